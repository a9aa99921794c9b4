// TransferManager, device staging (DeviceStaging in include/kvferry/tiering.h): primary <-> host
// copies of blocks that the primary layout scatters into many small fragments go in two legs, a
// device-local leg (gather into packed staging for offloads, scatter out of it for onboards: device
// memory at device speed) and a link leg that crosses PCIe as one contiguous copy per block on the
// copy engine (host tier packed per block), or from one contiguous block (a fragmented host tier).
//
// Why two streams. Measured on the H200 (docs/tiering.md), a per-layer block's 16-32 KiB device
// fragments hold offload + onboard at once at ~67 GB/s whatever carries them (the gather kernel,
// the copy engines, a packed host side), against 90+ for 2 MiB blocks. The two legs of one chunk
// depend on each other, but the device leg of chunk k+1 does not depend on the link leg of chunk
// k: each copy stream's staging is two halves, the link leg runs on the copy stream and the device
// leg on the stream's pack stream, and events hand a half from one to the other. The link then
// waits for a device leg only at a batch's first chunk (a few microseconds of device copy for
// milliseconds of link copy).
//
// Ordering. The copy stream's waits for earlier batches are enqueued before CopyStaged runs; the
// pack stream first waits for an event recorded behind them (stage_start), so both legs are
// ordered after what the batch depends on. An offload's last leg is on the copy stream; an
// onboard's is on the pack stream, so the copy stream waits for it before the batch's event is
// recorded. Either way the copy stream's work at the next batch covers every use of the halves,
// and the next batch's pack stream waits for it.
#include <fmt/format.h>

#include "tiering/transfer_manager_impl.h"

