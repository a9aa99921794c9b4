// Finds, checks and loads NIXL's C API (see nixl_api.h for the search order and the checks).
#include "transport/nixl_api.h"

#include <dlfcn.h>
#include <fmt/format.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <string>
#include <system_error>
#include <vector>

#include "base/log.h"
#include "kvferry/config.h"

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define KVFERRY_NIXL_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define KVFERRY_NIXL_SANITIZED 1
#endif
#endif

#ifndef KVFERRY_NIXL_SEARCH
#define KVFERRY_NIXL_SEARCH ""
#endif

namespace kvferry::nixl_detail {
namespace {

namespace fs = std::filesystem;

constexpr const char* kLibName = "libnixl_capi.so";
constexpr const char* kWheelLibDir = ".nixl_cu13.mesonpy.libs";

bool IsFile(const fs::path& p) {
  std::error_code ec;
  return fs::is_regular_file(p, ec);
}

// The library inside `where` (the file, a directory holding it, or a site-packages directory
// holding the wheel), or an empty path.
fs::path LibraryIn(const fs::path& where) {
  if (where.empty()) return {};
  if (IsFile(where)) return where;
  if (IsFile(where / kLibName)) return where / kLibName;
  if (IsFile(where / kWheelLibDir / kLibName)) return where / kWheelLibDir / kLibName;
  return {};
}

// Where a Python that runs kvferry keeps its packages: the directories above the file that holds
// this code (site-packages/kvferry/_core*.so, or a libkvferry.so beside it: up to three levels),
// and PREFIX/lib/python3.*/site-packages of an executable PREFIX/bin/python* (/proc/self/exe
// names the base interpreter, not a venv's link to it: the first way finds a venv's).
std::vector<fs::path> RunningPythonSitePackages() {
  std::vector<fs::path> out;
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&RunningPythonSitePackages), &info) != 0 &&
      info.dli_fname != nullptr) {
    fs::path dir = fs::path(info.dli_fname).parent_path();
    for (int up = 0; up < 3 && !dir.empty() && dir != dir.root_path(); ++up) {
      if (dir.filename() == "site-packages") out.push_back(dir);
      dir = dir.parent_path();
    }
  }
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (ec || exe.filename().string().rfind("python", 0) != 0) return out;
  const fs::path lib = exe.parent_path().parent_path() / "lib";
  for (const auto& d : fs::directory_iterator(lib, ec)) {
    if (d.path().filename().string().rfind("python3", 0) == 0) {
      out.push_back(d.path() / "site-packages");
    }
  }
  return out;
}

// "1.5.1" from a nixl*.dist-info/METADATA in the site-packages directory above the library's
// directory, or "".
std::string WheelVersion(const fs::path& library) {
  const fs::path site = library.parent_path().parent_path();
  std::error_code ec;
  for (const auto& d : fs::directory_iterator(site, ec)) {
    const std::string n = d.path().filename().string();
    if (n.rfind("nixl_cu", 0) != 0 || n.find(".dist-info") == std::string::npos) continue;
    std::ifstream in(d.path() / "METADATA");
    for (std::string line; std::getline(in, line);) {
      if (line.rfind("Version:", 0) == 0) {
        std::string v = line.substr(8);
        v.erase(0, v.find_first_not_of(" \t"));
        v.erase(v.find_last_not_of(" \t\r") + 1);
        return v;
      }
    }
  }
  return "";
}

struct Loaded {
  NixlApi api;
  Status status;
};

// NIXL's wheel carries its own UCX, whose transport modules (libuct_cma, libuct_cuda, ...) sit in
// `<site>/<wheel>.libs/ucx` and are loaded by that UCX's module loader without RTLD_DEEPBIND: their
// uct_/ucs_ calls then bind to the UCX already in the process (kvferry's, same symbol names), they
// register with the wrong UCX, and NIXL's UCX runs without them ("transport 'cma' is not
// available": NIXL between processes on one host fell back to TCP). Loading them first with
// RTLD_DEEPBIND binds them to their own UCX; the module loader's dlopen then finds them loaded
// (same file). Only the one-host modules, CMA and CUDA (cuda_copy, cuda_ipc): preloading the
// InfiniBand ones crashed the process at exit in their libnl-route's destructor (measured), so they
// stay as UCX loads them (RDMA through NIXL is not covered here). A module whose dependencies are
// absent (CUDA without a driver) fails to load and is left to UCX. Returns how many were loaded.
int PreloadWheelUcxModules(const fs::path& library) {
  int loaded = 0;
  std::error_code ec;
  const fs::path site = library.parent_path().parent_path();
  for (const auto& libs : fs::directory_iterator(site, ec)) {
    const std::string name = libs.path().filename().string();
    if (name.rfind("nixl", 0) != 0 || !name.ends_with(".libs")) continue;
    for (const auto& m : fs::directory_iterator(libs.path() / "ucx", ec)) {
      const std::string file = m.path().filename().string();
      if (file.rfind("libuct_cma.so", 0) != 0 && file.rfind("libuct_cuda.so", 0) != 0) continue;
      if (dlopen(m.path().c_str(), RTLD_LAZY | RTLD_LOCAL | RTLD_DEEPBIND) != nullptr) {
        ++loaded;
      } else {
        const char* e = dlerror();
        Log(LogLevel::kDebug, "nixl: UCX module {} not preloaded: {}", m.path().string(),
            e ? e : "unknown error");
      }
    }
  }
  return loaded;
}

