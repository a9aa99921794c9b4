// The cuFile (GPUDirect Storage) backend. libcufile is loaded with dlopen at first use
// ("libcufile.so.0", then the path found at build time), so a binary built with cuFile runs on a
// machine without it; only cufile.h is needed to build. cuFileDriverOpen is called once per
// process. When the library can't be loaded or the driver does not open (no nvidia-fs, no GPU,
// no CUDA driver), OpenCufileFileBackend returns kUnavailable with the reason and
// OpenFileBackend falls back to posix, logging that reason.
//
// I/O: device-memory segments go through cuFileWrite/cuFileRead on a registered handle (GDS
// DMA, or cuFile's own compat path when the filesystem is not GDS-capable); host segments (the
// slot header page) go through pwritev/preadv on the same O_DIRECT fd. Items run in order on the
// calling thread; short transfers are finished in a loop. Buffers are not cuFileBufRegister'ed
// (cuFile bounces through its own pinned buffers for unregistered memory): registering the pool
// once is the next step for peak GDS throughput.
#include <cufile.h>
#include <dlfcn.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <future>
#include <memory>
#include <thread>

#include "base/log.h"
#include "files/posix_io.h"
#include "kvferry/file_backend.h"
#include "kvferry_build_config.h"

namespace kvferry {
namespace {

using files_internal::PosixFile;

// The entry points we use, resolved from libcufile.so.0.
struct CufileApi {
  CUfileError_t (*driver_open)();
  CUfileError_t (*handle_register)(CUfileHandle_t*, CUfileDescr_t*);
  void (*handle_deregister)(CUfileHandle_t);
  ssize_t (*read)(CUfileHandle_t, void*, size_t, off_t, off_t);
  ssize_t (*write)(CUfileHandle_t, const void*, size_t, off_t, off_t);
};

std::string CufileErrorText(CUfileError_t e) {
  return fmt::format("{} (cufile error {}, CUresult {})", CUFILE_ERRSTR(e.err),
                     static_cast<int>(e.err), static_cast<int>(e.cu_err));
}

constexpr std::chrono::seconds kDriverOpenTimeout{20};

// GDS needs the CUDA driver and a GPU; cuFileDriverOpen without them can spin (seen with the
// nvidia-cufile 1.15 wheel and no libcuda), so check first, through the driver API by dlopen.
Status CheckCudaDriver() {
  void* cuda = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (cuda == nullptr) {
    const char* err = ::dlerror();
    return Status::Unavailable(fmt::format("no CUDA driver (libcuda.so.1: {})", err ? err : "?"));
  }
  using InitFn = int (*)(unsigned);
  using CountFn = int (*)(int*);
  auto init = reinterpret_cast<InitFn>(::dlsym(cuda, "cuInit"));
  auto count = reinterpret_cast<CountFn>(::dlsym(cuda, "cuDeviceGetCount"));
  if (init == nullptr || count == nullptr) {
    return Status::Unavailable("libcuda.so.1 lacks cuInit/cuDeviceGetCount");
  }
  int rc = init(0);
  int n = 0;
  if (rc != 0) return Status::Unavailable(fmt::format("cuInit failed (CUresult {})", rc));
  rc = count(&n);
  if (rc != 0 || n == 0) {
    return Status::Unavailable(
        fmt::format("no GPU (cuDeviceGetCount: CUresult {}, {} devices)", rc, n));
  }
  return Status::Ok();  // libcuda stays loaded: cuFile uses it
}

// Loads the library and opens the driver once per process. The handle is never dlclose'd: the
// cuFile driver stays open for the life of the process, as NVIDIA's samples do.
const StatusOr<CufileApi>& LoadCufile() {
  static const StatusOr<CufileApi> api = []() -> StatusOr<CufileApi> {
    const char* candidates[] = {"libcufile.so.0", KVFERRY_CUFILE_NOTE};
    void* lib = nullptr;
    std::string tried;
    for (const char* name : candidates) {
      lib = ::dlopen(name, RTLD_NOW | RTLD_LOCAL);
      if (lib != nullptr) break;
      const char* err = ::dlerror();
      tried += fmt::format("{}{}: {}", tried.empty() ? "" : "; ", name, err ? err : "?");
    }
    if (lib == nullptr) return Status::Unavailable("can't load libcufile: " + tried);
    CufileApi a{};
    auto sym = [&](const char* name) { return ::dlsym(lib, name); };
    a.driver_open = reinterpret_cast<decltype(a.driver_open)>(sym("cuFileDriverOpen"));
    a.handle_register = reinterpret_cast<decltype(a.handle_register)>(sym("cuFileHandleRegister"));
    a.handle_deregister =
        reinterpret_cast<decltype(a.handle_deregister)>(sym("cuFileHandleDeregister"));
    a.read = reinterpret_cast<decltype(a.read)>(sym("cuFileRead"));
    a.write = reinterpret_cast<decltype(a.write)>(sym("cuFileWrite"));
    if (!a.driver_open || !a.handle_register || !a.handle_deregister || !a.read || !a.write) {
      return Status::Unavailable("libcufile lacks cuFileDriverOpen/HandleRegister/Read/Write");
    }
    KVF_RETURN_IF_ERROR(CheckCudaDriver());
    // cuFileDriverOpen has been seen to spin instead of failing where the CUDA driver is broken;
    // run it on a helper thread and give up after kDriverOpenTimeout (the thread is left behind).
    auto result = std::make_shared<std::promise<CUfileError_t>>();
    std::future<CUfileError_t> done = result->get_future();
    std::thread([open = a.driver_open, result] { result->set_value(open()); }).detach();
    if (done.wait_for(kDriverOpenTimeout) != std::future_status::ready) {
      return Status::Unavailable(
          fmt::format("cuFileDriverOpen did not return within {} s", kDriverOpenTimeout.count()));
    }
    CUfileError_t e = done.get();
    if (e.err != CU_FILE_SUCCESS) {
      return Status::Unavailable("cuFileDriverOpen failed: " + CufileErrorText(e));
    }
    return a;
  }();
  return api;
}

// An O_DIRECT file plus its cuFile handle (deregistered before the fd closes).
class CufileFile : public BackendFile {
 public:
  CufileFile(const CufileApi& api, std::unique_ptr<PosixFile> file, CUfileHandle_t handle)
      : api_(api), file_(std::move(file)), handle_(handle) {}
  ~CufileFile() override { api_.handle_deregister(handle_); }
  CufileFile(const CufileFile&) = delete;
  CufileFile& operator=(const CufileFile&) = delete;

