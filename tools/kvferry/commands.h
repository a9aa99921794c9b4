// Subcommands of the kvferry tool. Each Add*Command registers itself on the app; the tools are
// thin: everything they do is a library call.
#pragma once

#include <CLI/CLI.hpp>

namespace kvferry::tools {

void AddInfoCommand(CLI::App& app);
void AddSelftestCommand(CLI::App& app);
// Adds `transfer` under the `bench` group.
void AddBenchTransferCommand(CLI::App& bench);
// `bench`: a group of measurements; each Add*Command registers one under it.
void AddBenchCommands(CLI::App& app);
void AddBenchOffloadCommand(CLI::App& bench);
void AddBenchTieringCommand(CLI::App& bench);
// `demo`: short narrated runs of the library, for scripts/demo.
void AddDemoCommands(CLI::App& app);
void AddDemoTieringCommand(CLI::App& demo);
void AddSoakCommand(CLI::App& app);
// Instances as separate commands: `instance` (this host's ranks of one instance) and `rendezvous`
// (the server they meet at).
void AddInstanceCommand(CLI::App& app);
void AddRendezvousCommand(CLI::App& app);

}  // namespace kvferry::tools
