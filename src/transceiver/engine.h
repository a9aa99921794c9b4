// Engine: what the context and generation sides share. One progress thread owns the transport
// and the pack/unpack stream; public calls reach it through a command queue (Call) and read
// results from a status table guarded by a mutex. Staging memory is a fixed set of chunk-sized
// slots allocated once; device events for pack/unpack come from a reused pool. Both are handed out
// only as move-only leases (transceiver/leases.h) that give them back when they go. The engine is
// the host of the pairs' data paths (paths/data_path.h PathHost): their resources, and what this
// rank's paths can do (paths/choose.h LocalPaths, set up at Start).
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "base/thread_annotations.h"
#include "device/peer_memory.h"
#include "kvferry/pool.h"
#include "kvferry/transceiver.h"
#include "kvferry/transport.h"
#include "planner/planner.h"
#include "transceiver/leases.h"
#include "transceiver/paths/choose.h"
#include "transceiver/paths/data_path.h"
#include "transceiver/paths/pack.h"
#include "transceiver/paths/peer_memory.h"
#include "transceiver/progress_profile.h"
#include "transceiver/progress_wakeup.h"
#include "transceiver/rma.h"
#include "transceiver/side_metrics.h"
#include "transceiver/wire/messages.h"

namespace kvferry {

struct EngineOptions {
  std::chrono::milliseconds timeout;
  int64_t chunk_bytes;
  int64_t staging_chunks;
  int64_t direct_min_bytes;
  int64_t max_inflight;
  std::chrono::milliseconds unknown_request_wait;
  std::chrono::milliseconds abort_grace;
  std::chrono::microseconds spin;  // polling with operations in flight before napping
  // The nap of a progress thread whose side waits only for its stream (transfer.stream_nap_us).
  std::chrono::microseconds stream_nap;
  // The nap of a generation progress thread waiting only for peer-memory pairs' messages
  // (transfer.peer_wait_nap_us).
  std::chrono::microseconds peer_wait_nap;
  std::array<uint8_t, 16> secret;
  uint64_t instance_id;
  bool rma;  // use one-sided puts where both transports can
  int64_t rma_row_min_bytes;
  bool checksum;  // ask for (generation) per-chunk checksums
  // Offer / use mapped peer pools on the one-sided path (transfer.peer_memory, choose.h).
  using PeerMemory = PeerMemoryMode;
  PeerMemory peer_memory;
  bool profile = false;  // transfer.profile: time the progress thread's phases
  int64_t peer_batch_bytes = int64_t{1} << 30;  // transfer.peer_batch_bytes
  bool peer_merge_pairs = true;                 // transfer.peer_merge_pairs
  int64_t peer_hold_launches = 0;               // transfer.peer_hold_launches (-1 resolved)
  int64_t peer_max_mapped = 1024;               // transfer.peer_max_mapped
};

// The options of a side on `device`: `options` where set, else the transfer.* knobs.
EngineOptions ResolveOptions(const TransceiverOptions& options, const Device& device);
StatusOr<std::unique_ptr<Transport>> MakeTransport(const TransceiverOptions& options,
                                                   const Device& device);

class Engine : public PathHost {
 public:
  Engine(Device& device, const BlockPool& pool, EngineOptions options,
         std::unique_ptr<Transport> transport);
  ~Engine() override;
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Allocates staging and the stream, then starts the progress thread.
  Status Start();
  // Stops the progress thread after OnStop drained every operation (bounded by the timeout).
  void Stop();

  std::vector<TransferStatus> PollStatuses(size_t at_least, Deadline deadline);
  // Claims `request_id` for a request a public call starts asynchronously (its first status,
  // kInit, set here on the caller's thread; the progress thread's SetStatus calls follow):
  // kInvalidArgument with `what` when a request of that id is live on this side.
  Status Reserve(uint64_t request_id, std::string_view what);
  TransceiverStats Stats() const {
    return TransceiverStats{ended_.load(), busy_cpu_ns_.load() / 1e9, live_.load(), slots_.in_use(),
                            thread_cpu_ns_.load() / 1e9};
  }
  StatusOr<TransferStatus> QueryStatus(uint64_t request_id) const;
  // Metrics (kvferry/metrics.h): `side` is "context" or "generation".
  TransceiverMetrics Metrics(std::string side) const;
  std::vector<RequestTimeline> Timelines() const { return metrics_.Timelines(); }

