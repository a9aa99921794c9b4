// FaultyTransport: a TransportWrapper that injects one deterministic fault at one step of the
// transfer protocol, for the fault-point matrix (fault_matrix_test.cc), `kvferry soak` and
// `kvferry selftest --fault`.
//
// Steps are recognized on the wire: control messages by their decoded type (FETCH, ACCEPT,
// REJECT, CREDIT, DONE, COMPLETE, ABORT), whether this transport sends them or receives them (a
// context rank sees FETCH arrive, a generation rank sees it leave); DATA is a chunk's data
// operation: a Send or Put on the sending side (one-sided: each put of a chunk's rows counts), a
// posted Recv or an arriving CHUNK message (one-sided: "chunk k is in place") on the receiving
// side. The fault
// fires at the Nth occurrence of the step on this transport (counted from construction or the
// last Arm), once:
//   crash      the step happens, then the transport dies before anything else: `crash` is called
//              (inproc: InProcFabric::Kill; a process: _exit) at the next call into the wrapper
//   stall      the step and every later one of its direction (control out, control in) are held
//              until `stall` has passed, in order; a data op's completion is hidden as long
//   drop       the message vanishes; a data send completes without sending; a posted receive
//              never completes (its bytes are swallowed) until cancelled
//   duplicate  the message is delivered twice; a data send is sent twice (a copy of the bytes),
//              a receive is posted twice (the second, into scratch, lingers)
//   corrupt    one byte is flipped (a control message's middle byte; a chunk's middle byte, in a
//              copy for a send, in place once a receive completes); device memory is not touched
// Operations the wrapper adds itself (duplicates, swallowed receives) are cancelled `stall` after
// they were posted, and their buffers are owned by the wrapper until they are done.
//
// Thread-safety: as Transport (one owner thread); fired() and Arm() may be called from any thread.
#pragma once

#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <limits>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "kvferry/transport_wrapper.h"

namespace kvferry {

enum class FaultStep : uint8_t {
  kFetch,
  kAccept,
  kReject,
  kCredit,
  kData,
  kDone,
  kComplete,
  kAbort
};
enum class FaultKind : uint8_t { kCrash, kStall, kDrop, kDuplicate, kCorrupt };
inline constexpr FaultStep kAllFaultSteps[] = {
    FaultStep::kFetch, FaultStep::kAccept, FaultStep::kReject,   FaultStep::kCredit,
    FaultStep::kData,  FaultStep::kDone,   FaultStep::kComplete, FaultStep::kAbort};
inline constexpr FaultKind kAllFaultKinds[] = {FaultKind::kCrash, FaultKind::kStall,
                                               FaultKind::kDrop, FaultKind::kDuplicate,
                                               FaultKind::kCorrupt};
std::string_view FaultStepName(FaultStep step);  // "FETCH", ..., "DATA"
std::string_view FaultKindName(FaultKind kind);  // "crash", ...

struct FaultSpec {
  FaultStep step = FaultStep::kData;
  int64_t nth = 1;  // fires at the nth occurrence (1-based)
  FaultKind kind = FaultKind::kDrop;
  std::chrono::milliseconds stall{500};  // stall length; lingering added ops are cancelled after it
};

// Where a fault goes in a cluster: "ctx:1:CREDIT:3:crash" or "gen:0:DATA:2:stall:800" (side, rank,
// step, nth, kind, stall ms). Names are case-insensitive; errors name the bad field.
struct FaultPoint {
  bool context = true;
  int rank = 0;
  FaultSpec spec;
};
StatusOr<FaultPoint> ParseFaultPoint(std::string_view text);
std::string FaultPointString(const FaultPoint& point);

class FaultyTransport final : public TransportWrapper {
 public:
  // `crash` makes the transport (or the process) die; it is called once, on the owner thread.
  FaultyTransport(std::unique_ptr<Transport> target, FaultSpec spec, std::function<void()> crash);
  ~FaultyTransport() override;

  // Replaces the fault and restarts counting (the soak arms a fresh fault now and then).
  void Arm(FaultSpec spec);
  // How many times a fault fired since construction.
  int64_t fired() const { return fired_.load(); }
  // A fault is armed and has not fired yet.
  bool armed() const {
    std::lock_guard lock(arm_mu_);
    return armed_ && spec_.nth != std::numeric_limits<int64_t>::max();
  }

  StatusOr<std::unique_ptr<TransportOp>> Send(PeerId peer, uint64_t tag, const void* buf,
                                              size_t bytes, MemoryKind kind) override;
  StatusOr<std::unique_ptr<TransportOp>> Recv(PeerId peer, uint64_t tag, void* buf, size_t capacity,
                                              MemoryKind kind) override;
  StatusOr<std::unique_ptr<TransportOp>> Put(PeerId peer, const void* local, size_t bytes,
                                             MemoryKind kind, uint64_t remote_addr,
                                             std::span<const std::byte> rkey) override;
  void Cancel(TransportOp& op) override;
  Status SendControl(PeerId peer, std::span<const std::byte> bytes) override;
  std::optional<ControlMessage> PollControl() override;
  bool Progress() override;

 private:
  struct Held {
    Clock::time_point until;
    PeerId peer;
    std::vector<std::byte> bytes;
  };
  struct Extra {  // an op the wrapper posted itself, with the buffer it names
    Clock::time_point cancel_at;
    std::vector<std::byte> buffer;
    std::shared_ptr<TransportOp> op;
  };

  // True when this occurrence of `step` is the one the fault is armed for.
  std::optional<FaultSpec> Hit(FaultStep step);
  void MaybeCrash();
  using PostFn = std::function<StatusOr<std::unique_ptr<TransportOp>>(const void* buf)>;
  // A chunk leaving (Send or Put): `post` posts it from a buffer of `bytes`.
  StatusOr<std::unique_ptr<TransportOp>> DataOut(const void* buf, size_t bytes, MemoryKind kind,
                                                 const PostFn& post);
  bool FlushHeld();
  bool ReapExtras();

  mutable std::mutex arm_mu_;
  FaultSpec spec_;               // guarded by arm_mu_
  std::vector<int64_t> counts_;  // guarded by arm_mu_: occurrences per step
  bool armed_ = true;            // guarded by arm_mu_
  std::atomic<int64_t> fired_{0};
  std::function<void()> crash_;
  bool crash_pending_ = false;
  bool crashed_ = false;
  std::deque<Held> out_held_;          // stalled outgoing control messages, in order
  std::deque<Held> in_held_;           // stalled incoming control messages, in order
  std::deque<ControlMessage> in_dup_;  // duplicates to deliver next
  std::deque<Extra> extras_;
};

}  // namespace kvferry
