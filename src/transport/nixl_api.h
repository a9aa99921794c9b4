// NIXL's C API, loaded at run time: the declarations kvferry uses, and the loader.
//
// Why at run time: the nixl-cu13 wheel (PyPI) ships no C++ headers, but it ships libnixl_capi.so,
// NIXL's C API (the one its Rust bindings use), with its plugins and its own UCX. kvferry declares
// the few C functions it calls here (its own declarations of a documented C ABI, checked against
// the NIXL version the wheel reports) and resolves them with dlsym, so a kvferry build needs no
// NIXL at all, and a machine without it still runs every other transport.
//
// Finding the library (first hit wins; LoadNixl() says which places it tried):
//   1. knob nixl.library: libnixl_capi.so itself, a directory holding it, or a site-packages
//      directory holding the wheel (.nixl_cu13.mesonpy.libs/);
//   2. the site-packages directories compiled in (KVFERRY_NIXL_SEARCH: scripts/setup's .deps/py,
//      where it installs the nixl-cu13 wheel, and CMake's KVFERRY_NIXL_DIR);
//   3. the site-packages of the running Python, for kvferry used from Python: the one above the
//      module that holds this code, or PREFIX/lib/python3.*/site-packages of an executable
//      PREFIX/bin/python*.
// Version: the wheel's dist-info (nixl_cu13-X.Y.Z.dist-info/METADATA beside the library's
// directory) must say 1.5.x, the C ABI declared here (the agent config struct, the status codes);
// another version, or none found, is refused unless nixl.check_version=false.
//
// Thread-safety: LoadNixl() may be called from any thread; it tries once per value of the knobs
// above (the library, once loaded, is never unloaded: NIXL loads its plugins RTLD_NODELETE anyway).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "kvferry/status.h"

