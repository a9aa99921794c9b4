// A layer folder's helper shared by tests: test_support_in_layer.sh must report it.
#pragma once

#include "testing/testdata.h"
