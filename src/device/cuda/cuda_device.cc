// The CUDA device: Device/Stream/Event/Buffer on cudaMalloc, cudaHostAlloc, cudaStream_t and
// cudaEvent_t, plus the batched gather kernel for many small copies.
//
// Path choice (CopyBatch). Each descriptor is classified once per batch (knobs read when the
// stream is created):
//  - total bytes (rows * bytes) >= cuda.copy_kernel_threshold -> copy engine, unless it is 2-D
//    with rows narrower than cuda.copy_engine_min_row_bytes (a partial-token copy: the engine
//    crawls over narrow rows) or 2-D from device memory to device memory (any row width: measured
//    faster in the kernel, see ToKernel), its direction is not listed in
//    cuda.copy_engine_2d_directions (one direction on the copy engine, the other as a kernel) and a
//    kernel can reach both ends -> gather kernel;
//  - smaller, and both ends addressable by a kernel on this GPU (its device memory, or mapped
//    pinned host memory through UVA) -> the gather kernel, all of them in ONE launch, unless its
//    direction (host->device, device->host) is listed in cuda.copy_engine_directions: then the
//    copy engine, so that offload and onboard running at once use the two copy engines instead
//    of competing for the SMs;
//  - anything touching pageable host memory, another GPU or managed memory -> copy engine.
// Copy-engine fragments go out in one cudaMemcpyBatchAsync (copy_engine_batch.h), not one call
// each. The gather kernel's grid is capped (cuda.gather_max_blocks, default two blocks per SM) so
// that the kernels of the offload and the onboard stream run side by side rather than in turn.
// Knowing a pointer's kind: a process-wide registry of the allocations every CudaDevice made
// (address ranges, under a shared mutex taken once per batch), with cudaPointerGetAttributes as
// the fallback for pointers it does not know (memory from other allocators). The registry keeps
// the common case (pool and staging buffers allocated here) free of driver calls per descriptor.
// Descriptor ring: desc_ring.h.
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <thread>
#include <vector>

#include "device/convert.h"
#include "device/cuda/convert_kernel.h"
#include "device/cuda/copy_engine_batch.h"
#include "device/cuda/cuda_ipc.h"
#include "device/cuda/cuda_kernels.h"
#include "device/cuda/cuda_util.h"
#include "device/cuda/desc_ring.h"
#include "device/cuda/digest_kernel.h"
#include "device/cuda/memory_registry.h"
#include "device/cuda_entry.h"
#include "kvferry/config.h"
#include "kvferry/device.h"

