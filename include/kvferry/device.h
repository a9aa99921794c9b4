// Device layer: memory, streams and events behind one small interface, so that every piece of
// kvferry runs on a CPU (and is tested in CI) and on CUDA GPUs with the same code.
//
// - A Device allocates memory of an explicit kind and creates streams and events.
// - A Stream is an ordered asynchronous executor: operations enqueued on one stream run in order;
//   operations on different streams are unordered unless a stream waits for an event.
// - An Event marks a point in a stream. Record() captures the work enqueued on the stream so far;
//   Query()/Synchronize() tell when that work is done; Stream::Wait() makes later work on another
//   stream wait for it. An event never recorded counts as complete (as in CUDA).
//
// The CPU device runs each stream on its own thread; "device memory" is host memory. The CUDA
// device maps these onto cudaStream_t / cudaEvent_t / cudaMalloc; no CUDA type is visible here.
//
// Completion semantics of every enqueue call: it returns as soon as the operation is queued; the
// source must stay valid and unmodified, and the destination must not be read, until an event
// recorded after it completes (or the stream is synchronized). Enqueue calls do not block on
// earlier work. Errors from enqueued work surface at the next Synchronize() of that stream.
//
// Thread-safety: a Device is thread-safe. A Stream may be used from one thread at a time. Events
// may be queried and synchronized from any thread; Record() from one thread at a time.
// Lifetimes: a Device must outlive its Buffers, Streams and Events; destroying a Stream waits for
// its queued work.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvferry/status.h"

#pragma GCC visibility push(default)  // the public API (kvferry/export.h)
namespace kvferry {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;
inline Deadline DeadlineIn(std::chrono::milliseconds ms) { return Clock::now() + ms; }

enum class MemoryKind : uint8_t {
  kDevice,      // accelerator memory (host memory on the CPU device)
  kPinnedHost,  // page-locked host memory the device can DMA to
  kHost,        // ordinary pageable host memory
  kFile,        // bytes in a file tier (never a pointer; used by tiers, not Allocate)
};
std::string_view MemoryKindName(MemoryKind kind);

class Device;

// A move-only owner of one allocation. Freed through its device when destroyed.
class Buffer {
 public:
  Buffer() = default;
  ~Buffer() { Reset(); }
  Buffer(Buffer&& o) noexcept { *this = std::move(o); }
  Buffer& operator=(Buffer&& o) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  std::byte* data() const { return data_; }
  size_t size() const { return size_; }
  MemoryKind kind() const { return kind_; }
  explicit operator bool() const { return data_ != nullptr; }
  void Reset();

