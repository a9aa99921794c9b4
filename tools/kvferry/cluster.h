// Runs a selftest configuration the way a deployment would: one process per rank (UCX), one MPI
// job (MPI), or threads of this process (inproc). Used by `selftest` and `bench transfer`.
#pragma once

#include <string>
#include <vector>

#include "selftest/selftest.h"

namespace kvferry::tools {

// Returns every rank's result or why the run failed.
StatusOr<std::vector<RankResult>> RunCluster(const SelftestConfig& cfg, bool progress = false);

// One rank of one of the two instances.
struct RankId {
  bool context = false;
  int rank = 0;
};

// `kvferry instance`: starts `ranks` (of one instance, or of both; context ranks first) on this
// host and returns their results. They meet the other ranks, started by other commands on this
// or other hosts, through the rendezvous at cfg.rendezvous (group key cfg.rendezvous_key); every
// command of a run gives the same configuration. UCX only (MPI and inproc start all ranks from
// one command).
StatusOr<std::vector<RankResult>> RunInstance(const SelftestConfig& cfg,
                                              const std::vector<RankId>& ranks,
                                              bool progress = false);

// When this process was started as one rank of a cluster (hidden flags), runs it and returns the
// exit code; otherwise -1.
int MaybeRunRank(int argc, char** argv);

}  // namespace kvferry::tools
