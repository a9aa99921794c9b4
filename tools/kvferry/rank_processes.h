// The rank processes of one multi-process run (`selftest`, `bench transfer`), and the clean-up
// that must happen however the run ends.
//
// Why this exists: ranks are separate processes that share a rendezvous directory. However the
// run ends, nothing outside the run may ever be signalled:
// - Ranks run in one process group of their own (the first rank leads it). Only that group
//   (a pgid > 1) or one of our own rank pids (> 0) is ever passed to kill(); a failed fork is an
//   error, never a pid.
//
// Not thread-safe: one thread owns a RankGroup.
#pragma once

#include <sys/types.h>

#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kvferry/device.h"
#include "kvferry/status.h"

namespace kvferry::tools {

class RankGroup {
 public:
  // fork() by default. Tests pass one that fails (returns -1 with errno set) on the Nth call.
  using ForkFn = std::function<pid_t()>;

  // `dir` (which must exist) is removed when the group ends.
  static StatusOr<std::unique_ptr<RankGroup>> Create(std::filesystem::path dir,
                                                     ForkFn fork_fn = {});
  // Kills and reaps every rank still running, then removes the directory.
  ~RankGroup();
  RankGroup(const RankGroup&) = delete;
  RankGroup& operator=(const RankGroup&) = delete;

  // Starts one rank (`label` names it in reports, e.g. "context rank 1"). When the process
  // cannot be started, kills and reaps the ranks already started and returns why.
  Status Spawn(std::string label, const std::vector<std::string>& args);

  // How a rank ended.
  struct Rank {
    std::string label;
    pid_t pid = 0;
    bool ended = false;
    int wait_status = 0;  // from waitpid, when ended
    bool killed_at_deadline = false;
    std::string Describe() const;  // "context rank 1 (pid 123): exit code 2"
  };

  // Waits until every rank ended or `deadline()` (asked again on every poll: it may move) has
  // passed; then kills the group and reaps it. Calls `tick` (when set) about every `tick_every`.
  // Returns DeadlineExceeded when the ranks had to be killed, else OK (exit codes are in ranks()).
  Status Wait(const std::function<Deadline()>& deadline, const std::function<void()>& tick = {},
              std::chrono::milliseconds tick_every = std::chrono::milliseconds(1000));

  // Kills the group (if any rank is still running) and reaps it.
  void KillAll();

  const std::vector<Rank>& ranks() const { return ranks_; }
  pid_t pgid() const { return pgid_; }

 private:
  RankGroup(std::filesystem::path dir, ForkFn fork_fn) : dir_(std::move(dir)), fork_(fork_fn) {}
  bool AnyRunning() const;
  void ReapAll();

  const std::filesystem::path dir_;
  const ForkFn fork_;
  std::vector<Rank> ranks_;
  pid_t pgid_ = 0;
};

}  // namespace kvferry::tools
