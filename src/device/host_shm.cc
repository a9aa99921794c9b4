#include "device/host_shm.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <map>

#include "base/thread_annotations.h"
#include "base/wire.h"
#include "device/peer_memory.h"

namespace kvferry {
namespace {

std::string MemfdName(uint64_t token) { return fmt::format("kvferry:{:016x}", token); }

// Random per allocation (getrandom): one token seen does not tell another.
uint64_t NewToken() { return RandomU64(); }

std::string Errno(int e) { return std::strerror(e); }

// An importer's view of another process's shared pages.
class ShmMapping final : public PeerMapping {
 public:
  ShmMapping(void* map, size_t map_bytes, std::byte* data, size_t bytes)
      : map_(map), map_bytes_(map_bytes), data_(data), bytes_(bytes) {}
  ~ShmMapping() override { munmap(map_, map_bytes_); }
  std::byte* data() const override { return data_; }
  size_t size() const override { return bytes_; }

 private:
  void* const map_;
  const size_t map_bytes_;
  std::byte* const data_;
  const size_t bytes_;
};

// Closes a descriptor on scope exit.
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) close(fd);
  }
};

std::atomic<int> g_method{0};  // 0 none yet, 1 /proc/<pid>/fd, 2 pidfd_getfd

}  // namespace

std::vector<std::byte> EncodeShmPayload(const ShmPayload& p) {
  WireWriter w;
  w.U32(p.fd);
  w.U64(p.offset);
  w.U64(p.file_bytes);
  w.U64(p.token);
  return w.Take();
}

StatusOr<ShmPayload> DecodeShmPayload(std::span<const std::byte> b) {
  if (b.size() != kShmPayloadBytes) {
    return Status::InvalidArgument(fmt::format(
        "cpu peer memory handle: payload of {} bytes, {} expected", b.size(), kShmPayloadBytes));
  }
  WireReader r(b);  // the size was checked above
  ShmPayload p;
  p.fd = r.U32("fd");
  p.offset = r.U64("offset");
  p.file_bytes = r.U64("file_bytes");
  p.token = r.U64("token");
  if (!r.ok()) return r.status();
  return p;
}

