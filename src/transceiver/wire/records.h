// The records the handle and the control messages share (docs/wire_format.md), each described
// once (field_io.h): a KV shape, a parallel config, a layout, the instance they describe
// with its pool size, and a list of block ids.
#pragma once

#include <fmt/format.h>

#include <bit>
#include <cstdint>
#include <vector>

#include "kvferry/kv_model.h"
#include "planner/planner.h"
#include "transceiver/wire/field_io.h"

namespace kvferry::wire {

inline constexpr uint32_t kMaxRanks = 1 << 16;
inline constexpr uint32_t kMaxBlocks = 1 << 24;

// i32 layers, i32 kv_heads, i32 head_dim, u8 dtype, u8 kv_factor, i32 tokens_per_block.
template <typename Io>
void Fields(Io& io, Ref<Io, KvShape> s) {
  io.I32(s.layers, "shape.layers");
  io.I32(s.kv_heads, "shape.kv_heads");
  io.I32(s.head_dim, "shape.head_dim");
  uint8_t dtype = static_cast<uint8_t>(s.dtype);
  io.U8(dtype, "shape.dtype");
  io.Check(dtype <= static_cast<uint8_t>(DType::kInt8),
           [&] { return fmt::format("shape.dtype {} is unknown", dtype); });
  io.Set(s.dtype, dtype);
  uint8_t kv_factor = static_cast<uint8_t>(s.kv_factor);
  io.U8(kv_factor, "shape.kv_factor");
  io.Set(s.kv_factor, kv_factor);
  io.I32(s.tokens_per_block, "shape.tokens_per_block");
}

// i32 tp, i32 pp, u32 n + n x i32 stage_layers, i32 dp_size, i32 dp_rank.
template <typename Io>
void Fields(Io& io, Ref<Io, ParallelConfig> p) {
  io.I32(p.tp, "parallel.tp");
  io.I32(p.pp, "parallel.pp");
  io.List(p.stage_layers, "parallel.stage_layers", Limit{.max = kMaxRanks, .min_bytes = 4},
          [](auto& io, auto& layers) { io.I32(layers, "parallel.stage_layers[]"); });
  io.I32(p.dp_size, "parallel.dp_size");
  io.I32(p.dp_rank, "parallel.dp_rank");
}

// A custom layout's fields: u8 region split, 6 x i64 strides.
template <typename Io>
void CustomLayoutFields(Io& io, Ref<Io, InstanceDesc> d) {
  uint8_t split = static_cast<uint8_t>(d.split);
  io.U8(split, "layout.split");
  io.Check(split <= static_cast<uint8_t>(RegionSplit::kPerLayerKv),
           [&] { return fmt::format("layout.split {} is unknown", split); });
  io.Set(d.split, split);
  for (int a = 0; a < kNumAxes; ++a) {
    auto& stride = d.strides[static_cast<size_t>(a)];
    io.I64(stride, "layout.strides[]");
    io.Check(stride >= 0,
             [&] { return fmt::format("layout.strides[{}] {} is negative", a, stride); });
  }
}

// Bit 7 of the layout byte: the instance's KV scales follow its layout's fields.
inline constexpr uint8_t kScalesFollow = 0x80;
inline constexpr uint32_t kMaxScales = 1 << 20;

// u8 granularity (1 per tensor, 2 per head, 3 per block), u32 n, n x f32 (the bits of each scale;
// none per block: those live in the pools and travel in the chunks). The planner checks the count
// against the shape and every value (finite, positive).
template <typename Io>
void ScaleFields(Io& io, Ref<Io, KvScales> s) {
  uint8_t g = static_cast<uint8_t>(s.granularity);
  io.U8(g, "scales.granularity");
  io.Check(g >= static_cast<uint8_t>(ScaleGranularity::kTensor) &&
               g <= static_cast<uint8_t>(ScaleGranularity::kBlock),
           [&] {
             return fmt::format("scales.granularity {} is unknown (1 tensor, 2 head, 3 block)", g);
           });
  io.Set(s.granularity, g);
  const bool per_block = g == static_cast<uint8_t>(ScaleGranularity::kBlock);
  io.List(s.values, "scales.values",
          Limit{.max = per_block ? 0 : kMaxScales, .min_bytes = 4, .empty_ok = per_block},
          [](auto& io, auto& value) {
            uint32_t bits = std::bit_cast<uint32_t>(value);
            io.U32(bits, "scales.values[]");
            io.Set(value, std::bit_cast<float>(bits));
          });
}

// u8 layout: a named layout every rank derives from its dims, or 2 (custom) followed by the
// instance's u8 region split and 6 x i64 strides in elements (block, layer, kv, head, token, dim;
// 0 on the axes that select a region). The planner checks the strides against every rank's dims.
// With bit 7 set (kScalesFollow), the instance's scales (ScaleFields) come after those fields.
template <typename Io>
void LayoutFields(Io& io, Ref<Io, InstanceDesc> d) {
  const bool scaled = d.scales.granularity != ScaleGranularity::kNone;
  uint8_t v = static_cast<uint8_t>(static_cast<uint8_t>(d.layout) | (scaled ? kScalesFollow : 0));
  io.U8(v, "layout");
  const bool scales_follow = (v & kScalesFollow) != 0;
  v &= static_cast<uint8_t>(~kScalesFollow);
  io.Check(v <= static_cast<uint8_t>(kLastLayoutKind), [&] {
    return fmt::format("layout {} is unknown (layouts are 0..{})", v,
                       static_cast<int>(kLastLayoutKind));
  });
  io.Set(d.layout, v);
  if (v == static_cast<uint8_t>(LayoutKind::kCustom)) CustomLayoutFields(io, d);
  if (scales_follow) ScaleFields(io, d.scales);
}

// An instance as both sides plan with it (the handle's context, a FETCH's generation instance):
// shape, parallel config, layout, i64 pool_blocks.
template <typename Io>
void InstanceFields(Io& io, Ref<Io, InstanceDesc> d) {
  Fields(io, d.shape);
  Fields(io, d.parallel);
  LayoutFields(io, d);
  io.I64(d.pool_blocks, "pool_blocks");
}

// u32 n, n x i64 block ids.
template <typename Io>
void BlocksField(Io& io, Ref<Io, std::vector<int64_t>> blocks) {
  io.List(blocks, "blocks", Limit{.max = kMaxBlocks, .min_bytes = 8},
          [](auto& io, auto& b) { io.I64(b, "blocks[]"); });
}

}  // namespace kvferry::wire
