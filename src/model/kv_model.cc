#include "kvferry/kv_model.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <charconv>
#include <numeric>
#include <optional>

#include "base/checked.h"
#include "model/coalesce.h"

namespace kvferry {

// ---- dtype ----------------------------------------------------------------------------------

int DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kFp32:
      return 4;
    case DType::kFp16:
    case DType::kBf16:
      return 2;
    case DType::kFp8E4M3:
    case DType::kFp8E5M2:
    case DType::kInt8:
      return 1;
  }
  return 0;
}

std::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFp32:
      return "fp32";
    case DType::kFp16:
      return "fp16";
    case DType::kBf16:
      return "bf16";
    case DType::kFp8E4M3:
      return "fp8";
    case DType::kFp8E5M2:
      return "fp8e5m2";
    case DType::kInt8:
      return "int8";
  }
  return "?";
}

StatusOr<DType> ParseDType(std::string_view name) {
  for (DType d :
       {DType::kFp32, DType::kFp16, DType::kBf16, DType::kFp8E4M3, DType::kFp8E5M2, DType::kInt8}) {
    if (DTypeName(d) == name) return d;
  }
  if (name == "fp8e4m3") return DType::kFp8E4M3;
  if (name == "float32" || name == "float") return DType::kFp32;
  if (name == "float16" || name == "half") return DType::kFp16;
  if (name == "bfloat16") return DType::kBf16;
  return Status::InvalidArgument(
      fmt::format("unknown dtype '{}'; expected fp32|fp16|bf16|fp8|fp8e5m2|int8", name));
}

// ---- shape ----------------------------------------------------------------------------------

Status KvShape::Validate() const {
  if (layers < 1)
    return Status::InvalidArgument(fmt::format("layers={} must be at least 1", layers));
  if (kv_heads < 1)
    return Status::InvalidArgument(fmt::format("kv_heads={} must be at least 1", kv_heads));
  if (head_dim < 1)
    return Status::InvalidArgument(fmt::format("head_dim={} must be at least 1", head_dim));
  if (kv_factor != 1 && kv_factor != 2) {
    return Status::InvalidArgument(
        fmt::format("kv_factor={} must be 2 (K and V) or 1 (K only, MLA)", kv_factor));
  }
  if (tokens_per_block < 1) {
    return Status::InvalidArgument(
        fmt::format("tokens_per_block={} must be at least 1", tokens_per_block));
  }
  if (DTypeSize(dtype) == 0) return Status::InvalidArgument("unknown dtype");
  // Every size derived from a shape is at most a block's bytes times a block count: the block
  // itself must fit in int64 (a pool's total is checked where its block count is known).
  if (!CheckedProduct(
          {layers, kv_factor, kv_heads, head_dim, DTypeSize(dtype), tokens_per_block})) {
    return Status::InvalidArgument(fmt::format(
        "layers={} * kv_factor={} * kv_heads={} * head_dim={} * {} bytes * tokens_per_block={} "
        "(bytes of one block) overflows int64",
        layers, kv_factor, kv_heads, head_dim, DTypeSize(dtype), tokens_per_block));
  }
  return Status::Ok();
}

int64_t KvShape::BytesPerToken() const {
  // -1 for a shape whose size overflows (Validate refuses it).
  return CheckedProduct({layers, kv_factor, kv_heads, head_dim, DTypeSize(dtype)}).value_or(-1);
}

std::string KvShape::ToString() const {
  return fmt::format("layers={} kv_heads={} head_dim={} dtype={} kv_factor={} tokens_per_block={}",
                     layers, kv_heads, head_dim, DTypeName(dtype), kv_factor, tokens_per_block);
}

// ---- parallel config ------------------------------------------------------------------------

std::vector<int32_t> DefaultStageLayers(int32_t layers, int32_t pp) {
  std::vector<int32_t> out;
  if (pp <= 0) return out;
  for (int32_t s = 0; s < pp; ++s) out.push_back(layers / pp + (s < layers % pp ? 1 : 0));
  return out;
}

std::vector<int32_t> ParallelConfig::ResolvedStageLayers(int32_t layers) const {
  return stage_layers.empty() ? DefaultStageLayers(layers, pp) : stage_layers;
}

