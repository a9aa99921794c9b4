// PrometheusText: families in first-seen order, each with its HELP and TYPE once and all of its
// samples together (a histogram's series must not interleave with another family).
#include "kvferry/prometheus.h"

#include <fmt/format.h>

#include <cmath>
#include <string_view>
#include <vector>

namespace kvferry {
namespace {

std::string Escape(std::string_view v) {
  std::string out;
  for (char c : v) {
    if (c == '\\' || c == '"') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out;
}

std::string Number(double v) {
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  return fmt::format("{}", v);
}

using Labels = std::vector<std::pair<std::string_view, std::string>>;

std::string LabelText(const Labels& labels) {
  std::string out = "{";
  for (size_t i = 0; i < labels.size(); ++i) {
    if (i) out += ',';
    out += fmt::format("{}=\"{}\"", labels[i].first, Escape(labels[i].second));
  }
  return out + "}";
}

class Writer {
 public:
  void Sample(std::string_view name, std::string_view type, std::string_view help, double value,
              const Labels& labels, std::string_view suffix = "") {
    Family& f = Get(name, type, help);
    f.lines += fmt::format("{}{}{} {}\n", name, suffix, LabelText(labels), Number(value));
  }
  void Histogram(std::string_view name, std::string_view help, const LatencyHistogram& h,
                 Labels labels) {
    int64_t cum = 0;
    for (int i = 0; i <= LatencyHistogram::kBuckets; ++i) {
      cum += h.counts()[i];
      Labels l = labels;
      l.emplace_back("le", Number(LatencyHistogram::UpperBound(i)));
      Sample(name, "histogram", help, static_cast<double>(cum), l, "_bucket");
    }
    Sample(name, "histogram", help, h.sum(), labels, "_sum");
    Sample(name, "histogram", help, static_cast<double>(h.count()), labels, "_count");
  }
  std::string Text() const {
    std::string out;
    for (const Family& f : families_)
      out += fmt::format("# HELP {} {}\n# TYPE {} {}\n{}", f.name, f.help, f.name, f.type, f.lines);
    return out;
  }

 private:
  struct Family {
    std::string name, type, help, lines;
  };
  Family& Get(std::string_view name, std::string_view type, std::string_view help) {
    for (Family& f : families_) {
      if (f.name == name) return f;
    }
    families_.push_back(Family{std::string(name), std::string(type), std::string(help), ""});
    return families_.back();
  }
  std::vector<Family> families_;
};

void Render(Writer& w, const std::string& source, const TransceiverMetrics& m) {
  const Labels side{{"source", source}, {"side", m.side}, {"transport", m.transport}};
  auto with = [&](std::string_view k, std::string v) {
    Labels l = side;
    l.emplace_back(k, std::move(v));
    return l;
  };
  auto d = [](int64_t v) { return static_cast<double>(v); };
  w.Sample("kvferry_requests_started_total", "counter", "Requests started on this rank.",
           d(m.requests_started), side);
  const char* kRequests = "Requests ended, by terminal state.";
  w.Sample("kvferry_requests_total", "counter", kRequests, d(m.requests_complete),
           with("state", "complete"));
  w.Sample("kvferry_requests_total", "counter", kRequests, d(m.requests_error),
           with("state", "error"));
  w.Sample("kvferry_requests_total", "counter", kRequests, d(m.requests_timed_out),
           with("state", "timed-out"));
  w.Sample("kvferry_requests_total", "counter", kRequests, d(m.requests_cancelled),
           with("state", "cancelled"));
  for (const auto& [code, n] : m.errors_by_code) {
    w.Sample("kvferry_request_errors_total", "counter",
             "Requests that ended other than complete, by the status code of their reason.", d(n),
             with("code", code));
  }
  w.Sample("kvferry_live_requests", "gauge", "Requests not yet terminal (their blocks are leased).",
           d(m.live_requests), side);
  w.Sample("kvferry_transfer_bytes_total", "counter",
           "Payload bytes of ended requests, sent or received by this rank.", d(m.bytes),
           with("path", m.data_path));
  w.Sample("kvferry_transfer_seconds_total", "counter", "Durations of ended requests, summed.",
           m.request_seconds, with("path", m.data_path));
  w.Sample("kvferry_chunks_total", "counter", "Chunks in place.", d(m.chunks), side);
  w.Sample("kvferry_chunk_bytes_total", "counter", "Payload bytes of the chunks in place.",
           d(m.chunk_bytes), side);
  w.Sample("kvferry_staging_slots_in_use", "gauge", "Staging slots held by chunks in flight.",
           d(m.staging_slots_in_use), side);
  w.Sample("kvferry_staging_slots", "gauge", "Staging slots of this rank (the bound).",
           d(m.staging_slots), side);
  w.Sample("kvferry_command_queue", "gauge", "Public calls waiting for the progress thread.",
           d(m.command_queue), side);
  w.Sample("kvferry_progress_busy_cpu_seconds_total", "counter",
           "Progress-thread CPU time in iterations that did work.", m.busy_cpu_seconds, side);
  w.Histogram("kvferry_request_latency_seconds",
              "From mark_ready (context) or fetch (generation) to the terminal state.",
              m.request_latency, side);
  w.Histogram("kvferry_chunk_latency_seconds",
              "From a chunk's pack or posted receive to the chunk in place.", m.chunk_latency,
              side);
}

void Render(Writer& w, const std::string& source, const TieringMetrics& m) {
  for (const TierCopyMetrics& c : m.copies) {
    const Labels l{{"source", source}, {"from", c.from}, {"to", c.to}};
    w.Sample("kvferry_tier_copy_batches_total", "counter", "Copy batches between tiers.",
             static_cast<double>(c.batches), l);
    w.Sample("kvferry_tier_copy_blocks_total", "counter", "Blocks copied between tiers.",
             static_cast<double>(c.blocks), l);
    w.Sample("kvferry_tier_copy_bytes_total", "counter", "Bytes the copy streams moved.",
             static_cast<double>(c.bytes), l);
    w.Histogram("kvferry_tier_copy_latency_seconds",
                "A copy batch from submission to its completion as first observed.", c.latency, l);
  }
  const Labels src{{"source", source}};
  auto op = [&](const char* o) { return Labels{{"source", source}, {"op", o}}; };
  w.Sample("kvferry_file_ops_total", "counter", "File tier slot writes and reads.",
           static_cast<double>(m.file_writes), op("write"));
  w.Sample("kvferry_file_ops_total", "counter", "File tier slot writes and reads.",
           static_cast<double>(m.file_reads), op("read"));
  w.Sample("kvferry_file_errors_total", "counter", "File tier slot writes and reads that failed.",
           static_cast<double>(m.file_write_errors), op("write"));
  w.Sample("kvferry_file_errors_total", "counter", "File tier slot writes and reads that failed.",
           static_cast<double>(m.file_read_errors), op("read"));
  w.Sample("kvferry_file_jobs_queued", "gauge", "File batches waiting for or on the I/O thread.",
           static_cast<double>(m.file_jobs_queued), src);
}

void Render(Writer& w, const std::string& source, const BlockManagerStats& s) {
  static constexpr const char* kTiers[] = {"primary", "host", "file"};
  for (int t = 0; t < kNumTiers; ++t) {
    const Labels l{{"source", source}, {"tier", kTiers[t]}};
    w.Sample("kvferry_cached_blocks", "gauge", "Keyed blocks held, per tier.",
             static_cast<double>(s.cached[t]), l);
    w.Sample("kvferry_prefix_hits_total", "counter", "Prefix blocks found, per tier.",
             static_cast<double>(s.hits[t]), l);
    w.Sample("kvferry_dropped_blocks_total", "counter", "Cached blocks dropped, per tier.",
             static_cast<double>(s.dropped[t]), l);
  }
  const Labels src{{"source", source}};
  const std::pair<const char*, int64_t> counters[] = {{"lookups", s.lookups},
                                                      {"offloaded", s.offloaded},
                                                      {"demoted", s.demoted},
                                                      {"onboarded", s.onboarded},
                                                      {"partial_copies", s.partial_copies},
                                                      {"write_failures", s.write_failures},
                                                      {"corrupt_reads", s.corrupt_reads},
                                                      {"prefetched", s.prefetched}};
  for (const auto& [key, v] : counters) {
    w.Sample(fmt::format("kvferry_blocks_{}_total", key), "counter",
             fmt::format("BlockManager: {}.", key), static_cast<double>(v), src);
  }
  w.Sample("kvferry_free_blocks", "gauge", "Free blocks per pool.",
           static_cast<double>(s.free_primary), Labels{{"source", source}, {"tier", "primary"}});
  w.Sample("kvferry_free_blocks", "gauge", "Free blocks per pool.",
           static_cast<double>(s.free_host), Labels{{"source", source}, {"tier", "host"}});
  w.Sample("kvferry_tier_ops_in_flight", "gauge", "Copy and file batches not finished yet.",
           static_cast<double>(s.ops_in_flight), src);
}

}  // namespace

std::string PrometheusText(std::span<const MetricsSource> sources) {
  Writer w;
  for (const MetricsSource& s : sources)
    std::visit([&](const auto& m) { Render(w, s.name, m); }, s.metrics);
  return w.Text();
}

}  // namespace kvferry