 private:
  friend class Device;
  Buffer(Device* owner, std::byte* data, size_t size, MemoryKind kind)
      : owner_(owner), data_(data), size_(size), kind_(kind) {}
  Device* owner_ = nullptr;
  std::byte* data_ = nullptr;
  size_t size_ = 0;
  MemoryKind kind_ = MemoryKind::kHost;
};

// One copy of a batch: `planes` planes of `rows` rows of `bytes` bytes; row r of plane q goes from
// src + q * src_plane_pitch + r * src_pitch to dst + q * dst_plane_pitch + r * dst_pitch.
// rows == 1 is a plain copy (pitches ignored); planes == 1 is a 2-D copy (plane pitches ignored).
// Planes carry a layout conversion's third axis (HND <-> NHD: heads x tokens of head_dim rows)
// in one descriptor; the rows of different planes may interleave (plane pitch below the rows'
// span) as long as no two destination bytes coincide. A Stream implemented outside kvferry must
// honour planes (device_conformance.h checks it).
struct CopyDesc {
  void* dst;
  const void* src;
  size_t bytes;
  size_t rows = 1;
  size_t dst_pitch = 0;
  size_t src_pitch = 0;
  size_t planes = 1;
  size_t dst_plane_pitch = 0;
  size_t src_plane_pitch = 0;
  // ConvertBatch only (CopyBatch ignores them: kvferry passes scaled pieces only to ConvertBatch):
  // each element read is multiplied by src_scale, then divided by dst_scale, in fp32 (each step
  // rounded to nearest even), before the narrowing. A stored value q with scale s stands for
  // q * s (fp8 KV caches with per-tensor or per-head scales): src_scale dequantizes, dst_scale
  // quantizes. Both 1: the plain conversion.
  float src_scale = 1.0f;
  float dst_scale = 1.0f;
  // Per-block scales (ConvertBatch only; docs/conversion.md "Per-block scales"): each plane is one
  // scale group (a KV block's rows of one layer, K or V, and head). With src_scales, plane q's
  // source scale is src_scales[q * src_scale_stride] instead of src_scale. With dst_scales (the
  // destination fp8 e4m3), plane q's destination scale is computed, BlockScale in
  // convert_core.h: the largest finite |element| of the plane, widened, times its source scale,
  // over 448 (e4m3's largest value), at least kMinBlockScale; it is written to
  // dst_scales[q * dst_scale_stride] and quantizes the plane. Both set and from == to: the scales
  // travel instead, each plane's elements copied unchanged and its source scale written.
  // Scale arrays are fp32, in memory the stream reaches (as the rows).
  const float* src_scales = nullptr;
  float* dst_scales = nullptr;
  size_t src_scale_stride = 1;
  size_t dst_scale_stride = 1;
  bool scaled() const { return src_scale != 1.0f || dst_scale != 1.0f || block_scaled(); }
  bool block_scaled() const { return src_scales != nullptr || dst_scales != nullptr; }
};

// Element formats a stream converts between (Stream::ConvertBatch; docs/conversion.md).
enum class ElementFormat : uint8_t { kFp32, kFp16, kBf16, kFp8E4m3 };
int ElementFormatSize(ElementFormat format);
std::string_view ElementFormatName(ElementFormat format);  // "fp32", "fp16", "bf16", "fp8"

// What ConvertBatch does to every element: read as `from`, written as `to` (from != to). Exact
// through fp32, then rounded to nearest, ties to even; NaN becomes the destination's quiet NaN
// with the sign kept; fp16 overflows to infinity; fp8 (e4m3, no infinity) saturates to +-448,
// infinities included (as the engines' saturating casts do).
struct Conversion {
  ElementFormat from = ElementFormat::kBf16;
  ElementFormat to = ElementFormat::kBf16;
  bool operator==(const Conversion&) const = default;
};

// One run of bytes for Stream::Digest: `rows` rows of `bytes` bytes, row r at data + r * pitch
// (pitch unused when rows == 1). Its packed bytes are its rows back to back.
struct DigestRun {
  const void* data = nullptr;
  size_t bytes = 0;
  size_t rows = 1;
  size_t pitch = 0;
};
// Stream::Digest hashes each run's packed bytes in segments of this many bytes (the last one of a
// run shorter), each on its own: XXH64 is sequential over its input, so a GPU hashes many
// segments at once. Fixed by the wire format (docs/wire_format.md, "chunk digest").
inline constexpr size_t kDigestSegmentBytes = 4096;
// How many digests Stream::Digest writes for `runs`: the sum of ceil(bytes * rows / segment).
size_t DigestSegmentCount(std::span<const DigestRun> runs);

class Event {
 public:
  virtual ~Event() = default;
  // True when the work captured by the last Record() has finished (or Record was never called).
  virtual bool Query() = 0;
  // Blocks until Query() would be true or the deadline passes (kDeadlineExceeded).
  virtual Status Synchronize(Deadline deadline) = 0;
};

class Stream {
 public:
  virtual ~Stream() = default;

  // Copies `bytes` from src to dst; both may be any memory kind of this device.
  virtual Status Copy(void* dst, const void* src, size_t bytes) = 0;
  // Copies every descriptor, in no particular order (destinations must not overlap); the
  // descriptor array itself is consumed before the call returns. Implementations pick the fastest
  // path (copy engine for large ones, a gather kernel for many small ones, one pass over source
  // rows that several descriptors slice).
  virtual Status CopyBatch(std::span<const CopyDesc> copies) = 0;
  // CopyBatch converting every element (Conversion): each descriptor's `bytes` counts a
  // destination row's bytes, its source row holding as many elements of `conversion.from`;
  // pitches and plane pitches are each side's own bytes; descriptors may carry scales (CopyDesc),
  // and from == to is a scaled copy. The default refuses (kInvalidArgument):
  // a Stream implemented outside kvferry converts nothing unless it says so.
  virtual Status ConvertBatch(std::span<const CopyDesc> copies, Conversion conversion);
  // `height` rows of `width` bytes, rows `src_pitch` / `dst_pitch` bytes apart.
  virtual Status Copy2D(void* dst, size_t dst_pitch, const void* src, size_t src_pitch,
                        size_t width, size_t height) = 0;
  virtual Status Fill(void* dst, uint8_t value, size_t bytes) = 0;
  // Runs `fn` on a host thread after all earlier work of this stream. `fn` must not call into
  // the device API and must not block for long.
  virtual Status HostCallback(std::function<void()> fn) = 0;
  // Segment digests of `runs`, in order (docs/wire_format.md, "chunk digest"): XXH64 (seed 0) of
  // every kDigestSegmentBytes of each run's packed bytes, written to out[0, DigestSegmentCount)
  // once the stream reaches this point; the same values on every device. `runs` is consumed
  // before the call returns; `out` must stay valid until then and be memory this stream's work
  // may write (host memory on the CPU device; device or pinned host memory on CUDA). The default
  // computes on a host thread in stream order (HostCallback), for memory the host can read; the
  // CUDA device runs one kernel. Runs of zero bytes or rows add no digest.
  virtual Status Digest(std::span<const DigestRun> runs, uint64_t* out);

