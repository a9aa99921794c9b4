#include "files/posix_io.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

namespace kvferry::files_internal {

void ScopedFd::Reset() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

std::string DirName(const std::string& path) {
  size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

Status ErrnoStatus(int err, std::string_view op, const std::string& path, int64_t offset) {
  std::string where = offset >= 0 ? fmt::format("{} {} at offset {}", op, path, offset)
                                  : fmt::format("{} {}", op, path);
  switch (err) {
    case ENOSPC:
    case EDQUOT:
      return Status::ResourceExhausted(
          fmt::format("no space left in {} ({}: {})", DirName(path), where, std::strerror(err)));
    case EIO:
      return Status::DataLoss(fmt::format("{}: I/O error ({})", where, std::strerror(err)));
    case ENOENT:
      return Status::NotFound(fmt::format("{}: {}", where, std::strerror(err)));
    case EACCES:
    case EPERM:
    case EROFS:
      return Status::InvalidArgument(
          fmt::format("{} is not writable ({}: {})", DirName(path), where, std::strerror(err)));
    default:
      return Status::Internal(fmt::format("{}: {} (errno {})", where, std::strerror(err), err));
  }
}

StatusOr<DirProbe> ProbeDir(const std::string& dir, bool want_direct) {
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0) {
    int err = errno;
    if (err == ENOENT || err == ENOTDIR) {
      return Status::NotFound(fmt::format("file tier directory {} does not exist", dir));
    }
    return ErrnoStatus(err, "stat", dir, -1);
  }
  if (!S_ISDIR(st.st_mode)) {
    return Status::InvalidArgument(fmt::format("file tier path {} is not a directory", dir));
  }
  if (::access(dir.c_str(), W_OK | X_OK) != 0) {
    return Status::InvalidArgument(
        fmt::format("file tier directory {} is not writable: {}", dir, std::strerror(errno)));
  }
  DirProbe probe;
  if (!want_direct) {
    probe.note = "O_DIRECT off by configuration";
    return probe;
  }
  // O_TMPFILE leaves nothing behind; fall back to a named probe file where it is unsupported.
  int fd = ::open(dir.c_str(), O_TMPFILE | O_RDWR | O_DIRECT | O_CLOEXEC, 0600);
  if (fd < 0 && errno != EINVAL) {
    // EOPNOTSUPP/EISDIR: no O_TMPFILE here; try a named file.
    std::string probe_path = dir + "/.kvferry-direct-probe";
    ::unlink(probe_path.c_str());  // a leftover of a killed probe
    fd = ::open(probe_path.c_str(), O_CREAT | O_EXCL | O_NOFOLLOW | O_RDWR | O_DIRECT | O_CLOEXEC,
                0600);
    int err = errno;
    ::unlink(probe_path.c_str());  // a refused O_DIRECT open may still have created it
    errno = err;
  }
  if (fd >= 0) {
    ::close(fd);
    probe.direct_io = true;
    return probe;
  }
  probe.note = fmt::format("the filesystem of {} refuses O_DIRECT ({}); using buffered I/O", dir,
                           std::strerror(errno));
  return probe;
}

Status CheckPrivateDir(const std::string& dir) {
  struct stat link;
  if (::lstat(dir.c_str(), &link) != 0) {
    int err = errno;
    if (err == ENOENT || err == ENOTDIR) {
      return Status::NotFound(fmt::format("file tier directory {} does not exist", dir));
    }
    return ErrnoStatus(err, "lstat", dir, -1);
  }
  const uid_t me = ::geteuid();
  if (S_ISLNK(link.st_mode) && link.st_uid != me && link.st_uid != 0) {
    return Status::InvalidArgument(fmt::format(
        "file tier directory {} is a symbolic link owned by uid {} (not you, uid {}, nor root): "
        "refusing to follow it",
        dir, link.st_uid, me));
  }
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0) return ErrnoStatus(errno, "stat", dir, -1);
  if (!S_ISDIR(st.st_mode)) {
    return Status::InvalidArgument(fmt::format("file tier path {} is not a directory", dir));
  }
  if (st.st_uid != me) {
    return Status::InvalidArgument(fmt::format(
        "file tier directory {} is owned by uid {}, not by you (uid {}): another user could "
        "replace its files; use a directory of your own (mkdir -m 700)",
        dir, st.st_uid, me));
  }
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
    return Status::InvalidArgument(fmt::format(
        "file tier directory {} is writable by {} (mode {:04o}): another user could replace "
        "its files; make it private (chmod go-w, or 700)",
        dir, (st.st_mode & S_IWOTH) ? "others" : "its group", st.st_mode & 07777));
  }
  return Status::Ok();
}

