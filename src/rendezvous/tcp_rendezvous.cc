// The default rendezvous: a one-thread TCP server holding keys in memory, and a client that keeps
// its connections open between calls (a call is one request and its reply; a deployment makes a
// few per rank at start, then several per request: the handle's publication, each generation
// rank's fetch, its erasure).
//
// The server polls its listening socket, its connections and a wake pipe. A connection carries
// requests one after another: the server answers each whole frame (bounded) as it arrives. A
// connection silent for kConnectionTimeout since it opened or since its last answer is closed, a
// connection that sent a bad frame is answered REFUSED and closed, and at most kMaxConnections
// are open (an idle one is closed to let a new client in), so a stray or hostile client can't
// hold the server. A client whose kept connection was closed (the server's idle bound, or a
// server that closes after each answer) connects again and repeats the request: every request
// is idempotent.
#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include "base/log.h"
#include "rendezvous/frame.h"
#include "rendezvous/socket.h"

namespace kvferry {
namespace rendezvous {
namespace {

constexpr auto kConnectionTimeout = std::chrono::seconds(5);
constexpr size_t kMaxConnections = 256;
constexpr size_t kMaxStoreBytes = size_t{64} << 20;
constexpr size_t kMaxStoreKeys = 65536;

class Server final : public RendezvousServer {
 public:
  Server(Fd listener, Fd wake_read, Fd wake_write, std::string address, const RendezvousKey& key)
      : listener_(std::move(listener)),
        wake_read_(std::move(wake_read)),
        wake_write_(std::move(wake_write)),
        address_(std::move(address)),
        key_(key) {
    thread_ = std::thread([this] { Run(); });
  }
  ~Server() override {
    stop_ = true;
    const char c = 0;
    (void)!write(wake_write_.get(), &c, 1);
    thread_.join();
  }
  std::string address() const override { return address_; }
  int64_t refused() const override { return refused_.load(); }
  int64_t accepted() const override { return accepted_.load(); }

 private:
  struct Conn {
    Fd fd;
    std::vector<std::byte> in;  // bytes of the next request, not yet a whole frame
    Clock::time_point since;    // opened, or last answered
    // A WAIT for a key not there yet: answered when a PUT brings it or at `until`; the frames
    // behind it wait (answers go in request order).
    std::optional<std::string> waiting{};
    Clock::time_point until{};
  };

  void Run() {
    std::vector<Conn> conns;
    std::vector<pollfd> fds;
    while (!stop_) {
      fds.clear();
      fds.push_back({listener_.get(), POLLIN, 0});
      fds.push_back({wake_read_.get(), POLLIN, 0});
      for (const Conn& c : conns) fds.push_back({c.fd.get(), POLLIN, 0});
      if (poll(fds.data(), fds.size(), PollMs(conns)) < 0 && errno != EINTR) {
        Log(LogLevel::kWarn, "rendezvous: poll: {}", std::strerror(errno));
      }
      const auto now = Clock::now();
      for (size_t i = conns.size(); i-- > 0;) {
        const pollfd& p = fds[2 + i];
        bool close = !conns[i].waiting && now - conns[i].since > kConnectionTimeout;
        if (!close && (p.revents & (POLLIN | POLLHUP | POLLERR))) close = ReadFrom(conns[i]);
        if (close) conns.erase(conns.begin() + static_cast<ptrdiff_t>(i));
      }
      // WAITs whose key came (a PUT above) or whose time is up; then the frames behind them.
      for (size_t i = conns.size(); i-- > 0;) {
        if (conns[i].waiting && EndWait(conns[i], Clock::now()) && Serve(conns[i]))
          conns.erase(conns.begin() + static_cast<ptrdiff_t>(i));
      }
      if ((fds[0].revents & POLLIN) && HasRoom(conns)) {
        int fd = accept4(listener_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd >= 0) {
          conns.push_back(Conn{Fd(fd), {}, now});
          ++accepted_;
        }
      }
    }
  }

  // Room for one more connection: below the bound, or by closing the connection idle longest
  // (no request under way); none when every connection is mid-request.
  static bool HasRoom(std::vector<Conn>& conns) {
    if (conns.size() < kMaxConnections) return true;
    auto idle = conns.end();
    for (auto it = conns.begin(); it != conns.end(); ++it) {
      if (it->in.empty() && !it->waiting && (idle == conns.end() || it->since < idle->since))
        idle = it;
    }
    if (idle == conns.end()) return false;
    conns.erase(idle);
    return true;
  }

