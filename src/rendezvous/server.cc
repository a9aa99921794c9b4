// The default rendezvous server: one thread, non-blocking sockets, a store in memory.
//
// Why it is shaped this way: the server is reachable by anyone on the network, so what a peer
// without the group key can make it hold or do must be small and bounded, and no peer, keyed or
// not, may hold the thread. So:
//   - A connection reads only its next 36-byte sealed header (at most a 68-byte HELLO before it
//     has a context) and verifies the header's tag before it takes a body. A connection that has
//     not yet sent a request verifying under its own context is "unverified": at most
//     kMaxUnverified of them, each closed kUnverifiedTimeout after it opened, the oldest closed to
//     let a new one in. They hold at most kMaxUnverifiedBytes each.
//   - Verified connections read a frame over kSmallFrameBytes only within a total budget
//     (kMaxInputBytes, reserved whole when the header verifies, so no two bodies starve each
//     other); smaller frames (handles, addresses) are always read, so keyed peers sending large
//     values slowly do not hold up the small requests of a deployment. A connection's next
//     request is read only when its previous reply is in the kernel, so it has one reply queued
//     at most; a reply over kSmallFrameBytes (a GET or WAIT of a large value) is queued only
//     within a total budget (kMaxOutputBytes), the request waiting as a WAIT does meanwhile.
//     Replies go out when poll says POLLOUT: a client that never reads stops being read (TCP
//     pushes back on it) and is closed kConnectionTimeout after its last progress; it never
//     delays another client.
//   - Behind a pending WAIT nothing is read: the frames queued behind it wait in the kernel.
//   - The listening socket is polled only while a connection can be taken (room, or one to
//     close for it), so a full table never spins the thread.
// Every request is idempotent and clients connect again when the server closed their connection,
// so closing is always a safe answer to pressure.
#include "rendezvous/server.h"

#include <fmt/format.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <thread>

#include "base/log.h"
#include "base/thread_annotations.h"
#include "rendezvous/frame.h"

namespace kvferry::rendezvous {
namespace {

constexpr auto kUnverifiedTimeout = std::chrono::seconds(2);
constexpr auto kConnectionTimeout = std::chrono::seconds(5);
constexpr auto kClosingTimeout = std::chrono::seconds(1);
constexpr size_t kMaxConnections = 512;
constexpr size_t kMaxUnverified = 256;
constexpr size_t kMaxInputBytes = size_t{32} << 20;    // frames over kSmallFrameBytes
constexpr size_t kSmallFrameBytes = size_t{64} << 10;  // at most 512 × 64 KiB = 32 MiB more
constexpr size_t kMaxOutputBytes = size_t{32} << 20;
constexpr size_t kMaxStoreBytes = size_t{64} << 20;
constexpr size_t kMaxStoreKeys = 65536;
constexpr int kFramesPerTurn = 16;  // fairness: a pipelining client yields after this many
constexpr int kAcceptsPerTurn = 64;
// Large frames verified or large replies tagged per turn over all connections (a MiB costs a few
// milliseconds of SipHash and copies on a slow core): the bound on how long one turn, and so a
// small request behind it, takes.
constexpr int kLargePerTurn = 2;

// An unverified connection's input is its greeting (kGreetingBytes) and its output a CHALLENGE
// or a refusal, whose reason is cut to fit.
constexpr size_t kMaxReasonBytes = 300;
static_assert(kMaxUnverifiedBytes >=
              kGreetingBytes + kSealedHeaderBytes + 4 + kMaxReasonBytes + kTagBytes);

enum class Phase {
  kHello,    // reads HELLO (unauthenticated context)
  kOpen,     // reads requests under its context
  kClosing,  // refused: sends the refusal, then closes
};

struct Conn {
  Fd fd;
  Phase phase = Phase::kHello;
  bool verified = false;  // a request verified under its context
  Context context;
  uint64_t next_sequence = 1;
  std::vector<std::byte> in;     // the frame being read: its sealed header, then all of it
  size_t filled = 0;             // bytes of `in` read so far
  std::optional<Header> header;  // the verified header of `in`, whose body is being read
  size_t reserved = 0;           // input budget held (verified connections' bodies)
  std::vector<std::byte> out;    // reply bytes not yet in the kernel, from `sent`
  size_t sent = 0;
  bool out_large = false;           // `out` is a reply over kSmallFrameBytes
  Clock::time_point opened, since;  // since: opened, last answered or last output progress
  bool parked = false;  // waits for the input budget or a large turn: tried every turn, not polled
  bool dead = false;
  // A WAIT for a key not there yet: answered when a PUT brings it or at `until`.
  std::optional<std::string> waiting{};
  uint64_t wait_sequence = 0;
  Clock::time_point until{};

