#include "selftest/handle_prefetch.h"

#include <algorithm>

namespace kvferry {

HandlePrefetch::HandlePrefetch(std::unique_ptr<Rendezvous> rv, std::vector<uint64_t> ids,
                               size_t depth)
    : rv_(std::move(rv)), ids_(std::move(ids)), depth_(std::max<size_t>(depth, 1)) {
  thread_ = std::thread([this] { Run(); });
}

HandlePrefetch::~HandlePrefetch() {
  {
    MutexLock lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

std::optional<std::vector<std::byte>> HandlePrefetch::Take(size_t i,
                                                           std::chrono::microseconds wait) {
  std::optional<std::vector<std::byte>> out;
  {
    MutexLock lock(mu_);
    lock.WaitFor(cv_, wait, [&]() REQUIRES(mu_) { return ready_.count(i) > 0; });
    auto it = ready_.find(i);
    if (it == ready_.end()) return out;
    out = std::move(it->second);
    ready_.erase(it);
    taken_ = i + 1;
  }
  cv_.notify_all();  // room for one more ahead
  return out;
}

Status HandlePrefetch::LastError() const {
  MutexLock lock(mu_);
  return last_error_;
}

void HandlePrefetch::Run() {
  // The rendezvous server holds the Get until the handle is published (WAIT), so a handle
  // published late is seen at once, in one call; the deadline only bounds how long a stop waits
  // for this thread. Over a slow link (hosts apart) one round trip can take longer than a short
  // deadline, so a call that times out doubles the next one's, up to kMaxWait: a fixed 200 ms
  // fetched nothing at all behind a slower round trip (handle_prefetch_test: 300 ms).
  constexpr std::chrono::milliseconds kFirstWait{200}, kMaxWait{2000};
  std::chrono::milliseconds wait = kFirstWait;
  for (size_t i = 0; i < ids_.size();) {
    {
      MutexLock lock(mu_);
      lock.Wait(cv_, [&]() REQUIRES(mu_) { return stop_ || i < taken_ + depth_; });
      if (stop_) return;
    }
    auto handle = FetchHandle(*rv_, ids_[i], DeadlineIn(wait));
    if (!handle.ok()) {  // not published yet, or the rendezvous is slow: ask again
      wait = std::min(wait * 2, kMaxWait);
      MutexLock lock(mu_);
      last_error_ = handle.status();
      if (stop_) return;
      continue;
    }
    {
      MutexLock lock(mu_);
      last_error_ = Status::Ok();
      ready_.emplace(i, std::move(handle).value());
    }
    cv_.notify_all();
    ++i;
  }
}

}  // namespace kvferry