Status ParallelConfig::Validate(const KvShape& shape) const {
  if (tp < 1) return Status::InvalidArgument(fmt::format("tp={} must be at least 1", tp));
  if (pp < 1) return Status::InvalidArgument(fmt::format("pp={} must be at least 1", pp));
  if (tp > kMaxWorldSize / pp) {
    return Status::InvalidArgument(
        fmt::format("tp={} * pp={} exceeds the limit of {} ranks", tp, pp, kMaxWorldSize));
  }
  if (pp > shape.layers) {
    return Status::InvalidArgument(
        fmt::format("pp={} exceeds layers={}: every pipeline stage needs at least one layer", pp,
                    shape.layers));
  }
  if (!stage_layers.empty()) {
    if (static_cast<int32_t>(stage_layers.size()) != pp) {
      return Status::InvalidArgument(fmt::format("stage_layers {} has {} entries but pp={}",
                                                 stage_layers, stage_layers.size(), pp));
    }
    for (size_t s = 0; s < stage_layers.size(); ++s) {
      if (stage_layers[s] < 1) {
        return Status::InvalidArgument(
            fmt::format("stage_layers {}: stage {} has {} layers; each needs at least 1",
                        stage_layers, s, stage_layers[s]));
      }
    }
    int64_t sum = std::accumulate(stage_layers.begin(), stage_layers.end(), int64_t{0});
    if (sum != shape.layers) {
      return Status::InvalidArgument(
          fmt::format("stage_layers {} sum to {} but the model has layers={}", stage_layers, sum,
                      shape.layers));
    }
  }
  if (dp_size < 1)
    return Status::InvalidArgument(fmt::format("dp_size={} must be at least 1", dp_size));
  if (tp % dp_size != 0) {
    return Status::InvalidArgument(fmt::format(
        "tp={} is not a multiple of attention dp_size={}: each DP group needs the same TP", tp,
        dp_size));
  }
  if (dp_rank < 0 || dp_rank >= dp_size) {
    return Status::InvalidArgument(
        fmt::format("dp_rank={} is outside [0, dp_size={})", dp_rank, dp_size));
  }
  int32_t atp = attention_tp();
  if (shape.kv_heads % atp != 0 && atp % shape.kv_heads != 0) {
    return Status::InvalidArgument(fmt::format(
        "kv_heads={} and attention TP={} (tp={} / dp_size={}) don't fit: heads must divide evenly "
        "over the TP ranks (kv_heads % tp == 0) or be duplicated over them (tp % kv_heads == 0)",
        shape.kv_heads, atp, tp, dp_size));
  }
  return Status::Ok();
}

std::string ParallelConfig::ToString() const {
  std::string s = fmt::format("tp={} pp={}", tp, pp);
  if (!stage_layers.empty()) s += fmt::format(" stage_layers={}", stage_layers);
  if (dp_size > 1) s += fmt::format(" dp_size={} dp_rank={}", dp_size, dp_rank);
  return s;
}

std::string RankSlice::ToString() const {
  return fmt::format("rank {} (tp {} pp {} dp {}): layers [{}, {}) heads [{}, {}) replica {}/{}",
                     rank, tp_rank, pp_rank, dp_group, layer_begin, layer_begin + layer_count,
                     head_begin, head_begin + head_count, replica_index, head_replicas);
}

StatusOr<RankSlice> SliceOf(const KvShape& shape, const ParallelConfig& parallel, int32_t rank) {
  KVF_RETURN_IF_ERROR(shape.Validate());
  KVF_RETURN_IF_ERROR(parallel.Validate(shape));
  if (rank < 0 || rank >= parallel.world_size()) {
    return Status::InvalidArgument(
        fmt::format("rank={} is outside [0, tp*pp={})", rank, parallel.world_size()));
  }
  RankSlice s;
  s.rank = rank;
  s.tp_rank = rank % parallel.tp;
  s.pp_rank = rank / parallel.tp;
  const int32_t atp = parallel.attention_tp();
  s.dp_group = s.tp_rank / atp;
  const int32_t atp_rank = s.tp_rank % atp;
  auto stages = parallel.ResolvedStageLayers(shape.layers);
  s.layer_begin = std::accumulate(stages.begin(), stages.begin() + s.pp_rank, 0);
  s.layer_count = stages[s.pp_rank];
  if (shape.kv_heads >= atp) {
    s.head_count = shape.kv_heads / atp;
    s.head_begin = atp_rank * s.head_count;
    s.head_replicas = 1;
    s.replica_index = 0;
  } else {
    s.head_replicas = atp / shape.kv_heads;
    s.head_count = 1;
    s.head_begin = atp_rank / s.head_replicas;
    s.replica_index = atp_rank % s.head_replicas;
  }
  return s;
}

// ---- layout ---------------------------------------------------------------------------------

