// What the UCX library kvferry runs with offers on this machine (for `kvferry info` and logs):
// its version, the file it was loaded from, the module directory, the memory types it can move
// and the transports with their devices, as `ucx_info -d` would list them. No UCX types here.
#pragma once

#include <string>
#include <vector>

#include "kvferry/status.h"

#pragma GCC visibility push(default)  // the public API (kvferry/export.h)
namespace kvferry {

struct UcxTransportResource {
  std::string transport;  // "tcp", "posix", "sysv", "cma", "cuda_copy", "cuda_ipc", "self", ...
  std::string device;     // "lo", "eth0", "memory", "cuda", ...
  std::string kind;       // "network", "shared-memory", "accelerator", "self"
};

struct UcxRuntimeInfo {
  std::string version;                    // "1.22.0"
  std::string library_path;               // the libucp the process loaded
  std::string module_dir;                 // where UCX loads its transport modules from
  std::vector<std::string> memory_types;  // "host", "cuda", "cuda-managed", ...
  std::vector<UcxTransportResource> transports;
  bool cuda() const;  // memory_types has "cuda"
};

// kUnavailable when UCX is not compiled in or does not initialize.
StatusOr<UcxRuntimeInfo> QueryUcxRuntime();

// One line: "UCX 1.22.0 from PATH: tcp/lo tcp/eth0 posix/memory ...; memory host,cuda".
std::string DescribeUcxRuntime(const UcxRuntimeInfo& info);

}  // namespace kvferry
#pragma GCC visibility pop
