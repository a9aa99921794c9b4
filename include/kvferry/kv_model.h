// The KV model as data: what a KV cache is (KvShape), how an instance is split across ranks
// (ParallelConfig, RankSlice), and how one rank's blocks sit in memory (PoolLayout).
//
// Everything here is a plain value type, pure, thread-compatible, and validated with errors that
// name the offending values. Layouts print in a CuTe-like shape:stride notation:
//   block-major  (blk,L,kv,h,t,d)=(64,32,2,8,32,128):(2097152,65536,32768,4096,128,1)
// so a failing test is readable.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

#include "kvferry/status.h"

#pragma GCC visibility push(default)  // the public API (kvferry/export.h)
namespace kvferry {

enum class DType : uint8_t { kFp32, kFp16, kBf16, kFp8E4M3, kFp8E5M2, kInt8 };

int DTypeSize(DType dtype);
std::string_view DTypeName(DType dtype);  // "fp32", "fp16", "bf16", "fp8", "fp8e5m2", "int8"
StatusOr<DType> ParseDType(std::string_view name);

// The shape of a model's KV cache, independent of how it is split.
struct KvShape {
  int32_t layers = 0;    // attention layers of the whole model
  int32_t kv_heads = 0;  // KV heads per layer (1 for MLA)
  int32_t head_dim = 0;  // elements per head (MLA: the latent width)
  DType dtype = DType::kBf16;
  int32_t kv_factor = 2;  // 2 = K and V, 1 = K only (MLA)
  int32_t tokens_per_block = 32;

  Status Validate() const;
  int64_t ElementBytes() const { return DTypeSize(dtype); }
  // Bytes of one token over all layers and heads, e.g. 131072 for Llama-3-8B in bf16.
  int64_t BytesPerToken() const;
  std::string ToString() const;
  bool operator==(const KvShape&) const = default;
};

// Scales of a quantized KV cache (fp8 e4m3 with scales, as vLLM's k_scale / v_scale): a stored
// value q stands for q * scale. Per tensor: one scale per (layer, kv), as vLLM's per-layer
// k_scale and v_scale; per head: one per (layer, kv, head). Global indices, the same on every rank
// of an instance. A transfer between sides whose scales differ (or whose dtypes differ) converts
// each element: read, times the source's scale, divided by the destination's, in fp32, narrowed
// (docs/conversion.md). No scales (kNone): every scale is 1.
// Per block (kBlock, fp8 only): one scale per (block, layer, kv, head), written as the blocks fill
// (dynamic quantization); they live in the pool (PoolSpec::block_scales, BlockPool::block_scales),
// not here, and travel with the KV: the generation side's are computed from each group's values
// (fp8 destination) or copied (fp8 -> fp8), the context side's read (docs/conversion.md).
enum class ScaleGranularity : uint8_t { kNone = 0, kTensor = 1, kHead = 2, kBlock = 3 };
// "none", "tensor", "head", "block"
std::string_view ScaleGranularityName(ScaleGranularity granularity);

struct KvScales {
  ScaleGranularity granularity = ScaleGranularity::kNone;
  // kTensor: layers * kv_factor values, [layer][kv]; kHead: layers * kv_factor * kv_heads values,
  // [layer][kv][head]; kNone and kBlock: empty.
  std::vector<float> values;

  // How many values `shape` takes at `granularity`.
  static int64_t CountFor(ScaleGranularity granularity, const KvShape& shape);
  // Every value finite and positive, as many as the shape takes.
  Status Check(const KvShape& shape) const;
  // The scale of (global layer, kv, global head); 1 without scales or per block. Check() first.
  float At(const KvShape& shape, int64_t layer, int64_t kv, int64_t head) const;
  bool operator==(const KvScales&) const = default;
};

// The most ranks (tp * pp) one instance may have; ParallelConfig::Validate refuses more.
inline constexpr int32_t kMaxWorldSize = 1 << 16;

// How an instance is split. Ranks are numbered pp_rank * tp + tp_rank (TP fastest).
// With attention data parallelism, the TP ranks form dp_size groups of tp / dp_size ranks; each
// group serves its own requests and splits heads among its tp / dp_size ranks.
struct ParallelConfig {
  int32_t tp = 1;
  int32_t pp = 1;
  std::vector<int32_t> stage_layers;  // layers per PP stage; empty = default split
  int32_t dp_size = 1;                // attention DP groups
  int32_t dp_rank = 0;                // the DP group a request is served by (in handles)

