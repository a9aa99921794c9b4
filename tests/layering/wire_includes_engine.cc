// Must NOT compile against the wire layer's include root: the sides (engine, paths) sit above the
// wire they speak.
#include "transceiver/engine/engine.h"
