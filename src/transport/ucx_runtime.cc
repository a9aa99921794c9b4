#include <dlfcn.h>
#include <link.h>
#include <signal.h>
#include <sys/stat.h>
#include <ucp/api/ucp.h>
#include <ucs/config/global_opts.h>
#include <ucs/debug/debug.h>
#include <uct/api/uct.h>

#include <mutex>
#include <string>

#include "base/log.h"
#include "kvferry/ucx_info.h"
#include "transport/ucx_util.h"

namespace kvferry {
namespace ucx_detail {
namespace {

bool IsDir(const std::string& p) {
  struct stat st {};
  return !p.empty() && stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

// The file libucp was loaded from. (dladdr on &ucp_init would name the executable that holds
// its PLT entry.)
std::string LoadedFrom() {
  void* h = dlopen("libucp.so.0", RTLD_LAZY | RTLD_NOLOAD);
  if (h == nullptr) return "";
  link_map* map = nullptr;
  std::string path;
  if (dlinfo(h, RTLD_DI_LINKMAP, &map) == 0 && map != nullptr && map->l_name != nullptr) {
    path = map->l_name;
  }
  dlclose(h);
  return path;
}

}  // namespace

std::string ConfiguredModuleDir() {
  char buf[4096] = {};
  if (ucs_global_opts_get_value("MODULE_DIR", buf, sizeof(buf)) != UCS_OK) return "";
  return buf;
}

void KeepSighup() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (ucs_global_opts.debug_signo == SIGHUP) ucs_debug_disable_signal(SIGHUP);
  });
}

// UCX loads its modules from two directories: "ucx" beside libucs (found through dladdr, so a
// relocated UCX such as the PyPI wheel finds its own) and MODULE_DIR (UCX_MODULE_DIR or the
// build-time default). The one that exists is the one to report. MODULE_DIR must not be changed
// at run time: UCX's module loader keeps a pointer to the string from libucs's load on, and
// ucs_global_opts_set_value frees it (kvferry pointed it at the wheel's directory before its
// first ucp_init; ASan found the loader's opendir reading the freed path in uct_query_components).
std::string ModuleDir() {
  const std::string lib = LoadedFrom();
  const size_t slash = lib.rfind('/');
  if (slash != std::string::npos) {
    const std::string beside = lib.substr(0, slash) + "/ucx";
    if (IsDir(beside)) return beside;
  }
  return ConfiguredModuleDir();
}

}  // namespace ucx_detail

namespace {

const char* DeviceKind(uct_device_type_t t) {
  switch (t) {
    case UCT_DEVICE_TYPE_NET:
      return "network";
    case UCT_DEVICE_TYPE_SHM:
      return "shared-memory";
    case UCT_DEVICE_TYPE_ACC:
      return "accelerator";
    case UCT_DEVICE_TYPE_SELF:
      return "self";
    default:
      return "other";
  }
}

void AddMdTransports(uct_component_h comp, const char* md_name,
                     std::vector<UcxTransportResource>& out) {
  uct_md_config_t* cfg = nullptr;
  if (uct_md_config_read(comp, nullptr, nullptr, &cfg) != UCS_OK) return;
  uct_md_h md = nullptr;
  const ucs_status_t st = uct_md_open(comp, md_name, cfg, &md);
  uct_config_release(cfg);
  if (st != UCS_OK) return;
  uct_tl_resource_desc_t* res = nullptr;
  unsigned n = 0;
  if (uct_md_query_tl_resources(md, &res, &n) == UCS_OK) {
    for (unsigned i = 0; i < n; ++i) {
      out.push_back({res[i].tl_name, res[i].dev_name, DeviceKind(res[i].dev_type)});
    }
    uct_release_tl_resource_list(res);
  }
  uct_md_close(md);
}

}  // namespace

StatusOr<UcxRuntimeInfo> QueryUcxRuntime() {
  UcxRuntimeInfo info;
  info.version = ucp_get_version_string();
  info.library_path = ucx_detail::LoadedFrom();
  info.module_dir = ucx_detail::ModuleDir();

  uct_component_h* comps = nullptr;
  unsigned ncomps = 0;
  ucs_status_t st = uct_query_components(&comps, &ncomps);
  if (st != UCS_OK) return ucx_detail::FromUcs(st, "uct_query_components");
  for (unsigned c = 0; c < ncomps; ++c) {
    uct_component_attr_t ca{};
    ca.field_mask = UCT_COMPONENT_ATTR_FIELD_MD_RESOURCE_COUNT;
    if (uct_component_query(comps[c], &ca) != UCS_OK) continue;
    std::vector<uct_md_resource_desc_t> mds(ca.md_resource_count);
    ca.field_mask = UCT_COMPONENT_ATTR_FIELD_MD_RESOURCES;
    ca.md_resources = mds.data();
    if (!mds.empty() && uct_component_query(comps[c], &ca) != UCS_OK) continue;
    for (const auto& md : mds) AddMdTransports(comps[c], md.md_name, info.transports);
  }
  uct_release_component_list(comps);

  ucx_detail::KeepSighup();
  ucp_config_t* raw = nullptr;
  st = ucp_config_read(nullptr, nullptr, &raw);
  if (st != UCS_OK) return ucx_detail::FromUcs(st, "ucp_config_read");
  ucx_detail::ConfigPtr config(raw);
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_TAG | UCP_FEATURE_RMA;
  ucp_context_h ctx = nullptr;
  st = ucp_init(&params, config.get(), &ctx);
  if (st != UCS_OK) return ucx_detail::FromUcs(st, "ucp_init");
  ucx_detail::ContextPtr context(ctx);
  ucp_context_attr_t attr{};
  attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  if (ucp_context_query(ctx, &attr) == UCS_OK) {
    for (int t = 0; t < UCS_MEMORY_TYPE_LAST; ++t) {
      if (attr.memory_types & UCS_BIT(t)) info.memory_types.push_back(ucs_memory_type_names[t]);
    }
  }
  return info;
}

}  // namespace kvferry
