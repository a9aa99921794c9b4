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

#include "transport/nixl_transport_impl.h"

namespace kvferry {
namespace nixl_detail {

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
  // GPU memory (VRAM) through the one-sided operations, where a CUDA driver runs; tagged
  // messages carry host memory only.
  t->caps_.device_memory = t->device_is_host_ || CudaDriverPresent();
  t->caps_.device_memory_tagged = t->device_is_host_;
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
  if (kind == MemoryKind::kDevice && !caps_.device_memory) {
    return Status::Unavailable("nixl transport: GPU memory needs the CUDA driver (libcuda.so.1)");
  }
  return Status::Ok();
}

Status NixlTransport::CheckTaggedKind(MemoryKind kind) const {
  KVF_RETURN_IF_ERROR(CheckKind(kind));
  if (kind == MemoryKind::kDevice && !device_is_host_) {
    return Status::Unavailable(
        "nixl transport: tagged messages carry host memory only (their bytes travel in NIXL "
        "notifications); GPU memory moves by the one-sided operations (transfer.rma)");
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
  KVF_RETURN_IF_ERROR(CheckTaggedKind(kind));
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
  KVF_RETURN_IF_ERROR(CheckTaggedKind(kind));
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

std::string NixlTransport::DescribePeer(PeerId peer) {
  if (peer < 0 || static_cast<size_t>(peer) >= peers_.size()) return "nixl";
  return fmt::format("nixl {} via {} (NIXL {})", peers_[peer].agent,
                     Config::Global().String("nixl.backend"), api_->version);
}

}  // namespace nixl_detail

StatusOr<std::unique_ptr<Transport>> CreateNixlTransport(const TransportOptions& options) {
  return nixl_detail::NixlTransport::Create(options);
}

}  // namespace kvferry
