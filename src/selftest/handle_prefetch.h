// HandlePrefetch: a generation rank's handles fetched from the run's rendezvous in order and
// ahead of need, on a thread of their own with a rendezvous client of their own. In a deployment
// the router hands the generation instance a context handle; the self-test plays the router
// through the rendezvous, whose Get polls (a round trip per call on a kept TCP connection,
// sleeping while the key is absent). Fetching inline, in the loop that starts requests and takes
// their completions, put those round trips and sleeps between one request's end and the next
// one's start; the prefetcher keeps them off that loop, so requests stay in flight back to back.
//
// Thread-safety: Take and the destructor are called by one thread (the rank's loop); the fetching
// thread is internal.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "base/thread_annotations.h"
#include "kvferry/rendezvous.h"

namespace kvferry {

class HandlePrefetch {
 public:
  // Fetches the handles of `ids` in order, at most `depth` (>= 1) past the last one taken.
  HandlePrefetch(std::unique_ptr<Rendezvous> rv, std::vector<uint64_t> ids, size_t depth);
  ~HandlePrefetch();
  HandlePrefetch(const HandlePrefetch&) = delete;
  HandlePrefetch& operator=(const HandlePrefetch&) = delete;

  // The handle of ids[i] (i: the next to start, taken in order), waiting up to `wait` for it;
  // nullopt when it has not been fetched by then (not yet published).
  std::optional<std::vector<std::byte>> Take(size_t i, std::chrono::microseconds wait);
  // Why the last look-up failed (OK when the last one succeeded or none failed): a rank that
  // gives up waiting for handles says what its rendezvous answered, e.g. that nothing listens
  // at its address, rather than only that no handle came.
  Status LastError() const;

 private:
  void Run();

  const std::unique_ptr<Rendezvous> rv_;
  const std::vector<uint64_t> ids_;
  const size_t depth_;
  mutable Mutex mu_;
  std::condition_variable cv_;
  std::map<size_t, std::vector<std::byte>> ready_ GUARDED_BY(mu_);
  size_t taken_ GUARDED_BY(mu_) = 0;  // handles [0, taken_) were taken
  bool stop_ GUARDED_BY(mu_) = false;
  Status last_error_ GUARDED_BY(mu_);
  std::thread thread_;  // last: starts once the members above exist
};

}  // namespace kvferry