  int32_t world_size() const { return tp * pp; }
  int32_t attention_tp() const { return dp_size > 0 ? tp / dp_size : 0; }
  Status Validate(const KvShape& shape) const;
  // Layers of each stage: stage_layers if given, else the default split where the first
  // layers % pp stages get one layer more.
  std::vector<int32_t> ResolvedStageLayers(int32_t layers) const;
  std::string ToString() const;
  bool operator==(const ParallelConfig&) const = default;
};

// The default PP split: the first layers % pp stages get one extra layer.
std::vector<int32_t> DefaultStageLayers(int32_t layers, int32_t pp);

// What one rank holds: a range of global layers and a range of global KV heads.
struct RankSlice {
  int32_t rank = 0;
  int32_t tp_rank = 0;
  int32_t pp_rank = 0;
  int32_t dp_group = 0;     // attention DP group of this rank
  int32_t layer_begin = 0;  // global layer of local layer 0
  int32_t layer_count = 0;
  int32_t head_begin = 0;  // global KV head of local head 0
  int32_t head_count = 0;
  int32_t head_replicas = 1;  // ranks of the DP group holding these same heads (KV heads < TP)
  int32_t replica_index = 0;  // this rank's index among them

  std::string ToString() const;
  bool operator==(const RankSlice&) const = default;
};

StatusOr<RankSlice> SliceOf(const KvShape& shape, const ParallelConfig& parallel, int32_t rank);

// ---- Pool layout ------------------------------------------------------------------------------

// The six axes of a pool, in this order everywhere.
enum Axis : int { kBlockAxis = 0, kLayerAxis, kKvAxis, kHeadAxis, kTokenAxis, kDimAxis, kNumAxes };

// Named layouts. Each one derives its strides from the pool's dims, so it describes every rank of
// an instance (handles and FETCH messages carry the kind, not the strides). The values are on the
// wire (docs/wire_format.md): append, never renumber. NHD = [token][head][dim] inside a block,
// HND = [head][token][dim].
enum class LayoutKind : uint8_t {
  kBlockMajor = 0,  // TensorRT-LLM: one region [block][layer][kv][head][token][dim]
  kPerLayer = 1,    // vLLM (FlashAttention) NHD: one region per layer [kv][block][token][head][dim]
  kCustom = 2,      // strides given explicitly (PoolLayout::Custom); local use only
  kPerLayerHnd = 3,  // vLLM HND: one region per layer [kv][block][head][token][dim]
  kPerLayerKvNhd =
      4,  // vLLM/SGLang K and V tensors: one region per (layer, kv) [block][token][head][dim]
  kPerLayerKvHnd = 5,  // the same, HND: one region per (layer, kv) [block][head][token][dim]
  kFlashInferNhd = 6,  // FlashInfer paged NHD: one region per layer [block][kv][token][head][dim]
  kFlashInferHnd = 7,  // FlashInfer paged HND: one region per layer [block][kv][head][token][dim]
  kBlockMajorNhd = 8,  // one region [block][layer][kv][token][head][dim] (vLLM cross-layer blocks)
  kVllmCpu = 9,        // vLLM CPU backend: one region per layer [block][head][kv][token][dim]
  // vLLM 0.32's CUDA backends: per layer a logical [block][head][token][2*dim] tensor (K then V
  // in the content dim) whose stride order is its KV cache layout (LBHNC or LBNHC).
  kVllmHnd = 10,  // one region per layer [block][head][token][kv][dim]
  kVllmNhd = 11,  // one region per layer [block][token][head][kv][dim]
};
inline constexpr LayoutKind kLastLayoutKind = LayoutKind::kVllmNhd;
// "block-major", "per-layer", "custom", "per-layer-hnd", "per-layer-kv", "per-layer-kv-hnd",
// "flashinfer", "flashinfer-hnd", "block-major-nhd", "vllm-cpu", "vllm-hnd", "vllm-nhd".
std::string_view LayoutKindName(LayoutKind kind);
StatusOr<LayoutKind> ParseLayoutKind(std::string_view name);  // any name above but "custom"
// The named kinds, in wire order, without kCustom.
std::vector<LayoutKind> NamedLayoutKinds();

// How a pool's elements are split into regions (separate allocations or engine tensors). The
// axes that select a region have no stride: region = layer * (kv regions) + kv.
enum class RegionSplit : uint8_t {
  kNone = 0,        // one region holds every layer, K and V
  kPerLayer = 1,    // region l holds layer l (K and V)
  kPerKv = 2,       // region kv holds K (0) or V (1) of every layer
  kPerLayerKv = 3,  // region l * kv_factor + kv holds (layer l, kv)
};
std::string_view RegionSplitName(
    RegionSplit split);  // "one", "per-layer", "per-kv", "per-layer-kv"

// The order of heads and tokens inside a block of an engine's tensor.
enum class HeadOrder : uint8_t { kNhd, kHnd };

// Sizes of a rank's pool along the six axes (local layers and heads).
using PoolDims = std::array<int64_t, kNumAxes>;
using PoolStrides = std::array<int64_t, kNumAxes>;  // in elements

// Where one element is: region (a separate allocation) and byte offset inside it.
struct Extent {
  int32_t region = 0;
  int64_t offset = 0;  // bytes from the region's start
  int64_t bytes = 0;
  bool operator==(const Extent&) const = default;
};

// A half-open range [begin, end).
struct Range {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
  bool operator==(const Range&) const = default;
};

// A box inside one block, in local coordinates. The dim axis is always whole.
struct BlockBox {
  int64_t block = 0;
  Range layers, kv, heads, tokens;
};

class PoolLayout {
 public:
  static PoolLayout BlockMajor(const PoolDims& dims, int64_t element_bytes);
  static PoolLayout PerLayer(const PoolDims& dims, int64_t element_bytes);
  // Engine presets (see LayoutKind): vLLM's per-layer [2][block]... tensors, vLLM/SGLang's K and V
  // tensor per layer, FlashInfer's paged [block][2]... tensors, TensorRT-LLM's block pool.
  static PoolLayout VllmPerLayer(const PoolDims& dims, int64_t element_bytes, HeadOrder order);
  static PoolLayout PerLayerKv(const PoolDims& dims, int64_t element_bytes, HeadOrder order);
  static PoolLayout FlashInfer(const PoolDims& dims, int64_t element_bytes, HeadOrder order);
  // vLLM's CPU attention backend: kv_caches[l] = [num_blocks, heads, block_size, 2 * head_dim]
  // seen as [block][head][kv][token][dim]: each (block, head) page is the block's K half, then
  // its V half. Inside a half the attention kernel orders tokens and dims its own way, so only
  // whole blocks (any head range) mean the same thing on both sides: move whole blocks.
  static PoolLayout VllmCpu(const PoolDims& dims, int64_t element_bytes);
  static PoolLayout TrtllmBlockMajor(const PoolDims& dims, int64_t element_bytes) {
    return BlockMajor(dims, element_bytes);
  }
  static StatusOr<PoolLayout> Make(LayoutKind kind, const PoolDims& dims, int64_t element_bytes);
  // Any strides (in elements). With region_per_layer, each layer is its own region and the layer
  // stride is ignored. Validated: positive dims, dim stride 1, no two elements at one address.
  static StatusOr<PoolLayout> Custom(const PoolDims& dims, const PoolStrides& strides,
                                     bool region_per_layer, int64_t element_bytes);
  // Any strides (in elements) and region split; the strides of the axes that select a region are
  // ignored. Validated as above.
  static StatusOr<PoolLayout> Custom(const PoolDims& dims, const PoolStrides& strides,
                                     RegionSplit split, int64_t element_bytes);
  // Strides in bytes, as an engine's tensor reports them (torch: stride(i) * element_size()).
  // Each must be a multiple of element_bytes, and the dim axis contiguous (stride element_bytes).
  // When the result equals a named layout for these dims, kind() names it (so it can be
  // transferred); otherwise kind() is kCustom.
  static StatusOr<PoolLayout> FromByteStrides(const PoolDims& dims, const PoolStrides& byte_strides,
                                              RegionSplit split, int64_t element_bytes);