namespace {

struct KindName {
  LayoutKind kind;
  std::string_view name;
};
constexpr KindName kKindNames[] = {
    {LayoutKind::kBlockMajor, "block-major"},
    {LayoutKind::kPerLayer, "per-layer"},
    {LayoutKind::kCustom, "custom"},
    {LayoutKind::kPerLayerHnd, "per-layer-hnd"},
    {LayoutKind::kPerLayerKvNhd, "per-layer-kv"},
    {LayoutKind::kPerLayerKvHnd, "per-layer-kv-hnd"},
    {LayoutKind::kFlashInferNhd, "flashinfer"},
    {LayoutKind::kFlashInferHnd, "flashinfer-hnd"},
    {LayoutKind::kBlockMajorNhd, "block-major-nhd"},
    {LayoutKind::kVllmCpu, "vllm-cpu"},
    {LayoutKind::kVllmHnd, "vllm-hnd"},
    {LayoutKind::kVllmNhd, "vllm-nhd"},
};

bool IsRegionAxis(RegionSplit split, int a) {
  const bool layer = split == RegionSplit::kPerLayer || split == RegionSplit::kPerLayerKv;
  const bool kv = split == RegionSplit::kPerKv || split == RegionSplit::kPerLayerKv;
  return (a == kLayerAxis && layer) || (a == kKvAxis && kv);
}

int64_t RegionElements(const PoolDims& d, const PoolStrides& s, RegionSplit split) {
  int64_t last = 0;
  for (int a = 0; a < kNumAxes; ++a) {
    if (IsRegionAxis(split, a)) continue;
    last += (d[a] - 1) * s[a];
  }
  return last + 1;
}

// The region's bytes, computed with checked arithmetic: kInvalidArgument naming the dims when
// they overflow int64 (positive dims and non-negative strides assumed).
Status CheckRegionBytes(const PoolDims& d, const PoolStrides& s, RegionSplit split,
                        int64_t element_bytes) {
  std::optional<int64_t> last = 0;
  for (int a = 0; a < kNumAxes && last; ++a) {
    if (IsRegionAxis(split, a)) continue;
    auto step = CheckedMul<int64_t>(d[a] - 1, s[a]);
    last = step ? CheckedAdd(*last, *step) : std::nullopt;
  }
  if (last) last = CheckedAdd<int64_t>(*last, 1);
  if (last) last = CheckedMul(*last, element_bytes);
  // All regions together (one per layer and/or kv when split) must fit as well.
  for (int a = 0; a < kNumAxes && last; ++a) {
    if (IsRegionAxis(split, a)) last = CheckedMul(*last, d[a]);
  }
  if (!last) {
    return Status::InvalidArgument(
        fmt::format("pool (blk,L,kv,h,t,d)={}:{} of {}-byte elements: its size overflows int64", d,
                    s, element_bytes));
  }
  return Status::Ok();
}

}  // namespace

std::string_view LayoutKindName(LayoutKind kind) {
  for (const KindName& k : kKindNames) {
    if (k.kind == kind) return k.name;
  }
  return "?";
}

std::vector<LayoutKind> NamedLayoutKinds() {
  std::vector<LayoutKind> out;
  for (const KindName& k : kKindNames) {
    if (k.kind != LayoutKind::kCustom) out.push_back(k.kind);
  }
  return out;
}

StatusOr<LayoutKind> ParseLayoutKind(std::string_view name) {
  std::string names;
  for (const KindName& k : kKindNames) {
    if (k.kind == LayoutKind::kCustom) continue;
    if (k.name == name) return k.kind;
    names += names.empty() ? "" : "|";
    names += k.name;
  }
  return Status::InvalidArgument(fmt::format("unknown layout '{}'; expected {}", name, names));
}

std::string_view RegionSplitName(RegionSplit split) {
  switch (split) {
    case RegionSplit::kNone:
      return "one";
    case RegionSplit::kPerLayer:
      return "per-layer";
    case RegionSplit::kPerKv:
      return "per-kv";
    case RegionSplit::kPerLayerKv:
      return "per-layer-kv";
  }
  return "?";
}

PoolLayout::PoolLayout(LayoutKind kind, const PoolDims& dims, const PoolStrides& strides,
                       RegionSplit split, int64_t element_bytes)
    : kind_(kind),
      dims_(dims),
      strides_(strides),
      split_(split),
      element_bytes_(element_bytes),
      region_bytes_(RegionElements(dims, strides, split) * element_bytes) {}

