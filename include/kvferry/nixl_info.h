// What the NIXL library the nixl transport would load offers on this machine (for `kvferry info`
// and logs): whether it is usable and why not, its version, the file, the backend plugins it
// finds, and whether the configured backend (knobs nixl.backend, nixl.backend_params) starts.
// NIXL is loaded at run time (never linked): no NIXL types here.
#pragma once

#include <string>
#include <vector>

#include "kvferry/status.h"

#pragma GCC visibility push(default)  // the public API (kvferry/export.h)
namespace kvferry {

struct NixlRuntimeInfo {
  std::string version;               // "1.5.1"
  std::string library_path;          // the libnixl_capi.so found
  std::vector<std::string> plugins;  // "UCX", "POSIX", "GDS", "LIBFABRIC", ...
  std::string backend;               // the configured backend (nixl.backend)
  Status backend_status;             // whether an agent could create it here
};

// kUnavailable (with why: not found, another version, a symbol missing, a sanitizer build) when
// the library can't be used at all; otherwise the info, with backend_status saying whether the
// configured backend starts.
StatusOr<NixlRuntimeInfo> QueryNixlRuntime();

}  // namespace kvferry
#pragma GCC visibility pop
