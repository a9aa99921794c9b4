// Packing a chunk's scattered pieces into a staging slot (context side) and unpacking a slot into
// the pool (generation side): the copy descriptors of a chunk, and one queued copy batch with the
// event that ends it. The tagged and one-sided paths share them, so device kernels and the CPU
// executor pack and unpack identically on both.
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "kvferry/device.h"
#include "kvferry/pool.h"
#include "planner/planner.h"
#include "transceiver/engine/leases.h"

namespace kvferry {

class PathHost;

// direct_min_bytes (and a one-sided row minimum) meaning "no direct chunks": every chunk is staged.
inline constexpr int64_t kNoDirect = std::numeric_limits<int64_t>::max();

// Builds the 2-D copy descriptors of a chunk between pool and a packed buffer.
// to_packed: pool -> packed (context side), else packed -> pool (generation side).
// With row_min_bytes, pieces whose rows go pool to pool on the one-sided path are left out.
// Per-block scales: a pack reads the context's (Piece::src_scale_at) and computes the
// generation's into the packed scale area (dst_scale_at, Chunk::scale_area_offset); an unpack
// copies those into the generation pool's scales, one descriptor per piece after its rows.
void ChunkCopies(const Chunk& chunk, bool context_side, const BlockPool& pool, std::byte* packed,
                 bool to_packed, std::vector<CopyDesc>& out, int64_t row_min_bytes = kNoDirect);

// Queues on the host's stream the pack of `chunk` into `slot` (`pack`, context side) or its
// unpack from `slot` into the pool, pieces with rows of at least `row_min_bytes` left out, and an
// event after it, leased into `done` (leased even when the copy failed; empty when none could be
// made). The error says which. A pack with `conversion` converts each element (a packed chunk
// holds the generation dtype; planner.h PlanConversion).
Status QueueSlotCopy(PathHost& host, const Chunk& chunk, const StagingLease& slot, bool pack,
                     int64_t row_min_bytes, EventLease& done,
                     std::optional<Conversion> conversion = std::nullopt);

}  // namespace kvferry