PoolLayout PoolLayout::Packed(LayoutKind kind, const PoolDims& d, std::initializer_list<int> order,
                              RegionSplit split, int64_t element_bytes) {
  PoolStrides s{};
  s[kDimAxis] = 1;
  int64_t run = d[kDimAxis];
  for (auto it = std::rbegin(order); it != std::rend(order); ++it) {
    s[*it] = run;
    run *= d[*it];
  }
  return PoolLayout(kind, d, s, split, element_bytes);
}

PoolLayout PoolLayout::BlockMajor(const PoolDims& d, int64_t element_bytes) {
  return Packed(LayoutKind::kBlockMajor, d,
                {kBlockAxis, kLayerAxis, kKvAxis, kHeadAxis, kTokenAxis}, RegionSplit::kNone,
                element_bytes);
}

PoolLayout PoolLayout::PerLayer(const PoolDims& d, int64_t element_bytes) {
  return VllmPerLayer(d, element_bytes, HeadOrder::kNhd);
}

PoolLayout PoolLayout::VllmPerLayer(const PoolDims& d, int64_t element_bytes, HeadOrder order) {
  if (order == HeadOrder::kNhd) {
    return Packed(LayoutKind::kPerLayer, d, {kKvAxis, kBlockAxis, kTokenAxis, kHeadAxis},
                  RegionSplit::kPerLayer, element_bytes);
  }
  return Packed(LayoutKind::kPerLayerHnd, d, {kKvAxis, kBlockAxis, kHeadAxis, kTokenAxis},
                RegionSplit::kPerLayer, element_bytes);
}

PoolLayout PoolLayout::PerLayerKv(const PoolDims& d, int64_t element_bytes, HeadOrder order) {
  if (order == HeadOrder::kNhd) {
    return Packed(LayoutKind::kPerLayerKvNhd, d, {kBlockAxis, kTokenAxis, kHeadAxis},
                  RegionSplit::kPerLayerKv, element_bytes);
  }
  return Packed(LayoutKind::kPerLayerKvHnd, d, {kBlockAxis, kHeadAxis, kTokenAxis},
                RegionSplit::kPerLayerKv, element_bytes);
}

PoolLayout PoolLayout::FlashInfer(const PoolDims& d, int64_t element_bytes, HeadOrder order) {
  if (order == HeadOrder::kNhd) {
    return Packed(LayoutKind::kFlashInferNhd, d, {kBlockAxis, kKvAxis, kTokenAxis, kHeadAxis},
                  RegionSplit::kPerLayer, element_bytes);
  }
  return Packed(LayoutKind::kFlashInferHnd, d, {kBlockAxis, kKvAxis, kHeadAxis, kTokenAxis},
                RegionSplit::kPerLayer, element_bytes);
}

PoolLayout PoolLayout::VllmCpu(const PoolDims& d, int64_t element_bytes) {
  return Packed(LayoutKind::kVllmCpu, d, {kBlockAxis, kHeadAxis, kKvAxis, kTokenAxis},
                RegionSplit::kPerLayer, element_bytes);
}

namespace {
// "blocks 0, layers 4, kv 2, heads 4, tokens 4, dim 8": which dim is which in an error.
std::string DimsNamed(const PoolDims& dims) {
  static constexpr const char* kNames[kNumAxes] = {"blocks", "layers", "kv",
                                                   "heads",  "tokens", "dim"};
  std::string out;
  for (int a = 0; a < kNumAxes; ++a) {
    out += fmt::format("{}{} {}", a ? ", " : "", kNames[a], dims[a]);
  }
  return out;
}
}  // namespace

