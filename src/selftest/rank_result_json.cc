// A rank's result as the JSON document a rank process writes for the parent (selftest.h).
#include <nlohmann/json.hpp>

#include "selftest/selftest.h"
#include "selftest/timeline_json.h"

namespace kvferry {

nlohmann::json TimelineToJson(const RequestTimeline& t) {
  return {{"request_id", t.request_id},
          {"state", t.state},
          {"code", t.code},
          {"bytes", t.bytes},
          {"chunks", t.chunks},
          {"fetch_s", t.fetch},
          {"first_byte_s", t.first_byte},
          {"last_byte_s", t.last_byte},
          {"end_s", t.end}};
}

RequestTimeline TimelineFromJson(const nlohmann::json& s) {
  RequestTimeline t;
  t.request_id = s.value("request_id", uint64_t{0});
  t.state = s.value("state", std::string());
  t.code = s.value("code", std::string());
  t.bytes = s.value("bytes", int64_t{0});
  t.chunks = s.value("chunks", int64_t{0});
  t.fetch = s.value("fetch_s", -1.0);
  t.first_byte = s.value("first_byte_s", -1.0);
  t.last_byte = s.value("last_byte_s", -1.0);
  t.end = s.value("end_s", -1.0);
  return t;
}

std::string ResultToJson(const RankResult& r) {
  nlohmann::json j;
  j["context"] = r.context;
  j["rank"] = r.rank;
  j["requests"] = r.requests;
  j["verified"] = r.verified;
  j["failed"] = r.failed;
  j["prefix_hits"] = r.prefix_hits;
  j["warmup_overlap"] = r.warmup_overlap;
  j["bytes"] = r.bytes;
  j["seconds"] = r.seconds;
  j["cpu_seconds"] = r.cpu_seconds;
  j["control_cpu_seconds"] = r.control_cpu_seconds;
  j["control_cpu_warm_seconds"] = r.control_cpu_warm_seconds;
  j["thread_cpu_seconds"] = r.thread_cpu_seconds;
  j["thread_cpu_warm_seconds"] = r.thread_cpu_warm_seconds;
  j["warm_requests"] = r.warm_requests;
  j["warm_at_seconds"] = r.warm_at_seconds;
  j["profile"] = r.profile;
  j["profile_warm"] = r.profile_warm;
  j["latencies"] = r.latencies;
  j["baseline_gbps"] = r.baseline_gbps;
  j["baseline_name"] = r.baseline_name;
  j["copy_gbps"] = r.copy_gbps;
  j["copy_name"] = r.copy_name;
  j["errors"] = r.errors;
  j["fault_missed"] = r.fault_missed;
  j["leaked"] = r.leaked;
  j["data_path"] = r.data_path;
  if (r.slowest) j["slowest"] = TimelineToJson(*r.slowest);
  if (r.median) j["median"] = TimelineToJson(*r.median);
  return j.dump();
}

StatusOr<RankResult> ResultFromJson(const std::string& text) {
  auto j = nlohmann::json::parse(text, nullptr, false);
  if (j.is_discarded()) return Status::DataLoss("rank result is not JSON");
  RankResult r;
  r.context = j.value("context", false);
  r.rank = j.value("rank", 0);
  r.requests = j.value("requests", 0);
  r.verified = j.value("verified", 0);
  r.failed = j.value("failed", 0);
  r.prefix_hits = j.value("prefix_hits", 0);
  r.warmup_overlap = j.value("warmup_overlap", 0);
  r.bytes = j.value("bytes", int64_t{0});
  r.seconds = j.value("seconds", 0.0);
  r.cpu_seconds = j.value("cpu_seconds", 0.0);
  r.control_cpu_seconds = j.value("control_cpu_seconds", 0.0);
  r.control_cpu_warm_seconds = j.value("control_cpu_warm_seconds", 0.0);
  r.thread_cpu_seconds = j.value("thread_cpu_seconds", 0.0);
  r.thread_cpu_warm_seconds = j.value("thread_cpu_warm_seconds", 0.0);
  r.warm_requests = j.value("warm_requests", 0);
  r.warm_at_seconds = j.value("warm_at_seconds", 0.0);
  using Pairs = std::vector<std::pair<std::string, double>>;
  r.profile = j.value("profile", Pairs{});
  r.profile_warm = j.value("profile_warm", Pairs{});
  r.latencies = j.value("latencies", std::vector<double>{});
  r.baseline_gbps = j.value("baseline_gbps", 0.0);
  r.baseline_name = j.value("baseline_name", std::string());
  r.copy_gbps = j.value("copy_gbps", 0.0);
  r.copy_name = j.value("copy_name", std::string());
  r.errors = j.value("errors", std::vector<std::string>{});
  r.fault_missed = j.value("fault_missed", false);
  r.leaked = j.value("leaked", int64_t{0});
  r.data_path = j.value("data_path", std::string());
  if (j.contains("slowest")) r.slowest = TimelineFromJson(j["slowest"]);
  if (j.contains("median")) r.median = TimelineFromJson(j["median"]);
  return r;
}

}  // namespace kvferry
