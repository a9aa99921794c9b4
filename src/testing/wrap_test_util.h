// Helpers for the external-memory tests: an "engine" that owns its KV tensors the way vLLM,
// SGLang, FlashInfer and TensorRT-LLM do, and the index formula of each engine's tensor written
// out independently of PoolLayout (so a test checks the presets against the engines, not against
// themselves).
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "kvferry/pool.h"
#include "testing/testdata.h"

namespace kvferry::testing {

// Where an engine's tensors put local element (b, l, kv, h, t, d): region and element index.
struct EngineIndex {
  int32_t region = 0;
  int64_t element = 0;
};

inline EngineIndex EngineElement(LayoutKind kind, const PoolDims& n, int64_t b, int64_t l,
                                 int64_t kv, int64_t h, int64_t t, int64_t d) {
  const int64_t B = n[kBlockAxis], L = n[kLayerAxis], KV = n[kKvAxis], H = n[kHeadAxis],
                T = n[kTokenAxis], D = n[kDimAxis];
  const auto r = [](int64_t x) { return static_cast<int32_t>(x); };
  switch (kind) {
    case LayoutKind::kBlockMajor:  // TensorRT-LLM pool [B][L][2][H][T][D]
      return {0, ((((b * L + l) * KV + kv) * H + h) * T + t) * D + d};
    case LayoutKind::kPerLayer:  // vLLM kv_caches[l]: [2][B][T][H][D]
      return {r(l), (((kv * B + b) * T + t) * H + h) * D + d};
    case LayoutKind::kPerLayerHnd:  // vLLM HND kv_caches[l]: [2][B][H][T][D]
      return {r(l), (((kv * B + b) * H + h) * T + t) * D + d};
    case LayoutKind::kPerLayerKvNhd:  // SGLang k_buffer[l] / v_buffer[l]: [B*T][H][D]
      return {r(l * KV + kv), ((b * T + t) * H + h) * D + d};
    case LayoutKind::kPerLayerKvHnd:  // [B][H][T][D] per layer per K/V
      return {r(l * KV + kv), ((b * H + h) * T + t) * D + d};
    case LayoutKind::kFlashInferNhd:  // FlashInfer paged_kv_cache[l]: [B][2][T][H][D]
      return {r(l), (((b * KV + kv) * T + t) * H + h) * D + d};
    case LayoutKind::kFlashInferHnd:  // FlashInfer HND: [B][2][H][T][D]
      return {r(l), (((b * KV + kv) * H + h) * T + t) * D + d};
    case LayoutKind::kBlockMajorNhd:  // vLLM cross-layer blocks [B][L][2][T][H][D]
      return {0, ((((b * L + l) * KV + kv) * T + t) * H + h) * D + d};
    case LayoutKind::kVllmCpu:  // vLLM CPU backend kv_caches[l]: [B][H][T][2*D], K rows then V
      return {r(l), ((b * H + h) * T * KV + kv * T + t) * D + d};
    case LayoutKind::kVllmHnd:  // vLLM 0.32 CUDA kv_caches[l], LBHNC: [B][H][T][2*D], K then V
      return {r(l), (((b * H + h) * T + t) * KV + kv) * D + d};
    case LayoutKind::kVllmNhd:  // vLLM 0.32 CUDA kv_caches[l], LBNHC: [B][T][H][2*D]
      return {r(l), (((b * T + t) * H + h) * KV + kv) * D + d};
    case LayoutKind::kCustom:
      break;
  }
  ADD_FAILURE() << "no engine formula for " << LayoutKindName(kind);
  return {};
}

// Tensors per engine layout and bytes of each, from the dims alone.
inline int32_t EngineTensors(LayoutKind kind, const PoolDims& n) {
  switch (kind) {
    case LayoutKind::kBlockMajor:
    case LayoutKind::kBlockMajorNhd:
      return 1;
    case LayoutKind::kPerLayerKvNhd:
    case LayoutKind::kPerLayerKvHnd:
      return static_cast<int32_t>(n[kLayerAxis] * n[kKvAxis]);
    default:
      return static_cast<int32_t>(n[kLayerAxis]);
  }
}

inline int64_t EngineTensorBytes(LayoutKind kind, const PoolDims& n, int64_t element_bytes) {
  int64_t all = element_bytes;
  for (int64_t x : n) all *= x;
  return all / EngineTensors(kind, n);
}

// Checks, element by element, that the bytes at the engine's own index hold the test-data value
// of (request_base + block, global coordinates). `read` returns a host pointer to region r.
template <typename Read>
void ExpectEngineElements(LayoutKind kind, const BlockPool& pool, uint64_t request_base,
                          Read&& read) {
  const PoolDims& n = pool.layout().dims();
  const int64_t eb = pool.layout().element_bytes();
  const RankSlice& s = pool.slice();
  int64_t wrong = 0;
  for (int64_t b = 0; b < n[kBlockAxis]; ++b)
    for (int64_t l = 0; l < n[kLayerAxis]; ++l)
      for (int64_t kv = 0; kv < n[kKvAxis]; ++kv)
        for (int64_t h = 0; h < n[kHeadAxis]; ++h)
          for (int64_t t = 0; t < n[kTokenAxis]; ++t)
            for (int64_t d = 0; d < n[kDimAxis]; ++d) {
              EngineIndex at = EngineElement(kind, n, b, l, kv, h, t, d);
              uint64_t want = TestValue({request_base + static_cast<uint64_t>(b), s.layer_begin + l,
                                         kv, s.head_begin + h, b * n[kTokenAxis] + t, d});
              uint64_t got = 0;
              std::memcpy(&got, read(at.region) + at.element * eb, static_cast<size_t>(eb));
              if (std::memcmp(&got, &want, static_cast<size_t>(eb)) != 0 && ++wrong <= 3) {
                ADD_FAILURE() << LayoutKindName(kind) << ": element (b" << b << " l" << l << " kv"
                              << kv << " h" << h << " t" << t << " d" << d << ") in region "
                              << at.region << " at element " << at.element;
              }
            }
  EXPECT_EQ(wrong, 0) << LayoutKindName(kind);
}

// Fills every block b of `pool` with request request_base + b, tokens from b * tokens_per_block.
inline void FillAllBlocks(const BlockPool& pool, uint64_t request_base) {
  const int64_t tpb = pool.shape().tokens_per_block;
  for (int64_t b = 0; b < pool.blocks(); ++b) {
    ASSERT_TRUE(FillBlock(pool, request_base + static_cast<uint64_t>(b), {b, b * tpb, tpb}).ok());
  }
}

inline void ExpectAllBlocks(const BlockPool& pool, uint64_t request_base) {
  const int64_t tpb = pool.shape().tokens_per_block;
  for (int64_t b = 0; b < pool.blocks(); ++b) {
    auto r = CheckBlock(pool, request_base + static_cast<uint64_t>(b), {b, b * tpb, tpb});
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_FALSE(r->has_value()) << "block " << b << ": " << (*r)->ToString();
  }
}

}  // namespace kvferry::testing
