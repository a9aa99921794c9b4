// Same-run baselines of `kvferry bench transfer`: raw transport bandwidth between context rank 0
// and generation rank 0 (the same processes, the same memory kind as the pools: GPU memory on a
// GPU whose transport takes it), and one copy of the same bytes inside one process (memcpy
// between two paged-in buffers on the CPU, one cudaMemcpy on a GPU): the one-copy limit of any
// transfer on one host.
#pragma once

#include <string>

#include "kvferry/device.h"
#include "selftest/selftest_config.h"

namespace kvferry {

struct BaselineResult {
  double gbps = 0;
  std::string name;  // what was measured: method, memory, message size
};

// Raw transport bandwidth: the faster of one-sided put (when the transport has it) and tagged
// send, 4 MiB messages, 16 in flight, BaselineBytes(cfg) in all. Context rank 0 sends, generation
// rank 0 receives (it runs BaselineReceiver at the same time); other ranks run the bystander
// (MPI transports are created collectively). The sender hands its result and `copy` (its
// CopyBaseline, measured first) to the receiver, so that a generation instance started on
// another host (`kvferry instance --bench`) reports both.
StatusOr<BaselineResult> BaselineSender(const SelftestConfig& cfg, const TransportMaker& make,
                                        Device& dev, const BaselineResult& copy);
struct ReceivedBaselines {
  BaselineResult raw, copy;
};
StatusOr<ReceivedBaselines> BaselineReceiver(const SelftestConfig& cfg, const TransportMaker& make,
                                             Device& dev);
Status BaselineBystander(const SelftestConfig& cfg, const TransportMaker& make);

// One copy of min(BaselineBytes, 256 MiB) between two buffers of the pools' memory kind, pages
// touched first (the best of three); on the CPU the faster of the device's copy and memcpy.
StatusOr<BaselineResult> CopyBaseline(const SelftestConfig& cfg, Device& dev);

}  // namespace kvferry
