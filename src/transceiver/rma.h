// The one-sided (RMA) data path shared by the context and generation sides.
//
// Why: a tagged message costs a matched receive per chunk and, for GPU pools over a transport
// without device memory, a staging copy through the host. With one-sided puts, each rank
// registers its pool regions and staging once (Engine::Start); a generation rank sends the keys
// and addresses in its FETCH (RmaTarget), and the context rank writes straight into the
// generation pool: every piece whose rows are at least row_min_bytes long is put row by row pool
// to pool; the shorter rows of a chunk are packed into a local staging slot (the same copy
// descriptors as the tagged path, so device kernels and the CPU executor pack identically), put
// into the staging slot the generation rank credited for that chunk, and unpacked there. One
// Flush and one CHUNK message per chunk tell the generation rank the chunk is in place.
//
// Safety: a context rank checks a FETCH's target against the generation layout it plans with
// (one region per layout region, each large enough; slots large enough for a packed chunk) and
// checks every put against the declared region before posting it, so a plan can only write the
// destination blocks it names. Transports check the key and range again (inproc: against the
// registration).
//
// Checksums (optional, transfer.checksum): the chunk digest (device/run_digest.h; wire version
// 5) of a chunk's bytes in plan order (every piece's rows, as the packed layout would hold them),
// computed where the bytes are on each side (the CPU for host-visible pools, a kernel on the
// side's stream for GPU pools; the context side before it sends, the generation side once the
// chunk is in place) and carried in the CHUNK message.
#pragma once

#include <cstdint>
#include <limits>
#include <memory>
#include <vector>

#include "kvferry/pool.h"
#include "kvferry/transport.h"
#include "planner/planner.h"
#include "transceiver/wire/messages.h"

namespace kvferry {

// Pool regions and staging registered with a transport for one-sided access.
struct LocalRma {
  std::vector<std::unique_ptr<MemoryRegistration>> pool;  // one per pool region
  std::unique_ptr<MemoryRegistration> staging;
};

StatusOr<LocalRma> RegisterForRma(Transport& transport, const BlockPool& pool, MemoryKind pool_kind,
                                  std::byte* staging, size_t staging_bytes,
                                  MemoryKind staging_kind);

RmaTarget DescribeTarget(const LocalRma& rma, int64_t slot_bytes, uint32_t slots,
                         int64_t row_min_bytes);

// A piece whose rows go pool to pool on the one-sided path: every piece of a direct chunk (the
// planner made it one contiguous run), and rows of at least row_min_bytes. kNoDirect: none.
inline bool RowsGoDirect(const Chunk& c, const Piece& p, int64_t row_min_bytes) {
  return row_min_bytes != std::numeric_limits<int64_t>::max() &&
         (c.direct || p.bytes >= row_min_bytes);
}
// Bytes of a chunk that travel packed (pieces with shorter rows).
int64_t PackedBytes(const Chunk& chunk, int64_t row_min_bytes);

// Checks a FETCH's RMA target against the generation layout of that FETCH (region count and
// sizes, staging slots able to hold a packed chunk); errors name the field and both values.
Status CheckRmaTarget(const FetchMsg& fetch);

// Posts one Put per row of every direct piece of `chunk` (context side), into the generation
// pool regions of `target`, after checking each row lies inside its declared region.
Status PutDirectRows(Transport& transport, PeerId peer, const Chunk& chunk, const BlockPool& pool,
                     MemoryKind kind, const RmaTarget& target,
                     std::vector<std::unique_ptr<TransportOp>>& ops);

// The chunk digest of a chunk's bytes in plan order, read from the context pool (context_side)
// or the generation pool: one run per piece (its rows, with that side's pitch).
class ChunkDigester {
 public:
  // Host-visible pools (`host`): computed on the calling thread. Device pools: one digest kernel
  // on `stream` (after the work already queued there), waited for until `deadline`; `device`
  // provides the pinned buffer it writes to (grown when a chunk has more segments than before).
  StatusOr<uint64_t> Of(const Chunk& chunk, bool context_side, const BlockPool& pool, bool host,
                        Device& device, Stream& stream, Deadline deadline);
  // The same digest over the chunk as packed at `packed` (its rows back to back, plane by plane,
  // in the generation side's bytes): what the generation side computes over its pool once it
  // unpacked it. A chunk converted while packing is summed so, after its pack completed.
  StatusOr<uint64_t> OfPacked(const Chunk& chunk, const std::byte* packed, bool host,
                              Device& device, Stream& stream, Deadline deadline);
  // Allocates the pinned buffer for `segments` digests now (a pinned allocation waits for the
  // device's queued work: better at start than behind a stream).
  Status Reserve(Device& device, size_t segments);

 private:
  // The digest of runs_.
  StatusOr<uint64_t> Sum(bool host, Device& device, Stream& stream, Deadline deadline);

  std::vector<DigestRun> runs_;
  std::vector<uint64_t> host_;
  Buffer out_;  // pinned: written by the device's kernel
};

}  // namespace kvferry
