// The device conformance suite (device_conformance_test.cc) runs against whatever device the
// test binary provides here: the CPU device in cpu_device_test.cc, the CUDA device in
// cuda/cuda_device_test.cc. Returning null skips the suite (no GPU present).
#pragma once

#include <memory>

#include "kvferry/device.h"

namespace kvferry::testing {

std::unique_ptr<Device> DeviceUnderTest();

}  // namespace kvferry::testing
