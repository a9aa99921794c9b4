#include "transceiver/engine/status_table.h"

#include <fmt/format.h>

namespace kvferry {

void StatusTable::Set(const TransferStatus& status) {
  metrics_.OnStatus(status);
  const bool terminal = IsTerminal(status.state);
  {
    MutexLock lock(mu_);
    auto it = statuses_.find(status.request_id);
    const bool was_live = it != statuses_.end() && !IsTerminal(it->second.state);
    live_ += int{!terminal} - int{was_live};
    statuses_[status.request_id] = status;
    if (terminal) reports_.push_back(status);
  }
  if (!terminal) return;
  ++ended_;
  cv_.notify_all();
}

Status StatusTable::Reserve(uint64_t request_id, std::string_view what) {
  MutexLock lock(mu_);
  auto [it, fresh] = statuses_.try_emplace(request_id);
  if (!fresh && !IsTerminal(it->second.state)) {
    return Status::InvalidArgument(fmt::format("request {} {}", request_id, what));
  }
  it->second = TransferStatus{request_id, TransferState::kInit, Status::Ok(), 0, 0};
  ++live_;
  return Status::Ok();
}

std::vector<TransferStatus> StatusTable::Poll(size_t at_least, Deadline deadline) {
  MutexLock lock(mu_);
  lock.WaitUntil(cv_, deadline, [&]() REQUIRES(mu_) { return reports_.size() >= at_least; });
  std::vector<TransferStatus> out(reports_.begin(), reports_.end());
  reports_.clear();
  for (const TransferStatus& s : out) {
    auto it = statuses_.find(s.request_id);
    if (it != statuses_.end() && IsTerminal(it->second.state)) statuses_.erase(it);
  }
  return out;
}

StatusOr<TransferStatus> StatusTable::Query(uint64_t request_id) const {
  MutexLock lock(mu_);
  auto it = statuses_.find(request_id);
  if (it == statuses_.end()) {
    return Status::NotFound(
        fmt::format("request {} is unknown here (never seen, or already polled)", request_id));
  }
  return it->second;
}

}  // namespace kvferry
