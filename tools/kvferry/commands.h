// Subcommands of the kvferry tool. Each Add*Command registers itself on the app; the tools are
// thin: everything they do is a library call.
#pragma once

#include <CLI/CLI.hpp>

namespace kvferry::tools {

void AddInfoCommand(CLI::App& app);
void AddSelftestCommand(CLI::App& app);
// Adds `transfer` under the `bench` group.
void AddBenchTransferCommand(CLI::App& bench);

}  // namespace kvferry::tools
