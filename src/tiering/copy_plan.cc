#include "tiering/copy_plan.h"

#include <algorithm>
#include <utility>

#include "model/coalesce.h"

namespace kvferry::tiering {

bool SameBlockShape(const PoolLayout& a, const PoolLayout& b) {
  if (a.element_bytes() != b.element_bytes()) return false;
  for (int ax = kLayerAxis; ax < kNumAxes; ++ax) {
    if (a.dims()[ax] != b.dims()[ax]) return false;
  }
  return true;
}

namespace {

// One axis of the copy: its extent and its byte strides on both sides. A "region" axis is the
// layer or kv axis of a layout split into regions along it: it selects a region instead of
// striding.
struct Axis {
  int64_t n = 0;
  int64_t s = 0;  // source stride, bytes
  int64_t d = 0;  // destination stride, bytes
  bool src_region = false;
  bool dst_region = false;
  int layout_axis = 0;
};

}  // namespace

size_t AppendRunCopies(const TierView& src, int64_t src_block, const TierView& dst,
                       int64_t dst_block, int64_t count, int64_t tokens,
                       std::vector<CopyDesc>& out) {
  const PoolLayout& sl = *src.layout;
  const PoolLayout& dl = *dst.layout;
  const int64_t eb = sl.element_bytes();
  const PoolDims& dims = sl.dims();
  tokens = std::min(tokens, dims[kTokenAxis]);
  if (tokens <= 0 || count <= 0) return 0;

  Axis axes[5];
  int na = 0;
  auto add = [&](int a, int64_t n) {
    if (n <= 1) return;
    axes[na++] =
        Axis{n, sl.strides()[a] * eb, dl.strides()[a] * eb, sl.RegionAxis(a), dl.RegionAxis(a), a};
  };
  add(kBlockAxis, count);
  add(kLayerAxis, dims[kLayerAxis]);
  add(kKvAxis, dims[kKvAxis]);
  add(kHeadAxis, dims[kHeadAxis]);
  add(kTokenAxis, tokens);

  // Strided axes first, innermost (by source stride) first; region axes last.
  auto before = [](const Axis& x, const Axis& y) {
    const bool rx = x.src_region || x.dst_region, ry = y.src_region || y.dst_region;
    if (rx != ry) return ry;
    if (x.s != y.s) return x.s < y.s;
    return x.d < y.d;
  };
  for (int a = 1; a < na; ++a) {  // insertion sort (na <= 5)
    for (int b = a; b > 0 && before(axes[b], axes[b - 1]); --b) std::swap(axes[b], axes[b - 1]);
  }
  // 1. The contiguous run and 2. the rows of a 2-D descriptor (the next strided axis, extended
  // by outer axes of uniform pitch); region axes are never folded.
  CopyAxis copy_axes[5];
  AxisSet strided = 0;
  for (int k = 0; k < na; ++k) {
    copy_axes[k] = CopyAxis{axes[k].n, axes[k].s, axes[k].d};
    if (!axes[k].src_region && !axes[k].dst_region) strided |= AxisSet{1} << k;
  }
  const std::span<const CopyAxis> span(copy_axes, na);
  const ContiguousRun folded = FoldContiguous(span, strided, dims[kDimAxis] * eb);
  const int64_t run = folded.bytes;
  AxisSet used = folded.axes;
  int64_t rows = 1, sp = 0, dp = 0;
  for (int k = 0; k < na; ++k) {
    if (!InSet(strided, k) || InSet(used, k)) continue;
    const RowChain chain = ChainRows(span, strided & ~used, k);
    rows = chain.rows;
    sp = chain.src_pitch;
    dp = chain.dst_pitch;
    used |= chain.axes;
    break;
  }
  // 3. Everything else is an outer loop, one descriptor per point.
  Axis outer[5];
  int no = 0;
  for (int k = 0; k < na; ++k) {
    if (!InSet(used, k)) outer[no++] = axes[k];
  }
  const int64_t sbase = sl.ByteOffset(src_block, 0, 0, 0, 0, 0);
  const int64_t dbase = dl.ByteOffset(dst_block, 0, 0, 0, 0, 0);
  int64_t idx[5] = {0, 0, 0, 0, 0};
  size_t emitted = 0;
  while (true) {
    int64_t so = sbase, doff = dbase;
    int64_t src_at[kNumAxes] = {}, dst_at[kNumAxes] = {};  // region-axis indices
    for (int k = 0; k < no; ++k) {
      if (outer[k].src_region) {
        src_at[outer[k].layout_axis] = idx[k];
      } else {
        so += idx[k] * outer[k].s;
      }
      if (outer[k].dst_region) {
        dst_at[outer[k].layout_axis] = idx[k];
      } else {
        doff += idx[k] * outer[k].d;
      }
    }
    const int32_t sr = sl.RegionOf(src_at[kLayerAxis], src_at[kKvAxis]);
    const int32_t dr = dl.RegionOf(dst_at[kLayerAxis], dst_at[kKvAxis]);
    CopyDesc c{dst.regions[dr] + doff, src.regions[sr] + so, static_cast<size_t>(run)};
    if (rows > 1) {
      c.rows = static_cast<size_t>(rows);
      c.src_pitch = static_cast<size_t>(sp);
      c.dst_pitch = static_cast<size_t>(dp);
    }
    out.push_back(c);
    ++emitted;
    int k = 0;
    for (; k < no; ++k) {
      if (++idx[k] < outer[k].n) break;
      idx[k] = 0;
    }
    if (k == no) break;
  }
  return emitted;
}

StatusOr<PoolLayout> PackedLayoutLike(const PoolLayout& like, int64_t blocks) {
  PoolDims dims = like.dims();
  dims[kBlockAxis] = blocks;
  // Order the in-block axes as `like` does: region (layer) axis outermost, then by stride.
  int order[4] = {kLayerAxis, kKvAxis, kHeadAxis, kTokenAxis};
  auto key = [&](int a) -> int64_t {
    if (like.RegionAxis(a)) return a == kLayerAxis ? INT64_MAX : INT64_MAX - 1;
    return like.strides()[a];
  };
  std::sort(order, order + 4, [&](int x, int y) { return key(x) < key(y); });
  PoolStrides strides{};
  strides[kDimAxis] = 1;
  int64_t s = dims[kDimAxis];
  for (int a : order) {
    strides[a] = s;
    s *= dims[a];
  }
  strides[kBlockAxis] = s;
  return PoolLayout::Custom(dims, strides, /*region_per_layer=*/false, like.element_bytes());
}

}  // namespace kvferry::tiering