StatusOr<PoolLayout> PoolLayout::Make(LayoutKind kind, const PoolDims& dims,
                                      int64_t element_bytes) {
  for (int a = 0; a < kNumAxes; ++a) {
    if (dims[a] < 1)
      return Status::InvalidArgument(
          fmt::format("pool dims ({}) must all be positive", DimsNamed(dims)));
  }
  if (element_bytes < 1) return Status::InvalidArgument("element_bytes must be positive");
  // Named layouts are dense: a region spans at most the product of all dims.
  if (!CheckedProduct({dims[0], dims[1], dims[2], dims[3], dims[4], dims[5], element_bytes})) {
    return Status::InvalidArgument(fmt::format(
        "pool dims (blk,L,kv,h,t,d)={} of {}-byte elements: the pool's size overflows int64", dims,
        element_bytes));
  }
  switch (kind) {
    case LayoutKind::kBlockMajor:
      return BlockMajor(dims, element_bytes);
    case LayoutKind::kPerLayer:
      return PerLayer(dims, element_bytes);
    case LayoutKind::kPerLayerHnd:
      return VllmPerLayer(dims, element_bytes, HeadOrder::kHnd);
    case LayoutKind::kPerLayerKvNhd:
      return PerLayerKv(dims, element_bytes, HeadOrder::kNhd);
    case LayoutKind::kPerLayerKvHnd:
      return PerLayerKv(dims, element_bytes, HeadOrder::kHnd);
    case LayoutKind::kFlashInferNhd:
      return FlashInfer(dims, element_bytes, HeadOrder::kNhd);
    case LayoutKind::kFlashInferHnd:
      return FlashInfer(dims, element_bytes, HeadOrder::kHnd);
    case LayoutKind::kBlockMajorNhd:
      return Packed(LayoutKind::kBlockMajorNhd, dims,
                    {kBlockAxis, kLayerAxis, kKvAxis, kTokenAxis, kHeadAxis}, RegionSplit::kNone,
                    element_bytes);
    case LayoutKind::kVllmCpu:
      return VllmCpu(dims, element_bytes);
    case LayoutKind::kVllmHnd:
      return Packed(LayoutKind::kVllmHnd, dims, {kBlockAxis, kHeadAxis, kTokenAxis, kKvAxis},
                    RegionSplit::kPerLayer, element_bytes);
    case LayoutKind::kVllmNhd:
      return Packed(LayoutKind::kVllmNhd, dims, {kBlockAxis, kTokenAxis, kHeadAxis, kKvAxis},
                    RegionSplit::kPerLayer, element_bytes);
    case LayoutKind::kCustom:
      break;
  }
  if (kind != LayoutKind::kCustom) {
    return Status::InvalidArgument(
        fmt::format("layout kind {} is unknown", static_cast<int>(kind)));
  }
  return Status::InvalidArgument("a custom layout needs strides: use PoolLayout::Custom");
}

StatusOr<PoolLayout> PoolLayout::Custom(const PoolDims& dims, const PoolStrides& strides,
                                        bool region_per_layer, int64_t element_bytes) {
  return Custom(dims, strides, region_per_layer ? RegionSplit::kPerLayer : RegionSplit::kNone,
                element_bytes);
}

StatusOr<PoolLayout> PoolLayout::Custom(const PoolDims& dims, const PoolStrides& strides,
                                        RegionSplit split, int64_t element_bytes) {
  for (int a = 0; a < kNumAxes; ++a) {
    if (dims[a] < 1)
      return Status::InvalidArgument(
          fmt::format("pool dims ({}) must all be positive", DimsNamed(dims)));
    if (strides[a] < 0)
      return Status::InvalidArgument(fmt::format("strides {} must not be negative", strides));
  }
  if (element_bytes < 1) return Status::InvalidArgument("element_bytes must be positive");
  if (static_cast<uint8_t>(split) > static_cast<uint8_t>(RegionSplit::kPerLayerKv)) {
    return Status::InvalidArgument(
        fmt::format("region split {} is unknown", static_cast<int>(split)));
  }
  if (strides[kDimAxis] != 1) {
    return Status::InvalidArgument(
        fmt::format("strides {}: the dim axis must have stride 1", strides));
  }
  // No aliasing: sorted by stride, each axis must step over the whole extent of the ones below.
  std::vector<int> axes;
  for (int a = 0; a < kNumAxes; ++a) {
    if (dims[a] > 1 && !IsRegionAxis(split, a)) axes.push_back(a);
  }
  std::sort(axes.begin(), axes.end(), [&](int x, int y) { return strides[x] < strides[y]; });
  int64_t covered = 1;
  for (int a : axes) {
    if (strides[a] < covered) {
      return Status::InvalidArgument(fmt::format(
          "layout (blk,L,kv,h,t,d)={}:{} aliases: axis {} with stride {} overlaps the {} elements "
          "spanned by the axes with smaller strides",
          dims, strides, a, strides[a], covered));
    }
    covered = CheckedMul(strides[a], dims[a]).value_or(INT64_MAX);
  }
  KVF_RETURN_IF_ERROR(CheckRegionBytes(dims, strides, split, element_bytes));
  PoolStrides clean = strides;
  for (int a = 0; a < kNumAxes; ++a) {
    if (IsRegionAxis(split, a)) clean[a] = 0;
  }
  PoolLayout layout(LayoutKind::kCustom, dims, clean, split, element_bytes);
  layout.kind_ = layout.MatchKind();
  return layout;
}

