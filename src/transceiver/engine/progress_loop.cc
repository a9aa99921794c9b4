#include "transceiver/engine/progress_loop.h"

#include <pthread.h>
#include <sys/prctl.h>
#include <time.h>

#include <array>

#include "base/log.h"

namespace kvferry {
namespace {

// The spin window's pause between progress calls. Not sched_yield(): with another thread runnable
// on the core (a copying rank, the engine that called us, any load), Linux's EEVDF scheduler moves
// a yielding thread's deadline a whole slice back, so every yield gave the core away for
// milliseconds: a 128-token request (512 KiB) over UCX puts took 5-9 ms at p50 with two busy
// threads on the 2-core machine, 0.6-0.8 ms with this pause (docs/vllm.md). A short sleep keeps
// the thread's place (it wakes with lag in hand) and leaves the core to the copier meanwhile.
// kSpinSlack: the timer slack while the window lasts (the default, 50 us, would make each pause a
// 60 us nap); naps go back to the default.
constexpr auto kSpinPause = std::chrono::microseconds(10);
constexpr auto kSpinSlack = std::chrono::microseconds(1);
// An idle side's poll interval.
constexpr auto kIdlePoll = std::chrono::microseconds(50);

void SpinPause() {
  timespec ts{0, static_cast<long>(std::chrono::nanoseconds(kSpinPause).count())};
  nanosleep(&ts, nullptr);
}

// This thread's timer slack (0: back to its default); true when it was set.
bool SetTimerSlack(std::chrono::nanoseconds slack) {
  return prctl(PR_SET_TIMERSLACK, static_cast<unsigned long>(slack.count()), 0, 0, 0) == 0;
}

}  // namespace

// The thread's CPU clock is a system call (no vDSO): read once per iteration, plus once per phase
// when profiling. A busy iteration does not nap, so (not profiling) its CPU is what the clock
// gained by the next iteration's start.
class ProgressLoop::IterationCpu {
 public:
  explicit IterationCpu(ProgressProfile& profile) : profile_(profile), on_(profile.on()) {}

  // The start of an iteration: settles the previous one's busy CPU.
  void Begin(ProgressLoop& loop) {
    start_ = ThreadCpuNs();
    loop.thread_cpu_ns_.store(start_, std::memory_order_relaxed);
    if (busy_since_ >= 0) loop.busy_cpu_ns_ += start_ - busy_since_;
    busy_since_ = -1;
    lap_ = start_;
    phase_ns_.fill(0);
  }
  // The phase `p` of this iteration ended (profiling only).
  void Done(ProfilePhase p) {
    if (!on_) return;
    const int64_t t = ThreadCpuNs();
    phase_ns_[static_cast<int>(p)] += t - lap_;
    lap_ = t;
  }
  // The iteration's work is known: its phases go to the profile, its CPU to busy when it did
  // something.
  void End(ProgressLoop& loop, bool busy) {
    if (on_) {
      profile_.Count(busy ? ProfileCounter::kBusyIterations : ProfileCounter::kIdleIterations);
      if (busy) {
        for (size_t i = 0; i < phase_ns_.size(); ++i)
          profile_.Add(static_cast<ProfilePhase>(i), phase_ns_[i]);
      } else {
        profile_.Add(ProfilePhase::kIdle, lap_ - start_);
      }
    }
    if (!busy) return;
    if (on_) {
      loop.busy_cpu_ns_ += lap_ - start_;
    } else {
      busy_since_ = start_;
    }
  }

