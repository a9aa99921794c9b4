// A test beside its code may include test support: test_support_in_layer.sh must not report it.
#include "testing/testdata.h"
