// Metrics snapshots as dicts, request timelines, and the Prometheus text (kvferry/prometheus.h:
// one renderer for the CLI, C++ and Python).
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <chrono>

#include "bindings.h"
#include "kvferry/prometheus.h"

namespace kvferry::py {
namespace {

nb::dict HistogramDict(const LatencyHistogram& h) {
  nb::list buckets;
  int64_t cum = 0;
  for (int i = 0; i <= LatencyHistogram::kBuckets; ++i) {
    cum += h.counts()[i];
    buckets.append(nb::make_tuple(LatencyHistogram::UpperBound(i), cum));
  }
  nb::dict d;
  d["buckets"] = buckets;  // (upper bound seconds, cumulative count)
  d["sum"] = h.sum();
  d["count"] = h.count();
  d["p50"] = h.Quantile(0.5);
  d["p99"] = h.Quantile(0.99);
  return d;
}

}  // namespace

nb::dict MetricsDict(const TransceiverMetrics& m) {
  nb::dict requests, errors, d;
  requests["complete"] = m.requests_complete;
  requests["error"] = m.requests_error;
  requests["timed-out"] = m.requests_timed_out;
  requests["cancelled"] = m.requests_cancelled;
  for (const auto& [code, n] : m.errors_by_code) errors[code.c_str()] = n;
  d["kind"] = m.side;
  d["transport"] = m.transport;
  d["data_path"] = m.data_path;
  d["requests_started"] = m.requests_started;
  d["requests"] = requests;
  d["errors"] = errors;
  d["live_requests"] = m.live_requests;
  d["bytes"] = m.bytes;
  d["request_seconds"] = m.request_seconds;
  d["chunks"] = m.chunks;
  d["chunk_bytes"] = m.chunk_bytes;
  d["staging_slots_in_use"] = m.staging_slots_in_use;
  d["staging_slots"] = m.staging_slots;
  d["command_queue"] = m.command_queue;
  d["busy_cpu_seconds"] = m.busy_cpu_seconds;
  d["latency_seconds"] = HistogramDict(m.request_latency);
  d["chunk_latency_seconds"] = HistogramDict(m.chunk_latency);
  return d;
}

nb::dict MetricsDict(const TieringMetrics& m) {
  nb::list copies;
  for (const TierCopyMetrics& c : m.copies) {
    nb::dict x;
    x["from"] = c.from;
    x["to"] = c.to;
    x["batches"] = c.batches;
    x["blocks"] = c.blocks;
    x["bytes"] = c.bytes;
    x["latency_seconds"] = HistogramDict(c.latency);
    copies.append(x);
  }
  nb::dict d;
  d["kind"] = "transfer_manager";
  d["copies"] = copies;
  d["file_writes"] = m.file_writes;
  d["file_write_errors"] = m.file_write_errors;
  d["file_reads"] = m.file_reads;
  d["file_read_errors"] = m.file_read_errors;
  d["file_jobs_queued"] = m.file_jobs_queued;
  return d;
}

nb::dict TimelineDict(const RequestTimeline& t) {
  nb::dict d;
  d["request_id"] = t.request_id;
  d["state"] = t.state;
  d["code"] = t.code;
  d["bytes"] = t.bytes;
  d["chunks"] = t.chunks;
  d["created"] =
      std::chrono::duration<double>(t.created.time_since_epoch()).count();  // Unix seconds
  d["fetch"] = t.fetch;
  d["first_byte"] = t.first_byte;
  d["last_byte"] = t.last_byte;
  d["end"] = t.end;
  return d;
}

void BindMetrics(nb::module_& m) {
  nb::class_<MetricsSource>(m, "MetricsSource",
                            "A named metrics snapshot (from an object's _metrics_source(name)).")
      .def_ro("name", &MetricsSource::name);
  m.def(
      "_prometheus_text",
      [](const std::vector<MetricsSource>& sources) { return PrometheusText(sources); },
      nb::arg("sources"), "The sources in the Prometheus text format 0.0.4.");
}

}  // namespace kvferry::py
