#include "kvferry/build_info.h"

#include "device/cuda_entry.h"
#include "kvferry_build_config.h"

namespace kvferry {

std::string_view Version() { return KVFERRY_VERSION; }

std::vector<Feature> BuildFeatures() {
  std::vector<Feature> f;
  std::string cuda_runtime = internal::CudaVersionString();
  f.push_back(
      {"cuda", KVFERRY_HAVE_CUDA != 0, KVFERRY_CUDA_VERSION,
       KVFERRY_HAVE_CUDA
           ? (cuda_runtime.empty() ? "compiled in; no usable GPU or driver now" : cuda_runtime)
           : "nvcc not found at configure time"});
  f.push_back({"ucx", KVFERRY_HAVE_UCX != 0, KVFERRY_UCX_VERSION, KVFERRY_UCX_NOTE});
  f.push_back({"mpi", KVFERRY_HAVE_MPI != 0, KVFERRY_MPI_VERSION, KVFERRY_MPI_NOTE});
  f.push_back({"cufile", KVFERRY_HAVE_CUFILE != 0, KVFERRY_CUFILE_VERSION, KVFERRY_CUFILE_NOTE});
  f.push_back({"nccl", KVFERRY_HAVE_NCCL != 0, KVFERRY_NCCL_VERSION, KVFERRY_NCCL_NOTE});
  f.push_back({"io_uring", KVFERRY_HAVE_URING != 0, KVFERRY_URING_VERSION, KVFERRY_URING_NOTE});
  return f;
}

}  // namespace kvferry