  const std::string& path() const override { return file_->path(); }
  int64_t size() const override { return file_->size(); }
  const PosixFile& posix() const { return *file_; }
  CUfileHandle_t handle() const { return handle_; }

 private:
  const CufileApi& api_;
  const std::unique_ptr<PosixFile> file_;
  const CUfileHandle_t handle_;
};

class CufileFileBackend : public FileBackend {
 public:
  CufileFileBackend(const CufileApi& api, FileBackendCaps caps)
      : api_(api), caps_(std::move(caps)) {}

  const FileBackendCaps& caps() const override { return caps_; }

  StatusOr<std::unique_ptr<BackendFile>> Open(const std::string& path, int64_t size) override {
    KVF_ASSIGN_OR_RETURN(std::unique_ptr<PosixFile> f,
                         files_internal::OpenPosixFile(path, size, /*direct=*/true));
    CUfileDescr_t descr;
    std::memset(&descr, 0, sizeof(descr));
    descr.handle.fd = f->fd();
    descr.type = CU_FILE_HANDLE_TYPE_OPAQUE_FD;
    CUfileHandle_t handle = nullptr;
    CUfileError_t e = api_.handle_register(&handle, &descr);
    if (e.err != CU_FILE_SUCCESS) {
      return Status::Internal(
          fmt::format("cuFileHandleRegister({}): {}", path, CufileErrorText(e)));
    }
    return std::unique_ptr<BackendFile>(new CufileFile(api_, std::move(f), handle));
  }

  std::vector<Status> Write(std::span<const FileIo> ios, Deadline deadline) override {
    return Run(true, ios, deadline);
  }
  std::vector<Status> Read(std::span<const FileIo> ios, Deadline deadline) override {
    return Run(false, ios, deadline);
  }

