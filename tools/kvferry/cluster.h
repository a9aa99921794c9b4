// Runs a selftest configuration the way a deployment would: one process per rank (UCX), one MPI
// job (MPI), or threads of this process (inproc). Used by `selftest` and `bench transfer`.
#pragma once

#include <string>
#include <vector>

#include "selftest/selftest.h"

namespace kvferry::tools {

// Returns every rank's result or why the run failed.
StatusOr<std::vector<RankResult>> RunCluster(const SelftestConfig& cfg, bool progress = false);

// When this process was started as one rank of a cluster (hidden flags), runs it and returns the
// exit code; otherwise -1.
int MaybeRunRank(int argc, char** argv);

}  // namespace kvferry::tools
