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
// Addressing: LocalAddress() returns opaque printable text that goes into context handles;
// Connect() on the other side turns it into a PeerId. Control messages are small self-describing
// byte strings delivered to PollControl() of the receiver with the sender's PeerId (the receiver
// connects back lazily, so a reply needs no Connect()).
//
// Matching: a data receive matches a send with the same tag. Tags are unique per receiver among
// messages in flight (the protocol numbers them per (transfer, chunk)); a tag must fit in
// caps().tag_bits bits. Transport by transport:
//   - inproc, mpi: matching is on (peer, tag); kAnyPeer matches any sender.
//   - ucx: matching is on the tag alone; `peer` only says whose death fails the receive (UCX tag
//     receives carry no source). Two peers must not send the same tag to one receiver at once.
//
// Completion: Send/Recv/Put/Flush return an Op immediately. An Op is complete when Done(); a
// send's buffer may be reused then, a receive's bytes are visible then. Nothing completes without
// Progress(), which the caller drives (one progress thread per transport). Cancel() ends a
// pending receive with kCancelled; sends can't be cancelled (see Cancel). A peer's failure (it
// was destroyed, its process died, or, for inproc, it was killed) completes every pending op
// naming it with kUnavailable: sends, puts, flushes and receives posted with that PeerId (not
// kAnyPeer receives). When: a destroyed peer says so (ucx: a "bye" control message; inproc: at
// once); a crashed one is noticed only when caps().detects_crashed_peers (ucx unless
// ucx.error_mode=none: its control endpoint's transport error or keepalive, ucx.keepalive_ms). mpi:
// no detection, a dead rank makes mpirun abort the job. Callers keep their own deadlines
// regardless.
//
// Ops: an Op may be destroyed at any time, but the buffer it names must stay valid until the op
// is Done or the transport is destroyed (destroying an op does not cancel it). Ops may outlive
// their transport: the transport completes (cancels) every pending op when destroyed.
//
// Thread-safety: thread-compatible. The owner calls every method from one thread at a time (the
// transceiver's progress thread). Several transports of one process may be driven by different
// threads. Ops' Done()/status()/bytes() are read by the thread that drives Progress().
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvferry/device.h"
#include "kvferry/status.h"

#pragma GCC visibility push(default)  // the public API (kvferry/export.h)
namespace kvferry {

using PeerId = int32_t;
inline constexpr PeerId kAnyPeer = -1;

struct TransportCaps {
  std::string name;            // "inproc", "ucx", "mpi"
  int tag_bits = 64;           // usable bits of a data tag (ucx 63, mpi from MPI_TAG_UB)
  bool device_memory = false;  // Send/Recv/Put accept MemoryKind::kDevice buffers
  // With device_memory: Send/Recv take them too (false for nixl, whose tagged messages travel in
  // notifications: GPU memory only by RegisterMemory/Put/Get).
  bool device_memory_tagged = true;
  bool one_sided = false;  // RegisterMemory/Put/Flush are implemented
  // A peer that dies without shutting down (crash, kill -9) fails pending ops with kUnavailable.
  // When false (ucx with ucx.error_mode=none, mpi) only an orderly shutdown is noticed; callers
  // rely on their own deadlines.
  bool detects_crashed_peers = false;
  size_t max_control_bytes = 0;  // largest control message
};

// One posted send, receive, put or flush.
class TransportOp {
 public:
  virtual ~TransportOp() = default;
  virtual bool Done() const = 0;
  // OK, or why it failed (kCancelled, kUnavailable for a dead peer, kInvalidArgument for a
  // message larger than the receive buffer). Meaningful once Done().
  virtual Status status() const = 0;
  virtual size_t bytes() const = 0;  // bytes received (receive ops), bytes sent otherwise
};

// A memory region registered for one-sided access. Move-only owner: deregisters when destroyed
// (it must not outlive its transport). PackedKey() travels to peers, which Put into the region
// at addresses [address(), address() + size()). A region the transport allocated
// (RegisterMemory with ptr == nullptr) is also used locally at address(), and freed with it.
class MemoryRegistration {
 public:
  virtual ~MemoryRegistration() = default;
  virtual std::span<const std::byte> PackedKey() const = 0;
  virtual uint64_t address() const = 0;
  virtual size_t size() const = 0;
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
  // A malformed address is kInvalidArgument; an unreachable one kUnavailable.
  virtual StatusOr<PeerId> Connect(std::string_view address, Deadline deadline) = 0;

