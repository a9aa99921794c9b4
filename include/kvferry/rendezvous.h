// Rendezvous: what the instances of a disaggregated deployment must exchange, and a default way to
// exchange it that needs no extra service.
//
// What travels: every rank's transport address (ContextSide/GenerationSide::address(), gathered
// into SetInstanceAddresses on every context rank), the context instance's secret (shared by its
// ranks; handles' access tokens derive from it) and context handles (from the context instance
// to the generation instance that fetches the request). Engines that already have a control
// plane (a router, etcd, a Dynamo component) implement `Rendezvous` over it; everyone else runs
// `RendezvousServer` in any one process (the router, or context rank 0) and connects with
// `ConnectRendezvous` from every rank, across hosts, over plain TCP.
//
// Trust: every request and reply carries SipHash-2-4-128 tags under the group key that all
// participants share, over its bytes and its connection's two random nonces, and requests are
// numbered on their connection. A peer without the key (or with a stale one), an altered
// message, a message replayed from another connection or garbage is refused with a clear error.
// Nothing is encrypted: whoever reads the network reads the values (see docs/wire_format.md,
// "Rendezvous", and docs/security.md).
//
// Completion: every call returns when the server answered or the deadline passed; Get waits for
// a key to appear until its deadline (the server holds the request until a Put brings the key).
// Thread-safety: a Rendezvous and a RendezvousServer are thread-safe.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvferry/device.h"
#include "kvferry/status.h"

#pragma GCC visibility push(default)  // the public API (kvferry/export.h)
namespace kvferry {

using RendezvousKey = std::array<uint8_t, 16>;
inline constexpr size_t kMaxRendezvousKeyBytes = 256;
inline constexpr size_t kMaxRendezvousValueBytes = size_t{1} << 20;

// A small key-value exchange shared by the ranks of a deployment.
class Rendezvous {
 public:
  virtual ~Rendezvous() = default;
  // Stores `value` under `key` (printable, 1..kMaxRendezvousKeyBytes bytes), replacing any older
  // value. `value` is at most kMaxRendezvousValueBytes.
  virtual Status Put(std::string_view key, std::span<const std::byte> value, Deadline deadline) = 0;
  // The value under `key`; waits for it to appear until `deadline` (then kDeadlineExceeded).
  virtual StatusOr<std::vector<std::byte>> Get(std::string_view key, Deadline deadline) = 0;
  // Removes `key`; removing a missing key is not an error.
  virtual Status Erase(std::string_view key, Deadline deadline) = 0;
};

// Forwards every call to another Rendezvous (which must outlive it): subclass it to observe or
// inject faults, as LevelDB's EnvWrapper does.
class RendezvousWrapper : public Rendezvous {
 public:
  explicit RendezvousWrapper(Rendezvous& target) : target_(target) {}
  Status Put(std::string_view key, std::span<const std::byte> value, Deadline deadline) override {
    return target_.Put(key, value, deadline);
  }
  StatusOr<std::vector<std::byte>> Get(std::string_view key, Deadline deadline) override {
    return target_.Get(key, deadline);
  }
  Status Erase(std::string_view key, Deadline deadline) override {
    return target_.Erase(key, deadline);
  }

 private:
  Rendezvous& target_;
};

// What a RendezvousServer holds now, and the most it held so far: for tests and operators.
// "Unverified" connections have not yet sent a request whose tags verify under the group key.
struct RendezvousServerStats {
  int64_t connections = 0;       // open now
  int64_t unverified = 0;        // of those, unverified
  int64_t unverified_bytes = 0;  // input and output buffered for unverified connections
  int64_t peak_unverified_bytes = 0;
  int64_t input_bytes = 0;   // request bytes buffered for verified connections
  int64_t output_bytes = 0;  // reply bytes queued, not yet taken by the kernel
  int64_t peak_input_bytes = 0;
  int64_t peak_output_bytes = 0;
};

// The default server: one thread, in-memory store (at most 64 MiB, 65536 keys), TCP. Peers
// without the key hold at most 128 KiB of it (256 unverified connections, 512 bytes each, each
// closed 2 s after it opened); keyed peers at most 32 MiB each of large (over 64 KiB) requests
// and replies plus 64 KiB of each per connection; a peer that does not read its replies delays
// no one (docs/wire_format.md, "Rendezvous").
class RendezvousServer {
 public:
  // Listens on `host` ("127.0.0.1", "0.0.0.0", a host name) and `port` (0: any free port).
  static StatusOr<std::unique_ptr<RendezvousServer>> Start(std::string_view host, uint16_t port,
                                                           const RendezvousKey& key);
  virtual ~RendezvousServer() = default;
  // "host:port" that clients pass to ConnectRendezvous.
  virtual std::string address() const = 0;
  // Requests refused so far (wrong key, garbage, over a bound): for tests and operators.
  virtual int64_t refused() const = 0;
  // Connections accepted so far (a client keeps its connections between calls).
  virtual int64_t accepted() const = 0;
  // What the server buffers now and at most so far.
  virtual RendezvousServerStats stats() const = 0;
};

// A client of a RendezvousServer at `address` ("host:port"). Keeps its connections open between
// calls (one per thread calling at once, up to 4) and connects again when the server closed one:
// a call fails with kUnavailable when nothing answers there, kInvalidArgument when the server holds
// another key (or the reply is not signed with ours) and kDataLoss for a garbled reply.
StatusOr<std::unique_ptr<Rendezvous>> ConnectRendezvous(std::string_view address,
                                                        const RendezvousKey& key);

// ---- what instances exchange, on any Rendezvous -----------------------------------------------

// A random 16-byte key or secret (from the OS's random source).
RendezvousKey RandomKey();

// Rank `rank` of instance `instance` (a name unique in the deployment, e.g. "ctx-0") publishes
// its transport address; `instance_id` tells restarts of one name apart.
Status PublishRankAddress(Rendezvous& rv, std::string_view instance, uint64_t instance_id,
                          int32_t rank, std::string_view address, Deadline deadline);
// The addresses of ranks 0..ranks-1 of `instance`, waiting until all are published. An entry
// published by another instance id (a stale rank of an earlier run) is refused, naming both ids.
StatusOr<std::vector<std::string>> GatherRankAddresses(Rendezvous& rv, std::string_view instance,
                                                       uint64_t instance_id, int32_t ranks,
                                                       Deadline deadline);

// The instance secret: rank 0 publishes it, the other ranks wait for it. A secret published
// under another instance id is refused.
Status PublishInstanceSecret(Rendezvous& rv, std::string_view instance, uint64_t instance_id,
                             const std::array<uint8_t, 16>& secret, Deadline deadline);
StatusOr<std::array<uint8_t, 16>> FetchInstanceSecret(Rendezvous& rv, std::string_view instance,
                                                      uint64_t instance_id, Deadline deadline);

// Context handles by request id: the context side publishes one, every generation rank of the
// fetching instance waits for it; whoever knows the request is over erases HandleKey(request_id).
std::string HandleKey(uint64_t request_id);
Status PublishHandle(Rendezvous& rv, uint64_t request_id, std::span<const std::byte> handle,
                     Deadline deadline);
StatusOr<std::vector<std::byte>> FetchHandle(Rendezvous& rv, uint64_t request_id,
                                             Deadline deadline);

}  // namespace kvferry
#pragma GCC visibility pop
