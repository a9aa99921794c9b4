// The UCX transport: one ucp_context (TAG | RMA), a control worker and a data worker, and per
// peer a control endpoint and a data endpoint (see ucx_transport_impl.h for why). One-sided
// operations are in ucx_rma.cc, the teardown (the destructor and its steps) in ucx_teardown.cc.
//
// ucx.error_mode: split (default): control endpoints in error mode PEER, data endpoints in NONE
// (shared memory, CMA, cuda_ipc on one host; a crash is noticed on the control endpoint).
// peer: both in PEER (UCX then refuses shared memory: TCP on one host). none: both in NONE (a
// crashed peer is noticed only by the caller's deadlines; an orderly shutdown still is).
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
// The first control message to a peer is a hello, on the control endpoint; every later one (bye
// included) goes on the data endpoint, and a receiver holds those of a sender whose hello it has
// not taken yet. A transport being destroyed sends bye to every live peer it has endpoints to,
// which fails that peer's pending ops at the receiver with kUnavailable at once. A hello adds its
// sender without endpoints (made by the first answer): a sender never answered gets no bye either
// (with ucx.error_mode=none, where the bye is the only news of an orderly end, such a sender
// learns of it by its deadline), since a bye would connect to an address nothing vouched for.
//
// Address text: see ucx_address.h.
#include <sys/epoll.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
#include <mutex>
#include <random>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "base/log.h"
#include "kvferry/config.h"
#include "kvferry/transport.h"
#include "transport/ucx_address.h"
#include "transport/ucx_transport_impl.h"

#if defined(__SANITIZE_THREAD__)
#define KVFERRY_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define KVFERRY_TSAN 1
#endif
#endif
#ifdef KVFERRY_TSAN
#include <sanitizer/tsan_interface.h>
#endif

