#include "rendezvous/socket.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace kvferry::rendezvous {
namespace {

int MsUntil(Deadline deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return static_cast<int>(std::clamp<int64_t>(left.count(), 0, 1000));
}

// Waits for `events` on fd until the deadline: OK, or kDeadlineExceeded.
Status WaitFor(int fd, short events, Deadline deadline, std::string_view what) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int n = poll(&p, 1, MsUntil(deadline));
    if (n > 0) return Status::Ok();
    if (n < 0 && errno != EINTR) {
      return Status::Unavailable(
          fmt::format("rendezvous: poll while {}: {}", what, std::strerror(errno)));
    }
    if (Clock::now() >= deadline) {
      return Status::DeadlineExceeded(fmt::format("rendezvous: deadline passed while {}", what));
    }
  }
}

struct AddrInfo {
  addrinfo* list = nullptr;
  ~AddrInfo() {
    if (list) freeaddrinfo(list);
  }
};

Status Resolve(const std::string& host, const std::string& port, bool passive, AddrInfo& out) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  if (passive) hints.ai_flags = AI_PASSIVE;
  const int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &out.list);
  if (rc != 0) {
    return Status::InvalidArgument(
        fmt::format("rendezvous: can't resolve '{}': {}", host, gai_strerror(rc)));
  }
  return Status::Ok();
}

}  // namespace

StatusOr<Listener> ListenTcp(std::string_view host, uint16_t port) {
  AddrInfo ai;
  KVF_RETURN_IF_ERROR(Resolve(std::string(host), std::to_string(port), true, ai));
  std::string last_error = "no address";
  for (addrinfo* a = ai.list; a; a = a->ai_next) {
    Fd fd(socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol));
    if (fd.get() < 0) {
      last_error = std::strerror(errno);
      continue;
    }
    const int one = 1;
    setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd.get(), a->ai_addr, a->ai_addrlen) != 0 || listen(fd.get(), 128) != 0) {
      last_error = std::strerror(errno);
      continue;
    }
    sockaddr_storage bound{};
    socklen_t len = sizeof bound;
    getsockname(fd.get(), reinterpret_cast<sockaddr*>(&bound), &len);
    const uint16_t actual =
        ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                          : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
    const bool v6 = std::string_view(host).find(':') != std::string_view::npos;
    return Listener{std::move(fd),
                    v6 ? fmt::format("[{}]:{}", host, actual) : fmt::format("{}:{}", host, actual)};
  }
  return Status::Unavailable(
      fmt::format("rendezvous: can't listen on {}:{}: {}", host, port, last_error));
}

StatusOr<Fd> ConnectTcp(const std::string& host, const std::string& port, Deadline deadline) {
  AddrInfo ai;
  KVF_RETURN_IF_ERROR(Resolve(host, port, false, ai));
  std::string last_error = "no address";
  for (addrinfo* a = ai.list; a; a = a->ai_next) {
    Fd fd(socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol));
    if (fd.get() < 0) {
      last_error = std::strerror(errno);
      continue;
    }
    if (connect(fd.get(), a->ai_addr, a->ai_addrlen) != 0 && errno != EINPROGRESS) {
      last_error = std::strerror(errno);
      continue;
    }
    Status ready = WaitFor(fd.get(), POLLOUT, deadline, "connecting");
    if (!ready.ok()) {
      last_error = ready.message();
      continue;
    }
    int err = 0;
    socklen_t len = sizeof err;
    getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
    if (err != 0) {
      last_error = std::strerror(err);
      continue;
    }
    const int one = 1;
    setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    return fd;
  }
  return Status::Unavailable(
      fmt::format("rendezvous {}:{} unreachable: {}", host, port, last_error));
}

Status WriteAll(int fd, std::span<const std::byte> bytes, Deadline deadline) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = send(fd, bytes.data() + done, bytes.size() - done, MSG_NOSIGNAL);
    if (n > 0) {
      done += static_cast<size_t>(n);
    } else if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
      KVF_RETURN_IF_ERROR(WaitFor(fd, POLLOUT, deadline, "sending"));
    } else {
      return Status::Unavailable(fmt::format("rendezvous: send: {}", std::strerror(errno)));
    }
  }
  return Status::Ok();
}

Status ReadExactly(int fd, std::span<std::byte> out, Deadline deadline) {
  size_t done = 0;
  while (done < out.size()) {
    const ssize_t n = recv(fd, out.data() + done, out.size() - done, 0);
    if (n > 0) {
      done += static_cast<size_t>(n);
    } else if (n == 0) {
      return Status::Unavailable(
          fmt::format("rendezvous: the peer closed after {} of {} bytes", done, out.size()));
    } else if (errno == EAGAIN || errno == EINTR) {
      KVF_RETURN_IF_ERROR(WaitFor(fd, POLLIN, deadline, "receiving"));
    } else {
      return Status::Unavailable(fmt::format("rendezvous: recv: {}", std::strerror(errno)));
    }
  }
  return Status::Ok();
}

}  // namespace kvferry::rendezvous
