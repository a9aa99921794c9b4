// Must compile against the planner layer's include root (the control for the negative tests):
// its own headers, the layers below (model, device, pool, base) and their public headers.
#include "base/log.h"
#include "kvferry/pool.h"
#include "planner/planner.h"

int main() { return 0; }
