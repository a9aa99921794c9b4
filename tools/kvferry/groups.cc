// Subcommand groups: `bench` and `demo` hold one subcommand per measurement or demo.
#include "tools/kvferry/commands.h"

namespace kvferry::tools {

void AddBenchCommands(CLI::App& app) {
  auto* bench = app.add_subcommand("bench", "measurements, each beside its same-run baseline");
  bench->require_subcommand(1);
  AddBenchOffloadCommand(*bench);
  AddBenchTieringCommand(*bench);
  AddBenchTransferCommand(*bench);
}

void AddDemoCommands(CLI::App& app) {
  auto* demo = app.add_subcommand("demo", "short narrated runs of the library");
  demo->require_subcommand(1);
  AddDemoTieringCommand(*demo);
}

}  // namespace kvferry::tools
