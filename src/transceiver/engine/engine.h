// Engine: the parts a side (context or generation) is made of, held by the side as a member and
// put together here once: the progress loop (engine/progress_loop.h: the thread, its command
// queue and naps), the status table (engine/status_table.h: what Poll and Query read), and the
// resources its pairs' data paths use (PathHost, paths/data_path.h): the transport, the
// pack/unpack stream, staging memory as a fixed set of chunk-sized slots and device events from
// a reused pool (both handed out only as move-only leases, engine/leases.h), the registrations of
// the pool and staging for one-sided access and the pool's peer-memory export (paths/choose.h
// LocalPaths), and the peer pools mapped (paths/peer_mappings.h). The side drives the loop
// (EngineSide) and answers for its requests; the engine knows nothing of requests or pairs.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "device/peer_memory.h"
#include "kvferry/pool.h"
#include "kvferry/transceiver.h"
#include "kvferry/transport.h"
#include "planner/planner.h"
#include "transceiver/engine/leases.h"
#include "transceiver/engine/progress_loop.h"
#include "transceiver/engine/progress_profile.h"
#include "transceiver/engine/status_table.h"
#include "transceiver/paths/choose.h"
#include "transceiver/paths/data_path.h"
#include "transceiver/paths/pack.h"
#include "transceiver/paths/peer_mappings.h"
#include "transceiver/paths/peer_memory.h"
#include "transceiver/rma.h"
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
  // transfer.wire_version: kMessageVersion (negotiates with older peers) or the previous one
  // (behaves as a build of that version: rolling-upgrade tests).
  uint8_t wire_version = kMessageVersion;
  KvScales kv_scales;  // TransceiverOptions::kv_scales
};

// The options of a side on `device`: `options` where set, else the transfer.* knobs.
EngineOptions ResolveOptions(const TransceiverOptions& options, const Device& device);
// The side's KV scales fit its pool: as many as the shape takes, and per block only where the
// pool holds them (BlockPool::block_scales). `side` names it in the error.
Status CheckSideScales(std::string_view side, const KvScales& scales, const BlockPool& pool);
StatusOr<std::unique_ptr<Transport>> MakeTransport(const TransceiverOptions& options,
                                                   const Device& device);

// What the engine asks of the side that holds it: the progress loop's steps, and the end of a
// request one of its pairs' data paths failed.
class EngineSide : public ProgressHandler {
 public:
  // Ends the request with an error at once (ABORT to its pairs, operations cancelled).
  virtual void Fail(PathRequest& r, Status why) = 0;
  // The same for the live request `request_id`, when it is not ending yet.
  virtual void FailById(uint64_t request_id, const Status& why) = 0;

 protected:
  ~EngineSide() = default;
};

class Engine final : public PathHost {
 public:
  // `side` holds the engine: it must outlive Stop.
  Engine(Device& device, const BlockPool& pool, EngineOptions options,
         std::unique_ptr<Transport> transport, EngineSide& side);
  ~Engine() override;
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Allocates staging, the stream and the data paths' registrations, then starts the progress
  // loop on the side.
  Status Start();
  // Stops the progress loop after the side's OnStop drained every operation (bounded by the
  // timeout). The side calls it first thing in its destructor: nothing of the side runs after.
  void Stop() { loop_.Stop(); }

  // The parts.
  const EngineOptions& options() const { return options_; }
  ProgressLoop& loop() { return loop_; }
  StatusTable& statuses() { return statuses_; }
  const StatusTable& statuses() const { return statuses_; }
  ProgressProfile* profile() { return &profile_; }
  // What this rank's data paths can do (paths/choose.h): the pool and staging registered for
  // one-sided access, or why not; the pool regions exported as peer memory (revoked when the side
  // goes).
  const LocalPaths& local_paths() const { return paths_; }
  // The peer pools this rank mapped (context side; set up at Start).
  PeerMappings& peer_mappings() { return *mappings_; }

  // The transport's address, as peers connect to it.
  std::string address() const { return address_; }
  TransceiverStats Stats() const;
  // Metrics (kvferry/metrics.h): `side` is "context" or "generation".
  TransceiverMetrics Metrics(std::string side) const;
  // Peer pool regions mapped now (any thread; tests).
  size_t mapped_peer_regions() const { return mappings_ ? mappings_->count() : 0; }

  // This rank's instance as a handle or FETCH describes it.
  InstanceDesc SelfDesc() const;
  // The memory a plan made from a peer's FETCH or handle may take: this rank's pool and staging
  // bytes (PlanInput::max_plan_bytes).
  int64_t plan_budget() const;
  // The most chunks such a plan may have (PlanInput::max_chunks): the budget in chunks of this
  // rank's own size, times kPeerChunkSlack.
  int64_t plan_chunk_cap() const { return PlanChunkCap(plan_budget(), options_.chunk_bytes); }
  // Wakes the progress thread when the stream reaches the work queued on it so far (the end of
  // a peer-memory batch), so that a thread napping up to stream_nap notices it at once. CPU device
  // only (a stream callback is one more task there; on a GPU it would be a host function launch).
  void WakeAtStreamEnd();
  bool host_visible_pool() const { return pool_wire_kind_ != MemoryKind::kDevice; }
  bool cpu_device() const { return device_.info().platform == "cpu"; }