 private:
  ProgressProfile& profile_;
  const bool on_;
  int64_t start_ = 0;
  int64_t lap_ = 0;
  int64_t busy_since_ = -1;  // the start of the previous iteration when it was busy
  std::array<int64_t, static_cast<int>(ProfilePhase::kIdle)> phase_ns_{};
};

ProgressLoop::ProgressLoop(Transport& transport, ProgressProfile& profile, PeerVersions& versions,
                           LoopOptions options)
    : transport_(transport), profile_(profile), versions_(versions), options_(options) {}

void ProgressLoop::Start(ProgressHandler& handler, std::function<void()> bind) {
  wakeup_ = ProgressWakeup::Create(transport_);
  thread_ = std::thread([this, &handler, bind = std::move(bind)] {
    // Named for perf, top -H and /proc: the progress thread of a side.
    pthread_setname_np(pthread_self(), "kvf-progress");
    bind();
    Run(handler);
  });
}

void ProgressLoop::Stop() {
  if (!thread_.joinable()) return;
  stop_ = true;
  cmd_cv_.notify_all();
  if (wakeup_) wakeup_->Notify();
  thread_.join();
}

void ProgressLoop::Post(std::function<void()> fn) {
  {
    MutexLock lock(cmd_mu_);
    commands_.push_back(std::move(fn));
  }
  cmd_cv_.notify_one();
  if (wakeup_) wakeup_->Notify();
}

int64_t ProgressLoop::queued() const {
  MutexLock lock(cmd_mu_);
  return static_cast<int64_t>(commands_.size());
}

void ProgressLoop::Run(ProgressHandler& handler) {
  IterationCpu cpu(profile_);
  auto next_tick = Clock::now();
  last_busy_ = next_tick;
  Deadline stop_deadline{};
  while (true) {
    cpu.Begin(*this);
    bool busy = RunCommands();
    cpu.Done(ProfilePhase::kCommands);
    busy |= transport_.Progress();
    cpu.Done(ProfilePhase::kProgress);
    busy |= TakeControl(handler);
    cpu.Done(ProfilePhase::kControl);
    busy |= handler.Advance();
    cpu.Done(ProfilePhase::kAdvance);
    const auto now = Clock::now();
    if (now >= next_tick) {
      handler.OnTick(now);
      next_tick = now + std::chrono::milliseconds(1);
    }
    if (stop_) {
      if (stop_deadline == Deadline{}) stop_deadline = now + options_.stop_wait;
      if (handler.OnStop() || now > stop_deadline) break;
    }
    cpu.Done(ProfilePhase::kTick);
    cpu.End(*this, busy);
    if (busy) {
      last_busy_ = now;
    } else {
      Idle(handler, now);
    }
  }
  RunCommands();
  thread_cpu_ns_.store(ThreadCpuNs(), std::memory_order_relaxed);
}

bool ProgressLoop::RunCommands() {
  std::deque<std::function<void()>> cmds;
  {
    MutexLock lock(cmd_mu_);
    cmds.swap(commands_);
  }
  for (auto& c : cmds) c();
  return !cmds.empty();
}

bool ProgressLoop::TakeControl(ProgressHandler& handler) {
  bool any = false;
  while (auto m = transport_.PollControl()) {
    any = true;
    PeerVersions::Incoming in =
        versions_.OnReceive(m->from, m->bytes, transport_.DescribePeer(m->from));
    if (in.reply) (void)transport_.SendControl(m->from, *in.reply);
    if (in.kind == PeerVersions::Incoming::kRefused) {
      Log(LogLevel::kError, "transceiver: {}", in.why.message());
      handler.OnPeerRefused(m->from, in.why);
      continue;
    }
    if (in.kind == PeerVersions::Incoming::kConsumed) continue;  // VERSION: not counted
    profile_.Count(ProfileCounter::kControlReceived);
    auto msg = DecodeMessage(m->bytes, versions_.ours());
    if (!msg.ok()) {
      Log(LogLevel::kWarn, "transceiver: dropped a control message from peer {}: {}", m->from,
          msg.status().ToString());
      continue;
    }
    handler.OnControl(m->from, std::move(msg).value());
  }
  return any;
}

void ProgressLoop::Idle(ProgressHandler& handler, Clock::time_point now) {
  // Nothing to do and nothing to drive (QuietNap): no spinning, one long nap. On the CPU device
  // every wake-up of a napping thread can take a core from a thread that copies (2 cores: 12 us
  // of the copier's time each; 50 us naps preempted the copy 2,700 times per 4 GB, 10% of its
  // time, 80% of them by the copying rank's own progress thread).
  const auto quiet = handler.QuietNap();
  if (quiet.count() == 0 && handler.InFlight() && now - last_busy_ < options_.spin) {
    // Transports make progress only when driven (MPI and UCX shared memory copy inside the
    // progress call): with bytes in flight, keep driving, pausing kSpinPause between calls. Past
    // transfer.spin_us without anything happening (a long copy on the device, a peer's answer)
    // the loop naps like an idle one, so waiting ranks leave the cores to those copying.
    if (!fine_slack_) fine_slack_ = SetTimerSlack(kSpinSlack);
    SpinPause();
    return;
  }
  if (fine_slack_) fine_slack_ = !SetTimerSlack(std::chrono::nanoseconds(0));
  // A quiet side (QuietNap): only a peer's message, a public call or a stream callback can bring
  // work, so it sleeps until one does (ProgressWakeup), at most the nap; a peer's message ends the
  // sleep only where the side listens (QuietNapHearsPeers). Without a wakeup fd it naps as
  // before; when the transport did not arm (a message came since this iteration looked), it looks
  // again after at most kIdlePoll. An idle side polls every kIdlePoll (sleeping on the fd there
  // cost more CPU per request than it saved once control messages went over shared memory:
  // arming, and the sender's signal to an armed peer).
  const bool wakes = wakeup_ && quiet.count() > 0;
  const bool slept = wakes && wakeup_->Sleep(quiet, handler.QuietNapHearsPeers(), [&] {
    MutexLock lock(cmd_mu_);
    return WakeReason();
  });
  if (slept) return;
  MutexLock lock(cmd_mu_);
  lock.WaitFor(cmd_cv_, quiet.count() > 0 && !wakes ? quiet : kIdlePoll,
               [&]() REQUIRES(cmd_mu_) { return WakeReason(); });
}

}  // namespace kvferry