namespace kvferry::nixl_detail {

// ---- The C ABI (NIXL 1.5: src/bindings/rust/wrapper.h declares it; these are kvferry's own
// declarations of the part kvferry calls). Every call returns a status; output parameters are
// written only on success. Blobs and names the library returns are malloc'd: free() them.
enum CapiStatus : int {
  kCapiSuccess = 0,
  kCapiInvalidParam = -1,
  kCapiBackend = -2,  // every NIXL error of a backend (a dead peer too) comes back as this
  kCapiInvalidState = -3,
  kCapiException = -4,
  kCapiInProg = 1,
  kCapiNoTelemetry = -5,
  kCapiNotFound = -6,
};

enum CapiMemType : int { kMemDram = 0, kMemVram = 1 };
// Where memory lies, as NIXL names it: a memory type (CapiMemType) and a device id (the CUDA
// ordinal for VRAM, 0 for DRAM).
struct MemPlace {
  int mem = kMemDram;
  uint64_t device = 0;
  bool operator==(const MemPlace&) const = default;
};

enum CapiXferOp : int { kOpRead = 0, kOpWrite = 1 };
enum CapiThreadSync : int { kSyncNone = 0, kSyncStrict = 1, kSyncRw = 2 };

struct CapiAgentConfig {  // nixl_capi_agent_config_t, field by field
  bool enable_prog_thread;
  bool enable_listen_thread;
  int listen_port;
  int thread_sync;  // CapiThreadSync (a C enum: int-sized)
  unsigned int num_workers;
  uint64_t pthr_delay_us;
  uint64_t lthr_delay_us;
  bool capture_telemetry;
};

using Agent = struct nixl_agent_opaque*;
using Params = struct nixl_params_opaque*;
using MemList = struct nixl_mem_list_opaque*;
using StringList = struct nixl_string_list_opaque*;
using Backend = struct nixl_backend_opaque*;
using OptArgs = struct nixl_opt_args_opaque*;
using ParamIter = struct nixl_param_iter_opaque*;
using XferDlist = struct nixl_xfer_dlist_opaque*;
using RegDlist = struct nixl_reg_dlist_opaque*;
using XferReq = struct nixl_xfer_req_opaque*;
using NotifMap = struct nixl_notif_map_opaque*;

// The functions kvferry resolves, by their C names without the nixl_capi_ prefix, with their
// types (X-macro: name and type in one place).
#define KVFERRY_NIXL_FUNCTIONS(X)                                                           \
  X(create_configured_agent, int(const char*, const CapiAgentConfig*, Agent*))              \
  X(destroy_agent, int(Agent))                                                              \
  X(get_local_md, int(Agent, void**, size_t*))                                              \
  X(get_local_partial_md, int(Agent, RegDlist, void**, size_t*, OptArgs))                   \
  X(load_remote_md, int(Agent, const void*, size_t, char**))                                \
  X(invalidate_remote_md, int(Agent, const char*))                                          \
  X(get_available_plugins, int(Agent, StringList*))                                         \
  X(destroy_string_list, int(StringList))                                                   \
  X(string_list_size, int(StringList, size_t*))                                             \
  X(string_list_get, int(StringList, size_t, const char**))                                 \
  X(create_backend, int(Agent, const char*, Params, Backend*))                              \
  X(destroy_backend, int(Backend))                                                          \
  X(create_params, int(Params*))                                                            \
  X(params_add, int(Params, const char*, const char*))                                      \
  X(destroy_params, int(Params))                                                            \
  X(create_opt_args, int(OptArgs*))                                                         \
  X(destroy_opt_args, int(OptArgs))                                                         \
  X(opt_args_add_backend, int(OptArgs, Backend))                                            \
  X(create_reg_dlist, int(int, RegDlist*))                                                  \
  X(destroy_reg_dlist, int(RegDlist))                                                       \
  X(reg_dlist_add_desc, int(RegDlist, uintptr_t, size_t, uint64_t, const void*, size_t))    \
  X(register_mem, int(Agent, RegDlist, OptArgs))                                            \
  X(deregister_mem, int(Agent, RegDlist, OptArgs))                                          \
  X(create_xfer_dlist, int(int, XferDlist*))                                                \
  X(destroy_xfer_dlist, int(XferDlist))                                                     \
  X(xfer_dlist_add_desc, int(XferDlist, uintptr_t, size_t, uint64_t))                       \
  X(create_xfer_req, int(Agent, int, XferDlist, XferDlist, const char*, XferReq*, OptArgs)) \
  X(post_xfer_req, int(Agent, XferReq, OptArgs))                                            \
  X(get_xfer_status, int(Agent, XferReq))                                                   \
  X(release_xfer_req, int(Agent, XferReq))                                                  \
  X(destroy_xfer_req, int(XferReq))                                                         \
  X(gen_notif, int(Agent, const char*, const void*, size_t, OptArgs))                       \
  X(create_notif_map, int(NotifMap*))                                                       \
  X(destroy_notif_map, int(NotifMap))                                                       \
  X(get_notifs, int(Agent, NotifMap, OptArgs))                                              \
  X(notif_map_size, int(NotifMap, size_t*))                                                 \
  X(notif_map_get_agent_at, int(NotifMap, size_t, const char**))                            \
  X(notif_map_get_notifs_size, int(NotifMap, const char*, size_t*))                         \
  X(notif_map_get_notif, int(NotifMap, const char*, size_t, const void**, size_t*))         \
  X(notif_map_clear, int(NotifMap))

struct NixlApi {
#define KVFERRY_NIXL_MEMBER(name, ...) std::add_pointer_t<__VA_ARGS__> name = nullptr;
  KVFERRY_NIXL_FUNCTIONS(KVFERRY_NIXL_MEMBER)
#undef KVFERRY_NIXL_MEMBER
  std::string library_path;  // the libnixl_capi.so loaded
  std::string version;       // "1.5.1" (from the wheel's dist-info), or "" when unknown
};

// The C API of the process (loaded at the first call), or why it can't be used: kUnavailable
// naming the places tried, the version found, or the symbol missing.
StatusOr<const NixlApi*> LoadNixl();

// Where memory at `p` lies for NIXL: with `gpu`, VRAM of the CUDA device that holds it (the
// ordinal asked of the CUDA driver, libcuda.so.1, loaded at the first call; kvferry's transports
// link no CUDA): kUnavailable without a driver, kInvalidArgument for memory that is not a GPU's.
// Without `gpu`, DRAM.
StatusOr<MemPlace> PlaceOf(const void* p, bool gpu);
// Whether the CUDA driver loads (GPU memory can be named at all).
bool CudaDriverPresent();

// A NIXL status as a Status (`what`: the call, for the message). kCapiSuccess and kCapiInProg
// are OK.
Status FromCapi(int st, const std::string& what);

}  // namespace kvferry::nixl_detail
