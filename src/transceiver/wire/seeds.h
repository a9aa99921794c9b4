// The seed inputs of the handle and control-message fuzz targets (fuzz/corpus/handle_fuzz and
// message_fuzz): make_seeds writes them, and wire_golden_test checks that encoding them still
// gives the checked-in bytes (the wire did not change). Each seed file is a mode byte (read by the
// fuzz body: which mutations to apply) followed by the encoded bytes.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "transceiver/wire/handle.h"
#include "transceiver/wire/messages.h"

namespace kvferry {

struct WireSeed {
  std::string target;  // the corpus directory: "handle_fuzz" or "message_fuzz"
  std::string name;
  uint8_t mode = 0;
  std::vector<std::byte> bytes;
};

inline ContextHandle SmallSeedHandle() {
  ContextHandle h;
  h.request_id = 7;
  h.token = {1, 2, 3};
  h.shape = KvShape{4, 4, 8, DType::kBf16, 2, 4};
  h.parallel = ParallelConfig{2, 1, {}, 1, 0};
  h.pool_blocks = 32;
  h.prompt_tokens = 10;
  h.chunk_bytes = 4096;
  h.blocks = {5, 6, 7};
  h.addresses = {"inproc:1", "inproc:2"};
  return h;
}

inline FetchMsg SmallSeedFetch() {
  FetchMsg f;
  f.request_id = 7;
  f.gen_instance = 3;
  f.transfer_id = 1;
  f.shape = KvShape{4, 4, 8, DType::kBf16, 2, 4};
  f.parallel = ParallelConfig{1, 1, {}, 1, 0};
  f.pool_blocks = 16;
  f.prompt_tokens = 10;
  f.chunk_bytes = 1024;
  f.direct_min_bytes = 512;
  f.blocks = {3, 2, 1};
  f.reply_address = "inproc:3";
  return f;
}

inline std::vector<WireSeed> WireSeeds() {
  std::vector<WireSeed> out;
  ContextHandle h = SmallSeedHandle();
  out.push_back({"handle_fuzz", "block_major", 0, EncodeHandle(h)});
  h.layout = LayoutKind::kPerLayer;
  h.layer_wise = true;
  out.push_back({"handle_fuzz", "per_layer_layer_wise", 1 | (5 << 1), EncodeHandle(h)});
  h = SmallSeedHandle();
  h.parallel = ParallelConfig{4, 1, {}, 2, 1};
  h.addresses = {"a", "b", "c", "d"};
  h.ctx_direct = false;
  out.push_back({"handle_fuzz", "dp2", 1 | (3 << 1), EncodeHandle(h)});
  // A custom layout: its split and strides travel (per layer [head][block][kv][token][dim]).
  h = SmallSeedHandle();
  h.layout = LayoutKind::kCustom;
  h.split = RegionSplit::kPerLayer;
  h.strides = {2 * 4 * 8, 0, 4 * 8, 16 * 2 * 4 * 8, 8, 1};
  out.push_back({"handle_fuzz", "custom_layout", 0, EncodeHandle(h)});
  // Scales (issue 26 item 3): an fp8 context with a scale per (layer, kv, head).
  h = SmallSeedHandle();
  h.shape.dtype = DType::kFp8E4M3;
  h.scales.granularity = ScaleGranularity::kHead;
  for (int i = 0; i < 4 * 2 * 4; ++i) h.scales.values.push_back(0.01f * (i + 1));
  out.push_back({"handle_fuzz", "scales_per_head", 0, EncodeHandle(h)});

  const std::pair<const char*, ControlMsg> msgs[] = {
      {"fetch", SmallSeedFetch()},
      {"accept", AcceptMsg{7, 1}},
      {"reject", RejectMsg{7, 1, 1, "no"}},
      {"credit", CreditMsg{7, 1, 4, {}}},
      {"credit_slots", CreditMsg{7, 1, 4, {0, 1, kNoSlot}}},
      {"chunk", ChunkMsg{7, 1, 2, 1, true, 0x1234}},
      {"chunk_complete", ChunkMsg{7, 1, 0, 3, false, 0, true}},
      {"done", DoneMsg{7, 1, 4096}},
      {"abort", AbortMsg{7, 1, 6, "cancelled"}},
      {"complete", CompleteMsg{7, 1}},
      {"sibling", SiblingMsg{7, {1, 2, 3}, 1, 0, {}}},
      {"sibling_failed", SiblingMsg{7, {1, 2, 3}, 0, 4, "timed out"}},
  };
  for (const auto& [name, m] : msgs) out.push_back({"message_fuzz", name, 0, EncodeMessage(m)});
  FetchMsg f = SmallSeedFetch();
  f.layout = LayoutKind::kPerLayer;
  f.parallel = ParallelConfig{2, 2, {}, 1, 0};
  out.push_back({"message_fuzz", "fetch_resealed_tp2pp2", 1 | 16 | (1 << 5), EncodeMessage(f)});
  f = SmallSeedFetch();
  f.checksum = true;
  f.rma = true;
  f.rma_target.pool = {RemoteRegion{}};
  f.rma_target.slot_bytes = 1024;
  f.rma_target.slots = 2;
  out.push_back({"message_fuzz", "fetch_rma", 0, EncodeMessage(f)});
  f = SmallSeedFetch();
  f.layout = LayoutKind::kCustom;
  f.split = RegionSplit::kNone;
  f.strides = {4 * 2 * 4 * 8 + 8, 2 * 4 * 8, 4 * 8, 8, 4 * 8 * 4, 1};
  out.push_back({"message_fuzz", "fetch_custom_layout", 0, EncodeMessage(f)});
  f = SmallSeedFetch();  // an fp8 generation instance with per-tensor scales (per layer K and V)
  f.shape.dtype = DType::kFp8E4M3;
  f.scales = KvScales{ScaleGranularity::kTensor, {1, 2, 3, 4, 0.5f, 0.25f, 0.125f, 8}};
  out.push_back({"message_fuzz", "fetch_scales_per_tensor", 1 | 16, EncodeMessage(f)});
  // Mixed versions: a FETCH of the version before (served), and the VERSION message.
  out.push_back({"message_fuzz", "fetch_v10", 0, EncodeMessage(SmallSeedFetch(), 10)});
  out.push_back({"message_fuzz", "version", 0, EncodeVersionMsg({10, 11})});
  return out;
}

}  // namespace kvferry
