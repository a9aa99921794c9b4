// FileBackend: the one seam between the file tier and the operating system's file I/O.
//
// Why: the file tier (SlabStore) must run the same format and slot logic over plain POSIX
// pwritev/preadv (with O_DIRECT where the filesystem allows it), io_uring (a whole batch in one
// submission), and cuFile/GDS (GPU memory to NVMe without a host bounce), and tests must be able
// to inject ENOSPC, EIO, short writes and corrupted reads without a broken disk. So the backend
// does bytes only: open/size a file, and run batches of positional, vectored reads and writes.
// It knows nothing of slots, headers or checksums.
//
// Completion semantics: Write() and Read() block until every item of the batch has finished or
// failed (or the deadline passed). When they return, every source buffer may be reused and every
// destination buffer holds what was read; the kernel holds no reference to any buffer. Errors of
// one item don't stop the others. An item's status is OK only when all its bytes were
// transferred: backends loop on short transfers and EINTR themselves; a transfer that makes no
// progress (end of file on read, 0 bytes written) is an error. errno values are converted here,
// once: ENOSPC/EDQUOT -> kResourceExhausted "no space left in DIR", EIO -> kDataLoss, end of file
// on read -> kDataLoss "truncated file", anything else -> kInternal, each with the file, offset
// and strerror text.
//
// Alignment: when caps().direct_io, every host segment's address and length and every item's
// offset must be multiples of caps().alignment (the caller stages unaligned data). Device-memory
// segments are accepted only when caps().device_memory.
//
// Thread-safety: a FileBackend is thread-safe: Open/Write/Read may be called from several threads
// at once, on the same or different files. A BackendFile is immutable after Open and may be used
// by several threads; it must outlive every batch that names it and must be destroyed through
// the backend that opened it (it is a unique_ptr; the backend outlives it).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvferry/device.h"
#include "kvferry/status.h"

#pragma GCC visibility push(default)  // the public API (kvferry/export.h)
namespace kvferry {

// What a FileBackend can do, as data.
struct FileBackendCaps {
  std::string name;            // "posix", "io_uring", "cufile"
  bool device_memory = false;  // reads/writes GPU memory directly (GDS)
  bool direct_io = false;      // bypasses the page cache (O_DIRECT)
  int64_t alignment = 1;       // required alignment of offsets, sizes and host buffers
  int32_t max_in_flight = 1;   // items the backend keeps in flight at once (queue depth)
  std::string note;            // why it is what it is ("tmpfs: no O_DIRECT", "GDS off: ...")
};

// One open file of a backend. Opaque: only its backend looks inside.
class BackendFile {
 public:
  virtual ~BackendFile() = default;
  virtual const std::string& path() const = 0;
  virtual int64_t size() const = 0;
};

// A piece of memory that is one part of a vectored transfer.
struct IoSegment {
  void* data = nullptr;  // const for writes
  int64_t bytes = 0;
  MemoryKind kind = MemoryKind::kHost;
};

// One positional transfer: the segments, in order, cover [offset, offset + sum(bytes)) of file.
struct FileIo {
  BackendFile* file = nullptr;
  int64_t offset = 0;
  std::span<const IoSegment> segments;
};

class FileBackend {
 public:
  virtual ~FileBackend() = default;

  virtual const FileBackendCaps& caps() const = 0;

  // Opens `path` read-write, creating it if needed, and makes sure `size` bytes are allocated
  // (fallocate; no holes, so a later write does not fail for space). Errors: kNotFound when the
  // directory does not exist, kInvalidArgument when it is not writable, kResourceExhausted when
  // the disk is full; each names the directory.
  virtual StatusOr<std::unique_ptr<BackendFile>> Open(const std::string& path, int64_t size) = 0;

  // Batches: one status per item, in order (see the header comment for semantics).
  virtual std::vector<Status> Write(std::span<const FileIo> ios, Deadline deadline) = 0;
  virtual std::vector<Status> Read(std::span<const FileIo> ios, Deadline deadline) = 0;
};

// Forwards every call to another backend. Tests derive from it and override one method to inject
// faults (ENOSPC, EIO, short writes, corrupted reads), the way LevelDB's EnvWrapper does.
// Does not own the target; the target must outlive the wrapper.
class FileBackendWrapper : public FileBackend {
 public:
  explicit FileBackendWrapper(FileBackend* target) : target_(target) {}
  FileBackend* target() const { return target_; }

  const FileBackendCaps& caps() const override { return target_->caps(); }
  StatusOr<std::unique_ptr<BackendFile>> Open(const std::string& path, int64_t size) override {
    return target_->Open(path, size);
  }
  std::vector<Status> Write(std::span<const FileIo> ios, Deadline deadline) override {
    return target_->Write(ios, deadline);
  }
  std::vector<Status> Read(std::span<const FileIo> ios, Deadline deadline) override {
    return target_->Read(ios, deadline);
  }

 private:
  FileBackend* const target_;
};

struct FileBackendOptions {
  // Directory the files will live in: probed at open (exists, writable, O_DIRECT allowed).
  std::string dir;
  // Use O_DIRECT when the filesystem allows it; otherwise buffered I/O with a logged reason.
  bool direct_io = true;
  // io_uring queue depth / items in flight.
  int32_t queue_depth = 32;
};

// POSIX: pwritev/preadv, O_DIRECT when the filesystem allows it. Always available.
StatusOr<std::unique_ptr<FileBackend>> OpenPosixFileBackend(const FileBackendOptions& options);
// io_uring: kUnavailable when the build has no liburing or the kernel refuses a ring.
StatusOr<std::unique_ptr<FileBackend>> OpenUringFileBackend(const FileBackendOptions& options);
// cuFile/GDS: kUnavailable when the build has no cuFile, libcufile.so.0 can't be loaded (dlopen)
// or cuFileDriverOpen fails; the status says which.
StatusOr<std::unique_ptr<FileBackend>> OpenCufileFileBackend(const FileBackendOptions& options);

// By name ("posix", "io_uring", "cufile"). When io_uring or cufile is unavailable, logs the
// reason once (warn) and returns the POSIX backend, whose caps().note repeats the reason.
StatusOr<std::unique_ptr<FileBackend>> OpenFileBackend(std::string_view name,
                                                       const FileBackendOptions& options);

// Names of the backends this build can try, in order: "posix", then "io_uring", "cufile".
std::vector<std::string> FileBackendNames();

}  // namespace kvferry
#pragma GCC visibility pop
