#include "tools/kvferry/output.h"

#include <fmt/format.h>

#include <cstdio>
#include <map>

#include "kvferry/build_info.h"
#include "kvferry/ucx_info.h"

namespace kvferry::tools {

void AddOutputFlags(CLI::App* cmd, OutputFlags& flags) {
  auto* j =
      cmd->add_flag("--json", flags.json, "one JSON document on stdout (schema: docs/output.md)");
  auto* c = cmd->add_flag("--csv", flags.csv, "the result rows as CSV on stdout");
  j->excludes(c);
}

Document::Document(std::string command) {
  doc_["schema"] = kSchema;
  doc_["command"] = std::move(command);
  doc_["versions"] = VersionsJson();
  doc_["config"] = nlohmann::json::object();
  doc_["rows"] = nlohmann::json::array();
  doc_["summary"] = nlohmann::json::object();
  doc_["ok"] = true;
  doc_["error"] = nullptr;
}

void Document::SetResult(bool ok, const std::string& error) {
  doc_["ok"] = ok;
  if (!error.empty()) doc_["error"] = error;
}

namespace {

void Flatten(const nlohmann::json& v, const std::string& prefix,
             std::vector<std::pair<std::string, std::string>>& out) {
  if (v.is_object()) {
    for (const auto& [k, x] : v.items()) Flatten(x, prefix.empty() ? k : prefix + "." + k, out);
    return;
  }
  std::string text;
  if (v.is_array()) {
    for (size_t i = 0; i < v.size(); ++i) {
      if (i) text += ';';
      text += v[i].is_string() ? v[i].get<std::string>() : v[i].dump();
    }
  } else if (v.is_string()) {
    text = v.get<std::string>();
  } else if (!v.is_null()) {
    text = v.dump();
  }
  out.emplace_back(prefix, std::move(text));
}

std::string CsvField(const std::string& s) {
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  std::string q = "\"";
  for (char c : s) {
    if (c == '"') q += '"';
    q += c;
  }
  return q + "\"";
}

}  // namespace

void Document::Print(Format format) const {
  if (format == Format::kJson) {
    std::puts(doc_.dump().c_str());
    return;
  }
  if (format != Format::kCsv) return;
  std::vector<nlohmann::json> rows(doc_["rows"].begin(), doc_["rows"].end());
  if (rows.empty()) rows.push_back(doc_["summary"]);
  std::vector<std::string> columns;
  std::vector<std::map<std::string, std::string>> cells;
  for (const nlohmann::json& r : rows) {
    std::vector<std::pair<std::string, std::string>> flat;
    Flatten(r, "", flat);
    std::map<std::string, std::string> m;
    for (auto& [k, v] : flat) {
      if (std::find(columns.begin(), columns.end(), k) == columns.end()) columns.push_back(k);
      m[k] = std::move(v);
    }
    cells.push_back(std::move(m));
  }
  std::string out;
  for (size_t i = 0; i < columns.size(); ++i) out += (i ? "," : "") + CsvField(columns[i]);
  out += '\n';
  for (const auto& m : cells) {
    for (size_t i = 0; i < columns.size(); ++i) {
      auto it = m.find(columns[i]);
      out += (i ? "," : "") + CsvField(it == m.end() ? "" : it->second);
    }
    out += '\n';
  }
  std::fputs(out.c_str(), stdout);
}

nlohmann::json VersionsJson() {
  nlohmann::json j;
  j["kvferry"] = Version();
  for (const Feature& f : BuildFeatures()) {
    if (f.present) j["build"][f.name] = f.version.empty() ? "yes" : f.version;
  }
  auto ucx = QueryUcxRuntime();
  j["ucx_runtime"] = ucx.ok() ? nlohmann::json(ucx->version) : nlohmann::json(nullptr);
  return j;
}

nlohmann::json ShapeJson(const KvShape& s) {
  return {{"layers", s.layers},
          {"kv_heads", s.kv_heads},
          {"head_dim", s.head_dim},
          {"dtype", std::string(DTypeName(s.dtype))},
          {"kv_factor", s.kv_factor},
          {"tokens_per_block", s.tokens_per_block},
          {"bytes_per_token", s.BytesPerToken()}};
}

nlohmann::json ParallelJson(const ParallelConfig& p) {
  return {{"tp", p.tp}, {"pp", p.pp}, {"stage_layers", p.stage_layers}, {"dp", p.dp_size}};
}

namespace {
nlohmann::json HistogramJson(const LatencyHistogram& h) {
  return {{"count", h.count()},
          {"sum_s", h.sum()},
          {"p50_s", h.Quantile(0.5)},
          {"p99_s", h.Quantile(0.99)}};
}
}  // namespace

nlohmann::json MetricsJson(const TransceiverMetrics& m) {
  nlohmann::json errors = nlohmann::json::object();
  for (const auto& [code, n] : m.errors_by_code) errors[code] = n;
  return {{"side", m.side},
          {"transport", m.transport},
          {"data_path", m.data_path},
          {"requests_started", m.requests_started},
          {"requests",
           {{"complete", m.requests_complete},
            {"error", m.requests_error},
            {"timed_out", m.requests_timed_out},
            {"cancelled", m.requests_cancelled}}},
          {"errors_by_code", errors},
          {"bytes", m.bytes},
          {"chunks", m.chunks},
          {"busy_cpu_s", m.busy_cpu_seconds},
          {"request_latency", HistogramJson(m.request_latency)},
          {"chunk_latency", HistogramJson(m.chunk_latency)}};
}

nlohmann::json MetricsJson(const TieringMetrics& m) {
  nlohmann::json copies = nlohmann::json::array();
  for (const TierCopyMetrics& c : m.copies) {
    copies.push_back({{"from", c.from},
                      {"to", c.to},
                      {"batches", c.batches},
                      {"blocks", c.blocks},
                      {"bytes", c.bytes},
                      {"latency", HistogramJson(c.latency)}});
  }
  return {{"copies", copies},
          {"file_writes", m.file_writes},
          {"file_reads", m.file_reads},
          {"file_write_errors", m.file_write_errors},
          {"file_read_errors", m.file_read_errors}};
}

std::string TimelineText(const RequestTimeline& t) {
  auto at = [](double s) {
    return s < 0 ? std::string("never") : fmt::format("+{:.3f} ms", s * 1e3);
  };
  return fmt::format(
      "request {} {}: created, fetch {}, first byte {}, last byte {}, {} {} ({} chunks, {:.1f} "
      "KB)",
      t.request_id, t.state, at(t.fetch), at(t.first_byte), at(t.last_byte), t.state, at(t.end),
      t.chunks, t.bytes / 1e3);
}

}  // namespace kvferry::tools
