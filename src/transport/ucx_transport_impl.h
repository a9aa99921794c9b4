// The UCX transport's class, shared by its sources: ucx_transport.cc (life cycle, endpoints,
// control messages, tagged data) and ucx_rma.cc (registration, remote keys, put/get/flush).
//
// Two workers on one context, and per peer two endpoints:
//   control worker: each peer's control endpoint, which carries the hello (the first control
//     message to a peer). Error mode PEER (unless ucx.error_mode=none): a crashed peer fails it
//     (TCP reset or keepalive), and that fails every op of the peer. UCX refuses shared memory in
//     this mode.
//   data worker: tagged data, one-sided ops and every control message after the hello, each
//     peer's data endpoint (TCP cost a send, an epoll and a receive system call per control
//     message: most of a transfer's control-plane CPU on one host). Error mode NONE
//     (unless ucx.error_mode=peer), so UCX picks its fastest transports on one host: shared
//     memory, CMA, cuda_ipc. A dead peer's data ops are failed by the control endpoint's death.
// Two workers rather than two endpoints on one: UCX pairs the endpoints two workers create to
// each other in creation order, which must not pair a control endpoint with a data endpoint.
#pragma once

#include <ucp/api/ucp.h>

#include <chrono>
#include <deque>
#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "kvferry/transport.h"
#include "transport/ucx_address.h"
#include "transport/ucx_util.h"

namespace kvferry::ucx_detail {

// Byte 0 of a control payload (ucx_transport.cc describes the payload byte by byte).
inline constexpr uint8_t kKindData = 0, kKindHello = 1, kKindBye = 2;

inline constexpr uint64_t kCtrlBit = uint64_t{1} << 63;

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

// A peer's remote key, unpacked on its data endpoint, with the registration it describes.
struct RemoteKey {
  RkeyPtr handle;
  uint64_t base = 0;
  uint64_t size = 0;
};

struct Peer {
  // Both null until the first operation that needs them (ReadyPeer): a sender's hello names an
  // address this transport connects back to only once its owner answers that sender.
  ucp_ep_h ctrl_ep = nullptr;
  ucp_ep_h data_ep = nullptr;
  std::string address;
  UcxWorkerAddresses workers;  // decoded and checked (UcxAddressShape) when the peer was added
  bool dead = false;
  Status death;
  bool hello_sent = false;
  std::unordered_set<OpState*> recvs;                // pending receives naming this peer
  std::unordered_map<std::string, RemoteKey> rkeys;  // by packed key bytes
  const std::pair<const std::string, RemoteKey>* last_key = nullptr;
};

struct EpErrorArg {
  UcxTransport* transport;
  PeerId peer;
};

enum class ErrorMode { kSplit, kPeer, kNone };

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
  int WakeupFd() override { return wakeup_fd_; }
  bool ArmWakeup() override;
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
  // An op that is complete at once with the peer's death.
  std::unique_ptr<TransportOp> Dead(PeerId peer, size_t bytes);
  ucp_request_param_t Param(OpState* s, MemoryKind kind, bool recv) const;
  StatusOr<Peer*> LivePeer(PeerId peer);
  // LivePeer with its endpoints created (first use); a peer whose endpoints can't be made is
  // dead from then on.
  StatusOr<Peer*> ReadyPeer(PeerId peer);
  Status CheckKind(MemoryKind kind) const;
  // The peer of `address`, added when new after decoding and checking the address (no UCX call
  // before that); its endpoints are created now when `connect`, else at first use.
  StatusOr<PeerId> ConnectAddress(const std::string& address, bool connect);
  Status CreateEndpoints(PeerId id);
  StatusOr<ucp_ep_h> CreateEp(ucp_worker_h worker, const std::vector<uint8_t>& address,
                              bool peer_errors, EpErrorArg* arg);
  void CloseEp(ucp_ep_h ep, bool force);
  // The destructor's steps, in its order (ucx_transport.cc says why).
  // Drives both workers once.
  void ProgressWorkers();
  // Cancels every pending data receive, so no peer's data lands in one after the byes.
  void CancelDataReceives();
  // Tells every live peer with endpoints that this transport goes, so their pending ops fail at
  // once instead of at keepalive; waits up to 100 ms (and `deadline`) for the byes to go out.
  void SendByes(Deadline deadline);
  // Closes every endpoint (force in error mode PEER, flush otherwise); the close requests go to
  // closing_, those of earlier closes are released first.
  void CloseEndpoints();
  // The inflight ops whose requests UCX has yet to hand back.
  bool RequestsPending() const;
  // Drives the workers until closing_ and the pending requests are done or `deadline` passes;
  // releases whatever close request is left.
  void AwaitClosed(Deadline deadline);
  // Frees the requests UCX still holds and ends every unfinished op (cancelled, or its forced
  // status); returns the states, which must outlive the workers.
  std::vector<std::shared_ptr<OpState>> EndInflight();
  void MarkDead(PeerId peer, Status why);
  void HandleDeaths();
  void DrainControl();
  // Sets wakeup_fd_ (left -1 where a worker has no event fd).
  void OpenWakeup();
  // Takes the messages held for a sender whose hello has not arrived yet (DrainControl).
  std::deque<std::vector<std::byte>> Unhold(uint64_t instance);
  // Sends a control message; the state lets the caller watch its local completion.
  StatusOr<std::shared_ptr<OpState>> PostControl(PeerId peer, uint8_t kind,
                                                 std::span<const std::byte> bytes);
  // The peer's remote key for `rkey` (unpacked once), after checking that [remote_addr,
  // remote_addr + bytes) lies inside the registration it describes.
  StatusOr<ucp_rkey_h> RemoteKeyFor(Peer& p, std::span<const std::byte> rkey, uint64_t remote_addr,
                                    size_t bytes);

