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

void HandlePrefetch::Run() {
  // Between misses the thread pauses 1 to 8 ms (doubling; reset by a hit): a handle published
  // late is seen within a pause, and a rank waiting for its context side costs a few rendezvous
  // calls per 10 ms, not a stream of them (two shared cores run every rank).
  constexpr auto kMinPause = std::chrono::milliseconds(1), kMaxPause = std::chrono::milliseconds(8);
  auto pause = kMinPause;
  for (size_t i = 0; i < ids_.size();) {
    {
      MutexLock lock(mu_);
      lock.Wait(cv_, [&]() REQUIRES(mu_) { return stop_ || i < taken_ + depth_; });
      if (stop_) return;
    }
    auto handle = FetchHandle(*rv_, ids_[i], DeadlineIn(std::chrono::milliseconds(2)));
    if (!handle.ok()) {  // not published yet (or the rendezvous is slow): ask again
      MutexLock lock(mu_);
      lock.WaitFor(cv_, pause, [&]() REQUIRES(mu_) { return stop_; });
      if (stop_) return;
      pause = std::min(pause * 2, kMaxPause);
      continue;
    }
    pause = kMinPause;
    {
      MutexLock lock(mu_);
      ready_.emplace(i, std::move(handle).value());
    }
    cv_.notify_all();
    ++i;
  }
}

}  // namespace kvferry
