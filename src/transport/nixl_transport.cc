// The NIXL transport: one NIXL agent per transport, with one backend (nixl.backend, UCX by
// default, created with nixl.backend_params), driven through NIXL's C API (nixl_api.h).
//
// What goes where:
//   - Control messages and tagged data travel in NIXL notifications (nixl_capi_gen_notif; the UCX
//     backend sends them as eager active messages, in order per pair of agents). A tagged message
//     is cut into fragments of at most kNixlFragmentBytes and reassembled by the receiver, which
//     matches on (peer, tag); a send completes when the receiver's ack says a receive took it
//     (or fails when the peer is gone). Notifications are copied when posted, and the receiver
//     holds unexpected messages: unlike ucx/mpi, receiving-side staging is not bounded by the
//     sender's buffers.
//   - One-sided Put/Get are NIXL WRITE/READ transfers between registered memory; a local buffer
//     that lies in no registration of this transport is registered for the transfer and
//     deregistered when it completes. Puts to a peer gather into one NIXL request (one
//     descriptor each, up to kMaxBatch), posted by Flush(peer), by the next Progress(), or when
//     full: the transceiver puts a chunk row by row and then flushes, and a NIXL request per row
//     cost a createXferReq and an endpoint flush each (half the throughput, measured). NIXL's UCX
//     backend ends every request with an endpoint flush, so a request is complete once its
//     bytes are visible at the target; Flush(peer) completes when every Put to the peer posted
//     before it has.
//   - Addresses carry the agent's metadata (nixl_wire.h); a key carries the partial metadata of
//     its registration, loaded into this agent on first use. A blob NIXL can't parse is a clear
//     kInvalidArgument.
// Peer failure: a destroyed transport says "bye" to every peer it loaded. A crashed one is noticed
// by silence: every transport pings the peers it loaded every nixl.keepalive_ms, and a peer that
// sent something before but nothing for nixl.peer_timeout_ms is dead (its pending ops fail with
// kUnavailable). NIXL has no per-transfer timeout: a transfer to a dead peer is failed by kvferry
// when the peer is found dead, whatever NIXL says of it.
// No wakeup fd: NIXL offers none; progress threads poll (WakeupFd() is -1, as for mpi).
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
namespace {

using std::chrono::milliseconds;

// The most puts one NIXL request carries.
constexpr size_t kMaxBatch = 1024;

// A malloc'd blob from NIXL.
struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
using Blob = std::unique_ptr<void, FreeDeleter>;

std::span<const std::byte> AsBytes(const void* p, size_t n) {
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

void Finish(OpState& s, Status st) {
  if (s.done) return;
  s.done = true;
  s.status = std::move(st);
}

std::unique_ptr<TransportOp> DoneOp(PeerId peer, size_t bytes, Status st) {
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

// One NIXL transfer: the puts (or the get) it carries, posted as one request.
struct Xfer {
  PeerId peer = kAnyPeer;
  int op = kOpWrite;
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
  Status CheckKind(MemoryKind kind) const;
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
  std::map<uint64_t, size_t> regs_;  // registered ranges: base -> size
  std::unordered_map<PeerId, std::vector<std::shared_ptr<OpState>>> puts_;  // pending, by peer
  std::map<PeerId, Xfer> batches_;  // puts not posted yet, by peer (posted by Flush or Progress)
  std::vector<Xfer> xfers_;
  std::vector<Xfer> zombies_;  // released late: NIXL refused to release them while in flight
};

NixlRegistration::~NixlRegistration() {
  t_->Deregister(dlist_, addr_);
  std::free(owned_);
}

StatusOr<std::unique_ptr<Transport>> NixlTransport::Create(const TransportOptions& options) {
  KVF_ASSIGN_OR_RETURN(const NixlApi* api, LoadNixl());
  std::unique_ptr<NixlTransport> t(new NixlTransport(api));
  t->device_is_host_ = options.device_memory_is_host;
  t->keepalive_ = milliseconds(Config::Global().Int("nixl.keepalive_ms"));
  t->peer_timeout_ = milliseconds(Config::Global().Int("nixl.peer_timeout_ms"));
  std::random_device rd;
  t->name_ = fmt::format("kvferry-{}-{:08x}{:08x}", getpid(), rd(), rd());
  // No progress thread: the owner's Progress() drives NIXL (getNotifs and getXferStatus progress
  // the backend's workers), one thread at a time, so NIXL needs no locks either.
  CapiAgentConfig cfg{};
  cfg.enable_prog_thread = false;
  cfg.enable_listen_thread = false;
  cfg.thread_sync = kSyncNone;
  cfg.num_workers = 1;
  Agent agent = nullptr;
  KVF_RETURN_IF_ERROR(FromCapi(api->create_configured_agent(t->name_.c_str(), &cfg, &agent),
                               "nixl_capi_create_configured_agent"));
  t->agent_ = agent;
  const std::string backend = Config::Global().String("nixl.backend");
  Params params = nullptr;
  KVF_RETURN_IF_ERROR(FromCapi(api->create_params(&params), "nixl_capi_create_params"));
  Status st;
  const std::string list = Config::Global().String("nixl.backend_params");
  for (size_t at = 0; st.ok() && at < list.size();) {
    size_t end = list.find(',', at);
    if (end == std::string::npos) end = list.size();
    const std::string kv = list.substr(at, end - at);
    const size_t eq = kv.find('=');
    if (eq == std::string::npos || eq == 0) {
      st = Status::InvalidArgument(fmt::format("nixl.backend_params: '{}' is not KEY=VALUE", kv));
    } else {
      st = FromCapi(api->params_add(params, kv.substr(0, eq).c_str(), kv.substr(eq + 1).c_str()),
                    "nixl_capi_params_add");
    }
    at = end + 1;
  }
  Backend b = nullptr;
  if (st.ok()) {
    const int rc = api->create_backend(agent, backend.c_str(), params, &b);
    if (rc != kCapiSuccess) {
      st = Status::Unavailable(fmt::format(
          "NIXL {} at {}: backend '{}' did not start (nixl.backend, nixl.backend_params='{}'; "
          "NIXL logs why on stderr)",
          api->version, api->library_path, backend, list));
    }
  }
  api->destroy_params(params);
  KVF_RETURN_IF_ERROR(st);
  t->backend_ = b;
  KVF_RETURN_IF_ERROR(FromCapi(api->create_notif_map(&t->notifs_), "nixl_capi_create_notif_map"));
  void* md = nullptr;
  size_t md_len = 0;
  KVF_RETURN_IF_ERROR(FromCapi(api->get_local_md(agent, &md, &md_len), "nixl_capi_get_local_md"));
  Blob owned(md);
  NixlAddress a{t->name_, {}};
  auto bytes = AsBytes(md, md_len);
  a.metadata.assign(bytes.begin(), bytes.end());
  t->address_ = EncodeNixlAddress(a);

  t->caps_.name = "nixl";
  t->caps_.tag_bits = 64;
  t->caps_.device_memory = t->device_is_host_;  // GPU memory (VRAM): not wired up yet
  t->caps_.one_sided = true;
  t->caps_.detects_crashed_peers = true;  // by silence (nixl.peer_timeout_ms)
  t->caps_.max_control_bytes = size_t{1} << 20;
  Log(LogLevel::kDebug, "nixl transport up: agent {}, backend {}, NIXL {} ({})", t->name_, backend,
      api->version, api->library_path);
  return std::unique_ptr<Transport>(std::move(t));
}

NixlTransport::~NixlTransport() {
  if (agent_ == nullptr) return;
  for (size_t i = 0; i < peers_.size(); ++i) {
    Peer& p = peers_[i];
    if (p.dead || !p.loaded) continue;
    (void)Notify(static_cast<PeerId>(i), p, kBye, 0, 0, 0, {});
  }
  // The byes are eager sends: a few rounds of progress push them out.
  for (int i = 0; i < 8; ++i) {
    api_->get_notifs(agent_, notifs_, nullptr);
    api_->notif_map_clear(notifs_);
  }
  for (auto& [peer, b] : batches_) FailXfer(b, Status::Cancelled("nixl transport destroyed"));
  for (Xfer& x : xfers_) {
    for (auto& s : x.ops) Finish(*s, Status::Cancelled("nixl transport destroyed"));
    ReleaseXfer(x);
  }
  for (Xfer& x : zombies_) ReleaseXfer(x);
  for (auto& r : recvs_) {
    if (r->op) Finish(*r->op, Status::Cancelled("nixl transport destroyed"));
  }
  for (auto& [peer, puts] : puts_) {
    for (auto& s : puts) Finish(*s, Status::Cancelled("nixl transport destroyed"));
  }
  for (auto& [key, sends] : sends_) {
    for (auto& s : sends) Finish(*s, Status::Cancelled("nixl transport destroyed"));
  }
  if (notifs_) api_->destroy_notif_map(notifs_);
  if (backend_) api_->destroy_backend(backend_);  // the handle only; the agent owns the backend
  api_->destroy_agent(agent_);
}

Status NixlTransport::CheckKind(MemoryKind kind) const {
  if (kind == MemoryKind::kFile) {
    return Status::InvalidArgument("nixl transport: file memory can't be sent");
  }
  if (kind == MemoryKind::kDevice && !device_is_host_) {
    return Status::Unavailable("nixl transport: GPU memory (VRAM) is not supported yet");
  }
  return Status::Ok();
}

Status NixlTransport::CheckPeer(PeerId peer) const {
  if (peer < 0 || static_cast<size_t>(peer) >= peers_.size()) {
    return Status::InvalidArgument(fmt::format("nixl transport: no peer {}", peer));
  }
  return Status::Ok();
}

StatusOr<Peer*> NixlTransport::LivePeer(PeerId peer) {
  KVF_RETURN_IF_ERROR(CheckPeer(peer));
  Peer& p = peers_[peer];
  if (p.dead) return p.death;
  return &p;
}

Status NixlTransport::LoadMetadata(std::span<const std::byte> md, const std::string& agent,
                                   const char* what) {
  // NIXL's metadata is a serialized record that opens with this tag: without it, the blob is
  // not NIXL metadata at all (and NIXL is not asked to parse it).
  static constexpr std::string_view kSerDesTag = "nixlSerDes|";
  if (md.size() < kSerDesTag.size() ||
      std::memcmp(md.data(), kSerDesTag.data(), kSerDesTag.size()) != 0) {
    return Status::InvalidArgument(
        fmt::format("nixl transport: {} of agent '{}' is not NIXL metadata (no '{}' record)", what,
                    agent, kSerDesTag.substr(0, kSerDesTag.size() - 1)));
  }
  char* name = nullptr;
  const int rc = api_->load_remote_md(agent_, md.data(), md.size(), &name);
  if (rc != kCapiSuccess) {
    // A record that failed half way may have left the agent half known to NIXL (a later load of
    // its good metadata would then be refused): forget it. (A loaded peer's name never reaches
    // here: Connect finds it first.)
    (void)api_->invalidate_remote_md(agent_, agent.c_str());
    // The C API says "backend error" both for a record that does not parse and for an agent
    // that can't be reached (a crashed peer): NIXL's log says which.
    return Status::Unavailable(fmt::format(
        "nixl transport: {} of agent '{}' does not load: the agent is unreachable (gone?) or "
        "the metadata is damaged (nixl_capi_load_remote_md: {}; NIXL logs which)",
        what, agent, rc));
  }
  std::string got = name ? name : "";
  std::free(name);
  if (got != agent) {
    (void)api_->invalidate_remote_md(agent_, got.c_str());
    return Status::InvalidArgument(fmt::format(
        "nixl transport: {} names agent '{}', not '{}' (another instance's)", what, got, agent));
  }
  return Status::Ok();
}

StatusOr<Peer*> NixlTransport::ReadyPeer(PeerId peer) {
  KVF_ASSIGN_OR_RETURN(Peer * p, LivePeer(peer));
  if (p->loaded) return p;
  auto a = DecodeNixlAddress(p->address);
  Status st =
      a.ok() ? LoadMetadata(a->metadata, p->agent, "the metadata in its hello") : a.status();
  if (!st.ok()) {
    MarkDead(peer, st);
    return st;
  }
  p->loaded = true;
  return p;
}

PeerId NixlTransport::AddPeer(const std::string& agent, const std::string& address) {
  const PeerId id = static_cast<PeerId>(peers_.size());
  Peer& p = peers_.emplace_back();
  p.agent = agent;
  p.address = address;
  p.last_heard = Clock::now();
  by_agent_[agent] = id;
  return id;
}

StatusOr<PeerId> NixlTransport::Connect(std::string_view address, Deadline) {
  KVF_ASSIGN_OR_RETURN(NixlAddress a, DecodeNixlAddress(address));
  if (auto it = by_agent_.find(a.agent); it != by_agent_.end()) {
    Peer& p = peers_[it->second];
    if (p.dead) return p.death;
    if (!p.loaded) {
      if (p.address != address) p.address = std::string(address);
      KVF_RETURN_IF_ERROR(ReadyPeer(it->second).status());
    }
    return it->second;
  }
  if (a.agent == name_) return Status::InvalidArgument("nixl transport: that is this transport");
  KVF_RETURN_IF_ERROR(LoadMetadata(a.metadata, a.agent, "the metadata in its address"));
  const PeerId id = AddPeer(a.agent, std::string(address));
  peers_[id].loaded = true;
  return id;
}

Status NixlTransport::Notify(PeerId id, Peer& p, uint8_t kind, uint64_t tag, uint64_t total,
                             uint64_t offset, std::span<const std::byte> payload) {
  std::vector<std::byte> msg =
      NixlNotifHeader(kind, p.hello_sent ? std::string_view() : address_, tag, total, offset);
  msg.insert(msg.end(), payload.begin(), payload.end());
  const int rc = api_->gen_notif(agent_, p.agent.c_str(), msg.data(), msg.size(), nullptr);
  if (rc != kCapiSuccess) {
    Status st = Status::Unavailable(
        fmt::format("nixl transport: notification to agent '{}' failed ({})", p.agent, rc));
    MarkDead(id, st);
    return st;
  }
  p.hello_sent = true;
  return Status::Ok();
}

StatusOr<std::unique_ptr<TransportOp>> NixlTransport::Send(PeerId peer, uint64_t tag,
                                                           const void* buf, size_t bytes,
                                                           MemoryKind kind) {
  KVF_RETURN_IF_ERROR(CheckKind(kind));
  KVF_RETURN_IF_ERROR(CheckPeer(peer));
  auto p = ReadyPeer(peer);
  if (!p.ok()) return DoneOp(peer, bytes, p.status());
  const auto* src = static_cast<const std::byte*>(buf);
  size_t off = 0;
  do {
    const size_t n = std::min(kNixlFragmentBytes, bytes - off);
    Status st = Notify(peer, **p, kData, tag, bytes, off, {src + off, n});
    if (!st.ok()) return DoneOp(peer, bytes, st);
    off += n;
  } while (off < bytes);
  auto s = std::make_shared<OpState>();
  s->peer = peer;
  s->bytes = bytes;
  sends_[{peer, tag}].push_back(s);
  return std::unique_ptr<TransportOp>(new NixlOp(std::move(s)));
}

StatusOr<std::unique_ptr<TransportOp>> NixlTransport::Recv(PeerId peer, uint64_t tag, void* buf,
                                                           size_t capacity, MemoryKind kind) {
  KVF_RETURN_IF_ERROR(CheckKind(kind));
  if (peer != kAnyPeer) {
    KVF_RETURN_IF_ERROR(CheckPeer(peer));
    if (auto p = LivePeer(peer); !p.ok()) return DoneOp(peer, 0, p.status());
  }
  auto s = std::make_shared<OpState>();
  s->peer = peer;
  // An unexpected message (held, complete or still arriving) with that tag, first come first.
  for (auto it = recvs_.begin(); it != recvs_.end(); ++it) {
    PendingRecv& r = **it;
    if (r.op || r.tag != tag || (peer != kAnyPeer && r.peer != peer)) continue;
    r.op = s;
    r.buf = static_cast<std::byte*>(buf);
    r.capacity = capacity;
    r.matched = true;
    if (r.received == r.total && !filling_.count({r.peer, r.tag})) {
      CompleteRecv(r);
      recvs_.erase(it);
    }
    return std::unique_ptr<TransportOp>(new NixlOp(std::move(s)));
  }
  auto r = std::make_unique<PendingRecv>();
  r->op = s;
  r->peer = peer;
  r->tag = tag;
  r->buf = static_cast<std::byte*>(buf);
  r->capacity = capacity;
  recvs_.push_back(std::move(r));
  return std::unique_ptr<TransportOp>(new NixlOp(std::move(s)));
}

void NixlTransport::CompleteRecv(PendingRecv& r) {
  if (r.total > r.capacity) {
    r.truncated = true;
  } else if (!r.held.empty()) {
    std::memcpy(r.buf, r.held.data(), r.total);
  }
  r.op->bytes = r.truncated ? 0 : r.total;
  Finish(*r.op, r.truncated ? Status::InvalidArgument(fmt::format(
                                  "nixl transport: a {}-byte message for a {}-byte receive "
                                  "(tag {})",
                                  r.total, r.capacity, r.tag))
                            : Status::Ok());
  // The sender's op completes with this ack (a sender that died meanwhile needs none).
  if (auto p = ReadyPeer(r.peer); p.ok()) (void)Notify(r.peer, **p, kAck, r.tag, 0, 0, {});
}

void NixlTransport::Cancel(TransportOp& op) {
  auto* s = static_cast<NixlOp&>(op).state();
  if (s->done) return;
  for (auto it = recvs_.begin(); it != recvs_.end(); ++it) {
    if ((*it)->op.get() == s && !(*it)->matched) {
      Finish(*s, Status::Cancelled("receive cancelled"));
      recvs_.erase(it);
      return;
    }
  }
}

Status NixlTransport::SendControl(PeerId peer, std::span<const std::byte> bytes) {
  if (bytes.size() > caps_.max_control_bytes) {
    return Status::InvalidArgument(fmt::format("control message of {} bytes (at most {})",
                                               bytes.size(), caps_.max_control_bytes));
  }
  KVF_ASSIGN_OR_RETURN(Peer * p, ReadyPeer(peer));
  return Notify(peer, *p, kControl, 0, 0, 0, bytes);
}

std::optional<ControlMessage> NixlTransport::PollControl() {
  if (control_.empty()) Progress();
  if (control_.empty()) return std::nullopt;
  ControlMessage m = std::move(control_.front());
  control_.pop_front();
  return m;
}

void NixlTransport::MarkDead(PeerId id, Status why) {
  Peer& p = peers_[id];
  if (p.dead) return;
  p.dead = true;
  p.death = Status::Unavailable(
      fmt::format("nixl peer {} (agent {}) is gone: {}", id, p.agent, why.message()));
  Log(LogLevel::kDebug, "{}", p.death.ToString());
  for (auto it = recvs_.begin(); it != recvs_.end();) {
    PendingRecv& r = **it;
    if (r.peer == id && (r.op == nullptr || !r.op->done)) {
      if (r.op) Finish(*r.op, p.death);
      filling_.erase({r.peer, r.tag});
      it = recvs_.erase(it);
    } else {
      ++it;
    }
  }
  if (auto b = batches_.find(id); b != batches_.end()) {
    FailXfer(b->second, p.death);
    batches_.erase(b);
  }
  for (Xfer& x : xfers_) {
    if (x.peer != id) continue;
    for (auto& s : x.ops) Finish(*s, p.death);
  }
  for (auto it = sends_.lower_bound({id, 0}); it != sends_.end() && it->first.first == id;) {
    for (auto& s : it->second) Finish(*s, p.death);
    it = sends_.erase(it);
  }
  if (auto it = puts_.find(id); it != puts_.end()) {
    for (auto& s : it->second) Finish(*s, p.death);
  }
}

void NixlTransport::Deliver(const std::string& agent, std::span<const std::byte> bytes) {
  auto n = DecodeNixlNotif(bytes);
  if (!n.ok()) {
    Log(LogLevel::kWarn, "nixl transport: dropped a notification from '{}': {}", agent,
        n.status().ToString());
    return;
  }
  PeerId from = kAnyPeer;
  if (auto it = by_agent_.find(agent); it != by_agent_.end()) {
    from = it->second;
  } else if (!n->hello_address.empty()) {
    auto a = DecodeNixlAddress(n->hello_address);
    if (!a.ok() || a->agent != agent) {
      Log(LogLevel::kWarn, "nixl transport: dropped a hello from '{}': {}", agent,
          a.ok() ? "its address names agent '" + a->agent + "'" : a.status().ToString());
      return;
    }
    from = AddPeer(agent, n->hello_address);
  } else {
    Log(LogLevel::kWarn, "nixl transport: dropped a notification from unknown agent '{}'", agent);
    return;
  }
  Peer& p = peers_[from];
  if (p.dead) return;
  p.heard = true;
  p.last_heard = Clock::now();
  switch (n->kind) {
    case kControl:
      control_.push_back({from, {n->payload.begin(), n->payload.end()}});
      break;
    case kBye:
      MarkDead(from, Status::Unavailable("it shut down"));
      break;
    case kPing:
      break;
    case kAck:
      if (auto it = sends_.find({from, n->tag}); it != sends_.end()) {
        Finish(*it->second.front(), Status::Ok());
        it->second.pop_front();
        if (it->second.empty()) sends_.erase(it);
      }
      break;
    case kData:
      OnData(from, *n);
      break;
  }
}

void NixlTransport::OnData(PeerId from, const NixlNotif& n) {
  PendingRecv* r = nullptr;
  auto key = std::make_pair(from, n.tag);
  if (auto it = filling_.find(key); it != filling_.end()) {
    r = it->second;
  } else {
    for (auto& c : recvs_) {
      if (c->op && !c->matched && c->tag == n.tag && (c->peer == kAnyPeer || c->peer == from)) {
        r = c.get();
        break;
      }
    }
    if (r == nullptr) {  // unexpected: held until a receive comes
      recvs_.push_back(std::make_unique<PendingRecv>());
      r = recvs_.back().get();
      r->held.resize(n.total);
    }
    r->peer = from;
    r->tag = n.tag;
    r->matched = r->op != nullptr;
    r->total = n.total;
    r->received = 0;
    r->truncated = r->op && n.total > r->capacity;
    filling_[key] = r;
  }
  if (n.offset != r->received || n.total != r->total) {
    Log(LogLevel::kWarn, "nixl transport: fragment out of order from peer {} (tag {})", from,
        n.tag);
    return;
  }
  if (!r->truncated) {
    std::byte* dst = r->held.empty() && r->op ? r->buf : r->held.data();
    if (!n.payload.empty()) std::memcpy(dst + n.offset, n.payload.data(), n.payload.size());
  }
  r->received += n.payload.size();
  if (r->received < r->total) return;
  filling_.erase(key);
  if (r->op == nullptr) return;  // held, complete
  CompleteRecv(*r);
  for (auto it = recvs_.begin(); it != recvs_.end(); ++it) {
    if (it->get() == r) {
      recvs_.erase(it);
      break;
    }
  }
}

void NixlTransport::ReleaseXfer(Xfer& x) {
  if (x.req) {
    if (api_->release_xfer_req(agent_, x.req) == kCapiSuccess) {
      api_->destroy_xfer_req(x.req);
      x.req = nullptr;
    }
  }
  if (x.req == nullptr) {
    for (RegDlist t : x.temps) {
      api_->deregister_mem(agent_, t, nullptr);
      api_->destroy_reg_dlist(t);
    }
    x.temps.clear();
  }
}

void NixlTransport::FailXfer(Xfer& x, const Status& st) {
  for (auto& s : x.ops) Finish(*s, st);
  ReleaseXfer(x);
}

void NixlTransport::PostXfer(Xfer x) {
  XferDlist l = nullptr, r = nullptr;
  Status st = FromCapi(api_->create_xfer_dlist(kMemDram, &l), "nixl_capi_create_xfer_dlist");
  if (st.ok()) st = FromCapi(api_->create_xfer_dlist(kMemDram, &r), "nixl_capi_create_xfer_dlist");
  for (size_t i = 0; st.ok() && i < x.sizes.size(); ++i) {
    st = FromCapi(api_->xfer_dlist_add_desc(l, x.local[i], x.sizes[i], 0), "xfer_dlist_add_desc");
    if (st.ok()) {
      st =
          FromCapi(api_->xfer_dlist_add_desc(r, x.remote[i], x.sizes[i], 0), "xfer_dlist_add_desc");
    }
  }
  if (st.ok()) {
    const int rc =
        api_->create_xfer_req(agent_, x.op, l, r, peers_[x.peer].agent.c_str(), &x.req, nullptr);
    if (rc != kCapiSuccess) {
      x.req = nullptr;
      st = Status::InvalidArgument(fmt::format(
          "nixl_capi_create_xfer_req ({} descriptors to peer {}): NIXL refused the transfer ({}): "
          "a range outside the registrations it knows (NIXL logs why)",
          x.sizes.size(), x.peer, rc));
    }
  }
  if (l) api_->destroy_xfer_dlist(l);
  if (r) api_->destroy_xfer_dlist(r);
  if (st.ok()) {
    const int rc = api_->post_xfer_req(agent_, x.req, nullptr);
    if (rc == kCapiSuccess) {
      for (auto& s : x.ops) Finish(*s, Status::Ok());
    } else if (rc != kCapiInProg) {
      st = Status::Unavailable(
          fmt::format("nixl_capi_post_xfer_req to peer {} failed ({})", x.peer, rc));
    }
  }
  if (!st.ok())
    for (auto& s : x.ops) Finish(*s, st);
  x.local.clear();
  x.remote.clear();
  x.sizes.clear();
  xfers_.push_back(std::move(x));  // released by PollXfers
}

void NixlTransport::PostBatches() {
  for (auto& [peer, b] : batches_) PostXfer(std::move(b));
  batches_.clear();
}

bool NixlTransport::PollXfers() {
  bool any = false;
  for (size_t i = 0; i < xfers_.size();) {
    Xfer& x = xfers_[i];
    bool all_done = true;
    for (const auto& s : x.ops) all_done &= s->done;
    const int rc =
        all_done || x.req == nullptr ? kCapiSuccess : api_->get_xfer_status(agent_, x.req);
    if (rc == kCapiInProg) {
      ++i;
      continue;
    }
    any = true;
    for (auto& s : x.ops) {
      Finish(*s, rc == kCapiSuccess
                     ? Status::Ok()
                     : Status::Unavailable(fmt::format(
                           "nixl transport: transfer to peer {} failed ({})", x.peer, rc)));
    }
    ReleaseXfer(x);
    if (x.req) zombies_.push_back(std::move(x));
    xfers_[i] = std::move(xfers_.back());
    xfers_.pop_back();
  }
  for (size_t i = 0; i < zombies_.size();) {
    ReleaseXfer(zombies_[i]);
    if (zombies_[i].req == nullptr) {
      zombies_[i] = std::move(zombies_.back());
      zombies_.pop_back();
    } else {
      ++i;
    }
  }
  for (auto& [peer, puts] : puts_) {
    std::erase_if(puts, [](const auto& s) { return s->done; });
  }
  return any;
}

void NixlTransport::Heartbeat() {
  const auto now = Clock::now();
  if (now < next_ping_) return;
  next_ping_ = now + keepalive_;
  for (size_t i = 0; i < peers_.size(); ++i) {
    Peer& p = peers_[i];
    if (p.dead) continue;
    if (p.heard && now - p.last_heard > peer_timeout_) {
      MarkDead(static_cast<PeerId>(i),
               Status::Unavailable(fmt::format(
                   "silent for {} ms (nixl.peer_timeout_ms)",
                   std::chrono::duration_cast<milliseconds>(now - p.last_heard).count())));
      continue;
    }
    if (p.loaded) (void)Notify(static_cast<PeerId>(i), p, kPing, 0, 0, 0, {});
  }
}

bool NixlTransport::Progress() {
  bool any = false;
  const int rc = api_->get_notifs(agent_, notifs_, nullptr);
  if (rc == kCapiSuccess) {
    size_t agents = 0;
    api_->notif_map_size(notifs_, &agents);
    for (size_t i = 0; i < agents; ++i) {
      const char* name = nullptr;
      size_t count = 0;
      if (api_->notif_map_get_agent_at(notifs_, i, &name) != kCapiSuccess || name == nullptr)
        continue;
      const std::string agent = name;
      api_->notif_map_get_notifs_size(notifs_, name, &count);
      for (size_t j = 0; j < count; ++j) {
        const void* data = nullptr;
        size_t len = 0;
        if (api_->notif_map_get_notif(notifs_, agent.c_str(), j, &data, &len) == kCapiSuccess) {
          Deliver(agent, AsBytes(data, len));
          any = true;
        }
      }
    }
    api_->notif_map_clear(notifs_);
  }
  PostBatches();
  any |= PollXfers();
  Heartbeat();
  return any;
}

StatusOr<std::unique_ptr<MemoryRegistration>> NixlTransport::RegisterMemory(void* ptr, size_t bytes,
                                                                            MemoryKind kind) {
  KVF_RETURN_IF_ERROR(CheckKind(kind));
  if (bytes == 0) return Status::InvalidArgument("nixl transport: registering 0 bytes");
  void* owned = nullptr;
  if (ptr == nullptr) {
    if (posix_memalign(&owned, 4096, bytes) != 0) {
      return Status::ResourceExhausted(fmt::format("nixl transport: {} bytes", bytes));
    }
    ptr = owned;
  }
  RegDlist dl = nullptr;
  Status st = FromCapi(api_->create_reg_dlist(kMemDram, &dl), "nixl_capi_create_reg_dlist");
  if (st.ok()) {
    st = FromCapi(
        api_->reg_dlist_add_desc(dl, reinterpret_cast<uintptr_t>(ptr), bytes, 0, nullptr, 0),
        "nixl_capi_reg_dlist_add_desc");
  }
  if (st.ok()) st = FromCapi(api_->register_mem(agent_, dl, nullptr), "nixl_capi_register_mem");
  void* md = nullptr;
  size_t md_len = 0;
  if (st.ok()) {
    st = FromCapi(api_->get_local_partial_md(agent_, dl, &md, &md_len, nullptr),
                  "nixl_capi_get_local_partial_md");
    if (!st.ok()) api_->deregister_mem(agent_, dl, nullptr);
  }
  if (!st.ok()) {
    if (dl) api_->destroy_reg_dlist(dl);
    std::free(owned);
    return st.WithContext("nixl transport: registering memory");
  }
  Blob md_owner(md);
  NixlKey k{name_, reinterpret_cast<uint64_t>(ptr), bytes, {}};
  auto b = AsBytes(md, md_len);
  k.metadata.assign(b.begin(), b.end());
  regs_[k.base] = bytes;
  return std::unique_ptr<MemoryRegistration>(
      new NixlRegistration(this, dl, owned, k.base, bytes, EncodeNixlKey(k)));
}

void NixlTransport::Deregister(RegDlist dlist, uint64_t addr) {
  regs_.erase(addr);
  api_->deregister_mem(agent_, dlist, nullptr);
  api_->destroy_reg_dlist(dlist);
}

StatusOr<std::unique_ptr<TransportOp>> NixlTransport::Transfer(int op, PeerId peer,
                                                               const void* local, size_t bytes,
                                                               MemoryKind kind,
                                                               uint64_t remote_addr,
                                                               std::span<const std::byte> rkey) {
  KVF_RETURN_IF_ERROR(CheckKind(kind));
  KVF_ASSIGN_OR_RETURN(NixlKey key, DecodeNixlKey(rkey));
  if (remote_addr < key.base || bytes > key.size || remote_addr - key.base > key.size - bytes) {
    return Status::InvalidArgument(
        fmt::format("nixl transport: {} bytes at {:#x} lie outside the registration [{:#x}, +{})",
                    bytes, remote_addr, key.base, key.size));
  }
  KVF_RETURN_IF_ERROR(CheckPeer(peer));
  auto p = ReadyPeer(peer);
  if (!p.ok()) return DoneOp(peer, bytes, p.status());
  if (key.agent != (*p)->agent) {
    return Status::InvalidArgument(
        fmt::format("nixl transport: a key of agent '{}' used for peer {} (agent '{}')", key.agent,
                    peer, (*p)->agent));
  }
  if (bytes == 0) return DoneOp(peer, 0, Status::Ok());
  const std::string key_bytes(reinterpret_cast<const char*>(rkey.data()), rkey.size());
  if (!(*p)->keys.count(key_bytes)) {
    KVF_RETURN_IF_ERROR(LoadMetadata(key.metadata, key.agent, "the metadata in a key"));
    (*p)->keys.insert(key_bytes);
  }
  const auto addr = reinterpret_cast<uint64_t>(local);
  auto reg = regs_.upper_bound(addr);
  const bool registered =
      reg != regs_.begin() &&
      (--reg, addr - reg->first <= reg->second && bytes <= reg->second - (addr - reg->first));
  RegDlist temp = nullptr;
  if (!registered) {
    Status st = FromCapi(api_->create_reg_dlist(kMemDram, &temp), "nixl_capi_create_reg_dlist");
    if (st.ok()) {
      st = FromCapi(api_->reg_dlist_add_desc(temp, addr, bytes, 0, nullptr, 0),
                    "nixl_capi_reg_dlist_add_desc");
    }
    if (st.ok()) st = FromCapi(api_->register_mem(agent_, temp, nullptr), "register_mem");
    if (!st.ok()) {
      if (temp) api_->destroy_reg_dlist(temp);
      return st.WithContext(op == kOpWrite ? "nixl transport: put" : "nixl transport: get");
    }
  }
  auto s = std::make_shared<OpState>();
  s->peer = peer;
  s->bytes = bytes;
  // Puts to a peer gather into one request (one NIXL transfer, one endpoint flush), posted by
  // Flush, by the next Progress, or when it is large; a get goes at once.
  Xfer one;
  Xfer& x = op == kOpWrite ? batches_[peer] : one;
  x.peer = peer;
  x.op = op;
  x.ops.push_back(s);
  x.local.push_back(addr);
  x.remote.push_back(remote_addr);
  x.sizes.push_back(bytes);
  if (temp) x.temps.push_back(temp);
  if (op == kOpWrite) {
    puts_[peer].push_back(s);
    if (x.sizes.size() >= kMaxBatch) {
      PostXfer(std::move(x));
      batches_.erase(peer);
    }
  } else {
    PostXfer(std::move(one));
  }
  return std::unique_ptr<TransportOp>(new NixlOp(std::move(s)));
}

StatusOr<std::unique_ptr<TransportOp>> NixlTransport::Put(PeerId peer, const void* local,
                                                          size_t bytes, MemoryKind kind,
                                                          uint64_t remote_addr,
                                                          std::span<const std::byte> rkey) {
  return Transfer(kOpWrite, peer, local, bytes, kind, remote_addr, rkey);
}

StatusOr<std::unique_ptr<TransportOp>> NixlTransport::Get(PeerId peer, void* local, size_t bytes,
                                                          MemoryKind kind, uint64_t remote_addr,
                                                          std::span<const std::byte> rkey) {
  return Transfer(kOpRead, peer, local, bytes, kind, remote_addr, rkey);
}

// A flush: done when every put it waits for is.
class FlushOp final : public TransportOp {
 public:
  FlushOp(std::vector<std::shared_ptr<OpState>> puts) : puts_(std::move(puts)) {}
  bool Done() const override {
    for (const auto& s : puts_) {
      if (!s->done) return false;
    }
    return true;
  }
  Status status() const override {
    for (const auto& s : puts_) {
      if (s->done && !s->status.ok()) return s->status;
    }
    return Status::Ok();
  }
  size_t bytes() const override { return 0; }

 private:
  std::vector<std::shared_ptr<OpState>> puts_;
};

StatusOr<std::unique_ptr<TransportOp>> NixlTransport::Flush(PeerId peer) {
  KVF_RETURN_IF_ERROR(CheckPeer(peer));
  if (auto p = LivePeer(peer); !p.ok()) return DoneOp(peer, 0, p.status());
  if (auto b = batches_.find(peer); b != batches_.end()) {
    PostXfer(std::move(b->second));
    batches_.erase(b);
  }
  std::vector<std::shared_ptr<OpState>> pending;
  if (auto it = puts_.find(peer); it != puts_.end()) pending = it->second;
  return std::unique_ptr<TransportOp>(new FlushOp(std::move(pending)));
}

std::string NixlTransport::DescribePeer(PeerId peer) {
  if (peer < 0 || static_cast<size_t>(peer) >= peers_.size()) return "nixl";
  return fmt::format("nixl {} via {} (NIXL {})", peers_[peer].agent,
                     Config::Global().String("nixl.backend"), api_->version);
}

}  // namespace
}  // namespace nixl_detail

StatusOr<std::unique_ptr<Transport>> CreateNixlTransport(const TransportOptions& options) {
  return nixl_detail::NixlTransport::Create(options);
}

}  // namespace kvferry
