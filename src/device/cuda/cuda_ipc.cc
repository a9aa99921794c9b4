#include "device/cuda/cuda_ipc.h"

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <string>

#include "base/wire.h"
#include "device/cuda/cuda_util.h"
#include "device/cuda/memory_registry.h"
#include "device/peer_memory.h"

namespace kvferry::internal::cuda {
namespace {

// The allocation holding `p` (any interior pointer), from the driver: engines' tensors are
// interior pointers of their allocators' segments, and a CUDA IPC handle names a whole
// allocation.
Status AllocationOf(const void* p, uintptr_t& base, size_t& size) {
  using Fn = int (*)(unsigned long long*, size_t*, unsigned long long);
  static Fn fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &f, 12000, cudaEnableDefault,
                                         &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return static_cast<Fn>(nullptr);
    }
    return reinterpret_cast<Fn>(f);
  }();
  if (fn == nullptr) return Status::Unavailable("cuMemGetAddressRange is not available");
  unsigned long long b = 0;
  size_t n = 0;
  const int rc = fn(&b, &n, reinterpret_cast<uintptr_t>(p));
  if (rc != 0) {
    return Status::InvalidArgument(
        fmt::format("{} is not device memory CUDA knows (cuMemGetAddressRange: {})", p, rc));
  }
  base = b;
  size = n;
  return Status::Ok();
}

// One opening of a peer allocation per process, shared by every importer (CUDA maps a handle
// once per context).
class IpcOpenings {
 public:
  static IpcOpenings& Get() {
    static IpcOpenings* o = new IpcOpenings();
    return *o;
  }
  // The opened allocation: its base here and its size (cuMemGetAddressRange of the opening).
  struct Opened {
    std::byte* base;
    size_t bytes;
  };
  StatusOr<Opened> Open(int ordinal, const cudaIpcMemHandle_t& h) {
    std::lock_guard lock(mu_);
    std::string key(reinterpret_cast<const char*>(&h), sizeof(h));
    auto it = open_.find(key);
    if (it != open_.end()) {
      ++it->second.refs;
      return Opened{it->second.base, it->second.bytes};
    }
    void* p = nullptr;
    KVF_RETURN_IF_ERROR(CudaCheck(cudaSetDevice(ordinal), "cudaSetDevice({})", ordinal));
    KVF_RETURN_IF_ERROR(CudaCheck(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess),
                                  "cuda:{} cudaIpcOpenMemHandle", ordinal));
    uintptr_t base = 0;
    size_t bytes = 0;
    if (Status st = AllocationOf(p, base, bytes); !st.ok()) {
      cudaIpcCloseMemHandle(p);
      cudaGetLastError();
      return st.WithContext(fmt::format("cuda:{} opened peer allocation", ordinal));
    }
    // The opening maps the whole allocation: its range starts at the pointer CUDA returned.
    bytes -= static_cast<size_t>(reinterpret_cast<uintptr_t>(p) - base);
    open_.emplace(key, Entry{static_cast<std::byte*>(p), bytes, 1});
    return Opened{static_cast<std::byte*>(p), bytes};
  }
  void Close(int ordinal, const cudaIpcMemHandle_t& h) {
    std::lock_guard lock(mu_);
    auto it = open_.find(std::string(reinterpret_cast<const char*>(&h), sizeof(h)));
    if (it == open_.end() || --it->second.refs > 0) return;
    cudaSetDevice(ordinal);
    cudaIpcCloseMemHandle(it->second.base);
    cudaGetLastError();
    open_.erase(it);
  }

 private:
  struct Entry {
    std::byte* base;
    size_t bytes;
    int refs;
  };
  std::mutex mu_;
  std::map<std::string, Entry> open_;
};

class IpcMapping final : public PeerMapping {
 public:
  IpcMapping(int ordinal, cudaIpcMemHandle_t h, std::byte* region, size_t bytes)
      : ordinal_(ordinal), h_(h), region_(region), bytes_(bytes) {
    MemoryRegistry::Get().Add(region_, bytes_, QueryPointer(region_));
  }
  ~IpcMapping() override {
    MemoryRegistry::Get().Remove(region_);
    IpcOpenings::Get().Close(ordinal_, h_);
  }
  std::byte* data() const override { return region_; }
  size_t size() const override { return bytes_; }

 private:
  const int ordinal_;
  const cudaIpcMemHandle_t h_;
  std::byte* const region_;
  const size_t bytes_;
};

