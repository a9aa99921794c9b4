// MemorySlabStore: an in-memory SlabStore (like LevelDB's memenv), for tests, the demo and the
// bench's "memory" backend. Slots keep their key, size and an XXH3-64 checksum of the payload;
// reads verify all three, so a corrupt or foreign slot reads as kDataLoss with a reason.
//
// FaultInjectingSlabStore (a SlabStoreWrapper, kvferry/slab_store.h) overrides Write and Read to
// fail writes (kResourceExhausted, as a full disk) or corrupt reads on demand.
//
// Thread-safety: all methods are thread-safe.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <vector>

#include "base/thread_annotations.h"
#include "kvferry/slab_store.h"

namespace kvferry::tiering {

class MemorySlabStore final : public SlabStore {
 public:
  MemorySlabStore(int64_t slot_payload_bytes, int64_t max_slots);

  const FileBackendCaps& backend() const override { return caps_; }
  // Constant after construction: no lock (Write and Read call it while holding mu_).
  int64_t capacity() const override { return capacity_; }
  int64_t free_slots() const override;
  StatusOr<SlotId> Allocate() override;
  void Release(SlotId slot) override;
  std::vector<Status> Write(std::span<const SlotWrite> writes) override;
  std::vector<Status> Read(std::span<const SlotRead> reads) override;

  // Flips one stored payload byte of a written slot (tests). False if the slot holds nothing.
  bool CorruptForTest(SlotId slot, int64_t offset);

 private:
  struct Slot {
    bool allocated = false;
    bool written = false;
    SlotKey key;
    int64_t bytes = 0;
    uint64_t checksum = 0;
    std::vector<std::byte> data;
  };
  const FileBackendCaps caps_;
  const int64_t payload_bytes_;
  const int64_t capacity_;  // slots_.size(), fixed at construction
  mutable Mutex mu_;
  std::vector<Slot> slots_ GUARDED_BY(mu_);
  std::vector<SlotId> free_ GUARDED_BY(mu_);
};

// Fails the next `n` slot writes (or all while fail_all_writes) with kResourceExhausted, and makes
// reads of a chosen slot report kDataLoss as a corrupt slot would.
class FaultInjectingSlabStore final : public SlabStoreWrapper {
 public:
  using SlabStoreWrapper::SlabStoreWrapper;
  void FailNextWrites(int64_t n) { fail_writes_ = n; }
  void FailAllWrites(bool on) { fail_all_ = on; }
  void CorruptReadsOf(SlotId slot) { corrupt_slot_ = slot; }
  std::vector<Status> Write(std::span<const SlotWrite> writes) override;
  std::vector<Status> Read(std::span<const SlotRead> reads) override;

 private:
  std::atomic<int64_t> fail_writes_{0};
  std::atomic<bool> fail_all_{false};
  std::atomic<SlotId> corrupt_slot_{-1};
};

}  // namespace kvferry::tiering
