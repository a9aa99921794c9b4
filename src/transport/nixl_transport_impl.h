// The NIXL transport's parts (nixl_transport.cc: the agent, peers, messages and progress;
// nixl_transport_rma.cc: registrations and one-sided transfers). Internal to the transport.
#pragma once

#include <fmt/format.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "base/log.h"
#include "kvferry/config.h"
#include "kvferry/transport.h"
#include "transport/nixl_api.h"
#include "transport/nixl_wire.h"

namespace kvferry {
namespace nixl_detail {

using std::chrono::milliseconds;

// The most puts one NIXL request carries.
inline constexpr size_t kMaxBatch = 1024;

// A malloc'd blob from NIXL.
struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
using Blob = std::unique_ptr<void, FreeDeleter>;

inline std::span<const std::byte> AsBytes(const void* p, size_t n) {
  return {static_cast<const std::byte*>(p), n};
}

struct OpState {
  PeerId peer = kAnyPeer;
  bool done = false;
  Status status;
  size_t bytes = 0;
};

class NixlOp final : public TransportOp {
 public:
  explicit NixlOp(std::shared_ptr<OpState> s) : s_(std::move(s)) {}
  bool Done() const override { return s_->done; }
  Status status() const override { return s_->status; }
  size_t bytes() const override { return s_->bytes; }
  OpState* state() const { return s_.get(); }

 private:
  std::shared_ptr<OpState> s_;
};

inline void Finish(OpState& s, Status st) {
  if (s.done) return;
  s.done = true;
  s.status = std::move(st);
}

inline std::unique_ptr<TransportOp> DoneOp(PeerId peer, size_t bytes, Status st) {
  auto s = std::make_shared<OpState>();
  s->peer = peer;
  s->bytes = bytes;
  Finish(*s, std::move(st));
  return std::unique_ptr<TransportOp>(new NixlOp(std::move(s)));
}

// A posted receive, or an unexpected message being held.
struct PendingRecv {
  std::shared_ptr<OpState> op;  // null: unexpected (bytes in `held`)
  PeerId peer = kAnyPeer;
  uint64_t tag = 0;
  std::byte* buf = nullptr;
  size_t capacity = 0;
  bool matched = false;  // a message is filling it (can't be cancelled)
  bool truncated = false;
  uint64_t total = 0, received = 0;
  std::vector<std::byte> held;
};

struct Peer {
  std::string agent;
  std::string address;  // its address text (from Connect or its hello)
  bool loaded = false;  // its metadata is in this agent
  bool hello_sent = false;
  bool heard = false;  // it sent something: it pings, silence means death
  bool dead = false;
  Status death;
  Clock::time_point last_heard{};
  std::set<std::string> keys;  // packed keys whose metadata was loaded
};

// One NIXL transfer: the puts (or the get) it carries, posted as one request. A request's
// descriptor lists have one memory type each: every local buffer lies in `local_place`, every
// remote one in `remote_place`.
struct Xfer {
  PeerId peer = kAnyPeer;
  int op = kOpWrite;
  MemPlace local_place, remote_place;
  std::vector<std::shared_ptr<OpState>> ops;
  std::vector<uintptr_t> local, remote;
  std::vector<size_t> sizes;
  std::vector<RegDlist> temps;  // registrations made for it (local buffers in none)
  XferReq req = nullptr;
};

class NixlTransport;

class NixlRegistration final : public MemoryRegistration {
 public:
  NixlRegistration(NixlTransport* t, RegDlist dlist, void* owned, uint64_t addr, size_t size,
                   std::vector<std::byte> key)
      : t_(t), dlist_(dlist), owned_(owned), addr_(addr), size_(size), key_(std::move(key)) {}
  ~NixlRegistration() override;
  std::span<const std::byte> PackedKey() const override { return key_; }
  uint64_t address() const override { return addr_; }
  size_t size() const override { return size_; }

 private:
  NixlTransport* t_;
  RegDlist dlist_;
  void* owned_;
  uint64_t addr_;
  size_t size_;
  std::vector<std::byte> key_;
};

class NixlTransport final : public Transport {
 public:
  static StatusOr<std::unique_ptr<Transport>> Create(const TransportOptions& options);
  ~NixlTransport() override;