StatusOr<PoolLayout> PoolLayout::FromByteStrides(const PoolDims& dims,
                                                 const PoolStrides& byte_strides, RegionSplit split,
                                                 int64_t element_bytes) {
  if (element_bytes < 1) return Status::InvalidArgument("element_bytes must be positive");
  static constexpr std::string_view kAxisNames[kNumAxes] = {"block", "layer", "kv",
                                                            "head",  "token", "dim"};
  PoolStrides elements{};
  for (int a = 0; a < kNumAxes; ++a) {
    if (IsRegionAxis(split, a)) continue;
    if (byte_strides[a] % element_bytes != 0) {
      return Status::InvalidArgument(
          fmt::format("byte strides {}: the {} stride {} is not a multiple of the {}-byte "
                      "element (misaligned elements)",
                      byte_strides, kAxisNames[a], byte_strides[a], element_bytes));
    }
    elements[a] = byte_strides[a] / element_bytes;
  }
  if (dims[kDimAxis] > 1 && byte_strides[kDimAxis] != element_bytes) {
    return Status::InvalidArgument(
        fmt::format("byte strides {}: the dim stride must be the element size {} (head_dim "
                    "contiguous)",
                    byte_strides, element_bytes));
  }
  elements[kDimAxis] = 1;
  return Custom(dims, elements, split, element_bytes);
}

LayoutKind PoolLayout::MatchKind() const {
  for (LayoutKind k : NamedLayoutKinds()) {
    StatusOr<PoolLayout> named = Make(k, dims_, element_bytes_);
    if (!named.ok() || named->split_ != split_) continue;
    bool same = true;
    for (int a = 0; a < kNumAxes && same; ++a) {
      same = dims_[a] == 1 || RegionAxis(a) || named->strides_[a] == strides_[a];
    }
    if (same) return k;
  }
  return LayoutKind::kCustom;
}

Range PoolLayout::RegionLayers(int32_t region) const {
  if (!region_per_layer()) return Range{0, dims_[kLayerAxis]};
  const int64_t l = region / (region_per_kv() ? dims_[kKvAxis] : 1);
  return Range{l, l + 1};
}

Range PoolLayout::RegionKv(int32_t region) const {
  if (!region_per_kv()) return Range{0, dims_[kKvAxis]};
  const int64_t kv = region % dims_[kKvAxis];
  return Range{kv, kv + 1};
}

int64_t PoolLayout::block_bytes() const {
  int64_t n = element_bytes_;
  for (int a = kLayerAxis; a < kNumAxes; ++a) n *= dims_[a];
  return n;
}

bool PoolLayout::block_contiguous() const { return Extents(WholeBlock(0)).size() == 1; }

int64_t PoolLayout::ByteOffset(int64_t block, int64_t layer, int64_t kv, int64_t head,
                               int64_t token, int64_t dim) const {
  int64_t e = block * strides_[kBlockAxis] + head * strides_[kHeadAxis] +
              token * strides_[kTokenAxis] + dim * strides_[kDimAxis];
  if (!region_per_layer()) e += layer * strides_[kLayerAxis];
  if (!region_per_kv()) e += kv * strides_[kKvAxis];
  return e * element_bytes_;
}

BlockBox PoolLayout::WholeBlock(int64_t block) const {
  return BlockBox{block,
                  {0, dims_[kLayerAxis]},
                  {0, dims_[kKvAxis]},
                  {0, dims_[kHeadAxis]},
                  {0, dims_[kTokenAxis]}};
}

Status PoolLayout::CheckBox(const BlockBox& box) const {
  if (box.block < 0 || box.block >= dims_[kBlockAxis]) {
    return Status::InvalidArgument(
        fmt::format("block id {} is outside the pool's [0, {})", box.block, dims_[kBlockAxis]));
  }
  const Range* r[] = {&box.layers, &box.kv, &box.heads, &box.tokens};
  const char* names[] = {"layers", "kv", "heads", "tokens"};
  for (int i = 0; i < 4; ++i) {
    int64_t n = dims_[kLayerAxis + i];
    if (r[i]->begin < 0 || r[i]->end > n || r[i]->begin >= r[i]->end) {
      return Status::InvalidArgument(fmt::format("{} range [{}, {}) is empty or outside [0, {})",
                                                 names[i], r[i]->begin, r[i]->end, n));
    }
  }
  return Status::Ok();
}

