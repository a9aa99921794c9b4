// Transceiver: ships a request's KV cache from the ranks of a context (prefill) instance to the
// ranks of a generation (decode) instance, whatever the TP / PP / attention-DP split and pool
// layout on each side.
//
// Flow. Every context rank of the DP group that served a request calls MarkReady (or
// BeginLayerWise, then MarkLayersReady as prefill progresses) with the request's block ids; each
// returns the same context handle bytes. The embedding engine's router passes the handle to the
// generation instance, where every rank of the decoding DP group calls Fetch with the handle and
// its destination blocks. Both sides then report each request's end through Poll.
//
// Leases. The context blocks of a request are leased from MarkReady until Poll reports the
// request terminal on that rank: the caller must not free or overwrite them before. The same holds
// for the destination blocks from Fetch on. A terminal state is reported only once every
// transport operation touching those blocks is finished (or cancelled and finished).
//
// Deadlines. Every request has a deadline (knob transfer.timeout_ms or the options); a dead or
// silent peer ends its requests with kTimedOut or kError within it. Nothing waits without one.
//
// Threading. Each side runs one progress thread that owns its transport. All public methods are
// thread-safe and never block on the network; Poll blocks until its own deadline at most.
// MarkReady, BeginLayerWise and Fetch do not wait for the progress thread either: they check their
// arguments, claim the request id and build the handle (or plan) on the caller's thread, so a
// reused id is refused at once, and what fails later arrives through Poll.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kvferry/device.h"
#include "kvferry/metrics.h"
#include "kvferry/pool.h"
#include "kvferry/status.h"
#include "kvferry/transport.h"

#pragma GCC visibility push(default)  // the public API (kvferry/export.h)
namespace kvferry {

enum class TransferState : uint8_t {
  kInit,        // known, nothing moved yet (generation: handle accepted locally)
  kInProgress,  // bytes are moving
  kComplete,    // terminal: every byte this rank sends / receives has been delivered
  kError,       // terminal: refused or failed; see reason
  kTimedOut,    // terminal: the deadline passed
  kCancelled,   // terminal: Cancel was called
};
std::string_view TransferStateName(TransferState state);
inline bool IsTerminal(TransferState s) { return s >= TransferState::kComplete; }

struct TransferStatus {
  uint64_t request_id = 0;
  TransferState state = TransferState::kInit;
  Status reason;       // why, for kError / kTimedOut / kCancelled
  int64_t bytes = 0;   // payload bytes this rank sent or received
  double seconds = 0;  // from MarkReady / Fetch to the terminal state
};

// Counters of one side (one rank), for observability.
struct TransceiverStats {
  int64_t requests_ended = 0;   // requests that reached a terminal state
  double busy_cpu_seconds = 0;  // progress-thread CPU time in iterations that did work
                                // (control plane, posting and completing operations); idle
                                // polling is not counted
  // Leak checks (tests, `kvferry soak`): requests not yet terminal here (their blocks are
  // leased), and staging slots held by chunks being packed, moved or unpacked. Both are 0 once
  // every request this side knew has been reported terminal.
  int64_t live_requests = 0;
  int64_t staging_slots_in_use = 0;
  // All of the progress thread's CPU time so far: busy_cpu_seconds plus idle polling and the
  // wake-ups of its naps (what the side costs a core; as of its latest loop iteration).
  double thread_cpu_seconds = 0;
};

struct TransceiverOptions {
  std::string transport = "ucx";         // "inproc" (tests), "ucx", "mpi"
  std::chrono::milliseconds timeout{0};  // 0: knob transfer.timeout_ms
  int64_t chunk_bytes = 0;               // 0: knob transfer.chunk_bytes
  int64_t staging_chunks = 0;    // 0: knob transfer.staging_chunks (staging = chunks * bytes)
  int64_t direct_min_bytes = 0;  // 0: knob transfer.direct_min_bytes
  // Shared by every rank of a context instance and by no one else: rank 0 makes it with
  // NewInstanceSecret() and the engine distributes it with the addresses (PublishInstanceSecret /
  // FetchInstanceSecret, kvferry/rendezvous.h). Handles' access tokens are keyed by it, so a handle
  // forged without it is refused. ContextSide::Create refuses the all-zero default
  // (anyone could key tokens with it); the generation side does not use it.
  std::array<uint8_t, 16> instance_secret{};
  // Distinguishes generation instances (the same on all of an instance's ranks).
  uint64_t instance_id = 0;
  // Unset: knobs transfer.rma (one-sided puts into registered pools where both transports can)
  // and transfer.checksum (XXH3-64 per chunk, verified by the generation side: kDataLoss).
  std::optional<bool> rma;
  std::optional<bool> checksum;
  // The control-message version this rank speaks; 0: knob transfer.wire_version (11, meeting
  // peers of version 10 in version 10; 10: behave as a version-10 build).
  int wire_version = 0;
  // The instance's KV scales (kv_model.h; every rank of an instance passes the same), for a
  // quantized cache: fp8 with vLLM's per-layer k_scale / v_scale is per tensor. A transfer between
  // instances whose scales or dtypes differ converts each element on the context side. None: 1.
  KvScales kv_scales;
};

// 16 bytes from the OS's random source (getrandom), never all zero: a context instance's secret.
std::array<uint8_t, 16> NewInstanceSecret();

// The sending side, one per context rank.
class ContextSide {
 public:
  // `pool` is this rank's KV pool (its spec names the instance's split and this rank). The device
  // and pool must outlive the ContextSide. kInvalidArgument when options.instance_secret is all
  // zero (the default): every rank of the instance needs the same NewInstanceSecret().
  static StatusOr<std::unique_ptr<ContextSide>> Create(Device& device, const BlockPool& pool,
                                                       const TransceiverOptions& options);
  // For tests and custom transports (kvferry/transport.h; TransportWrapper forwards, for fault
  // injection): takes a ready transport.
  static StatusOr<std::unique_ptr<ContextSide>> Create(Device& device, const BlockPool& pool,
                                                       const TransceiverOptions& options,
                                                       std::unique_ptr<Transport> transport);
  virtual ~ContextSide() = default;

