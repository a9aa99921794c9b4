#include "testing/raw_io_bench.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "files/posix_io.h"

namespace kvferry {
namespace {

using files_internal::ErrnoStatus;
using files_internal::ScopedFd;

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

// Runs the whole file once with pwrite/pread of `block` bytes.
Status Pass(int fd, const std::string& path, std::byte* buf, int64_t nbuf, int64_t total,
            int64_t block, bool write) {
  for (int64_t off = 0; off < total; off += block) {
    std::byte* p = buf + (off / block % nbuf) * block;
    ssize_t r = write ? ::pwrite(fd, p, block, off) : ::pread(fd, p, block, off);
    if (r < 0 && errno == EINTR) {
      off -= block;
      continue;
    }
    if (r < 0) return ErrnoStatus(errno, write ? "write" : "read", path, off);
    if (r != block) {
      return Status::DataLoss(fmt::format("short {} of {}: {} of {} bytes at offset {}",
                                          write ? "write" : "read", path, r, block, off));
    }
  }
  return Status::Ok();
}

}  // namespace

StatusOr<double> RawDirectIoGbps(const std::string& dir, int64_t bytes, int64_t block, bool write,
                                 int64_t buffer_bytes) {
  if (block <= 0 || block % 4096 != 0 || bytes <= 0) {
    return Status::InvalidArgument(fmt::format(
        "raw I/O bench: block {} must be a positive multiple of 4096, bytes {} > 0", block, bytes));
  }
  KVF_ASSIGN_OR_RETURN(files_internal::DirProbe probe, files_internal::ProbeDir(dir, true));
  if (!probe.direct_io) return Status::Unavailable(probe.note);
  const int64_t total = (bytes + block - 1) / block * block;
  std::string path = fmt::format("{}/kvferry-rawio-{}.tmp", dir, ::getpid());
  ScopedFd fd(::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_DIRECT | O_CLOEXEC, 0600));
  if (!fd.valid()) return ErrnoStatus(errno, "open", path, -1);
  struct Unlink {
    std::string p;
    ~Unlink() { ::unlink(p.c_str()); }
  } unlink_at_exit{path};
  if (::fallocate(fd.get(), 0, 0, total) != 0 && errno != EOPNOTSUPP) {
    return ErrnoStatus(errno, "fallocate", path, -1);
  }
  const int64_t nbuf = std::max<int64_t>(1, (buffer_bytes + block - 1) / block);
  void* raw = nullptr;
  if (posix_memalign(&raw, 4096, nbuf * block) != 0) {
    return Status::ResourceExhausted("raw I/O bench: no memory for the buffer");
  }
  std::unique_ptr<void, FreeDeleter> owner(raw);
  auto* buf = static_cast<std::byte*>(raw);
  std::memset(raw, 0x5a, nbuf * block);
  if (!write) KVF_RETURN_IF_ERROR(Pass(fd.get(), path, buf, nbuf, total, block, true));
  auto t0 = std::chrono::steady_clock::now();
  KVF_RETURN_IF_ERROR(Pass(fd.get(), path, buf, nbuf, total, block, write));
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return static_cast<double>(total) / s / 1e9;
}

}  // namespace kvferry