namespace {

// Appends the extent, merged with the one before it when they touch.
void Push(std::vector<Extent>& out, int32_t region, int64_t offset, int64_t bytes) {
  if (!out.empty()) {
    Extent& last = out.back();
    StridedRun run{.src_region = last.region,
                   .src_offset = last.offset,
                   .dst_region = last.region,
                   .dst_offset = last.offset,
                   .bytes = last.bytes};
    const StridedRun next{.src_region = region,
                          .src_offset = offset,
                          .dst_region = region,
                          .dst_offset = offset,
                          .bytes = bytes};
    if (MergeRuns(run, next, RunMerge::kLinear)) {
      last.bytes = run.bytes;
      return;
    }
  }
  out.push_back(Extent{region, offset, bytes});
}

}  // namespace

void PoolLayout::AppendExtents(const BlockBox& box, std::vector<Extent>& out) const {
  const Range ranges[kNumAxes] = {
      {box.block, box.block + 1}, box.layers, box.kv, box.heads, box.tokens, {0, dims_[kDimAxis]}};
  // Axes looped inside one region (dim is always the contiguous innermost run).
  int loop_axes[4];
  int n = 0;
  for (int a = kLayerAxis; a < kDimAxis; ++a) {
    if (RegionAxis(a)) continue;
    if (ranges[a].size() > 1) loop_axes[n++] = a;
  }
  for (int i = 1; i < n; ++i) {  // insertion sort by stride (n <= 4)
    for (int j = i; j > 0 && strides_[loop_axes[j]] < strides_[loop_axes[j - 1]]; --j) {
      std::swap(loop_axes[j], loop_axes[j - 1]);
    }
  }
  // Contiguous inner axes fold into the run; the rest are looped, innermost first.
  CopyAxis axes[4];
  for (int i = 0; i < n; ++i) {
    const int64_t stride = strides_[loop_axes[i]] * element_bytes_;
    axes[i] = CopyAxis{ranges[loop_axes[i]].size(), stride, stride};
  }
  const ContiguousRun folded =
      FoldContiguous(std::span(axes, n), (AxisSet{1} << n) - 1, dims_[kDimAxis] * element_bytes_);
  const int64_t run = folded.bytes;
  int outer_axes[4];
  int outer = 0;
  for (int i = 0; i < n; ++i) {
    if (!InSet(folded.axes, i)) outer_axes[outer++] = loop_axes[i];
  }
  // Region axes (layer, kv) are the outermost loops, so extents come region by region.
  const Range layer_loop =
      region_per_layer() ? box.layers : Range{box.layers.begin, box.layers.begin + 1};
  const Range kv_loop = region_per_kv() ? box.kv : Range{box.kv.begin, box.kv.begin + 1};
  for (int64_t layer = layer_loop.begin; layer < layer_loop.end; ++layer) {
    for (int64_t kv = kv_loop.begin; kv < kv_loop.end; ++kv) {
      const int32_t region = RegionOf(layer, kv);
      const int64_t base = ByteOffset(box.block, layer, kv, box.heads.begin, box.tokens.begin, 0);
      int64_t idx[4] = {0, 0, 0, 0};
      while (true) {
        int64_t off = base;
        for (int i = 0; i < outer; ++i) off += idx[i] * strides_[outer_axes[i]] * element_bytes_;
        Push(out, region, off, run);
        int i = 0;
        for (; i < outer; ++i) {
          if (++idx[i] < ranges[outer_axes[i]].size()) break;
          idx[i] = 0;
        }
        if (i == outer) break;
      }
    }
  }
}

std::vector<Extent> PoolLayout::Extents(const BlockBox& box) const {
  std::vector<Extent> out;
  AppendExtents(box, out);
  return out;
}

std::string PoolLayout::ToString() const {
  return fmt::format("{} (blk,L,kv,h,t,d)=({}):({}){} {}B/elem", LayoutKindName(kind_),
                     fmt::join(dims_, ","), fmt::join(strides_, ","),
                     split_ == RegionSplit::kNone
                         ? std::string()
                         : fmt::format(" regions {}", RegionSplitName(split_)),
                     element_bytes_);
}

PoolDims RankPoolDims(const KvShape& shape, const RankSlice& slice, int64_t blocks) {
  return PoolDims{blocks,           slice.layer_count,      shape.kv_factor,
                  slice.head_count, shape.tokens_per_block, shape.head_dim};
}

StatusOr<PoolDims> InstancePoolDims(const KvShape& shape, const ParallelConfig& parallel,
                                    int64_t blocks) {
  PoolDims span{};
  for (int32_t r = 0; r < parallel.world_size(); ++r) {
    KVF_ASSIGN_OR_RETURN(const RankSlice slice, SliceOf(shape, parallel, r));
    const PoolDims dims = RankPoolDims(shape, slice, blocks);
    for (int a = 0; a < kNumAxes; ++a) span[a] = std::max(span[a], dims[a]);
  }
  return span;
}

