// The UCX transport. One ucp_context (TAG | RMA), one single-threaded worker, one endpoint per
// peer, with error handling mode PEER (ucx.error_mode=peer, the default) so a dead peer fails
// operations instead of hanging them; ucx.error_mode=none trades that for shared memory.
//
// Tags: bit 63 set = control message, its low 63 bits the sender's random instance id; bit 63
// clear = data (caps().tag_bits = 63), matched with a full 64-bit mask.
//
// Control payload, byte by byte (version 1):
//   byte 0: kind  (0 = data, 1 = hello + data, 2 = bye)
//   kind 1: bytes 1..4 address length L (little-endian u32), then L bytes of the sender's
//           LocalAddress() text, so the receiver can connect back; then the data.
//   kind 2: like kind 1 without data (the receiver looks the sender up, never connects back).
//   kind 0: the data follows byte 0.
// The first control message to a peer is a hello; a transport being destroyed sends bye to every
// live peer, which fails that peer's pending ops at the receiver with kUnavailable at once.
//
// Address text: see ucx_address.h.
#include <ucp/api/ucp.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <random>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "base/log.h"
#include "kvferry/config.h"
#include "transport/transport.h"
#include "transport/ucx_address.h"
#include "transport/ucx_util.h"

namespace kvferry {
namespace {

constexpr uint64_t kCtrlBit = uint64_t{1} << 63;
constexpr uint8_t kKindData = 0, kKindHello = 1, kKindBye = 2;

using ucx_detail::ConfigPtr;
using ucx_detail::ContextPtr;
using ucx_detail::FromUcs;
using ucx_detail::RkeyPtr;
using ucx_detail::UcxRegistration;
using ucx_detail::WorkerPtr;

// ---- ops ----------------------------------------------------------------------------------------

class UcxTransport;

struct OpState {
  UcxTransport* owner = nullptr;
  PeerId peer = kAnyPeer;
  bool is_recv = false;
  bool done = false;
  Status status;
  size_t bytes = 0;
  void* request = nullptr;         // the UCX request while pending
  Status forced;                   // when not OK: the status to report instead of UCX's
  std::vector<std::byte> payload;  // control sends/receives own their bytes
  uint64_t sender_tag = 0;         // control receives
};

class UcxOp final : public TransportOp {
 public:
  explicit UcxOp(std::shared_ptr<OpState> s) : s_(std::move(s)) {}
  bool Done() const override { return s_->done; }
  Status status() const override { return s_->status; }
  size_t bytes() const override { return s_->bytes; }
  OpState& state() const { return *s_; }

 private:
  std::shared_ptr<OpState> s_;
};

struct Peer {
  ucp_ep_h ep = nullptr;
  std::string address;
  bool dead = false;
  Status death;
  bool hello_sent = false;
  std::unordered_set<OpState*> recvs;  // pending receives naming this peer
  std::unordered_map<std::string, RkeyPtr> rkeys;
};

struct EpErrorArg {
  UcxTransport* transport;
  PeerId peer;
};

// ---- the transport ------------------------------------------------------------------------------

class UcxTransport final : public Transport {
 public:
  static StatusOr<std::unique_ptr<Transport>> Create(const TransportOptions& options);
  ~UcxTransport() override;

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
  StatusOr<std::unique_ptr<TransportOp>> Flush(PeerId peer) override;

  // Called by UCX.
  static void OnSend(void* request, ucs_status_t status, void* user_data);
  static void OnRecv(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info,
                     void* user_data);
  static void OnEpError(void* arg, ucp_ep_h ep, ucs_status_t status);

 private:
  UcxTransport() = default;
  void Finish(OpState* s, void* request, ucs_status_t status, size_t bytes);
  std::shared_ptr<OpState> NewOp(PeerId peer, bool is_recv);
  // Turns the result of an nbx call into an op; `s` was made by NewOp.
  std::unique_ptr<TransportOp> Posted(std::shared_ptr<OpState> s, ucs_status_ptr_t ret,
                                      std::string_view what);
  ucp_request_param_t Param(OpState* s, MemoryKind kind, bool recv) const;
  StatusOr<Peer*> LivePeer(PeerId peer);
  Status CheckKind(MemoryKind kind) const;
  StatusOr<PeerId> ConnectAddress(const std::string& address);
  void MarkDead(PeerId peer, Status why);
  void HandleDeaths();
  void DrainControl();
  // Sends a control message; the state lets the caller watch its local completion.
  StatusOr<std::shared_ptr<OpState>> PostControl(PeerId peer, uint8_t kind,
                                                 std::span<const std::byte> bytes);