namespace kvferry::internal {
namespace cuda {

// ---- error conversion and handle owners -----------------------------------------------------

Status CudaError(cudaError_t err, std::string context) {
  cudaGetLastError();  // clear the last-error slot (a sticky error stays sticky regardless)
  std::string msg =
      fmt::format("{}: {} ({})", context, cudaGetErrorName(err), cudaGetErrorString(err));
  switch (err) {
    case cudaErrorMemoryAllocation:
      return Status::ResourceExhausted(std::move(msg));
    case cudaErrorInvalidValue:
    case cudaErrorInvalidPitchValue:
    case cudaErrorInvalidDevicePointer:
    case cudaErrorInvalidMemcpyDirection:
    case cudaErrorInvalidDevice:
      return Status::InvalidArgument(std::move(msg));
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorDevicesUnavailable:
    case cudaErrorSystemDriverMismatch:
    case cudaErrorCompatNotSupportedOnDevice:
      return Status::Unavailable(std::move(msg));
    default:
      return Status::Internal(std::move(msg));
  }
}

StatusOr<StreamHandle> StreamHandle::Create() {
  cudaStream_t s = nullptr;
  KVF_RETURN_IF_ERROR(
      CudaCheck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate"));
  return StreamHandle(s);
}

void StreamHandle::Reset() noexcept {
  if (s_ == nullptr) return;
  cudaStreamSynchronize(s_);  // errors of queued work were reported at Synchronize, if asked
  cudaStreamDestroy(s_);
  cudaGetLastError();
  s_ = nullptr;
}

StatusOr<EventHandle> EventHandle::Create(bool timing) {
  cudaEvent_t e = nullptr;
  KVF_RETURN_IF_ERROR(
      CudaCheck(cudaEventCreateWithFlags(&e, timing ? cudaEventDefault : cudaEventDisableTiming),
                "cudaEventCreate"));
  return EventHandle(e);
}

void EventHandle::Reset() noexcept {
  if (e_ == nullptr) return;
  cudaEventDestroy(e_);
  e_ = nullptr;
}

StatusOr<PinnedRegion> PinnedRegion::Create(size_t bytes) {
  void* p = nullptr;
  KVF_RETURN_IF_ERROR(
      CudaCheck(cudaHostAlloc(&p, bytes, cudaHostAllocPortable | cudaHostAllocMapped),
                "cudaHostAlloc({} bytes)", bytes));
  return PinnedRegion(p, bytes);
}

void PinnedRegion::Reset() noexcept {
  if (p_ == nullptr) return;
  cudaFreeHost(p_);
  p_ = nullptr;
  size_ = 0;
}

namespace {

// A CopyDesc as the kernels read it (GatherDesc), planes and all; planes of a single row are rows,
// except with per-block scales (a plane is a scale group).
GatherDesc KernelDesc(const CopyDesc& c) {
  const uint64_t rows = std::max<size_t>(c.rows, 1);  // rows 0 is a plain copy, as on the CPU
  const uint64_t planes = std::max<size_t>(c.planes, 1);
  const uint64_t d = reinterpret_cast<uint64_t>(c.dst), s = reinterpret_cast<uint64_t>(c.src);
  if (rows == 1 && planes > 1 && !c.block_scaled()) {
    return GatherDesc{d, s, c.bytes, planes, c.dst_plane_pitch, c.src_plane_pitch, 1, 0, 0};
  }
  if (planes == 1) return GatherDesc{d, s, c.bytes, rows, c.dst_pitch, c.src_pitch, 1, 0, 0};
  return GatherDesc{
      d, s, c.bytes, rows, c.dst_pitch, c.src_pitch, planes, c.dst_plane_pitch, c.src_plane_pitch};
}

using std::chrono::microseconds;

// Polls `query` (cudaEventQuery / cudaStreamQuery) until it stops answering cudaErrorNotReady or
// the deadline passes: a few yields first (short waits are common), then sleeps that double up
// to 1 ms. Never blocks in the driver, so a wait always ends by its deadline.
template <typename Query>
Status PollUntil(Query query, Deadline deadline, std::string_view what) {
  microseconds nap(8);
  for (int i = 0;; ++i) {
    cudaError_t err = query();
    if (err == cudaSuccess) return Status::Ok();
    if (err != cudaErrorNotReady) return CudaError(err, std::string(what));
    Clock::time_point now = Clock::now();
    if (now >= deadline) {
      return Status::DeadlineExceeded(fmt::format("{}: work still pending at the deadline", what));
    }
    if (i < 32) {
      std::this_thread::yield();
      continue;
    }
    std::this_thread::sleep_for(std::min<Clock::duration>(nap, deadline - now));
    nap = std::min(nap * 2, microseconds(1000));
  }
}

// Classifies the pointers of one batch; holds the registry's shared lock while it lives.
// Remembers the last range seen for each end, so a batch between two buffers costs two lookups.
class Classifier {
 public:
  explicit Classifier(int ordinal)
      : reg_(MemoryRegistry::Get()), lock_(reg_.mu()), ordinal_(ordinal) {}

  // True when a kernel on this GPU can read (and write) both ends of the copy in place.
  bool KernelCanReach(const void* dst, const void* src) {
    return Reachable(Lookup(dst, dst_cache_)) && Reachable(Lookup(src, src_cache_));
  }
  PtrInfo Info(const void* p) { return Lookup(p, dst_cache_); }
  // Both ends at once (the same caches as KernelCanReach).
  std::pair<PtrInfo, PtrInfo> Ends(const void* dst, const void* src) {
    return {Lookup(dst, dst_cache_), Lookup(src, src_cache_)};
  }
  // A descriptor's per-block scale arrays, with caches of their own: sharing the data ends'
  // would miss twice a descriptor (a registry search each) when scales and data are different
  // allocations, as they always are.
  std::pair<PtrInfo, PtrInfo> ScaleEnds(const void* dst, const void* src) {
    return {Lookup(dst, dst_scale_cache_), Lookup(src, src_scale_cache_)};
  }
  bool Reachable(PtrInfo i) const {
    return i.cls == PtrClass::kMappedHost || (i.cls == PtrClass::kDevice && i.ordinal == ordinal_);
  }

 private:
  struct Cache {
    uintptr_t begin = 1, end = 0;  // empty
    PtrInfo info{PtrClass::kHost, -1};
  };
  PtrInfo Lookup(const void* p, Cache& c) {
    uintptr_t a = MemoryRegistry::Addr(p);
    if (a >= c.begin && a < c.end) return c.info;
    if (const auto* hit = reg_.FindLocked(a)) {
      c = Cache{hit->first, hit->second.end, hit->second.info};
      return c.info;
    }
    return QueryPointer(p);
  }

  MemoryRegistry& reg_;
  std::shared_lock<std::shared_mutex> lock_;
  const int ordinal_;
  Cache dst_cache_, src_cache_, dst_scale_cache_, src_scale_cache_;
};

// ---- events and streams ----------------------------------------------------------------------

class CudaEvent final : public Event {
 public:
  // An event kvferry created (owned) ...
  CudaEvent(int ordinal, EventHandle e)
      : ordinal_(ordinal), owned_(std::move(e)), e_(owned_.get()) {}
  // ... or an engine's event (WrapEvent): never destroyed here.
  CudaEvent(int ordinal, cudaEvent_t native) : ordinal_(ordinal), e_(native) {}

  bool Query() override {
    cudaError_t err = cudaEventQuery(e_);
    if (err != cudaSuccess && err != cudaErrorNotReady) cudaGetLastError();
    // An error means the work will never complete normally; Synchronize() reports it.
    return err != cudaErrorNotReady;
  }
  Status Synchronize(Deadline deadline) override {
    return PollUntil([this] { return cudaEventQuery(e_); }, deadline,
                     fmt::format("cuda:{} event synchronize", ordinal_));
  }
  cudaEvent_t get() const { return e_; }
  bool wrapped() const { return owned_.get() == nullptr; }

 private:
  const int ordinal_;
  EventHandle owned_;
  const cudaEvent_t e_;
};

void CUDART_CB RunHostCallback(void* p) {
  std::unique_ptr<std::function<void()>> fn(static_cast<std::function<void()>*>(p));
  (*fn)();
}

// How a stream routes the descriptors of a CopyBatch (the cuda.* knobs, read at stream creation).
struct CopyRouting {
  uint64_t kernel_threshold = 1 << 20;      // cuda.copy_kernel_threshold
  uint64_t min_ce_row = 64 << 10;           // cuda.copy_engine_min_row_bytes
  uint64_t list_row = 16 << 10;             // cuda.copy_engine_list_row_bytes
  bool ce_h2d = false, ce_d2h = false;      // cuda.copy_engine_directions
  bool ce2d_h2d = false, ce2d_d2h = false;  // cuda.copy_engine_2d_directions
  bool batched = true;                      // cuda.batch_copies
  uint32_t gather_blocks = 0;               // cuda.gather_max_blocks, resolved (0 = uncapped)
};

class CudaStream final : public Stream {
 public:
  // `owned` is a stream kvferry created; otherwise `native` is an engine's stream (WrapStream),
  // never destroyed here.
  CudaStream(int ordinal, StreamHandle owned, cudaStream_t native, const CopyRouting& routing)
      : ordinal_(ordinal),
        routing_(routing),
        owned_(std::move(owned)),
        s_(owned_.get() != nullptr ? owned_.get() : native),
        ce_(ordinal, routing.batched, routing.list_row) {}
  ~CudaStream() override {
    cudaSetDevice(ordinal_);
    // Wait for queued work before the ring it reads is freed.
    if (owned_.get() != nullptr) {
      owned_.Reset();
    } else {
      cudaStreamSynchronize(s_);
      cudaGetLastError();
    }
  }

  // Allocates the descriptor ring; called once, before the stream is handed out.
  Status Init() { return ring_.Init(); }

  Status Copy(void* dst, const void* src, size_t bytes) override {
    if (bytes == 0) return Status::Ok();
    KVF_RETURN_IF_ERROR(Use());
    return CudaCheck(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s_),
                     "cuda:{} cudaMemcpyAsync({} bytes)", ordinal_, bytes);
  }

  Status CopyBatch(std::span<const CopyDesc> copies) override {
    for (size_t i = 0; i < copies.size(); ++i) {
      const CopyDesc& c = copies[i];
      if (c.rows > 1 && (c.bytes > c.dst_pitch || c.bytes > c.src_pitch)) {
        return Status::InvalidArgument(
            fmt::format("CopyBatch: descriptor {} has rows of {} bytes wider than a pitch (dst "
                        "{}, src {})",
                        i, c.bytes, c.dst_pitch, c.src_pitch));
      }
    }
    KVF_RETURN_IF_ERROR(Use());
    // Pass 1 (registry lock held): choose each descriptor's path.
    small_.clear();
    ce_.Clear();
    {
      Classifier cls(ordinal_);
      for (const CopyDesc& c : copies) {
        if (c.bytes == 0 || c.planes == 0) continue;
        const size_t rows = std::max<size_t>(c.rows, 1);  // rows 0 is a plain copy, as on the CPU
        // Planes: the path is chosen once for all of them (one allocation at each end); the
        // kernel takes them in one descriptor, the copy engine a 2-D copy per plane.
        const auto [dst, src] = cls.Ends(c.dst, c.src);
        const bool kernel = ToKernel(c, rows, dst, src, cls);
        const bool pageable = dst.cls == PtrClass::kHost || src.cls == PtrClass::kHost;
        if (kernel) {  // one descriptor, planes and all (GatherDesc)
          small_.push_back(KernelDesc(c));
          continue;
        }
        for (size_t q = 0; q < c.planes; ++q) {
          const uint64_t d = reinterpret_cast<uint64_t>(c.dst) + q * c.dst_plane_pitch;
          const uint64_t s = reinterpret_cast<uint64_t>(c.src) + q * c.src_plane_pitch;
          CopyDesc one = c;
          one.dst = reinterpret_cast<void*>(d);
          one.src = reinterpret_cast<const void*>(s);
          one.rows = rows;
          one.planes = 1;
          ce_.Add(one, pageable);
        }
      }
    }
    // Pass 2: one kernel launch for the small ones, one batched submission for the rest.
    if (!small_.empty()) {
      KVF_ASSIGN_OR_RETURN(GatherDesc * slots, ring_.Reserve(small_.size()));
      std::memcpy(slots, small_.data(), small_.size() * sizeof(GatherDesc));
      std::atomic_thread_fence(std::memory_order_release);
      KVF_RETURN_IF_ERROR(CudaCheck(
          LaunchGather(slots, static_cast<uint32_t>(small_.size()), routing_.gather_blocks, s_),
          "cuda:{} gather kernel launch ({} descriptors)", ordinal_, small_.size()));
      KVF_RETURN_IF_ERROR(ring_.Commit(s_));
    }
    if (!ce_.empty()) KVF_RETURN_IF_ERROR(ce_.Submit(s_));
    return Status::Ok();
  }

  // One conversion kernel (convert_kernel.h) for every descriptor, planes expanded; both ends must
  // be memory a kernel reaches (this GPU's, or mapped pinned host memory).
  Status ConvertBatch(std::span<const CopyDesc> copies, Conversion conversion) override {
    KVF_RETURN_IF_ERROR(CheckConversion(copies, conversion));
    const size_t in = static_cast<size_t>(ElementFormatSize(conversion.from));
    const size_t out = static_cast<size_t>(ElementFormatSize(conversion.to));
    for (size_t i = 0; i < copies.size(); ++i) {
      const CopyDesc& c = copies[i];
      if (c.rows > 1 && (c.bytes > c.dst_pitch || c.bytes / out * in > c.src_pitch)) {
        return Status::InvalidArgument(fmt::format(
            "ConvertBatch: descriptor {} has rows of {} bytes ({} at the source) wider than a "
            "pitch (dst {}, src {})",
            i, c.bytes, c.bytes / out * in, c.dst_pitch, c.src_pitch));
      }
    }
    KVF_RETURN_IF_ERROR(Use());
    small_.clear();
    scales_.clear();
    block_scales_.clear();
    bool scaled = false, block_scaled = false;
    uint64_t max_planes = 1;
    {
      Classifier cls(ordinal_);
      for (size_t i = 0; i < copies.size(); ++i) {
        const CopyDesc& c = copies[i];
        if (c.bytes == 0 || c.planes == 0) continue;
        scaled = scaled || c.scaled();
        block_scaled = block_scaled || c.block_scaled();
        max_planes = std::max<uint64_t>(max_planes, c.planes);
        const auto [dst, src] = cls.Ends(c.dst, c.src);
        bool ok = cls.Reachable(dst) && cls.Reachable(src);
        if (c.block_scaled()) {  // scale arrays: the kernel reads and writes them too
          const auto [ds, ss] = cls.ScaleEnds(c.dst_scales ? c.dst_scales : c.dst,
                                              c.src_scales ? c.src_scales : c.src);
          ok = ok && cls.Reachable(ds) && cls.Reachable(ss);
        }
        if (!ok) {
          return Status::InvalidArgument(fmt::format(
              "ConvertBatch: descriptor {} reads or writes memory the conversion kernel of "
              "cuda:{} can't reach (pageable host memory or another GPU's)",
              i, ordinal_));
        }
        small_.push_back(KernelDesc(c));
        scales_.push_back(float2{c.src_scale, c.dst_scale});
        block_scales_.push_back(BlockScaleDesc{
            reinterpret_cast<uint64_t>(c.src_scales), reinterpret_cast<uint64_t>(c.dst_scales),
            c.src_scale_stride, c.dst_scale_stride, c.src_scale, c.dst_scale});
      }
    }
    if (small_.empty()) return Status::Ok();
    // Scales, when any descriptor has them, travel in the ring after the descriptors: (src_scale,
    // dst_scale) pairs, or BlockScaleDesc when any descriptor has per-block scales.
    const size_t n = small_.size();
    const size_t scale_bytes = block_scaled ? n * sizeof(BlockScaleDesc)
                               : scaled     ? n * sizeof(float2)
                                            : 0;
    KVF_ASSIGN_OR_RETURN(
        GatherDesc * slots,
        ring_.Reserve(n + (scale_bytes + sizeof(GatherDesc) - 1) / sizeof(GatherDesc)));
    std::memcpy(slots, small_.data(), n * sizeof(GatherDesc));
    void* scales = scale_bytes > 0 ? static_cast<void*>(slots + n) : nullptr;
    if (scales != nullptr) {
      std::memcpy(scales,
                  block_scaled ? static_cast<const void*>(block_scales_.data()) : scales_.data(),
                  scale_bytes);
    }
    std::atomic_thread_fence(std::memory_order_release);
    const int from = static_cast<int>(conversion.from), to = static_cast<int>(conversion.to);
    KVF_RETURN_IF_ERROR(CudaCheck(
        block_scaled
            ? LaunchConvertBlockScaled(slots, static_cast<const BlockScaleDesc*>(scales),
                                       static_cast<uint32_t>(n), max_planes, from, to,
                                       routing_.gather_blocks, s_)
            : LaunchConvert(slots, static_cast<const float2*>(scales), static_cast<uint32_t>(n),
                            from, to, routing_.gather_blocks, s_),
        "cuda:{} conversion kernel launch ({} descriptors, {} to {})", ordinal_, small_.size(),
        ElementFormatName(conversion.from), ElementFormatName(conversion.to)));
    return ring_.Commit(s_);
  }

  // One digest kernel (digest_kernel.h); its run table and segment index travel in the ring.
  Status Digest(std::span<const DigestRun> runs, uint64_t* out) override {
    KVF_RETURN_IF_ERROR(Use());
    size_t n = 0;
    for (const DigestRun& r : runs) n += (r.bytes > 0 && r.rows > 0) ? 1 : 0;
    const size_t segments = DigestSegmentCount(runs);
    if (segments == 0) return Status::Ok();
    const size_t bytes = n * sizeof(DigestRunDesc) + segments * sizeof(uint32_t);
    KVF_ASSIGN_OR_RETURN(GatherDesc * slots,
                         ring_.Reserve((bytes + sizeof(GatherDesc) - 1) / sizeof(GatherDesc)));
    auto* descs = reinterpret_cast<DigestRunDesc*>(slots);
    auto* segment_run = reinterpret_cast<uint32_t*>(descs + n);
    size_t i = 0, g = 0;
    for (const DigestRun& r : runs) {
      if (r.bytes == 0 || r.rows == 0) continue;
      descs[i] = DigestRunDesc{reinterpret_cast<uint64_t>(r.data), r.bytes, r.rows, r.pitch, g};
      for (size_t k = DigestSegmentCount({&r, 1}); k > 0; --k) segment_run[g++] = i;
      ++i;
    }
    std::atomic_thread_fence(std::memory_order_release);
    KVF_RETURN_IF_ERROR(CudaCheck(LaunchDigest(descs, segment_run, segments, out, s_),
                                  "cuda:{} digest kernel launch ({} runs, {} segments)", ordinal_,
                                  n, segments));
    return ring_.Commit(s_);
  }

  Status Copy2D(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width,
                size_t height) override {
    if (width > dst_pitch || width > src_pitch) {
      return Status::InvalidArgument(fmt::format(
          "Copy2D: width {} exceeds a pitch (dst {}, src {})", width, dst_pitch, src_pitch));
    }
    if (width == 0 || height == 0) return Status::Ok();
    KVF_RETURN_IF_ERROR(Use());
    return CudaCheck(
        cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, height, cudaMemcpyDefault, s_),
        "cuda:{} cudaMemcpy2DAsync({} rows of {} bytes, pitches {}/{})", ordinal_, height, width,
        dst_pitch, src_pitch);
  }

  Status Fill(void* dst, uint8_t value, size_t bytes) override {
    if (bytes == 0) return Status::Ok();
    KVF_RETURN_IF_ERROR(Use());
    PtrInfo info;
    {
      Classifier cls(ordinal_);
      info = cls.Info(dst);
    }
    if (info.cls == PtrClass::kDevice || info.cls == PtrClass::kOther) {
      return CudaCheck(cudaMemsetAsync(dst, value, bytes, s_), "cuda:{} cudaMemsetAsync({} bytes)",
                       ordinal_, bytes);
    }
    // Host memory (pinned or not): the CPU fills it, in stream order.
    return HostCallback([dst, value, bytes] { std::memset(dst, value, bytes); });
  }

  Status HostCallback(std::function<void()> fn) override {
    KVF_RETURN_IF_ERROR(Use());
    auto* heap = new std::function<void()>(std::move(fn));
    cudaError_t err = cudaLaunchHostFunc(s_, RunHostCallback, heap);
    if (err != cudaSuccess) {
      delete heap;
      return CudaError(err, fmt::format("cuda:{} cudaLaunchHostFunc", ordinal_));
    }
    return Status::Ok();
  }

  Status Record(Event& event) override {
    KVF_RETURN_IF_ERROR(Use());
    auto& e = static_cast<CudaEvent&>(event);
    cudaError_t err = cudaEventRecord(e.get(), s_);
    if (err == cudaErrorInvalidResourceHandle && e.wrapped()) {
      cudaGetLastError();
      return Status::InvalidArgument(fmt::format(
          "cuda:{} cudaEventRecord: the wrapped event {} does not belong to this GPU's context "
          "(an event of another device, or destroyed)",
          ordinal_, static_cast<void*>(e.get())));
    }
    return CudaCheck(err, "cuda:{} cudaEventRecord", ordinal_);
  }

  Status Wait(Event& event) override {
    KVF_RETURN_IF_ERROR(Use());
    return CudaCheck(cudaStreamWaitEvent(s_, static_cast<CudaEvent&>(event).get(), 0),
                     "cuda:{} cudaStreamWaitEvent", ordinal_);
  }

  Status Synchronize(Deadline deadline) override {
    KVF_RETURN_IF_ERROR(Use());
    return PollUntil([this] { return cudaStreamQuery(s_); }, deadline,
                     fmt::format("cuda:{} stream synchronize", ordinal_));
  }

  bool Query() override {
    if (!Use().ok()) return false;
    cudaError_t err = cudaStreamQuery(s_);
    if (err != cudaSuccess && err != cudaErrorNotReady) cudaGetLastError();
    return err != cudaErrorNotReady;
  }

 private:
  Status Use() const { return CudaCheck(cudaSetDevice(ordinal_), "cudaSetDevice({})", ordinal_); }

  // The routing rules of the file comment.
  bool ToKernel(const CopyDesc& c, size_t rows, PtrInfo dst, PtrInfo src,
                const Classifier& cls) const {
    if (!cls.Reachable(dst) || !cls.Reachable(src)) return false;
    const uint64_t total = static_cast<uint64_t>(c.bytes) * rows * c.planes;
    const bool h2d = src.cls == PtrClass::kMappedHost && dst.cls == PtrClass::kDevice;
    const bool d2h = src.cls == PtrClass::kDevice && dst.cls == PtrClass::kMappedHost;
    if (total >= routing_.kernel_threshold) {
      // 2-D: the copy engine walks narrow rows slowly; between two places in this GPU's memory
      // (its own allocations, or a peer process's pool mapped through CUDA IPC) it lost to the
      // kernel at every row width measured (H200, vLLM HND pools, TP2->TP1: 2 MiB fragments of
      // 64 KiB rows, 23 GB/s listed row by row, 303-553 GB/s as cudaMemcpy2DAsync, 490-1182 GB/s
      // in the kernel; TP1->TP2 1460 GB/s, 0.97 of one cudaMemcpy of the same bytes).
      const bool d2d = src.cls == PtrClass::kDevice && dst.cls == PtrClass::kDevice;
      const bool kernel_rows = routing_.min_ce_row != 0 && (d2d || c.bytes < routing_.min_ce_row);
      return (rows > 1 || c.planes > 1) && kernel_rows &&
             !((h2d && routing_.ce2d_h2d) || (d2h && routing_.ce2d_d2h));
    }
    return !((h2d && routing_.ce_h2d) || (d2h && routing_.ce_d2h));
  }

  const int ordinal_;
  const CopyRouting routing_;
  StreamHandle owned_;
  const cudaStream_t s_;
  DescRing ring_;
  std::vector<GatherDesc> small_;             // scratch, reused across batches
  std::vector<float2> scales_;                // ConvertBatch's scales of small_, likewise
  std::vector<BlockScaleDesc> block_scales_;  // and its per-block scales
  CopyEngineBatch ce_;                        // scratch, reused across batches
};

// ---- the device ------------------------------------------------------------------------------

constexpr size_t kHostAlignment = 4096;  // pageable host buffers: page-aligned, as for O_DIRECT

class CudaDevice final : public Device {
 public:
  CudaDevice(int ordinal, DeviceInfo info, int sm_count)
      : ordinal_(ordinal), info_(std::move(info)), sm_count_(sm_count) {}

