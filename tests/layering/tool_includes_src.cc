// Must NOT compile against the tools' include root: tools use public and testing headers only.
#include "transport/ucx_transport_impl.h"
