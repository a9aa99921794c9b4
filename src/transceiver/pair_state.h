// Where one (context rank, generation rank) pair of a request is in the transfer protocol
// (docs/design.md, "Protocol"), as one value per pair instead of a set of flags. PairState refuses
// the transitions the protocol does not have, so a late, repeated or forged message can't move a
// pair backwards or out of a final phase: the caller sees `false` and the phase is unchanged.
//
//   generation side: kFetched --ACCEPT--> kAccepted --all chunks in, DONE sent--> kDone
//                    --COMPLETE--> kCompleted;  REJECT / ABORT / peer unreachable: --> kClosed
//                    from any phase but kCompleted.
//   context side:    kAccepted (FETCH accepted: sending) --DONE--> kDone;  ABORT --> kClosed
//                    from kAccepted or kDone.
// kCompleted and kClosed are final. Thread-compatible (the progress thread owns its pairs).
#pragma once

#include <cstdint>
#include <string_view>

namespace kvferry {

enum class PairPhase : uint8_t {
  kFetched,    // generation: FETCH sent, no answer yet
  kAccepted,   // generation: ACCEPT received; context: FETCH accepted, chunks being sent
  kDone,       // generation: DONE sent; context: DONE received
  kCompleted,  // generation: COMPLETE received (final)
  kClosed,     // the peer refused, aborted or became unreachable (final)
};

enum class PairSide : uint8_t { kContext, kGeneration };

constexpr std::string_view PairPhaseName(PairPhase p) {
  switch (p) {
    case PairPhase::kFetched:
      return "fetched";
    case PairPhase::kAccepted:
      return "accepted";
    case PairPhase::kDone:
      return "done";
    case PairPhase::kCompleted:
      return "completed";
    case PairPhase::kClosed:
      return "closed";
  }
  return "?";
}

class PairState {
 public:
  explicit PairState(PairSide side)
      : side_(side),
        phase_(side == PairSide::kContext ? PairPhase::kAccepted : PairPhase::kFetched) {}

  PairPhase phase() const { return phase_; }
  bool Is(PairPhase p) const { return phase_ == p; }
  bool final() const { return phase_ == PairPhase::kCompleted || phase_ == PairPhase::kClosed; }

  // Moves to `next` when the protocol has that step from here; false (unchanged) otherwise.
  bool To(PairPhase next) {
    if (!Allowed(side_, phase_, next)) return false;
    phase_ = next;
    return true;
  }

  static constexpr bool Allowed(PairSide side, PairPhase from, PairPhase to) {
    using P = PairPhase;
    if (side == PairSide::kContext) {
      return (from == P::kAccepted && (to == P::kDone || to == P::kClosed)) ||
             (from == P::kDone && to == P::kClosed);
    }
    switch (from) {
      case P::kFetched:
        return to == P::kAccepted || to == P::kClosed;
      case P::kAccepted:
        return to == P::kDone || to == P::kClosed;
      case P::kDone:
        return to == P::kCompleted || to == P::kClosed;
      case P::kCompleted:
      case P::kClosed:
        return false;
    }
    return false;
  }

 private:
  PairSide side_;
  PairPhase phase_;
};

}  // namespace kvferry
