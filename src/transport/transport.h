// Transport: moves bytes between the ranks of different processes (or hosts).
//
// Why this seam: the transceiver must run over UCX (shared memory, TCP, RDMA, cuda_ipc behind one
// API), MPI, and an in-process fake for unit tests, with one protocol. All three offer two-sided
// tagged messages with receiver-side matching on (peer, tag), which is all the protocol needs:
// large messages land directly in the posted receive buffer (rendezvous), so a fragment that is
// contiguous on both sides moves pool to pool with no staging copy, and a sender's buffer stays
// busy until its receive is matched, which bounds staging memory on both sides. Transports that
// also offer one-sided Put (UCX) say so in their capabilities.
//
// Addressing: LocalAddress() returns opaque bytes that go into context handles; Connect() on the
// other side turns them into a PeerId. Control messages are small self-describing byte strings
// delivered to PollControl() of the receiver with the sender's PeerId (connecting back lazily).
//
// Completion: Send/Recv return an Op immediately. An Op is complete when Done(); a send's buffer
// may be reused then, a receive's bytes are visible then. Nothing completes without Progress(),
// which the caller drives (one progress thread per transport). Every op can be cancelled; a
// peer's failure completes its ops with kUnavailable.
//
// Thread-safety: thread-compatible. The owner calls every method from one thread at a time (the
// transceiver's progress thread).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kvferry/device.h"
#include "kvferry/status.h"

namespace kvferry {

using PeerId = int32_t;
inline constexpr PeerId kAnyPeer = -1;

struct TransportCaps {
  std::string name;             // "inproc", "ucx", "mpi"
  int tag_bits = 64;            // usable bits of a data tag
  bool device_memory = false;   // Send/Recv accept MemoryKind::kDevice buffers
  bool one_sided = false;       // Put is implemented
  size_t max_control_bytes = 0; // largest control message
};

// One posted send or receive.
class TransportOp {
 public:
  virtual ~TransportOp() = default;
  virtual bool Done() const = 0;
  // OK, or why it failed (kCancelled, kUnavailable for a dead peer, kInvalidArgument for a
  // message larger than the receive buffer). Meaningful once Done().
  virtual Status status() const = 0;
  virtual size_t bytes() const = 0;  // bytes received (receive ops)
};

struct ControlMessage {
  PeerId from = kAnyPeer;
  std::vector<std::byte> bytes;
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual const TransportCaps& caps() const = 0;
  virtual std::string LocalAddress() const = 0;
  // Connects (or returns the existing connection) to the address another transport reported.
  virtual StatusOr<PeerId> Connect(std::string_view address, Deadline deadline) = 0;

  // Data plane. `buf` must stay valid until the op is Done.
  virtual StatusOr<std::unique_ptr<TransportOp>> Send(PeerId peer, uint64_t tag, const void* buf,
                                                      size_t bytes, MemoryKind kind) = 0;
  virtual StatusOr<std::unique_ptr<TransportOp>> Recv(PeerId peer, uint64_t tag, void* buf,
                                                      size_t capacity, MemoryKind kind) = 0;
  // Completes `op` with kCancelled if it has not completed (the buffer is free once Done()).
  virtual void Cancel(TransportOp& op) = 0;

  // Control plane: copied at the call; delivered in order per (sender, receiver) pair.
  virtual Status SendControl(PeerId peer, std::span<const std::byte> bytes) = 0;
  virtual std::optional<ControlMessage> PollControl() = 0;

  // Drives all outstanding operations; returns true if anything happened.
  virtual bool Progress() = 0;
};

}  // namespace kvferry