namespace kvferry {

StatusOr<size_t> TransferManager::Impl::CopyStaged(int stream, Tier from, Tier to,
                                                   std::span<const BlockMove> moves,
                                                   std::span<const int32_t> toks,
                                                   std::vector<CopyDesc>& desc, int64_t* bytes) {
  Stream& link = *streams[stream];
  Stream& pack = *pack_streams[stream];
  const bool offload = to == Tier::kHost;
  const tiering::TierView& sv = views[static_cast<int>(from)];
  const tiering::TierView& dv = views[static_cast<int>(to)];
  const tiering::TierView& st = dstaging_view[stream];
  const size_t chunk = static_cast<size_t>(dstaging_half);
  KVF_RETURN_IF_ERROR(link.Record(*stage_start[stream]));
  KVF_RETURN_IF_ERROR(pack.Wait(*stage_start[stream]));
  size_t descs = 0;
  int last_half = -1;
  for (size_t at = 0, k = 0; at < moves.size(); at += chunk, ++k) {
    const size_t n = std::min(moves.size() - at, chunk);
    const int h = static_cast<int>(k % 2);
    const int64_t base = h * dstaging_half;
    auto slot = [base](size_t i) { return base + static_cast<int64_t>(i); };
    auto src_of = [&](size_t i) { return moves[at + i].src; };
    auto dst_of = [&](size_t i) { return moves[at + i].dst; };
    const std::span<const int32_t> chunk_toks = toks.subspan(at, n);
    Event& ready = *half_ready[stream][h];
    Event& freed = *half_free[stream][h];
    // Leg 1 into the half (pack: gather; link: copy from the host), leg 2 out of it.
    Stream& first = offload ? pack : link;
    Stream& second = offload ? link : pack;
    if (k >= 2) KVF_RETURN_IF_ERROR(first.Wait(freed));  // chunk k-2 is done with this half
    desc.clear();
    int64_t ignored = 0;
    Plan(sv, st, n, src_of, slot, chunk_toks, desc, bytes);
    if (!desc.empty()) KVF_RETURN_IF_ERROR(first.CopyBatch(desc));
    descs += desc.size();
    KVF_RETURN_IF_ERROR(first.Record(ready));
    KVF_RETURN_IF_ERROR(second.Wait(ready));
    desc.clear();
    Plan(st, dv, n, slot, dst_of, chunk_toks, desc, &ignored);
    if (!desc.empty()) KVF_RETURN_IF_ERROR(second.CopyBatch(desc));
    descs += desc.size();
    KVF_RETURN_IF_ERROR(second.Record(freed));
    last_half = h;
  }
  // An onboard's last scatter ran on the pack stream: the batch's event (recorded on the copy
  // stream) must cover it. Only the newest one: the pack stream runs its scatters in order.
  if (!offload && last_half >= 0) {
    KVF_RETURN_IF_ERROR(link.Wait(*half_free[stream][last_half]));
  }
  return descs;
}

Status TransferManager::Impl::SetUpDeviceStaging(const TransferOptions& o) {
  if (pools[1] == nullptr || o.device_staging == DeviceStaging::kNever) return Status::Ok();
  if (o.device_staging == DeviceStaging::kAuto && device->info().platform == "cpu") {
    return Status::Ok();  // host memory both sides: staging is only an extra copy
  }
  if (o.device_staging_blocks <= 0) {
    return Status::InvalidArgument(fmt::format(
        "transfer manager: device_staging_blocks={} must be positive", o.device_staging_blocks));
  }
  // Two halves that alternate; a half is one chunk of a batch.
  const int64_t half = std::max<int64_t>(1, o.device_staging_blocks / 2);
  KVF_ASSIGN_OR_RETURN(PoolLayout packed, tiering::PackedLayoutLike(pools[1]->layout(), 2 * half));
  // Staging pays when a primary block is several fragments. With a host block that is one range
  // (staged in the host's own order) the link sees one copy per block: auto and always. With a
  // fragmented host block (only `always`), blocks are staged in the primary's own order: the link
  // leg keeps the host side's fragments but reads one contiguous block on the device.
  // auto also wants the device-local leg to move runs of at least kMinAutoRun bytes: a host tier
  // that transposes the primary's in-block order (per-layer NHD into block-major HND) makes it
  // 256-byte rows, measured slower than the direct copy (H200: 56 vs 68.5 GB/s both ways).
  constexpr size_t kMinAutoRun = 4096;
  std::byte* fake[1] = {nullptr};
  tiering::TierView pv = views[0], hv = views[1], sv{&packed, fake};
  std::vector<CopyDesc> probe;
  const int64_t tpb = pools[0]->shape().tokens_per_block;
  const size_t direct = tiering::AppendRunCopies(pv, 0, hv, 0, 1, tpb, probe);
  const size_t link = tiering::AppendRunCopies(sv, 0, hv, 0, 1, tpb, probe);
  if (direct <= 1) return Status::Ok();
  if (link != 1) {
    if (o.device_staging != DeviceStaging::kAlways) return Status::Ok();
    KVF_ASSIGN_OR_RETURN(packed, tiering::PackedLayoutLike(pools[0]->layout(), 2 * half));
  } else if (o.device_staging == DeviceStaging::kAuto) {
    probe.clear();
    tiering::AppendRunCopies(pv, 0, sv, 0, 1, tpb, probe);
    for (const CopyDesc& c : probe) {
      if (c.bytes < kMinAutoRun) return Status::Ok();
    }
  }
  dstaging_layout = std::move(packed);
  for (int i = 0; i < 2; ++i) {
    KVF_ASSIGN_OR_RETURN(
        dstaging[i],
        device->Allocate(MemoryKind::kDevice, static_cast<size_t>(dstaging_layout->total_bytes())));
    dstaging_region[i][0] = dstaging[i].data();
    dstaging_view[i] = tiering::TierView{&*dstaging_layout, dstaging_region[i]};
    KVF_ASSIGN_OR_RETURN(pack_streams[i], device->CreateStream());
    KVF_ASSIGN_OR_RETURN(stage_start[i], device->CreateEvent());
    for (int h = 0; h < 2; ++h) {
      KVF_ASSIGN_OR_RETURN(half_ready[i][h], device->CreateEvent());
      KVF_ASSIGN_OR_RETURN(half_free[i][h], device->CreateEvent());
    }
  }
  dstaging_blocks = 2 * half;
  dstaging_half = half;
  return Status::Ok();
}

}  // namespace kvferry