Loaded Load() {
  Loaded out;
  std::vector<fs::path> tried;
  fs::path lib;
  const std::string knob = Config::Global().String("nixl.library");
  if (!knob.empty()) {
    lib = LibraryIn(knob);
    if (lib.empty()) {
      out.status = Status::Unavailable(fmt::format(
          "nixl.library='{}' is not {}, a directory holding it, or a site-packages directory "
          "holding the nixl-cu13 wheel",
          knob, kLibName));
      return out;
    }
  } else {
    std::vector<fs::path> places;
    std::string search = KVFERRY_NIXL_SEARCH;
    for (size_t at = 0; at <= search.size();) {
      size_t end = search.find(':', at);
      if (end == std::string::npos) end = search.size();
      if (end > at) places.emplace_back(search.substr(at, end - at));
      at = end + 1;
    }
    for (const fs::path& p : RunningPythonSitePackages()) places.push_back(p);
    for (const fs::path& p : places) {
      tried.push_back(p);
      lib = LibraryIn(p);
      if (!lib.empty()) break;
    }
    if (lib.empty()) {
      std::string where;
      for (const fs::path& p : tried) where += (where.empty() ? "" : ", ") + p.string();
      out.status = Status::Unavailable(fmt::format(
          "NIXL not found: no {} in {} (install the nixl-cu13 wheel: scripts/setup, or name it "
          "with nixl.library)",
          kLibName, where.empty() ? "any place searched" : where));
      return out;
    }
  }
  out.api.library_path = lib.string();
  out.api.version = WheelVersion(lib);
  if (Config::Global().Bool("nixl.check_version")) {
    if (out.api.version.empty()) {
      out.status = Status::Unavailable(fmt::format(
          "{}: no nixl_cu*.dist-info beside it says which NIXL this is (kvferry declares the C "
          "API of NIXL 1.5; nixl.check_version=false uses it anyway)",
          out.api.library_path));
      return out;
    }
    if (out.api.version.rfind("1.5.", 0) != 0) {
      out.status = Status::Unavailable(fmt::format(
          "{} is NIXL {}; kvferry declares the C API of NIXL 1.5 (nixl.check_version=false uses "
          "it anyway)",
          out.api.library_path, out.api.version));
      return out;
    }
  }
#ifdef KVFERRY_NIXL_SANITIZED
  // NIXL's UCX plugin must be loaded with RTLD_DEEPBIND (below), which ASan and TSan refuse
  // (they abort the process).
  out.status = Status::Unavailable(
      "NIXL is not used in a sanitizer build (its UCX plugin needs "
      "RTLD_DEEPBIND, which the sanitizers refuse)");
  return out;
#endif
  // NIXL's UCX plugin links the wheel's own UCX (a newer one than kvferry's, whose libraries have
  // other file names but the same symbols). Loaded plainly, its calls bind to the UCX already in
  // the process (kvferry's), which hangs in uct_md_query_tl_resources. NIXL loads the plugin with
  // RTLD_DEEPBIND when NIXL_UCX_DEEPBIND is set: its own UCX first. Set only when not set already.
  setenv("NIXL_UCX_DEEPBIND", "1", 0);
  // NIXL 1.5.1 maps memory without telling UCX its type, so UCX takes it from its memory-type
  // cache, which learns of GPU allocations through libucm_cuda's hooks. NIXL's libucm_cuda,
  // loaded by UCX's module loader, most likely binds to kvferry's libucm (not proven), and the
  // cache misses any allocation made before NIXL's UCX started: GPU memory was registered as host
  // memory ("VRAM memory is detected as host by UCX", H100, session 34). Without the cache, UCX
  // asks its CUDA memory domain (cuPointerGetAttributes) at each registration. kvferry's own UCX
  // names the memory type on every call, so the cache's absence costs it nothing.
  if (CudaDriverPresent()) setenv("UCX_MEMTYPE_CACHE", "n", 0);
  const int modules = PreloadWheelUcxModules(out.api.library_path);
  // RTLD_LOCAL: NIXL's symbols stay out of the process's global scope.
  void* h = dlopen(out.api.library_path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (h == nullptr) {
    const char* e = dlerror();
    out.status = Status::Unavailable(
        fmt::format("dlopen {}: {}", out.api.library_path, e ? e : "unknown error"));
    return out;
  }
  std::string missing;
#define KVFERRY_NIXL_RESOLVE(name, ...)                                                           \
  out.api.name = reinterpret_cast<std::add_pointer_t<__VA_ARGS__>>(dlsym(h, "nixl_capi_" #name)); \
  if (out.api.name == nullptr) missing += (missing.empty() ? "" : ", ") + std::string(#name);
  KVFERRY_NIXL_FUNCTIONS(KVFERRY_NIXL_RESOLVE)
#undef KVFERRY_NIXL_RESOLVE
  if (!missing.empty()) {
    out.status = Status::Unavailable(fmt::format("{} (NIXL {}) lacks nixl_capi_ functions: {}",
                                                 out.api.library_path, out.api.version, missing));
    return out;
  }
  Log(LogLevel::kDebug, "nixl: loaded {} (NIXL {}), {} of its UCX modules preloaded",
      out.api.library_path, out.api.version, modules);
  return out;
}

}  // namespace

StatusOr<const NixlApi*> LoadNixl() {
  // One try per value of the knobs that decide it (tests change them); never freed: the library
  // stays loaded.
  static std::mutex mu;
  static auto* tries = new std::map<std::string, const Loaded*>();
  const std::string knobs = Config::Global().String("nixl.library") + "\n" +
                            (Config::Global().Bool("nixl.check_version") ? "1" : "0");
  std::lock_guard<std::mutex> lock(mu);
  const Loaded*& loaded = (*tries)[knobs];
  if (loaded == nullptr) loaded = new Loaded(Load());
  if (!loaded->status.ok()) return loaded->status;
  return &loaded->api;
}

namespace {
// The driver API's cuPointerGetAttribute, declared here (CUresult, CUpointer_attribute and
// CUdeviceptr are an int, an int and an unsigned long long); null without a driver.
using GetAttribute = int (*)(void* data, int attribute, unsigned long long ptr);
GetAttribute PointerGetAttribute() {
  static const GetAttribute get = [] {
    void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    return h ? reinterpret_cast<GetAttribute>(dlsym(h, "cuPointerGetAttribute")) : nullptr;
  }();
  return get;
}
}  // namespace

bool CudaDriverPresent() { return PointerGetAttribute() != nullptr; }

StatusOr<MemPlace> PlaceOf(const void* p, bool gpu) {
  if (!gpu) return MemPlace{};
  constexpr int kMemoryTypeAttr = 2;         // CU_POINTER_ATTRIBUTE_MEMORY_TYPE
  constexpr int kDeviceOrdinalAttr = 9;      // CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
  constexpr unsigned kMemoryTypeDevice = 2;  // CU_MEMORYTYPE_DEVICE
  const GetAttribute get = PointerGetAttribute();
  if (get == nullptr) {
    return Status::Unavailable("nixl transport: GPU memory needs the CUDA driver (libcuda.so.1)");
  }
  const auto ptr = static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(p));
  unsigned type = 0;
  int ordinal = -1;
  const int rc_type = get(&type, kMemoryTypeAttr, ptr);
  if (rc_type != 0 || type != kMemoryTypeDevice || get(&ordinal, kDeviceOrdinalAttr, ptr) != 0 ||
      ordinal < 0) {
    return Status::InvalidArgument(fmt::format(
        "nixl transport: {} is not GPU memory (cuPointerGetAttribute: {}, memory type {})", p,
        rc_type, type));
  }
  return MemPlace{kMemVram, static_cast<uint64_t>(ordinal)};
}

Status FromCapi(int st, const std::string& what) {
  switch (st) {
    case kCapiSuccess:
    case kCapiInProg:
      return Status::Ok();
    case kCapiInvalidParam:
      return Status::InvalidArgument(what + ": NIXL: invalid parameter");
    case kCapiNotFound:
      return Status::NotFound(what + ": NIXL: not found (metadata not loaded, or no backend)");
    case kCapiInvalidState:
      return Status::Internal(what + ": NIXL: invalid state");
    case kCapiException:
      return Status::Internal(what + ": NIXL: exception");
    default:
      return Status::Unavailable(fmt::format("{}: NIXL: backend error ({})", what, st));
  }
}

}  // namespace kvferry::nixl_detail
