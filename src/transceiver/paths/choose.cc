#include "transceiver/paths/choose.h"

#include <fmt/format.h>

#include "base/log.h"
#include "transceiver/paths/one_sided.h"
#include "transceiver/paths/tagged.h"

namespace kvferry {
namespace {

// The pool and staging registered for puts, or why not (the first rows of the table in choose.h).
void SetUpOneSided(Transport& transport, const BlockPool& pool, const Buffer& staging,
                   MemoryKind pool_wire_kind, MemoryKind staging_wire_kind, bool direct_ok,
                   bool rma_knob, LocalPaths& out) {
  if (!rma_knob) {
    out.rma_why = "transfer.rma is off";
  } else if (!transport.caps().one_sided) {
    out.rma_why = fmt::format("transport {} has no one-sided operations", transport.caps().name);
  } else if (!direct_ok) {
    out.rma_why = fmt::format("transport {} can't reach {} pool memory", transport.caps().name,
                              MemoryKindName(pool.memory()));
  } else {
    auto rma = RegisterForRma(transport, pool, pool_wire_kind, staging.data(), staging.size(),
                              staging_wire_kind);
    if (rma.ok()) {
      out.rma = std::move(rma).value();
    } else {
      out.rma_why = rma.status().ToString();
      Log(LogLevel::kInfo, "transceiver: one-sided path off, tagged messages instead: {}",
          out.rma_why);
    }
  }
}

// auto: GPU pools (CUDA IPC) and CPU-device pools (shared host memory, or ranks of one process);
// a region the device can't share (a wrapped engine region of pinned host memory on a GPU) is
// refused by ExportMemory, and a peer that can't map one falls back to puts.
void SetUpPeerMemory(Device& device, const BlockPool& pool, PeerMemoryMode knob, LocalPaths& out) {
  const bool cpu = device.info().platform == "cpu";
  const bool share = knob == PeerMemoryMode::kOn || (knob == PeerMemoryMode::kAuto &&
                                                     (cpu || pool.memory() == MemoryKind::kDevice));
  if (!out.one_sided() || !share) return;
  const size_t region_bytes = static_cast<size_t>(pool.layout().region_bytes());
  for (int32_t i = 0; i < pool.num_regions(); ++i) {
    auto h = device.ExportMemory(pool.region(i), region_bytes, pool.memory());
    if (!h.ok()) {
      Log(LogLevel::kDebug, "transceiver: pool region {} not shared as peer memory: {}", i,
          h.status().ToString());
      out.exported_pool.clear();
      return;
    }
    out.exported_pool.push_back(std::move(h).value());
  }
  // The per-block scales go last (RmaTarget::peer_pool): a context rank that converts into this
  // pool writes them there.
  if (pool.block_scales() != nullptr) {
    auto h = device.ExportMemory(pool.block_scales(),
                                 static_cast<size_t>(pool.block_scale_count()) * 4, pool.memory());
    if (!h.ok()) {
      Log(LogLevel::kDebug, "transceiver: per-block scales not shared as peer memory: {}",
          h.status().ToString());
      out.exported_pool.clear();
      return;
    }
    out.exported_pool.push_back(std::move(h).value());
  }
}

// The bytes of the generation rank's per-block scales a FETCH names (0 without).
StatusOr<int64_t> PeerScaleBytes(const FetchMsg& f) {
  if (f.scales.granularity != ScaleGranularity::kBlock) return 0;
  KVF_ASSIGN_OR_RETURN(const RankSlice s, SliceOf(f.shape, f.parallel, f.gen_rank));
  return f.pool_blocks * s.layer_count * f.shape.kv_factor * s.head_count * 4;
}

}  // namespace

LocalPaths SetUpLocalPaths(Transport& transport, Device& device, const BlockPool& pool,
                           const Buffer& staging, MemoryKind pool_wire_kind,
                           MemoryKind staging_wire_kind, bool direct_ok, bool rma_knob,
                           PeerMemoryMode peer_knob) {
  LocalPaths out;
  SetUpOneSided(transport, pool, staging, pool_wire_kind, staging_wire_kind, direct_ok, rma_knob,
                out);
  SetUpPeerMemory(device, pool, peer_knob, out);
  return out;
}

std::string_view SideDataPath(const LocalPaths& local, unsigned used_paths) {
  const bool peer_memory_used =
      (used_paths & (1u << static_cast<unsigned>(DataPathKind::kPeerMemory))) != 0;
  return DataPathName(peer_memory_used    ? DataPathKind::kPeerMemory
                      : local.one_sided() ? DataPathKind::kOneSided
                                          : DataPathKind::kTagged);
}

DataPathKind SendPathFor(bool offers_one_sided, bool one_sided_here, bool peer_pool_maps) {
  peer_pool_maps = peer_pool_maps && offers_one_sided && one_sided_here;
  for (const SendPathRow& row : kSendPaths) {
    if (row.offers_one_sided == offers_one_sided && row.one_sided_here == one_sided_here &&
        row.peer_pool_maps == peer_pool_maps)
      return row.path;
  }
  return DataPathKind::kTagged;
}

std::optional<MappedPeerPool> SendPathChooser::MapOffered(const FetchMsg& f) {
  const RmaTarget& target = f.rma_target;
  auto mapped = map_(target.peer_pool);
  Status st = mapped.ok() ? Status::Ok() : mapped.status();
  if (st.ok() && mapped->regions.size() == target.pool.size() + 1) {  // + per-block scales
    mapped->scales = mapped->regions.back();
    mapped->regions.pop_back();
    auto want = PeerScaleBytes(f);
    st = !want.ok() ? want.status()
         : static_cast<int64_t>(mapped->scales->size()) < *want
             ? Status::InvalidArgument(fmt::format(
                   "the generation pool's per-block scales map {} bytes, its FETCH needs {}",
                   mapped->scales->size(), *want))
             : Status::Ok();
  }
  if (st.ok() && f.scales.granularity == ScaleGranularity::kBlock && mapped->scales == nullptr)
    st = Status::InvalidArgument("the generation pool's per-block scales are not offered");
  if (st.ok()) st = CheckPeerPool(mapped->regions, target);
  if (st.ok()) return std::move(mapped).value();
  if (!peer_said_) {
    peer_said_ = true;
    Log(LogLevel::kInfo, "context side: transport puts, not peer memory copies: {}", st.ToString());
  }
  return std::nullopt;
}

StatusOr<std::unique_ptr<SendPath>> SendPathChooser::Choose(FetchMsg& f, bool converts) {
  const bool one_sided = f.rma && local_.one_sided();
  if (one_sided) {
    KVF_RETURN_IF_ERROR(CheckRmaTarget(f));
  } else if (f.rma && !rma_said_) {
    rma_said_ = true;
    Log(LogLevel::kInfo, "context side: tagged data path, not one-sided: {}", local_.rma_why);
  }
  std::optional<MappedPeerPool> mapped;
  if (converts) f.rma_target.row_min_bytes = kNoDirect;
  // A converting pair with checksums sums each chunk packed (OpSendPath::SumPacked): it packs.
  // Per-block generation scales are written into the mapped scales (MapOffered).
  if (one_sided && settings_.peer_knob != PeerMemoryMode::kOff && !f.rma_target.peer_pool.empty() &&
      !(converts && f.checksum))
    mapped = MapOffered(f);
  switch (SendPathFor(f.rma, local_.one_sided(), mapped.has_value())) {
    case DataPathKind::kTagged:
      return std::unique_ptr<SendPath>(std::make_unique<TaggedSend>(settings_.max_inflight));
    case DataPathKind::kOneSided:
      return std::unique_ptr<SendPath>(
          std::make_unique<OneSidedSend>(settings_.max_inflight, std::move(f.rma_target)));
    case DataPathKind::kPeerMemory:
      return std::unique_ptr<SendPath>(
          std::make_unique<PeerMemorySend>(std::move(*mapped), f.checksum, copies_, profile_,
                                           settings_.peer_batch_bytes, settings_.max_inflight));
  }
  return Status::Internal("no data path");
}

PathOffer OfferOf(const LocalPaths& local) {
  return PathOffer{local.one_sided(), local.one_sided() && !local.exported_pool.empty()};
}

void DescribeOffer(const LocalPaths& local, int64_t slot_bytes, uint32_t slots, int64_t row_min,
                   FetchMsg& f) {
  f.rma = local.one_sided();
  if (!f.rma) return;
  f.rma_target = DescribeTarget(local.rma, slot_bytes, slots, row_min);
  f.rma_target.peer_pool = local.exported_pool;
}

std::unique_ptr<RecvPath> RecvPathForOffer(const PathOffer& offer, const RecvSettings& settings) {
  if (!offer.one_sided)
    return std::make_unique<TaggedRecv>(offer, settings.abort_grace, settings.max_inflight);
  return std::make_unique<OneSidedRecv>(offer, settings.abort_grace, settings.max_inflight,
                                        settings.row_min);
}

StatusOr<std::unique_ptr<RecvPath>> RecvPathForAnswer(const RecvPath& current,
                                                      const AcceptMsg& answer,
                                                      const RecvSettings& settings,
                                                      int32_t ctx_rank) {
  const PathOffer& offer = current.offer();
  if (answer.peer_memory) {
    if (current.kind() != DataPathKind::kOneSided || !offer.peer_memory) {
      return Status::InvalidArgument(fmt::format(
          "context rank {} answered peer memory to a fetch that offered none", ctx_rank));
    }
    return std::unique_ptr<RecvPath>(std::make_unique<PeerMemoryRecv>(offer, settings.abort_grace));
  }
  const bool now_one_sided = current.kind() == DataPathKind::kOneSided;
  if (now_one_sided == answer.rma) return std::unique_ptr<RecvPath>();
  if (answer.rma) {
    return Status::InvalidArgument(fmt::format(
        "context rank {} answered one-sided to a fetch that offered no target", ctx_rank));
  }
  // The context rank can't put: receive tagged messages instead. Nothing was put yet.
  return std::unique_ptr<RecvPath>(
      std::make_unique<TaggedRecv>(offer, settings.abort_grace, settings.max_inflight));
}

}  // namespace kvferry
