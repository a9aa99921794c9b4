// The rank processes of one multi-process run (`selftest`, `bench transfer`), and the clean-up
// that must happen however the run ends.
//
// Why this exists: ranks are separate processes that share a rendezvous directory. Whether the
// run ends normally, with an error, by SIGINT/SIGTERM or by SIGKILL of this process, no rank and
// no file may stay behind, and nothing outside the run may ever be signalled:
// - Ranks run in one process group of their own (the first rank leads it). Only that group
//   (a pgid > 1) or one of our own rank pids (> 0) is ever passed to kill(); a failed fork is an
//   error, never a pid.
// - Each rank gets PR_SET_PDEATHSIG(SIGKILL) before exec and then checks that its parent is
//   still the process that forked it, so a parent that died in between still takes it along.
// - A janitor process outlives this one: it holds the read end of a pipe whose write end only
//   this process has. When the pipe reads end-of-file (this process exited, by any means), the
//   janitor kills the rank group unless it was told the group was reaped, and removes the
//   rendezvous directory (and any other directory of the run, e.g. MPI's shared-memory segments,
//   which a killed MPI job leaves in /dev/shm otherwise).
//
// Not thread-safe: one thread owns a RankGroup, and it must be the thread that outlives the
// ranks (PR_SET_PDEATHSIG fires when the forking thread ends).
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

  // Starts the janitor for `dirs` (which must exist; they are removed when the group ends,
  // whatever ends it).
  static StatusOr<std::unique_ptr<RankGroup>> Create(std::vector<std::filesystem::path> dirs,
                                                     ForkFn fork_fn = {});
  static StatusOr<std::unique_ptr<RankGroup>> Create(std::filesystem::path dir,
                                                     ForkFn fork_fn = {}) {
    return Create(std::vector<std::filesystem::path>{std::move(dir)}, std::move(fork_fn));
  }
  // Kills and reaps every rank still running, then has the janitor remove the directory and
  // waits for it.
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
    std::string How() const;       // "exit code 2"
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
  pid_t janitor_pid() const { return janitor_; }

 private:
  RankGroup(std::vector<std::filesystem::path> dirs, ForkFn fork_fn)
      : dirs_(std::move(dirs)), fork_(fork_fn) {}
  Status StartJanitor();
  void TellJanitor(char what, pid_t pgid);
  bool AnyRunning() const;
  void ReapAll();

  const std::vector<std::filesystem::path> dirs_;
  const ForkFn fork_;
  std::vector<Rank> ranks_;
  pid_t pgid_ = 0;
  pid_t janitor_ = 0;
  int janitor_fd_ = -1;  // write end of the janitor's pipe
};

}  // namespace kvferry::tools
