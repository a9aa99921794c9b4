#include "transceiver/pair_state.h"

#include <fmt/format.h>

namespace kvferry {

std::string_view PairPhaseName(PairPhase phase) {
  switch (phase) {
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

std::string_view PairEventName(PairEvent event) {
  switch (event) {
    case PairEvent::kAccept:
      return "ACCEPT";
    case PairEvent::kCredit:
      return "CREDIT";
    case PairEvent::kChunk:
      return "CHUNK";
    case PairEvent::kDoneSent:
      return "DONE sent";
    case PairEvent::kDone:
      return "DONE";
    case PairEvent::kComplete:
      return "COMPLETE";
    case PairEvent::kReject:
      return "REJECT";
    case PairEvent::kAbort:
      return "ABORT";
    case PairEvent::kPeerLost:
      return "peer lost";
    case PairEvent::kChunkComplete:
      return "CHUNK (complete)";
    case PairEvent::kCompleteFolded:
      return "COMPLETE folded into CHUNK";
    case PairEvent::kCompleteAfterChunks:
      return "COMPLETE after the last CHUNK";
  }
  return "?";
}

namespace {

constexpr PairTransition Move(PairPhase next) { return {PairStep::kMove, next}; }
constexpr PairTransition Stay(PairStep step, PairPhase at) { return {step, at}; }

PairTransition GenerationNext(PairPhase from, PairEvent event) {
  using P = PairPhase;
  using E = PairEvent;
  const PairTransition illegal = Stay(PairStep::kIllegal, from);
  const PairTransition ignore = Stay(PairStep::kIgnore, from);
  switch (event) {
    case E::kAccept:
      if (from == P::kFetched) return Move(P::kAccepted);
      return from == P::kAccepted ? ignore : illegal;
    case E::kChunk:  // in phase fetched it stands for ACCEPT (peer memory)
      if (from == P::kFetched) return Move(P::kAccepted);
      return from == P::kAccepted ? Stay(PairStep::kWithin, from) : illegal;
    case E::kChunkComplete:  // in phase fetched it stands for ACCEPT (peer memory) too
      if (from == P::kFetched || from == P::kAccepted) return Move(P::kCompleted);
      return from == P::kCompleted ? ignore : illegal;
    case E::kDoneSent:
      return from == P::kAccepted ? Move(P::kDone) : illegal;
    case E::kComplete:  // in phase fetched: a pair with no chunks, which only COMPLETE answers
      if (from == P::kDone || from == P::kFetched) return Move(P::kCompleted);
      return from == P::kCompleted ? ignore : illegal;
    case E::kCompleteAfterChunks:
      if (from == P::kAccepted) return Move(P::kCompleted);
      return from == P::kCompleted ? ignore : illegal;
    case E::kReject:
      if (from == P::kFetched) return Move(P::kClosed);
      return from == P::kClosed ? ignore : illegal;
    case E::kAbort:
      if (from == P::kFetched || from == P::kAccepted || from == P::kDone) return Move(P::kClosed);
      return from == P::kClosed ? ignore : illegal;
    case E::kPeerLost:
      if (from == P::kFetched || from == P::kAccepted || from == P::kDone) return Move(P::kClosed);
      return ignore;  // completed: it owes nothing more; closed: already known
    case E::kCredit:
    case E::kDone:
    case E::kCompleteFolded:
      return illegal;  // context-side events
  }
  return illegal;
}

PairTransition ContextNext(PairPhase from, PairEvent event) {
  using P = PairPhase;
  using E = PairEvent;
  const PairTransition illegal = Stay(PairStep::kIllegal, from);
  const PairTransition ignore = Stay(PairStep::kIgnore, from);
  switch (event) {
    case E::kCredit:
      return from == P::kAccepted ? Stay(PairStep::kWithin, from) : illegal;
    case E::kDone:
      if (from == P::kAccepted) return Move(P::kDone);
      return from == P::kDone ? ignore : illegal;
    case E::kAbort:
      if (from == P::kAccepted || from == P::kDone) return Move(P::kClosed);
      return from == P::kClosed ? ignore : illegal;
    case E::kCompleteFolded:
      return from == P::kAccepted ? Move(P::kDone) : illegal;
    case E::kAccept:
    case E::kChunk:
    case E::kDoneSent:
    case E::kComplete:
    case E::kReject:
    case E::kPeerLost:
    case E::kChunkComplete:
    case E::kCompleteAfterChunks:
      return illegal;  // generation-side events
  }
  return illegal;
}

}  // namespace

PairTransition PairNext(PairSide side, PairPhase from, PairEvent event) {
  return side == PairSide::kContext ? ContextNext(from, event) : GenerationNext(from, event);
}

StatusOr<PairStep> PairState::On(PairEvent event) {
  const PairTransition t = PairNext(side_, phase_, event);
  if (t.step == PairStep::kIllegal) {
    return Status::InvalidArgument(fmt::format(
        "{} in phase {} of a {} pair: the protocol has no such step", PairEventName(event),
        PairPhaseName(phase_), side_ == PairSide::kContext ? "context" : "generation"));
  }
  phase_ = t.next;
  return t.step;
}

}  // namespace kvferry
