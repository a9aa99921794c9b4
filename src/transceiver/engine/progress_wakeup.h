// ProgressWakeup: lets a side's progress thread sleep until something it waits for may have
// happened, instead of waking on a timer to look. What can bring work while a side only waits:
// a peer's control message (the transport's WakeupFd: UCX's control worker, the in-process
// fabric), a public call or a stream callback (ProgressLoop::Post, which calls Notify).
//
// Why: on the CPU device the progress threads nap so as to leave the cores to the threads that
// copy (2 cores: 50 us polling preempted the copying thread about 10,000 times a second), but a
// timed nap noticed each peer message up to a nap late. Measured (bench transfer, Llama-3-8B,
// 128 tokens, one request at a time): of 1.9 ms per request, 0.94 ms was the copy and 0.58 ms
// the generation rank sleeping through the COMPLETE that answered its DONE 15 us later, 0.15 ms
// it sleeping through the CHUNK, 0.06 ms the context rank's 50 us idle poll finding the FETCH.
//
// Thread safety: Notify from any thread; Sleep from the progress thread only (it arms and
// drives the transport).
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>

#include "kvferry/transport.h"

namespace kvferry {

class ProgressWakeup {
 public:
  // Null when the transport has no wakeup fd or no eventfd can be had: the loop then naps on its
  // condition variable and polls.
  static std::unique_ptr<ProgressWakeup> Create(Transport& transport);
  ~ProgressWakeup();
  ProgressWakeup(const ProgressWakeup&) = delete;
  ProgressWakeup& operator=(const ProgressWakeup&) = delete;

  // After queueing work for the progress thread: ends a Sleep in progress.
  void Notify();

  // Sleeps until a control message may have come (when `hear_peers`), a Notify or `timeout`;
  // returns at once when `has_work()` (checked after this thread is marked sleeping, so a Notify
  // that follows is not lost) or, hearing peers, the transport has something waiting (ArmWakeup
  // false). True when it slept. Not hearing peers leaves the transport unarmed: its peers send
  // without waking this thread, and their messages wait for the Notify or the timeout.
  bool Sleep(std::chrono::microseconds timeout, bool hear_peers,
             const std::function<bool()>& has_work);

 private:
  ProgressWakeup(Transport& transport, int event_fd) : transport_(transport), event_fd_(event_fd) {}

  Transport& transport_;
  const int event_fd_;  // owned; Notify writes it while the progress thread sleeps
  std::atomic<bool> sleeping_{false};
};

}  // namespace kvferry
