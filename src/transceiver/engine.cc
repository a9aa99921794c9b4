#include "transceiver/engine.h"

#include <fmt/format.h>
#include <pthread.h>
#include <sys/prctl.h>
#include <time.h>

#include <random>

#include "base/log.h"
#include "kvferry/config.h"

namespace kvferry {

std::string_view TransferStateName(TransferState state) {
  switch (state) {
    case TransferState::kInit:
      return "init";
    case TransferState::kInProgress:
      return "in-progress";
    case TransferState::kComplete:
      return "complete";
    case TransferState::kError:
      return "error";
    case TransferState::kTimedOut:
      return "timed-out";
    case TransferState::kCancelled:
      return "cancelled";
  }
  return "?";
}

EngineOptions ResolveOptions(const TransceiverOptions& o, const Device& device) {
  const Config& c = Config::Global();
  EngineOptions e;
  e.timeout =
      o.timeout.count() > 0 ? o.timeout : std::chrono::milliseconds(c.Int("transfer.timeout_ms"));
  e.chunk_bytes = o.chunk_bytes > 0 ? o.chunk_bytes : c.Int("transfer.chunk_bytes");
  e.staging_chunks = o.staging_chunks > 0 ? o.staging_chunks : c.Int("transfer.staging_chunks");
  e.direct_min_bytes =
      o.direct_min_bytes > 0 ? o.direct_min_bytes : c.Int("transfer.direct_min_bytes");
  e.max_inflight = c.Int("transfer.max_inflight_per_pair");
  e.unknown_request_wait = std::chrono::milliseconds(c.Int("transfer.unknown_request_wait_ms"));
  e.abort_grace = std::chrono::milliseconds(c.Int("transfer.abort_grace_ms"));
  e.spin = std::chrono::microseconds(c.Int("transfer.spin_us"));
  e.stream_nap = std::chrono::microseconds(c.Int("transfer.stream_nap_us"));
  e.peer_wait_nap = std::chrono::microseconds(c.Int("transfer.peer_wait_nap_us"));
  e.rma = o.rma.value_or(c.Bool("transfer.rma"));
  e.rma_row_min_bytes = c.Int("transfer.rma_row_min_bytes");
  e.checksum = o.checksum.value_or(c.Bool("transfer.checksum"));
  const std::string peer = c.String("transfer.peer_memory");
  e.peer_memory = peer == "on"    ? EngineOptions::PeerMemory::kOn
                  : peer == "off" ? EngineOptions::PeerMemory::kOff
                                  : EngineOptions::PeerMemory::kAuto;
  e.profile = c.Bool("transfer.profile");
  e.peer_batch_bytes = c.Int("transfer.peer_batch_bytes");
  e.peer_merge_pairs = c.Bool("transfer.peer_merge_pairs");
  // -1: by device. On the CPU device a held launch lets CopyHostBatch read the source rows that
  // several generation ranks' head slices share once (TP2->TP4 at 128 tokens: 0.98 of one memcpy
  // against 0.64 without, medians of 4 interleaved rounds); on CUDA holding gained nothing and
  // cost p50 (H200, TP2->TP4 128 tokens 16 in flight: 0.71-0.76 ms against 0.65-0.69).
  e.peer_hold_launches = c.Int("transfer.peer_hold_launches");
  e.peer_max_mapped = c.Int("transfer.peer_max_mapped");
  if (e.peer_hold_launches < 0) e.peer_hold_launches = device.info().platform == "cpu" ? 2 : 0;
  e.secret = o.instance_secret;
  e.instance_id = o.instance_id;
  if (e.instance_id == 0)
    e.instance_id = std::random_device{}() | (uint64_t{std::random_device{}()} << 32);
  return e;
}

StatusOr<std::unique_ptr<Transport>> MakeTransport(const TransceiverOptions& options,
                                                   const Device& device) {
  TransportOptions t;
  t.name = options.transport;
  t.device_memory_is_host = device.info().platform == "cpu";
  return CreateTransport(t);
}

Engine::Engine(Device& device, const BlockPool& pool, EngineOptions options,
               std::unique_ptr<Transport> transport)
    : device_(device),
      pool_(pool),
      options_(options),
      transport_(std::move(transport)),
      events_([this] { return device_.CreateEvent(); }),
      profile_(options.profile) {}

Engine::~Engine() {
  Stop();
  // Copies still queued on the stream read or write staging, the pool and mapped peer pools: the
  // stream drains them when destroyed, which must happen before staging_ (declared after it) is
  // freed and the peer mappings are closed.
  stream_.reset();
  mapped_.clear();
  mapped_count_.store(0, std::memory_order_relaxed);
  retired_.clear();
  // A peer in this process maps these regions no more (the pool may go once the side is gone).
  for (const auto& h : paths_.exported_pool) RevokePeerExport(h);
}

Status Engine::Start() {
  const bool cpu = device_.info().platform == "cpu";
  const bool dev_mem = transport_->caps().device_memory;
  // On the CPU device every kind is host memory; tell transports so.
  pool_wire_kind_ = cpu ? MemoryKind::kHost : pool_.memory();
  direct_ok_ = cpu || pool_.memory() != MemoryKind::kDevice || dev_mem;
  MemoryKind staging_kind = (!cpu && dev_mem) ? MemoryKind::kDevice : MemoryKind::kPinnedHost;
  staging_wire_kind_ = cpu ? MemoryKind::kHost : staging_kind;
  auto staging = device_.Allocate(staging_kind, options_.chunk_bytes * options_.staging_chunks);
  if (!staging.ok()) return staging.status().WithContext("transceiver staging");
  staging_ = std::move(staging).value();
  slots_.Resize(static_cast<int>(options_.staging_chunks));
  KVF_ASSIGN_OR_RETURN(stream_, device_.CreateStream());
  // Chunk digests of a GPU pool land in pinned memory: allocated now, not behind queued work.
  if (!host_visible_pool()) {
    KVF_RETURN_IF_ERROR(digester_.Reserve(
        device_, static_cast<size_t>(options_.chunk_bytes) / kDigestSegmentBytes + 1024));
  }
  paths_ = SetUpLocalPaths(*transport_, device_, pool_, staging_, pool_wire_kind_,
                           staging_wire_kind_, direct_ok_, options_.rma, options_.peer_memory);
  wakeup_ = ProgressWakeup::Create(*transport_);
  thread_ = std::thread([this] { Run(); });
  return Status::Ok();
}

StatusOr<MappedPeerPool> Engine::MapPeerPool(const std::vector<std::vector<std::byte>>& handles) {
  MappedPeerPool out;
  out.regions.reserve(handles.size());
  out.holds.reserve(handles.size());
  for (const auto& h : handles) {
    auto it = mapped_.find(h);
    if (it == mapped_.end()) {
      // A handle that did not map once is not tried again on every fetch.
      if (auto bad = unmappable_.find(h); bad != unmappable_.end()) return bad->second;
      auto m = [&] {
        ProfileScope timed(&profile_, ProfilePhase::kPeerImport);
        return device_.ImportMemory(h);
      }();
      if (!m.ok()) {
        if (unmappable_.size() >= 1024) unmappable_.clear();
        unmappable_.emplace(h, m.status());
        return m.status();
      }
      auto decoded = DecodePeerHandle(h);  // ImportMemory decoded it already: can't fail
      if (!decoded.ok()) return decoded.status();
      EvictMappings(static_cast<size_t>(std::max<int64_t>(options_.peer_max_mapped, 1)) - 1);
      MappedPeer entry;
      entry.mapping = std::shared_ptr<PeerMapping>(std::move(m).value());
      entry.watch = std::make_unique<ExporterWatch>(*decoded);
      it = mapped_.emplace(h, std::move(entry)).first;
      mapped_count_.store(mapped_.size(), std::memory_order_relaxed);
    }
    it->second.last_use = ++map_uses_;
    out.regions.push_back(it->second.mapping.get());
    out.holds.push_back(it->second.mapping);
  }
  return out;
}

void Engine::RetireMapping(std::shared_ptr<PeerMapping> mapping) {
  RetiredMapping r{std::move(mapping), nullptr};
  if (auto ev = device_.CreateEvent(); ev.ok() && stream_ && stream_->Record(**ev).ok())
    r.passed = std::move(ev).value();
  retired_.push_back(std::move(r));  // no event: kept until the side goes
}

void Engine::EvictMappings(size_t keep) {
  while (mapped_.size() > keep) {
    auto victim = mapped_.end();
    for (auto it = mapped_.begin(); it != mapped_.end(); ++it) {
      if (it->second.mapping.use_count() > 1) continue;  // a live pair copies into it
      if (victim == mapped_.end() || it->second.last_use < victim->second.last_use) victim = it;
    }
    if (victim == mapped_.end()) return;
    Log(LogLevel::kDebug, "transceiver: unmapped a peer pool region ({} mapped, at most {})",
        mapped_.size(), options_.peer_max_mapped);
    RetireMapping(std::move(victim->second.mapping));
    mapped_.erase(victim);
    mapped_count_.store(mapped_.size(), std::memory_order_relaxed);
  }
}

void Engine::SweepPeerMappings(Clock::time_point now) {
  if (now < next_sweep_) return;
  next_sweep_ = now + std::chrono::seconds(1);
  for (auto it = mapped_.begin(); it != mapped_.end();) {
    if (it->second.mapping.use_count() == 1 && !it->second.watch->alive()) {
      RetireMapping(std::move(it->second.mapping));
      it = mapped_.erase(it);
    } else {
      ++it;
    }
  }
  // Regions a pair held past the bound when they were mapped go once it let them go.
  EvictMappings(static_cast<size_t>(std::max<int64_t>(options_.peer_max_mapped, 1)));
  mapped_count_.store(mapped_.size(), std::memory_order_relaxed);
  std::erase_if(retired_, [](RetiredMapping& r) { return r.passed && r.passed->Query(); });
}

void Engine::Stop() {
  if (!thread_.joinable()) return;
  stop_ = true;
  cmd_cv_.notify_all();
  if (wakeup_) wakeup_->Notify();
  thread_.join();
}

void Engine::WakeAtStreamEnd() {
  if (device_.info().platform != "cpu") return;
  // The callback runs on the stream's thread; ~Engine drains the stream before any member goes.
  (void)stream_->HostCallback([this] { Post([] {}); });
}

void Engine::Post(std::function<void()> fn) {
  {
    MutexLock lock(cmd_mu_);
    commands_.push_back(std::move(fn));
  }
  cmd_cv_.notify_one();
  if (wakeup_) wakeup_->Notify();
}

namespace {

// The spin window's pause between progress calls (Engine::Run). Not sched_yield(): with another
// thread runnable on the core (a copying rank, the engine that called us, any load), Linux's
// EEVDF scheduler moves a yielding thread's deadline a whole slice back, so every yield gave the
// core away for milliseconds: a 128-token request (512 KiB) over UCX puts took 5-9 ms at p50 with
// two busy threads on the 2-core machine, 0.6-0.8 ms with this pause (docs/vllm.md). A short
// sleep keeps the thread's place (it wakes with lag in hand) and leaves the core to the copier
// meanwhile. kSpinSlack: the timer slack while the window lasts (the default, 50 us, would make
// each pause a 60 us nap); naps go back to the default.
constexpr auto kSpinPause = std::chrono::microseconds(10);
constexpr auto kSpinSlack = std::chrono::microseconds(1);

void SpinPause() {
  timespec ts{0, static_cast<long>(std::chrono::nanoseconds(kSpinPause).count())};
  nanosleep(&ts, nullptr);
}

// This thread's timer slack (0: back to its default); true when it was set.
bool SetTimerSlack(std::chrono::nanoseconds slack) {
  return prctl(PR_SET_TIMERSLACK, static_cast<unsigned long>(slack.count()), 0, 0, 0) == 0;
}

}  // namespace

void Engine::Run() {
  // Named for perf, top -H and /proc: the progress thread of a side.
  pthread_setname_np(pthread_self(), "kvf-progress");
  // Binds this thread to the device (CUDA: its primary context, which the transport's CUDA
  // transports find current when they copy GPU memory).
  (void)stream_->Query();
  auto next_tick = Clock::now();
  auto last_busy = next_tick;
  Deadline stop_deadline{};
  // transfer.profile: the CPU of each phase of this iteration (ProgressProfile), kept apart until
  // the iteration is known to have been busy.
  const bool profiling = profile_.on();
  std::array<int64_t, static_cast<int>(ProfilePhase::kIdle)> phase_ns{};
  int64_t lap = 0;
  auto phase_done = [&](ProfilePhase p) {
    if (!profiling) return;
    const int64_t t = ThreadCpuNs();
    phase_ns[static_cast<int>(p)] += t - lap;
    lap = t;
  };
  // The thread's CPU clock is a system call (no vDSO): read once per iteration. A busy iteration
  // does not nap, so its CPU is what the clock gained by the next iteration's start.
  int64_t busy_since = -1;  // the start of the previous iteration when it was busy
  bool fine_slack = false;  // the spin window's timer slack is set (kSpinSlack)
  while (true) {
    const int64_t cpu0 = ThreadCpuNs();
    thread_cpu_ns_.store(cpu0, std::memory_order_relaxed);
    if (busy_since >= 0) busy_cpu_ns_ += cpu0 - busy_since;
    busy_since = -1;
    lap = cpu0;
    phase_ns.fill(0);
    bool busy = false;
    std::deque<std::function<void()>> cmds;
    {
      MutexLock lock(cmd_mu_);
      cmds.swap(commands_);
    }
    for (auto& c : cmds) c();
    busy |= !cmds.empty();
    phase_done(ProfilePhase::kCommands);
    busy |= transport_->Progress();
    phase_done(ProfilePhase::kProgress);
    while (auto m = transport_->PollControl()) {
      busy = true;
      profile_.Count(ProfileCounter::kControlReceived);
      auto msg = DecodeMessage(m->bytes);
      if (!msg.ok()) {
        Log(LogLevel::kWarn, "transceiver: dropped a control message from peer {}: {}", m->from,
            msg.status().ToString());
        continue;
      }
      OnControl(m->from, std::move(msg).value());
    }
    phase_done(ProfilePhase::kControl);
    busy |= Advance();
    phase_done(ProfilePhase::kAdvance);
    auto now = Clock::now();
    if (now >= next_tick) {
      OnTick(now);
      SweepPeerMappings(now);
      next_tick = now + std::chrono::milliseconds(1);
    }
    if (stop_) {
      if (stop_deadline == Deadline{}) stop_deadline = now + options_.timeout;
      if (OnStop() || now > stop_deadline) break;
    }
    phase_done(ProfilePhase::kTick);
    if (profiling) {
      profile_.Count(busy ? ProfileCounter::kBusyIterations : ProfileCounter::kIdleIterations);
      if (busy) {
        for (size_t i = 0; i < phase_ns.size(); ++i)
          profile_.Add(static_cast<ProfilePhase>(i), phase_ns[i]);
      } else {
        profile_.Add(ProfilePhase::kIdle, lap - cpu0);
      }
    }
    if (busy) {
      if (profiling) {
        busy_cpu_ns_ += lap - cpu0;
      } else {
        busy_since = cpu0;
      }
      last_busy = now;
    }
    // Nothing to do and nothing to drive (QuietNap): no spinning, one long nap. On the CPU
    // device every wake-up of a napping thread can take a core from a thread that copies (2
    // cores: 12 us of the copier's time each; 50 us naps preempted the copy 2,700 times per 4 GB,
    // 10% of its time, 80% of them by the copying rank's own progress thread).
    const auto quiet = busy ? std::chrono::microseconds(0) : QuietNap();
    if (!busy && quiet.count() == 0 && InFlight() && now - last_busy < options_.spin) {
      // Transports make progress only when driven (MPI and UCX shared memory copy inside the
      // progress call): with bytes in flight, keep driving, pausing kSpinPause between calls.
      // Past transfer.spin_us without anything happening (a long copy on the device, a peer's
      // answer) the loop naps like an idle one, so waiting ranks leave the cores to those
      // copying.
      if (!fine_slack) fine_slack = SetTimerSlack(kSpinSlack);
      SpinPause();
    } else if (!busy) {
      if (fine_slack) fine_slack = !SetTimerSlack(std::chrono::nanoseconds(0));
      // A quiet side (QuietNap): only a peer's message, a public call or a stream callback can
      // bring work, so it sleeps until one does (ProgressWakeup), at most the nap; a peer's
      // message ends the sleep only where the side listens (QuietNapHearsPeers). Without a
      // wakeup fd it naps as before; when the transport did not arm (a message came since this
      // iteration looked), it looks again after at most 50 us. An idle side polls every 50 us as
      // before (sleeping on the fd there cost more CPU per request than it saved once control
      // messages went over shared memory: arming, and the sender's signal to an armed peer).
      const bool wakes = wakeup_ && quiet.count() > 0;
      const bool slept = wakes && wakeup_->Sleep(quiet, QuietNapHearsPeers(), [&] {
        MutexLock lock(cmd_mu_);
        return !commands_.empty() || stop_;
      });
      if (!slept) {
        constexpr std::chrono::microseconds kPoll(50);
        MutexLock lock(cmd_mu_);
        lock.WaitFor(cmd_cv_, quiet.count() > 0 && !wakes ? quiet : kPoll,
                     [&]() REQUIRES(cmd_mu_) { return !commands_.empty() || stop_; });
      }
    }
  }
  // Commands posted after the loop ended still complete (with whatever state they find).
  std::deque<std::function<void()>> rest;
  {
    MutexLock lock(cmd_mu_);
    rest.swap(commands_);
  }
  for (auto& c : rest) c();
  thread_cpu_ns_.store(ThreadCpuNs(), std::memory_order_relaxed);
}

void Engine::SetStatus(const TransferStatus& status) {
  metrics_.OnStatus(status);
  {
    MutexLock lock(status_mu_);
    auto it = statuses_.find(status.request_id);
    const bool was_live = it != statuses_.end() && !IsTerminal(it->second.state);
    live_ += int{!IsTerminal(status.state)} - int{was_live};
    statuses_[status.request_id] = status;
    if (IsTerminal(status.state)) reports_.push_back(status);
  }
  if (IsTerminal(status.state)) ++ended_;
  if (IsTerminal(status.state)) status_cv_.notify_all();
}

Status Engine::Reserve(uint64_t request_id, std::string_view what) {
  MutexLock lock(status_mu_);
  auto [it, fresh] = statuses_.try_emplace(request_id);
  if (!fresh && !IsTerminal(it->second.state)) {
    return Status::InvalidArgument(fmt::format("request {} {}", request_id, what));
  }
  it->second = TransferStatus{request_id, TransferState::kInit, Status::Ok(), 0, 0};
  ++live_;
  return Status::Ok();
}

std::vector<TransferStatus> Engine::PollStatuses(size_t at_least, Deadline deadline) {
  MutexLock lock(status_mu_);
  lock.WaitUntil(status_cv_, deadline,
                 [&]() REQUIRES(status_mu_) { return reports_.size() >= at_least; });
  std::vector<TransferStatus> out(reports_.begin(), reports_.end());
  reports_.clear();
  // Terminal requests leave the table once reported; Query then says not found.
  for (const TransferStatus& s : out) {
    auto it = statuses_.find(s.request_id);
    if (it != statuses_.end() && IsTerminal(it->second.state)) statuses_.erase(it);
  }
  return out;
}

StatusOr<TransferStatus> Engine::QueryStatus(uint64_t request_id) const {
  MutexLock lock(status_mu_);
  auto it = statuses_.find(request_id);
  if (it == statuses_.end()) {
    return Status::NotFound(
        fmt::format("request {} is unknown here (never seen, or already polled)", request_id));
  }
  return it->second;
}

TransceiverMetrics Engine::Metrics(std::string side) const {
  TransceiverMetrics m;
  m.side = std::move(side);
  m.transport = std::string(transport_->caps().name);
  m.data_path = std::string(SideDataPath(paths_, used_paths_.load(std::memory_order_relaxed)));
  metrics_.Fill(m);
  m.live_requests = live_.load();
  m.staging_slots_in_use = slots_.in_use();
  m.staging_slots = options_.staging_chunks;
  m.busy_cpu_seconds = static_cast<double>(busy_cpu_ns_.load()) / 1e9;
  m.profile = profile_.Snapshot();
  MutexLock lock(cmd_mu_);
  m.command_queue = static_cast<int64_t>(commands_.size());
  return m;
}

void Engine::SendMsg(PeerId peer, const ControlMsg& msg) {
  ProfileScope timed(&profile_, ProfilePhase::kSendControl);
  profile_.Count(ProfileCounter::kControlSent);
  auto bytes = EncodeMessage(msg);
  Status st = transport_->SendControl(peer, bytes);
  if (!st.ok())
    Log(LogLevel::kWarn, "transceiver: control message to peer {} failed: {}", peer, st.ToString());
}

InstanceDesc Engine::SelfDesc() const {
  InstanceDesc d;
  d.shape = pool_.shape();
  d.parallel = pool_.spec().parallel;
  d.parallel.dp_rank = pool_.slice().dp_group;
  d.layout = pool_.spec().layout;
  d.pool_blocks = pool_.blocks();
  return d;
}

int64_t Engine::plan_budget() const {
  int64_t bytes = options_.chunk_bytes * options_.staging_chunks;  // allocated: it fit
  for (int32_t i = 0; i < pool_.num_regions(); ++i) bytes += pool_.region_size(i);
  return bytes;
}

}  // namespace kvferry
