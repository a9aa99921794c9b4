// POSIX building blocks shared by the file backends (posix, io_uring, cuFile): the fd owner, the
// open file, the directory probe, errno conversion, and the loop that finishes short transfers.
// Internal to src/files. Thread-safety: PosixFile is immutable after open; the free functions are
// thread-safe.
#pragma once

#include <sys/types.h>
#include <sys/uio.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "kvferry/file_backend.h"

namespace kvferry::files_internal {

// Move-only owner of a file descriptor.
class ScopedFd {
 public:
  ScopedFd() = default;
  explicit ScopedFd(int fd) : fd_(fd) {}
  ~ScopedFd() { Reset(); }
  ScopedFd(ScopedFd&& o) noexcept : fd_(o.Release()) {}
  ScopedFd& operator=(ScopedFd&& o) noexcept {
    if (this != &o) {
      Reset();
      fd_ = o.Release();
    }
    return *this;
  }
  ScopedFd(const ScopedFd&) = delete;
  ScopedFd& operator=(const ScopedFd&) = delete;

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int Release() {
    int fd = fd_;
    fd_ = -1;
    return fd;
  }
  void Reset();

 private:
  int fd_ = -1;
};

// An open file of the POSIX-based backends.
class PosixFile : public BackendFile {
 public:
  PosixFile(ScopedFd fd, std::string path, int64_t size, bool direct)
      : fd_(std::move(fd)), path_(std::move(path)), size_(size), direct_(direct) {}
  const std::string& path() const override { return path_; }
  int64_t size() const override { return size_; }
  int fd() const { return fd_.get(); }
  bool direct() const { return direct_; }

 private:
  ScopedFd fd_;
  const std::string path_;
  const int64_t size_;
  const bool direct_;
};

// The system calls the transfer loop uses; tests replace them to force short transfers, EINTR.
struct PosixIoFns {
  ssize_t (*pwritev)(int fd, const struct iovec* iov, int iovcnt, off_t offset) = ::pwritev;
  ssize_t (*preadv)(int fd, const struct iovec* iov, int iovcnt, off_t offset) = ::preadv;
};

struct DirProbe {
  bool direct_io = false;
  std::string note;  // why not direct, when not
};

// Checks that `dir` exists (kNotFound naming it), is a writable directory (kInvalidArgument), and
// whether files in it can be opened with O_DIRECT (when want_direct).
StatusOr<DirProbe> ProbeDir(const std::string& dir, bool want_direct);

// The file tier's directory must be private to this user: kNotFound when it does not exist;
// kInvalidArgument when it is not a directory, is not owned by the effective user, is writable by
// group or others, or is reached through a symbolic link owned by another user (not root).
Status CheckPrivateDir(const std::string& dir);

// Opens `path` (flags: O_RDWR and the like) without following a symbolic link, creating it
// exclusively with mode 0600 when it does not exist. Refuses (kInvalidArgument) anything but a
// regular file owned by the effective user with one link; narrows an existing file's mode to 0600.
StatusOr<ScopedFd> OpenPrivateFile(const std::string& path, int flags);

// Opens/creates `path` (OpenPrivateFile) and allocates `size` bytes (fallocate; ftruncate where
// unsupported).
StatusOr<std::unique_ptr<PosixFile>> OpenPosixFile(const std::string& path, int64_t size,
                                                   bool direct);

std::string DirName(const std::string& path);

// errno -> Status, once, with what was being done: "write FILE at offset N: strerror".
Status ErrnoStatus(int err, std::string_view op, const std::string& path, int64_t offset);

// Transfers the segments at `offset`, skipping the first `done` bytes (already transferred by an
// earlier attempt). Loops on short transfers and EINTR; no progress is an error.
Status TransferFully(const PosixIoFns& fns, bool write, const PosixFile& file, int64_t offset,
                     std::span<const IoSegment> segments, int64_t done = 0);

// kInvalidArgument when an item breaks the caps' alignment or memory-kind rules.
Status CheckIo(const FileBackendCaps& caps, const FileIo& io);

int64_t IoBytes(const FileIo& io);

// A POSIX backend with replaceable system calls (tests).
std::unique_ptr<FileBackend> MakePosixFileBackend(FileBackendCaps caps, PosixIoFns fns);

}  // namespace kvferry::files_internal
