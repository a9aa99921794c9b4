// The default rendezvous' client, and the server's and client's factories (the server is
// server.cc). A client keeps its connections open between calls (a call is one request and its
// reply; a deployment makes a few per rank at start, then several per request: the handle's
// publication, each generation rank's fetch, its erasure).
//
// A connection opens with HELLO (the client's nonce) answered by CHALLENGE (the server's); every
// request after is numbered and tagged under both nonces (rendezvous/frame.h). A client whose
// kept connection was closed (the server's idle bound, or pressure on it) connects again and
// repeats the request: every request is idempotent.
#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <thread>

#include "rendezvous/frame.h"
#include "rendezvous/server.h"
#include "rendezvous/socket.h"

namespace kvferry {
namespace rendezvous {
namespace {

Nonce RandomNonce() {
  const RendezvousKey r = RandomKey();
  Nonce n;
  std::transform(r.begin(), r.end(), n.begin(), [](uint8_t b) { return std::byte{b}; });
  return n;
}

// One open connection: its context and the number of its next request.
struct Session {
  Fd fd;
  Context context;
  uint64_t next_sequence = 1;
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
    Frame f{
        .type = FrameType::kPut, .key = std::string(key), .value = {value.begin(), value.end()}};
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
    for (;;) {
      const auto left =
          std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left <= margin) break;
      Frame wait{.type = FrameType::kWait, .key = std::string(key)};
      wait.wait_ms = static_cast<uint32_t>(std::min<int64_t>(left - margin, kMaxWaitMs));
      KVF_ASSIGN_OR_RETURN(Frame reply, Call(wait, deadline));
      if (reply.type == FrameType::kOk) return std::move(reply.value);
      if (reply.type != FrameType::kNotFound) {
        KVF_RETURN_IF_ERROR(Expect(reply, FrameType::kOk, key));
      }
    }
    auto pause = std::chrono::milliseconds(1);
    for (;;) {
      KVF_ASSIGN_OR_RETURN(Frame reply,
                           Call(Frame{.type = FrameType::kGet, .key = std::string(key)}, deadline));
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
                         Call(Frame{.type = FrameType::kErase, .key = std::string(key)}, deadline));
    return Expect(reply, FrameType::kOk, key);
  }

 private:
  // One request and its reply, on a kept connection when there is one. A kept connection the
  // server has closed since fails with kUnavailable; the request then goes again on a new
  // connection (requests are idempotent).
  StatusOr<Frame> Call(Frame request, Deadline deadline) {
    if (request.key.empty() || request.key.size() > kMaxRendezvousKeyBytes) {
      return Status::InvalidArgument(fmt::format("rendezvous key of {} bytes: must be 1..{}",
                                                 request.key.size(), kMaxRendezvousKeyBytes));
    }
    if (std::optional<Session> kept = TakeKept()) {
      StatusOr<Frame> reply = Exchange(*kept, request, deadline);
      KeepAfter(reply, std::move(*kept));
      if (reply.ok() || reply.status().code() != StatusCode::kUnavailable) return reply;
    }
    KVF_ASSIGN_OR_RETURN(Session session, Open(deadline));
    StatusOr<Frame> reply = Exchange(session, request, deadline);
    KeepAfter(reply, std::move(session));
    return reply;
  }

  // A new connection, greeted: HELLO with our nonce, CHALLENGE with the server's.
  StatusOr<Session> Open(Deadline deadline) {
    KVF_ASSIGN_OR_RETURN(Fd fd, ConnectTcp(host_, port_, deadline));
    Session s{std::move(fd), Context{RandomNonce(), {}}, 1};
    const Frame hello{.type = FrameType::kHello, .nonce = s.context.client};
    KVF_RETURN_IF_ERROR(WriteAll(s.fd.get(), EncodeFrame(hello, key_, Context{}), deadline));
    KVF_ASSIGN_OR_RETURN(Frame challenge, Read(s.fd, Context{s.context.client, {}}, deadline));
    if (challenge.type != FrameType::kChallenge) {
      KVF_RETURN_IF_ERROR(Expect(challenge, FrameType::kChallenge, "(greeting)"));
    }
    s.context.server = challenge.nonce;
    return s;
  }

  // Sends a request and reads its reply. Any failure leaves the connection unusable (a reply may
  // still be on its way), so the caller keeps it only after a success.
  StatusOr<Frame> Exchange(Session& s, Frame& request, Deadline deadline) {
    request.sequence = s.next_sequence++;
    KVF_RETURN_IF_ERROR(WriteAll(s.fd.get(), EncodeFrame(request, key_, s.context), deadline));
    KVF_ASSIGN_OR_RETURN(Frame reply, Read(s.fd, s.context, deadline));
    if (reply.sequence != request.sequence) {
      return Status::DataLoss(fmt::format("rendezvous {}:{} answered request {} to request {}",
                                          host_, port_, reply.sequence, request.sequence));
    }
    return reply;
  }

  // One frame. A server of another frame version is named as such (its refusal of our frame is
  // not readable in our version); garbage is kDataLoss.
  StatusOr<Frame> Read(const Fd& fd, const Context& context, Deadline deadline) {
    std::vector<std::byte> in(kSealedHeaderBytes);
    KVF_RETURN_IF_ERROR(ReadExactly(fd.get(), std::span(in).first(kVersionBytes), deadline));
    if (Status v = CheckVersion(std::span(in).first(kVersionBytes)); !v.ok()) {
      if (in[0] == std::byte{0x4B} && in[1] == std::byte{0x56}) {  // "KV": a kvferry frame
        return Status::InvalidArgument(fmt::format(
            "rendezvous {}:{} speaks another protocol version: {}", host_, port_, v.message()));
      }
      return Status::DataLoss(
          fmt::format("rendezvous {}:{} answered garbage: {}", host_, port_, v.message()));
    }
    KVF_RETURN_IF_ERROR(ReadExactly(fd.get(), std::span(in).subspan(kVersionBytes), deadline));
    StatusOr<Header> header = ParseHeader(in);
    if (!header.ok()) {
      return Status::DataLoss(fmt::format("rendezvous {}:{} answered garbage: {}", host_, port_,
                                          header.status().message()));
    }
    in.resize(header->frame_bytes());
    KVF_RETURN_IF_ERROR(ReadExactly(fd.get(), std::span(in).subspan(kSealedHeaderBytes), deadline));
    StatusOr<Frame> reply = DecodeFrame(in, key_, context);
    if (!reply.ok()) {
      return Status(reply.status().code(),
                    fmt::format("rendezvous {}:{}: {}", host_, port_, reply.status().message()));
    }
    return reply;
  }

  std::optional<Session> TakeKept() {
    std::lock_guard<std::mutex> lock(mu_);
    if (kept_.empty()) return std::nullopt;
    Session s = std::move(kept_.back());
    kept_.pop_back();
    return s;
  }

  // Keeps a connection for later calls after a whole answer (the server closes after refusing a
  // request): as many as threads have called at once, at most kKept.
  void KeepAfter(const StatusOr<Frame>& reply, Session s) {
    if (!reply.ok() || reply->type == FrameType::kRefused) return;
    std::lock_guard<std::mutex> lock(mu_);
    if (kept_.size() < kKept) kept_.push_back(std::move(s));
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
  std::vector<Session> kept_;  // guarded by mu_: open connections no call is using
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
  return rendezvous::StartServer(std::move(l.fd), rendezvous::Fd(pipe_fds[0]),
                                 rendezvous::Fd(pipe_fds[1]), std::move(l.address), key);
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
