// Validation of a plan's inputs, shared by the planner's entry points (planner.cc): both
// instances compatible (CheckCompatible, planner.h), the prompt and block ids sound, the chunking
// parameters in range. Pure; internal to the planner layer.
#pragma once

#include <cstdint>

#include "planner/planner.h"

namespace kvferry {

// Blocks of the prompt on each side (its tokens, rounded up to whole blocks of that side's size).
int64_t CtxBlocksNeeded(const PlanInput& in);
int64_t GenBlocksNeeded(const PlanInput& in);

// Pieces at least this large go pool to pool (a direct chunk): in.direct_min_bytes, or never
// when the plan converts dtypes (a direct chunk is copied as it is).
int64_t DirectMin(const PlanInput& in);

// Why `in` can't be planned (the error names the field and both values), or OK.
Status CheckInput(const PlanInput& in);

}  // namespace kvferry
