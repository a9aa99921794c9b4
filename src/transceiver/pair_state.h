// Where one (context rank, generation rank) pair of a request stands in the transfer protocol
// (docs/design.md, "Protocol"), as one value per pair and one table of the steps the protocol has,
// instead of flags (accepted, done_sent, completed_ack, closed, peer_ended) each path tests and
// sets on its own. Every protocol event of a pair goes through PairState::On, which says what the
// event does in the pair's phase; an event the protocol has no step for (a COMPLETE before this
// rank's DONE, a CHUNK after DONE, a CREDIT after DONE, a DONE after ABORT) is an error naming
// the event and the phase, which the side turns into the request's failure.
//
//   generation side (pair made by FETCH):
//     fetched   --ACCEPT--> accepted --DONE sent--> done --COMPLETE--> completed
//     fetched   --CHUNK--> accepted  (peer memory: the first CHUNK stands for ACCEPT)
//     fetched   --COMPLETE--> completed  (a pair with no chunks: nothing else answers it)
//     fetched, accepted --CHUNK saying complete--> completed  (one-sided without checksums:
//                          no DONE; in fetched it stands for ACCEPT with peer memory too)
//     accepted  --COMPLETE after its chunks--> completed  (the same pair, its last CHUNK sent on
//                          its own to free a staging slot)
//     fetched   --REJECT--> closed
//     fetched, accepted, done --ABORT / context rank lost--> closed
//     within accepted: CHUNK
//   context side (pair made when this rank accepts a FETCH):
//     accepted  --DONE--> done;  accepted, done --ABORT--> closed
//     accepted  --COMPLETE folded--> done  (its last CHUNK said complete: no DONE comes)
//     within accepted: CREDIT
// completed and closed are final. A message repeated by the transport (the same ACCEPT, DONE,
// COMPLETE, REJECT or ABORT again right after the first; the fault matrix's duplicate cells) is
// ignored, as is losing the context rank once its pair completed (it owes nothing more).
//
// Thread-compatible (each side's progress thread owns its pairs).
#pragma once

#include <cstdint>
#include <string_view>

#include "kvferry/status.h"

namespace kvferry {

enum class PairPhase : uint8_t {
  kFetched,    // generation: FETCH sent, no answer yet
  kAccepted,   // generation: ACCEPT received; context: FETCH accepted, chunks being sent
  kDone,       // generation: DONE sent; context: DONE received
  kCompleted,  // generation: COMPLETE received (final)
  kClosed,     // the peer refused, aborted or became unreachable (final)
};

enum class PairSide : uint8_t { kContext, kGeneration };

// What happens to a pair: a message it receives, or one of its own steps.
enum class PairEvent : uint8_t {
  kAccept,    // generation: ACCEPT received
  kCredit,    // context: CREDIT received
  kChunk,     // generation: CHUNK received
  kDoneSent,  // generation: every chunk of the pair is in place and DONE went out
  kDone,      // context: DONE received
  kComplete,  // generation: COMPLETE received
  kReject,    // generation: REJECT received
  kAbort,     // ABORT received
  kPeerLost,  // generation: the context rank became unreachable (one-sided path)
  // generation: a CHUNK saying complete received (the pair's last, messages.h ChunkMsg::complete)
  kChunkComplete,
  // context: the pair's last CHUNK went out saying complete (every pair's copies landed)
  kCompleteFolded,
  // generation: COMPLETE received by a pair whose last CHUNK would say complete but came on its
  // own, since its packed rows held a staging slot (wire version 11)
  kCompleteAfterChunks,
};

// What an event does in a phase.
enum class PairStep : uint8_t {
  kMove,     // the pair moves to a new phase; the caller acts on the event
  kWithin,   // the phase stays; the caller acts on the event (a CREDIT, a CHUNK)
  kIgnore,   // nothing to do: a repeated message, or nothing owed any more
  kIllegal,  // the protocol has no such step
};

struct PairTransition {
  PairStep step = PairStep::kIllegal;
  PairPhase next = PairPhase::kClosed;  // the phase after the event (kMove: the new one)
};

std::string_view PairPhaseName(PairPhase phase);
std::string_view PairEventName(PairEvent event);  // "ACCEPT", ..., "DONE sent", "peer lost"

// The table: what `event` does to a pair of `side` in phase `from`.
PairTransition PairNext(PairSide side, PairPhase from, PairEvent event);

class PairState {
 public:
  explicit PairState(PairSide side)
      : side_(side),
        phase_(side == PairSide::kContext ? PairPhase::kAccepted : PairPhase::kFetched) {}

  PairPhase phase() const { return phase_; }
  bool Is(PairPhase p) const { return phase_ == p; }
  bool final() const { return phase_ == PairPhase::kCompleted || phase_ == PairPhase::kClosed; }

  // Applies `event`: kMove, kWithin or kIgnore (see PairStep), or, when the protocol has no such
  // step, INVALID_ARGUMENT "<event> in phase <phase> of a <side> pair" with the phase unchanged.
  StatusOr<PairStep> On(PairEvent event);

 private:
  PairSide side_;
  PairPhase phase_;
};

}  // namespace kvferry
