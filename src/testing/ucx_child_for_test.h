// Test support for the UCX two-process tests (ucx_two_process_test, ucx_cuda_test): the child
// process, ucx_peer_helper (KVFERRY_UCX_PEER_HELPER, set by the build) run in one of its modes
// with this side's transport address, killed if it is still running when the Child goes; and
// control messages as text.
#pragma once

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "kvferry/status.h"

namespace kvferry::testing {

class Child {
 public:
  // `extra`, when not empty, is the helper's third argument (the bandwidth mode's MiB).
  Child(const std::string& mode, const std::string& address, const std::string& extra = "") {
    pid_ = fork();
    if (pid_ == 0) {
      if (extra.empty()) {
        execl(KVFERRY_UCX_PEER_HELPER, KVFERRY_UCX_PEER_HELPER, mode.c_str(), address.c_str(),
              nullptr);
      } else {
        execl(KVFERRY_UCX_PEER_HELPER, KVFERRY_UCX_PEER_HELPER, mode.c_str(), address.c_str(),
              extra.c_str(), nullptr);
      }
      _exit(127);
    }
  }
  ~Child() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;

  pid_t pid() const { return pid_; }
  // Exit status, or -1 if it did not exit by the deadline (then it is killed when the Child goes).
  int Wait(Deadline deadline) {
    while (pid_ > 0) {
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
      if (Clock::now() > deadline) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return -1;
  }

 private:
  pid_t pid_ = -1;
};

inline std::vector<std::byte> Bytes(std::string_view s) {
  const auto* p = reinterpret_cast<const std::byte*>(s.data());
  return {p, p + s.size()};
}

}  // namespace kvferry::testing
