#include "tools/kvferry/rank_processes.h"

#include <dirent.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

namespace kvferry::tools {
namespace {

// One message to the janitor: 'G' (the rank group is `pgid`) or 'R' (the group was reaped).
struct JanitorMessage {
  char kind;
  char pad[3];
  int32_t pgid;
};

void SleepMs(long ms) {
  timespec ts{ms / 1000, (ms % 1000) * 1000000};
  while (nanosleep(&ts, &ts) == -1 && errno == EINTR) {
  }
}

// Removes `dirfd`'s entries, `depth` levels of subdirectories deep. Async-signal-safe (it runs
// in the janitor, a child forked without exec): no allocation, raw system calls only.
void RemoveEntries(int dirfd, int depth) {
  alignas(8) char buf[4096];
  for (int pass = 0; pass < 64; ++pass) {
    if (lseek(dirfd, 0, SEEK_SET) < 0) return;
    bool removed_any = false;
    long n;
    while ((n = syscall(SYS_getdents64, dirfd, buf, sizeof buf)) > 0) {
      for (long off = 0; off < n;) {
        auto* d = reinterpret_cast<struct dirent64*>(buf + off);
        off += d->d_reclen;
        const char* name = d->d_name;
        if (name[0] == '.' && (name[1] == 0 || (name[1] == '.' && name[2] == 0))) continue;
        if (unlinkat(dirfd, name, 0) == 0) {
          removed_any = true;
          continue;
        }
        if ((errno == EISDIR || errno == EPERM) && depth > 0) {
          int sub = openat(dirfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
          if (sub >= 0) {
            RemoveEntries(sub, depth - 1);
            close(sub);
          }
          if (unlinkat(dirfd, name, AT_REMOVEDIR) == 0) removed_any = true;
        }
      }
    }
    if (!removed_any) return;
  }
}

// `dirs`: null-terminated.
[[noreturn]] void JanitorMain(int fd, const char* const* dirs) {
  struct sigaction ignore {};
  ignore.sa_handler = SIG_IGN;
  for (int s : {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGPIPE}) sigaction(s, &ignore, nullptr);
  // Hold nothing of the parent's but the socket: a pipe the parent's reader waits on must not
  // stay open because of us.
  if (fd != 3) {
    dup2(fd, 3);
    fd = 3;
  }
  syscall(SYS_close_range, 4u, ~0u, 0u);
  int devnull = open("/dev/null", O_RDWR);
  if (devnull >= 0) {
    for (int i = 0; i < 3; ++i) dup2(devnull, i);
    if (devnull > 3) close(devnull);
  }
  pid_t pgid = 0;
  bool reaped = false;
  JanitorMessage m;
  size_t have = 0;
  for (;;) {
    ssize_t n = read(fd, reinterpret_cast<char*>(&m) + have, sizeof m - have);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;  // end of file: the parent is gone or done
    have += static_cast<size_t>(n);
    if (have < sizeof m) continue;
    have = 0;
    if (m.kind == 'G' && m.pgid > 1) {
      pgid = m.pgid;
      reaped = false;
    } else if (m.kind == 'R') {
      reaped = true;
    }
  }
  if (pgid > 1 && !reaped) {
    kill(-pgid, SIGKILL);
    // Wait (bounded) for the group to be gone, so no rank writes into the directory after it is
    // removed. Members that are zombies of a non-reaping init keep it "alive": stop at 2 s.
    for (int i = 0; i < 200 && kill(-pgid, 0) == 0; ++i) SleepMs(10);
  }
  for (; *dirs != nullptr; ++dirs) {
    for (int attempt = 0; attempt < 2; ++attempt) {
      int d = open(*dirs, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
      if (d >= 0) {
        RemoveEntries(d, 8);  // OpenMPI's session directory nests deep
        close(d);
      }
      if (rmdir(*dirs) == 0 || errno == ENOENT) break;
      SleepMs(100);
    }
  }
  _exit(0);
}

std::string DescribeWait(int st) {
  if (WIFEXITED(st)) return fmt::format("exit code {}", WEXITSTATUS(st));
  if (WIFSIGNALED(st)) {
    const char* name = sigabbrev_np(WTERMSIG(st));
    return fmt::format("killed by signal {} (SIG{})", WTERMSIG(st), name ? name : "?");
  }
  return fmt::format("wait status {:#x}", st);
}

}  // namespace

std::string RankGroup::Rank::How() const {
  return !ended               ? "still running"
         : killed_at_deadline ? "killed at the run deadline"
                              : DescribeWait(wait_status);
}

std::string RankGroup::Rank::Describe() const {
  return fmt::format("{} (pid {}): {}", label, pid, How());
}

StatusOr<std::unique_ptr<RankGroup>> RankGroup::Create(std::vector<std::filesystem::path> dirs,
                                                       ForkFn fork_fn) {
  if (!fork_fn) fork_fn = [] { return fork(); };
  std::unique_ptr<RankGroup> g(new RankGroup(std::move(dirs), std::move(fork_fn)));
  KVF_RETURN_IF_ERROR(g->StartJanitor());
  return g;
}

Status RankGroup::StartJanitor() {
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0)
    return Status::Unavailable(fmt::format("janitor socketpair: {}", std::strerror(errno)));
  // The child reads these without allocating.
  std::vector<std::string> dir_names;
  for (const auto& d : dirs_) dir_names.push_back(d.string());
  std::vector<const char*> dirs;
  for (const auto& d : dir_names) dirs.push_back(d.c_str());
  dirs.push_back(nullptr);
  const std::string dir = dir_names.empty() ? std::string() : dir_names.front();
  pid_t pid = fork();
  if (pid < 0) {
    int e = errno;
    close(sv[0]);
    close(sv[1]);
    return Status::Unavailable(
        fmt::format("cannot start the clean-up process for {}: fork: {}", dir, std::strerror(e)));
  }
  if (pid == 0) {
    close(sv[1]);
    JanitorMain(sv[0], dirs.data());
  }
  close(sv[0]);
  janitor_ = pid;
  janitor_fd_ = sv[1];
  return Status::Ok();
}

void RankGroup::TellJanitor(char what, pid_t pgid) {
  if (janitor_fd_ < 0) return;
  JanitorMessage m{what, {}, static_cast<int32_t>(pgid)};
  // MSG_NOSIGNAL: a janitor that died must not take this process with it (SIGPIPE).
  ssize_t n = send(janitor_fd_, &m, sizeof m, MSG_NOSIGNAL);
  (void)n;
}

RankGroup::~RankGroup() {
  KillAll();
  TellJanitor('R', pgid_);
  if (janitor_fd_ >= 0) close(janitor_fd_);
  if (janitor_ > 0) {
    while (waitpid(janitor_, nullptr, 0) < 0 && errno == EINTR) {
    }
  }
}

Status RankGroup::Spawn(std::string label, const std::vector<std::string>& args) {
  if (args.empty()) return Status::InvalidArgument(fmt::format("{}: no command", label));
  // Everything the child needs is prepared before fork: after it, only async-signal-safe calls.
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  const pid_t parent = getpid();
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
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(126);  // the parent died before the line above
    // Ranks report through files; whatever they (or UCX's logger) print goes to stderr, so this
    // process's stdout (--json) stays machine-readable.
    if (dup2(STDERR_FILENO, STDOUT_FILENO) < 0) _exit(124);
    execvp(argv[0], argv.data());
    _exit(127);
  }
  // Also from this side, so the rank is in the group before anything can signal it (EACCES once
  // the child has exec'd means it did so itself).
  setpgid(pid, group == 0 ? pid : group);
  if (pgid_ == 0) {
    pgid_ = pid;
    TellJanitor('G', pgid_);
  }
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
