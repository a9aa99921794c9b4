// MetricsServer: one thread polls the listening socket (100 ms ticks, so the destructor is prompt);
// each connection is read up to the end of its request head (at most 8 KiB within 2 s), answered
// and closed.
#include <fmt/format.h>
#include <poll.h>
#include <sys/socket.h>

#include <atomic>
#include <string_view>
#include <thread>

#include "kvferry/prometheus.h"
#include "rendezvous/socket.h"

namespace kvferry {
namespace {

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
    while (!stop_) {
      pollfd p{fd_.get(), POLLIN, 0};
      if (poll(&p, 1, 100) <= 0) continue;
      rendezvous::Fd conn(accept4(fd_.get(), nullptr, nullptr, SOCK_CLOEXEC));
      if (conn.get() >= 0) Serve(conn.get());
    }
  }

  void Serve(int fd) {
    const Deadline deadline = Clock::now() + std::chrono::seconds(2);
    std::string head;
    char buf[1024];
    while (head.find("\r\n\r\n") == std::string::npos && head.size() < 8192) {
      pollfd p{fd, POLLIN, 0};
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left <= 0 || poll(&p, 1, static_cast<int>(left)) <= 0) return;
      const ssize_t n = recv(fd, buf, sizeof buf, 0);
      if (n <= 0) return;
      head.append(buf, static_cast<size_t>(n));
    }
    std::string_view line(head);
    line = line.substr(0, line.find("\r\n"));
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
    const std::string out = fmt::format(
        "HTTP/1.1 {}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
        "Content-Length: {}\r\nConnection: close\r\n\r\n{}",
        status, body.size(), body);
    (void)rendezvous::WriteAll(fd, std::as_bytes(std::span(out.data(), out.size())), deadline);
  }

  rendezvous::Fd fd_;
  const uint16_t port_;
  const std::function<std::string()> render_;
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> scrapes_{0};
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