  // This rank's transport address; every rank's address goes into the handles.
  virtual std::string address() const = 0;
  // The addresses of all ranks of this instance, indexed by rank. Required before MarkReady.
  virtual Status SetInstanceAddresses(std::vector<std::string> addresses) = 0;

  // All layers of the request are in `blocks` (block ids, the same on every rank), covering
  // `prompt_tokens` tokens. Returns the context handle (identical bytes on every rank).
  virtual StatusOr<std::vector<std::byte>> MarkReady(uint64_t request_id,
                                                     std::span<const int64_t> blocks,
                                                     int64_t prompt_tokens) = 0;
  // As MarkReady, but no layer is ready yet: bytes of a layer move once it is marked ready.
  virtual StatusOr<std::vector<std::byte>> BeginLayerWise(uint64_t request_id,
                                                          std::span<const int64_t> blocks,
                                                          int64_t prompt_tokens) = 0;
  // The first `local_layers` layers of this rank's stage are ready.
  virtual Status MarkLayersReady(uint64_t request_id, int32_t local_layers) = 0;
  // Local layer `local_layer` (and all before it) is ready once `event` completes; the event
  // must stay alive until the request is terminal.
  virtual Status MarkLayerReadyOn(uint64_t request_id, int32_t local_layer,
                                  std::shared_ptr<Event> event) = 0;

  // Terminal statuses not reported before; waits until at least `at_least` are available or
  // the deadline passes.
  virtual std::vector<TransferStatus> Poll(size_t at_least, Deadline deadline) = 0;
  virtual StatusOr<TransferStatus> Query(uint64_t request_id) const = 0;
  virtual Status Cancel(uint64_t request_id) = 0;
  virtual TransceiverStats stats() const = 0;
  // Counters, queue depths and latency histograms since creation (kvferry/metrics.h).
  virtual TransceiverMetrics metrics() const = 0;
  // Timelines of recently ended requests (the last 256, oldest first, then the slowest ended
  // here when it is older).
  virtual std::vector<RequestTimeline> timelines() const = 0;
};

// The receiving side, one per generation rank.
class GenerationSide {
 public:
  static StatusOr<std::unique_ptr<GenerationSide>> Create(Device& device, const BlockPool& pool,
                                                          const TransceiverOptions& options);
  static StatusOr<std::unique_ptr<GenerationSide>> Create(Device& device, const BlockPool& pool,
                                                          const TransceiverOptions& options,
                                                          std::unique_ptr<Transport> transport);
  virtual ~GenerationSide() = default;

  virtual std::string address() const = 0;
  // Starts fetching the request named in `handle` into `blocks` (block ids on this instance, the
  // same on every rank). The first `reused_blocks` blocks are already held (a reused prefix) and
  // are not moved. Errors here are about the arguments (malformed handle, incompatible shapes,
  // too few blocks, a request of this id live on this rank); later failures (a context rank
  // unreachable) arrive through Poll. Returns without waiting for the progress thread: the
  // request is kInit until its FETCH messages are sent, then kInProgress.
  virtual Status Fetch(std::span<const std::byte> handle, std::span<const int64_t> blocks,
                       int64_t reused_blocks) = 0;
  virtual std::vector<TransferStatus> Poll(size_t at_least, Deadline deadline) = 0;
  virtual StatusOr<TransferStatus> Query(uint64_t request_id) const = 0;
  virtual Status Cancel(uint64_t request_id) = 0;
  virtual TransceiverStats stats() const = 0;
  // Counters, queue depths and latency histograms since creation (kvferry/metrics.h).
  virtual TransceiverMetrics metrics() const = 0;
  // Timelines of recently ended requests (the last 256, oldest first, then the slowest ended
  // here when it is older).
  virtual std::vector<RequestTimeline> timelines() const = 0;
};

}  // namespace kvferry
#pragma GCC visibility pop
