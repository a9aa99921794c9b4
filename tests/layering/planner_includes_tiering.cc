// Must NOT compile against the planner layer's include root: tiering sits above the planner.
#include "tiering/copy_plan.h"
