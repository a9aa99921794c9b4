// SlabStore: the file tier. Fixed-size slots in a few large slab files (not one file per block),
// each slot a small header (key, sizes, checksum, format version; docs/file_format.md) followed by
// the payload, aligned for O_DIRECT / GDS.
//
// A FileBackend does the I/O (POSIX pread/pwrite with O_DIRECT and aligned staging, io_uring,
// cuFile/GDS); SlabStore owns the files, the slot map and the format. Reads verify the header and
// checksum: a corrupt, truncated or foreign slot reads back as kDataLoss with a reason, never as
// wrong data. A failed write (ENOSPC, EIO, short write) returns an error and leaves the slot
// unused; the caller keeps its block where it was.
//
// Thread-safety: SlabStore is thread-safe; I/O batches may run from several threads.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kvferry/device.h"
#include "kvferry/status.h"

namespace kvferry {

using SlotId = int64_t;

// The identity of a slot's contents. Checked on read, so a slot reused for another block can't be
// read as the old one.
struct SlotKey {
  uint64_t hi = 0;
  uint64_t lo = 0;
  bool operator==(const SlotKey&) const = default;
};

struct SlotWrite {
  SlotId slot;
  SlotKey key;
  const void* src;   // payload, `bytes` long, of memory kind `kind`
  int64_t bytes;     // <= slot payload capacity
  MemoryKind kind;
};

struct SlotRead {
  SlotId slot;
  SlotKey key;       // expected key
  void* dst;
  int64_t bytes;     // expected payload size
  MemoryKind kind;
};

// What a FileBackend can do, as data.
struct FileBackendCaps {
  std::string name;          // "posix", "io_uring", "cufile"
  bool device_memory;        // reads/writes GPU memory directly (GDS)
  bool direct_io;            // bypasses the page cache
  int64_t alignment;         // required alignment of offsets, sizes and host buffers
};

struct SlabStoreOptions {
  std::string dir;                  // must exist
  int64_t slot_payload_bytes = 0;   // capacity of one slot's payload
  int64_t slots_per_file = 256;
  int64_t max_slots = 0;            // capacity of the tier
  std::string backend = "posix";    // "posix" | "io_uring" | "cufile" (falls back to posix, logged)
};

class SlabStore {
 public:
  static StatusOr<std::unique_ptr<SlabStore>> Open(const SlabStoreOptions& options);
  virtual ~SlabStore() = default;

  virtual const FileBackendCaps& backend() const = 0;
  virtual int64_t capacity() const = 0;  // slots
  virtual int64_t free_slots() const = 0;
  // A free slot, or kResourceExhausted.
  virtual StatusOr<SlotId> Allocate() = 0;
  virtual void Release(SlotId slot) = 0;

  // Batches: one status per item, in order. Blocking; errors of one item don't stop the others.
  virtual std::vector<Status> Write(std::span<const SlotWrite> writes) = 0;
  virtual std::vector<Status> Read(std::span<const SlotRead> reads) = 0;
};

}  // namespace kvferry
