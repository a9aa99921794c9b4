// QueryNixlRuntime (kvferry/nixl_info.h): loads the C API, lists the plugins and tries the
// configured backend on a probe agent.
#include <fmt/format.h>
#include <unistd.h>

#include "kvferry/config.h"
#include "kvferry/nixl_info.h"
#include "transport/nixl_api.h"

namespace kvferry {

StatusOr<NixlRuntimeInfo> QueryNixlRuntime() {
  using namespace nixl_detail;
  KVF_ASSIGN_OR_RETURN(const NixlApi* api, LoadNixl());
  NixlRuntimeInfo info;
  info.version = api->version;
  info.library_path = api->library_path;
  info.backend = Config::Global().String("nixl.backend");
  CapiAgentConfig cfg{};
  cfg.thread_sync = kSyncNone;
  cfg.num_workers = 1;
  Agent agent = nullptr;
  const std::string name = fmt::format("kvferry-probe-{}", getpid());
  KVF_RETURN_IF_ERROR(FromCapi(api->create_configured_agent(name.c_str(), &cfg, &agent),
                               "nixl_capi_create_configured_agent"));
  StringList list = nullptr;
  if (api->get_available_plugins(agent, &list) == kCapiSuccess) {
    size_t n = 0;
    api->string_list_size(list, &n);
    for (size_t i = 0; i < n; ++i) {
      const char* s = nullptr;
      if (api->string_list_get(list, i, &s) == kCapiSuccess && s) info.plugins.push_back(s);
    }
    api->destroy_string_list(list);
  }
  Params params = nullptr;
  info.backend_status = FromCapi(api->create_params(&params), "nixl_capi_create_params");
  const std::string kvs = Config::Global().String("nixl.backend_params");
  for (size_t at = 0; info.backend_status.ok() && at < kvs.size();) {
    size_t end = kvs.find(',', at);
    if (end == std::string::npos) end = kvs.size();
    const std::string kv = kvs.substr(at, end - at);
    const size_t eq = kv.find('=');
    info.backend_status =
        eq == std::string::npos || eq == 0
            ? Status::InvalidArgument(fmt::format("nixl.backend_params: '{}' is not KEY=VALUE", kv))
            : FromCapi(api->params_add(params, kv.substr(0, eq).c_str(), kv.substr(eq + 1).c_str()),
                       "nixl_capi_params_add");
    at = end + 1;
  }
  if (info.backend_status.ok()) {
    Backend b = nullptr;
    if (api->create_backend(agent, info.backend.c_str(), params, &b) == kCapiSuccess) {
      api->destroy_backend(b);
    } else {
      info.backend_status = Status::Unavailable(
          fmt::format("backend '{}' did not start (NIXL logs why on stderr)", info.backend));
    }
  }
  if (params) api->destroy_params(params);
  api->destroy_agent(agent);
  return info;
}

}  // namespace kvferry
