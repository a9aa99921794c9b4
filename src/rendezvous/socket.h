// TCP sockets with deadlines for the rendezvous: an fd owner, listen, connect, and whole reads
// and writes. errno becomes Status here, once.
#pragma once

#include <unistd.h>

#include <cstddef>
#include <span>
#include <string>
#include <string_view>

#include "kvferry/device.h"
#include "kvferry/status.h"

namespace kvferry::rendezvous {

// Move-only owner of a file descriptor.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      Reset();
      fd_ = o.fd_;
      o.fd_ = -1;
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { Reset(); }
  int get() const { return fd_; }
  void Reset() {
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

struct Listener {
  Fd fd;                // non-blocking, listening
  std::string address;  // "host:port" with the port actually bound
};
StatusOr<Listener> ListenTcp(std::string_view host, uint16_t port);

// A non-blocking connected socket; kUnavailable when nothing answers by the deadline.
StatusOr<Fd> ConnectTcp(const std::string& host, const std::string& port, Deadline deadline);

Status WriteAll(int fd, std::span<const std::byte> bytes, Deadline deadline);
// Fills `out` entirely; kUnavailable when the peer closes first, kDeadlineExceeded at the deadline.
Status ReadExactly(int fd, std::span<std::byte> out, Deadline deadline);

}  // namespace kvferry::rendezvous
