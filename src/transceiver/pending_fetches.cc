#include "transceiver/pending_fetches.h"

#include <algorithm>

namespace kvferry {

void PendingFetches::AddCredit(PeerId from, const CreditMsg& c) {
  for (PendingFetch& pf : list_) {
    if (pf.from == from && pf.fetch.request_id == c.request_id &&
        pf.fetch.transfer_id == c.transfer_id && pf.credits.size() < kMaxCredits) {
      pf.credits.push_back(c);
    }
  }
}

void PendingFetches::AddSibling(const SiblingMsg& m, Deadline give_up) {
  std::erase_if(siblings_, [&](const PendingSibling& ps) { return ps.give_up <= Clock::now(); });
  if (siblings_.size() < kMaxSiblings) siblings_.push_back(PendingSibling{m, give_up});
}

std::vector<SiblingMsg> PendingFetches::TakeSiblings(uint64_t request_id) {
  std::vector<SiblingMsg> out;
  std::erase_if(siblings_, [&](PendingSibling& ps) {
    if (ps.msg.request_id != request_id) return false;
    out.push_back(std::move(ps.msg));
    return true;
  });
  return out;
}

void PendingFetches::Drop(PeerId from, uint64_t request_id, uint32_t transfer_id) {
  std::erase_if(list_, [&](const PendingFetch& pf) {
    return pf.from == from && pf.fetch.request_id == request_id &&
           pf.fetch.transfer_id == transfer_id;
  });
}

template <typename Pred>
std::vector<PendingFetch> PendingFetches::Remove(Pred pred) {
  std::vector<PendingFetch> out;
  for (auto it = list_.begin(); it != list_.end();) {
    if (pred(*it)) {
      out.push_back(std::move(*it));
      it = list_.erase(it);
    } else {
      ++it;
    }
  }
  return out;
}

std::vector<PendingFetch> PendingFetches::Take(uint64_t request_id) {
  return Remove([&](const PendingFetch& pf) { return pf.fetch.request_id == request_id; });
}

std::vector<PendingFetch> PendingFetches::Expired(Clock::time_point now) {
  return Remove([&](const PendingFetch& pf) { return now >= pf.give_up; });
}

}  // namespace kvferry