  TransportCaps caps_;
  bool device_is_host_ = true;
  bool cuda_ = false;
  ErrorMode mode_ = ErrorMode::kSplit;
  bool ctrl_peer_errors_ = true;   // control endpoints in error mode PEER
  bool data_peer_errors_ = false;  // data endpoints in error mode PEER
  int progress_spin_ = 1;
  // Progress: the control worker is driven while it reports events, else once a period.
  static constexpr std::chrono::microseconds kCtrlProgressPeriod{100};
  bool ctrl_active_ = true;
  std::chrono::steady_clock::time_point next_ctrl_progress_{};
  // Progress ran since PollControl last found nothing (PollControl skips driving it again).
  bool just_progressed_ = false;
  ContextPtr context_;
  WorkerPtr ctrl_worker_;
  int wakeup_fd_ = -1;  // owned: an epoll fd over both workers' event fds (-1: none)
  WorkerPtr data_worker_;
  std::string address_;
  UcxAddressShape shape_ = UcxAddressShape::Unchecked();  // learned from this transport's address
  uint64_t instance_ = 0;   // random, 63 bits: identifies this transport in control tags
  std::deque<Peer> peers_;  // PeerId -> peer (deque: stable addresses for callbacks)
  std::deque<EpErrorArg> ep_args_;
  std::unordered_map<std::string, PeerId> peer_by_address_;
  std::unordered_map<uint64_t, PeerId> peer_by_instance_;
  std::unordered_map<OpState*, std::shared_ptr<OpState>> inflight_;
  std::deque<std::shared_ptr<OpState>> control_in_;  // control receives, in arrival order
  std::deque<ControlMessage> control_ready_;
  // Control messages of senders not known yet, by instance, until their hello comes (bounded).
  static constexpr size_t kMaxHeldControl = 4096;
  std::unordered_map<uint64_t, std::deque<std::vector<std::byte>>> held_;
  size_t held_count_ = 0;
  std::vector<std::pair<PeerId, ucs_status_t>> deaths_;  // reported by OnEpError
  // Close requests not complete yet: dead peers' endpoints (error mode none); in teardown, all.
  std::vector<void*> closing_;
};

}  // namespace kvferry::ucx_detail