  const DeviceInfo& info() const override { return info_; }

  StatusOr<Buffer> Allocate(MemoryKind kind, size_t bytes) override {
    if (kind == MemoryKind::kFile)
      return Status::InvalidArgument("Allocate: file memory is not allocatable");
    if (bytes == 0) return Status::InvalidArgument("Allocate: zero bytes");
    KVF_RETURN_IF_ERROR(Use());
    void* p = nullptr;
    PtrInfo info{PtrClass::kHost, -1};
    switch (kind) {
      case MemoryKind::kDevice:
        KVF_RETURN_IF_ERROR(
            CudaCheck(cudaMalloc(&p, bytes), "cuda:{} cudaMalloc({} bytes)", ordinal_, bytes));
        info = {PtrClass::kDevice, ordinal_};
        break;
      case MemoryKind::kPinnedHost:
        KVF_RETURN_IF_ERROR(
            CudaCheck(cudaHostAlloc(&p, bytes, cudaHostAllocPortable | cudaHostAllocMapped),
                      "cuda:{} cudaHostAlloc({} bytes)", ordinal_, bytes));
        info = {PtrClass::kMappedHost, -1};
        break;
      case MemoryKind::kHost: {
        size_t rounded = (bytes + kHostAlignment - 1) / kHostAlignment * kHostAlignment;
        p = std::aligned_alloc(kHostAlignment, rounded);
        if (p == nullptr) {
          return Status::ResourceExhausted(
              fmt::format("cuda:{}: could not allocate {} bytes of host memory", ordinal_, bytes));
        }
        break;
      }
      case MemoryKind::kFile:
        break;
    }
    MemoryRegistry::Get().Add(p, bytes, info);
    return MakeBuffer(static_cast<std::byte*>(p), bytes, kind);
  }

