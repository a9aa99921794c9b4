#include "tools/kvferry/rank_processes.h"

#include <fmt/format.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

namespace kvferry::tools {
namespace {

std::string DescribeWait(int st) {
  if (WIFEXITED(st)) return fmt::format("exit code {}", WEXITSTATUS(st));
  if (WIFSIGNALED(st)) {
    const char* name = sigabbrev_np(WTERMSIG(st));
    return fmt::format("killed by signal {} (SIG{})", WTERMSIG(st), name ? name : "?");
  }
  return fmt::format("wait status {:#x}", st);
}

}  // namespace

std::string RankGroup::Rank::Describe() const {
  std::string how = !ended               ? "still running"
                    : killed_at_deadline ? "killed at the run deadline"
                                         : DescribeWait(wait_status);
  return fmt::format("{} (pid {}): {}", label, pid, how);
}

StatusOr<std::unique_ptr<RankGroup>> RankGroup::Create(std::filesystem::path dir, ForkFn fork_fn) {
  if (!fork_fn) fork_fn = [] { return fork(); };
  std::unique_ptr<RankGroup> g(new RankGroup(std::move(dir), std::move(fork_fn)));
  return g;
}

RankGroup::~RankGroup() {
  KillAll();
  std::error_code ec;
  std::filesystem::remove_all(dir_, ec);
}

Status RankGroup::Spawn(std::string label, const std::vector<std::string>& args) {
  if (args.empty()) return Status::InvalidArgument(fmt::format("{}: no command", label));
  // Everything the child needs is prepared before fork: after it, only async-signal-safe calls.
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  const pid_t group = pgid_;
  pid_t pid = fork_();
  if (pid < 0) {
    int e = errno;
    KillAll();
    return Status::Unavailable(
        fmt::format("cannot start {} ({}): fork: {}; the {} rank(s) "
                    "already started were killed",
                    label, args[0], std::strerror(e), ranks_.size()));
  }
  if (pid == 0) {
    if (setpgid(0, group) != 0) _exit(125);
    execvp(argv[0], argv.data());
    _exit(127);
  }
  // Also from this side, so the rank is in the group before anything can signal it (EACCES once
  // the child has exec'd means it did so itself).
  setpgid(pid, group == 0 ? pid : group);
  if (pgid_ == 0) pgid_ = pid;
  ranks_.push_back(Rank{std::move(label), pid});
  return Status::Ok();
}

bool RankGroup::AnyRunning() const {
  for (const Rank& r : ranks_) {
    if (!r.ended) return true;
  }
  return false;
}

void RankGroup::ReapAll() {
  for (Rank& r : ranks_) {
    if (r.ended) continue;
    int st = 0;
    pid_t p;
    while ((p = waitpid(r.pid, &st, 0)) < 0 && errno == EINTR) {
    }
    r.ended = true;
    r.wait_status = p == r.pid ? st : 0;
  }
}

void RankGroup::KillAll() {
  if (!AnyRunning()) return;
  // While one rank is unreaped the group id cannot have been reused: only our ranks get this.
  if (pgid_ > 1) kill(-pgid_, SIGKILL);
  for (Rank& r : ranks_) {
    if (!r.ended && r.pid > 0) {
      kill(r.pid, SIGKILL);
      r.killed_at_deadline = true;
    }
  }
  ReapAll();
}

Status RankGroup::Wait(const std::function<Deadline()>& deadline, const std::function<void()>& tick,
                       std::chrono::milliseconds tick_every) {
  auto next_tick = Clock::now() + tick_every;
  while (AnyRunning()) {
    if (tick && Clock::now() >= next_tick) {
      tick();
      next_tick += tick_every;
    }
    for (Rank& r : ranks_) {
      if (r.ended) continue;
      int st = 0;
      if (waitpid(r.pid, &st, WNOHANG) == r.pid) {
        r.ended = true;
        r.wait_status = st;
      }
    }
    if (!AnyRunning()) break;
    if (Clock::now() > deadline()) {
      KillAll();
      return Status::DeadlineExceeded("rank processes did not finish in time; killed");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return Status::Ok();
}

}  // namespace kvferry::tools