  size_t pending() const { return out.size() - sent; }
  size_t held() const { return in.size() + pending(); }
};

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
  RendezvousServerStats stats() const override {
    MutexLock lock(stats_mu_);
    return stats_;
  }

 private:
  void Run() {
    std::vector<pollfd> fds;
    while (!stop_) {
      fds.clear();
      fds.push_back({listener_.get(), static_cast<short>(CanAccept() ? POLLIN : 0), 0});
      fds.push_back({wake_read_.get(), POLLIN, 0});
      for (const auto& c : conns_) {
        short events = 0;
        if (Readable(*c) && !c->parked) events |= POLLIN;
        if (c->pending() > 0) events |= POLLOUT;
        fds.push_back({c->fd.get(), events, 0});
      }
      if (poll(fds.data(), fds.size(), PollMs()) < 0 && errno != EINTR) {
        Log(LogLevel::kWarn, "rendezvous: poll: {}", std::strerror(errno));
      }
      large_this_turn_ = 0;
      const size_t first = conns_.empty() ? 0 : turn_++ % conns_.size();  // fair to late ones
      for (size_t k = 0; k < conns_.size(); ++k) {
        const size_t i = (first + k) % conns_.size();
        Conn& c = *conns_[i];
        const short revents = fds[2 + i].revents;
        if (revents & (POLLERR | POLLNVAL)) c.dead = true;
        if (!c.dead && (revents & POLLOUT)) Flush(c);
        if (!c.dead && Readable(c) && (c.parked || (revents & (POLLIN | POLLHUP)))) Advance(c);
        // Hung up while not read (behind a WAIT): no one is left to answer, and poll would
        // report it at once on every turn.
        if (!c.dead && (revents & POLLHUP) && !Readable(c)) c.dead = true;
      }
      const auto now = Clock::now();
      for (auto& c : conns_) {
        if (!c->dead && c->waiting) EndWait(*c, now);
        if (!c->dead && TimedOut(*c, now)) c->dead = true;
      }
      Sweep();
      if (fds[0].revents & POLLIN) Accept();
      Publish();
    }
  }

  // Reading a connection's next frame is allowed: not behind a WAIT (or a GET whose large reply
  // waits for the output budget), a reply still queued or a refusal.
  static bool Readable(const Conn& c) {
    return !c.dead && c.phase != Phase::kClosing && !c.waiting && c.pending() == 0;
  }

  // A reply of `bytes` may be queued now: small ones always (each connection has one at most),
  // large ones within the budget.
  bool Fits(size_t bytes) const {
    if (bytes <= kSmallFrameBytes) return true;
    return large_this_turn_ < kLargePerTurn &&
           (large_output_bytes_ == 0 || large_output_bytes_ + bytes <= kMaxOutputBytes);
  }