  StatusOr<std::unique_ptr<Stream>> CreateStream() override {
    KVF_RETURN_IF_ERROR(Use());
    KVF_ASSIGN_OR_RETURN(StreamHandle s, StreamHandle::Create());
    auto stream = std::make_unique<CudaStream>(ordinal_, std::move(s), nullptr, Routing());
    KVF_RETURN_IF_ERROR(stream->Init());
    return std::unique_ptr<Stream>(std::move(stream));
  }

  // See device.h: an engine's cudaStream_t of this GPU, not owned.
  StatusOr<std::unique_ptr<Stream>> WrapStream(void* native) override {
    if (native == nullptr) {
      return Status::InvalidArgument(fmt::format(
          "cuda:{} WrapStream: null stream (the legacy default stream is not accepted; pass the "
          "engine's stream, or cudaStreamPerThread's value from the engine)",
          ordinal_));
    }
    auto s = static_cast<cudaStream_t>(native);
    int dev = -1;
    cudaError_t err = cudaStreamGetDevice(s, &dev);
    if (err != cudaSuccess) {
      cudaGetLastError();
      return Status::InvalidArgument(fmt::format("cuda:{} WrapStream({}): not a usable stream: {}",
                                                 ordinal_, native, cudaGetErrorName(err)));
    }
    if (dev != ordinal_) {
      return Status::InvalidArgument(fmt::format(
          "cuda:{} WrapStream({}): the stream belongs to cuda:{}", ordinal_, native, dev));
    }
    KVF_RETURN_IF_ERROR(Use());
    auto stream = std::make_unique<CudaStream>(ordinal_, StreamHandle(), s, Routing());
    KVF_RETURN_IF_ERROR(stream->Init());
    return std::unique_ptr<Stream>(std::move(stream));
  }