StatusOr<ScopedFd> OpenPrivateFile(const std::string& path, int flags) {
  // An existing file is opened as it is; a missing one is created exclusively, 0600. Neither
  // follows a symbolic link (O_NOFOLLOW), and O_EXCL makes a name planted between the two
  // attempts an error rather than a file we write.
  flags |= O_CLOEXEC | O_NOFOLLOW;
  ScopedFd fd(::open(path.c_str(), flags));
  for (int attempt = 0; !fd.valid() && errno == ENOENT && attempt < 2; ++attempt) {
    fd = ScopedFd(::open(path.c_str(), flags | O_CREAT | O_EXCL, 0600));
    if (!fd.valid() && errno == EEXIST) fd = ScopedFd(::open(path.c_str(), flags));
  }
  if (!fd.valid()) {
    int err = errno;
    if (err == ELOOP) {
      return Status::InvalidArgument(
          fmt::format("{} is a symbolic link: refusing to follow it", path));
    }
    if (err == ENOENT) {
      return Status::NotFound(
          fmt::format("file tier directory {} does not exist (opening {})", DirName(path), path));
    }
    return ErrnoStatus(err, "open", path, -1);
  }
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return ErrnoStatus(errno, "fstat", path, -1);
  if (!S_ISREG(st.st_mode)) {
    return Status::InvalidArgument(fmt::format("{} is not a regular file", path));
  }
  if (st.st_uid != ::geteuid()) {
    return Status::InvalidArgument(fmt::format(
        "{} is owned by uid {}, not by you (uid {}): refusing to use a file another user made",
        path, st.st_uid, ::geteuid()));
  }
  if (st.st_nlink != 1) {
    return Status::InvalidArgument(
        fmt::format("{} has {} hard links: refusing to write through a link to another file", path,
                    st.st_nlink));
  }
  // Files of earlier versions were made 0644: nobody else reads the cache.
  if ((st.st_mode & 077) != 0 && ::fchmod(fd.get(), 0600) != 0) {
    return ErrnoStatus(errno, "fchmod", path, -1);
  }
  return fd;
}

StatusOr<std::unique_ptr<PosixFile>> OpenPosixFile(const std::string& path, int64_t size,
                                                   bool direct) {
  KVF_ASSIGN_OR_RETURN(ScopedFd fd, OpenPrivateFile(path, O_RDWR | (direct ? O_DIRECT : 0)));
  int rc;
  do {
    rc = ::fallocate(fd.get(), 0, 0, size);
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) {
    int err = errno;
    if (err == EOPNOTSUPP) {
      if (::ftruncate(fd.get(), size) != 0) return ErrnoStatus(errno, "ftruncate", path, -1);
    } else {
      return ErrnoStatus(err, "fallocate", path, -1);
    }
  }
  return std::make_unique<PosixFile>(std::move(fd), path, size, direct);
}

int64_t IoBytes(const FileIo& io) {
  int64_t total = 0;
  for (const IoSegment& s : io.segments) total += s.bytes;
  return total;
}

Status CheckIo(const FileBackendCaps& caps, const FileIo& io) {
  if (io.file == nullptr) return Status::InvalidArgument("file I/O without a file");
  const int64_t a = caps.alignment;
  if (io.offset < 0 || io.offset + IoBytes(io) > io.file->size()) {
    return Status::InvalidArgument(
        fmt::format("I/O of {} bytes at offset {} is outside {} ({} bytes)", IoBytes(io), io.offset,
                    io.file->path(), io.file->size()));
  }
  if (caps.direct_io && io.offset % a != 0) {
    return Status::InvalidArgument(
        fmt::format("offset {} in {} is not a multiple of {}", io.offset, io.file->path(), a));
  }
  for (const IoSegment& s : io.segments) {
    if (s.kind == MemoryKind::kFile) {
      return Status::InvalidArgument("a file-kind segment is not memory");
    }
    if (s.kind == MemoryKind::kDevice) {
      if (!caps.device_memory) {
        return Status::InvalidArgument(
            fmt::format("backend {} can't read or write device memory", caps.name));
      }
      continue;
    }
    if (caps.direct_io &&
        (reinterpret_cast<uintptr_t>(s.data) % a != 0 || s.bytes % a != 0 || s.bytes < 0)) {
      return Status::InvalidArgument(fmt::format(
          "segment {} ({} bytes) is not aligned to {} for O_DIRECT", s.data, s.bytes, a));
    }
  }
  return Status::Ok();
}

Status TransferFully(const PosixIoFns& fns, bool write, const PosixFile& file, int64_t offset,
                     std::span<const IoSegment> segments, int64_t done) {
  // An iovec array per call; at most a handful of segments per slot, so keep it on the stack.
  constexpr size_t kMaxIov = 16;
  if (segments.size() > kMaxIov) {
    return Status::InvalidArgument(
        fmt::format("{} segments in one I/O; at most {}", segments.size(), kMaxIov));
  }
  int64_t total = 0;
  for (const IoSegment& s : segments) total += s.bytes;
  while (done < total) {
    struct iovec iov[kMaxIov];
    int n = 0;
    int64_t skip = done;
    for (const IoSegment& s : segments) {
      if (skip >= s.bytes) {
        skip -= s.bytes;
        continue;
      }
      iov[n].iov_base = static_cast<char*>(s.data) + skip;
      iov[n].iov_len = static_cast<size_t>(s.bytes - skip);
      skip = 0;
      ++n;
    }
    ssize_t r = write ? fns.pwritev(file.fd(), iov, n, offset + done)
                      : fns.preadv(file.fd(), iov, n, offset + done);
    if (r < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, write ? "write" : "read", file.path(), offset + done);
    }
    if (r == 0) {
      if (write) {
        return Status::DataLoss(fmt::format("short write to {} at offset {}: {} of {} bytes",
                                            file.path(), offset, done, total));
      }
      return Status::DataLoss(fmt::format("truncated file {}: read {} of {} bytes at offset {}",
                                          file.path(), done, total, offset));
    }
    done += r;
  }
  return Status::Ok();
}

}  // namespace kvferry::files_internal
