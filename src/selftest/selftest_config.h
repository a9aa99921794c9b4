// What a selftest or bench transfer run is (SelftestConfig), its bounds and their check, and the
// facts every part of a run derives from it alone: a request's prompt, a side's request slots,
// the ranks of a DP group, a rank's device. The run (selftest.h), its baselines (baseline.h) and
// its files (run_files.h) all stand on this header; it depends on none of them.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kvferry/kv_model.h"
#include "kvferry/status.h"
#include "kvferry/transport.h"

namespace kvferry {

struct SelftestConfig {
  KvShape shape;  // the context instance's; the generation instance's differs in block size and
                  // dtype only
  // The generation instance's tokens per block (0: shape's); one must be a multiple of the other.
  int32_t gen_tokens_per_block = 0;
  // The generation instance's dtype (none: shape's); the context side converts while packing.
  std::optional<DType> gen_dtype;
  // Each instance's KV scales (SideScales: distinct made-up values per tensor or per head); the
  // context side converts with them when they differ.
  ScaleGranularity ctx_scales = ScaleGranularity::kNone;
  ScaleGranularity gen_scales = ScaleGranularity::kNone;
  ParallelConfig ctx, gen;
  LayoutSpec ctx_layout;  // a named layout or custom strides (LayoutSpec)
  LayoutSpec gen_layout;
  int requests = 8;
  std::vector<int64_t> prompt_tokens{100};  // request i uses prompt_tokens[i % size]
  int concurrency = 4;                      // requests in flight per rank
  // Requests the context instance holds beyond `concurrency`, marked ready and published before
  // the generation side asks for them (a serving context instance has prefilled requests waiting;
  // bench transfer: `concurrency`, so a handle is there when a generation slot frees).
  int ctx_ahead = 0;
  std::string transport = "ucx";
  std::string device = "cpu";
  bool layer_wise = false;
  bool verify = true;
  bool baseline = false;  // also measure raw transport bandwidth
  // Every request starts with the same `shared_prefix_blocks` blocks (a system prompt). Both
  // instances keep them resident; the generation side fetches them once, with the first request,
  // and reuses them afterwards (only the missing blocks move).
  int shared_prefix_blocks = 0;
  // Fault injection: this context rank exits abruptly right after publishing its first request
  // (-1: none). Tests that a crashed peer ends the others' requests within their deadlines.
  int crash_ctx_rank = -1;
  // Fault injection at a protocol step (FaultyTransport): "SIDE:RANK:STEP:NTH:KIND[:STALL_MS]",
  // e.g. "ctx:1:CREDIT:3:crash" (a crash ends the rank's process). Empty: none.
  std::string fault;
  std::chrono::milliseconds timeout{60000};
  // How long a rank (and, kParentGrace more, the parent) waits without progress before it gives up
  // on the rest of the run; 0: StallLimit's default (a deadline + abort grace + 1 s). Longer
  // lets a run outlive a network cut longer than the deadline: the requests in flight fail, the
  // later ones go on once the link is back.
  std::chrono::milliseconds give_up{0};
  std::string dir;  // run directory: results, progress, the stop file
  // The run's RendezvousServer ("host:port") and its group key (32 hex digits).
  std::string rendezvous;
  std::string rendezvous_key;
  // GPU of each rank process (--gpus), cycled over context ranks then generation ranks; empty:
  // the local rank modulo the visible GPUs (device "cuda"), or every rank on "cuda:N".
  std::vector<int> gpus;
  bool checksum = true;  // per-chunk payload checksums (transfer.checksum)
  // Leading requests of each generation rank left out of bytes, seconds and latencies (bench
  // transfer's warm-up: connection setup, first registrations and peer mappings); they are still
  // transferred and checked. Both instances finish their warm-up requests before they start the
  // measured ones, so the control-plane CPU of the measured ones is known apart from set-up.
  int warmup = 0;
  // Each rank serves its side's metrics on 127.0.0.1: context rank r at metrics_port + r,
  // generation rank r at metrics_port + context ranks + r; 0: free ports (each named on stderr);
  // -1: none.
  int metrics_port = -1;
};

// Bounds of a selftest run (ValidateSelftest): ranks of both instances together (all on this
// host), requests (every rank keeps a few words per request of its group), and what the pools
// must hold.
inline constexpr int kSelftestMaxRanks = 64;
inline constexpr int kSelftestMaxRequests = 1'000'000;
// Requests in flight per rank, and the pool bytes of one instance (all its ranks) that the
// requests in flight need: a selftest's pools are sized for tests and benchmarks.
inline constexpr int kSelftestMaxConcurrency = 4096;
inline constexpr int64_t kSelftestMaxPoolBytes = int64_t{64} << 30;

// Makes a rank's transport (the in-process transport needs a shared fabric; otherwise
// cfg.transport).
using TransportMaker = std::function<StatusOr<std::unique_ptr<Transport>>()>;

Status ValidateSelftest(const SelftestConfig& cfg);

// One instance's shape: `shape`, with gen_tokens_per_block on the generation side.
KvShape SideShape(const SelftestConfig& cfg, bool context);
// One instance's KV scales at its granularity (ctx_scales / gen_scales): value i of the context's
// 0.5 + 0.0137 i, of the generation's 0.25 + 0.0071 i (every scale differs from the other side's).
KvScales SideScales(const SelftestConfig& cfg, bool context);
// The device a rank process opens ("cpu", "cuda:N").
std::string RankDevice(const SelftestConfig& cfg, bool context, int rank);
// The prompt tokens of request i.
int64_t TokensOf(const SelftestConfig& cfg, int i);
// Request slots of a side's pool: the generation side keeps `concurrency` requests in flight;
// the context side holds `ctx_ahead` more, marked ready and published before they are fetched.
int SlotsOf(const SelftestConfig& cfg, bool context);
// The ranks of DP group `group` of an instance split `p`, in order.
std::vector<int> GroupRanks(const KvShape& shape, const ParallelConfig& p, int group);

}  // namespace kvferry