  // Data plane. `buf` must stay valid until the op is Done. A receive of a message larger than
  // `capacity` completes with kInvalidArgument (its buffer contents are then unspecified).
  virtual StatusOr<std::unique_ptr<TransportOp>> Send(PeerId peer, uint64_t tag, const void* buf,
                                                      size_t bytes, MemoryKind kind) = 0;
  virtual StatusOr<std::unique_ptr<TransportOp>> Recv(PeerId peer, uint64_t tag, void* buf,
                                                      size_t capacity, MemoryKind kind) = 0;
  // A receive not yet matched completes with kCancelled at once (one already being filled by a
  // rendezvous completes as it would have). Sends: inproc cancels at once; ucx and mpi can't
  // take back a send the peer may be reading, so Cancel has no effect on them: the op completes
  // when the receiver matches it, the peer dies, or the transport is destroyed (kCancelled).
  // No-op on a Done op.
  virtual void Cancel(TransportOp& op) = 0;

  // Control plane: copied at the call; delivered in order per (sender, receiver) pair.
  virtual Status SendControl(PeerId peer, std::span<const std::byte> bytes) = 0;
  virtual std::optional<ControlMessage> PollControl() = 0;

  // Drives all outstanding operations; returns true if anything happened.
  virtual bool Progress() = 0;

  // Sleeping until a control message comes, instead of polling for it (optional: -1 and false
  // mean the transport has no such fd, and the caller polls). WakeupFd() is a file descriptor,
  // owned by the transport, that becomes readable when a control message may have arrived since
  // the last ArmWakeup() that returned true; it says nothing of data operations (they complete
  // only when Progress drives them). ArmWakeup() returns false when something already waits
  // (PollControl and Progress first, then arm again). Both on the thread that calls Progress.
  virtual int WakeupFd() { return -1; }
  virtual bool ArmWakeup() { return false; }

  // One-sided (caps().one_sided; otherwise kUnavailable). Put writes `bytes` from `local` to
  // `remote_addr` inside a peer's registration whose PackedKey() is `rkey`; it completes when
  // `local` may be reused (local completion: the bytes need not be visible remotely yet).
  // A range outside that registration is refused with kInvalidArgument before any byte moves
  // (by the call, or by its op; ucx: locally, as its packed key carries the registration's
  // address and size); a key that is not a packed key too.
  // Flush completes when every Put issued to `peer` before it is visible in the peer's memory.
  // RegisterMemory(nullptr, bytes, kind) lets the transport allocate the region, in the memory
  // peers reach fastest (ucx on one host: shared memory, so a Put is one copy; user memory is
  // reached through CMA). User memory may be host or, with caps().device_memory, GPU memory
  // (kind kDevice; cuda_ipc on one host).
  virtual StatusOr<std::unique_ptr<MemoryRegistration>> RegisterMemory(void* ptr, size_t bytes,
                                                                       MemoryKind kind);
  virtual StatusOr<std::unique_ptr<TransportOp>> Put(PeerId peer, const void* local, size_t bytes,
                                                     MemoryKind kind, uint64_t remote_addr,
                                                     std::span<const std::byte> rkey);
  virtual StatusOr<std::unique_ptr<TransportOp>> Flush(PeerId peer);
  // Reads `bytes` at `remote_addr` of a peer's registration into `local`; complete (and the
  // bytes in `local`) when Done. Same rules as Put.
  virtual StatusOr<std::unique_ptr<TransportOp>> Get(PeerId peer, void* local, size_t bytes,
                                                     MemoryKind kind, uint64_t remote_addr,
                                                     std::span<const std::byte> rkey);
  // What carries data to `peer`, for benchmark rows and logs (ucx: the UCX transports and
  // devices of its endpoints, e.g. "data posix/memory cma/memory; control tcp/lo").
  virtual std::string DescribePeer(PeerId peer);
};

class InProcFabric;  // kvferry/inproc_transport.h

struct TransportOptions {
  std::string name = "inproc";  // "inproc" | "ucx" | "mpi"
  // inproc: the fabric the transport joins; transports reach each other only on one fabric.
  std::shared_ptr<InProcFabric> fabric;
  // kDevice buffers are host memory (the CPU device): every transport accepts them. When false,
  // kDevice means GPU memory: accepted only by a UCX built with CUDA (caps().device_memory).
  bool device_memory_is_host = true;
};

// "inproc" needs options.fabric. kUnavailable (with why) when the named transport is not compiled
// in or can't start; kInvalidArgument for an unknown name.
StatusOr<std::unique_ptr<Transport>> CreateTransport(const TransportOptions& options);

// Names compiled into this build, "inproc" first.
std::vector<std::string> AvailableTransports();

// Waits until `op` is Done, driving `transport`; kDeadlineExceeded (op still pending) at the
// deadline, else op.status().
Status WaitOp(Transport& transport, TransportOp& op, Deadline deadline);

}  // namespace kvferry
#pragma GCC visibility pop