  LayoutKind kind() const { return kind_; }
  const PoolDims& dims() const { return dims_; }
  const PoolStrides& strides() const { return strides_; }
  int64_t element_bytes() const { return element_bytes_; }
  RegionSplit split() const { return split_; }
  int32_t num_regions() const {
    return static_cast<int32_t>((region_per_layer() ? dims_[kLayerAxis] : 1) *
                                (region_per_kv() ? dims_[kKvAxis] : 1));
  }
  // True when the layer (kv) axis selects a region instead of striding inside one.
  bool region_per_layer() const {
    return split_ == RegionSplit::kPerLayer || split_ == RegionSplit::kPerLayerKv;
  }
  bool region_per_kv() const {
    return split_ == RegionSplit::kPerKv || split_ == RegionSplit::kPerLayerKv;
  }
  // Whether axis `a` selects a region.
  bool RegionAxis(int a) const {
    return (a == kLayerAxis && region_per_layer()) || (a == kKvAxis && region_per_kv());
  }
  // Bytes each region spans: its largest element offset plus one element.
  int64_t region_bytes() const { return region_bytes_; }
  int64_t total_bytes() const { return region_bytes_ * num_regions(); }
  // Bytes of one whole block (all local layers, kv, heads, tokens).
  int64_t block_bytes() const;
  // True when each block is one contiguous range of one region.
  bool block_contiguous() const;

