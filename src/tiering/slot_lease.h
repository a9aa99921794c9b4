// SlotLease: the block manager's hold on one file slot, as a move-only owner. The slot goes back
// to the store (SlabStore::Release) when the lease is destroyed or Reset, and at no other time.
//
// Why a type: SlabStore forbids releasing a slot while a Write or Read of it runs (a reused slot
// could be overwritten by the late I/O, or read back as another key). The block manager keeps each
// lease either in its index (the slot holds a key, no I/O) or inside the in-flight operation that
// reads or writes the slot, and retires an operation only once its TransferBatch has finished.
// So "released while I/O is running" can't be written without moving a lease out of a running
// operation, which the manager never does (an operation past its deadline keeps its leases).
//
// Thread-compatible (used by the scheduler thread only).
#pragma once

#include <utility>

#include "kvferry/slab_store.h"

namespace kvferry::tiering {

class SlotLease {
 public:
  SlotLease() = default;
  // Takes over `slot` of `store` (allocated, or recovered by the store at open).
  SlotLease(SlabStore* store, SlotId slot) : store_(store), slot_(slot) {}
  ~SlotLease() { Reset(); }
  SlotLease(SlotLease&& o) noexcept
      : store_(std::exchange(o.store_, nullptr)), slot_(std::exchange(o.slot_, -1)) {}
  SlotLease& operator=(SlotLease&& o) noexcept {
    if (this != &o) {
      Reset();
      store_ = std::exchange(o.store_, nullptr);
      slot_ = std::exchange(o.slot_, -1);
    }
    return *this;
  }
  SlotLease(const SlotLease&) = delete;
  SlotLease& operator=(const SlotLease&) = delete;

  SlotId id() const { return slot_; }
  explicit operator bool() const { return store_ != nullptr; }
  // Gives the slot back to the store (its contents are forgotten).
  void Reset() {
    if (store_ != nullptr) store_->Release(slot_);
    store_ = nullptr;
    slot_ = -1;
  }

 private:
  SlabStore* store_ = nullptr;
  SlotId slot_ = -1;
};

}  // namespace kvferry::tiering
