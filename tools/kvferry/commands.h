// Subcommands of the kvferry tool. Each Add*Command registers itself on the app; the tools are
// thin: everything they do is a library call.
#pragma once

#include <CLI/CLI.hpp>

namespace kvferry::tools {

void AddInfoCommand(CLI::App& app);

}  // namespace kvferry::tools