 private:
  Status DeviceTransfer(bool write, const CufileFile& f, int64_t offset, void* data,
                        int64_t bytes) {
    int64_t done = 0;
    while (done < bytes) {
      ssize_t r = write ? api_.write(f.handle(), data, bytes - done, offset + done, done)
                        : api_.read(f.handle(), data, bytes - done, offset + done, done);
      if (r == -1) {
        if (errno == EINTR) continue;
        return files_internal::ErrnoStatus(errno, write ? "cuFileWrite" : "cuFileRead", f.path(),
                                           offset + done);
      }
      if (r < 0) {
        return Status::Internal(fmt::format("{} {} at offset {}: {}",
                                            write ? "cuFileWrite" : "cuFileRead", f.path(),
                                            offset + done, CUFILE_ERRSTR(-r)));
      }
      if (r == 0) {
        return Status::DataLoss(fmt::format("{} {} at offset {}: {} of {} bytes",
                                            write ? "short write to" : "truncated file", f.path(),
                                            offset, done, bytes));
      }
      done += r;
    }
    return Status::Ok();
  }

  std::vector<Status> Run(bool write, std::span<const FileIo> ios, Deadline deadline) {
    std::vector<Status> out;
    out.reserve(ios.size());
    files_internal::PosixIoFns fns;
    for (const FileIo& io : ios) {
      if (Clock::now() > deadline) {
        out.push_back(Status::DeadlineExceeded(fmt::format(
            "{} at offset {} not started before the deadline", io.file->path(), io.offset)));
        continue;
      }
      Status st = files_internal::CheckIo(caps_, io);
      const auto& f = static_cast<const CufileFile&>(*io.file);
      int64_t offset = io.offset;
      for (const IoSegment& s : io.segments) {
        if (!st.ok()) break;
        if (s.kind == MemoryKind::kDevice) {
          st = DeviceTransfer(write, f, offset, s.data, s.bytes);
        } else {
          st = files_internal::TransferFully(fns, write, f.posix(), offset,
                                             std::span<const IoSegment>(&s, 1));
        }
        offset += s.bytes;
      }
      out.push_back(std::move(st));
    }
    return out;
  }

  const CufileApi& api_;
  const FileBackendCaps caps_;
};

}  // namespace

StatusOr<std::unique_ptr<FileBackend>> OpenCufileFileBackend(const FileBackendOptions& options) {
  KVF_ASSIGN_OR_RETURN(files_internal::DirProbe probe,
                       files_internal::ProbeDir(options.dir, /*want_direct=*/true));
  if (!probe.direct_io) return Status::Unavailable("cuFile needs O_DIRECT: " + probe.note);
  const StatusOr<CufileApi>& api = LoadCufile();
  if (!api.ok()) return api.status();
  // The driver may open and still refuse this filesystem (no GDS support under it, as in a VM):
  // register one probe file here, so the caller falls back now rather than at every file.
  {
    const std::string path = options.dir + "/.kvferry-cufile-probe";
    auto f = files_internal::OpenPosixFile(path, 4096, /*direct=*/true);
    if (!f.ok()) return Status::Unavailable("cuFile probe file: " + f.status().ToString());
    CUfileDescr_t descr;
    std::memset(&descr, 0, sizeof(descr));
    descr.handle.fd = (*f)->fd();
    descr.type = CU_FILE_HANDLE_TYPE_OPAQUE_FD;
    CUfileHandle_t handle = nullptr;
    CUfileError_t e = api->handle_register(&handle, &descr);
    if (e.err == CU_FILE_SUCCESS) api->handle_deregister(handle);
    f->reset();
    ::unlink(path.c_str());
    if (e.err != CU_FILE_SUCCESS) {
      return Status::Unavailable(fmt::format("cuFileHandleRegister refuses files in {}: {}",
                                             options.dir, CufileErrorText(e)));
    }
  }
  FileBackendCaps caps;
  caps.name = "cufile";
  caps.device_memory = true;
  caps.direct_io = true;
  caps.alignment = 4096;
  caps.max_in_flight = 1;
  caps.note = "cuFile driver open (libcufile loaded with dlopen)";
  return std::unique_ptr<FileBackend>(new CufileFileBackend(*api, std::move(caps)));
}

}  // namespace kvferry