  // The poll's timeout: 100 ms, or until the first waiting WAIT ends.
  static int PollMs(const std::vector<Conn>& conns) {
    auto next = Clock::now() + std::chrono::milliseconds(100);
    for (const Conn& c : conns) {
      if (c.waiting) next = std::min(next, c.until);
    }
    const auto ms = std::chrono::ceil<std::chrono::milliseconds>(next - Clock::now()).count();
    return static_cast<int>(std::max<int64_t>(ms, 0));
  }

  // Answers the connection's WAIT if its key is there (OK) or its time is up (NOT_FOUND): true
  // when it did.
  bool EndWait(Conn& c, Clock::time_point now) {
    std::optional<std::vector<std::byte>> value;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = store_.find(*c.waiting);
      if (it != store_.end()) value = it->second;
    }
    if (!value && now < c.until) return false;
    Reply(c, value ? Frame{FrameType::kOk, {}, std::move(*value), {}}
                   : Frame{FrameType::kNotFound, {}, {}, {}});
    c.waiting.reset();
    c.since = Clock::now();
    return true;
  }

  // Reads what arrived and answers every whole frame in it, in order. True when the connection
  // is done (closed by the client, failed, or refused).
  bool ReadFrom(Conn& c) {
    std::byte buf[65536];
    ssize_t n = read(c.fd.get(), buf, sizeof buf);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) return true;
    if (n < 0) return false;
    c.in.insert(c.in.end(), buf, buf + n);
    return Serve(c);
  }

  // Answers the whole frames buffered on the connection, in order, until one must wait.
  bool Serve(Conn& c) {
    while (!c.waiting && c.in.size() >= kHeaderBytes) {
      StatusOr<size_t> length = DecodeHeader(c.in);
      if (!length.ok()) return Refuse(c, length.status().message(), false);
      const size_t total = kHeaderBytes + *length + kTagBytes;
      if (c.in.size() < total) return false;
      StatusOr<Frame> request = DecodeFrame(std::span(c.in).first(total), key_);
      if (!request.ok()) return Refuse(c, request.status().message(), false);
      c.in.erase(c.in.begin(), c.in.begin() + static_cast<ptrdiff_t>(total));
      if (request->type == FrameType::kWait) {
        c.waiting = request->key;
        c.until = Clock::now() + std::chrono::milliseconds(request->wait_ms);
        EndWait(c, Clock::now());
        continue;
      }
      Reply(c, Handle(*request));
      c.since = Clock::now();
    }
    return false;
  }

  Frame Handle(const Frame& request) {
    std::lock_guard<std::mutex> lock(mu_);
    Frame reply{FrameType::kOk, {}, {}, {}};
    switch (request.type) {
      case FrameType::kPut: {
        auto it = store_.find(request.key);
        const size_t old = it == store_.end() ? 0 : it->second.size() + it->first.size();
        const size_t added = request.value.size() + request.key.size();
        if (store_bytes_ - old + added > kMaxStoreBytes ||
            (it == store_.end() && store_.size() >= kMaxStoreKeys)) {
          ++refused_;
          return Frame{FrameType::kRefused,
                       {},
                       {},
                       fmt::format("rendezvous store full ({} keys, {} bytes; bounds {}, {})",
                                   store_.size(), store_bytes_, kMaxStoreKeys, kMaxStoreBytes)};
        }
        store_bytes_ = store_bytes_ - old + added;
        store_[request.key] = request.value;
        return reply;
      }
      case FrameType::kGet: {
        auto it = store_.find(request.key);
        if (it == store_.end()) return Frame{FrameType::kNotFound, {}, {}, {}};
        reply.value = it->second;
        return reply;
      }
      case FrameType::kErase: {
        auto it = store_.find(request.key);
        if (it != store_.end()) {
          store_bytes_ -= it->second.size() + it->first.size();
          store_.erase(it);
        }
        return reply;
      }
      default:
        ++refused_;
        return Frame{FrameType::kRefused, {}, {}, "a reply type sent as a request"};
    }
  }

  bool Refuse(Conn& c, std::string_view why, bool sign) {
    ++refused_;
    Log(LogLevel::kWarn, "rendezvous: refused a request: {}", why);
    Reply(c, Frame{FrameType::kRefused, {}, {}, std::string(why)}, sign);
    return true;
  }

  void Reply(Conn& c, const Frame& reply, bool sign = true) {
    const std::vector<std::byte> bytes = EncodeFrame(reply, key_, sign);
    (void)WriteAll(c.fd.get(), bytes, Clock::now() + std::chrono::seconds(1));
  }

