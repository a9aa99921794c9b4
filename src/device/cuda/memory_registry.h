// What a pointer is, for the CUDA device: the process-wide registry of the allocations every
// CudaDevice made (and the peer regions it mapped), with cudaPointerGetAttributes as the fallback
// for pointers it does not know. Private to src/device/cuda/ (cuda_device.cc classifies batches
// with it, cuda_ipc.cc registers mapped peer regions). Thread-safe.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <shared_mutex>
#include <utility>

namespace kvferry::internal::cuda {

enum class PtrClass : uint8_t {
  kDevice,      // device memory of one GPU (ordinal says which)
  kMappedHost,  // pinned host memory mapped at the same address on every GPU (UVA)
  kHost,        // pageable host memory, or pinned memory a kernel can't use at its address
  kOther,       // managed memory and other kinds: left to the copy engine
};

struct PtrInfo {
  PtrClass cls;
  int ordinal;  // for kDevice
};

// Every allocation made by a CudaDevice of this process, by address range.
class MemoryRegistry {
 public:
  static MemoryRegistry& Get() {
    static MemoryRegistry* r = new MemoryRegistry();  // never destroyed: Buffers may outlive main
    return *r;
  }
  void Add(const void* p, size_t n, PtrInfo info) {
    std::unique_lock lock(mu_);
    ranges_[Addr(p)] = Range{Addr(p) + n, info};
  }
  void Remove(const void* p) {
    std::unique_lock lock(mu_);
    ranges_.erase(Addr(p));
  }

  struct Range {
    uintptr_t end;
    PtrInfo info;
  };
  std::shared_mutex& mu() { return mu_; }
  // Caller holds mu() (shared). Null when p is in no registered range.
  const std::pair<const uintptr_t, Range>* FindLocked(uintptr_t p) const {
    auto it = ranges_.upper_bound(p);
    if (it == ranges_.begin()) return nullptr;
    --it;
    return p < it->second.end ? &*it : nullptr;
  }
  static uintptr_t Addr(const void* p) { return reinterpret_cast<uintptr_t>(p); }

 private:
  std::shared_mutex mu_;
  std::map<uintptr_t, Range> ranges_;
};

inline PtrInfo QueryPointer(const void* p) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();
    return {PtrClass::kHost, -1};
  }
  switch (a.type) {
    case cudaMemoryTypeDevice:
      return {PtrClass::kDevice, a.device};
    case cudaMemoryTypeHost:
      return {a.devicePointer == p ? PtrClass::kMappedHost : PtrClass::kHost, -1};
    case cudaMemoryTypeManaged:
      return {PtrClass::kOther, a.device};
    default:
      return {PtrClass::kHost, -1};
  }
}

}  // namespace kvferry::internal::cuda
