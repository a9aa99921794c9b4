#include "transceiver/engine/engine.h"

#include <fmt/format.h>

#include <random>

#include "base/log.h"
#include "kvferry/config.h"

namespace kvferry {

Status CheckSideScales(std::string_view side, const KvScales& scales, const BlockPool& pool) {
  if (Status s = scales.Check(pool.shape()); !s.ok())
    return Status::InvalidArgument(fmt::format("{}: {}", side, s.message()));
  if (scales.granularity == ScaleGranularity::kBlock && pool.block_scales() == nullptr) {
    return Status::InvalidArgument(
        fmt::format("{}: kv scales per block, and the pool has none (PoolSpec::block_scales, "
                    "BlockPool::AttachBlockScales)",
                    side));
  }
  return Status::Ok();
}

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
  e.wire_version =
      static_cast<uint8_t>(o.wire_version > 0 ? o.wire_version : c.Int("transfer.wire_version"));
  if (e.peer_hold_launches < 0) e.peer_hold_launches = device.info().platform == "cpu" ? 2 : 0;
  e.secret = o.instance_secret;
  e.instance_id = o.instance_id;
  if (e.instance_id == 0)
    e.instance_id = std::random_device{}() | (uint64_t{std::random_device{}()} << 32);
  e.kv_scales = o.kv_scales;
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
               std::unique_ptr<Transport> transport, EngineSide& side)
    : device_(device),
      pool_(pool),
      options_(options),
      side_(side),
      transport_(std::move(transport)),
      address_(transport_->LocalAddress()),
      profile_(options.profile),
      versions_(options.wire_version),
      events_([this] { return device_.CreateEvent(); }),
      loop_(*transport_, profile_, versions_, LoopOptions{options.spin, options.timeout}) {}

Engine::~Engine() {
  Stop();
  // Copies still queued on the stream read or write staging, the pool and mapped peer pools: the
  // stream drains them when destroyed, which must happen before staging is freed and the peer
  // mappings are closed.
  stream_.reset();
  mappings_.reset();
  // A peer in this process maps these regions no more (the pool may go once the side is gone).
  for (const auto& h : paths_.exported_pool) RevokePeerExport(h);
}

Status Engine::Start() {
  KVF_RETURN_IF_ERROR(AllocateStaging());
  KVF_ASSIGN_OR_RETURN(stream_, device_.CreateStream());
  // Chunk digests of a GPU pool land in pinned memory: allocated now, not behind queued work.
  if (!host_visible_pool()) {
    KVF_RETURN_IF_ERROR(digester_.Reserve(
        device_, static_cast<size_t>(options_.chunk_bytes) / kDigestSegmentBytes + 1024));
  }
  SetUpPaths();
  // The thread binds to the device first (CUDA: its primary context, which the transport's CUDA
  // transports find current when they copy GPU memory).
  loop_.Start(side_, [this] { (void)stream_->Query(); });
  return Status::Ok();
}

Status Engine::AllocateStaging() {
  const bool cpu = cpu_device();
  // GPU memory on the wire: staging there too, unless the transport takes it only one-sided
  // (nixl) and the tagged path is chosen (transfer.rma off).
  const TransportCaps& caps = transport_->caps();
  const bool dev_mem = caps.device_memory && (caps.device_memory_tagged || options_.rma);
  // On the CPU device every kind is host memory; tell transports so.
  pool_wire_kind_ = cpu ? MemoryKind::kHost : pool_.memory();
  direct_ok_ = cpu || pool_.memory() != MemoryKind::kDevice || dev_mem;
  const MemoryKind kind = (!cpu && dev_mem) ? MemoryKind::kDevice : MemoryKind::kPinnedHost;
  staging_wire_kind_ = cpu ? MemoryKind::kHost : kind;
  auto staging = device_.Allocate(kind, options_.chunk_bytes * options_.staging_chunks);
  if (!staging.ok()) return staging.status().WithContext("transceiver staging");
  staging_ = std::move(staging).value();
  slots_.Resize(static_cast<int>(options_.staging_chunks));
  return Status::Ok();
}

void Engine::SetUpPaths() {
  paths_ = SetUpLocalPaths(*transport_, device_, pool_, staging_, pool_wire_kind_,
                           staging_wire_kind_, direct_ok_, options_.rma, options_.peer_memory);
  mappings_ = std::make_unique<PeerMappings>(device_, *stream_, profile_, options_.peer_max_mapped);
}

void Engine::WakeAtStreamEnd() {
  if (!cpu_device()) return;
  // The callback runs on the stream's thread; ~Engine drains the stream before any member goes.
  (void)stream_->HostCallback([this] { loop_.Post([] {}); });
}

TransceiverStats Engine::Stats() const {
  return TransceiverStats{statuses_.ended(), loop_.busy_cpu_ns() / 1e9, statuses_.live(),
                          slots_.in_use(), loop_.thread_cpu_ns() / 1e9};
}

TransceiverMetrics Engine::Metrics(std::string side) const {
  TransceiverMetrics m;
  m.side = std::move(side);
  m.transport = std::string(transport_->caps().name);
  m.data_path = std::string(SideDataPath(paths_, used_paths_.load(std::memory_order_relaxed)));
  statuses_.metrics().Fill(m);
  m.live_requests = statuses_.live();
  m.staging_slots_in_use = slots_.in_use();
  m.staging_slots = options_.staging_chunks;
  m.busy_cpu_seconds = static_cast<double>(loop_.busy_cpu_ns()) / 1e9;
  m.profile = profile_.Snapshot();
  m.command_queue = loop_.queued();
  return m;
}

void Engine::SendMsg(PeerId peer, const ControlMsg& msg) {
  ProfileScope timed(&profile_, ProfilePhase::kSendControl);
  profile_.Count(ProfileCounter::kControlSent);
  if (versions_.Refusal(peer)) return;  // it can't read us: the refusal was logged once
  if (auto hello = versions_.HelloFor(peer)) (void)transport_->SendControl(peer, *hello);
  auto bytes = EncodeMessage(msg, versions_.SendVersion(peer));
  Status st = transport_->SendControl(peer, bytes);
  if (!st.ok())
    Log(LogLevel::kWarn, "transceiver: control message to peer {} failed: {}", peer, st.ToString());
}

InstanceDesc Engine::SelfDesc() const {
  InstanceDesc d;
  d.shape = pool_.shape();
  d.parallel = pool_.spec().parallel;
  d.parallel.dp_rank = pool_.slice().dp_group;
  DescribeLayout(pool_.layout(), d);
  d.pool_blocks = pool_.blocks();
  d.scales = options_.kv_scales;
  return d;
}

int64_t Engine::plan_budget() const {
  int64_t bytes = options_.chunk_bytes * options_.staging_chunks;  // allocated: it fit
  for (int32_t i = 0; i < pool_.num_regions(); ++i) bytes += pool_.region_size(i);
  return bytes;
}

}  // namespace kvferry