  const Fd listener_, wake_read_, wake_write_;
  const std::string address_;
  const RendezvousKey key_;
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> refused_{0};
  std::atomic<int64_t> accepted_{0};
  std::mutex mu_;
  std::map<std::string, std::vector<std::byte>> store_;  // guarded by mu_
  size_t store_bytes_ = 0;                               // guarded by mu_
  std::thread thread_;
};

class Client final : public Rendezvous {
 public:
  Client(std::string host, std::string port, const RendezvousKey& key)
      : host_(std::move(host)), port_(std::move(port)), key_(key) {}

  Status Put(std::string_view key, std::span<const std::byte> value, Deadline deadline) override {
    if (value.size() > kMaxRendezvousValueBytes) {
      return Status::InvalidArgument(fmt::format("rendezvous value of {} bytes exceeds {}",
                                                 value.size(), kMaxRendezvousValueBytes));
    }
    Frame f{FrameType::kPut, std::string(key), {value.begin(), value.end()}, {}};
    KVF_ASSIGN_OR_RETURN(Frame reply, Call(f, deadline));
    return Expect(reply, FrameType::kOk, key);
  }

  StatusOr<std::vector<std::byte>> Get(std::string_view key, Deadline deadline) override {
    // The server holds a WAIT until the key appears (up to kMaxWaitMs per request, so the
    // connection's idle bound never ends it): one round trip, no polling. Its answer is due a
    // margin (a quarter of the wait, 2 to 50 ms) before the deadline; the last moments are polled
    // with GET, which never starts a request due past the deadline (a reply still on its way
    // when the deadline passes would cost the kept connection).
    const int64_t margin = std::clamp<int64_t>(
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count() / 4,
        2, 50);
    bool wait_refused = false;
    while (wait_ok_.load()) {
      const auto left =
          std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left <= margin) break;
      Frame wait{FrameType::kWait, std::string(key), {}, {}};
      wait.wait_ms = static_cast<uint32_t>(std::min<int64_t>(left - margin, kMaxWaitMs));
      StatusOr<Frame> reply = Call(wait, deadline);
      if (!reply.ok() && reply.status().code() == StatusCode::kInvalidArgument) {
        // A server before WAIT refuses the frame type: ask it the old way. A wrong group key or
        // a bad key is refused again there and reported, and the client keeps asking by WAIT.
        wait_refused = true;
        break;
      }
      KVF_RETURN_IF_ERROR(reply.status());
      if (reply->type == FrameType::kOk) return std::move(reply->value);
      if (reply->type != FrameType::kNotFound) {
        KVF_RETURN_IF_ERROR(Expect(*reply, FrameType::kOk, key));
      }
    }
    auto pause = std::chrono::milliseconds(1);
    for (;;) {
      KVF_ASSIGN_OR_RETURN(Frame reply,
                           Call(Frame{FrameType::kGet, std::string(key), {}, {}}, deadline));
      if (wait_refused && reply.type != FrameType::kRefused) wait_ok_ = false;  // GET, not WAIT
      if (reply.type == FrameType::kOk) return std::move(reply.value);
      if (reply.type != FrameType::kNotFound) {
        KVF_RETURN_IF_ERROR(Expect(reply, FrameType::kOk, key));
      }
      if (Clock::now() + pause >= deadline) {
        return Status::DeadlineExceeded(
            fmt::format("rendezvous {}:{}: key '{}' did not appear in time", host_, port_, key));
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::milliseconds(50));
    }
  }

  Status Erase(std::string_view key, Deadline deadline) override {
    KVF_ASSIGN_OR_RETURN(Frame reply,
                         Call(Frame{FrameType::kErase, std::string(key), {}, {}}, deadline));
    return Expect(reply, FrameType::kOk, key);
  }

 private:
  // One request and its reply, on a kept connection when there is one. A kept connection the
  // server has closed since (its idle bound, or a server that answers once per connection) fails
  // with kUnavailable; the request then goes again on a new connection (requests are idempotent).
  StatusOr<Frame> Call(const Frame& request, Deadline deadline) {
    if (request.key.empty() || request.key.size() > kMaxRendezvousKeyBytes) {
      return Status::InvalidArgument(fmt::format("rendezvous key of {} bytes: must be 1..{}",
                                                 request.key.size(), kMaxRendezvousKeyBytes));
    }
    const std::vector<std::byte> bytes = EncodeFrame(request, key_);
    if (Fd kept = TakeKept(); kept.get() >= 0) {
      StatusOr<Frame> reply = Exchange(kept, bytes, deadline);
      KeepAfter(reply, std::move(kept));
      if (reply.ok() || reply.status().code() != StatusCode::kUnavailable) return reply;
    }
    KVF_ASSIGN_OR_RETURN(Fd fd, ConnectTcp(host_, port_, deadline));
    StatusOr<Frame> reply = Exchange(fd, bytes, deadline);
    KeepAfter(reply, std::move(fd));
    return reply;
  }