StatusOr<ShmBlock> AllocateShm(size_t bytes, size_t alignment, bool populate) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  if (alignment < page) alignment = page;
  ShmBlock b;
  b.token = NewToken();
  b.bytes = (bytes + page - 1) / page * page;
  b.fd =
      static_cast<int>(memfd_create(MemfdName(b.token).c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (b.fd < 0) {
    return Status::ResourceExhausted(
        fmt::format("memfd_create for {} bytes: {}", bytes, Errno(errno)));
  }
  auto fail = [&](std::string what) {
    const int e = errno;
    if (b.reserved != nullptr) munmap(b.reserved, b.reserved_bytes);
    close(b.fd);
    return Status::ResourceExhausted(
        fmt::format("shared host memory of {} bytes: {}: {}", bytes, what, Errno(e)));
  };
  if (ftruncate(b.fd, static_cast<off_t>(b.bytes)) != 0) return fail("ftruncate");
  if (fcntl(b.fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0)
    return fail("sealing");
  // Reserve room to place the mapping at the alignment, then map the memfd there.
  b.reserved_bytes = b.bytes + (alignment - page);
  void* r = mmap(nullptr, b.reserved_bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (r == MAP_FAILED) {
    b.reserved = nullptr;
    return fail("reserving address space");
  }
  b.reserved = static_cast<std::byte*>(r);
  const uintptr_t at = (reinterpret_cast<uintptr_t>(r) + alignment - 1) / alignment * alignment;
  void* m = mmap(reinterpret_cast<void*>(at), b.bytes, PROT_READ | PROT_WRITE,
                 MAP_SHARED | MAP_FIXED | (populate ? MAP_POPULATE : 0), b.fd, 0);
  if (m == MAP_FAILED) return fail("mapping the memfd");
  b.data = static_cast<std::byte*>(m);
  // Give back the padding on both sides.
  const size_t head = static_cast<size_t>(b.data - b.reserved);
  if (head > 0) munmap(b.reserved, head);
  const size_t tail = b.reserved_bytes - head - b.bytes;
  if (tail > 0) munmap(b.data + b.bytes, tail);
  b.reserved = b.data;
  b.reserved_bytes = b.bytes;
  return b;
}

void FreeShm(const ShmBlock& b) noexcept {
  munmap(b.reserved, b.reserved_bytes);
  close(b.fd);
}

struct ShmTable::Impl {
  mutable Mutex mu;
  std::map<uintptr_t, ShmBlock> blocks GUARDED_BY(mu);  // by start address
};

std::shared_ptr<ShmTable::Impl> ShmTable::MakeImpl() { return std::make_shared<Impl>(); }

void ShmTable::Add(const ShmBlock& b) {
  MutexLock lock(impl_->mu);
  impl_->blocks[reinterpret_cast<uintptr_t>(b.data)] = b;
}

std::optional<ShmBlock> ShmTable::Take(const void* data) {
  MutexLock lock(impl_->mu);
  auto it = impl_->blocks.find(reinterpret_cast<uintptr_t>(data));
  if (it == impl_->blocks.end()) return std::nullopt;
  ShmBlock b = it->second;
  impl_->blocks.erase(it);
  return b;
}

std::optional<ShmPayload> ShmTable::Find(const void* base, size_t bytes) const {
  const uintptr_t a = reinterpret_cast<uintptr_t>(base);
  MutexLock lock(impl_->mu);
  auto it = impl_->blocks.upper_bound(a);
  if (it == impl_->blocks.begin()) return std::nullopt;
  --it;
  const ShmBlock& b = it->second;
  const uint64_t off = a - it->first;
  if (off + bytes > b.bytes) return std::nullopt;
  return ShmPayload{static_cast<uint32_t>(b.fd), off, b.bytes, b.token};
}

StatusOr<std::unique_ptr<PeerMapping>> MapPeerShm(uint32_t pid, uint64_t bytes,
                                                  const ShmPayload& p) {
  const std::string where = fmt::format("descriptor {} of process {}", p.fd, pid);
  if (p.offset > p.file_bytes || bytes > p.file_bytes - p.offset) {
    return Status::InvalidArgument(
        fmt::format("cpu peer memory handle: region of {} bytes at offset {} runs past the "
                    "{}-byte memfd ({})",
                    bytes, p.offset, p.file_bytes, where));
  }
  // /proc/<pid>/fd/<n> first (ptrace read access); pidfd_getfd where that is refused.
  Fd fd;
  int method = 1;
  const std::string path = fmt::format("/proc/{}/fd/{}", pid, p.fd);
  fd.fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
  const int open_errno = errno;
  if (fd.fd < 0) {
    Fd pidfd{static_cast<int>(syscall(SYS_pidfd_open, static_cast<pid_t>(pid), 0))};
    if (pidfd.fd >= 0) {
      fd.fd = static_cast<int>(syscall(SYS_pidfd_getfd, pidfd.fd, static_cast<int>(p.fd), 0));
    }
    if (fd.fd < 0) {
      const int e = errno;
      return Status::Unavailable(fmt::format(
          "cpu peer memory: can't open {} ({}: {}; pidfd_getfd: {}): the process exited, or "
          "this process may not read its descriptors (another user)",
          where, path, Errno(open_errno), Errno(e)));
    }
    method = 2;
  }
  // A kvferry memfd of exactly this allocation: sealed (only memfds take seals), its name, its
  // size.
  const int seals = fcntl(fd.fd, F_GET_SEALS);
  char link[256] = {};
  const std::string self = fmt::format("/proc/self/fd/{}", fd.fd);
  const ssize_t n = readlink(self.c_str(), link, sizeof link - 1);
  const std::string name = n > 0 ? std::string(link, static_cast<size_t>(n)) : "?";
  const std::string want = "/memfd:" + MemfdName(p.token);
  if (seals < 0 || (seals & F_SEAL_SHRINK) == 0 || name.rfind(want, 0) != 0) {
    return Status::InvalidArgument(
        fmt::format("cpu peer memory: {} is {} (seals {}), not kvferry's memfd {}", where, name,
                    seals, want.substr(7)));
  }
  struct stat st {};
  if (fstat(fd.fd, &st) != 0 || static_cast<uint64_t>(st.st_size) != p.file_bytes) {
    return Status::InvalidArgument(
        fmt::format("cpu peer memory: {} ({}) holds {} bytes, the handle declares {}", where, name,
                    static_cast<int64_t>(st.st_size), p.file_bytes));
  }
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t map_off = p.offset / page * page;
  const size_t map_bytes = static_cast<size_t>(p.offset - map_off + bytes);
  void* m = mmap(nullptr, map_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd.fd,
                 static_cast<off_t>(map_off));
  if (m == MAP_FAILED) {
    return Status::ResourceExhausted(
        fmt::format("cpu peer memory: mapping {} bytes of {}: {}", map_bytes, where, Errno(errno)));
  }
  g_method.store(method, std::memory_order_relaxed);
  return std::unique_ptr<PeerMapping>(std::make_unique<ShmMapping>(
      m, map_bytes, static_cast<std::byte*>(m) + (p.offset - map_off), static_cast<size_t>(bytes)));
}

std::string ShmOpenMethod() {
  switch (g_method.load(std::memory_order_relaxed)) {
    case 1:
      return "proc-fd";
    case 2:
      return "pidfd-getfd";
    default:
      return "none";
  }
}

}  // namespace kvferry
