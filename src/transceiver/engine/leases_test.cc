// Staging-slot and pooled-event leases (transceiver/engine/leases.h) and the per-pair protocol
// state (transceiver/pair_state.h).
#include "transceiver/engine/leases.h"

#include <gtest/gtest.h>

#include <deque>
#include <map>
#include <set>
#include <string>

#include "transceiver/pair_state.h"

namespace kvferry {
namespace {

// An operation as the sides hold them: a slot and an event leased for its lifetime.
struct Op {
  StagingLease slot;
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

TEST(StagingLease, EverySlotOnceThenEmpty) {
  StagingPool pool(3);
  std::set<int> got;
  std::vector<StagingLease> held;
  for (int i = 0; i < 3; ++i) {
    held.push_back(pool.Acquire());
    ASSERT_TRUE(held.back());
    got.insert(held.back().index());
  }
  EXPECT_EQ(got, (std::set<int>{0, 1, 2}));
  EXPECT_EQ(pool.in_use(), 3);
  StagingLease none = pool.Acquire();
  EXPECT_FALSE(none);
  EXPECT_EQ(none.index(), -1);
  none.Reset();  // an empty lease returns nothing
  EXPECT_EQ(pool.free(), 0u);
  held.clear();
  EXPECT_EQ(pool.in_use(), 0);
  EXPECT_EQ(pool.free(), 3u);
}

TEST(StagingLease, ReturnedExactlyOnceOnEveryPath) {
  StagingPool pool(4);
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
    StagingLease a = pool.Acquire();
    StagingLease b = pool.Acquire();
    const int ia = a.index();
    StagingLease c = std::move(a);
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
  std::vector<StagingLease> all;
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

using P = PairPhase;
using E = PairEvent;
constexpr P kPhases[] = {P::kFetched, P::kAccepted, P::kDone, P::kCompleted, P::kClosed};
constexpr E kEvents[] = {E::kAccept,   E::kCredit,        E::kChunk,         E::kDoneSent,
                         E::kDone,     E::kComplete,      E::kReject,        E::kAbort,
                         E::kPeerLost, E::kChunkComplete, E::kCompleteFolded};

TEST(PairState, GenerationWalksForwardOnly) {
  PairState s(PairSide::kGeneration);
  EXPECT_TRUE(s.Is(P::kFetched));
  EXPECT_FALSE(s.On(E::kCredit).ok());  // a context-side event
  EXPECT_EQ(*s.On(E::kAccept), PairStep::kMove);
  auto early = s.On(E::kComplete);  // COMPLETE before our DONE
  ASSERT_FALSE(early.ok());
  EXPECT_EQ(early.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(early.status().message(),
            "COMPLETE in phase accepted of a generation pair: the protocol has no such step");
  EXPECT_TRUE(s.Is(P::kAccepted)) << "an illegal event changed the phase";
  EXPECT_EQ(*s.On(E::kAccept), PairStep::kIgnore);  // the transport delivered it twice
  EXPECT_EQ(*s.On(E::kChunk), PairStep::kWithin);
  EXPECT_FALSE(s.On(E::kReject).ok());  // a FETCH once accepted is not refused
  EXPECT_EQ(*s.On(E::kDoneSent), PairStep::kMove);
  EXPECT_FALSE(s.On(E::kChunk).ok());  // every chunk was in place
  EXPECT_EQ(*s.On(E::kComplete), PairStep::kMove);
  EXPECT_TRUE(s.final());
  EXPECT_EQ(*s.On(E::kComplete), PairStep::kIgnore);
  EXPECT_EQ(*s.On(E::kPeerLost), PairStep::kIgnore);  // it owes nothing more
  EXPECT_FALSE(s.On(E::kAbort).ok());
  EXPECT_TRUE(s.Is(P::kCompleted));
}

// Wire version 7: a peer-memory pair's first CHUNK stands for its ACCEPT. Version 8: a pair with
// no chunks is answered by COMPLETE alone (it sends no DONE), or by REJECT.
TEST(PairState, GenerationSkipsAcceptWhenNoneIsSent) {
  PairState peer(PairSide::kGeneration);
  EXPECT_EQ(*peer.On(E::kChunk), PairStep::kMove);
  EXPECT_TRUE(peer.Is(P::kAccepted));
  EXPECT_EQ(*peer.On(E::kChunk), PairStep::kWithin);
  EXPECT_EQ(*peer.On(E::kDoneSent), PairStep::kMove);
  EXPECT_EQ(*peer.On(E::kComplete), PairStep::kMove);
  EXPECT_TRUE(peer.Is(P::kCompleted));

  PairState empty(PairSide::kGeneration);
  EXPECT_FALSE(empty.On(E::kDoneSent).ok());  // DONE follows an answer
  EXPECT_EQ(*empty.On(E::kComplete), PairStep::kMove);
  EXPECT_TRUE(empty.Is(P::kCompleted));
  EXPECT_FALSE(empty.On(E::kReject).ok());  // no REJECT after COMPLETE

  PairState refused(PairSide::kGeneration);
  EXPECT_EQ(*refused.On(E::kReject), PairStep::kMove);
  EXPECT_TRUE(refused.Is(P::kClosed));
}

TEST(PairState, ClosedIsFinalFromAnyOpenPhase) {
  for (E closing : {E::kAbort, E::kPeerLost}) {
    for (P at : {P::kFetched, P::kAccepted, P::kDone}) {
      PairState s(PairSide::kGeneration);
      if (at != P::kFetched) {
        ASSERT_EQ(*s.On(E::kAccept), PairStep::kMove);
      }
      if (at == P::kDone) {
        ASSERT_EQ(*s.On(E::kDoneSent), PairStep::kMove);
      }
      ASSERT_TRUE(s.Is(at));
      EXPECT_EQ(*s.On(closing), PairStep::kMove) << PairPhaseName(at);
      EXPECT_TRUE(s.Is(P::kClosed));
      for (E next : kEvents) {
        auto step = s.On(next);
        EXPECT_TRUE(!step.ok() || *step == PairStep::kIgnore)
            << "closed: " << PairEventName(next) << " acted on";
      }
      EXPECT_TRUE(s.Is(P::kClosed));
    }
  }
  PairState rejected(PairSide::kGeneration);
  EXPECT_EQ(*rejected.On(E::kReject), PairStep::kMove);
  EXPECT_EQ(*rejected.On(E::kReject), PairStep::kIgnore);
  EXPECT_TRUE(rejected.Is(P::kClosed));
}

TEST(PairState, ContextSide) {
  PairState s(PairSide::kContext);
  EXPECT_TRUE(s.Is(P::kAccepted));
  EXPECT_EQ(*s.On(E::kCredit), PairStep::kWithin);
  EXPECT_FALSE(s.On(E::kComplete).ok());  // the context side sends COMPLETE, never gets one
  EXPECT_EQ(*s.On(E::kDone), PairStep::kMove);
  EXPECT_EQ(*s.On(E::kDone), PairStep::kIgnore);  // a repeated DONE
  auto late = s.On(E::kCredit);
  ASSERT_FALSE(late.ok());
  EXPECT_EQ(late.status().message(),
            "CREDIT in phase done of a context pair: the protocol has no such step");
  EXPECT_EQ(*s.On(E::kAbort), PairStep::kMove);  // ABORT after DONE
  EXPECT_FALSE(s.On(E::kDone).ok());             // DONE after ABORT
  EXPECT_EQ(*s.On(E::kAbort), PairStep::kIgnore);
  EXPECT_TRUE(s.Is(P::kClosed));
}

// The table, exhaustively: exactly the steps pair_state.h draws, every other one illegal.
TEST(PairState, TransitionTable) {
  using Key = std::tuple<P, E>;
  const std::map<Key, PairTransition> gen = {
      {{P::kFetched, E::kAccept}, {PairStep::kMove, P::kAccepted}},
      {{P::kFetched, E::kReject}, {PairStep::kMove, P::kClosed}},
      {{P::kFetched, E::kAbort}, {PairStep::kMove, P::kClosed}},
      {{P::kFetched, E::kPeerLost}, {PairStep::kMove, P::kClosed}},
      {{P::kFetched, E::kChunkComplete}, {PairStep::kMove, P::kCompleted}},
      {{P::kFetched, E::kChunk}, {PairStep::kMove, P::kAccepted}},
      {{P::kFetched, E::kComplete}, {PairStep::kMove, P::kCompleted}},
      {{P::kAccepted, E::kAccept}, {PairStep::kIgnore, P::kAccepted}},
      {{P::kAccepted, E::kChunk}, {PairStep::kWithin, P::kAccepted}},
      {{P::kAccepted, E::kDoneSent}, {PairStep::kMove, P::kDone}},
      {{P::kAccepted, E::kChunkComplete}, {PairStep::kMove, P::kCompleted}},
      {{P::kAccepted, E::kAbort}, {PairStep::kMove, P::kClosed}},
      {{P::kAccepted, E::kPeerLost}, {PairStep::kMove, P::kClosed}},
      {{P::kDone, E::kComplete}, {PairStep::kMove, P::kCompleted}},
      {{P::kDone, E::kAbort}, {PairStep::kMove, P::kClosed}},
      {{P::kDone, E::kPeerLost}, {PairStep::kMove, P::kClosed}},
      {{P::kCompleted, E::kComplete}, {PairStep::kIgnore, P::kCompleted}},
      {{P::kCompleted, E::kPeerLost}, {PairStep::kIgnore, P::kCompleted}},
      {{P::kCompleted, E::kChunkComplete}, {PairStep::kIgnore, P::kCompleted}},
      {{P::kClosed, E::kReject}, {PairStep::kIgnore, P::kClosed}},
      {{P::kClosed, E::kAbort}, {PairStep::kIgnore, P::kClosed}},
      {{P::kClosed, E::kPeerLost}, {PairStep::kIgnore, P::kClosed}},
  };
  const std::map<Key, PairTransition> ctx = {
      {{P::kAccepted, E::kCredit}, {PairStep::kWithin, P::kAccepted}},
      {{P::kAccepted, E::kDone}, {PairStep::kMove, P::kDone}},
      {{P::kAccepted, E::kAbort}, {PairStep::kMove, P::kClosed}},
      {{P::kAccepted, E::kCompleteFolded}, {PairStep::kMove, P::kDone}},
      {{P::kDone, E::kDone}, {PairStep::kIgnore, P::kDone}},
      {{P::kDone, E::kAbort}, {PairStep::kMove, P::kClosed}},
      {{P::kClosed, E::kAbort}, {PairStep::kIgnore, P::kClosed}},
  };
  for (auto [side, table] : {std::pair{PairSide::kGeneration, &gen}, {PairSide::kContext, &ctx}}) {
    for (P from : kPhases) {
      for (E event : kEvents) {
        const PairTransition got = PairNext(side, from, event);
        auto it = table->find({from, event});
        const std::string where = std::string(side == PairSide::kContext ? "context " : "gen ") +
                                  std::string(PairPhaseName(from)) + " + " +
                                  std::string(PairEventName(event));
        if (it == table->end()) {
          EXPECT_EQ(got.step, PairStep::kIllegal) << where;
        } else {
          EXPECT_EQ(got.step, it->second.step) << where;
          EXPECT_EQ(got.next, it->second.next) << where;
        }
      }
    }
  }
}

}  // namespace
}  // namespace kvferry
