#include "testing/memory_slab_store.h"

#include <fmt/format.h>

#include <cstring>

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace kvferry::tiering {

MemorySlabStore::MemorySlabStore(int64_t slot_payload_bytes, int64_t max_slots)
    : caps_{"memory",
            /*device_memory=*/false,
            /*direct_io=*/false,
            /*alignment=*/1,
            /*max_in_flight=*/1,
            /*note=*/"in memory, for tests"},
      payload_bytes_(slot_payload_bytes),
      capacity_(std::max<int64_t>(max_slots, 0)),
      slots_(static_cast<size_t>(std::max<int64_t>(max_slots, 0))) {
  for (int64_t i = max_slots - 1; i >= 0; --i) free_.push_back(i);
}

int64_t MemorySlabStore::free_slots() const {
  MutexLock lock(mu_);
  return static_cast<int64_t>(free_.size());
}

StatusOr<SlotId> MemorySlabStore::Allocate() {
  MutexLock lock(mu_);
  if (free_.empty()) {
    return Status::ResourceExhausted(
        fmt::format("memory slab store: all {} slots in use", slots_.size()));
  }
  SlotId s = free_.back();
  free_.pop_back();
  slots_[s].allocated = true;
  slots_[s].written = false;
  return s;
}

void MemorySlabStore::Release(SlotId slot) {
  MutexLock lock(mu_);
  if (slot < 0 || slot >= capacity() || !slots_[slot].allocated) return;
  slots_[slot].allocated = false;
  slots_[slot].written = false;
  free_.push_back(slot);
}

std::vector<Status> MemorySlabStore::Write(std::span<const SlotWrite> writes) {
  std::vector<Status> out;
  out.reserve(writes.size());
  MutexLock lock(mu_);
  for (const SlotWrite& w : writes) {
    if (w.slot < 0 || w.slot >= capacity() || !slots_[w.slot].allocated) {
      out.push_back(Status::InvalidArgument(fmt::format("slot {} is not allocated", w.slot)));
      continue;
    }
    if (w.bytes < 0 || w.bytes > payload_bytes_) {
      out.push_back(Status::InvalidArgument(fmt::format(
          "slot {}: payload of {} bytes exceeds the slot's {}", w.slot, w.bytes, payload_bytes_)));
      continue;
    }
    Slot& s = slots_[w.slot];
    s.data.resize(static_cast<size_t>(w.bytes));
    std::memcpy(s.data.data(), w.src, static_cast<size_t>(w.bytes));
    s.key = w.key;
    s.bytes = w.bytes;
    s.checksum = XXH3_64bits(s.data.data(), s.data.size());
    s.written = true;
    out.push_back(Status::Ok());
  }
  return out;
}

std::vector<Status> MemorySlabStore::Read(std::span<const SlotRead> reads) {
  std::vector<Status> out;
  out.reserve(reads.size());
  MutexLock lock(mu_);
  for (const SlotRead& r : reads) {
    if (r.slot < 0 || r.slot >= capacity() || !slots_[r.slot].written) {
      out.push_back(Status::NotFound(fmt::format("slot {} holds no data", r.slot)));
      continue;
    }
    const Slot& s = slots_[r.slot];
    if (!(s.key == r.key)) {
      out.push_back(Status::DataLoss(
          fmt::format("slot {}: key {:016x}{:016x} differs from the expected {:016x}{:016x}",
                      r.slot, s.key.hi, s.key.lo, r.key.hi, r.key.lo)));
      continue;
    }
    if (s.bytes != r.bytes) {
      out.push_back(Status::DataLoss(
          fmt::format("slot {}: holds {} bytes, expected {}", r.slot, s.bytes, r.bytes)));
      continue;
    }
    if (XXH3_64bits(s.data.data(), s.data.size()) != s.checksum) {
      out.push_back(Status::DataLoss(fmt::format("slot {}: payload checksum mismatch", r.slot)));
      continue;
    }
    std::memcpy(r.dst, s.data.data(), s.data.size());
    out.push_back(Status::Ok());
  }
  return out;
}

bool MemorySlabStore::CorruptForTest(SlotId slot, int64_t offset) {
  MutexLock lock(mu_);
  if (slot < 0 || slot >= capacity() || !slots_[slot].written) return false;
  auto& d = slots_[slot].data;
  if (d.empty()) return false;
  d[static_cast<size_t>(offset) % d.size()] ^= std::byte{0x5a};
  return true;
}

std::vector<Status> FaultInjectingSlabStore::Write(std::span<const SlotWrite> writes) {
  std::vector<Status> out(writes.size());
  std::vector<SlotWrite> pass;
  std::vector<size_t> where;
  for (size_t i = 0; i < writes.size(); ++i) {
    if (fail_all_.load() || fail_writes_.fetch_sub(1) > 0) {
      out[i] = Status::ResourceExhausted(
          fmt::format("slot {}: no space left on device (injected)", writes[i].slot));
    } else {
      pass.push_back(writes[i]);
      where.push_back(i);
    }
  }
  if (fail_writes_.load() < 0) fail_writes_ = 0;
  std::vector<Status> r = base_->Write(pass);
  for (size_t i = 0; i < where.size(); ++i) out[where[i]] = std::move(r[i]);
  return out;
}

std::vector<Status> FaultInjectingSlabStore::Read(std::span<const SlotRead> reads) {
  std::vector<Status> out = base_->Read(reads);
  for (size_t i = 0; i < reads.size(); ++i) {
    if (reads[i].slot == corrupt_slot_.load()) {
      out[i] = Status::DataLoss(
          fmt::format("slot {}: payload checksum mismatch (injected)", reads[i].slot));
    }
  }
  return out;
}

}  // namespace kvferry::tiering