  // See device.h: an engine's cudaEvent_t, not owned. CUDA has no query for an event's device;
  // an invalid handle is refused here, another GPU's event at the first Record into it.
  StatusOr<std::unique_ptr<Event>> WrapEvent(void* native) override {
    if (native == nullptr) {
      return Status::InvalidArgument(fmt::format("cuda:{} WrapEvent: null event", ordinal_));
    }
    KVF_RETURN_IF_ERROR(Use());
    auto e = static_cast<cudaEvent_t>(native);
    cudaError_t err = cudaEventQuery(e);
    if (err != cudaSuccess && err != cudaErrorNotReady) {
      cudaGetLastError();
      return Status::InvalidArgument(fmt::format("cuda:{} WrapEvent({}): not a usable event: {}",
                                                 ordinal_, native, cudaGetErrorName(err)));
    }
    return std::unique_ptr<Event>(new CudaEvent(ordinal_, e));
  }

  // CUDA IPC (device.h, cuda_ipc.h).
  StatusOr<std::vector<std::byte>> ExportMemory(const void* base, size_t bytes,
                                                MemoryKind kind) override {
    return ExportIpcMemory(ordinal_, base, bytes, kind);
  }

  StatusOr<std::unique_ptr<PeerMapping>> ImportMemory(std::span<const std::byte> handle) override {
    return ImportIpcMemory(ordinal_, handle);
  }

