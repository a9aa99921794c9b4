#include "transceiver/paths/pack.h"

#include "transceiver/paths/data_path.h"
#include "transceiver/rma.h"

namespace kvferry {

void ChunkCopies(const Chunk& chunk, bool context_side, const BlockPool& pool, std::byte* packed,
                 bool to_packed, std::vector<CopyDesc>& out, int64_t row_min_bytes) {
  out.clear();
  int64_t off = 0;
  // Per-block scales written at the generation side, packed after the rows (Chunk::scale_bytes).
  auto* const packed_scales = reinterpret_cast<float*>(packed + chunk.scale_area_offset());
  int64_t scale = 0;
  for (const Piece& p : chunk.pieces) {
    if (RowsGoDirect(chunk, p, row_min_bytes)) continue;
    int32_t region = context_side ? p.src_region : p.dst_region;
    int64_t offset = context_side ? p.src_offset : p.dst_offset;
    int64_t pitch = context_side ? p.src_pitch : p.dst_pitch;
    int64_t plane_pitch = context_side ? p.src_plane_pitch : p.dst_plane_pitch;
    std::byte* pool_addr = pool.region(region) + offset;
    std::byte* buf = packed + off;
    CopyDesc d{};
    d.bytes = static_cast<size_t>(p.bytes);
    d.rows = static_cast<size_t>(p.rows);
    d.planes = static_cast<size_t>(p.planes);
    const size_t packed_plane = static_cast<size_t>(p.rows * p.bytes);
    if (to_packed) {
      d.src_scale = p.src_scale;  // used when packing converts (ConvertBatch)
      d.dst_scale = p.dst_scale;
      if (p.src_scale_at >= 0) d.src_scales = pool.block_scales() + p.src_scale_at;
      if (p.dst_scale_at >= 0) d.dst_scales = packed_scales + scale;
      d.dst = buf;
      d.dst_pitch = static_cast<size_t>(p.bytes);
      d.dst_plane_pitch = packed_plane;
      d.src = pool_addr;
      d.src_pitch = static_cast<size_t>(pitch);
      d.src_plane_pitch = static_cast<size_t>(plane_pitch);
    } else {
      d.dst = pool_addr;
      d.dst_pitch = static_cast<size_t>(pitch);
      d.dst_plane_pitch = static_cast<size_t>(plane_pitch);
      d.src = buf;
      d.src_pitch = static_cast<size_t>(p.bytes);
      d.src_plane_pitch = packed_plane;
    }
    out.push_back(d);
    off += p.total();
    if (p.dst_scale_at >= 0 && !to_packed) {  // the scales, after the rows: one run per piece
      CopyDesc s{};
      s.src = packed_scales + scale;
      s.dst = pool.block_scales() + p.dst_scale_at;
      s.bytes = static_cast<size_t>(4 * p.planes);
      out.push_back(s);
    }
    if (p.dst_scale_at >= 0) scale += p.planes;
  }
}

Status QueueSlotCopy(PathHost& host, const Chunk& chunk, const StagingLease& slot, bool pack,
                     int64_t row_min_bytes, EventLease& done,
                     std::optional<Conversion> conversion) {
  std::vector<CopyDesc>& descs = host.scratch();
  ChunkCopies(chunk, pack, host.pool(), host.SlotData(slot), pack, descs, row_min_bytes);
  Status st = pack && conversion ? host.stream().ConvertBatch(descs, *conversion)
                                 : host.stream().CopyBatch(descs);
  done = host.AcquireEvent();
  if (st.ok()) st = done ? host.stream().Record(*done) : Status::Internal("no device event");
  return st.ok() ? st : st.WithContext(pack ? "packing a chunk" : "unpacking a chunk");
}

}  // namespace kvferry