  // The poll's timeout: 100 ms, 5 ms while a connection waits for a budget, or until the first
  // waiting WAIT ends.
  int PollMs() const {
    const auto now = Clock::now();
    const auto soon = now + std::chrono::milliseconds(5);
    auto next = now + std::chrono::milliseconds(100);
    if (accept_paused_until_ > now) next = std::min(next, accept_paused_until_);
    for (const auto& c : conns_) {
      // A wait past its end waits for the output budget: checked on every turn, and at least
      // every 5 ms.
      if (c->waiting) next = std::min(next, c->until > now ? c->until : soon);
      if (c->parked && Readable(*c)) next = std::min(next, soon);
    }
    const auto ms = std::chrono::ceil<std::chrono::milliseconds>(next - Clock::now()).count();
    return static_cast<int>(std::max<int64_t>(ms, 0));
  }

  bool TimedOut(const Conn& c, Clock::time_point now) const {
    if (c.phase == Phase::kClosing) return now - c.since > kClosingTimeout;
    if (!c.verified && now - c.opened > kUnverifiedTimeout) return true;
    if (c.waiting) return now - c.until > kConnectionTimeout;  // answer deferred for budget
    return now - c.since > kConnectionTimeout;
  }

  // ---- connections ----------------------------------------------------------------------

  bool CanAccept() const {
    if (Clock::now() < accept_paused_until_) return false;
    if (conns_.size() < kMaxConnections) return true;
    return std::any_of(conns_.begin(), conns_.end(),
                       [](const auto& c) { return !c->verified || Idle(*c); });
  }

  static bool Idle(const Conn& c) {
    return c.phase == Phase::kOpen && c.filled == 0 && !c.waiting && c.pending() == 0;
  }

  void Accept() {
    for (int i = 0; i < kAcceptsPerTurn; ++i) {
      pollfd pending{listener_.get(), POLLIN, 0};  // close no one for a connection not there
      if (poll(&pending, 1, 0) != 1 || !MakeRoom()) return;
      const int fd = accept4(listener_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR && errno != ECONNABORTED) {
          // Out of descriptors or memory: the listener stays readable, so pause rather than spin.
          Log(LogLevel::kWarn, "rendezvous: accept: {}", std::strerror(errno));
          accept_paused_until_ = Clock::now() + std::chrono::milliseconds(100);
        }
        return;
      }
      auto c = std::make_unique<Conn>();
      c->fd = Fd(fd);
      c->opened = c->since = Clock::now();
      c->in.resize(kSealedHeaderBytes);
      conns_.push_back(std::move(c));
      ++accepted_;
    }
  }

  // Room for one more connection: under both bounds, else by closing the oldest unverified
  // connection, else (at the total bound) the verified one idle longest. False when every
  // connection is verified and busy.
  bool MakeRoom() {
    const size_t unverified = static_cast<size_t>(
        std::count_if(conns_.begin(), conns_.end(), [](const auto& c) { return !c->verified; }));
    if (unverified < kMaxUnverified && conns_.size() < kMaxConnections) return true;
    auto victim = conns_.end();
    for (auto it = conns_.begin(); it != conns_.end(); ++it) {
      if (!(*it)->verified && (victim == conns_.end() || (*it)->opened < (*victim)->opened)) {
        victim = it;
      }
    }
    if (victim == conns_.end() && conns_.size() >= kMaxConnections) {
      for (auto it = conns_.begin(); it != conns_.end(); ++it) {
        if (Idle(**it) && (victim == conns_.end() || (*it)->since < (*victim)->since)) victim = it;
      }
    }
    if (victim == conns_.end()) return conns_.size() < kMaxConnections;
    (*victim)->dead = true;
    Sweep();
    return true;
  }

  void Sweep() {
    for (auto& c : conns_) {
      if (c->dead) {
        Release(*c);
        output_bytes_ -= c->pending();
        if (c->out_large) large_output_bytes_ -= c->pending();
      }
    }
    std::erase_if(conns_, [](const auto& c) { return c->dead; });
  }

  // ---- input ------------------------------------------------------------------------------

