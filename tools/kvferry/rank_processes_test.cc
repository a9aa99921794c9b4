#include "tools/kvferry/rank_processes.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <thread>

namespace kvferry::tools {
namespace {

namespace fs = std::filesystem;
using std::chrono::milliseconds;

// Running (not a zombie, not gone).
bool Alive(pid_t pid) {
  std::ifstream f(fmt::format("/proc/{}/stat", pid));
  std::string pid_s, comm, state;
  if (!(f >> pid_s >> comm >> state)) return false;
  return state != "Z";
}

// A process outside any run: nothing a run does may signal it.
struct Sentinel {
  pid_t pid = fork();
  Sentinel() {
    if (pid == 0) {
      execlp("sleep", "sleep", "60", nullptr);
      _exit(127);
    }
  }
  ~Sentinel() {
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
  }
  bool Running() const { return waitpid(pid, nullptr, WNOHANG) == 0 && Alive(pid); }
};

fs::path MakeDir() {
  fs::path d = fs::temp_directory_path() /
               fmt::format("kvferry-rank-test-{}-{}", getpid(), std::random_device{}());
  fs::create_directories(d);
  std::ofstream(d / "config.json") << "{}";
  return d;
}

const std::vector<std::string> kSleep{"sleep", "60"};

TEST(RankGroup, FailedForkIsAnErrorAndSignalsNothingOutsideTheRun) {
  Sentinel sentinel;
  fs::path dir = MakeDir();
  int calls = 0;
  // The third rank cannot be started, as when a container's process limit is reached.
  auto failing_fork = [&calls]() -> pid_t {
    if (++calls == 3) {
      errno = EAGAIN;
      return -1;
    }
    return fork();
  };
  auto group = RankGroup::Create(dir, failing_fork);
  ASSERT_TRUE(group.ok()) << group.status().ToString();
  RankGroup& g = **group;
  ASSERT_TRUE(g.Spawn("context rank 0", kSleep).ok());
  ASSERT_TRUE(g.Spawn("context rank 1", kSleep).ok());
  Status st = g.Spawn("generation rank 0", kSleep);
  EXPECT_EQ(st.code(), StatusCode::kUnavailable) << st.ToString();
  EXPECT_NE(st.message().find("generation rank 0"), std::string::npos) << st.ToString();
  EXPECT_NE(st.message().find("fork"), std::string::npos) << st.ToString();
  // The ranks already started were killed and reaped; no pid <= 0 was kept.
  ASSERT_EQ(g.ranks().size(), 2u);
  for (const auto& r : g.ranks()) {
    EXPECT_GT(r.pid, 0);
    EXPECT_TRUE(r.ended) << r.Describe();
    EXPECT_EQ(waitpid(r.pid, nullptr, WNOHANG), -1);
    EXPECT_EQ(errno, ECHILD);
  }
  // A run deadline that has passed signals nothing more.
  EXPECT_TRUE(g.Wait([] { return Clock::now() - milliseconds(1); }).ok());
  EXPECT_TRUE(sentinel.Running());
  group->reset();
  EXPECT_TRUE(sentinel.Running());
  EXPECT_FALSE(fs::exists(dir));
}

TEST(RankGroup, FirstForkFailingLeavesNoGroupToSignal) {
  Sentinel sentinel;
  fs::path dir = MakeDir();
  auto group = RankGroup::Create(dir, []() -> pid_t {
    errno = EAGAIN;
    return -1;
  });
  ASSERT_TRUE(group.ok());
  EXPECT_FALSE((*group)->Spawn("context rank 0", kSleep).ok());
  EXPECT_EQ((*group)->pgid(), 0);
  EXPECT_TRUE((*group)->ranks().empty());
  (*group)->KillAll();
  group->reset();
  EXPECT_TRUE(sentinel.Running());
  EXPECT_FALSE(fs::exists(dir));
}

TEST(RankGroup, RunDeadlineKillsTheGroupOnly) {
  Sentinel sentinel;
  fs::path dir = MakeDir();
  auto group = RankGroup::Create(dir);
  ASSERT_TRUE(group.ok());
  RankGroup& g = **group;
  ASSERT_TRUE(g.Spawn("context rank 0", kSleep).ok());
  ASSERT_TRUE(g.Spawn("generation rank 0", {"sh", "-c", "sleep 60 & sleep 60"}).ok());
  EXPECT_GT(g.pgid(), 1);
  const Deadline d = DeadlineIn(milliseconds(300));
  Status st = g.Wait([d] { return d; });
  EXPECT_EQ(st.code(), StatusCode::kDeadlineExceeded) << st.ToString();
  for (const auto& r : g.ranks()) {
    EXPECT_TRUE(r.ended);
    EXPECT_NE(r.Describe().find("killed at the run deadline"), std::string::npos) << r.Describe();
  }
  EXPECT_TRUE(sentinel.Running());
  // The grandchild (the shell's background sleep) was in the group too.
  group->reset();
  EXPECT_TRUE(sentinel.Running());
  EXPECT_FALSE(fs::exists(dir));
}

TEST(RankGroup, HowEachRankEndedIsNamed) {
  fs::path dir = MakeDir();
  auto group = RankGroup::Create(dir);
  ASSERT_TRUE(group.ok());
  RankGroup& g = **group;
  ASSERT_TRUE(g.Spawn("context rank 0", {"sh", "-c", "exit 3"}).ok());
  ASSERT_TRUE(g.Spawn("generation rank 0", {"sh", "-c", "kill -9 $$"}).ok());
  ASSERT_TRUE(g.Spawn("generation rank 1", {"/nonexistent/kvferry"}).ok());
  const Deadline d = DeadlineIn(milliseconds(10000));
  ASSERT_TRUE(g.Wait([d] { return d; }).ok());
  const auto& r = g.ranks();
  EXPECT_EQ(r[0].Describe(), fmt::format("context rank 0 (pid {}): exit code 3", r[0].pid));
  EXPECT_EQ(r[1].Describe(),
            fmt::format("generation rank 0 (pid {}): killed by signal 9 (SIGKILL)", r[1].pid));
  EXPECT_EQ(r[2].Describe(), fmt::format("generation rank 1 (pid {}): exit code 127", r[2].pid));
}

// pid -> "(comm)" of each child of this process that is not a zombie.
std::map<std::string, std::string> LiveChildren() {
  std::map<std::string, std::string> children;
  for (const auto& e : fs::directory_iterator("/proc")) {
    std::ifstream st(e.path() / "stat");
    std::string pid_s, comm, state, ppid;
    if (st >> pid_s >> comm >> state >> ppid && ppid == std::to_string(getpid()) && state != "Z")
      children.emplace(pid_s, comm);
  }
  return children;
}

// A parent that dies (SIGKILL: no handler runs; SIGTERM; SIGINT) takes its ranks and its
// rendezvous directory along, within a few seconds.
void ParentDiesAndLeavesNothing(int signal) {
  // Orphans come to this test (not to init), so it can tell "gone" from "a zombie of init".
  ASSERT_EQ(prctl(PR_SET_CHILD_SUBREAPER, 1), 0);
  Sentinel sentinel;
  // Children this process had before the run (the sentinel; under TSan the runtime's own
  // llvm-symbolizer, started when UCX's constructors matched a suppression) are not the run's.
  // Compared by pid alone: a child forked just before may not have exec'd yet (the sentinel's
  // `sleep` still named after this binary under load), so its name changes later.
  const std::map<std::string, std::string> before = LiveChildren();
  fs::path dir = MakeDir();
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  pid_t parent = fork();
  ASSERT_GE(parent, 0);
  if (parent == 0) {
    close(fds[0]);
    auto group = RankGroup::Create(dir);
    if (!group.ok()) _exit(1);
    for (const char* who : {"context rank 0", "generation rank 0"}) {
      if (!(*group)->Spawn(who, {"sh", "-c", "sleep 60 & sleep 60"}).ok()) _exit(1);
    }
    pid_t pids[3] = {(*group)->ranks()[0].pid, (*group)->ranks()[1].pid, (*group)->janitor_pid()};
    if (write(fds[1], pids, sizeof pids) != sizeof pids) _exit(1);
    for (;;) pause();
  }
  close(fds[1]);
  pid_t pids[3];
  ASSERT_EQ(read(fds[0], pids, sizeof pids), static_cast<ssize_t>(sizeof pids));
  close(fds[0]);
  std::this_thread::sleep_for(milliseconds(100));  // the shells start their background sleeps
  ASSERT_TRUE(Alive(pids[0]) && Alive(pids[1]));
  ASSERT_EQ(kill(parent, signal), 0);
  ASSERT_EQ(waitpid(parent, nullptr, 0), parent);
  // Everything of the run, grandchildren included, is reparented here; reap what ends.
  // The ranks' own children (the background sleeps) were in the group and go too; a killed
  // process may take a moment to exit on a loaded machine, so they are awaited like the ranks.
  const auto run_children = [&before] {
    std::string out;
    for (const auto& [pid, comm] : LiveChildren()) {
      if (!before.contains(pid)) out += pid + comm + " ";
    }
    return out;
  };
  const Deadline limit = DeadlineIn(milliseconds(5000));
  int left = 0;
  std::string out;
  do {
    std::this_thread::sleep_for(milliseconds(20));
    while (waitpid(-1, nullptr, WNOHANG) > 0) {
    }
    left = 0;
    for (pid_t p : pids) left += Alive(p) ? 1 : 0;
    out = run_children();
  } while ((left > 0 || fs::exists(dir) || !out.empty()) && Clock::now() < limit);
  EXPECT_EQ(left, 0) << "rank or janitor processes still running";
  EXPECT_FALSE(fs::exists(dir));
  EXPECT_EQ(out, "") << "processes of the run left";
  EXPECT_TRUE(sentinel.Running());
  ASSERT_EQ(prctl(PR_SET_CHILD_SUBREAPER, 0), 0);
}

TEST(RankGroup, KilledParentLeavesNoRankAndNoDirectory) { ParentDiesAndLeavesNothing(SIGKILL); }
TEST(RankGroup, TerminatedParentLeavesNoRankAndNoDirectory) { ParentDiesAndLeavesNothing(SIGTERM); }
TEST(RankGroup, InterruptedParentLeavesNoRankAndNoDirectory) { ParentDiesAndLeavesNothing(SIGINT); }

}  // namespace
}  // namespace kvferry::tools