// The payload: u32 ordinal, u64 offset of the region in its allocation, the IPC handle.
constexpr size_t kIpcPayload = 4 + 8 + sizeof(cudaIpcMemHandle_t);

}  // namespace

StatusOr<std::vector<std::byte>> ExportIpcMemory(int ordinal, const void* base, size_t bytes,
                                                 MemoryKind kind) {
  if (kind != MemoryKind::kDevice || base == nullptr || bytes == 0) {
    return Status::InvalidArgument(fmt::format(
        "cuda:{} ExportMemory: {} bytes of {} memory at {}: only device memory is shared", ordinal,
        bytes, MemoryKindName(kind), base));
  }
  KVF_RETURN_IF_ERROR(CudaCheck(cudaSetDevice(ordinal), "cudaSetDevice({})", ordinal));
  uintptr_t alloc = 0;
  size_t alloc_size = 0;
  KVF_RETURN_IF_ERROR(AllocationOf(base, alloc, alloc_size));
  const uintptr_t b = reinterpret_cast<uintptr_t>(base);
  if (b - alloc > alloc_size || bytes > alloc_size - (b - alloc)) {
    return Status::InvalidArgument(
        fmt::format("cuda:{} ExportMemory: {} bytes at {} run past their allocation ({:#x} + {})",
                    ordinal, bytes, base, alloc, alloc_size));
  }
  cudaIpcMemHandle_t h{};
  KVF_RETURN_IF_ERROR(CudaCheck(cudaIpcGetMemHandle(&h, reinterpret_cast<void*>(alloc)),
                                "cuda:{} cudaIpcGetMemHandle({:#x})", ordinal, alloc));
  PeerHandle ph;
  ph.platform = PeerPlatform::kCuda;
  ph.pid = ThisPid();
  ph.host = ThisHostId();
  ph.address = b;
  ph.bytes = bytes;
  KVF_ASSIGN_OR_RETURN(ph.export_token, RegisterPeerExport(ph.address, ph.bytes, ph.platform));
  WireWriter payload;
  payload.U32(static_cast<uint32_t>(ordinal));
  payload.U64(b - alloc);
  const auto* hb = reinterpret_cast<const std::byte*>(&h);
  payload.buffer().insert(payload.buffer().end(), hb, hb + sizeof(h));
  ph.payload = payload.Take();
  return EncodePeerHandle(ph);
}

StatusOr<std::unique_ptr<PeerMapping>> ImportIpcMemory(int ordinal,
                                                       std::span<const std::byte> handle) {
  KVF_ASSIGN_OR_RETURN(PeerHandle ph, DecodeLocalPeerHandle(handle, PeerPlatform::kCuda));
  if (ph.payload.size() != kIpcPayload) {
    return Status::InvalidArgument(
        fmt::format("cuda peer memory handle: payload of {} bytes, {} expected", ph.payload.size(),
                    kIpcPayload));
  }
  if (ph.pid == ThisPid()) {
    // Only a region this process exported, exactly (the handle's other fields are the peer's).
    KVF_RETURN_IF_ERROR(CheckOwnExport(ph));
    return OwnPeerMapping(reinterpret_cast<std::byte*>(ph.address), static_cast<size_t>(ph.bytes));
  }
  WireReader payload(ph.payload);
  payload.U32("ordinal");
  const uint64_t offset = payload.U64("offset");
  cudaIpcMemHandle_t h{};
  std::memcpy(&h, ph.payload.data() + payload.position(), sizeof(h));
  KVF_ASSIGN_OR_RETURN(IpcOpenings::Opened opened, IpcOpenings::Get().Open(ordinal, h));
  // The region must lie inside the allocation the handle opened, whatever offset and size the
  // handle declares.
  if (offset > opened.bytes || ph.bytes > opened.bytes - offset) {
    IpcOpenings::Get().Close(ordinal, h);
    return Status::InvalidArgument(fmt::format(
        "cuda:{} peer memory handle of process {}: {} bytes at offset {} run past the {}-byte "
        "allocation it opens",
        ordinal, ph.pid, ph.bytes, offset, opened.bytes));
  }
  return std::unique_ptr<PeerMapping>(std::make_unique<IpcMapping>(ordinal, h, opened.base + offset,
                                                                   static_cast<size_t>(ph.bytes)));
}

}  // namespace kvferry::internal::cuda