  StatusOr<std::unique_ptr<Event>> CreateEvent() override {
    KVF_RETURN_IF_ERROR(Use());
    KVF_ASSIGN_OR_RETURN(EventHandle e, EventHandle::Create(/*timing=*/false));
    return std::unique_ptr<Event>(new CudaEvent(ordinal_, std::move(e)));
  }

 protected:
  void Free(std::byte* data, size_t, MemoryKind kind) noexcept override {
    MemoryRegistry::Get().Remove(data);
    switch (kind) {
      case MemoryKind::kDevice:
        cudaSetDevice(ordinal_);
        cudaFree(data);
        break;
      case MemoryKind::kPinnedHost:
        cudaFreeHost(data);
        break;
      default:
        std::free(data);
        return;
    }
    cudaGetLastError();  // a failed free has nothing to report to; keep later calls clean
  }

 private:
  Status Use() const { return CudaCheck(cudaSetDevice(ordinal_), "cudaSetDevice({})", ordinal_); }

  CopyRouting Routing() const {
    const Config& c = Config::Global();
    CopyRouting r;
    r.kernel_threshold = static_cast<uint64_t>(c.Int("cuda.copy_kernel_threshold"));
    r.min_ce_row = static_cast<uint64_t>(c.Int("cuda.copy_engine_min_row_bytes"));
    r.list_row = static_cast<uint64_t>(c.Int("cuda.copy_engine_list_row_bytes"));
    const std::string dirs = c.String("cuda.copy_engine_directions");
    r.ce_h2d = dirs == "h2d" || dirs == "both";
    r.ce_d2h = dirs == "d2h" || dirs == "both";
    const std::string dirs2d = c.String("cuda.copy_engine_2d_directions");
    r.ce2d_h2d = dirs2d == "h2d" || dirs2d == "both";
    r.ce2d_d2h = dirs2d == "d2h" || dirs2d == "both";
    r.batched = c.Bool("cuda.batch_copies");
    const int64_t blocks = c.Int("cuda.gather_max_blocks");
    r.gather_blocks = static_cast<uint32_t>(blocks > 0 ? blocks : 2 * sm_count_);
    return r;
  }

