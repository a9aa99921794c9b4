// The UCX transport's teardown: the destructor and its steps (ucx_transport_impl.h declares
// them). A transport being destroyed cancels its pending data receives, says bye to every live
// peer it has endpoints to (ucx_transport.cc describes the control payload), closes its endpoints
// and waits, within transport.close_timeout_ms, for UCX to hand back every request before the
// workers go.
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <utility>
#include <vector>

#include "base/log.h"
#include "kvferry/config.h"
#include "transport/ucx_transport_impl.h"

namespace kvferry::ucx_detail {

// Teardown, in order: no peer's data may land in a receive after the byes; the byes go out
// before the endpoints close; UCX hands back every request before the workers go; states stay
// alive until then.
UcxTransport::~UcxTransport() {
  if (!data_worker_) return;
  const Deadline deadline =
      DeadlineIn(std::chrono::milliseconds(Config::Global().Int("transport.close_timeout_ms")));
  CancelDataReceives();
  SendByes(deadline);
  CloseEndpoints();
  AwaitClosed(deadline);
  const std::vector<std::shared_ptr<OpState>> keep = EndInflight();
  if (wakeup_fd_ >= 0) ::close(wakeup_fd_);
  data_worker_.reset();
  ctrl_worker_.reset();
  context_.reset();
}

void UcxTransport::ProgressWorkers() {
  ucp_worker_progress(ctrl_worker_.get());
  ucp_worker_progress(data_worker_.get());
}

void UcxTransport::CancelDataReceives() {
  // Completes them synchronously with UCS_ERR_CANCELED. Control receives complete at once.
  std::vector<OpState*> recvs;
  for (auto& [p, s] : inflight_) {
    if (s->is_recv && s->request && s->payload.empty()) recvs.push_back(p);
  }
  for (OpState* s : recvs) {
    if (inflight_.count(s) && s->request) {
      s->forced = Status::Cancelled("ucx transport destroyed");
      ucp_request_cancel(data_worker_.get(), s->request);
    }
  }
}

void UcxTransport::SendByes(Deadline deadline) {
  std::vector<std::shared_ptr<OpState>> byes;
  for (size_t i = 0; i < peers_.size(); ++i) {
    if (peers_[i].dead || peers_[i].ctrl_ep == nullptr) continue;  // never answered: nothing to end
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
  while (!byes_done() && Clock::now() < bye_deadline) ProgressWorkers();
}

void UcxTransport::CloseEndpoints() {
  // Endpoints in error mode PEER are force-closed, as a flushing close would wait for peers that
  // may be gone or not progressing; peers learn of it from the bye (or keepalive). Error mode
  // NONE does not allow force: flush-close within the deadline (AwaitClosed), then destroy the
  // workers. Dead peers' endpoints (error mode NONE) may never finish closing: don't wait for
  // them.
  for (void* r : closing_) ucp_request_free(r);
  closing_.clear();
  for (Peer& peer : peers_) {
    peer.rkeys.clear();
    peer.last_key = nullptr;
    CloseEp(std::exchange(peer.data_ep, nullptr), data_peer_errors_);
    CloseEp(std::exchange(peer.ctrl_ep, nullptr), ctrl_peer_errors_);
  }
}

bool UcxTransport::RequestsPending() const {
  for (const auto& [p, s] : inflight_) {
    // Error mode NONE: a detached op's peer is gone and its request never ends; don't wait.
    if (s->request && (data_peer_errors_ || !s->done)) return true;
  }
  return false;
}

void UcxTransport::AwaitClosed(Deadline deadline) {
  // Closing completes the endpoints' requests (force: cancelled; flush: when done): wait for
  // them too.
  while ((!closing_.empty() || RequestsPending()) && Clock::now() < deadline) {
    ProgressWorkers();
    std::erase_if(closing_, [](void* r) {
      if (ucp_request_check_status(r) == UCS_INPROGRESS) return false;
      ucp_request_free(r);
      return true;
    });
  }
  if (!closing_.empty()) {
    Log(LogLevel::kWarn, "ucx: {} endpoint(s) did not close within the deadline; destroying",
        closing_.size());
    for (void* r : closing_) ucp_request_free(r);
    closing_.clear();
  }
}

std::vector<std::shared_ptr<OpState>> UcxTransport::EndInflight() {
  // What UCX did not complete, we do (ucp_request_free: no callback will follow); buffers are
  // released with the workers.
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
  return keep;
}

}  // namespace kvferry::ucx_detail