  // Sends a request and reads its reply. Any failure leaves the connection unusable (a reply may
  // still be on its way), so the caller keeps it only after a success.
  StatusOr<Frame> Exchange(const Fd& fd, std::span<const std::byte> bytes, Deadline deadline) {
    KVF_RETURN_IF_ERROR(WriteAll(fd.get(), bytes, deadline));
    std::vector<std::byte> in(kHeaderBytes);
    KVF_RETURN_IF_ERROR(ReadExactly(fd.get(), in, deadline));
    StatusOr<size_t> length = DecodeHeader(in);
    if (!length.ok()) {
      return Status::DataLoss(fmt::format("rendezvous {}:{} answered garbage: {}", host_, port_,
                                          length.status().message()));
    }
    in.resize(kHeaderBytes + *length + kTagBytes);
    KVF_RETURN_IF_ERROR(ReadExactly(fd.get(), std::span(in).subspan(kHeaderBytes), deadline));
    StatusOr<Frame> reply = DecodeFrame(in, key_);
    if (!reply.ok()) {
      return Status(reply.status().code(),
                    fmt::format("rendezvous {}:{}: {}", host_, port_, reply.status().message()));
    }
    return reply;
  }

  Fd TakeKept() {
    std::lock_guard<std::mutex> lock(mu_);
    if (kept_.empty()) return Fd();
    Fd fd = std::move(kept_.back());
    kept_.pop_back();
    return fd;
  }

  // Keeps a connection for later calls after a whole answer (the server closes after refusing a
  // request): as many as threads have called at once, at most kKept.
  void KeepAfter(const StatusOr<Frame>& reply, Fd fd) {
    if (!reply.ok() || reply->type == FrameType::kRefused) return;
    std::lock_guard<std::mutex> lock(mu_);
    if (kept_.size() < kKept) kept_.push_back(std::move(fd));
  }

  Status Expect(const Frame& reply, FrameType type, std::string_view key) const {
    if (reply.type == type) return Status::Ok();
    if (reply.type == FrameType::kRefused) {
      return Status::InvalidArgument(
          fmt::format("rendezvous {}:{} refused '{}': {}", host_, port_, key, reply.reason));
    }
    return Status::DataLoss(fmt::format("rendezvous {}:{} answered type 0x{:02x} for '{}'", host_,
                                        port_, static_cast<int>(reply.type), key));
  }

  static constexpr size_t kKept = 4;
  const std::string host_, port_;
  const RendezvousKey key_;
  std::mutex mu_;
  std::vector<Fd> kept_;             // guarded by mu_: open connections no call is using
  std::atomic<bool> wait_ok_{true};  // the server takes WAIT (false after it refused one)
};

}  // namespace
}  // namespace rendezvous

StatusOr<std::unique_ptr<RendezvousServer>> RendezvousServer::Start(std::string_view host,
                                                                    uint16_t port,
                                                                    const RendezvousKey& key) {
  KVF_ASSIGN_OR_RETURN(rendezvous::Listener l, rendezvous::ListenTcp(host, port));
  int pipe_fds[2];
  if (pipe2(pipe_fds, O_CLOEXEC | O_NONBLOCK) != 0) {
    return Status::Internal(fmt::format("rendezvous: pipe: {}", std::strerror(errno)));
  }
  return std::unique_ptr<RendezvousServer>(
      new rendezvous::Server(std::move(l.fd), rendezvous::Fd(pipe_fds[0]),
                             rendezvous::Fd(pipe_fds[1]), std::move(l.address), key));
}

StatusOr<std::unique_ptr<Rendezvous>> ConnectRendezvous(std::string_view address,
                                                        const RendezvousKey& key) {
  const size_t colon = address.rfind(':');
  if (colon == std::string_view::npos || colon == 0 || colon + 1 == address.size()) {
    return Status::InvalidArgument(
        fmt::format("rendezvous address '{}': expected host:port", address));
  }
  std::string host(address.substr(0, colon));
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  const std::string port(address.substr(colon + 1));
  if (port.find_first_not_of("0123456789") != std::string::npos || port.size() > 5) {
    return Status::InvalidArgument(
        fmt::format("rendezvous address '{}': the port '{}' is not a number", address, port));
  }
  return std::unique_ptr<Rendezvous>(new rendezvous::Client(std::move(host), port, key));
}

}  // namespace kvferry
