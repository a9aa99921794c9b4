// ProgressLoop: a side's progress thread. It runs what public calls post (Post, Call), drives the
// transport, hands peers' control messages and each iteration's work to its side (ProgressHandler),
// ticks every millisecond, and when an iteration found nothing to do spins briefly (bytes in
// flight) or naps (ProgressWakeup where the transport has a wakeup fd). It counts its own CPU:
// all of it, and the part spent in iterations that did work.
//
// Thread-safe: Post, Call and the counters from any thread; the handler runs on the loop's thread
// only.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <thread>

#include "base/thread_annotations.h"
#include "kvferry/transport.h"
#include "transceiver/engine/peer_versions.h"
#include "transceiver/engine/progress_profile.h"
#include "transceiver/engine/progress_wakeup.h"
#include "transceiver/wire/messages.h"

namespace kvferry {

// What a side does on its progress thread; every call comes from the loop's thread.
class ProgressHandler {
 public:
  // A peer's control message, decoded.
  virtual void OnControl(PeerId from, ControlMsg msg) = 0;
  // A peer whose wire versions do not meet ours (PeerVersions): `why` names it and both ranges.
  // Its messages are dropped from now on; the side ends what it has with it.
  virtual void OnPeerRefused(PeerId peer, const Status& why) {
    (void)peer;
    (void)why;
  }
  // Moves the side's requests on; true when it did something.
  virtual bool Advance() = 0;
  // At most once a millisecond: deadlines, retries, housekeeping.
  virtual void OnTick(Clock::time_point now) = 0;
  // Once Stop was asked, every iteration: ends every live request (kCancelled, "shutting down")
  // and returns true once nothing is in flight any more.
  virtual bool OnStop() = 0;
  // True while requests are live: the loop then polls every 10 us (short sleeps, not yields) for
  // up to transfer.spin_us after the last progress (transport operations, device copies and
  // peers' answers are due).
  virtual bool InFlight() const = 0;
  // How long the loop may nap, neither polling nor spinning, when an iteration found nothing to
  // do; zero: poll as usual (spin transfer.spin_us with requests live, then 50 us naps). The
  // context side says transfer.stream_nap_us while all it waits for is its stream (whose
  // WakeAtStreamEnd callback wakes it), the generation side transfer.peer_wait_nap_us while all
  // it waits for are CHUNK and COMPLETE messages of peer-memory pairs. A public call wakes it, and
  // a peer's control message where the transport has a wakeup fd (ProgressWakeup).
  virtual std::chrono::microseconds QuietNap() const = 0;
  // Whether a peer's control message ends such a nap. Listening arms the transport, and then
  // every message a peer sends wakes this thread from its sender's progress loop (UCX: a system
  // call and a wake-up of the sleeping thread, 10-35 us of the sender's CPU per message measured
  // on the 2-core machine). The context side does not listen while its stream copies: a FETCH or
  // DONE that comes meanwhile waits for the stream callback or the nap. The generation side
  // listens only with one request live (its latency is all there is to win); with several, their
  // messages come often and are taken together at the nap.
  virtual bool QuietNapHearsPeers() const = 0;

 protected:
  ~ProgressHandler() = default;
};

struct LoopOptions {
  std::chrono::microseconds spin;       // transfer.spin_us
  std::chrono::milliseconds stop_wait;  // how long Stop lets OnStop drain (the request timeout)
};

class ProgressLoop {
 public:
  // `versions`: the wire version of each peer, which the loop learns from what comes in (the
  // loop's thread owns it).
  ProgressLoop(Transport& transport, ProgressProfile& profile, PeerVersions& versions,
               LoopOptions options);
  ~ProgressLoop() { Stop(); }
  ProgressLoop(const ProgressLoop&) = delete;
  ProgressLoop& operator=(const ProgressLoop&) = delete;

  // Starts the thread: `bind` runs on it first (binds it to the device), then the loop drives
  // `handler` until Stop.
  void Start(ProgressHandler& handler, std::function<void()> bind);
  // Stops the thread after the handler's OnStop drained every operation (bounded by stop_wait).
  // Commands posted after the loop ended still run, with whatever state they find.
  void Stop();

  void Post(std::function<void()> fn);
  // Runs `fn` on the loop's thread and returns its result.
  template <typename F>
  auto Call(F&& fn) -> decltype(fn()) {
    using R = decltype(fn());
    auto task = std::make_shared<std::packaged_task<R()>>(std::forward<F>(fn));
    auto result = task->get_future();
    Post([task] { (*task)(); });
    return result.get();
  }

  // The thread's CPU in iterations that did work, and all of it (idle polling and naps' wake-ups
  // too), as of its latest iteration.
  int64_t busy_cpu_ns() const { return busy_cpu_ns_.load(); }
  int64_t thread_cpu_ns() const { return thread_cpu_ns_.load(); }
  // Commands posted and not yet run.
  int64_t queued() const;

 private:
  // The CPU clock of one iteration, phase by phase (transfer.profile).
  class IterationCpu;

  void Run(ProgressHandler& handler);
  // One iteration's steps: each returns whether it did something.
  bool RunCommands();
  bool TakeControl(ProgressHandler& handler);
  // After an iteration that did nothing: spin, nap or sleep until something may have come.
  void Idle(ProgressHandler& handler, Clock::time_point now);
  bool WakeReason() REQUIRES(cmd_mu_) { return !commands_.empty() || stop_; }

  Transport& transport_;
  ProgressProfile& profile_;
  PeerVersions& versions_;
  const LoopOptions options_;
  // Sleeps until a control message, a Post or a nap's end (null: the transport has no wakeup
  // fd; the loop naps on cmd_cv_).
  std::unique_ptr<ProgressWakeup> wakeup_;
  mutable Mutex cmd_mu_;
  std::condition_variable cmd_cv_;
  std::deque<std::function<void()>> commands_ GUARDED_BY(cmd_mu_);
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> busy_cpu_ns_{0};
  std::atomic<int64_t> thread_cpu_ns_{0};
  Clock::time_point last_busy_{};  // loop thread
  bool fine_slack_ = false;        // loop thread: the spin window's timer slack is set
  std::thread thread_;
};

}  // namespace kvferry
