// Coalescing: the one routine that turns a box of a strided layout into few long runs. Pool
// extents (PoolLayout::AppendExtents), transfer plans (planner) and tier copies (tiering's
// AppendRunCopies) all use it, so "which bytes merge into one copy" has one definition.
//
// Two steps, both pure and allocation-free:
//   - Axis folding, before any run exists: a copy is (run of `bytes`) x axes, each axis stepping
//     a byte stride on the source and on the destination. FoldContiguous grows the run by every
//     axis contiguous on both sides; ChainRows turns the next axes into the rows of a 2-D copy
//     (uniform pitch on each side).
//   - Run merging, as runs are emitted: MergeRuns joins a run to the one before it when the two
//     are exactly one run (side by side, or, for 2-D runs, one after the other at one pitch).
//
// A one-sided walk (a pool's own extents) passes the same stride and offset on both sides.
// Thread-compatible (no state).
#pragma once

#include <cstdint>
#include <span>

namespace kvferry {

// One axis of a copy: `n` indices, stepping `src` bytes on the source and `dst` bytes on the
// destination.
struct CopyAxis {
  int64_t n = 1;
  int64_t src = 0;
  int64_t dst = 0;
};

// A set of axes: bit i stands for axes[i] of the span it goes with.
using AxisSet = uint32_t;
inline constexpr int kMaxCopyAxes = 32;
constexpr bool InSet(AxisSet set, int i) { return (set >> i) & 1u; }

struct ContiguousRun {
  int64_t bytes = 0;  // the grown run
  AxisSet axes = 0;   // the axes folded into it
};

// Grows a contiguous run of `bytes` by each axis of `eligible` whose stride is the run so far on
// both sides (its indices then follow each other with no gap), scanning the axes in order again
// until none grows it. Axes with n <= 1 add nothing and are never folded. With axes that do not
// alias (no axis steps inside the run of the others), the result does not depend on the order.
ContiguousRun FoldContiguous(std::span<const CopyAxis> axes, AxisSet eligible, int64_t bytes);

struct RowChain {
  int64_t rows = 1;
  int64_t src_pitch = 0;  // stride between rows, bytes (that of the first axis)
  int64_t dst_pitch = 0;
  AxisSet axes = 0;  // the axes making up the rows
};

// The rows of a 2-D copy starting with axes[first]: that axis, then each axis of `eligible` that
// steps over all rows so far on both sides (stride = rows * pitch), scanning in order again until
// none grows it. `first` need not be in `eligible`. The rows of the result are uniformly spaced.
RowChain ChainRows(std::span<const CopyAxis> axes, AxisSet eligible, int first);

// A run of a copy: `rows` rows of `bytes` bytes; row r starts at offset + r * pitch in its region
// on each side (pitch unused when rows == 1).
struct StridedRun {
  int32_t src_region = 0;
  int64_t src_offset = 0;
  int64_t src_pitch = 0;
  int32_t dst_region = 0;
  int64_t dst_offset = 0;
  int64_t dst_pitch = 0;
  int64_t bytes = 0;  // per row
  int64_t rows = 1;
  bool operator==(const StridedRun&) const = default;
};

enum class RunMerge {
  kLinear,   // runs stay 1-D: only runs that touch (end of one = start of the next) merge
  kStrided,  // also stack equal-width rows at one pitch per side into a 2-D run
};

// Merges `next` into `last` when the two are exactly one run covering both, on both sides:
//   - side by side: same rows (and pitches), `next` starting where each row of `last` ends;
//   - (kStrided) one after the other: same width, `next` starting one pitch after the last row
//     of `last` (with a single row, `next` sets the pitch; it must step forward).
// Returns false, leaving `last` unchanged, when they are not: different regions, a gap
// (kLinear), overlapping bytes (rows that would overlap are refused too), an empty run, or
// pitches that differ.
bool MergeRuns(StridedRun& last, const StridedRun& next, RunMerge how);

}  // namespace kvferry
