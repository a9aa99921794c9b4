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
// Memory kinds: kHost and kPinnedHost sources/destinations are used in place when aligned for
// O_DIRECT (only the header block and the unaligned tail go through a staging page), copied
// through an aligned staging buffer otherwise. kDevice goes straight to the file with the cufile
// backend; with posix/io_uring it needs options.device (see SlabStoreOptions).
//
// Thread-safety: SlabStore is thread-safe; I/O batches may run from several threads.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kvferry/device.h"
#include "kvferry/file_backend.h"
#include "kvferry/status.h"

#pragma GCC visibility push(default)  // the public API (kvferry/export.h)
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
  const void* src;  // payload, `bytes` long, of memory kind `kind`
  int64_t bytes;    // <= slot payload capacity
  MemoryKind kind;
};

struct SlotRead {
  SlotId slot;
  SlotKey key;  // expected key
  void* dst;
  int64_t bytes;  // expected payload size
  MemoryKind kind;
};

// A slot found intact in the slab files when the store opened (SlabStore::Recovered).
struct RecoveredSlot {
  SlotId slot;
  SlotKey key;
  int64_t bytes;  // payload bytes
};

struct SlabStoreOptions {
  std::string dir;                 // must exist and be writable (kNotFound / kInvalidArgument)
  int64_t slot_payload_bytes = 0;  // capacity of one slot's payload
  int64_t slots_per_file = 256;    // knob files.slots_per_file
  int64_t max_slots = 0;           // capacity of the tier
  std::string backend = "posix";   // "posix" | "io_uring" | "cufile" (falls back to posix, logged)
  bool direct_io = true;           // O_DIRECT where the filesystem allows it (knob files.direct_io)
  int32_t max_in_flight = 16;      // slots one batch keeps in flight (knob files.max_in_flight)
  int64_t io_timeout_ms = 30000;   // deadline of one Write/Read batch (knob files.io_timeout_ms)
  // What Open does with the slab files already in `dir` (knob files.recover): "verify" reads every
  // slot and keeps those whose header and payload checksum verify; "headers" checks headers only
  // (the payload checksum is still checked on every read); "none" forgets them.
  std::string recover = "verify";
  // Not owned; overrides `backend` (tests, fault injection). Must outlive the store.
  FileBackend* file_backend = nullptr;
  // Not owned. Needed only for kDevice memory when the backend can't do device memory: a CPU
  // device's memory is used in place; another device's is staged through pinned host memory
  // with a stream copy. Must outlive the store.
  Device* device = nullptr;
};

// Options with backend, slots_per_file, direct_io, max_in_flight and io_timeout_ms taken from the
// files.* knobs; dir, slot_payload_bytes and max_slots are the caller's.
SlabStoreOptions SlabStoreOptionsFromConfig();

// Bytes one slot takes in its slab file: a 4096-byte header block plus the payload capacity
// rounded up to 4096 (docs/file_format.md). A slab file is slots_per_file times that.
int64_t SlabSlotBytes(int64_t slot_payload_bytes);

class SlabStore {
 public:
  // Probes options.dir (kNotFound when it does not exist), opens the backend (falling back to
  // posix with a logged reason), and takes an exclusive lock on DIR/kvferry-slab.lock
  // (kUnavailable when another store holds it). Slab files are created lazily, when a write
  // first needs one. Slab files left by an earlier store (a restart, a crash) are scanned as
  // options.recover says: every slot that verifies is kept, written, under its key (Recovered()),
  // every other slot is free. A crash during a write never leaves a slot that verifies with the
  // wrong bytes (docs/file_format.md, "Recovery").
  static StatusOr<std::unique_ptr<SlabStore>> Open(const SlabStoreOptions& options);
  virtual ~SlabStore() = default;

  // The slots found intact at open, in slot order. Each is written (readable under its key) and
  // allocated: the caller takes them over (and Releases those it does not want).
  virtual std::vector<RecoveredSlot> Recovered() const { return {}; }

  virtual const FileBackendCaps& backend() const = 0;
  virtual int64_t capacity() const = 0;  // slots
  virtual int64_t free_slots() const = 0;
  // A free slot, or kResourceExhausted. Lowest never-used ids first, then released ones.
  virtual StatusOr<SlotId> Allocate() = 0;
  // Returns a slot to the free list; its contents are forgotten. Releasing a free slot is a no-op.
  // The caller must not release a slot while a Write or Read of it is running.
  virtual void Release(SlotId slot) = 0;

  // Batches: one status per item, in order. Blocking, up to options.io_timeout_ms per batch;
  // errors of one item don't stop the others. When Write returns, every source may be reused.
  // A slot must be allocated to be written; a successful write replaces its key and contents, a
  // failed one (kResourceExhausted "no space left in DIR", kDataLoss for EIO or a short write,
  // kInternal for other errno) leaves it allocated but unwritten: it reads as kNotFound.
  virtual std::vector<Status> Write(std::span<const SlotWrite> writes) = 0;
  // Reads verify the slot header (magic, version, slot id, key, size) and the payload checksum.
  // A mismatch is kDataLoss with the reason ("slot 17: checksum mismatch", "slot 3: key differs
  // (reused slot)", "slot 9: truncated file ..."); a slot never written is kNotFound. On any error
  // the destination's bytes are unspecified (they may have been partly overwritten).
  virtual std::vector<Status> Read(std::span<const SlotRead> reads) = 0;
};

// Forwards every call to `base` (not owned; must outlive the wrapper): subclass it to observe a
// store or inject faults, as LevelDB's EnvWrapper does (tests: FaultInjectingSlabStore).
class SlabStoreWrapper : public SlabStore {
 public:
  explicit SlabStoreWrapper(SlabStore* base) : base_(base) {}
  const FileBackendCaps& backend() const override { return base_->backend(); }
  int64_t capacity() const override { return base_->capacity(); }
  int64_t free_slots() const override { return base_->free_slots(); }
  StatusOr<SlotId> Allocate() override { return base_->Allocate(); }
  void Release(SlotId slot) override { base_->Release(slot); }
  std::vector<Status> Write(std::span<const SlotWrite> writes) override {
    return base_->Write(writes);
  }
  std::vector<Status> Read(std::span<const SlotRead> reads) override { return base_->Read(reads); }
  std::vector<RecoveredSlot> Recovered() const override { return base_->Recovered(); }

 protected:
  SlabStore* base_;
};

}  // namespace kvferry
#pragma GCC visibility pop
