// `kvferry info`: build features, devices present, every config knob.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdio>
#include <nlohmann/json.hpp>

#include "kvferry/build_info.h"
#include "kvferry/config.h"
#include "kvferry/device.h"
#include "kvferry/nixl_info.h"
#include "kvferry/ucx_info.h"
#include "tools/kvferry/commands.h"
#include "tools/kvferry/output.h"

namespace kvferry::tools {
namespace {

std::string_view TypeName(KnobType t) {
  switch (t) {
    case KnobType::kBool:
      return "bool";
    case KnobType::kInt:
      return "int";
    case KnobType::kString:
      return "string";
  }
  return "?";
}

std::string_view SourceName(KnobSource s) {
  switch (s) {
    case KnobSource::kDefault:
      return "default";
    case KnobSource::kEnvironment:
      return "environment";
    case KnobSource::kSet:
      return "--set";
  }
  return "?";
}

struct DeviceRow {
  std::string name;
  DeviceInfo info;
  std::string error;
};

std::vector<DeviceRow> Devices() {
  std::vector<DeviceRow> rows;
  for (const std::string& n : ListDevices()) {
    auto d = OpenDevice(n);
    if (d.ok())
      rows.push_back({n, (*d)->info(), ""});
    else
      rows.push_back({n, {}, d.status().ToString()});
  }
  return rows;
}

int RunInfo(const OutputFlags& out) {
  auto features = BuildFeatures();
  auto devices = Devices();
  auto knobs = Config::Global().List();
  auto ucx = QueryUcxRuntime();
  auto nixl = QueryNixlRuntime();
  if (out.machine()) {
    nlohmann::json j;
    j["version"] = Version();
    for (const Feature& f : features) {
      j["features"][f.name] = {{"present", f.present}, {"version", f.version}, {"note", f.note}};
    }
    for (const DeviceRow& d : devices) {
      j["devices"].push_back({{"name", d.name},
                              {"model", d.info.name},
                              {"memory_bytes", d.info.memory_bytes},
                              {"detail", d.info.detail},
                              {"error", d.error}});
    }
    if (ucx.ok()) {
      j["ucx"] = {{"version", ucx->version},
                  {"library", ucx->library_path},
                  {"module_dir", ucx->module_dir},
                  {"memory_types", ucx->memory_types},
                  {"transports", nlohmann::json::array()}};
      for (const auto& t : ucx->transports) {
        j["ucx"]["transports"].push_back(
            {{"transport", t.transport}, {"device", t.device}, {"kind", t.kind}});
      }
    } else {
      j["ucx"] = {{"error", ucx.status().ToString()}};
    }
    if (nixl.ok()) {
      j["nixl"] = {{"available", nixl->backend_status.ok()},
                   {"version", nixl->version},
                   {"library", nixl->library_path},
                   {"plugins", nixl->plugins},
                   {"backend", nixl->backend},
                   {"error", nixl->backend_status.ok() ? "" : nixl->backend_status.ToString()}};
    } else {
      j["nixl"] = {{"available", false}, {"error", nixl.status().ToString()}};
    }
    Document doc("info");
    for (const KnobView& k : knobs) {
      doc.AddRow({{"name", k.name},
                  {"type", TypeName(k.type)},
                  {"default", k.default_value},
                  {"value", k.value},
                  {"source", SourceName(k.source)},
                  {"doc", k.doc},
                  {"constraint", k.constraint},
                  {"env", k.env_var}});
    }
    j.erase("version");  // in "versions"
    doc.summary() = j;
    doc.config() = {{"knobs_from", "defaults, environment and --set (rows)"}};
    doc.Print(out.format());
    return 0;
  }
  fmt::print("kvferry {}\n\nBuild features:\n", Version());
  for (const Feature& f : features) {
    fmt::print("  {:<9} {:<4} {:<10} {}\n", f.name, f.present ? "yes" : "no", f.version, f.note);
  }
  fmt::print("\nDevices:\n");
  for (const DeviceRow& d : devices) {
    if (d.error.empty()) {
      fmt::print("  {:<8} {} {}{}\n", d.name, d.info.name,
                 d.info.memory_bytes
                     ? fmt::format("{:.1f} GiB ", d.info.memory_bytes / double(1 << 30))
                     : "",
                 d.info.detail);
    } else {
      fmt::print("  {:<8} unusable: {}\n", d.name, d.error);
    }
  }
  fmt::print("\nUCX at run time:\n");
  if (ucx.ok()) {
    fmt::print("  version     {}\n  library     {}\n  modules     {}\n  memory      {}\n",
               ucx->version, ucx->library_path, ucx->module_dir,
               fmt::join(ucx->memory_types, ", "));
    for (const auto& t : ucx->transports) {
      fmt::print("  transport   {:<10} device {:<12} {}\n", t.transport, t.device, t.kind);
    }
  } else {
    fmt::print("  unavailable: {}\n", ucx.status().ToString());
  }
  fmt::print("\nNIXL at run time (--transport nixl):\n");
  if (nixl.ok()) {
    fmt::print(
        "  version     {}\n  library     {}\n  plugins     {}\n  backend     {} {}\n",
        nixl->version, nixl->library_path, fmt::join(nixl->plugins, ", "), nixl->backend,
        nixl->backend_status.ok() ? "starts" : "unusable: " + nixl->backend_status.ToString());
  } else {
    fmt::print("  unavailable: {}\n", nixl.status().ToString());
  }
  fmt::print("\nConfig knobs (override with --set NAME=VALUE or the environment variable):\n");
  for (const KnobView& k : knobs) {
    fmt::print("  {} = {}  [{}{}{}, default {}, {}]\n      {}\n      env {}\n", k.name, k.value,
               TypeName(k.type), k.constraint.empty() ? "" : " ", k.constraint, k.default_value,
               SourceName(k.source), k.doc, k.env_var);
  }
  for (const std::string& e : Config::Global().EnvironmentErrors()) fmt::print("warning: {}\n", e);
  return 0;
}

}  // namespace

void AddInfoCommand(CLI::App& app) {
  auto* cmd = app.add_subcommand("info", "build features, devices and every config knob");
  auto out = std::make_shared<OutputFlags>();
  AddOutputFlags(cmd, *out);
  cmd->callback([out] { std::exit(RunInfo(*out)); });
}

}  // namespace kvferry::tools
