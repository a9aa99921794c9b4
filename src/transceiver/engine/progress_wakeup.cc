#include "transceiver/engine/progress_wakeup.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>

namespace kvferry {

std::unique_ptr<ProgressWakeup> ProgressWakeup::Create(Transport& transport) {
  if (transport.WakeupFd() < 0) return nullptr;
  const int fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (fd < 0) return nullptr;
  return std::unique_ptr<ProgressWakeup>(new ProgressWakeup(transport, fd));
}

ProgressWakeup::~ProgressWakeup() { close(event_fd_); }

void ProgressWakeup::Notify() {
  if (!sleeping_.load()) return;  // the loop looks at its commands before it sleeps
  const uint64_t one = 1;
  (void)!write(event_fd_, &one, sizeof one);  // fails only when the count is full: still readable
}

bool ProgressWakeup::Sleep(std::chrono::microseconds timeout, bool hear_peers,
                           const std::function<bool()>& has_work) {
  sleeping_.store(true);
  bool slept = false;
  if (!has_work() && (!hear_peers || transport_.ArmWakeup())) {
    pollfd fds[2] = {{event_fd_, POLLIN, 0}, {transport_.WakeupFd(), POLLIN, 0}};
    const auto s = std::chrono::duration_cast<std::chrono::seconds>(timeout);
    const timespec ts{
        static_cast<time_t>(s.count()),
        static_cast<long>(
            std::chrono::duration_cast<std::chrono::nanoseconds>(timeout - s).count())};
    int n;
    do {
      n = ppoll(fds, hear_peers ? 2 : 1, &ts, nullptr);
    } while (n < 0 && errno == EINTR);
    slept = true;
  }
  sleeping_.store(false);
  uint64_t count = 0;
  (void)!read(event_fd_, &count, sizeof count);  // a Notify that came needs no second wake-up
  return slept;
}

}  // namespace kvferry
