// MetricsServer: one thread polls the listening socket and every open connection, never blocking
// on one: each connection is read up to the end of its request head (at most 8 KiB), answered
// when poll says it can take the reply, and closed. A connection is closed 2 s after it opened
// whatever it did, at most kMaxConnections are open (the oldest closed to let a new one in), so
// silent or slow peers neither delay a scrape nor hold memory: at most 64 × (8 KiB + one reply).
#include <fmt/format.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <string_view>
#include <thread>
#include <vector>

#include "kvferry/prometheus.h"
#include "rendezvous/socket.h"

namespace kvferry {
namespace {

constexpr auto kConnectionTimeout = std::chrono::seconds(2);
constexpr size_t kMaxConnections = 64;
constexpr size_t kMaxHeadBytes = 8192;

struct Conn {
  rendezvous::Fd fd;
  Clock::time_point opened;
  std::string head;  // the request head read so far
  std::string out;   // the reply, from `sent`; empty while reading
  size_t sent = 0;
  bool dead = false;
};

class MetricsServerImpl final : public MetricsServer {
 public:
  MetricsServerImpl(rendezvous::Fd fd, uint16_t port, std::function<std::string()> render)
      : fd_(std::move(fd)), port_(port), render_(std::move(render)) {
    thread_ = std::thread([this] { Run(); });
  }
  ~MetricsServerImpl() override {
    stop_ = true;
    thread_.join();
  }
  uint16_t port() const override { return port_; }
  int64_t scrapes() const override { return scrapes_.load(); }

 private:
  void Run() {
    std::vector<pollfd> fds;
    while (!stop_) {
      fds.clear();
      fds.push_back({fd_.get(), POLLIN, 0});
      for (const auto& c : conns_) {
        fds.push_back({c->fd.get(), static_cast<short>(c->out.empty() ? POLLIN : POLLOUT), 0});
      }
      if (poll(fds.data(), fds.size(), 100) < 0) continue;  // 100 ms: a prompt destructor
      const auto now = Clock::now();
      for (size_t i = 0; i < conns_.size(); ++i) {
        Conn& c = *conns_[i];
        const short revents = fds[1 + i].revents;
        if (revents & (POLLIN | POLLHUP | POLLERR)) Read(c);
        if (!c.dead && !c.out.empty() && (revents & POLLOUT)) Write(c);
        if (now - c.opened > kConnectionTimeout) c.dead = true;
      }
      std::erase_if(conns_, [](const auto& c) { return c->dead; });
      if (fds[0].revents & POLLIN) Accept();
    }
  }

  void Accept() {
    for (int i = 0; i < 16; ++i) {
      rendezvous::Fd fd(accept4(fd_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
      if (fd.get() < 0) return;
      if (conns_.size() >= kMaxConnections) {
        auto oldest = std::min_element(conns_.begin(), conns_.end(),
                                       [](auto& a, auto& b) { return a->opened < b->opened; });
        conns_.erase(oldest);
      }
      auto c = std::make_unique<Conn>();
      c->fd = std::move(fd);
      c->opened = Clock::now();
      conns_.push_back(std::move(c));
    }
  }

  void Read(Conn& c) {
    char buf[1024];
    const ssize_t n = recv(c.fd.get(), buf, std::min(sizeof buf, kMaxHeadBytes - c.head.size()), 0);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
    if (n <= 0) {
      c.dead = true;
      return;
    }
    c.head.append(buf, static_cast<size_t>(n));
    if (c.head.find("\r\n\r\n") == std::string::npos && c.head.size() < kMaxHeadBytes) return;
    c.out = Answer(c.head);
    Write(c);
  }

  std::string Answer(std::string_view head) {
    std::string_view line = head.substr(0, head.find("\r\n"));
    std::string status = "200 OK", body;
    const bool get = line.starts_with("GET ");
    const std::string_view path = get ? line.substr(4, line.find(' ', 4) - 4) : "";
    const std::string_view bare = path.substr(0, path.find('?'));
    if (!get) {
      status = "405 Method Not Allowed";
      body = "GET only\n";
    } else if (bare != "/metrics" && bare != "/") {
      status = "404 Not Found";
      body = "try /metrics\n";
    } else {
      body = render_();
      ++scrapes_;
    }
    return fmt::format(
        "HTTP/1.1 {}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
        "Content-Length: {}\r\nConnection: close\r\n\r\n{}",
        status, body.size(), body);
  }

  // Sends what the kernel takes now; closes once all is sent.
  void Write(Conn& c) {
    while (c.sent < c.out.size()) {
      const ssize_t n = send(c.fd.get(), c.out.data() + c.sent, c.out.size() - c.sent,
                             MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
      if (n <= 0) break;
      c.sent += static_cast<size_t>(n);
    }
    c.dead = true;
  }

  const rendezvous::Fd fd_;
  const uint16_t port_;
  const std::function<std::string()> render_;
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> scrapes_{0};
  std::vector<std::unique_ptr<Conn>> conns_;  // the server thread's own
  std::thread thread_;
};

}  // namespace

StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(const std::string& host,
                                                              uint16_t port,
                                                              std::function<std::string()> render) {
  auto l = rendezvous::ListenTcp(host, port);
  if (!l.ok()) return l.status().WithContext(fmt::format("metrics endpoint on {}:{}", host, port));
  const std::string& addr = l->address;
  const auto bound = static_cast<uint16_t>(std::stoi(addr.substr(addr.rfind(':') + 1)));
  return std::unique_ptr<MetricsServer>(
      new MetricsServerImpl(std::move(l->fd), bound, std::move(render)));
}

}  // namespace kvferry
