// Summarize (selftest.h): the aggregate over all ranks that the command prints, with its
// measured-request parts: the control-plane CPU and the transfer.profile rows of the requests
// after each rank's warm-up (the set-up those carry left out).
#include <fmt/format.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "selftest/selftest.h"

namespace kvferry {

namespace {

// A rank's share of one request in the measured part of the run: its measured requests scaled to
// all it took part in, over the run's requests (with one DP group, 1 / measured requests).
double MeasuredWeight(const SelftestConfig& cfg, const RankResult& r) {
  const int measured = r.requests - r.warm_requests;
  if (measured <= 0 || cfg.requests <= 0) return 0;
  return static_cast<double>(r.requests) / measured / cfg.requests;
}

}  // namespace

double MeasuredCpu(const SelftestConfig& cfg, const std::vector<RankResult>& ranks,
                   double RankResult::*total, double RankResult::*warm) {
  double per_request = 0;
  for (const RankResult& r : ranks) per_request += (r.*total - r.*warm) * MeasuredWeight(cfg, r);
  return per_request;
}

static double Lookup(const std::vector<std::pair<std::string, double>>& values,
                     const std::string& name) {
  for (const auto& [n, v] : values) {
    if (n == name) return v;
  }
  return 0;
}

// transfer.profile per side over the measured requests (SelftestSummary::profile).
std::vector<std::pair<std::string, std::vector<std::pair<std::string, double>>>> MeasuredProfile(
    const SelftestConfig& cfg, const std::vector<RankResult>& ranks) {
  std::vector<std::pair<std::string, std::vector<std::pair<std::string, double>>>> out;
  for (const bool context : {true, false}) {
    std::vector<std::pair<std::string, double>> sums;
    double busy_sum = 0, busy_min = 1e300;
    int metered = 0;
    for (const RankResult& r : ranks) {
      if (r.context != context || r.profile.empty()) continue;
      const double w = MeasuredWeight(cfg, r);
      for (const auto& [name, value] : r.profile) {
        const double v = (value - Lookup(r.profile_warm, name)) * w;
        if (name == "copy_busy_s") continue;
        const bool cpu = name.size() > 6 && name.ends_with("_cpu_s");
        const std::string key = cpu ? name.substr(0, name.size() - 2) + "_us" : name;
        auto it =
            std::find_if(sums.begin(), sums.end(), [&](const auto& e) { return e.first == key; });
        if (it == sums.end()) it = sums.insert(sums.end(), {key, 0.0});
        it->second += cpu ? v * 1e6 : v;
      }
      const double wall = r.seconds - r.warm_at_seconds;
      if (context && wall > 0) {
        const double busy =
            (Lookup(r.profile, "copy_busy_s") - Lookup(r.profile_warm, "copy_busy_s")) / wall;
        busy_sum += busy;
        busy_min = std::min(busy_min, busy);
        ++metered;
      }
    }
    if (sums.empty()) continue;
    if (metered > 0) {
      sums.emplace_back("copy_busy", busy_sum / metered);
      sums.emplace_back("copy_busy_min", busy_min);
    }
    out.emplace_back(context ? "context" : "generation", std::move(sums));
  }
  return out;
}

std::optional<RequestTimeline> MedianTimeline(const std::vector<RequestTimeline>& timelines) {
  std::vector<double> first, last, end, bytes, chunks;
  for (const RequestTimeline& t : timelines) {
    if (t.state != "complete" || t.fetch < 0) continue;
    if (t.first_byte >= 0) first.push_back(t.first_byte - t.fetch);
    if (t.last_byte >= 0) last.push_back(t.last_byte - t.fetch);
    end.push_back(t.end - t.fetch);
    bytes.push_back(static_cast<double>(t.bytes));
    chunks.push_back(static_cast<double>(t.chunks));
  }
  if (end.empty()) return std::nullopt;
  auto median = [](std::vector<double>& v) {
    if (v.empty()) return -1.0;
    auto mid = v.begin() + static_cast<ptrdiff_t>(v.size() / 2);
    std::nth_element(v.begin(), mid, v.end());
    return *mid;
  };
  RequestTimeline m;
  m.state = "complete";
  m.code = "OK";
  m.fetch = 0;
  m.first_byte = median(first);
  m.last_byte = median(last);
  m.end = median(end);
  m.bytes = static_cast<int64_t>(median(bytes));
  m.chunks = static_cast<int64_t>(median(chunks));
  return m;
}

SelftestSummary Summarize(const SelftestConfig& cfg, const std::vector<RankResult>& ranks) {
  SelftestSummary s;
  s.requests = cfg.requests;
  std::vector<double> lat;
  double cpu = 0, control_cpu = 0;
  // A request is verified when every generation rank of its decoding group verified it: count
  // per rank and compare with the number of (request, rank) pairs expected.
  int expected_pairs = 0, verified_pairs = 0, failed_pairs = 0;
  for (int i = 0; i < cfg.requests; ++i) {
    expected_pairs += static_cast<int>(GroupRanks(cfg.shape, cfg.gen, i % cfg.gen.dp_size).size());
  }
  for (const RankResult& r : ranks) {
    cpu += r.cpu_seconds;
    control_cpu += r.control_cpu_seconds;
    // Every rank is heard: its first errors, and its last (why it stopped, when it gave up).
    const char* side = r.context ? "context" : "generation";
    s.fault_missed |= r.fault_missed;
    s.leaked += r.leaked;
    for (size_t i = 0; i < r.errors.size(); ++i) {
      if (i < 3 || i + 1 == r.errors.size())
        s.errors.push_back(fmt::format("{} rank {}: {}", side, r.rank, r.errors[i]));
      else if (i == 3)
        s.errors.push_back(fmt::format("{} rank {}: ({} more)", side, r.rank, r.errors.size() - 4));
    }
    // Context rank 0 measured the baselines and generation rank 0 heard them: either says
    // (a generation instance started alone has only the latter).
    if (r.baseline_gbps > 0 && (r.context || s.baseline_gbps == 0)) {
      s.baseline_gbps = r.baseline_gbps;
      s.baseline_name = r.baseline_name;
      s.copy_gbps = r.copy_gbps;
      s.copy_name = r.copy_name;
    }
    if (r.context) {
      if (r.failed) s.failed = std::max(s.failed, r.failed);
      continue;
    }
    s.bytes += r.bytes;
    s.prefix_hits += r.prefix_hits;
    s.warmup_overlap += r.warmup_overlap;
    if (!r.data_path.empty() && s.data_path.find(r.data_path) == std::string::npos)
      s.data_path += (s.data_path.empty() ? "" : "+") + r.data_path;
    s.seconds = std::max(s.seconds, r.seconds);
    verified_pairs += r.verified;
    failed_pairs += r.failed;
    lat.insert(lat.end(), r.latencies.begin(), r.latencies.end());
  }
  s.completed =
      (verified_pairs == expected_pairs && failed_pairs == 0)
          ? cfg.requests
          : static_cast<int>(std::min<int64_t>(
                cfg.requests, int64_t{verified_pairs} * cfg.requests /
                                  std::max(1, expected_pairs)));  // --requests 1000000: 64 bits
  s.verified = cfg.verify ? s.completed : 0;
  s.failed = std::max(s.failed, cfg.requests - s.completed);
  s.gbps = s.seconds > 0 ? s.bytes / s.seconds / 1e9 : 0;
  std::sort(lat.begin(), lat.end());
  auto pct = [&](double p) {
    return lat.empty() ? 0.0
                       : lat[std::min(lat.size() - 1, static_cast<size_t>(p * lat.size()))] * 1e3;
  };
  s.p50_ms = pct(0.5);
  s.p90_ms = pct(0.9);
  s.p99_ms = pct(0.99);
  s.cpu_us_per_request = cpu / cfg.requests * 1e6;
  s.control_cpu_with_warmup_us_per_request = control_cpu / cfg.requests * 1e6;
  s.control_cpu_us_per_request = MeasuredCpu(cfg, ranks, &RankResult::control_cpu_seconds,
                                             &RankResult::control_cpu_warm_seconds) *
                                 1e6;
  s.thread_cpu_us_per_request = MeasuredCpu(cfg, ranks, &RankResult::thread_cpu_seconds,
                                            &RankResult::thread_cpu_warm_seconds) *
                                1e6;
  s.profile = MeasuredProfile(cfg, ranks);
  return s;
}

}  // namespace kvferry