  // PathHost: the resources a pair's data path uses, and the side's answers.
  Transport& transport() override { return *transport_; }
  Stream& stream() override { return *stream_; }
  const BlockPool& pool() const override { return pool_; }
  void SendMsg(PeerId peer, const ControlMsg& msg) override;
  // The control-message version a pair with `peer` speaks (PeerVersions; progress thread), for
  // behaviour that differs between versions.
  uint8_t PairVersion(PeerId peer) const { return versions_.PairVersion(peer); }
  // Why `peer` was refused (its wire versions do not meet ours), when it was (progress thread).
  std::optional<Status> PeerRefusal(PeerId peer) const { return versions_.Refusal(peer); }
  void NoteChunk(uint64_t request_id, int64_t bytes, Clock::time_point started) override {
    statuses_.metrics().OnChunk(request_id, bytes, started);
  }
  StagingLease AcquireSlot() override { return slots_.Acquire(); }
  std::byte* SlotData(const StagingLease& slot) const override {
    return staging_.data() + slot.index() * options_.chunk_bytes;
  }
  EventLease AcquireEvent() override { return events_.Acquire(); }
  EventPool& event_pool() override { return events_; }
  MemoryKind pool_wire_kind() const override { return pool_wire_kind_; }
  MemoryKind staging_wire_kind() const override { return staging_wire_kind_; }
  bool direct_ok() const override { return direct_ok_; }
  // Computed where the bytes are (rma.h, ChunkDigester): on a GPU pool, waits for the side's
  // stream up to the request timeout.
  StatusOr<uint64_t> ChunkDigest(const Chunk& chunk, bool context_side) override {
    return digester_.Of(chunk, context_side, pool_, host_visible_pool(), device_, *stream_,
                        Clock::now() + options_.timeout);
  }
  StatusOr<uint64_t> PackedDigest(const Chunk& chunk, const StagingLease& slot) override {
    return digester_.OfPacked(chunk, SlotData(slot), staging_wire_kind_ != MemoryKind::kDevice,
                              device_, *stream_, Clock::now() + options_.timeout);
  }
  void Fail(PathRequest& r, Status why) override { side_.Fail(r, std::move(why)); }
  void FailById(uint64_t request_id, const Status& why) override {
    side_.FailById(request_id, why);
  }
  void NotePathUsed(DataPathKind kind) override {
    used_paths_.fetch_or(1u << static_cast<unsigned>(kind), std::memory_order_relaxed);
  }

 private:
  // Start's steps.
  Status AllocateStaging();
  void SetUpPaths();

  Device& device_;
  const BlockPool& pool_;
  const EngineOptions options_;
  EngineSide& side_;
  std::unique_ptr<Transport> transport_;
  std::string address_;
  ProgressProfile profile_;
  PeerVersions versions_;  // progress thread
  StatusTable statuses_;
  std::unique_ptr<Stream> stream_;
  Buffer staging_;
  StagingPool slots_;  // progress thread (in_use(): any thread)
  EventPool events_;   // progress thread
  MemoryKind pool_wire_kind_ = MemoryKind::kHost;
  MemoryKind staging_wire_kind_ = MemoryKind::kHost;
  bool direct_ok_ = true;
  LocalPaths paths_;
  ChunkDigester digester_;                  // progress thread
  std::unique_ptr<PeerMappings> mappings_;  // progress thread (count(): any thread)
  std::atomic<unsigned> used_paths_{0};     // bit DataPathKind: a pair of this side used it
  // Last: it goes first, so nothing runs on the thread once the parts go.
  ProgressLoop loop_;
};

// The public calls both sides answer the same way, written once: `Side` (the implementation
// class, deriving from this) has `engine_` and kName ("context", "generation").
template <typename Api, typename Side>
class SideSurface : public Api {
 public:
  std::string address() const final { return engine().address(); }
  std::vector<TransferStatus> Poll(size_t at_least, Deadline deadline) final {
    return engine().statuses().Poll(at_least, deadline);
  }
  StatusOr<TransferStatus> Query(uint64_t id) const final { return engine().statuses().Query(id); }
  TransceiverStats stats() const final { return engine().Stats(); }
  TransceiverMetrics metrics() const final { return engine().Metrics(std::string(Side::kName)); }
  std::vector<RequestTimeline> timelines() const final {
    return engine().statuses().metrics().Timelines();
  }

 private:
  Engine& engine() { return static_cast<Side*>(this)->engine_; }
  const Engine& engine() const { return static_cast<const Side*>(this)->engine_; }
};

}  // namespace kvferry
