// SlabStore over a FileBackend: slot map, lazy slab files, slot format (docs/file_format.md).
#include "kvferry/slab_store.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <utility>

#include "base/log.h"
#include "base/thread_annotations.h"
#include "files/posix_io.h"
#include "files/slot_header.h"
#include "kvferry/config.h"

namespace kvferry {

SlabStoreOptions SlabStoreOptionsFromConfig() {
  const Config& c = Config::Global();
  SlabStoreOptions o;
  o.backend = c.String("files.backend");
  o.slots_per_file = c.Int("files.slots_per_file");
  o.direct_io = c.Bool("files.direct_io");
  o.max_in_flight = static_cast<int32_t>(c.Int("files.max_in_flight"));
  o.io_timeout_ms = c.Int("files.io_timeout_ms");
  o.recover = c.String("files.recover");
  return o;
}

namespace {

using files_internal::ScopedFd;

constexpr int64_t kPage = 4096;

int64_t RoundUp(int64_t v, int64_t a) { return (v + a - 1) / a * a; }
}  // namespace

int64_t SlabSlotBytes(int64_t slot_payload_bytes) {
  return kSlotHeaderBlock + RoundUp(slot_payload_bytes, kPage);
}

namespace {
int64_t RoundDown(int64_t v, int64_t a) { return v / a * a; }
bool Aligned(const void* p, int64_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

// An aligned host allocation: pinned through the device when there is a non-CPU one, else
// posix_memalign'ed. Move-only.
class HostBuffer {
 public:
  HostBuffer() = default;
  static StatusOr<HostBuffer> Allocate(Device* device, int64_t bytes) {
    HostBuffer b;
    if (device != nullptr) {
      KVF_ASSIGN_OR_RETURN(b.device_buffer_,
                           device->Allocate(MemoryKind::kPinnedHost, static_cast<size_t>(bytes)));
      if (Aligned(b.device_buffer_.data(), kPage)) {
        b.data_ = b.device_buffer_.data();
        return b;
      }
      b.device_buffer_.Reset();  // not aligned enough for O_DIRECT: use plain memory
    }
    void* p = nullptr;
    if (posix_memalign(&p, kPage, static_cast<size_t>(bytes)) != 0) {
      return Status::ResourceExhausted(
          fmt::format("file tier: no memory for {} staging bytes", bytes));
    }
    b.owned_.reset(static_cast<std::byte*>(p));
    b.data_ = b.owned_.get();
    return b;
  }
  std::byte* data() const { return data_; }

 private:
  struct FreeDeleter {
    void operator()(std::byte* p) const { std::free(p); }
  };
  Buffer device_buffer_;
  std::unique_ptr<std::byte, FreeDeleter> owned_;
  std::byte* data_ = nullptr;
};

// Staging memory for one batch window: two pages per slot (header, tail), full-slot buffers made
// lazily for unaligned or device payloads, and a stream for device staging copies. One thread
// uses an arena at a time; arenas are pooled by the store.
struct Arena {
  HostBuffer pages;                // 2 * window pages
  std::vector<HostBuffer> full;    // lazily, up to window, each payload_capacity rounded up
  std::unique_ptr<Stream> stream;  // lazily, for non-CPU device staging

  std::byte* header_page(int i) const { return pages.data() + (2 * i) * kPage; }
  std::byte* tail_page(int i) const { return pages.data() + (2 * i + 1) * kPage; }
};

enum class SlotState : uint8_t { kFree, kAllocated, kWritten };

struct SlotInfo {
  SlotState state = SlotState::kFree;
  SlotKey key;
  int64_t bytes = 0;
  bool corruption_logged = false;  // a failed verification was logged (once per written content)
};

// How one slot's payload moves, decided per item before I/O.
struct Plan {
  Status status;                    // not OK: skip the I/O
  const std::byte* host = nullptr;  // host-visible payload (write: source; read: where it lands)
  bool staged = false;              // payload goes through arena.full[i]
  bool device_direct = false;       // device memory handed to the backend (cuFile)
  int64_t body = 0;                 // bytes moved in place before the tail page
  int64_t tail = 0;                 // bytes that go through the tail page
  IoSegment segs[3];
  int nsegs = 0;
};

class SlabStoreImpl : public SlabStore {
 public:
  SlabStoreImpl(const SlabStoreOptions& o, std::unique_ptr<FileBackend> owned, FileBackend* backend,
                ScopedFd lock)
      : options_(o),
        owned_backend_(std::move(owned)),
        backend_(backend),
        caps_(backend->caps()),
        lock_fd_(std::move(lock)),
        payload_cap_(o.slot_payload_bytes),
        stride_(SlabSlotBytes(o.slot_payload_bytes)),
        window_(std::max(1, o.max_in_flight)),
        cpu_device_(o.device != nullptr && o.device->info().platform == "cpu"),
        slots_(static_cast<size_t>(o.max_slots)),
        files_(static_cast<size_t>((o.max_slots + o.slots_per_file - 1) / o.slots_per_file)) {}

  const FileBackendCaps& backend() const override { return caps_; }
  int64_t capacity() const override { return options_.max_slots; }
  int64_t free_slots() const override {
    MutexLock l(mu_);
    return static_cast<int64_t>(free_.size()) + (options_.max_slots - next_fresh_);
  }

  StatusOr<SlotId> Allocate() override {
    MutexLock l(mu_);
    SlotId s;
    if (!free_.empty()) {
      s = free_.back();
      free_.pop_back();
    } else if (next_fresh_ < options_.max_slots) {
      s = next_fresh_++;
    } else {
      return Status::ResourceExhausted(fmt::format("file tier in {} is full: all {} slots in use",
                                                   options_.dir, options_.max_slots));
    }
    slots_[s] = SlotInfo{SlotState::kAllocated, {}, 0};
    return s;
  }

  void Release(SlotId slot) override {
    MutexLock l(mu_);
    if (slot < 0 || slot >= options_.max_slots || slot >= next_fresh_ ||
        slots_[slot].state == SlotState::kFree) {
      return;
    }
    slots_[slot] = SlotInfo{};
    free_.push_back(slot);
  }

  std::vector<Status> Write(std::span<const SlotWrite> writes) override;
  std::vector<Status> Read(std::span<const SlotRead> reads) override;
  std::vector<RecoveredSlot> Recovered() const override { return recovered_; }

  // Scans the slab files an earlier store left (options.recover); called once by Open, before
  // the store is shared (so without the locks).
  Status Recover() NO_THREAD_SAFETY_ANALYSIS;

 private:
  std::string FilePath(int64_t index) const {
    return fmt::format("{}/kvferry-slab-{:05d}.kvf", options_.dir, index);
  }
  // Keeps the verified slots of one slab file; false when the file is not there to scan.
  StatusOr<bool> ScanFile(int64_t index, std::vector<bool>& kept);
  // XXH3-64 of `bytes` of device memory, hashed after a copy into the arena's staging.
  StatusOr<uint64_t> DeviceChecksum(Arena& a, int i, const void* device_bytes, int64_t bytes);
  StatusOr<BackendFile*> FileOf(SlotId slot);
  int64_t OffsetOf(SlotId slot) const { return (slot % options_.slots_per_file) * stride_; }
  StatusOr<std::unique_ptr<Arena>> AcquireArena();
  void ReleaseArena(std::unique_ptr<Arena> a);
  Status EnsureFull(Arena& a, int i);
  // Where a kDevice payload can be touched by the host without a copy (CPU device), or not.
  bool DeviceIsHost(MemoryKind kind) const { return kind != MemoryKind::kDevice || cpu_device_; }
  Plan PlanPayload(Arena& a, int i, MemoryKind kind, const void* user, int64_t bytes, bool write);
  Deadline BatchDeadline() const {
    return DeadlineIn(std::chrono::milliseconds(options_.io_timeout_ms));
  }

  void WriteWindow(std::span<const SlotWrite> w, std::span<Status> out, Arena& a);
  void ReadWindow(std::span<const SlotRead> r, std::span<Status> out, Arena& a);

  const SlabStoreOptions options_;
  const std::unique_ptr<FileBackend> owned_backend_;
  FileBackend* const backend_;
  const FileBackendCaps caps_;
  const ScopedFd lock_fd_;
  const int64_t payload_cap_;
  const int64_t stride_;
  const int window_;
  const bool cpu_device_;

  mutable Mutex mu_;
  std::vector<SlotInfo> slots_ GUARDED_BY(mu_);
  std::vector<SlotId> free_ GUARDED_BY(mu_);
  SlotId next_fresh_ GUARDED_BY(mu_) = 0;  // slots >= it were never allocated

  Mutex files_mu_;
  std::vector<std::unique_ptr<BackendFile>> files_ GUARDED_BY(files_mu_);  // never shrink

  Mutex arenas_mu_;
  std::vector<std::unique_ptr<Arena>> arenas_ GUARDED_BY(arenas_mu_);

  std::vector<RecoveredSlot> recovered_;  // set by Recover, then constant
};

Status SlabStoreImpl::Recover() {
  if (options_.recover == "none") return Status::Ok();
  std::vector<bool> kept(static_cast<size_t>(options_.max_slots), false);
  bool any_file = false;
  for (int64_t f = 0; f < static_cast<int64_t>(files_.size()); ++f) {
    KVF_ASSIGN_OR_RETURN(bool scanned, ScanFile(f, kept));
    any_file |= scanned;
  }
  if (!any_file) return Status::Ok();  // a fresh directory: slots are handed out in id order
  MutexLock l(mu_);
  free_.clear();
  for (SlotId s = options_.max_slots - 1; s >= 0; --s) {
    if (!kept[s]) free_.push_back(s);  // reclaimed (lowest ids handed out first)
  }
  next_fresh_ = options_.max_slots;
  Log(LogLevel::kInfo, "file tier: recovered {} verified slots in {} ({} reclaimed)",
      recovered_.size(), options_.dir, free_.size());
  return Status::Ok();
}

StatusOr<bool> SlabStoreImpl::ScanFile(int64_t index, std::vector<bool>& kept) {
  const std::string path = FilePath(index);
  // The size of the file itself (fstat): a symbolic link in its place is refused, not followed.
  struct stat sb;
  {
    ScopedFd probe(::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC));
    if (!probe.valid()) {
      if (errno == ENOENT) return false;
      if (errno == ELOOP) {
        return Status::InvalidArgument(
            fmt::format("{} is a symbolic link: refusing to follow it", path));
      }
      return files_internal::ErrnoStatus(errno, "open", path, -1);
    }
    if (::fstat(probe.get(), &sb) != 0) {
      return files_internal::ErrnoStatus(errno, "fstat", path, -1);
    }
  }
  const int64_t first = index * options_.slots_per_file;
  const int64_t nslots = std::min(options_.slots_per_file, options_.max_slots - first);
  if (sb.st_size != nslots * stride_) {
    Log(LogLevel::kInfo, "file tier: {} has {} bytes, not {} ({} slots of {}): not recovered", path,
        sb.st_size, nslots * stride_, nslots, stride_);
    return true;
  }
  KVF_ASSIGN_OR_RETURN(BackendFile * file, FileOf(first));
  const bool payloads = options_.recover != "headers";
  const int64_t span = payloads ? stride_ : kSlotHeaderBlock;
  KVF_ASSIGN_OR_RETURN(HostBuffer buf, HostBuffer::Allocate(cpu_device_ ? nullptr : options_.device,
                                                            static_cast<int64_t>(window_) * span));
  std::vector<IoSegment> segs(window_);
  std::vector<FileIo> ios(window_);
  for (int64_t at = 0; at < nslots; at += window_) {
    const int64_t n = std::min<int64_t>(window_, nslots - at);
    for (int64_t i = 0; i < n; ++i) {
      segs[i] = IoSegment{buf.data() + i * span, span, MemoryKind::kHost};
      ios[i] = FileIo{file, (at + i) * stride_, std::span<const IoSegment>(&segs[i], 1)};
    }
    std::vector<Status> done =
        backend_->Read(std::span<const FileIo>(ios.data(), n), BatchDeadline());
    for (int64_t i = 0; i < n; ++i) {
      if (i >= static_cast<int64_t>(done.size()) || !done[i].ok()) continue;
      const SlotId slot = first + at + i;
      const std::byte* page = buf.data() + i * span;
      auto h = DecodeSlotHeader(std::span<const std::byte>(page, kSlotHeaderBlock));
      if (!h.ok() || h->slot != static_cast<uint64_t>(slot) ||
          h->payload_bytes > static_cast<uint64_t>(payload_cap_) ||
          (h->flags & kSlotFlagPayloadChecksum) == 0) {
        continue;  // torn, foreign, stale or unverifiable: reclaimed
      }
      const int64_t bytes = static_cast<int64_t>(h->payload_bytes);
      if (payloads && Checksum64(page + kSlotHeaderBlock, bytes) != h->payload_checksum) continue;
      const SlotKey key{h->key_hi, h->key_lo};
      {
        MutexLock l(mu_);
        slots_[slot] = SlotInfo{SlotState::kWritten, key, bytes};
      }
      kept[slot] = true;
      recovered_.push_back(RecoveredSlot{slot, key, bytes});
    }
  }
  return true;
}

StatusOr<uint64_t> SlabStoreImpl::DeviceChecksum(Arena& a, int i, const void* device_bytes,
                                                 int64_t bytes) {
  KVF_RETURN_IF_ERROR(EnsureFull(a, i));
  if (!a.stream) {
    KVF_ASSIGN_OR_RETURN(a.stream, options_.device->CreateStream());
  }
  KVF_RETURN_IF_ERROR(a.stream->Copy(a.full[i].data(), device_bytes, static_cast<size_t>(bytes)));
  KVF_RETURN_IF_ERROR(a.stream->Synchronize(BatchDeadline()));
  return Checksum64(a.full[i].data(), static_cast<size_t>(bytes));
}

StatusOr<BackendFile*> SlabStoreImpl::FileOf(SlotId slot) {
  const int64_t index = slot / options_.slots_per_file;
  MutexLock l(files_mu_);
  if (files_[index]) return files_[index].get();
  const int64_t first = index * options_.slots_per_file;
  const int64_t nslots = std::min(options_.slots_per_file, options_.max_slots - first);
  std::string path = FilePath(index);
  KVF_ASSIGN_OR_RETURN(files_[index], backend_->Open(path, nslots * stride_));
  Log(LogLevel::kDebug, "file tier: opened {} ({} slots of {} bytes)", path, nslots, stride_);
  return files_[index].get();
}

StatusOr<std::unique_ptr<Arena>> SlabStoreImpl::AcquireArena() {
  {
    MutexLock l(arenas_mu_);
    if (!arenas_.empty()) {
      std::unique_ptr<Arena> a = std::move(arenas_.back());
      arenas_.pop_back();
      return a;
    }
  }
  auto a = std::make_unique<Arena>();
  KVF_ASSIGN_OR_RETURN(
      a->pages, HostBuffer::Allocate(cpu_device_ ? nullptr : options_.device, 2 * window_ * kPage));
  a->full.resize(window_);
  return a;
}

void SlabStoreImpl::ReleaseArena(std::unique_ptr<Arena> a) {
  MutexLock l(arenas_mu_);
  arenas_.push_back(std::move(a));
}

Status SlabStoreImpl::EnsureFull(Arena& a, int i) {
  if (a.full[i].data() != nullptr) return Status::Ok();
  KVF_ASSIGN_OR_RETURN(a.full[i], HostBuffer::Allocate(cpu_device_ ? nullptr : options_.device,
                                                       RoundUp(payload_cap_, kPage)));
  return Status::Ok();
}

Plan SlabStoreImpl::PlanPayload(Arena& a, int i, MemoryKind kind, const void* user, int64_t bytes,
                                bool write) {
  Plan p;
  const int64_t align = caps_.direct_io ? caps_.alignment : 1;
  p.segs[p.nsegs++] = {a.header_page(i), kSlotHeaderBlock, MemoryKind::kHost};
  if (kind == MemoryKind::kFile) {
    p.status = Status::InvalidArgument("a kFile buffer is not memory");
    return p;
  }
  if (bytes == 0) return p;
  if (kind == MemoryKind::kDevice && caps_.device_memory) {
    p.device_direct = true;
    p.segs[p.nsegs++] = {const_cast<void*>(user), bytes, MemoryKind::kDevice};
    return p;
  }
  if (!DeviceIsHost(kind) && options_.device == nullptr) {
    p.status = Status::InvalidArgument(
        fmt::format("device memory with the {} backend needs SlabStoreOptions::device for staging",
                    caps_.name));
    return p;
  }
  const bool in_place = DeviceIsHost(kind) && Aligned(user, std::max<int64_t>(align, 1));
  if (!in_place) {
    p.status = EnsureFull(a, i);
    if (!p.status.ok()) return p;
    p.staged = true;
    p.host = a.full[i].data();
    p.segs[p.nsegs++] = {a.full[i].data(), RoundUp(bytes, align), MemoryKind::kHost};
    if (write) {
      if (DeviceIsHost(kind)) {
        std::memcpy(a.full[i].data(), user, bytes);
      } else {
        if (!a.stream) {
          auto s = options_.device->CreateStream();
          if (!s.ok()) {
            p.status = s.status();
            return p;
          }
          a.stream = std::move(s).value();
        }
        p.status = a.stream->Copy(a.full[i].data(), user, bytes);
        if (p.status.ok()) p.status = a.stream->Synchronize(BatchDeadline());
        if (!p.status.ok()) {
          p.status = p.status.WithContext("staging device memory");
          return p;
        }
      }
      std::memset(a.full[i].data() + bytes, 0, RoundUp(bytes, align) - bytes);
    }
    return p;
  }
  p.host = static_cast<const std::byte*>(user);
  p.body = RoundDown(bytes, align);
  p.tail = bytes - p.body;
  if (p.body > 0) p.segs[p.nsegs++] = {const_cast<void*>(user), p.body, MemoryKind::kHost};
  if (p.tail > 0) {
    if (write) {
      std::memcpy(a.tail_page(i), p.host + p.body, p.tail);
      std::memset(a.tail_page(i) + p.tail, 0, kPage - p.tail);
    }
    p.segs[p.nsegs++] = {a.tail_page(i), RoundUp(p.tail, align), MemoryKind::kHost};
  }
  return p;
}

// Checksum of a payload held as body (in place) + tail (in the tail page), or staged.
uint64_t PayloadChecksum(const Plan& p, const Arena& a, int i, int64_t bytes) {
  if (p.staged || p.tail == 0) return Checksum64(p.host, bytes);
  return Checksum64(p.host, p.body, a.tail_page(i), p.tail);
}

std::string SlotPrefix(SlotId s) { return fmt::format("slot {}", s); }

std::vector<Status> SlabStoreImpl::Write(std::span<const SlotWrite> writes) {
  std::vector<Status> out(writes.size());
  auto arena = AcquireArena();
  if (!arena.ok()) {
    for (auto& s : out) s = arena.status();
    return out;
  }
  for (size_t begin = 0; begin < writes.size(); begin += window_) {
    size_t n = std::min<size_t>(window_, writes.size() - begin);
    WriteWindow(writes.subspan(begin, n), std::span<Status>(out).subspan(begin, n), **arena);
  }
  ReleaseArena(std::move(arena).value());
  return out;
}

void SlabStoreImpl::WriteWindow(std::span<const SlotWrite> w, std::span<Status> out, Arena& a) {
  std::vector<Plan> plans(w.size());
  std::vector<FileIo> ios;
  std::vector<int> io_item;
  ios.reserve(w.size());
  for (size_t i = 0; i < w.size(); ++i) {
    const SlotWrite& sw = w[i];
    Plan& p = plans[i];
    if (sw.slot < 0 || sw.slot >= options_.max_slots) {
      p.status = Status::InvalidArgument(
          fmt::format("slot {} is out of range [0, {})", sw.slot, options_.max_slots));
    } else if (sw.bytes < 0 || sw.bytes > payload_cap_) {
      p.status = Status::InvalidArgument(fmt::format("{}: payload of {} bytes; a slot holds {}",
                                                     SlotPrefix(sw.slot), sw.bytes, payload_cap_));
    } else if (sw.bytes > 0 && sw.src == nullptr) {
      p.status = Status::InvalidArgument(fmt::format("{}: null source", SlotPrefix(sw.slot)));
    } else {
      MutexLock l(mu_);
      SlotInfo& info = slots_[sw.slot];
      if (info.state == SlotState::kFree) {
        p.status = Status::InvalidArgument(
            fmt::format("{}: not allocated (Allocate() it first)", SlotPrefix(sw.slot)));
      } else {
        info = SlotInfo{SlotState::kAllocated, {}, 0};  // old contents are gone from now on
      }
    }
    if (!p.status.ok()) continue;
    auto file = FileOf(sw.slot);
    if (!file.ok()) {
      p.status = file.status();
      continue;
    }
    Plan planned = PlanPayload(a, static_cast<int>(i), sw.kind, sw.src, sw.bytes, true);
    p = std::move(planned);
    if (!p.status.ok()) continue;
    SlotHeader h;
    h.key_hi = sw.key.hi;
    h.key_lo = sw.key.lo;
    h.slot = static_cast<uint64_t>(sw.slot);
    h.payload_bytes = static_cast<uint64_t>(sw.bytes);
    if (!p.device_direct) {
      h.flags |= kSlotFlagPayloadChecksum;
      h.payload_checksum = PayloadChecksum(p, a, static_cast<int>(i), sw.bytes);
    } else if (options_.device != nullptr) {
      // GDS: the payload goes GPU -> file directly; its checksum from a staged copy.
      auto sum = DeviceChecksum(a, static_cast<int>(i), sw.src, sw.bytes);
      if (!sum.ok()) {
        p.status = sum.status().WithContext("checksum of device memory");
        continue;
      }
      h.flags |= kSlotFlagPayloadChecksum;
      h.payload_checksum = *sum;
    }
    std::byte* page = a.header_page(static_cast<int>(i));
    std::memset(page, 0, kSlotHeaderBlock);
    EncodeSlotHeader(h, std::span<std::byte>(page, kSlotHeaderBlock));
    ios.push_back(FileIo{*file, OffsetOf(sw.slot), std::span<const IoSegment>(p.segs, p.nsegs)});
    io_item.push_back(static_cast<int>(i));
  }
  std::vector<Status> done = backend_->Write(ios, BatchDeadline());
  for (size_t k = 0; k < io_item.size(); ++k) {
    Status st = k < done.size() ? std::move(done[k]) : Status::Internal("backend lost an item");
    plans[io_item[k]].status = std::move(st);
  }
  for (size_t i = 0; i < w.size(); ++i) {
    const SlotWrite& sw = w[i];
    if (plans[i].status.ok()) {
      MutexLock l(mu_);
      SlotInfo& info = slots_[sw.slot];
      if (info.state == SlotState::kAllocated)
        info = SlotInfo{SlotState::kWritten, sw.key, sw.bytes};
      out[i] = Status::Ok();
    } else {
      const Status& st = plans[i].status;
      bool prefixed = st.message().starts_with("slot ");
      out[i] = prefixed ? st : st.WithContext(SlotPrefix(sw.slot));
      Log(LogLevel::kDebug, "file tier write failed: {}", out[i].ToString());
    }
  }
}

std::vector<Status> SlabStoreImpl::Read(std::span<const SlotRead> reads) {
  std::vector<Status> out(reads.size());
  auto arena = AcquireArena();
  if (!arena.ok()) {
    for (auto& s : out) s = arena.status();
    return out;
  }
  for (size_t begin = 0; begin < reads.size(); begin += window_) {
    size_t n = std::min<size_t>(window_, reads.size() - begin);
    ReadWindow(reads.subspan(begin, n), std::span<Status>(out).subspan(begin, n), **arena);
  }
  ReleaseArena(std::move(arena).value());
  return out;
}

void SlabStoreImpl::ReadWindow(std::span<const SlotRead> r, std::span<Status> out, Arena& a) {
  std::vector<Plan> plans(r.size());
  std::vector<FileIo> ios;
  std::vector<int> io_item;
  for (size_t i = 0; i < r.size(); ++i) {
    const SlotRead& sr = r[i];
    Plan& p = plans[i];
    const std::string prefix = SlotPrefix(sr.slot);
    if (sr.slot < 0 || sr.slot >= options_.max_slots) {
      p.status = Status::InvalidArgument(
          fmt::format("slot {} is out of range [0, {})", sr.slot, options_.max_slots));
    } else if (sr.bytes < 0 || sr.bytes > payload_cap_ || (sr.bytes > 0 && sr.dst == nullptr)) {
      p.status = Status::InvalidArgument(
          fmt::format("{}: bad destination ({} bytes at {}; a slot holds {})", prefix, sr.bytes,
                      sr.dst, payload_cap_));
    } else {
      MutexLock l(mu_);
      const SlotInfo& info = slots_[sr.slot];
      if (info.state != SlotState::kWritten) {
        p.status = Status::NotFound(fmt::format("{}: not written", prefix));
      } else if (!(info.key == sr.key)) {
        p.status = Status::DataLoss(fmt::format("{}: key differs (reused slot)", prefix));
      } else if (info.bytes != sr.bytes) {
        p.status = Status::DataLoss(
            fmt::format("{}: holds {} payload bytes, {} expected", prefix, info.bytes, sr.bytes));
      }
    }
    if (!p.status.ok()) continue;
    auto file = FileOf(sr.slot);
    if (!file.ok()) {
      p.status = file.status();
      continue;
    }
    Plan planned = PlanPayload(a, static_cast<int>(i), sr.kind, sr.dst, sr.bytes, false);
    p = std::move(planned);
    if (!p.status.ok()) continue;
    ios.push_back(FileIo{*file, OffsetOf(sr.slot), std::span<const IoSegment>(p.segs, p.nsegs)});
    io_item.push_back(static_cast<int>(i));
  }
  std::vector<Status> done = backend_->Read(ios, BatchDeadline());
  for (size_t k = 0; k < io_item.size(); ++k) {
    Status st = k < done.size() ? std::move(done[k]) : Status::Internal("backend lost an item");
    plans[io_item[k]].status = std::move(st);
  }
  for (size_t i = 0; i < r.size(); ++i) {
    const SlotRead& sr = r[i];
    Plan& p = plans[i];
    const std::string prefix = SlotPrefix(sr.slot);
    if (!p.status.ok()) {
      bool prefixed = p.status.message().starts_with("slot ");
      out[i] = prefixed ? p.status : p.status.WithContext(prefix);
      continue;
    }
    const int ii = static_cast<int>(i);
    auto h = DecodeSlotHeader(std::span<const std::byte>(a.header_page(ii), kSlotHeaderBlock));
    if (!h.ok()) {
      out[i] = Status::DataLoss(fmt::format("{}: {}", prefix, h.status().message()));
      continue;
    }
    if (h->slot != static_cast<uint64_t>(sr.slot)) {
      out[i] = Status::DataLoss(
          fmt::format("{}: header names slot {} (misplaced or stale slot)", prefix, h->slot));
      continue;
    }
    if (h->key_hi != sr.key.hi || h->key_lo != sr.key.lo) {
      out[i] = Status::DataLoss(fmt::format("{}: key differs (reused slot)", prefix));
      continue;
    }
    if (h->payload_bytes != static_cast<uint64_t>(sr.bytes)) {
      out[i] = Status::DataLoss(fmt::format("{}: header says {} payload bytes, {} expected", prefix,
                                            h->payload_bytes, sr.bytes));
      continue;
    }
    if (p.device_direct) {
      // GDS: the payload is in device memory; hashed from a staged copy when a device is known
      // (without one only the header was checked; docs/file_format.md).
      if ((h->flags & kSlotFlagPayloadChecksum) && options_.device != nullptr) {
        auto sum = DeviceChecksum(a, ii, sr.dst, sr.bytes);
        if (!sum.ok()) {
          out[i] = sum.status().WithContext(prefix + ": checksum of device memory");
          continue;
        }
        if (*sum != h->payload_checksum) {
          out[i] = Status::DataLoss(fmt::format("{}: checksum mismatch", prefix));
          continue;
        }
      }
      out[i] = Status::Ok();
      continue;
    }
    if (h->flags & kSlotFlagPayloadChecksum) {
      uint64_t sum = sr.bytes == 0 ? Checksum64(nullptr, 0) : PayloadChecksum(p, a, ii, sr.bytes);
      if (sum != h->payload_checksum) {
        out[i] = Status::DataLoss(fmt::format("{}: checksum mismatch", prefix));
        continue;
      }
    }
    // Verified: move the staged or tail bytes to the destination.
    Status st;
    if (p.staged) {
      if (DeviceIsHost(sr.kind)) {
        std::memcpy(sr.dst, a.full[ii].data(), sr.bytes);
      } else {
        if (!a.stream) {
          auto s = options_.device->CreateStream();
          if (s.ok()) a.stream = std::move(s).value();
          st = s.status();
        }
        if (st.ok()) st = a.stream->Copy(sr.dst, a.full[ii].data(), sr.bytes);
        if (st.ok()) st = a.stream->Synchronize(BatchDeadline());
      }
    } else if (p.tail > 0) {
      std::memcpy(static_cast<std::byte*>(sr.dst) + p.body, a.tail_page(ii), p.tail);
    }
    out[i] = st.ok() ? Status::Ok() : st.WithContext(prefix + ": staging to device memory");
  }
  // A slot whose contents fail verification is useless to every later read: its owner drops it.
  // Say so once per slot (and written contents), with the reason.
  for (size_t i = 0; i < r.size(); ++i) {
    if (out[i].code() != StatusCode::kDataLoss) continue;
    MutexLock l(mu_);
    SlotInfo& info = slots_[r[i].slot];
    if (info.corruption_logged) continue;
    info.corruption_logged = true;
    Log(LogLevel::kWarn, "file tier: dropping corrupt slot {} of {}: {}", r[i].slot, options_.dir,
        out[i].message());
  }
}

}  // namespace

StatusOr<std::unique_ptr<SlabStore>> SlabStore::Open(const SlabStoreOptions& o) {
  if (o.slot_payload_bytes <= 0 || o.slots_per_file <= 0 || o.max_slots <= 0 ||
      o.max_in_flight <= 0 || o.io_timeout_ms <= 0) {
    return Status::InvalidArgument(fmt::format(
        "slab store options: slot_payload_bytes={}, slots_per_file={}, max_slots={}, "
        "max_in_flight={}, io_timeout_ms={} must all be > 0",
        o.slot_payload_bytes, o.slots_per_file, o.max_slots, o.max_in_flight, o.io_timeout_ms));
  }
  // Private to this user: nobody else can plant a link or a file of theirs among the slabs
  // (docs/security.md).
  KVF_RETURN_IF_ERROR(files_internal::CheckPrivateDir(o.dir));
  KVF_ASSIGN_OR_RETURN(files_internal::DirProbe probe, files_internal::ProbeDir(o.dir, false));
  (void)probe;
  std::unique_ptr<FileBackend> owned;
  FileBackend* backend = o.file_backend;
  if (backend == nullptr) {
    FileBackendOptions fo;
    fo.dir = o.dir;
    fo.direct_io = o.direct_io;
    fo.queue_depth = o.max_in_flight;
    KVF_ASSIGN_OR_RETURN(owned, OpenFileBackend(o.backend, fo));
    backend = owned.get();
  }
  std::string lock_path = o.dir + "/kvferry-slab.lock";
  KVF_ASSIGN_OR_RETURN(ScopedFd lock, files_internal::OpenPrivateFile(lock_path, O_RDWR));
  if (::flock(lock.get(), LOCK_EX | LOCK_NB) != 0) {
    return Status::Unavailable(fmt::format(
        "file tier directory {} is in use by another SlabStore ({} is locked)", o.dir, lock_path));
  }
  Log(LogLevel::kInfo, "file tier: {} backend in {} ({} slots of {} payload bytes{}{})",
      backend->caps().name, o.dir, o.max_slots, o.slot_payload_bytes,
      backend->caps().direct_io ? ", O_DIRECT" : ", buffered",
      backend->caps().note.empty() ? "" : "; " + backend->caps().note);
  if (o.recover != "verify" && o.recover != "headers" && o.recover != "none") {
    return Status::InvalidArgument(
        fmt::format("slab store options: recover='{}' must be verify, headers or none", o.recover));
  }
  auto store = std::make_unique<SlabStoreImpl>(o, std::move(owned), backend, std::move(lock));
  KVF_RETURN_IF_ERROR(store->Recover());
  return std::unique_ptr<SlabStore>(std::move(store));
}

}  // namespace kvferry
