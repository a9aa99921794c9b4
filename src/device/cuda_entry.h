// The seam between the device factory and the CUDA device. With CUDA compiled in, these are
// defined in src/device/cuda/; without it, in src/device/no_cuda.cc.
#pragma once

#include <memory>
#include <string>

#include "kvferry/device.h"

namespace kvferry::internal {

bool CudaCompiledIn();
// Number of GPUs usable now (0 without CUDA, without a driver or without a GPU).
int CudaDeviceCount();
// "runtime 13.0, driver 13.0" ("no driver" when none is loaded); empty without CUDA.
std::string CudaVersionString();
StatusOr<std::unique_ptr<Device>> OpenCudaDevice(int ordinal);

}  // namespace kvferry::internal