  const int ordinal_;
  const DeviceInfo info_;
  const int sm_count_;
};

std::string VersionText(int v) { return fmt::format("{}.{}", v / 1000, (v % 1000) / 10); }

}  // namespace
}  // namespace cuda

// ---- the seam (cuda_entry.h) -----------------------------------------------------------------

bool CudaCompiledIn() { return true; }

int CudaDeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

std::string CudaVersionString() {
  int runtime = 0, driver = 0;
  if (cudaRuntimeGetVersion(&runtime) != cudaSuccess) runtime = 0;
  if (cudaDriverGetVersion(&driver) != cudaSuccess) driver = 0;
  cudaGetLastError();
  return fmt::format("runtime {}, {}", cuda::VersionText(runtime),
                     driver > 0 ? "driver " + cuda::VersionText(driver) : std::string("no driver"));
}

StatusOr<std::unique_ptr<Device>> OpenCudaDevice(int ordinal) {
  int n = 0;
  cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    std::string why = fmt::format("{} ({})", cudaGetErrorName(err), cudaGetErrorString(err));
    cudaGetLastError();
    return Status::Unavailable(fmt::format("OpenDevice: cuda:{}: no usable CUDA GPU: {}; {}",
                                           ordinal, why, CudaVersionString()));
  }
  if (ordinal < 0 || ordinal >= n) {
    return Status::Unavailable(
        fmt::format("OpenDevice: cuda:{}: no such GPU ({} present)", ordinal, n));
  }
  KVF_RETURN_IF_ERROR(
      cuda::CudaCheck(cudaSetDevice(ordinal), "OpenDevice: cuda:{}: cudaSetDevice", ordinal));
  cudaDeviceProp prop{};
  KVF_RETURN_IF_ERROR(cuda::CudaCheck(cudaGetDeviceProperties(&prop, ordinal),
                                      "OpenDevice: cuda:{}: cudaGetDeviceProperties", ordinal));
  DeviceInfo info;
  info.platform = "cuda";
  info.ordinal = ordinal;
  info.name = prop.name;
  info.memory_bytes = static_cast<int64_t>(prop.totalGlobalMem);
  info.detail = fmt::format("sm_{}{}, {} SMs, {}", prop.major, prop.minor, prop.multiProcessorCount,
                            CudaVersionString());
  return std::unique_ptr<Device>(
      new cuda::CudaDevice(ordinal, std::move(info), prop.multiProcessorCount));
}

}  // namespace kvferry::internal
