// PendingFetches: FETCHes a context rank received for requests it does not know yet (a generation
// rank may ask before this rank's MarkReady), kept with the CREDITs that follow them until the
// request is marked ready or its wait (transfer.unknown_request_wait_ms) runs out; and the SIBLING
// messages of other context ranks that got there first, likewise. Bounded: a peer sending
// messages for made-up ids can't grow it without bound. Used by the progress thread only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvferry/transport.h"
#include "transceiver/wire/messages.h"

namespace kvferry {

struct PendingFetch {
  PeerId from;
  FetchMsg fetch;
  std::vector<CreditMsg> credits;  // arrived before the request was known
  Deadline give_up;
};

struct PendingSibling {
  SiblingMsg msg;
  Deadline give_up;
};

class PendingFetches {
 public:
  static constexpr size_t kMaxFetches = 1024;
  static constexpr size_t kMaxCredits = 4096;  // per fetch
  static constexpr size_t kMaxSiblings = 4096;

  bool full() const { return list_.size() >= kMaxFetches; }
  void Add(PendingFetch f) { list_.push_back(std::move(f)); }
  // Keeps a CREDIT for the waiting fetch it belongs to (none: dropped).
  void AddCredit(PeerId from, const CreditMsg& c);
  // Keeps a SIBLING until `give_up` (dropped when kMaxSiblings are waiting).
  void AddSibling(const SiblingMsg& m, Deadline give_up);
  // The SIBLINGs of `request_id` (now known), in arrival order, removed from the list.
  std::vector<SiblingMsg> TakeSiblings(uint64_t request_id);
  // Forgets the fetch an ABORT names.
  void Drop(PeerId from, uint64_t request_id, uint32_t transfer_id);
  // The fetches of `request_id` (now known), in arrival order, removed from the list.
  std::vector<PendingFetch> Take(uint64_t request_id);
  // The fetches whose wait ran out by `now`, removed from the list.
  std::vector<PendingFetch> Expired(Clock::time_point now);

 private:
  template <typename Pred>
  std::vector<PendingFetch> Remove(Pred pred);

  std::vector<PendingFetch> list_;
  std::vector<PendingSibling> siblings_;
};

}  // namespace kvferry