  TransportCaps caps_;
  bool device_is_host_ = true;
  bool cuda_ = false;
  bool peer_errors_ = true;  // ucx.error_mode == "peer"
  int progress_spin_ = 1;
  ContextPtr context_;
  WorkerPtr worker_;
  std::string address_;
  uint64_t instance_ = 0;   // random, 63 bits: identifies this transport in control tags
  std::deque<Peer> peers_;  // PeerId -> peer (deque: stable addresses for callbacks)
  std::deque<EpErrorArg> ep_args_;
  std::unordered_map<std::string, PeerId> peer_by_address_;
  std::unordered_map<uint64_t, PeerId> peer_by_instance_;
  std::unordered_map<OpState*, std::shared_ptr<OpState>> inflight_;
  std::deque<std::shared_ptr<OpState>> control_in_;  // control receives, in arrival order
  std::deque<ControlMessage> control_ready_;
  std::vector<std::pair<PeerId, ucs_status_t>> deaths_;  // reported by OnEpError
  std::vector<void*> closing_;  // close requests of dead peers' endpoints (error mode none)
};

StatusOr<std::unique_ptr<Transport>> UcxTransport::Create(const TransportOptions& options) {
  std::unique_ptr<UcxTransport> t(new UcxTransport());
  t->device_is_host_ = options.device_memory_is_host;
  t->progress_spin_ = static_cast<int>(Config::Global().Int("ucx.progress_spin"));
  t->peer_errors_ = Config::Global().String("ucx.error_mode") == "peer";

  ucx_detail::PrepareUcx();
  ucp_config_t* raw_config = nullptr;
  ucs_status_t st = ucp_config_read(nullptr, nullptr, &raw_config);
  if (st != UCS_OK) return FromUcs(st, "ucp_config_read").WithContext("ucx transport");
  ConfigPtr config(raw_config);
  const std::string tls = Config::Global().String("ucx.tls");
  if (!tls.empty()) {
    st = ucp_config_modify(config.get(), "TLS", tls.c_str());
    if (st != UCS_OK) return FromUcs(st, "ucx.tls='" + tls + "'").WithContext("ucx transport");
  }
  const std::string keepalive = std::to_string(Config::Global().Int("ucx.keepalive_ms")) + "ms";
  st = ucp_config_modify(config.get(), "KEEPALIVE_INTERVAL", keepalive.c_str());
  if (st != UCS_OK)
    Log(LogLevel::kDebug, "ucx: KEEPALIVE_INTERVAL not set: {}", ucs_status_string(st));

  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_TAG | UCP_FEATURE_RMA;
  ucp_context_h ctx = nullptr;
  st = ucp_init(&params, config.get(), &ctx);
  if (st != UCS_OK) return FromUcs(st, "ucp_init").WithContext("ucx transport");
  t->context_.reset(ctx);

  ucp_context_attr_t attr{};
  attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  if (ucp_context_query(ctx, &attr) == UCS_OK) {
    t->cuda_ = (attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
  }

  ucp_worker_params_t wparams{};
  wparams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wparams.thread_mode = UCS_THREAD_MODE_SINGLE;
  ucp_worker_h worker = nullptr;
  st = ucp_worker_create(ctx, &wparams, &worker);
  if (st != UCS_OK) return FromUcs(st, "ucp_worker_create").WithContext("ucx transport");
  t->worker_.reset(worker);

  ucp_address_t* addr = nullptr;
  size_t addr_len = 0;
  st = ucp_worker_get_address(worker, &addr, &addr_len);
  if (st != UCS_OK) return FromUcs(st, "ucp_worker_get_address").WithContext("ucx transport");
  t->address_ = EncodeUcxAddress(addr, addr_len);
  ucp_worker_release_address(worker, addr);

  std::random_device rd;
  t->instance_ = ((uint64_t{rd()} << 32) ^ rd() ^ reinterpret_cast<uintptr_t>(t.get())) & ~kCtrlBit;

  t->caps_.name = "ucx";
  t->caps_.tag_bits = 63;
  t->caps_.device_memory = t->device_is_host_ || t->cuda_;
  t->caps_.one_sided = true;
  t->caps_.detects_crashed_peers = t->peer_errors_;
  t->caps_.max_control_bytes = size_t{1} << 20;
  Log(LogLevel::kDebug, "ucx transport up: cuda={} address {} bytes", t->cuda_, addr_len);
  return std::unique_ptr<Transport>(std::move(t));
}

UcxTransport::~UcxTransport() {
  if (!worker_) return;
  const Deadline deadline =
      DeadlineIn(std::chrono::milliseconds(Config::Global().Int("transport.close_timeout_ms")));
  // Cancel every pending receive first, so no peer's data lands in them after the byes
  // (completes them synchronously with UCS_ERR_CANCELED).
  std::vector<OpState*> recvs;
  for (auto& [p, s] : inflight_) {
    if (s->is_recv && s->request) recvs.push_back(p);
  }
  for (OpState* s : recvs) {
    if (inflight_.count(s) && s->request) {
      s->forced = Status::Cancelled("ucx transport destroyed");
      ucp_request_cancel(worker_.get(), s->request);
    }
  }
  // Tell live peers we are going, so their pending ops fail at once instead of at keepalive.
  std::vector<std::shared_ptr<OpState>> byes;
  for (size_t i = 0; i < peers_.size(); ++i) {
    if (peers_[i].dead) continue;
    auto bye = PostControl(static_cast<PeerId>(i), kKindBye, {});
    if (bye.ok()) byes.push_back(std::move(bye).value());
  }
  // Byes are eager sends: they complete locally once handed to the wire.
  auto byes_done = [&] {
    for (auto& b : byes) {
      if (!b->done) return false;
    }
    return true;
  };
  // A bye not out within 100 ms goes to a peer that is gone or stuck: don't wait for it.
  const Deadline bye_deadline = std::min(deadline, DeadlineIn(std::chrono::milliseconds(100)));
  while (!byes_done() && Clock::now() < bye_deadline) ucp_worker_progress(worker_.get());
  // Error mode peer: force-close every endpoint, as a flushing close would wait for peers that
  // may be gone or not progressing; peers learn of it from the bye (or keepalive). Error mode
  // none: force is not allowed, so flush-close within the deadline, then destroy the worker.
  // Dead peers' endpoints (error mode none) may never finish closing: don't wait for them.
  for (void* r : closing_) ucp_request_free(r);
  closing_.clear();
  std::vector<void*> closing;
  for (auto& peer : peers_) {
    peer.rkeys.clear();
    if (!peer.ep) continue;
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = peer_errors_ ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    ucs_status_ptr_t r = ucp_ep_close_nbx(peer.ep, &p);
    peer.ep = nullptr;
    if (UCS_PTR_IS_PTR(r)) closing.push_back(r);
  }
  // Closing completes the endpoints' requests (force: cancelled; flush: when done): wait for
  // them too, so UCX hands back every request before the worker goes.
  auto requests_pending = [&] {
    for (auto& [p, s] : inflight_) {
      // Error mode none: a detached op's peer is gone and its request never ends; don't wait.
      if (s->request && (peer_errors_ || !s->done)) return true;
    }
    return false;
  };
  while ((!closing.empty() || requests_pending()) && Clock::now() < deadline) {
    ucp_worker_progress(worker_.get());
    std::erase_if(closing, [](void* r) {
      if (ucp_request_check_status(r) == UCS_INPROGRESS) return false;
      ucp_request_free(r);
      return true;
    });
  }
  if (!closing.empty()) {
    Log(LogLevel::kWarn, "ucx: {} endpoint(s) did not close within the deadline; destroying",
        closing.size());
    for (void* r : closing) ucp_request_free(r);
  }
  // What UCX did not complete, we do (ucp_request_free: no callback will follow); buffers are
  // released with the worker. States stay alive until the worker is gone.
  std::vector<std::shared_ptr<OpState>> keep;
  for (auto& [p, s] : inflight_) {
    if (s->request) ucp_request_free(s->request);
    s->request = nullptr;
    if (!s->done) {
      s->status = s->forced.ok() ? Status::Cancelled("ucx transport destroyed") : s->forced;
      s->done = true;
    }
    keep.push_back(s);
  }
  inflight_.clear();
  control_in_.clear();
  worker_.reset();
  context_.reset();
}

std::shared_ptr<OpState> UcxTransport::NewOp(PeerId peer, bool is_recv) {
  auto s = std::make_shared<OpState>();
  s->owner = this;
  s->peer = peer;
  s->is_recv = is_recv;
  return s;
}

ucp_request_param_t UcxTransport::Param(OpState* s, MemoryKind kind, bool recv) const {
  ucp_request_param_t p{};
  p.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
  if (recv) {
    p.cb.recv = &UcxTransport::OnRecv;
  } else {
    p.cb.send = &UcxTransport::OnSend;
  }
  p.user_data = s;
  // Telling UCX the memory type saves it a pointer lookup per operation.
  p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMORY_TYPE;
  p.memory_type = (kind == MemoryKind::kDevice && !device_is_host_) ? UCS_MEMORY_TYPE_CUDA
                                                                    : UCS_MEMORY_TYPE_HOST;
  return p;
}

std::unique_ptr<TransportOp> UcxTransport::Posted(std::shared_ptr<OpState> s, ucs_status_ptr_t ret,
                                                  std::string_view what) {
  if (s->done) {
    // With NO_IMM_CMPL, UCX may run the callback inside the call and still return the (now
    // freed) request: the op is complete already.
  } else if (UCS_PTR_IS_PTR(ret)) {
    s->request = ret;
    inflight_.emplace(s.get(), s);
    if (s->is_recv && s->peer != kAnyPeer) peers_[s->peer].recvs.insert(s.get());
  } else {
    // Completed or failed at once (NO_IMM_CMPL makes the former rare).
    const ucs_status_t st = UCS_PTR_STATUS(ret);
    s->status = (st != UCS_OK && s->peer != kAnyPeer && peers_[s->peer].dead)
                    ? peers_[s->peer].death
                    : FromUcs(st, what);
    s->done = true;
  }
  return std::make_unique<UcxOp>(std::move(s));
}

void UcxTransport::OnSend(void* request, ucs_status_t status, void* user_data) {
  auto* s = static_cast<OpState*>(user_data);
  s->owner->Finish(s, request, status, s->bytes);
}

void UcxTransport::OnRecv(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info,
                          void* user_data) {
  auto* s = static_cast<OpState*>(user_data);
  if (info != nullptr) s->sender_tag = info->sender_tag;
  s->owner->Finish(s, request, status, status == UCS_OK && info ? info->length : 0);
}

void UcxTransport::Finish(OpState* s, void* request, ucs_status_t status, size_t bytes) {
  if (request) ucp_request_free(request);
  s->request = nullptr;
  if (s->done) {  // detached at its peer's death: already reported
    inflight_.erase(s);
    return;
  }
  s->bytes = bytes;
  if (!s->forced.ok()) {
    s->status = s->forced;
  } else if (status != UCS_OK && s->peer != kAnyPeer && peers_[s->peer].dead) {
    s->status = peers_[s->peer].death;
  } else if (status != UCS_OK && s->peer != kAnyPeer && status != UCS_ERR_CANCELED &&
             status != UCS_ERR_MESSAGE_TRUNCATED) {
    s->status = Status::Unavailable(std::string("ucx peer failed: ") + ucs_status_string(status));
  } else {
    s->status = FromUcs(status, s->is_recv ? "ucx receive" : "ucx send");
  }
  s->done = true;
  if (s->is_recv && s->peer != kAnyPeer) peers_[s->peer].recvs.erase(s);
  inflight_.erase(s);  // may free `s`
}

void UcxTransport::OnEpError(void* arg, ucp_ep_h, ucs_status_t status) {
  auto* a = static_cast<EpErrorArg*>(arg);
  a->transport->deaths_.emplace_back(a->peer, status);
}

Status UcxTransport::CheckKind(MemoryKind kind) const {
  if (kind == MemoryKind::kFile) return Status::InvalidArgument("ucx: kFile is not memory");
  if (kind == MemoryKind::kDevice && !caps_.device_memory) {
    return Status::InvalidArgument("ucx: this UCX build has no CUDA support for kDevice buffers");
  }
  return Status::Ok();
}

StatusOr<Peer*> UcxTransport::LivePeer(PeerId peer) {
  if (peer < 0 || static_cast<size_t>(peer) >= peers_.size()) {
    return Status::InvalidArgument("unknown peer id " + std::to_string(peer));
  }
  return &peers_[peer];
}

StatusOr<PeerId> UcxTransport::Connect(std::string_view address, Deadline) {
  KVF_ASSIGN_OR_RETURN(std::vector<uint8_t> raw, DecodeUcxAddress(address));
  (void)raw;
  return ConnectAddress(std::string(address));
}

StatusOr<PeerId> UcxTransport::ConnectAddress(const std::string& address) {
  auto it = peer_by_address_.find(address);
  if (it != peer_by_address_.end() && !peers_[it->second].dead) return it->second;
  KVF_ASSIGN_OR_RETURN(std::vector<uint8_t> raw, DecodeUcxAddress(address));
  if (address == address_) return Status::InvalidArgument("ucx: connecting to self");
  const PeerId id = static_cast<PeerId>(peers_.size());
  ep_args_.push_back({this, id});
  ucp_ep_params_t ep_params{};
  ep_params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  ep_params.address = reinterpret_cast<const ucp_address_t*>(raw.data());
  ep_params.err_mode = peer_errors_ ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
  if (peer_errors_) {
    ep_params.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep_params.err_handler.cb = &UcxTransport::OnEpError;
    ep_params.err_handler.arg = &ep_args_.back();
  }
  ucp_ep_h ep = nullptr;
  const ucs_status_t st = ucp_ep_create(worker_.get(), &ep_params, &ep);
  if (st != UCS_OK) {
    ep_args_.pop_back();
    return FromUcs(st, "ucp_ep_create").WithContext("ucx connect");
  }
  peers_.emplace_back();
  peers_.back().ep = ep;
  peers_.back().address = address;
  peer_by_address_[address] = id;  // a reconnect after death replaces the dead peer's id
  return id;
}

void UcxTransport::MarkDead(PeerId peer, Status why) {
  Peer& p = peers_[peer];
  if (p.dead) return;
  // An orderly shutdown ("bye") is routine; anything else is worth a warning.
  const bool orderly = why.message().find("shut down") != std::string_view::npos;
  Log(orderly ? LogLevel::kDebug : LogLevel::kWarn, "ucx: peer {} {}: {}", peer,
      orderly ? "closed" : "failed", why.ToString());
  p.dead = true;
  p.death = std::move(why);
  p.rkeys.clear();
  // Receives naming the peer are not tied to its endpoint in UCX: cancel them ourselves.
  std::vector<OpState*> recvs(p.recvs.begin(), p.recvs.end());
  for (OpState* s : recvs) {
    if (!p.recvs.count(s) || !s->request) continue;
    s->forced = p.death;
    ucp_request_cancel(worker_.get(), s->request);
  }
  // Sends, puts and flushes to the peer end now for the caller; UCX may still hold their
  // requests (error mode none) until the endpoint closes: they stay in flight, detached.
  for (auto& [ptr, st] : inflight_) {
    if (st->peer != peer || st->is_recv || st->done) continue;
    st->forced = p.death;
    st->status = p.death;
    st->done = true;
  }
  if (p.ep) {
    ucp_request_param_t prm{};
    prm.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    // Force (fails the endpoint's requests) needs error mode peer on both sides; otherwise a
    // flushing close that completes when it can (or when the worker is destroyed).
    prm.flags = peer_errors_ ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    ucs_status_ptr_t r = ucp_ep_close_nbx(p.ep, &prm);
    if (UCS_PTR_IS_PTR(r)) closing_.push_back(r);
    p.ep = nullptr;
  }
}

void UcxTransport::HandleDeaths() {
  while (!deaths_.empty()) {
    auto [peer, st] = deaths_.back();
    deaths_.pop_back();
    if (peers_[peer].dead) continue;
    // The endpoint is in error state: UCX has failed or will fail its sends; close it later.
    MarkDead(peer, Status::Unavailable("ucx peer " + std::to_string(peer) +
                                       " unreachable: " + ucs_status_string(st)));
  }
}

StatusOr<std::shared_ptr<OpState>> UcxTransport::PostControl(PeerId peer, uint8_t kind,
                                                             std::span<const std::byte> bytes) {
  Peer& p = peers_[peer];
  auto s = NewOp(peer, false);
  if (kind == kKindData && !p.hello_sent) kind = kKindHello;
  s->payload.push_back(static_cast<std::byte>(kind));
  if (kind == kKindHello || kind == kKindBye) {
    const uint32_t n = static_cast<uint32_t>(address_.size());
    for (int i = 0; i < 4; ++i) s->payload.push_back(static_cast<std::byte>(n >> (8 * i)));
    const auto* a = reinterpret_cast<const std::byte*>(address_.data());
    s->payload.insert(s->payload.end(), a, a + n);
  }
  s->payload.insert(s->payload.end(), bytes.begin(), bytes.end());
  ucp_request_param_t prm = Param(s.get(), MemoryKind::kHost, false);
  ucs_status_ptr_t r =
      ucp_tag_send_nbx(p.ep, s->payload.data(), s->payload.size(), kCtrlBit | instance_, &prm);
  auto keep = s;
  auto op = Posted(std::move(s), r, "ucx control send");
  if (op->Done() && !op->status().ok()) return op->status();
  if (kind == kKindHello) p.hello_sent = true;
  return keep;  // a later failure shows as the peer's death
}

Status UcxTransport::SendControl(PeerId peer, std::span<const std::byte> bytes) {
  if (bytes.size() > caps_.max_control_bytes) {
    return Status::InvalidArgument("control message of " + std::to_string(bytes.size()) +
                                   " bytes exceeds " + std::to_string(caps_.max_control_bytes));
  }
  KVF_ASSIGN_OR_RETURN(Peer * p, LivePeer(peer));
  if (p->dead) return p->death;
  auto posted = PostControl(peer, kKindData, bytes);
  return posted.ok() ? Status::Ok() : posted.status();
}

void UcxTransport::DrainControl() {
  // Take every arrived control message off the unexpected queue, in arrival order.
  for (;;) {
    ucp_tag_recv_info_t info{};
    ucp_tag_message_h msg = ucp_tag_probe_nb(worker_.get(), kCtrlBit, kCtrlBit, 1, &info);
    if (msg == nullptr) break;
    auto s = NewOp(kAnyPeer, true);
    s->payload.resize(info.length);
    s->sender_tag = info.sender_tag;
    ucp_request_param_t prm = Param(s.get(), MemoryKind::kHost, true);
    ucs_status_ptr_t r =
        ucp_tag_msg_recv_nbx(worker_.get(), s->payload.data(), s->payload.size(), msg, &prm);
    auto keep = s;
    (void)Posted(std::move(s), r, "ucx control receive");
    control_in_.push_back(std::move(keep));
  }
  while (!control_in_.empty() && control_in_.front()->done) {
    std::shared_ptr<OpState> s = std::move(control_in_.front());
    control_in_.pop_front();
    if (!s->status.ok() || s->payload.empty()) {
      Log(LogLevel::kWarn, "ucx: dropped a control message: {}", s->status.ToString());
      continue;
    }
    const uint64_t instance = s->sender_tag & ~kCtrlBit;
    const auto* p = reinterpret_cast<const uint8_t*>(s->payload.data());
    const size_t n = s->payload.size();
    size_t off = 1;
    if (p[0] == kKindBye) {
      if (n < 5 || n - 5 < LoadU32Le(p + 1)) continue;
      auto it = peer_by_instance_.find(instance);
      auto by_addr = peer_by_address_.find(
          std::string(reinterpret_cast<const char*>(p + 5), LoadU32Le(p + 1)));
      const PeerId gone = it != peer_by_instance_.end()       ? it->second
                          : by_addr != peer_by_address_.end() ? by_addr->second
                                                              : kAnyPeer;
      if (gone != kAnyPeer) {
        MarkDead(gone, Status::Unavailable("ucx peer " + std::to_string(gone) + " shut down"));
      }
      continue;
    }
    if (p[0] == kKindHello) {
      if (n < 5 || n - 5 < LoadU32Le(p + 1)) {
        Log(LogLevel::kWarn, "ucx: dropped a malformed hello");
        continue;
      }
      const uint32_t len = LoadU32Le(p + 1);
      std::string addr(reinterpret_cast<const char*>(p + 5), len);
      auto peer = ConnectAddress(addr);
      if (!peer.ok()) {
        Log(LogLevel::kWarn, "ucx: can't connect back to a sender: {}", peer.status().ToString());
        continue;
      }
      peer_by_instance_[instance] = *peer;
      off = 5 + len;
    }
    auto it = peer_by_instance_.find(instance);
    if (it == peer_by_instance_.end()) {
      Log(LogLevel::kWarn, "ucx: dropped a control message from an unknown sender");
      continue;
    }
    ControlMessage m;
    m.from = it->second;
    m.bytes.assign(s->payload.begin() + static_cast<std::ptrdiff_t>(off), s->payload.end());
    control_ready_.push_back(std::move(m));
  }
}

std::optional<ControlMessage> UcxTransport::PollControl() {
  if (control_ready_.empty()) Progress();
  if (control_ready_.empty()) return std::nullopt;
  ControlMessage m = std::move(control_ready_.front());
  control_ready_.pop_front();
  return m;
}

bool UcxTransport::Progress() {
  bool any = false;
  for (int i = 0; i < progress_spin_; ++i) any |= ucp_worker_progress(worker_.get()) != 0;
  HandleDeaths();
  if (!closing_.empty()) {
    std::erase_if(closing_, [](void* r) {
      if (ucp_request_check_status(r) == UCS_INPROGRESS) return false;
      ucp_request_free(r);
      return true;
    });
  }
  const size_t before = control_ready_.size();
  DrainControl();
  return any || control_ready_.size() != before;
}

StatusOr<std::unique_ptr<TransportOp>> UcxTransport::Send(PeerId peer, uint64_t tag,
                                                          const void* buf, size_t bytes,
                                                          MemoryKind kind) {
  KVF_RETURN_IF_ERROR(CheckKind(kind));
  if (tag & kCtrlBit) return Status::InvalidArgument("ucx data tags have 63 bits");
  KVF_ASSIGN_OR_RETURN(Peer * p, LivePeer(peer));
  auto s = NewOp(peer, false);
  s->bytes = bytes;
  if (p->dead) {
    s->status = p->death;
    s->done = true;
    return std::unique_ptr<TransportOp>(std::make_unique<UcxOp>(std::move(s)));
  }
  ucp_request_param_t prm = Param(s.get(), kind, false);
  ucs_status_ptr_t r = ucp_tag_send_nbx(p->ep, buf, bytes, tag, &prm);
  return Posted(std::move(s), r, "ucp_tag_send_nbx");
}

StatusOr<std::unique_ptr<TransportOp>> UcxTransport::Recv(PeerId peer, uint64_t tag, void* buf,
                                                          size_t capacity, MemoryKind kind) {
  KVF_RETURN_IF_ERROR(CheckKind(kind));
  if (tag & kCtrlBit) return Status::InvalidArgument("ucx data tags have 63 bits");
  auto s = NewOp(peer, true);
  if (peer != kAnyPeer) {
    KVF_ASSIGN_OR_RETURN(Peer * p, LivePeer(peer));
    if (p->dead) {
      s->status = p->death;
      s->done = true;
      return std::unique_ptr<TransportOp>(std::make_unique<UcxOp>(std::move(s)));
    }
  }
  ucp_request_param_t prm = Param(s.get(), kind, true);
  ucs_status_ptr_t r = ucp_tag_recv_nbx(worker_.get(), buf, capacity, tag, ~uint64_t{0}, &prm);
  return Posted(std::move(s), r, "ucp_tag_recv_nbx");
}

void UcxTransport::Cancel(TransportOp& op) {
  auto* mine = dynamic_cast<UcxOp*>(&op);
  if (mine == nullptr || mine->Done()) return;
  OpState& s = mine->state();
  if (s.owner != this || !s.request) return;
  if (s.is_recv) ucp_request_cancel(worker_.get(), s.request);  // completes it synchronously
  // Sends: UCX can't take back a send the peer may be reading; it completes on its own.
}

StatusOr<std::unique_ptr<MemoryRegistration>> UcxTransport::RegisterMemory(void* ptr, size_t bytes,
                                                                           MemoryKind kind) {
  KVF_RETURN_IF_ERROR(CheckKind(kind));
  if (bytes == 0) return Status::InvalidArgument("ucx: empty registration");
  ucp_mem_map_params_t mp{};
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                  UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
  if (ptr == nullptr) {
    // UCX allocates: on one host, shared memory that peers' puts reach with a plain copy.
    if (kind == MemoryKind::kDevice && !device_is_host_) {
      return Status::InvalidArgument("ucx: allocating device memory is not supported");
    }
    mp.field_mask |= UCP_MEM_MAP_PARAM_FIELD_FLAGS;
    mp.flags = UCP_MEM_MAP_ALLOCATE;
  }
  mp.address = ptr;
  mp.length = bytes;
  mp.memory_type = (kind == MemoryKind::kDevice && !device_is_host_) ? UCS_MEMORY_TYPE_CUDA
                                                                     : UCS_MEMORY_TYPE_HOST;
  ucp_mem_h memh = nullptr;
  ucs_status_t st = ucp_mem_map(context_.get(), &mp, &memh);
  if (st != UCS_OK) return FromUcs(st, "ucp_mem_map");
  if (ptr == nullptr) {
    ucp_mem_attr_t ma{};
    ma.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS;
    st = ucp_mem_query(memh, &ma);
    if (st != UCS_OK) {
      ucp_mem_unmap(context_.get(), memh);
      return FromUcs(st, "ucp_mem_query");
    }
    ptr = ma.address;
  }
  void* key = nullptr;
  size_t key_len = 0;
  st = ucp_rkey_pack(context_.get(), memh, &key, &key_len);
  if (st != UCS_OK) {
    ucp_mem_unmap(context_.get(), memh);
    return FromUcs(st, "ucp_rkey_pack");
  }
  std::vector<std::byte> packed(static_cast<std::byte*>(key),
                                static_cast<std::byte*>(key) + key_len);
  ucp_rkey_buffer_release(key);
  return std::unique_ptr<MemoryRegistration>(
      std::make_unique<UcxRegistration>(context_.get(), memh, std::move(packed), ptr, bytes));
}

StatusOr<std::unique_ptr<TransportOp>> UcxTransport::Put(PeerId peer, const void* local,
                                                         size_t bytes, MemoryKind kind,
                                                         uint64_t remote_addr,
                                                         std::span<const std::byte> rkey) {
  KVF_RETURN_IF_ERROR(CheckKind(kind));
  KVF_ASSIGN_OR_RETURN(Peer * p, LivePeer(peer));
  auto s = NewOp(peer, false);
  s->bytes = bytes;
  if (p->dead) {
    s->status = p->death;
    s->done = true;
    return std::unique_ptr<TransportOp>(std::make_unique<UcxOp>(std::move(s)));
  }
  std::string key(reinterpret_cast<const char*>(rkey.data()), rkey.size());
  auto it = p->rkeys.find(key);
  if (it == p->rkeys.end()) {
    ucp_rkey_h h = nullptr;
    const ucs_status_t st = ucp_ep_rkey_unpack(p->ep, rkey.data(), &h);
    if (st != UCS_OK) return FromUcs(st, "ucp_ep_rkey_unpack");
    it = p->rkeys.emplace(std::move(key), RkeyPtr(h)).first;
  }
  ucp_request_param_t prm = Param(s.get(), kind, false);
  ucs_status_ptr_t r = ucp_put_nbx(p->ep, local, bytes, remote_addr, it->second.get(), &prm);
  return Posted(std::move(s), r, "ucp_put_nbx");
}

StatusOr<std::unique_ptr<TransportOp>> UcxTransport::Flush(PeerId peer) {
  KVF_ASSIGN_OR_RETURN(Peer * p, LivePeer(peer));
  auto s = NewOp(peer, false);
  if (p->dead) {
    s->status = p->death;
    s->done = true;
    return std::unique_ptr<TransportOp>(std::make_unique<UcxOp>(std::move(s)));
  }
  ucp_request_param_t prm = Param(s.get(), MemoryKind::kHost, false);
  prm.op_attr_mask &= ~static_cast<uint32_t>(UCP_OP_ATTR_FIELD_MEMORY_TYPE);
  ucs_status_ptr_t r = ucp_ep_flush_nbx(p->ep, &prm);
  return Posted(std::move(s), r, "ucp_ep_flush_nbx");
}

}  // namespace

StatusOr<std::unique_ptr<Transport>> CreateUcxTransport(const TransportOptions& options) {
  return UcxTransport::Create(options);
}

}  // namespace kvferry
