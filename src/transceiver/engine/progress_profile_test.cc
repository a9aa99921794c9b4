// transfer.profile (progress_profile.h) and the peer-memory completion tracker: the copy meter
// counts the time a stream had work once, however completions are observed; PeerCompletions
// queries events only up to the first batch still copying; a side's metrics carry the profile
// only with the knob on.
#include "transceiver/engine/progress_profile.h"

#include <gtest/gtest.h>

#include "testing/transceiver_test_cluster.h"
#include "transceiver/paths/peer_copies.h"

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

// An event pool lending FakeEvents, each kept in `events` and counting its queries in `queries`.
struct FakeEventPool {
  int queries = 0;
  std::vector<FakeEvent*> events;
  EventPool pool{[this]() -> StatusOr<std::unique_ptr<Event>> {
    auto e = std::make_unique<FakeEvent>(&queries);
    events.push_back(e.get());
    return std::unique_ptr<Event>(std::move(e));
  }};
};

TEST(PeerCompletions, PollQueriesOnlyUpToTheFirstBatchStillCopying) {
  FakeEventPool fake;
  auto& [queries, events, pool] = fake;
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
  FakeEventPool fake;
  auto& [queries, events, pool] = fake;
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

// A stream that copies nothing and counts its launches (CopyBatch calls) and their descriptors.
class CountingStream final : public Stream {
 public:
  Status Copy(void*, const void*, size_t) override { return Status::Ok(); }
  Status CopyBatch(std::span<const CopyDesc> copies) override {
    launches.push_back(copies.size());
    return fail ? Status::Internal("copy failed") : Status::Ok();
  }
  Status Copy2D(void*, size_t, const void*, size_t, size_t, size_t) override {
    return Status::Ok();
  }
  Status Fill(void*, uint8_t, size_t) override { return Status::Ok(); }
  Status HostCallback(std::function<void()> fn) override {
    fn();
    return Status::Ok();
  }
  Status Record(Event&) override { return Status::Ok(); }
  Status Wait(Event&) override { return Status::Ok(); }
  Status Synchronize(Deadline) override { return Status::Ok(); }
  bool Query() override { return true; }
  std::vector<size_t> launches;  // descriptors per CopyBatch
  bool fail = false;
};

// transfer.peer_hold_launches: batches of several requests found while two launches are on the
// stream wait and go out as one launch once the stream drains to one; a request that ends while
// its batches wait takes them out; full launches go at once; 0 launches every batch at once.
TEST(PeerLaunch, BatchesOfManyRequestsWaitWhileTwoLaunchesAreQueuedThenGoAsOne) {
  FakeEventPool fake;
  auto& [queries, events, pool] = fake;
  CountingStream stream;
  PeerCompletions c(nullptr);
  PeerLaunch launch(c, /*max_bytes=*/1000, nullptr, /*hold_launches=*/2);
  const std::vector<CopyDesc> one(1), two(2);
  EXPECT_FALSE(launch.due());  // nothing waits
  // An idle stream: the first request's batch goes at once.
  EXPECT_EQ(launch.Add(1, one, 100), 0u);
  EXPECT_TRUE(launch.due());
  ASSERT_TRUE(launch.Flush(stream, pool).ok());
  // One launch on the stream: the next still goes (it queues behind, the stream never idles).
  EXPECT_EQ(launch.Add(2, one, 100), 1u);
  EXPECT_TRUE(launch.due());
  ASSERT_TRUE(launch.Flush(stream, pool).ok());
  // Two on the stream: requests 3, 4 and 5 wait, over several iterations.
  EXPECT_EQ(launch.Add(3, two, 100), 2u);
  EXPECT_FALSE(launch.due());
  EXPECT_EQ(launch.Add(4, one, 100), 2u);
  EXPECT_EQ(launch.Add(5, one, 100), 2u);
  EXPECT_EQ(launch.Add(4, one, 100), 2u);
  EXPECT_EQ(launch.owners(), (std::vector<uint64_t>{3, 4, 5}));
  EXPECT_FALSE(launch.due());
  launch.Discard(5);  // request 5 ended while waiting: its copies never go out
  EXPECT_EQ(launch.owners(), (std::vector<uint64_t>{3, 4}));
  EXPECT_FALSE(c.Poll());
  EXPECT_FALSE(launch.due());
  events[0]->done = true;  // the first launch finished: one left copying
  EXPECT_TRUE(c.Poll());
  EXPECT_TRUE(launch.due());
  ASSERT_TRUE(launch.Flush(stream, pool).ok());
  EXPECT_EQ(stream.launches, (std::vector<size_t>{1, 1, 4}))
      << "requests 3 and 4 in one launch of their 4 copies, request 5's left out";
  EXPECT_TRUE(launch.empty());
  EXPECT_EQ(c.copying(), 2u);
  // A full launch goes even with two on the stream.
  EXPECT_EQ(launch.Add(6, one, 999), 3u);
  EXPECT_FALSE(launch.due());
  launch.Add(6, one, 1);
  EXPECT_TRUE(launch.full());
  EXPECT_TRUE(launch.due());
  // A failed launch leaves nothing waiting and adds nothing to the stream's count.
  stream.fail = true;
  EXPECT_FALSE(launch.Flush(stream, pool).ok());
  EXPECT_TRUE(launch.empty());
  EXPECT_EQ(c.copying(), 2u);
  // hold_launches 0: whatever is on the stream, a batch goes at once.
  PeerLaunch eager(c, 1000, nullptr, 0);
  eager.Add(7, one, 1);
  EXPECT_TRUE(eager.due());
}

// With hold_launches > 0, a launch whose every request still awaits another pair's FETCH waits
// while anything copies, and goes once the stream is idle, once it is full, or once some request
// in it has all its pairs; hold_launches 0 never waits.
TEST(PeerLaunch, BatchesOfRequestsAwaitingPairsWaitWhileTheStreamCopies) {
  FakeEventPool fake;
  auto& [queries, events, pool] = fake;
  CountingStream stream;
  PeerCompletions c(nullptr);
  PeerLaunch launch(c, /*max_bytes=*/1000, nullptr, /*hold_launches=*/2);
  const std::vector<CopyDesc> one(1);
  const auto awaiting = [](uint64_t) { return true; };  // every request awaits another pair
  const auto complete = [](uint64_t) { return false; };
  launch.Add(1, one, 100);
  EXPECT_TRUE(launch.due(awaiting)) << "an idle stream: nothing to wait for";
  ASSERT_TRUE(launch.Flush(stream, pool).ok());
  ASSERT_EQ(c.copying(), 1u);
  launch.Add(2, one, 100);
  EXPECT_FALSE(launch.due(awaiting)) << "request 2 awaits its other pair while request 1 copies";
  EXPECT_TRUE(launch.due(complete)) << "a request with all its pairs here goes";
  events[0]->done = true;
  EXPECT_TRUE(c.Poll());
  ASSERT_EQ(c.copying(), 0u);
  EXPECT_TRUE(launch.due(awaiting)) << "the stream went idle";
  ASSERT_TRUE(launch.Flush(stream, pool).ok());
  ASSERT_EQ(c.copying(), 1u);
  launch.Add(3, one, 1000);
  EXPECT_TRUE(launch.due(awaiting)) << "a full launch goes";
  PeerLaunch eager(c, 1000, nullptr, /*hold_launches=*/0);
  eager.Add(4, one, 1);
  EXPECT_TRUE(eager.due(awaiting));
  EXPECT_EQ(stream.launches, (std::vector<size_t>{1, 1}));
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
