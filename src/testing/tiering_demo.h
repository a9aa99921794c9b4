// A short narrated run of the tiered KV cache, for `kvferry demo tiering` and scripts/demo:
// conversations sharing a system prompt go through a small primary pool, evictions offload to the
// host tier and then the file tier, and a second round of the same conversations hits the prefix
// in every tier and onboards it; every reused block is checked byte for byte.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include "kvferry/block_manager.h"
#include "kvferry/device.h"

namespace kvferry {

struct TieringDemoOptions {
  int32_t conversations = 10;
  int32_t rounds = 2;
  int64_t primary_blocks = 8;
  int64_t host_blocks = 6;
  int64_t file_slots = 6;  // 0: no file tier
  LayoutKind layout = LayoutKind::kBlockMajor;
};

struct TieringDemoReport {
  BlockManagerStats stats;
  TransferStats transfers;
  int64_t events[3] = {0, 0, 0};  // stored, moved, removed
  int64_t reused_tokens = 0, prompt_tokens = 0;
  int64_t verified_blocks = 0;
  std::string file_backend;
};

// Bytes of one demo block (the slot payload a file tier for the demo needs).
int64_t TieringDemoBlockBytes();

// `file`: the file tier to use (not owned), or null for an in-memory one (MemorySlabStore).
// `say` gets one line per step.
StatusOr<TieringDemoReport> RunTieringDemo(Device& device, const TieringDemoOptions& options,
                                           SlabStore* file,
                                           const std::function<void(std::string_view)>& say);

}  // namespace kvferry