namespace {
constexpr std::string_view kAxisNames[kNumAxes] = {"block", "layer", "kv", "head", "token", "dim"};
constexpr std::string_view kCustomSyntax =
    "custom:SPLIT:AXES[:pad=N] (SPLIT one|per-layer|per-kv|per-layer-kv; AXES the axes inside a "
    "region outermost first, e.g. block,kv,layer,head,token,dim, without those the split selects, "
    "dim last)";

std::vector<std::string_view> SplitOn(std::string_view text, char sep) {
  std::vector<std::string_view> out;
  size_t start = 0;
  for (size_t i = 0; i <= text.size(); ++i) {
    if (i == text.size() || text[i] == sep) {
      out.push_back(text.substr(start, i - start));
      start = i + 1;
    }
  }
  return out;
}
}  // namespace

StatusOr<LayoutSpec> LayoutSpec::Parse(std::string_view text) {
  LayoutSpec spec;
  if (!text.starts_with("custom:")) {
    KVF_ASSIGN_OR_RETURN(spec.kind, ParseLayoutKind(text));
    return spec;
  }
  auto bad = [&](std::string_view why) {
    return Status::InvalidArgument(
        fmt::format("layout '{}': {}; expected {}", text, why, kCustomSyntax));
  };
  const std::vector<std::string_view> parts = SplitOn(text, ':');
  if (parts.size() < 3 || parts.size() > 4) return bad("wrong number of ':' fields");
  spec.kind = LayoutKind::kCustom;
  bool split_known = false;
  for (RegionSplit s : {RegionSplit::kNone, RegionSplit::kPerLayer, RegionSplit::kPerKv,
                        RegionSplit::kPerLayerKv}) {
    if (RegionSplitName(s) == parts[1]) {
      spec.split = s;
      split_known = true;
    }
  }
  if (!split_known) return bad(fmt::format("unknown region split '{}'", parts[1]));
  bool seen[kNumAxes] = {};
  for (std::string_view name : SplitOn(parts[2], ',')) {
    const auto* it = std::find(std::begin(kAxisNames), std::end(kAxisNames), name);
    if (it == std::end(kAxisNames)) return bad(fmt::format("unknown axis '{}'", name));
    const int a = static_cast<int>(it - std::begin(kAxisNames));
    if (seen[a]) return bad(fmt::format("axis '{}' twice", name));
    if (IsRegionAxis(spec.split, a)) {
      return bad(fmt::format("axis '{}' selects a region with split {}", name, parts[1]));
    }
    seen[a] = true;
    spec.order.push_back(a);
  }
  for (int a = 0; a < kNumAxes; ++a) {
    if (!seen[a] && !IsRegionAxis(spec.split, a))
      return bad(fmt::format("axis '{}' is missing", kAxisNames[a]));
  }
  if (spec.order.back() != kDimAxis) return bad("dim must be the last (contiguous) axis");
  if (parts.size() == 4) {
    const std::string_view p = parts[3];
    int64_t pad = -1;
    if (p.starts_with("pad=")) {
      const std::string_view digits = p.substr(4);
      auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), pad);
      if (ec != std::errc() || end != digits.data() + digits.size()) pad = -1;
    }
    if (pad < 0 || pad > (int64_t{1} << 40)) return bad(fmt::format("bad padding '{}'", p));
    spec.pad = pad;
  }
  return spec;
}

std::string LayoutSpec::ToString() const {
  if (kind != LayoutKind::kCustom) return std::string(LayoutKindName(kind));
  std::string axes;
  for (int a : order) axes += fmt::format("{}{}", axes.empty() ? "" : ",", kAxisNames[a]);
  return fmt::format("custom:{}:{}{}", RegionSplitName(split), axes,
                     pad ? fmt::format(":pad={}", pad) : "");
}

PoolStrides LayoutSpec::Strides(const PoolDims& span) const {
  PoolStrides strides{};
  int64_t extent = 1;  // elements spanned by the axes inside
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    strides[*it] = *it == kBlockAxis ? extent + pad : extent;
    extent = CheckedMul(strides[*it], span[*it]).value_or(INT64_MAX / 2);
  }
  return strides;
}

StatusOr<PoolLayout> LayoutSpec::Make(const PoolDims& dims, const PoolDims& span,
                                      int64_t element_bytes) const {
  if (kind != LayoutKind::kCustom) return PoolLayout::Make(kind, dims, element_bytes);
  return PoolLayout::Custom(dims, Strides(span), split, element_bytes);
}

}  // namespace kvferry
