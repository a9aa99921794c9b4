// ProgressProfile: where a transceiver progress thread's CPU goes, phase by phase, and how busy
// a context rank's copy stream is (knob transfer.profile; off by default, then it costs one
// branch per use).
//
// Why: TransceiverStats::busy_cpu_seconds says how much CPU the control plane costs, not what it
// is spent on, and the GPU image has no perf. With the knob on, the progress loop reads its thread
// CPU clock (CLOCK_THREAD_CPUTIME_ID) between its phases: public calls posted to it, the
// transport's progress, control messages, Advance, the 1 ms tick. An iteration that did nothing
// counts whole as idle polling (busy_cpu_seconds leaves it out too). Inside those phases, a few
// named operations are timed inclusively ("of which": a peer pool's first mapping, a connection,
// planning, copy submission, event queries, control sends), so one-time setup can be told from
// per-request work. The copy meter turns batch launch and observed completion times of the one
// copy stream into the time it had work queued: stream busy time over the run's wall time says
// whether the GPU (busy ~100%) or the host side (gaps) limits a rank.
//
// Thread safety: Add/Count/the meter are called by the progress thread only; Snapshot may be
// called from any thread (relaxed atomics: a snapshot is approximate while the side runs).
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <deque>
#include <string>
#include <utility>
#include <vector>

#include "kvferry/status.h"

namespace kvferry {

enum class ProfilePhase : int {
  // Exclusive: every busy iteration's CPU is split between these five ...
  kCommands,  // public calls run on the progress thread (MarkReady, Fetch, Cancel, ...)
  kProgress,  // Transport::Progress
  kControl,   // control messages polled, decoded and handled (FETCH, ACCEPT, CHUNK, DONE, ...)
  kAdvance,   // the sides' Advance: launching and reaping copies and transport operations
  kTick,      // deadlines, pending fetches
  // ... and an iteration that did nothing counts whole here.
  kIdle,
  // Inclusive: timed inside one of the phases above.
  kPeerImport,   // mapping a peer pool region the first time (Device::ImportMemory)
  kConnect,      // Transport::Connect (generation side, per FETCH)
  kPlan,         // planning a request's pairs (context side, first FETCH)
  kCopySubmit,   // CopyBatch + Record of a peer-memory batch
  kEventQuery,   // polling a peer-memory batch's completion event
  kSendControl,  // encoding and sending one control message
  kCount
};

enum class ProfileCounter : int {
  kBusyIterations,
  kIdleIterations,
  kControlSent,
  kControlReceived,  // protocol messages handed on (a VERSION is not one)
  kBatches,          // peer-memory batches launched
  kCount
};

// The CPU time of the calling thread, in nanoseconds.
int64_t ThreadCpuNs();

class ProgressProfile {
 public:
  explicit ProgressProfile(bool on) : on_(on) {}
  bool on() const { return on_; }

  void Add(ProfilePhase p, int64_t ns) {
    phase_ns_[static_cast<int>(p)].fetch_add(ns, std::memory_order_relaxed);
  }
  void Count(ProfileCounter c, int64_t n = 1) {
    if (on_) counters_[static_cast<int>(c)].fetch_add(n, std::memory_order_relaxed);
  }

  // The copy meter. Batches complete in launch order (one stream); completions may be observed
  // out of order (pairs are polled in turn). Returns the batch's ticket for Landed.
  uint64_t Launched(int64_t now_ns);
  void Landed(uint64_t ticket, int64_t now_ns);
  // A batch given up without observing its end (abandoned request): it ends the meter's view of
  // the stream there.
  void Dropped(uint64_t ticket, int64_t now_ns) { Landed(ticket, now_ns); }

  // Name and value pairs: "<phase>_cpu_s" per phase, the counters, "copy_busy_s". Empty when off.
  std::vector<std::pair<std::string, double>> Snapshot() const;

 private:
  const bool on_;
  std::array<std::atomic<int64_t>, static_cast<int>(ProfilePhase::kCount)> phase_ns_{};
  std::array<std::atomic<int64_t>, static_cast<int>(ProfileCounter::kCount)> counters_{};
  std::atomic<int64_t> copy_busy_ns_{0};
  // Progress thread only: batches launched and not yet folded into copy_busy_ns_, oldest first
  // (launch time, observed end or -1).
  std::deque<std::pair<int64_t, int64_t>> open_;
  uint64_t first_open_ = 0;  // ticket of open_.front()
  int64_t last_end_ = 0;     // when the stream last ran dry, as far as the meter knows
};

// Adds the calling thread's CPU between construction and destruction to `phase` (nothing when the
// profile is off or null).
class ProfileScope {
 public:
  ProfileScope(ProgressProfile* profile, ProfilePhase phase)
      : profile_(profile != nullptr && profile->on() ? profile : nullptr),
        phase_(phase),
        start_(profile_ ? ThreadCpuNs() : 0) {}
  ~ProfileScope() {
    if (profile_) profile_->Add(phase_, ThreadCpuNs() - start_);
  }
  ProfileScope(const ProfileScope&) = delete;
  ProfileScope& operator=(const ProfileScope&) = delete;

 private:
  ProgressProfile* const profile_;
  const ProfilePhase phase_;
  const int64_t start_;
};

}  // namespace kvferry
