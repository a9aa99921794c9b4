// Block ids, token ids and block moves from Python: a list or tuple of ints, or a 1-D (moves: an
// N x 2 or N x 3) integer array: numpy, torch (CPU) or anything with __dlpack__ on the CPU. Arrays
// are read in place, whatever their strides, without a Python call per element. And block ids
// back to Python as numpy int64 arrays.
#pragma once

#include <cstdint>
#include <vector>

#include "bindings.h"
#include "kvferry/tiering.h"

namespace kvferry::py {

// The ids in `obj`; `what` names the argument in errors. Values outside T's range, a float array,
// an array of another rank or on a GPU are refused with InvalidArgument.
std::vector<int64_t> Int64Ids(nb::handle obj, const char* what);
std::vector<int32_t> Int32Ids(nb::handle obj, const char* what);

// (src, dst) or (src, dst, tokens) per move: a sequence of tuples, or an N x 2 / N x 3 array.
std::vector<BlockMove> ParseMoves(nb::handle moves);

// A numpy int64 array owning `ids`.
nb::object Int64Array(std::vector<int64_t> ids);

}  // namespace kvferry::py
