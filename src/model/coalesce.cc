#include "model/coalesce.h"

namespace kvferry {

ContiguousRun FoldContiguous(std::span<const CopyAxis> axes, AxisSet eligible, int64_t bytes) {
  ContiguousRun r{bytes, 0};
  const int n = static_cast<int>(axes.size());
  for (bool grew = true; grew;) {
    grew = false;
    for (int a = 0; a < n; ++a) {
      if (!InSet(eligible, a) || InSet(r.axes, a) || axes[a].n <= 1) continue;
      if (axes[a].src == r.bytes && axes[a].dst == r.bytes) {
        r.bytes *= axes[a].n;
        r.axes |= AxisSet{1} << a;
        grew = true;
      }
    }
  }
  return r;
}

RowChain ChainRows(std::span<const CopyAxis> axes, AxisSet eligible, int first) {
  RowChain c{axes[first].n, axes[first].src, axes[first].dst, AxisSet{1} << first};
  const int n = static_cast<int>(axes.size());
  for (bool grew = true; grew;) {
    grew = false;
    for (int b = 0; b < n; ++b) {
      if (!InSet(eligible, b) || InSet(c.axes, b) || axes[b].n <= 1) continue;
      if (axes[b].src == c.src_pitch * c.rows && axes[b].dst == c.dst_pitch * c.rows) {
        c.rows *= axes[b].n;
        c.axes |= AxisSet{1} << b;
        grew = true;
      }
    }
  }
  return c;
}

namespace {

// True when `rows` rows of `bytes` at `pitch` do not overlap one another.
bool RowsApart(int64_t rows, int64_t bytes, int64_t pitch) { return rows == 1 || pitch >= bytes; }

}  // namespace

bool MergeRuns(StridedRun& last, const StridedRun& next, RunMerge how) {
  if (last.src_region != next.src_region || last.dst_region != next.dst_region) return false;
  if (next.bytes <= 0 || next.rows <= 0 || last.bytes <= 0 || last.rows <= 0) return false;
  const bool strided = how == RunMerge::kStrided;
  if (!strided && (last.rows != 1 || next.rows != 1)) return false;
  // Side by side: each row grows.
  if (last.rows == next.rows && next.src_offset == last.src_offset + last.bytes &&
      next.dst_offset == last.dst_offset + last.bytes &&
      (last.rows == 1 || (last.src_pitch == next.src_pitch && last.dst_pitch == next.dst_pitch))) {
    const int64_t bytes = last.bytes + next.bytes;
    if (!RowsApart(last.rows, bytes, last.src_pitch) ||
        !RowsApart(last.rows, bytes, last.dst_pitch)) {
      return false;
    }
    last.bytes = bytes;
    return true;
  }
  // One after the other: more rows at the same pitches.
  if (!strided || last.bytes != next.bytes) return false;
  int64_t sp = last.src_pitch, dp = last.dst_pitch;
  if (last.rows == 1) {
    sp = next.src_offset - last.src_offset;
    dp = next.dst_offset - last.dst_offset;
    if (sp < last.bytes || dp < last.bytes) return false;  // backwards or overlapping
  } else {
    // Hostile offsets and pitches (a handle's) can overflow the row arithmetic: no chain then.
    int64_t src_end = 0, dst_end = 0;
    if (__builtin_mul_overflow(last.rows, sp, &src_end) ||
        __builtin_add_overflow(src_end, last.src_offset, &src_end) ||
        __builtin_mul_overflow(last.rows, dp, &dst_end) ||
        __builtin_add_overflow(dst_end, last.dst_offset, &dst_end) || next.src_offset != src_end ||
        next.dst_offset != dst_end) {
      return false;
    }
  }
  if (next.rows > 1 && (next.src_pitch != sp || next.dst_pitch != dp)) return false;
  last.src_pitch = sp;
  last.dst_pitch = dp;
  last.rows += next.rows;
  return true;
}

}  // namespace kvferry