  const TransportCaps& caps() const override { return caps_; }
  std::string LocalAddress() const override { return address_; }
  StatusOr<PeerId> Connect(std::string_view address, Deadline deadline) override;
  StatusOr<std::unique_ptr<TransportOp>> Send(PeerId peer, uint64_t tag, const void* buf,
                                              size_t bytes, MemoryKind kind) override;
  StatusOr<std::unique_ptr<TransportOp>> Recv(PeerId peer, uint64_t tag, void* buf, size_t capacity,
                                              MemoryKind kind) override;
  void Cancel(TransportOp& op) override;
  Status SendControl(PeerId peer, std::span<const std::byte> bytes) override;
  std::optional<ControlMessage> PollControl() override;
  bool Progress() override;
  StatusOr<std::unique_ptr<MemoryRegistration>> RegisterMemory(void* ptr, size_t bytes,
                                                               MemoryKind kind) override;
  StatusOr<std::unique_ptr<TransportOp>> Put(PeerId peer, const void* local, size_t bytes,
                                             MemoryKind kind, uint64_t remote_addr,
                                             std::span<const std::byte> rkey) override;
  StatusOr<std::unique_ptr<TransportOp>> Get(PeerId peer, void* local, size_t bytes,
                                             MemoryKind kind, uint64_t remote_addr,
                                             std::span<const std::byte> rkey) override;
  StatusOr<std::unique_ptr<TransportOp>> Flush(PeerId peer) override;
  std::string DescribePeer(PeerId peer) override;

  void Deregister(RegDlist dlist, uint64_t addr);

 private:
  NixlTransport(const NixlApi* api) : api_(api) {}
  // Memory the one-sided operations take (GPU memory too where CUDA runs), and memory tagged
  // messages take (host memory only: their bytes travel in notifications).
  Status CheckKind(MemoryKind kind) const;
  Status CheckTaggedKind(MemoryKind kind) const;
  // kInvalidArgument for an id that names no peer (a dead peer's id is valid).
  Status CheckPeer(PeerId peer) const;
  StatusOr<Peer*> LivePeer(PeerId peer);
  // LivePeer with its metadata loaded into this agent (first use).
  StatusOr<Peer*> ReadyPeer(PeerId peer);
  // Loads a metadata blob that must name `agent`.
  Status LoadMetadata(std::span<const std::byte> md, const std::string& agent, const char* what);
  // Sends one notification (header + payload), the hello first when the peer has none yet.
  Status Notify(PeerId id, Peer& p, uint8_t kind, uint64_t tag, uint64_t total, uint64_t offset,
                std::span<const std::byte> payload);
  PeerId AddPeer(const std::string& agent, const std::string& address);
  void MarkDead(PeerId id, Status why);
  void Deliver(const std::string& agent, std::span<const std::byte> bytes);
  void OnData(PeerId from, const NixlNotif& n);
  void CompleteRecv(PendingRecv& r);
  bool PollXfers();
  void Heartbeat();
  StatusOr<std::unique_ptr<TransportOp>> Transfer(int op, PeerId peer, const void* local,
                                                  size_t bytes, MemoryKind kind,
                                                  uint64_t remote_addr,
                                                  std::span<const std::byte> rkey);
  void ReleaseXfer(Xfer& x);
  // Posts `x` as one NIXL request (its ops fail when NIXL refuses it); keeps it in xfers_.
  void PostXfer(Xfer x);
  void PostBatches();
  void FailXfer(Xfer& x, const Status& st);

  const NixlApi* const api_;
  Agent agent_ = nullptr;
  Backend backend_ = nullptr;
  NotifMap notifs_ = nullptr;
  std::string name_;
  std::string address_;
  TransportCaps caps_;
  bool device_is_host_ = true;
  milliseconds keepalive_{1000}, peer_timeout_{5000};
  Clock::time_point next_ping_{};
  std::deque<Peer> peers_;
  std::unordered_map<std::string, PeerId> by_agent_;
  std::deque<ControlMessage> control_;
  std::deque<std::unique_ptr<PendingRecv>>
      recvs_;  // posted receives and unexpected messages, in order
  std::map<std::pair<PeerId, uint64_t>, PendingRecv*>
      filling_;  // (peer, tag) -> the one being filled
  // Sends waiting for their receiver's ack, by (peer, tag), oldest first.
  std::map<std::pair<PeerId, uint64_t>, std::deque<std::shared_ptr<OpState>>> sends_;
  struct Registered {
    size_t size = 0;
    MemPlace place;
  };
  std::map<uint64_t, Registered> regs_;  // registered ranges: base -> size, place
  std::unordered_map<PeerId, std::vector<std::shared_ptr<OpState>>> puts_;  // pending, by peer
  std::map<PeerId, Xfer> batches_;  // puts not posted yet, by peer (posted by Flush or Progress)
  std::vector<Xfer> xfers_;
  std::vector<Xfer> zombies_;  // released late: NIXL refused to release them while in flight
};

}  // namespace nixl_detail
}  // namespace kvferry
