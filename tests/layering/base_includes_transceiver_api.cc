// Must NOT compile against the base layer's include root: a public header of a higher layer.
#include "kvferry/transceiver.h"
