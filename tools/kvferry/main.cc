// kvferry: check and measure a machine for KV-cache movement.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstdlib>

#include "kvferry/build_info.h"
#include "kvferry/config.h"
#include "tools/kvferry/cluster.h"
#include "tools/kvferry/commands.h"

int main(int argc, char** argv) {
  // A rank of a cluster started by `selftest` / `bench transfer` (hidden flags).
  if (int rc = kvferry::tools::MaybeRunRank(argc, argv); rc >= 0) return rc;
  // A bad KVFERRY_* value is an error, not a silently kept default.
  if (auto bad = kvferry::Config::Global().EnvironmentErrors(); !bad.empty()) {
    for (const std::string& e : bad) std::fprintf(stderr, "kvferry: %s\n", e.c_str());
    return 2;
  }
  CLI::App app{"kvferry: moves LLM KV caches between GPUs, hosts, files and instances"};
  app.set_version_flag("--version", std::string(kvferry::Version()));
  app.require_subcommand(1);
  std::vector<std::string> sets;
  app.add_option("--set", sets, "set a config knob, NAME=VALUE (see `kvferry info`)");
  app.parse_complete_callback([&] {
    for (const std::string& kv : sets) {
      auto eq = kv.find('=');
      kvferry::Status st =
          eq == std::string::npos
              ? kvferry::Status::InvalidArgument("--set expects NAME=VALUE, got '" + kv + "'")
              : kvferry::Config::Global().Set(kv.substr(0, eq), kv.substr(eq + 1));
      if (!st.ok()) throw CLI::ValidationError("--set", st.ToString());
      // Rank processes started by this one (selftest, bench transfer) inherit the setting.
      for (const kvferry::KnobView& k : kvferry::Config::Global().List()) {
        if (k.name == kv.substr(0, eq)) setenv(k.env_var.c_str(), k.value.c_str(), 1);
      }
    }
  });
  kvferry::tools::AddInfoCommand(app);
  kvferry::tools::AddSelftestCommand(app);
  kvferry::tools::AddBenchCommands(app);
  kvferry::tools::AddDemoCommands(app);
  kvferry::tools::AddSoakCommand(app);
  kvferry::tools::AddInstanceCommand(app);
  kvferry::tools::AddRendezvousCommand(app);
  CLI11_PARSE(app, argc, argv);
  return 0;
}