  // Runs `fn` on the progress thread and returns its result.
  template <typename F>
  auto Call(F&& fn) -> decltype(fn()) {
    using R = decltype(fn());
    auto task = std::make_shared<std::packaged_task<R()>>(std::forward<F>(fn));
    auto result = task->get_future();
    Post([task] { (*task)(); });
    return result.get();
  }

  // Regions mapped now, as of the progress thread's last change (any thread; tests).
  size_t mapped_peer_regions() const { return mapped_count_.load(std::memory_order_relaxed); }

 protected:
  // Progress-thread hooks.
  virtual void OnControl(PeerId from, ControlMsg msg) = 0;
  virtual bool Advance() = 0;
  virtual void OnTick(Clock::time_point now) = 0;
  // Ends every live request (kCancelled, "shutting down") and returns true once nothing is in
  // flight any more.
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
  virtual std::chrono::microseconds QuietNap() const { return {}; }
  // Whether a peer's control message ends such a nap. Listening arms the transport, and then
  // every message a peer sends wakes this thread from its sender's progress loop (UCX: a system
  // call and a wake-up of the sleeping thread, 10-35 us of the sender's CPU per message measured
  // on the 2-core machine). The context side does not listen while its stream copies: a FETCH or
  // DONE that comes meanwhile waits for the stream callback or the nap. The generation side
  // listens only with one request live (its latency is all there is to win); with several, their
  // messages come often and are taken together at the nap.
  virtual bool QuietNapHearsPeers() const { return true; }

  void Post(std::function<void()> fn);
  void SetStatus(const TransferStatus& status);

  // PathHost: the resources a pair's data path uses.
  Transport& transport() override { return *transport_; }
  Stream& stream() override { return *stream_; }
  const BlockPool& pool() const override { return pool_; }
  void SendMsg(PeerId peer, const ControlMsg& msg) override;
  // A chunk of the request is in place (RequestTimeline says when per side); `started` is when
  // its pack or receive began.
  void NoteChunk(uint64_t request_id, int64_t bytes, Clock::time_point started) override {
    metrics_.OnChunk(request_id, bytes, started);
  }
  // A staging slot (an empty lease when none is free) and its bytes (chunk_bytes of them).
  StagingLease AcquireSlot() override { return slots_.Acquire(); }
  std::byte* SlotData(const StagingLease& slot) const override {
    return staging_.data() + slot.index() * options_.chunk_bytes;
  }
  // A pooled device event (an empty lease when none can be made).
  EventLease AcquireEvent() override { return events_.Acquire(); }
  EventPool& event_pool() override { return events_; }
  // The memory kind a transport is told for the pool, and whether chunks may move pool to pool.
  MemoryKind pool_wire_kind() const override { return pool_wire_kind_; }
  bool direct_ok() const override { return direct_ok_; }
  MemoryKind staging_wire_kind() const override { return staging_wire_kind_; }
  // Metrics' data_path says peer memory once a pair used it.
  void NotePathUsed(DataPathKind kind) override {
    used_paths_.fetch_or(1u << static_cast<unsigned>(kind), std::memory_order_relaxed);
  }
  InstanceDesc SelfDesc() const;
  // The memory a plan made from a peer's FETCH or handle may take: this rank's pool and staging
  // bytes (PlanInput::max_plan_bytes).
  int64_t plan_budget() const;
  // The most chunks such a plan may have (PlanInput::max_chunks): the budget in chunks of this
  // rank's own size, times kPeerChunkSlack.
  int64_t plan_chunk_cap() const { return PlanChunkCap(plan_budget(), options_.chunk_bytes); }
  // What this rank's data paths can do (paths/choose.h): the pool and staging registered for
  // one-sided access, or why not; the pool regions exported as peer memory (revoked when the side
  // goes).
  const LocalPaths& local_paths() const { return paths_; }
  // The peer pools this rank mapped, by handle: at most transfer.peer_max_mapped regions not in
  // use by a pair, the least recently used unmapped first, and those of an exporter that exited
  // (or revoked its export) unmapped within a second (SweepPeerMappings). An unmapped region goes
  // only once this side's stream passed every copy queued before (an abandoned pair's copies).
  // The mappings of `handles` (one per region), or why they can't be mapped.
  StatusOr<MappedPeerPool> MapPeerPool(const std::vector<std::vector<std::byte>>& handles);
  // Unmaps what the bound and the exporters' ends ask for; does something at most once a second.
  void SweepPeerMappings(Clock::time_point now);
  // Wakes the progress thread when the stream reaches the work queued on it so far (the end of
  // a peer-memory batch), so that a thread napping up to stream_nap notices it at once. CPU device
  // only (a stream callback is one more task there; on a GPU it would be a host function launch).
  void WakeAtStreamEnd();
  MemoryKind staging_kind() const { return staging_.kind(); }
  // Where the progress thread's CPU goes (transfer.profile; inert when off).
  ProgressProfile* profile() { return &profile_; }
  bool host_visible_pool() const { return pool_wire_kind_ != MemoryKind::kDevice; }
  // The chunk digest of `chunk`'s bytes in this rank's pool (the context side reads its source,
  // the generation side its destination), computed where they are (rma.h, ChunkDigester): on a
  // GPU pool, waits for the side's stream up to the request timeout.
  StatusOr<uint64_t> ChunkDigest(const Chunk& chunk, bool context_side) override {
    return digester_.Of(chunk, context_side, pool_, host_visible_pool(), device_, *stream_,
                        Clock::now() + options_.timeout);
  }

