// Staging-slot and pooled-event leases (transceiver/leases.h) and the per-pair protocol state
// (transceiver/pair_state.h).
#include "transceiver/leases.h"

#include <gtest/gtest.h>

#include <deque>
#include <set>

#include "transceiver/pair_state.h"

namespace kvferry {
namespace {

// An operation as the sides hold them: a slot and an event leased for its lifetime.
struct Op {
  SlotLease slot;
  EventLease event;
};

class FakeEvent final : public Event {
 public:
  bool Query() override { return true; }
  Status Synchronize(Deadline) override { return Status::Ok(); }
};

EventPool MakeEvents(int& made) {
  return EventPool([&made]() -> StatusOr<std::unique_ptr<Event>> {
    ++made;
    return std::unique_ptr<Event>(new FakeEvent());
  });
}

TEST(SlotLease, EverySlotOnceThenEmpty) {
  SlotPool pool(3);
  std::set<int> got;
  std::vector<SlotLease> held;
  for (int i = 0; i < 3; ++i) {
    held.push_back(pool.Acquire());
    ASSERT_TRUE(held.back());
    got.insert(held.back().index());
  }
  EXPECT_EQ(got, (std::set<int>{0, 1, 2}));
  EXPECT_EQ(pool.in_use(), 3);
  SlotLease none = pool.Acquire();
  EXPECT_FALSE(none);
  EXPECT_EQ(none.index(), -1);
  none.Reset();  // an empty lease returns nothing
  EXPECT_EQ(pool.free(), 0u);
  held.clear();
  EXPECT_EQ(pool.in_use(), 0);
  EXPECT_EQ(pool.free(), 3u);
}

TEST(SlotLease, ReturnedExactlyOnceOnEveryPath) {
  SlotPool pool(4);
  {  // complete: returned when the chunk is done, the later destruction returns nothing more
    Op op{pool.Acquire(), {}};
    op.slot.Reset();
    EXPECT_EQ(pool.in_use(), 0);
    op.slot.Reset();
    EXPECT_EQ(pool.free(), 4u);
  }
  EXPECT_EQ(pool.free(), 4u);
  {  // abort: the request's operations are dropped with it
    std::deque<Op> inflight;
    for (int i = 0; i < 3; ++i) inflight.push_back(Op{pool.Acquire(), {}});
    EXPECT_EQ(pool.in_use(), 3);
    inflight.clear();
    EXPECT_EQ(pool.in_use(), 0);
  }
  {  // error: the operation that failed to start never reaches the in-flight list
    auto start = [&]() -> Status {
      Op op{pool.Acquire(), {}};
      EXPECT_EQ(pool.in_use(), 1);
      return Status::Unavailable("send failed");
    };
    EXPECT_FALSE(start().ok());
    EXPECT_EQ(pool.in_use(), 0);
  }
  {  // moves: the duty moves with the lease; move-assigning over a held lease returns that one
    SlotLease a = pool.Acquire();
    SlotLease b = pool.Acquire();
    const int ia = a.index();
    SlotLease c = std::move(a);
    EXPECT_FALSE(a);  // NOLINT(bugprone-use-after-move): moved-from is empty by contract
    EXPECT_EQ(c.index(), ia);
    EXPECT_EQ(pool.in_use(), 2);
    c = std::move(b);  // returns ia
    EXPECT_EQ(pool.in_use(), 1);
    EXPECT_TRUE(c);
  }
  EXPECT_EQ(pool.in_use(), 0);
  EXPECT_EQ(pool.free(), 4u);
  // Nothing came back twice: four distinct slots are out again.
  std::vector<SlotLease> all;
  std::set<int> ids;
  for (int i = 0; i < 4; ++i) {
    all.push_back(pool.Acquire());
    ids.insert(all.back().index());
  }
  EXPECT_EQ(ids.size(), 4u);
  EXPECT_FALSE(pool.Acquire());
}

TEST(EventLease, ReusedAndReturnedExactlyOnce) {
  int made = 0;
  EventPool pool = MakeEvents(made);
  Event* first = nullptr;
  {
    EventLease e = pool.Acquire();
    ASSERT_TRUE(e);
    first = e.get();
    EXPECT_EQ(pool.out(), 1u);
  }  // destruction returns it
  EXPECT_EQ(pool.out(), 0u);
  EventLease again = pool.Acquire();
  EXPECT_EQ(again.get(), first);  // reused, not made anew
  EXPECT_EQ(made, 1);
  EventLease second = pool.Acquire();
  EXPECT_NE(second.get(), first);
  EXPECT_EQ(made, 2);
  again.Reset();
  again.Reset();
  EXPECT_EQ(pool.out(), 1u);
  EventLease moved = std::move(second);
  EXPECT_EQ(pool.out(), 1u);
  moved = EventLease();
  EXPECT_EQ(pool.out(), 0u);
  EXPECT_EQ(pool.made(), 2u);
}

TEST(EventLease, EmptyWhenNoneCanBeMade) {
  EventPool pool(
      []() -> StatusOr<std::unique_ptr<Event>> { return Status::ResourceExhausted("no events"); });
  EventLease e = pool.Acquire();
  EXPECT_FALSE(e);
  EXPECT_EQ(pool.out(), 0u);
}

TEST(PairState, GenerationWalksForwardOnly) {
  PairState s(PairSide::kGeneration);
  EXPECT_TRUE(s.Is(PairPhase::kFetched));
  EXPECT_FALSE(s.To(PairPhase::kDone));       // DONE before ACCEPT
  EXPECT_FALSE(s.To(PairPhase::kCompleted));  // COMPLETE before our DONE is void
  EXPECT_TRUE(s.To(PairPhase::kAccepted));
  EXPECT_FALSE(s.To(PairPhase::kAccepted));  // a repeated ACCEPT
  EXPECT_FALSE(s.To(PairPhase::kFetched));   // never backwards
  EXPECT_TRUE(s.To(PairPhase::kDone));
  EXPECT_TRUE(s.To(PairPhase::kCompleted));
  EXPECT_TRUE(s.final());
  EXPECT_FALSE(s.To(PairPhase::kClosed));  // an ABORT after COMPLETE changes nothing
  EXPECT_TRUE(s.Is(PairPhase::kCompleted));
}

TEST(PairState, ClosedIsFinalFromAnyOpenPhase) {
  for (PairPhase at : {PairPhase::kFetched, PairPhase::kAccepted, PairPhase::kDone}) {
    PairState s(PairSide::kGeneration);
    if (at != PairPhase::kFetched) {
      ASSERT_TRUE(s.To(PairPhase::kAccepted));
    }
    if (at == PairPhase::kDone) {
      ASSERT_TRUE(s.To(PairPhase::kDone));
    }
    ASSERT_TRUE(s.Is(at));
    EXPECT_TRUE(s.To(PairPhase::kClosed)) << PairPhaseName(at);
    for (PairPhase next : {PairPhase::kFetched, PairPhase::kAccepted, PairPhase::kDone,
                           PairPhase::kCompleted, PairPhase::kClosed}) {
      EXPECT_FALSE(s.To(next)) << "closed -> " << PairPhaseName(next);
    }
    EXPECT_TRUE(s.Is(PairPhase::kClosed));
  }
}

TEST(PairState, ContextSide) {
  PairState s(PairSide::kContext);
  EXPECT_TRUE(s.Is(PairPhase::kAccepted));
  EXPECT_FALSE(s.To(PairPhase::kCompleted));  // the context side sends COMPLETE, never gets one
  EXPECT_FALSE(s.To(PairPhase::kFetched));
  EXPECT_TRUE(s.To(PairPhase::kDone));
  EXPECT_FALSE(s.To(PairPhase::kDone));   // a repeated DONE
  EXPECT_TRUE(s.To(PairPhase::kClosed));  // ABORT after DONE
  EXPECT_FALSE(s.To(PairPhase::kDone));   // DONE after ABORT
  EXPECT_TRUE(s.Is(PairPhase::kClosed));
  PairState t(PairSide::kContext);
  EXPECT_TRUE(t.To(PairPhase::kClosed));  // ABORT while sending
  EXPECT_TRUE(t.final());
}

// The table, exhaustively: exactly the transitions the header draws.
TEST(PairState, TransitionTable) {
  using P = PairPhase;
  const P all[] = {P::kFetched, P::kAccepted, P::kDone, P::kCompleted, P::kClosed};
  std::set<std::pair<P, P>> gen = {{P::kFetched, P::kAccepted}, {P::kFetched, P::kClosed},
                                   {P::kAccepted, P::kDone},    {P::kAccepted, P::kClosed},
                                   {P::kDone, P::kCompleted},   {P::kDone, P::kClosed}};
  std::set<std::pair<P, P>> ctx = {
      {P::kAccepted, P::kDone}, {P::kAccepted, P::kClosed}, {P::kDone, P::kClosed}};
  for (P from : all) {
    for (P to : all) {
      EXPECT_EQ(PairState::Allowed(PairSide::kGeneration, from, to), gen.count({from, to}) == 1)
          << "generation " << PairPhaseName(from) << " -> " << PairPhaseName(to);
      EXPECT_EQ(PairState::Allowed(PairSide::kContext, from, to), ctx.count({from, to}) == 1)
          << "context " << PairPhaseName(from) << " -> " << PairPhaseName(to);
    }
  }
}

}  // namespace
}  // namespace kvferry
