#include <fmt/format.h>

#include "device/cuda_entry.h"

namespace kvferry::internal {

bool CudaCompiledIn() { return false; }
int CudaDeviceCount() { return 0; }
std::string CudaVersionString() { return {}; }
StatusOr<std::unique_ptr<Device>> OpenCudaDevice(int ordinal) {
  return Status::Unavailable(
      fmt::format("cuda:{}: this build of kvferry has no CUDA support", ordinal));
}

}  // namespace kvferry::internal