  Device& device_;
  const BlockPool& pool_;
  const EngineOptions options_;
  std::unique_ptr<Transport> transport_;
  std::unique_ptr<Stream> stream_;

 private:
  void Run();

  Buffer staging_;
  StagingPool slots_;  // progress thread (in_use(): any thread)
  EventPool events_;   // progress thread
  MemoryKind pool_wire_kind_ = MemoryKind::kHost;
  MemoryKind staging_wire_kind_ = MemoryKind::kHost;
  bool direct_ok_ = true;
  LocalPaths paths_;
  ChunkDigester digester_;               // progress thread
  std::atomic<unsigned> used_paths_{0};  // bit DataPathKind: a pair of this side used it
  struct MappedPeer {
    std::shared_ptr<PeerMapping> mapping;  // use_count() > 1: a pair holds it
    std::unique_ptr<ExporterWatch> watch;
    uint64_t last_use = 0;
  };
  // An unmapped region waiting for the stream to pass `passed` (recorded when it was unmapped).
  struct RetiredMapping {
    std::shared_ptr<PeerMapping> mapping;
    std::unique_ptr<Event> passed;
  };
  void RetireMapping(std::shared_ptr<PeerMapping> mapping);
  // Evicts least recently used unheld regions until at most `keep` remain (or none is unheld).
  void EvictMappings(size_t keep);
  std::map<std::vector<std::byte>, MappedPeer> mapped_;  // progress thread
  std::vector<RetiredMapping> retired_;                  // progress thread
  uint64_t map_uses_ = 0;                                // progress thread: LRU clock
  std::atomic<size_t> mapped_count_{0};                  // mapped_.size()
  Clock::time_point next_sweep_{};                       // progress thread
  std::map<std::vector<std::byte>, Status> unmappable_;  // progress thread: why each did not map

  // Sleeps until a control message, a Post or a nap's end (null: the transport has no wakeup
  // fd; the loop naps on cmd_cv_).
  std::unique_ptr<ProgressWakeup> wakeup_;
  mutable Mutex cmd_mu_;
  std::condition_variable cmd_cv_;
  std::deque<std::function<void()>> commands_ GUARDED_BY(cmd_mu_);
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> busy_cpu_ns_{0};    // progress-thread CPU in iterations that did work
  std::atomic<int64_t> thread_cpu_ns_{0};  // all progress-thread CPU, as of its latest iteration
  ProgressProfile profile_;
  std::atomic<int64_t> ended_{0};
  std::atomic<int64_t> live_{0};  // requests whose last status is not terminal
  std::thread thread_;

  mutable Mutex status_mu_;
  std::condition_variable status_cv_;
  std::map<uint64_t, TransferStatus> statuses_ GUARDED_BY(status_mu_);
  std::deque<TransferStatus> reports_ GUARDED_BY(status_mu_);  // terminal, not yet polled
  SideMetrics metrics_;
};

}  // namespace kvferry
