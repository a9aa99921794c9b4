// The POSIX backend: one pwritev/preadv per item (looping on short transfers), items in order on
// the calling thread. O_DIRECT when the directory's filesystem allows it (probed at open).
#include <utility>

#include "base/log.h"
#include "files/posix_io.h"
#include "kvferry/file_backend.h"
#include "kvferry_build_config.h"

namespace kvferry {
namespace files_internal {
namespace {

class PosixFileBackend : public FileBackend {
 public:
  PosixFileBackend(FileBackendCaps caps, PosixIoFns fns) : caps_(std::move(caps)), fns_(fns) {}

  const FileBackendCaps& caps() const override { return caps_; }

  StatusOr<std::unique_ptr<BackendFile>> Open(const std::string& path, int64_t size) override {
    KVF_ASSIGN_OR_RETURN(std::unique_ptr<PosixFile> f, OpenPosixFile(path, size, caps_.direct_io));
    return std::unique_ptr<BackendFile>(std::move(f));
  }

  std::vector<Status> Write(std::span<const FileIo> ios, Deadline deadline) override {
    return Run(true, ios, deadline);
  }
  std::vector<Status> Read(std::span<const FileIo> ios, Deadline deadline) override {
    return Run(false, ios, deadline);
  }

 private:
  std::vector<Status> Run(bool write, std::span<const FileIo> ios, Deadline deadline) {
    std::vector<Status> out;
    out.reserve(ios.size());
    for (const FileIo& io : ios) {
      // Synchronous I/O can't be interrupted; the deadline is checked between items.
      if (Clock::now() > deadline) {
        out.push_back(Status::DeadlineExceeded(
            fmt::format("file {} at offset {} not started before the deadline",
                        io.file ? io.file->path() : "?", io.offset)));
        continue;
      }
      Status st = CheckIo(caps_, io);
      if (st.ok()) {
        st = TransferFully(fns_, write, static_cast<const PosixFile&>(*io.file), io.offset,
                           io.segments);
      }
      out.push_back(std::move(st));
    }
    return out;
  }

  const FileBackendCaps caps_;
  const PosixIoFns fns_;
};

}  // namespace

std::unique_ptr<FileBackend> MakePosixFileBackend(FileBackendCaps caps, PosixIoFns fns) {
  return std::make_unique<PosixFileBackend>(std::move(caps), fns);
}

}  // namespace files_internal

StatusOr<std::unique_ptr<FileBackend>> OpenPosixFileBackend(const FileBackendOptions& options) {
  KVF_ASSIGN_OR_RETURN(files_internal::DirProbe probe,
                       files_internal::ProbeDir(options.dir, options.direct_io));
  if (options.direct_io && !probe.direct_io) Log(LogLevel::kWarn, "file tier: {}", probe.note);
  FileBackendCaps caps;
  caps.name = "posix";
  caps.device_memory = false;
  caps.direct_io = probe.direct_io;
  caps.alignment = probe.direct_io ? 4096 : 1;
  caps.max_in_flight = 1;
  caps.note = probe.note;
  return files_internal::MakePosixFileBackend(std::move(caps), files_internal::PosixIoFns{});
}

#if !KVFERRY_HAVE_URING
StatusOr<std::unique_ptr<FileBackend>> OpenUringFileBackend(const FileBackendOptions&) {
  return Status::Unavailable("io_uring backend: this build has no liburing");
}
#endif

#if !KVFERRY_HAVE_CUFILE
StatusOr<std::unique_ptr<FileBackend>> OpenCufileFileBackend(const FileBackendOptions&) {
  return Status::Unavailable("cufile backend: this build has no cuFile (CUDA off or no cufile.h)");
}
#endif

std::vector<std::string> FileBackendNames() {
  std::vector<std::string> names = {"posix"};
  if (KVFERRY_HAVE_URING) names.push_back("io_uring");
  if (KVFERRY_HAVE_CUFILE) names.push_back("cufile");
  return names;
}

StatusOr<std::unique_ptr<FileBackend>> OpenFileBackend(std::string_view name,
                                                       const FileBackendOptions& options) {
  if (name == "posix") return OpenPosixFileBackend(options);
  StatusOr<std::unique_ptr<FileBackend>> chosen = Status::InvalidArgument(
      fmt::format("unknown file backend '{}'; expected posix|io_uring|cufile", name));
  if (name == "io_uring") {
    chosen = OpenUringFileBackend(options);
  } else if (name == "cufile") {
    chosen = OpenCufileFileBackend(options);
  } else {
    return chosen;
  }
  if (chosen.ok()) return chosen;
  if (chosen.status().code() != StatusCode::kUnavailable) return chosen;
  // Unavailable: fall back to POSIX, saying why, once.
  Log(LogLevel::kWarn, "file tier: {} unavailable, using posix: {}", name,
      chosen.status().message());
  KVF_ASSIGN_OR_RETURN(std::unique_ptr<FileBackend> posix, OpenPosixFileBackend(options));
  // caps() is const; rebuild with the reason in the note.
  FileBackendCaps caps = posix->caps();
  caps.note = fmt::format("{} unavailable ({}){}{}", name, chosen.status().message(),
                          caps.note.empty() ? "" : "; ", caps.note);
  return files_internal::MakePosixFileBackend(std::move(caps), files_internal::PosixIoFns{});
}

}  // namespace kvferry
