// Summarize: the control-plane CPU and the profile of the measured requests leave out what a
// rank spent before its warm-up requests ended (connections, first peer mappings).
#include <gtest/gtest.h>

#include "selftest/selftest.h"

namespace kvferry {
namespace {

RankResult Rank(bool context, double control, double warm, int warm_requests,
                std::vector<std::pair<std::string, double>> profile = {},
                std::vector<std::pair<std::string, double>> profile_warm = {}) {
  RankResult r;
  r.context = context;
  r.requests = 11;
  r.verified = context ? 0 : 11;
  r.control_cpu_seconds = control;
  r.control_cpu_warm_seconds = warm;
  r.warm_requests = warm_requests;
  r.seconds = 2.0;
  r.warm_at_seconds = 1.0;
  r.profile = std::move(profile);
  r.profile_warm = std::move(profile_warm);
  return r;
}

TEST(SelftestSummary, ControlCpuPerRequestLeavesOutTheWarmUp) {
  SelftestConfig cfg;
  cfg.requests = 11;
  cfg.warmup = 1;
  // Each rank: 0.010 s of set-up in its one warm-up request, then 10 requests of 50 us.
  const std::vector<RankResult> ranks = {Rank(true, 0.0105, 0.010, 1),
                                         Rank(false, 0.0105, 0.010, 1)};
  const SelftestSummary s = Summarize(cfg, ranks);
  EXPECT_NEAR(s.control_cpu_us_per_request, 100, 1e-6);  // 2 ranks x 50 us
  EXPECT_NEAR(s.control_cpu_with_warmup_us_per_request, 0.021 / 11 * 1e6, 1e-6);
}

// A stopped long run (`--requests 1000000`, as cli.no_orphans_* start) counts its completed
// requests without overflowing: verified pairs x requests passes 2^31 (UBSan found it in CI).
TEST(SelftestSummary, CompletedRequestsOfALongStoppedRunDoNotOverflow) {
  SelftestConfig cfg;
  cfg.shape = KvShape{2, 2, 16, DType::kBf16, 2, 8};  // a valid split: one generation rank
  cfg.ctx = ParallelConfig{2, 1, {}, 1, 0};
  cfg.gen = ParallelConfig{1, 1, {}, 1, 0};
  cfg.requests = 1000000;
  RankResult gen = Rank(false, 0, 0, 1);
  gen.requests = 2513;
  gen.verified = 2513;
  gen.failed = 1;
  const SelftestSummary s = Summarize(cfg, {Rank(true, 0, 0, 1), gen});
  EXPECT_EQ(s.completed, 2513);
  EXPECT_EQ(s.failed, 1000000 - 2513);
}

// All progress-thread CPU (idle polling too) is measured the same way, from its own counters.
TEST(SelftestSummary, ThreadCpuPerRequestLeavesOutTheWarmUp) {
  SelftestConfig cfg;
  cfg.requests = 11;
  cfg.warmup = 1;
  std::vector<RankResult> ranks = {Rank(true, 0.0105, 0.010, 1), Rank(false, 0.0105, 0.010, 1)};
  // 0.020 s before warm, then 10 requests of 300 us (context) and 200 us (generation).
  ranks[0].thread_cpu_warm_seconds = ranks[1].thread_cpu_warm_seconds = 0.020;
  ranks[0].thread_cpu_seconds = 0.023;
  ranks[1].thread_cpu_seconds = 0.022;
  const SelftestSummary s = Summarize(cfg, ranks);
  EXPECT_NEAR(s.thread_cpu_us_per_request, 500, 1e-6);
  EXPECT_NEAR(s.control_cpu_us_per_request, 100, 1e-6);
}

TEST(SelftestSummary, ProfileIsPerMeasuredRequestAndCopyBusyPerWallTime) {
  SelftestConfig cfg;
  cfg.requests = 11;
  const std::vector<RankResult> ranks = {
      Rank(true, 1, 0, 1, {{"advance_cpu_s", 0.0012}, {"batches", 21}, {"copy_busy_s", 0.9}},
           {{"advance_cpu_s", 0.0002}, {"batches", 1}, {"copy_busy_s", 0.1}}),
      Rank(false, 1, 0, 1, {{"commands_cpu_s", 0.0005}}, {})};
  const SelftestSummary s = Summarize(cfg, ranks);
  ASSERT_EQ(s.profile.size(), 2u);
  EXPECT_EQ(s.profile[0].first, "context");
  auto get = [](const auto& values, const std::string& name) {
    for (const auto& [n, v] : values) {
      if (n == name) return v;
    }
    return -1.0;
  };
  EXPECT_NEAR(get(s.profile[0].second, "advance_cpu_us"), 100, 1e-6);  // 1 ms over 10 requests
  EXPECT_NEAR(get(s.profile[0].second, "batches"), 2, 1e-9);
  EXPECT_NEAR(get(s.profile[0].second, "copy_busy"), 0.8, 1e-9);  // 0.8 s of the last 1 s
  EXPECT_EQ(s.profile[1].first, "generation");
  EXPECT_NEAR(get(s.profile[1].second, "commands_cpu_us"), 50, 1e-6);
}

RequestTimeline Timeline(std::string state, double fetch, double first, double last, double end) {
  RequestTimeline t;
  t.state = std::move(state);
  t.fetch = fetch;
  t.first_byte = first;
  t.last_byte = last;
  t.end = end;
  t.bytes = 100;
  t.chunks = 2;
  return t;
}

TEST(SelftestSummary, MedianTimelineCountsEachPhaseFromTheFetch) {
  EXPECT_FALSE(MedianTimeline({}).has_value());
  // Only complete, fetched timelines count; a phase never reached is left out of its median.
  auto m = MedianTimeline(
      {Timeline("complete", 1.0, 1.2, 1.3, 1.5), Timeline("complete", 5.0, 5.1, 5.4, 5.6),
       Timeline("complete", 0.0, -1, -1, 0.9), Timeline("error", 0.0, 0.1, 0.2, 9.0),
       Timeline("complete", -1, -1, -1, 9.0)});
  ASSERT_TRUE(m.has_value());
  EXPECT_EQ(m->fetch, 0);
  EXPECT_NEAR(m->first_byte, 0.2, 1e-9);  // of 0.2, 0.1
  EXPECT_NEAR(m->last_byte, 0.4, 1e-9);   // of 0.3, 0.4
  EXPECT_NEAR(m->end, 0.6, 1e-9);         // of 0.5, 0.6, 0.9
  EXPECT_EQ(m->bytes, 100);
  EXPECT_EQ(m->chunks, 2);
  EXPECT_FALSE(MedianTimeline({Timeline("complete", -1, -1, -1, 1)}).has_value());
  auto none = MedianTimeline({Timeline("complete", 0, -1, -1, 1)});
  ASSERT_TRUE(none.has_value());
  EXPECT_EQ(none->first_byte, -1);
}

}  // namespace
}  // namespace kvferry
