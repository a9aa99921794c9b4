// transfer.profile (progress_profile.h) and the peer-memory completion tracker: the copy meter
// counts the time a stream had work once, however completions are observed; PeerCompletions
// queries events only up to the first batch still copying; a side's metrics carry the profile
// only with the knob on.
#include "transceiver/progress_profile.h"

#include <gtest/gtest.h>

#include "transceiver/context_side_peer.h"
#include "transceiver/transceiver_test_cluster.h"

namespace kvferry {
namespace {

using namespace txtest;  // NOLINT: the shared harness

double Value(const std::vector<std::pair<std::string, double>>& v, const std::string& name) {
  for (const auto& [n, x] : v) {
    if (n == name) return x;
  }
  ADD_FAILURE() << name << " is not in the profile";
  return -1;
}

TEST(ProgressProfile, OffRecordsNothing) {
  ProgressProfile p(false);
  { ProfileScope s(&p, ProfilePhase::kAdvance); }
  p.Count(ProfileCounter::kBatches);
  p.Landed(p.Launched(10), 20);
  EXPECT_TRUE(p.Snapshot().empty());
}

TEST(ProgressProfile, CopyMeterCountsQueuedTimeOnceWhateverTheOrderObserved) {
  ProgressProfile p(true);
  const uint64_t a = p.Launched(0), b = p.Launched(10), c = p.Launched(20);
  p.Landed(b, 50);  // observed before a: nothing folds until a is known
  EXPECT_EQ(Value(p.Snapshot(), "copy_busy_s"), 0);
  p.Landed(a, 40);
  p.Landed(c, 100);
  EXPECT_DOUBLE_EQ(Value(p.Snapshot(), "copy_busy_s"), 100e-9);  // [0, 100): one busy stretch
  p.Landed(p.Launched(200), 250);                                // idle [100, 200) not counted
  EXPECT_DOUBLE_EQ(Value(p.Snapshot(), "copy_busy_s"), 150e-9);
  p.Count(ProfileCounter::kBatches, 4);
  { ProfileScope s(&p, ProfilePhase::kPlan); }
  EXPECT_EQ(Value(p.Snapshot(), "batches"), 4);
  EXPECT_GE(Value(p.Snapshot(), "plan_cpu_s"), 0);
}

class FakeEvent final : public Event {
 public:
  explicit FakeEvent(int* queries) : queries_(queries) {}
  bool Query() override {
    ++*queries_;
    return done;
  }
  Status Synchronize(Deadline) override { return Status::Ok(); }
  bool done = false;

 private:
  int* queries_;
};

TEST(PeerCompletions, PollQueriesOnlyUpToTheFirstBatchStillCopying) {
  int queries = 0;
  std::vector<FakeEvent*> events;
  EventPool pool([&]() -> StatusOr<std::unique_ptr<Event>> {
    auto e = std::make_unique<FakeEvent>(&queries);
    events.push_back(e.get());
    return std::unique_ptr<Event>(std::move(e));
  });
  PeerCompletions c(nullptr);
  for (int i = 0; i < 16; ++i) EXPECT_EQ(c.Add(pool.Acquire()), static_cast<uint64_t>(i));
  EXPECT_FALSE(c.Poll());
  EXPECT_EQ(queries, 1) << "one query speaks for 16 batches on one stream";
  events[0]->done = events[1]->done = true;
  events[5]->done = true;  // a stream can't finish 5 before 2; polling stops at 2 anyway
  queries = 0;
  EXPECT_TRUE(c.Poll());
  EXPECT_EQ(queries, 3);
  EXPECT_TRUE(c.Finished(0));
  EXPECT_TRUE(c.Finished(1));
  EXPECT_FALSE(c.Finished(2));
  EXPECT_EQ(c.copying(), 14u);
  EXPECT_EQ(pool.out(), 14u) << "finished batches give their events back";
}

// A batch is not queried before its bytes could have moved at kPeerCopyBytesPerNs since it
// could have started (enqueued, or after the last query that saw the batch before it copying).
TEST(PeerCompletions, PollDoesNotQueryABatchBeforeItCanHaveFinished) {
  int queries = 0;
  std::vector<FakeEvent*> events;
  EventPool pool([&]() -> StatusOr<std::unique_ptr<Event>> {
    auto e = std::make_unique<FakeEvent>(&queries);
    events.push_back(e.get());
    return std::unique_ptr<Event>(std::move(e));
  });
  PeerCompletions c(nullptr);
  const int64_t hour = kPeerCopyBytesPerNs * int64_t{3600} * 1000000000;  // an hour's bytes
  EXPECT_EQ(c.Add(pool.Acquire(), 0), 0u);
  EXPECT_EQ(c.Add(pool.Acquire(), hour), 1u);
  events[0]->done = events[1]->done = true;
  EXPECT_TRUE(c.Poll());
  EXPECT_EQ(queries, 1) << "the second batch cannot have moved an hour's bytes yet";
  EXPECT_TRUE(c.Finished(0));
  EXPECT_FALSE(c.Finished(1));
  EXPECT_FALSE(c.Poll());
  EXPECT_EQ(queries, 1);
  // A small batch behind it is not queried either: the stream finishes in order.
  EXPECT_EQ(c.Add(pool.Acquire(), 1), 2u);
  EXPECT_FALSE(c.Poll());
  EXPECT_EQ(queries, 1);
  // Small batches are queried at once, as before.
  PeerCompletions small(nullptr);
  EXPECT_EQ(small.Add(pool.Acquire(), 4096), 0u);
  events.back()->done = true;
  EXPECT_TRUE(small.Poll());
  EXPECT_EQ(queries, 2);
}

class KnobOn {
 public:
  KnobOn(const char* name, const char* value) : name_(name) {
    EXPECT_TRUE(Config::Global().Set(name, value).ok());
  }
  ~KnobOn() { EXPECT_TRUE(Config::Global().Reset(name_).ok()); }

 private:
  const char* name_;
};

TEST(ProgressProfile, SidesReportPhasesOnlyWithTheKnob) {
  KnobOn peer("transfer.peer_memory", "on");
  for (const bool on : {false, true}) {
    KnobOn knob("transfer.profile", on ? "true" : "false");
    Cluster cl({Shape(), {1, 1, {}, 1, 0}}, {Shape(), {1, 1, {}, 1, 0}}, SmallChunks(true));
    auto h = cl.Publish(41, {3, 4, 9}, 11);
    ASSERT_TRUE(cl.Fetch(h, {0, 5, 6}).ok());
    ExpectAllComplete(cl.Drain(0, 0, 1), 2);
    const auto ctx = cl.ctx_[0]->metrics().profile, gen = cl.gen_[0]->metrics().profile;
    if (!on) {
      EXPECT_TRUE(ctx.empty());
      EXPECT_TRUE(gen.empty());
      continue;
    }
    EXPECT_GT(Value(ctx, "batches"), 0);
    EXPECT_GT(Value(ctx, "busy_iterations"), 0);
    EXPECT_GT(Value(ctx, "control_sent"), 0);   // ACCEPT, CHUNK, COMPLETE
    EXPECT_GT(Value(gen, "control_sent"), 0);   // FETCH, DONE
    EXPECT_GT(Value(ctx, "advance_cpu_s"), 0);  // the copies were launched there
  }
}

}  // namespace
}  // namespace kvferry