namespace kvferry {
namespace ucx_detail {
namespace {

// libucs takes SIGHUP when it loads, before any transport exists: kvferry gives it back as soon
// as it loads too (libucs, a dependency, was initialized before), so a process that never makes
// a UCX transport still dies of a hangup. Create calls it again (once per process in all).
[[maybe_unused]] const bool kSighupKept = (KeepSighup(), true);

}  // namespace

namespace {

StatusOr<WorkerPtr> MakeWorker(ucp_context_h ctx, std::vector<uint8_t>& address) {
  ucp_worker_params_t wparams{};
  wparams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wparams.thread_mode = UCS_THREAD_MODE_SINGLE;
  ucp_worker_h worker = nullptr;
  ucs_status_t st = ucp_worker_create(ctx, &wparams, &worker);
  if (st != UCS_OK) return FromUcs(st, "ucp_worker_create");
  WorkerPtr owner(worker);
  ucp_address_t* addr = nullptr;
  size_t addr_len = 0;
  st = ucp_worker_get_address(worker, &addr, &addr_len);
  if (st != UCS_OK) return FromUcs(st, "ucp_worker_get_address");
  const auto* p = reinterpret_cast<const uint8_t*>(addr);
  address.assign(p, p + addr_len);
  ucp_worker_release_address(worker, addr);
  return owner;
}

}  // namespace

StatusOr<std::unique_ptr<Transport>> UcxTransport::Create(const TransportOptions& options) {
  std::unique_ptr<UcxTransport> t(new UcxTransport());
  t->device_is_host_ = options.device_memory_is_host;
  t->progress_spin_ = static_cast<int>(Config::Global().Int("ucx.progress_spin"));
  const std::string mode = Config::Global().String("ucx.error_mode");
  t->mode_ = mode == "peer"   ? ErrorMode::kPeer
             : mode == "none" ? ErrorMode::kNone
                              : ErrorMode::kSplit;
  t->ctrl_peer_errors_ = t->mode_ != ErrorMode::kNone;
  t->data_peer_errors_ = t->mode_ == ErrorMode::kPeer;

  KeepSighup();
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
  // WAKEUP: a progress thread can sleep on the workers' event fds until a control message comes
  // (WakeupFd; hellos arrive on the control worker, later messages on the data worker).
  params.features = UCP_FEATURE_TAG | UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP;
  ucp_context_h ctx = nullptr;
  st = ucp_init(&params, config.get(), &ctx);
  if (st != UCS_OK) return FromUcs(st, "ucp_init").WithContext("ucx transport");
  t->context_.reset(ctx);

  ucp_context_attr_t attr{};
  attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  if (ucp_context_query(ctx, &attr) == UCS_OK) {
    t->cuda_ = (attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
  }

  UcxWorkerAddresses addresses;
  auto ctrl = MakeWorker(ctx, addresses.control);
  if (!ctrl.ok()) return ctrl.status().WithContext("ucx transport: control worker");
  t->ctrl_worker_ = std::move(ctrl).value();
  auto data = MakeWorker(ctx, addresses.data);
  if (!data.ok()) return data.status().WithContext("ucx transport: data worker");
  t->data_worker_ = std::move(data).value();
  t->address_ = EncodeUcxWorkerAddresses(addresses);
  if (auto shape = UcxAddressShape::Learn(addresses.control); shape.ok()) {
    t->shape_ = *shape;
  } else {
    static std::once_flag said;
    std::call_once(said, [&] {
      Log(LogLevel::kWarn, "ucx: peer addresses go to UCX unchecked: {}",
          shape.status().ToString());
    });
  }
  t->OpenWakeup();

  std::random_device rd;
  t->instance_ = ((uint64_t{rd()} << 32) ^ rd() ^ reinterpret_cast<uintptr_t>(t.get())) & ~kCtrlBit;

  t->caps_.name = "ucx";
  t->caps_.tag_bits = 63;
  t->caps_.device_memory = t->device_is_host_ || t->cuda_;
  t->caps_.one_sided = true;  // the context was created with UCP_FEATURE_RMA
  t->caps_.detects_crashed_peers = t->ctrl_peer_errors_;
  t->caps_.max_control_bytes = size_t{1} << 20;
  Log(LogLevel::kDebug, "ucx transport up: error mode {}, cuda={}, address {} + {} bytes", mode,
      t->cuda_, addresses.control.size(), addresses.data.size());
  return std::unique_ptr<Transport>(std::move(t));
}

void UcxTransport::OpenWakeup() {
  const int ep = epoll_create1(EPOLL_CLOEXEC);
  if (ep < 0) return;  // the progress thread polls
  for (ucp_worker_h w : {ctrl_worker_.get(), data_worker_.get()}) {
    int fd = -1;
    ucs_status_t st = ucp_worker_get_efd(w, &fd);
    epoll_event ev{};
    ev.events = EPOLLIN;
    if (st != UCS_OK || epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev) != 0) {
      Log(LogLevel::kDebug, "ucx: no wakeup fd, progress threads poll: {}",
          st != UCS_OK ? ucs_status_string(st) : "epoll_ctl failed");
      close(ep);
      return;
    }
  }
  wakeup_fd_ = ep;
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

std::unique_ptr<TransportOp> UcxTransport::Dead(PeerId peer, size_t bytes) {
  auto s = NewOp(peer, false);
  s->bytes = bytes;
  s->status = peers_[peer].death;
  s->done = true;
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
  // ConnectAddress decodes (and so checks) an address it has not connected before; a known one
  // is a lookup (a generation rank connects to every context rank on every Fetch).
  return ConnectAddress(std::string(address), /*connect=*/true);
}

StatusOr<ucp_ep_h> UcxTransport::CreateEp(ucp_worker_h worker, const std::vector<uint8_t>& address,
                                          bool peer_errors, EpErrorArg* arg) {
  ucp_ep_params_t ep_params{};
  ep_params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  ep_params.address = reinterpret_cast<const ucp_address_t*>(address.data());
  ep_params.err_mode = peer_errors ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
  if (peer_errors) {
    ep_params.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep_params.err_handler.cb = &UcxTransport::OnEpError;
    ep_params.err_handler.arg = arg;
  }
  ucp_ep_h ep = nullptr;
  const ucs_status_t st = ucp_ep_create(worker, &ep_params, &ep);
  if (st != UCS_OK) return FromUcs(st, "ucp_ep_create").WithContext("ucx connect");
  return ep;
}

void UcxTransport::CloseEp(ucp_ep_h ep, bool force) {
  if (!ep) return;
  ucp_request_param_t prm{};
  prm.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  // Force (fails the endpoint's requests) needs error mode PEER on both sides; otherwise a
  // flushing close that completes when it can (or when the worker is destroyed).
  prm.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  ucs_status_ptr_t r = ucp_ep_close_nbx(ep, &prm);
  if (UCS_PTR_IS_PTR(r)) closing_.push_back(r);
}

StatusOr<PeerId> UcxTransport::ConnectAddress(const std::string& address, bool connect) {
  // A peer that died stays dead: its address names a worker that is gone (a restarted process
  // has a new address), and reconnecting would only wait for UCX to find that out again.
  auto it = peer_by_address_.find(address);
  if (it != peer_by_address_.end()) {
    if (peers_[it->second].dead) return peers_[it->second].death;
    if (connect) KVF_RETURN_IF_ERROR(ReadyPeer(it->second).status());
    return it->second;
  }
  KVF_ASSIGN_OR_RETURN(UcxWorkerAddresses raw, DecodeUcxWorkerAddresses(address));
  if (address == address_) return Status::InvalidArgument("ucx: connecting to self");
  // UCX parses a worker address without its length and aborts on some bad bytes: only an
  // address of the layout this UCX makes reaches ucp_ep_create (ucx_address.h says what stays
  // trusted).
  if (Status st = shape_.Check(raw.control); !st.ok()) return st.WithContext("control worker");
  if (Status st = shape_.Check(raw.data); !st.ok()) return st.WithContext("data worker");
  const PeerId id = static_cast<PeerId>(peers_.size());
  ep_args_.push_back({this, id});
  peers_.emplace_back();
  peers_.back().address = address;
  peers_.back().workers = std::move(raw);
  peer_by_address_[address] = id;
  if (connect) KVF_RETURN_IF_ERROR(ReadyPeer(id).status());
  return id;
}

StatusOr<Peer*> UcxTransport::ReadyPeer(PeerId peer) {
  KVF_ASSIGN_OR_RETURN(Peer * p, LivePeer(peer));
  if (p->dead || p->ctrl_ep != nullptr) return p;
  if (Status st = CreateEndpoints(peer); !st.ok()) {
    MarkDead(peer, st);
    return st;
  }
  return p;
}

Status UcxTransport::CreateEndpoints(PeerId id) {
  Peer& p = peers_[id];
  EpErrorArg* arg = &ep_args_[id];
  KVF_ASSIGN_OR_RETURN(ucp_ep_h ctrl,
                       CreateEp(ctrl_worker_.get(), p.workers.control, ctrl_peer_errors_, arg));
  auto data = CreateEp(data_worker_.get(), p.workers.data, data_peer_errors_, arg);
  if (!data.ok()) {
    CloseEp(ctrl, ctrl_peer_errors_);
    return data.status();
  }
  Log(LogLevel::kDebug, "ucx: peer {} connected (pid {})", id, getpid());
  p.ctrl_ep = ctrl;
  p.data_ep = *data;
  return Status::Ok();
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
  p.last_key = nullptr;
  // Receives naming the peer are not tied to its endpoint in UCX: cancel them ourselves.
  std::vector<OpState*> recvs(p.recvs.begin(), p.recvs.end());
  for (OpState* s : recvs) {
    if (!p.recvs.count(s) || !s->request) continue;
    s->forced = p.death;
    ucp_request_cancel(data_worker_.get(), s->request);
  }
  // Sends, puts, gets and flushes to the peer end now for the caller; UCX may still hold their
  // requests (error mode NONE) until the endpoint closes: they stay in flight, detached. This
  // is how the control endpoint's death fails the data endpoint's ops.
  for (auto& [ptr, st] : inflight_) {
    if (st->peer != peer || st->is_recv || st->done) continue;
    st->forced = p.death;
    st->status = p.death;
    st->done = true;
  }
  CloseEp(p.data_ep, data_peer_errors_);
  CloseEp(p.ctrl_ep, ctrl_peer_errors_);
  p.data_ep = nullptr;
  p.ctrl_ep = nullptr;
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

namespace {
// ThreadSanitizer and control messages between transports of one process (the soak, the
// transport tests: UCX workers in one process). A control message orders everything its sender
// did before sending it before everything its receiver does after taking it; the protocol
// relies on that (a context rank's CHUNK follows the completion of its copies into the
// generation rank's pool, whose bytes the generation rank then sums). UCX carries the message
// through its own lock-free queues in code built without TSan, so TSan sees no such edge and
// reports the receiver's reads as racing with the sender's earlier writes. Each sender releases
// a sync word chosen by its instance id before it posts a message, and the receiver acquires the
// sender's word when it takes one: the edge UCX provides, told to TSan (a message from an
// instance also orders that instance's earlier sends to other peers, and those of instances
// whose ids share its word: an over-approximation that can only hide a race, never report a false
// one). No code outside TSan builds.
#ifdef KVFERRY_TSAN
char tsan_control_sync[64];
void* ControlSyncWord(uint64_t instance) { return &tsan_control_sync[instance % 64]; }
#endif
void ControlSent([[maybe_unused]] uint64_t sender_instance) {
#ifdef KVFERRY_TSAN
  __tsan_release(ControlSyncWord(sender_instance));
#endif
}
void ControlTaken([[maybe_unused]] uint64_t sender_instance) {
#ifdef KVFERRY_TSAN
  __tsan_acquire(ControlSyncWord(sender_instance));
#endif
}
}  // namespace

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
  ControlSent(instance_);
  // The hello goes on the control endpoint (it sets up the connection that notices the peer's
  // death); everything after it on the data endpoint: shared memory on one host, where a message
  // costs no system call on either side (TCP: a send and an epoll + receive per message, most of
  // a transfer's control-plane CPU).
  ucp_ep_h ep = kind == kKindHello ? p.ctrl_ep : p.data_ep;
  ucs_status_ptr_t r =
      ucp_tag_send_nbx(ep, s->payload.data(), s->payload.size(), kCtrlBit | instance_, &prm);
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
  KVF_ASSIGN_OR_RETURN(Peer * p, ReadyPeer(peer));
  if (p->dead) return p->death;
  auto posted = PostControl(peer, kKindData, bytes);
  return posted.ok() ? Status::Ok() : posted.status();
}

void UcxTransport::DrainControl() {
  // Take every arrived control message off the unexpected queues, in arrival order: hellos come
  // on the control worker, every later message of a peer on the data worker (PostControl).
  for (ucp_worker_h worker : {ctrl_worker_.get(), data_worker_.get()}) {
    for (;;) {
      ucp_tag_recv_info_t info{};
      ucp_tag_message_h msg = ucp_tag_probe_nb(worker, kCtrlBit, kCtrlBit, 1, &info);
      if (msg == nullptr) break;
      auto s = NewOp(kAnyPeer, true);
      s->payload.resize(info.length);
      s->sender_tag = info.sender_tag;
      ucp_request_param_t prm = Param(s.get(), MemoryKind::kHost, true);
      ucs_status_ptr_t r =
          ucp_tag_msg_recv_nbx(worker, s->payload.data(), s->payload.size(), msg, &prm);
      auto keep = s;
      (void)Posted(std::move(s), r, "ucx control receive");
      control_in_.push_back(std::move(keep));
    }
  }
  while (!control_in_.empty() && control_in_.front()->done) {
    std::shared_ptr<OpState> s = std::move(control_in_.front());
    control_in_.pop_front();
    if (!s->status.ok() || s->payload.empty()) {
      Log(LogLevel::kWarn, "ucx: dropped a control message: {}", s->status.ToString());
      continue;
    }
    const uint64_t instance = s->sender_tag & ~kCtrlBit;
    ControlTaken(instance);
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
      Unhold(instance);
      continue;
    }
    if (p[0] == kKindHello) {
      if (n < 5 || n - 5 < LoadU32Le(p + 1)) {
        Log(LogLevel::kWarn, "ucx: dropped a malformed hello");
        continue;
      }
      const uint32_t len = LoadU32Le(p + 1);
      std::string addr(reinterpret_cast<const char*>(p + 5), len);
      // Not connected yet: the endpoints come with the first answer (ReadyPeer), so a sender
      // no one answers (a forged hello) makes this transport call no UCX function on its address.
      auto peer = ConnectAddress(addr, /*connect=*/false);
      if (!peer.ok()) {
        Log(LogLevel::kWarn, "ucx: dropped a hello: {}", peer.status().ToString());
        continue;
      }
      peer_by_instance_[instance] = *peer;
      off = 5 + len;
    }
    auto it = peer_by_instance_.find(instance);
    std::vector<std::byte> bytes(s->payload.begin() + static_cast<std::ptrdiff_t>(off),
                                 s->payload.end());
    if (it == peer_by_instance_.end()) {
      // A peer's later messages (data worker) may overtake its hello (control worker): they wait
      // for it, in order.
      if (held_count_ >= kMaxHeldControl) {
        Log(LogLevel::kWarn, "ucx: dropped a control message from an unknown sender");
        continue;
      }
      held_[instance].push_back(std::move(bytes));
      ++held_count_;
      continue;
    }
    control_ready_.push_back(ControlMessage{it->second, std::move(bytes)});
    if (p[0] == kKindHello) {
      for (auto& b : Unhold(instance))
        control_ready_.push_back(ControlMessage{it->second, std::move(b)});
    }
  }
}

bool UcxTransport::ArmWakeup() {
  if (wakeup_fd_ < 0 || !control_ready_.empty() || !control_in_.empty()) return false;
  // Progress drives the control worker only now and then: whatever it has waiting is taken
  // before the sleep, not found by the arm (busy) over and over.
  if (ucp_worker_progress(ctrl_worker_.get()) != 0) {
    ctrl_active_ = true;
    return false;
  }
  // UCS_ERR_BUSY: events came since the last progress; the caller drives it and arms again.
  return ucp_worker_arm(ctrl_worker_.get()) == UCS_OK &&
         ucp_worker_arm(data_worker_.get()) == UCS_OK;
}

std::deque<std::vector<std::byte>> UcxTransport::Unhold(uint64_t instance) {
  auto it = held_.find(instance);
  if (it == held_.end()) return {};
  std::deque<std::vector<std::byte>> out = std::move(it->second);
  held_.erase(it);
  held_count_ -= out.size();
  return out;
}

std::optional<ControlMessage> UcxTransport::PollControl() {
  // A caller that drove Progress and then takes messages until none is left (the progress loop)
  // finds nothing new by driving it again at once: that second look is skipped.
  if (control_ready_.empty() && !just_progressed_) Progress();
  if (control_ready_.empty()) {
    just_progressed_ = false;
    return std::nullopt;
  }
  ControlMessage m = std::move(control_ready_.front());
  control_ready_.pop_front();
  return m;
}

bool UcxTransport::Progress() {
  bool any = false;
  for (int i = 0; i < progress_spin_; ++i) any |= ucp_worker_progress(data_worker_.get()) != 0;
  // The control worker carries the hellos, byes and the peer-error endpoints' keepalives and error
  // events (TCP: each of its progress calls is an epoll_wait system call, the most of an empty
  // Progress). Once peers said hello its traffic is rare: it is driven while it has something to
  // do and otherwise at most every kCtrlProgressPeriod (ArmWakeup drives it before a sleep).
  const auto now = std::chrono::steady_clock::now();
  if (ctrl_active_ || now >= next_ctrl_progress_) {
    ctrl_active_ = ucp_worker_progress(ctrl_worker_.get()) != 0;
    any |= ctrl_active_;
    next_ctrl_progress_ = now + kCtrlProgressPeriod;
  }
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
  just_progressed_ = true;
  return any || control_ready_.size() != before;
}

StatusOr<std::unique_ptr<TransportOp>> UcxTransport::Send(PeerId peer, uint64_t tag,
                                                          const void* buf, size_t bytes,
                                                          MemoryKind kind) {
  KVF_RETURN_IF_ERROR(CheckKind(kind));
  if (tag & kCtrlBit) return Status::InvalidArgument("ucx data tags have 63 bits");
  KVF_ASSIGN_OR_RETURN(Peer * p, ReadyPeer(peer));
  if (p->dead) return Dead(peer, bytes);
  auto s = NewOp(peer, false);
  s->bytes = bytes;
  ucp_request_param_t prm = Param(s.get(), kind, false);
  ucs_status_ptr_t r = ucp_tag_send_nbx(p->data_ep, buf, bytes, tag, &prm);
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
  ucs_status_ptr_t r = ucp_tag_recv_nbx(data_worker_.get(), buf, capacity, tag, ~uint64_t{0}, &prm);
  return Posted(std::move(s), r, "ucp_tag_recv_nbx");
}

void UcxTransport::Cancel(TransportOp& op) {
  auto* mine = dynamic_cast<UcxOp*>(&op);
  if (mine == nullptr || mine->Done()) return;
  OpState& s = mine->state();
  if (s.owner != this || !s.request) return;
  if (s.is_recv) ucp_request_cancel(data_worker_.get(), s.request);  // completes it synchronously
  // Sends: UCX can't take back a send the peer may be reading; it completes on its own.
}

}  // namespace ucx_detail

StatusOr<std::unique_ptr<Transport>> CreateUcxTransport(const TransportOptions& options) {
  return ucx_detail::UcxTransport::Create(options);
}

}  // namespace kvferry