  // The region holding (local layer, kv).
  int32_t RegionOf(int64_t layer, int64_t kv) const {
    return static_cast<int32_t>((region_per_layer() ? layer : 0) *
                                    (region_per_kv() ? dims_[kKvAxis] : 1) +
                                (region_per_kv() ? kv : 0));
  }
  // The (layer range, kv range) region r holds.
  Range RegionLayers(int32_t region) const;
  Range RegionKv(int32_t region) const;
  // The named layout with these strides and split for these dims, or kCustom.
  LayoutKind MatchKind() const;
  // Byte offset of an element inside its region.
  int64_t ByteOffset(int64_t block, int64_t layer, int64_t kv, int64_t head, int64_t token,
                     int64_t dim) const;

  // Checks a box against the dims.
  Status CheckBox(const BlockBox& box) const;
  // Appends the byte extents covering `box` to `out`, coalescing neighbours (including with the
  // last extent already in `out`). Order: by region, then by increasing offset within each
  // contiguous run of the box's loops. The box must be valid (CheckBox).
  void AppendExtents(const BlockBox& box, std::vector<Extent>& out) const;
  std::vector<Extent> Extents(const BlockBox& box) const;
  // The whole block as a box.
  BlockBox WholeBlock(int64_t block) const;

  // "block-major (blk,L,kv,h,t,d)=(64,32,2,8,32,128):(2097152,65536,32768,4096,128,1) bf16x2B"
  std::string ToString() const;
  bool operator==(const PoolLayout&) const = default;

 private:
  PoolLayout(LayoutKind kind, const PoolDims& dims, const PoolStrides& strides, RegionSplit split,
             int64_t element_bytes);
  // Packed strides for axes listed outermost first (dim innermost, stride 1); axes not listed
  // select a region (stride 0).
  static PoolLayout Packed(LayoutKind kind, const PoolDims& dims, std::initializer_list<int> order,
                           RegionSplit split, int64_t element_bytes);

  LayoutKind kind_ = LayoutKind::kCustom;
  PoolDims dims_{};
  PoolStrides strides_{};
  RegionSplit split_ = RegionSplit::kNone;
  int64_t element_bytes_ = 0;
  int64_t region_bytes_ = 0;
};

// The dims of a rank's pool of `blocks` blocks.
PoolDims RankPoolDims(const KvShape& shape, const RankSlice& slice, int64_t blocks);
// The largest dims of any rank's pool of an instance (ranks differ in layers with uneven pipeline
// stages): what a custom layout shared by every rank must span.
StatusOr<PoolDims> InstancePoolDims(const KvShape& shape, const ParallelConfig& parallel,
                                    int64_t blocks);

// A layout as a person writes it (command lines): a named layout ("per-layer-hnd"), or
// "custom:SPLIT:AXES[:pad=N]": SPLIT one of one|per-layer|per-kv|per-layer-kv, AXES the axes
// inside a region outermost first, comma-separated (block,layer,kv,head,token,dim; the axes that
// select a region left out, dim last), N elements of padding after each block. A custom layout's
// strides are packed over an instance's largest rank dims (InstancePoolDims), so every rank of
// the instance has the same strides.
struct LayoutSpec {
  LayoutKind kind = LayoutKind::kBlockMajor;  // kCustom: split, order and pad say how
  RegionSplit split = RegionSplit::kNone;
  std::vector<int> order;  // in-region axes, outermost first
  int64_t pad = 0;

  static StatusOr<LayoutSpec> Parse(std::string_view text);
  std::string ToString() const;  // what Parse reads back
  // Strides (elements) over `span` (custom only; zero on region axes).
  PoolStrides Strides(const PoolDims& span) const;
  // The layout of a rank's pool with `dims`, of an instance spanning `span`.
  StatusOr<PoolLayout> Make(const PoolDims& dims, const PoolDims& span,
                            int64_t element_bytes) const;
  bool operator==(const LayoutSpec&) const = default;
};

}  // namespace kvferry
#pragma GCC visibility pop
