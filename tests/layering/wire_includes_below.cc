// Must compile against the wire layer's include root (the control for wire_includes_engine): the
// messages and the handle need only the planner's types and the layers below.
#include "transceiver/wire/handle.h"
#include "transceiver/wire/messages.h"

int main() { return 0; }