  // Captures the work enqueued on this stream so far into `event`.
  virtual Status Record(Event& event) = 0;
  // Later work on this stream waits for the work captured by `event` at the time of this call.
  virtual Status Wait(Event& event) = 0;
  // Waits for all work enqueued so far; returns the first error of that work, or
  // kDeadlineExceeded when the deadline passes first (the work keeps going).
  virtual Status Synchronize(Deadline deadline) = 0;
  // True when all work enqueued so far has finished.
  virtual bool Query() = 0;
};

struct DeviceInfo {
  std::string platform;  // "cpu" or "cuda"
  int ordinal = 0;
  std::string name;  // "NVIDIA H200", "cpu"
  int64_t memory_bytes = 0;
  std::string detail;  // free-form: compute capability, driver version
};

// Another process's device memory mapped into this one (Device::ImportMemory), so this process's
// streams can copy into it directly. Move-only owner: unmaps when destroyed (after the streams
// that copy into it are drained: the caller's job).
class PeerMapping {
 public:
  virtual ~PeerMapping() = default;
  virtual std::byte* data() const = 0;
  virtual size_t size() const = 0;
};

class Device {
 public:
  virtual ~Device() = default;
  virtual const DeviceInfo& info() const = 0;
  // Allocates `bytes` (> 0) of `kind` (not kFile). Memory is not initialized.
  virtual StatusOr<Buffer> Allocate(MemoryKind kind, size_t bytes) = 0;
  virtual StatusOr<std::unique_ptr<Stream>> CreateStream() = 0;
  virtual StatusOr<std::unique_ptr<Event>> CreateEvent() = 0;

  // Wrapping an engine's own streams and events, so kvferry's copies and layer-ready marks order
  // against the engine's compute stream. `native` is opaque here:
  //   - CUDA device: a cudaStream_t / cudaEvent_t of this GPU. A null stream (the legacy default
  //     stream) is refused, and so is a stream of another GPU (cudaStreamGetDevice) or a handle
  //     CUDA does not know (cudaStreamQuery / cudaEventQuery). CUDA cannot tell an event's GPU:
  //     an event of another GPU is refused by CUDA when a stream of this device records into it
  //     (the error names this device); waiting on it is legal in CUDA and works.
  //   - CPU device: a Stream* / Event* created by this same device (CreateStream/CreateEvent),
  //     so tests can play the engine; any other pointer, null, or a handle of another CPU device is
  //     refused without being dereferenced.
  // The result does not own the native handle: destroying it waits for the work enqueued through
  // it (like any Stream) and leaves the native stream or event alive; the native handle must
  // outlive the wrapper. Work enqueued through the wrapper and by the engine on the native
  // stream is one ordered queue. Errors are kInvalidArgument and name the handle and devices.
  // The default implementation refuses (a device without native handles).
  virtual StatusOr<std::unique_ptr<Stream>> WrapStream(void* native);
  virtual StatusOr<std::unique_ptr<Event>> WrapEvent(void* native);

  // Sharing memory with another process on the same host, so one process's stream copies straight
  // into another's pool (no transport, no staging). ExportMemory returns opaque bytes
  // (docs/wire_format.md, "peer memory handle") naming [base, base + bytes) of `kind` memory;
  // a device of the same platform in another process maps it with ImportMemory, and streams of
  // that device may then read and write the mapping like their own memory.
  //   - CUDA: kDevice memory of this GPU (an allocation of this device or an engine's tensor),
  //     shared by CUDA IPC; the importer's GPU must reach it (same GPU, or peer access).
  //   - CPU device: memory this device allocated (shared memory: a memfd) maps into any process
  //     of this host that may read the exporter's descriptors (same user, or root); any region
  //     maps into the exporting process itself (ranks as threads). Another process's region that
  //     this device did not allocate (a wrapped engine buffer) is refused (kUnavailable).
  // Import refuses (kUnavailable) a handle of another host, platform or an unreachable process;
  // malformed bytes are kInvalidArgument. Thread-safe. The default refuses both (kUnavailable).
  virtual StatusOr<std::vector<std::byte>> ExportMemory(const void* base, size_t bytes,
                                                        MemoryKind kind);
  virtual StatusOr<std::unique_ptr<PeerMapping>> ImportMemory(std::span<const std::byte> handle);

 protected:
  // Buffers are made and freed only by their device.
  Buffer MakeBuffer(std::byte* data, size_t size, MemoryKind kind) {
    return Buffer(this, data, size, kind);
  }
  virtual void Free(std::byte* data, size_t size, MemoryKind kind) noexcept = 0;
  friend class Buffer;
};

// Opens a device by name: "cpu", "cuda" (= "cuda:0") or "cuda:N". kUnavailable when the build has
// no CUDA or no such GPU is present.
StatusOr<std::unique_ptr<Device>> OpenDevice(std::string_view name);
std::unique_ptr<Device> OpenCpuDevice();
// Names of the devices present: always "cpu", then "cuda:N" for each GPU.
std::vector<std::string> ListDevices();

}  // namespace kvferry
#pragma GCC visibility pop