  // Reads what the connection sent, frame by frame, and answers each whole one, until the
  // socket is drained, a frame must wait, or the connection has had its turn: kFramesPerTurn
  // frames, or one large frame or reply (copying, tagging and sending 1 MiB is a millisecond).
  void Advance(Conn& c) {
    c.parked = false;
    for (int frames = 0; frames < kFramesPerTurn && Readable(c);) {
      const size_t want = c.header ? c.header->frame_bytes() : kSealedHeaderBytes;
      if (c.filled < want) {
        if (c.in.size() < want && !Reserve(c, want)) return;
        const ssize_t n = recv(c.fd.get(), c.in.data() + c.filled, want - c.filled, 0);
        if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
          c.dead = true;
          return;
        }
        if (n < 0) return;
        const size_t before = c.filled;
        c.filled += static_cast<size_t>(n);
        if (before < kVersionBytes) {
          Status version = CheckVersion(std::span(c.in).first(c.filled));
          if (!version.ok()) return Refuse(c, version.message(), false);
        }
        if (c.filled < want) continue;
      }
      if (!c.header) {
        OnHeader(c);
        continue;
      }
      if (want > kSmallFrameBytes && large_this_turn_ >= kLargePerTurn) {
        c.parked = true;  // whole in `in`: verified and answered on a later turn
        return;
      }
      if (want > kSmallFrameBytes) ++large_this_turn_;
      const uint64_t output_before = output_total_;
      OnFrame(c);
      ++frames;
      if (want > kSmallFrameBytes || output_total_ - output_before > kSmallFrameBytes) return;
    }
  }

  // Sizes `in` for a whole frame: an unverified connection's greeting, or a verified one's body
  // within the input budget (false: not now; the connection is tried again on the next turns).
  bool Reserve(Conn& c, size_t want) {
    if (c.phase == Phase::kOpen) {
      const bool large = want > kSmallFrameBytes;
      if (large && large_input_bytes_ > 0 && large_input_bytes_ + want > kMaxInputBytes) {
        c.parked = true;
        return false;
      }
      Release(c);
      input_bytes_ += want;
      if (large) large_input_bytes_ += want;
      c.reserved = want;
    }
    c.in.resize(want);
    peak_input_bytes_ = std::max(peak_input_bytes_, input_bytes_);
    return true;
  }

  void Release(Conn& c) {
    input_bytes_ -= c.reserved;
    if (c.reserved > kSmallFrameBytes) large_input_bytes_ -= c.reserved;
    c.reserved = 0;
  }

  // The sealed header is in: authenticate it before any body is read.
  void OnHeader(Conn& c) {
    const bool hello = c.phase == Phase::kHello;
    StatusOr<rendezvous::Header> h = VerifyHeader(c.in, key_, hello ? Context{} : c.context);
    if (!h.ok()) return Refuse(c, h.status().message(), false);
    const bool request = h->type == FrameType::kPut || h->type == FrameType::kGet ||
                         h->type == FrameType::kErase || h->type == FrameType::kWait;
    if (hello && h->type != FrameType::kHello) {
      return Refuse(c, "a connection opens with HELLO", false);
    }
    if (!hello && !request) {
      return Refuse(
          c, fmt::format("frame type 0x{:02x} is not a request", static_cast<int>(h->type)), true);
    }
    if (!hello && h->sequence != c.next_sequence) {
      return Refuse(c,
                    fmt::format("request number {}, expected {} (a replayed or reordered frame)",
                                h->sequence, c.next_sequence),
                    true);
    }
    if (!hello) c.verified = true;
    c.header = *h;
  }

  // The whole frame is in: decode it, answer it, and start reading the next one.
  void OnFrame(Conn& c) {
    const bool hello = c.phase == Phase::kHello;
    StatusOr<rendezvous::Frame> f = DecodeFrame(c.in, key_, hello ? Context{} : c.context);
    if (!f.ok()) return Refuse(c, f.status().message(), !hello);
    Release(c);
    c.header.reset();
    c.filled = 0;
    if (c.in.capacity() > 4096) std::vector<std::byte>().swap(c.in);
    c.in.resize(kSealedHeaderBytes);
    if (hello) {
      c.context.client = f->nonce;
      const RendezvousKey r = RandomKey();
      std::transform(r.begin(), r.end(), c.context.server.begin(),
                     [](uint8_t b) { return std::byte{b}; });
      rendezvous::Frame challenge{.type = FrameType::kChallenge, .nonce = c.context.server};
      Queue(c, EncodeFrame(challenge, key_, Context{c.context.client, {}}));
      c.phase = Phase::kOpen;
      return;
    }
    ++c.next_sequence;
    if (f->type == FrameType::kWait || f->type == FrameType::kGet) {  // a GET waits 0 ms
      c.waiting = f->key;
      c.wait_sequence = f->sequence;
      c.until = Clock::now() + std::chrono::milliseconds(f->wait_ms);
      EndWait(c, Clock::now());
      return;
    }
    rendezvous::Frame reply = Handle(*f);
    reply.sequence = f->sequence;
    Queue(c, EncodeFrame(reply, key_, c.context));
    c.since = Clock::now();
  }

  // Answers the connection's WAIT or GET if its key is there (OK; a large value once the output
  // budget has room) or its time is up (NOT_FOUND).
  void EndWait(Conn& c, Clock::time_point now) {
    auto it = store_.find(*c.waiting);
    if (it == store_.end() && now < c.until) return;
    rendezvous::Frame reply{.type = FrameType::kNotFound, .sequence = c.wait_sequence};
    if (it != store_.end()) {
      if (!Fits(kSealedHeaderBytes + 4 + it->second.size() + kTagBytes)) return;
      reply.type = FrameType::kOk;
      reply.value = it->second;
    }
    c.waiting.reset();
    Queue(c, EncodeFrame(reply, key_, c.context));
    c.since = Clock::now();
  }

  rendezvous::Frame Handle(const rendezvous::Frame& request) {
    rendezvous::Frame reply{.type = FrameType::kOk};
    switch (request.type) {
      case FrameType::kPut: {
        auto it = store_.find(request.key);
        const size_t old = it == store_.end() ? 0 : it->second.size() + it->first.size();
        const size_t added = request.value.size() + request.key.size();
        if (store_bytes_ - old + added > kMaxStoreBytes ||
            (it == store_.end() && store_.size() >= kMaxStoreKeys)) {
          ++refused_;
          return rendezvous::Frame{
              .type = FrameType::kRefused,
              .reason = fmt::format("rendezvous store full ({} keys, {} bytes; bounds {}, {})",
                                    store_.size(), store_bytes_, kMaxStoreKeys, kMaxStoreBytes)};
        }
        store_bytes_ = store_bytes_ - old + added;
        store_[request.key] = request.value;
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
      default:  // Header() lets requests only
        return rendezvous::Frame{.type = FrameType::kRefused, .reason = "not a request"};
    }
  }

  // Answers REFUSED (signed under the connection's context when its frame verified; in version
  // 1's format to a client of version 1) and closes once that is sent.
  void Refuse(Conn& c, std::string_view why, bool sign) {
    ++refused_;
    const auto now = Clock::now();
    if (now - last_log_ > std::chrono::seconds(1)) {
      Log(LogLevel::kWarn, "rendezvous: refused a request: {}{}", why,
          unlogged_ ? fmt::format(" (and {} more in the last second)", unlogged_) : "");
      last_log_ = now;
      unlogged_ = 0;
    } else {
      ++unlogged_;
    }
    const std::string reason(why.substr(0, kMaxReasonBytes));
    const bool version1 =
        c.filled >= kVersionBytes && c.in[4] == std::byte{1} && c.in[5] == std::byte{0};
    rendezvous::Frame refusal{.type = FrameType::kRefused, .reason = reason};
    if (c.header) refusal.sequence = c.header->sequence;
    Queue(c,
          version1 ? EncodeVersion1Refusal(reason) : EncodeFrame(refusal, key_, c.context, sign));
    c.phase = Phase::kClosing;
    c.since = now;
    if (c.pending() == 0) c.dead = true;
  }

  // ---- output -----------------------------------------------------------------------------

  void Queue(Conn& c, std::vector<std::byte> bytes) {
    output_bytes_ += bytes.size();
    output_total_ += bytes.size();
    if (bytes.size() > kSmallFrameBytes) {
      c.out_large = true;
      large_output_bytes_ += bytes.size();
      ++large_this_turn_;
    }
    peak_output_bytes_ = std::max(peak_output_bytes_, output_bytes_);
    if (c.pending() == 0) {
      c.out = std::move(bytes);
      c.sent = 0;
    } else {
      c.out.insert(c.out.end(), bytes.begin(), bytes.end());
    }
    Flush(c);
  }

  // Sends what the kernel takes now, never waiting.
  void Flush(Conn& c) {
    while (c.pending() > 0) {
      const ssize_t n =
          send(c.fd.get(), c.out.data() + c.sent, c.pending(), MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
      if (n <= 0) {
        c.dead = true;
        return;
      }
      c.sent += static_cast<size_t>(n);
      output_bytes_ -= static_cast<size_t>(n);
      if (c.out_large) large_output_bytes_ -= static_cast<size_t>(n);
      c.since = Clock::now();
    }
    if (c.out.capacity() > 4096) std::vector<std::byte>().swap(c.out);
    c.out.clear();
    c.sent = 0;
    c.out_large = false;
    if (c.phase == Phase::kClosing) c.dead = true;
  }

  void Publish() {
    RendezvousServerStats s;
    s.connections = static_cast<int64_t>(conns_.size());
    for (const auto& c : conns_) {
      if (c->verified) continue;
      ++s.unverified;
      s.unverified_bytes += static_cast<int64_t>(c->held());
    }
    peak_unverified_bytes_ = std::max(peak_unverified_bytes_, s.unverified_bytes);
    s.peak_unverified_bytes = peak_unverified_bytes_;
    s.input_bytes = static_cast<int64_t>(input_bytes_);
    s.output_bytes = static_cast<int64_t>(output_bytes_);
    s.peak_input_bytes = static_cast<int64_t>(peak_input_bytes_);
    s.peak_output_bytes = static_cast<int64_t>(peak_output_bytes_);
    MutexLock lock(stats_mu_);
    stats_ = s;
  }

  const Fd listener_, wake_read_, wake_write_;
  const std::string address_;
  const RendezvousKey key_;
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> refused_{0};
  std::atomic<int64_t> accepted_{0};
  mutable Mutex stats_mu_;
  RendezvousServerStats stats_ GUARDED_BY(stats_mu_);
  // The server thread's own:
  std::vector<std::unique_ptr<Conn>> conns_;
  std::map<std::string, std::vector<std::byte>> store_;
  size_t store_bytes_ = 0;
  size_t input_bytes_ = 0, peak_input_bytes_ = 0;    // reserved for verified connections' frames
  size_t large_input_bytes_ = 0;                     // of which frames over kSmallFrameBytes
  size_t output_bytes_ = 0, peak_output_bytes_ = 0;  // queued replies
  size_t large_output_bytes_ = 0;                    // of which replies over kSmallFrameBytes
  uint64_t output_total_ = 0;                        // reply bytes ever queued
  int large_this_turn_ = 0;  // large frames and replies handled in this turn
  size_t turn_ = 0;
  int64_t peak_unverified_bytes_ = 0;
  Clock::time_point last_log_{};
  Clock::time_point accept_paused_until_{};
  int64_t unlogged_ = 0;
  std::thread thread_;
};

}  // namespace

std::unique_ptr<RendezvousServer> StartServer(Fd listener, Fd wake_read, Fd wake_write,
                                              std::string address, const RendezvousKey& key) {
  return std::make_unique<Server>(std::move(listener), std::move(wake_read), std::move(wake_write),
                                  std::move(address), key);
}

}  // namespace kvferry::rendezvous
