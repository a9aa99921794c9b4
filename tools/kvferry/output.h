// Tool output: every command prints one document. Text for people; with --json one JSON document
// (schema in docs/output.md: what ran, with which versions and configuration, the result rows and
// a summary); with --csv the rows as CSV (nested values flattened to dotted columns). Commands
// fill a Document and print it once at the end, so stdout holds nothing else.
#pragma once

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <string>

#include "kvferry/kv_model.h"
#include "kvferry/metrics.h"

namespace kvferry::tools {

enum class Format { kText, kJson, kCsv };

struct OutputFlags {
  bool json = false, csv = false;
  Format format() const { return json ? Format::kJson : csv ? Format::kCsv : Format::kText; }
  bool machine() const { return json || csv; }
};
// --json and --csv (mutually exclusive).
void AddOutputFlags(CLI::App* cmd, OutputFlags& flags);

class Document {
 public:
  static constexpr const char* kSchema = "kvferry-output/1";
  explicit Document(std::string command);
  nlohmann::json& config() { return doc_["config"]; }
  nlohmann::json& summary() { return doc_["summary"]; }
  nlohmann::json& doc() { return doc_; }
  void AddRow(nlohmann::json row) { doc_["rows"].push_back(std::move(row)); }
  void SetResult(bool ok, const std::string& error = "");
  // JSON: the document on one line. CSV: a header and one line per row (the summary as the only
  // row when there are none).
  void Print(Format format) const;

 private:
  nlohmann::json doc_;
};

// The library's version and build features, and the UCX found at run time (when built with it).
nlohmann::json VersionsJson();
nlohmann::json ShapeJson(const KvShape& shape);
nlohmann::json ParallelJson(const ParallelConfig& parallel);
nlohmann::json MetricsJson(const TransceiverMetrics& m);
nlohmann::json MetricsJson(const TieringMetrics& m);
// One line: "request 7 (generation rank 0): fetch +0.01 ms, first byte +0.20 ms, ..."
std::string TimelineText(const RequestTimeline& t);

}  // namespace kvferry::tools
