// FaultRig: a context instance and a generation instance in one process over the in-process
// fabric, every rank's transport wrapped in a FaultyTransport (disarmed until armed), with the
// helpers a fault test needs: publish (fill + mark ready), fetch, verify, collect every terminal
// report, and the leak counters of every side. Used by the fault-point matrix test and by
// `kvferry soak`.
//
// Thread-safety: one thread drives a rig; the sides run their own progress threads.
#pragma once

#include <deque>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#include "kvferry/device.h"
#include "kvferry/inproc_transport.h"
#include "kvferry/pool.h"
#include "kvferry/transceiver.h"
#include "testing/faulty_transport.h"

namespace kvferry {

struct RigInstance {
  KvShape shape;
  ParallelConfig parallel;
  LayoutKind layout = LayoutKind::kBlockMajor;
  int64_t blocks = 32;
};

// One terminal status as a rank reported it.
struct RigReport {
  bool context = false;
  int rank = 0;
  TransferStatus status;
};

class FaultRig {
 public:
  // transport: "inproc" (faults may crash a rank: InProcFabric::Kill) or "ucx" (every rank a
  // UCX worker of this process; a crash fault does nothing); options.transport is ignored. The
  // instance secret is set here.
  static StatusOr<std::unique_ptr<FaultRig>> Create(const RigInstance& ctx, const RigInstance& gen,
                                                    TransceiverOptions options,
                                                    const std::string& transport = "inproc");
  ~FaultRig();

  const RigInstance& spec(bool context) const { return context ? ctx_spec_ : gen_spec_; }
  int ranks(bool context) const;
  // Ranks of a DP group of one instance.
  std::vector<int> Group(bool context, int group) const;
  int groups(bool context) const { return spec(context).parallel.dp_size; }
  FaultyTransport& faulty(bool context, int rank) { return *(context ? ctx_t_ : gen_t_)[rank]; }
  ContextSide& ctx(int rank) { return *ctx_[rank]; }
  GenerationSide& gen(int rank) { return *gen_[rank]; }

  // Fills the request's blocks on every rank of the context group with the test data of request
  // `id` and marks it ready (or begins it layer-wise); the handle.
  StatusOr<std::vector<std::byte>> Publish(uint64_t id, const std::vector<int64_t>& blocks,
                                           int64_t tokens, int ctx_group, bool layer_wise);
  // Fetch on every rank of the generation group; the first refusal.
  Status Fetch(std::span<const std::byte> handle, const std::vector<int64_t>& blocks,
               int gen_group);
  // Every generation rank of the group holds request `id`'s elements: OK, or DataLoss naming the
  // first mismatch.
  Status Verify(uint64_t id, const std::vector<int64_t>& blocks, int64_t tokens, int gen_group);
  // Terminal reports of every side so far (waits up to `wait` for at least one when none is ready).
  std::vector<RigReport> PollAll(std::chrono::milliseconds wait);
  // Sums over every side (live requests, staging slots in use, requests ended).
  TransceiverStats Totals() const;
  int64_t FaultsFired() const;
  // Disarms every transport (nothing fires any more).
  void DisarmAll();
  // Kills one rank's transport as a crash would.
  Status Kill(bool context, int rank);

 private:
  FaultRig() = default;

  std::unique_ptr<Device> device_;
  std::shared_ptr<InProcFabric> fabric_;
  RigInstance ctx_spec_, gen_spec_;
  std::deque<BlockPool> ctx_pools_, gen_pools_;  // deque: sides hold references
  std::vector<FaultyTransport*> ctx_t_, gen_t_;  // owned by the sides
  std::vector<std::string> ctx_addr_, gen_addr_;
  std::vector<std::unique_ptr<ContextSide>> ctx_;
  std::vector<std::unique_ptr<GenerationSide>> gen_;
};

// A spec that never fires (for transports that must stay healthy).
inline FaultSpec NeverFault() {
  FaultSpec s;
  s.nth = std::numeric_limits<int64_t>::max();
  return s;
}

}  // namespace kvferry
