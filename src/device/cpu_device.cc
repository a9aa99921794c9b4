// The CPU device: streams are worker threads draining ordered queues, events are completion
// counters, all memory is aligned host memory. It exists so that every piece of logic above the
// device layer runs, and is tested, on a machine without a GPU.
#include <fmt/format.h>
#include <pthread.h>

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <unordered_set>

#include "base/thread_annotations.h"
#include "device/convert.h"
#include "device/host_copy.h"
#include "device/host_shm.h"
#include "device/peer_memory.h"
#include "kvferry/config.h"
#include "kvferry/device.h"

namespace kvferry {
namespace {

// The streams and events a CPU device made that are still alive, so WrapStream/WrapEvent can
// check a pointer without dereferencing it.
class HandleRegistry {
 public:
  enum Kind { kStream = 0, kEvent = 1 };
  void Add(Kind k, const void* p) {
    MutexLock lock(mu_);
    live_[k].insert(p);
  }
  void Remove(Kind k, const void* p) {
    MutexLock lock(mu_);
    live_[k].erase(p);
  }
  bool Has(Kind k, const void* p) {
    MutexLock lock(mu_);
    return live_[k].count(p) > 0;
  }

 private:
  Mutex mu_;
  std::unordered_set<const void*> live_[2] GUARDED_BY(mu_);
};

// Adds a handle to its device's registry for its lifetime (no registry: a wrapper, not listed).
class Registered {
 public:
  Registered(std::shared_ptr<HandleRegistry> registry, HandleRegistry::Kind kind,
             const void* handle)
      : registry_(std::move(registry)), kind_(kind), handle_(handle) {
    if (registry_) registry_->Add(kind_, handle_);
  }
  ~Registered() {
    if (registry_) registry_->Remove(kind_, handle_);
  }
  Registered(const Registered&) = delete;
  Registered& operator=(const Registered&) = delete;

 private:
  const std::shared_ptr<HandleRegistry> registry_;
  const HandleRegistry::Kind kind_;
  const void* const handle_;
};

// Shared between an event and the stream tasks that complete it.
struct EventState {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t recorded = 0;   // generation of the last Record()
  uint64_t completed = 0;  // highest generation whose work has finished
};

class CpuEvent final : public Event {
 public:
  // A new event, listed in `registry`; or (state given, no registry) another name for the event
  // owning `state`, as WrapEvent returns.
  CpuEvent(std::shared_ptr<HandleRegistry> registry, std::shared_ptr<EventState> state)
      : state_(state ? std::move(state) : std::make_shared<EventState>()),
        listed_(std::move(registry), HandleRegistry::kEvent, static_cast<const Event*>(this)) {}
  bool Query() override {
    std::lock_guard lock(state_->mu);
    return state_->completed >= state_->recorded;
  }
  Status Synchronize(Deadline deadline) override {
    std::unique_lock lock(state_->mu);
    uint64_t want = state_->recorded;
    if (!state_->cv.wait_until(lock, deadline, [&] { return state_->completed >= want; })) {
      return Status::DeadlineExceeded(
          "cpu event: recorded work did not finish before the deadline");
    }
    return Status::Ok();
  }
  const std::shared_ptr<EventState>& state() const { return state_; }

 private:
  std::shared_ptr<EventState> state_;
  Registered listed_;
};

class CpuStream final : public Stream {
 public:
  explicit CpuStream(std::shared_ptr<HandleRegistry> registry)
      : streaming_min_(Config::Global().Int("cpu.streaming_copy_min_bytes")),
        listed_(std::move(registry), HandleRegistry::kStream, static_cast<const Stream*>(this)),
        worker_([this] { Run(); }) {}
  ~CpuStream() override {
    {
      MutexLock lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }

  // Copies of at least cpu.streaming_copy_min_bytes in all write with streaming stores
  // (host_copy.h: a copy past the caches moves 2 bytes per byte instead of 3).
  Status Copy(void* dst, const void* src, size_t bytes) override {
    const bool stream = UseStreamingStores(bytes, bytes, streaming_min_);
    return Enqueue([=] { CopyHostBytes(dst, src, bytes, stream); });
  }

  Status CopyBatch(std::span<const CopyDesc> copies) override {
    return Enqueue([v = std::vector<CopyDesc>(copies.begin(), copies.end()),
                    min = streaming_min_]() mutable { CopyHostBatch(v, min); });
  }

  Status ConvertBatch(std::span<const CopyDesc> copies, Conversion conversion) override {
    KVF_RETURN_IF_ERROR(CheckConversion(copies, conversion));
    return Enqueue([v = std::vector<CopyDesc>(copies.begin(), copies.end()), conversion] {
      ConvertHostBatch(v, conversion);
    });
  }

  Status Copy2D(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width,
                size_t height) override {
    if (width > dst_pitch || width > src_pitch) {
      return Status::InvalidArgument(fmt::format(
          "Copy2D: width {} exceeds a pitch (dst {}, src {})", width, dst_pitch, src_pitch));
    }
    const bool stream = UseStreamingStores(width * height, width, streaming_min_);
    return Enqueue([=] { CopyHostRows(dst, dst_pitch, src, src_pitch, width, height, stream); });
  }

  Status Fill(void* dst, uint8_t value, size_t bytes) override {
    return Enqueue([=] { std::memset(dst, value, bytes); });
  }

  Status HostCallback(std::function<void()> fn) override { return Enqueue(std::move(fn)); }

  Status Record(Event& event) override {
    auto state = static_cast<CpuEvent&>(event).state();
    uint64_t gen;
    {
      std::lock_guard lock(state->mu);
      gen = ++state->recorded;
    }
    return Enqueue([state, gen] {
      {
        std::lock_guard lock(state->mu);
        state->completed = std::max(state->completed, gen);
      }
      state->cv.notify_all();
    });
  }

  Status Wait(Event& event) override {
    auto state = static_cast<CpuEvent&>(event).state();
    uint64_t want;
    {
      std::lock_guard lock(state->mu);
      want = state->recorded;
    }
    // Blocking this stream's worker is what a GPU stream does too.
    return Enqueue([state, want] {
      std::unique_lock lock(state->mu);
      state->cv.wait(lock, [&] { return state->completed >= want; });
    });
  }

  Status Synchronize(Deadline deadline) override {
    MutexLock lock(mu_);
    uint64_t want = enqueued_;
    if (!lock.WaitUntil(done_cv_, deadline, [&]() REQUIRES(mu_) { return finished_ >= want; })) {
      return Status::DeadlineExceeded(
          fmt::format("cpu stream: {} operations still pending at the deadline", want - finished_));
    }
    return Status::Ok();
  }

  bool Query() override {
    MutexLock lock(mu_);
    return finished_ >= enqueued_;
  }

 private:
  Status Enqueue(std::function<void()> fn) {
    {
      MutexLock lock(mu_);
      queue_.push_back(std::move(fn));
      ++enqueued_;
    }
    cv_.notify_one();
    return Status::Ok();
  }

  void Run() {
    pthread_setname_np(pthread_self(), "kvf-cpu-stream");  // for perf, top -H and /proc
    MutexLock lock(mu_);
    while (true) {
      lock.Wait(cv_, [&]() REQUIRES(mu_) { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and drained
      std::function<void()> fn = std::move(queue_.front());
      queue_.pop_front();
      lock.Unlock();
      fn();
      lock.Lock();
      ++finished_;
      done_cv_.notify_all();
    }
  }

  const int64_t streaming_min_;  // cpu.streaming_copy_min_bytes when the stream was made
  Mutex mu_;
  std::condition_variable cv_;       // work queued or stop
  std::condition_variable done_cv_;  // an operation finished
  std::deque<std::function<void()>> queue_ GUARDED_BY(mu_);
  uint64_t enqueued_ GUARDED_BY(mu_) = 0;
  uint64_t finished_ GUARDED_BY(mu_) = 0;
  bool stop_ GUARDED_BY(mu_) = false;
  Registered listed_;
  std::thread worker_;  // last: starts after the members above exist
};

// A non-owning name for a stream of this device (WrapStream): every call goes to the target.
class WrappedStream final : public Stream {
 public:
  explicit WrappedStream(Stream* target) : target_(target) {}
  ~WrappedStream() override {
    // Like destroying any stream: wait for the work enqueued so far (the target stays alive).
    (void)target_->Synchronize(Clock::now() + std::chrono::hours(1));
  }
  Status Copy(void* dst, const void* src, size_t bytes) override {
    return target_->Copy(dst, src, bytes);
  }
  Status CopyBatch(std::span<const CopyDesc> copies) override { return target_->CopyBatch(copies); }
  Status ConvertBatch(std::span<const CopyDesc> copies, Conversion conversion) override {
    return target_->ConvertBatch(copies, conversion);
  }
  Status Copy2D(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width,
                size_t height) override {
    return target_->Copy2D(dst, dst_pitch, src, src_pitch, width, height);
  }
  Status Fill(void* dst, uint8_t value, size_t bytes) override {
    return target_->Fill(dst, value, bytes);
  }
  Status HostCallback(std::function<void()> fn) override {
    return target_->HostCallback(std::move(fn));
  }
  Status Record(Event& event) override { return target_->Record(event); }
  Status Wait(Event& event) override { return target_->Wait(event); }
  Status Synchronize(Deadline deadline) override { return target_->Synchronize(deadline); }
  bool Query() override { return target_->Query(); }

 private:
  Stream* const target_;
};

class CpuDevice final : public Device {
 public:
  CpuDevice()
      : info_{"cpu", 0, "cpu", 0,
              fmt::format("{} hardware threads", std::thread::hardware_concurrency())},
        alignment_(static_cast<size_t>(Config::Global().Int("cpu.pinned_alignment"))) {}

  const DeviceInfo& info() const override { return info_; }

  StatusOr<Buffer> Allocate(MemoryKind kind, size_t bytes) override {
    if (kind == MemoryKind::kFile)
      return Status::InvalidArgument("Allocate: file memory is not allocatable");
    if (bytes == 0) return Status::InvalidArgument("Allocate: zero bytes");
    // Shared memory first, so a peer process on this host can map the buffer (host_shm.h);
    // private memory where a memfd can't be had (descriptors exhausted, no memfd).
    auto shm = AllocateShm(bytes, alignment_, /*populate=*/kind != MemoryKind::kHost);
    if (shm.ok()) {
      shared_.Add(*shm);
      return MakeBuffer(shm->data, bytes, kind);
    }
    size_t rounded = (bytes + alignment_ - 1) / alignment_ * alignment_;
    void* p = std::aligned_alloc(alignment_, rounded);
    if (p == nullptr) {
      return Status::ResourceExhausted(fmt::format(
          "cpu device: could not allocate {} bytes of {} memory", bytes, MemoryKindName(kind)));
    }
    // Device and pinned memory are resident from the start, as cudaMalloc / cudaHostAlloc memory
    // is: left to first touch, the first copy into each page of a pool paid a page fault and a
    // page clear (13% of the copy threads' time in `bench tiering`, about half the speed of a
    // memcpy between touched buffers). Pageable host memory stays lazy, like malloc's.
    if (kind != MemoryKind::kHost) std::memset(p, 0, rounded);
    return MakeBuffer(static_cast<std::byte*>(p), bytes, kind);
  }

  StatusOr<std::unique_ptr<Stream>> CreateStream() override {
    return std::unique_ptr<Stream>(new CpuStream(registry_));
  }
  StatusOr<std::unique_ptr<Event>> CreateEvent() override {
    return std::unique_ptr<Event>(new CpuEvent(registry_, nullptr));
  }

  // Accepts only live Stream* / Event* made by this device (see device.h).
  StatusOr<std::unique_ptr<Stream>> WrapStream(void* native) override {
    if (native == nullptr) return Status::InvalidArgument("cpu WrapStream: null stream");
    if (!registry_->Has(HandleRegistry::kStream, native)) {
      return Status::InvalidArgument(fmt::format(
          "cpu WrapStream({}): not a live stream of this cpu device (it takes the Stream* of a "
          "stream this device created; a stream of another device is refused)",
          native));
    }
    return std::unique_ptr<Stream>(new WrappedStream(static_cast<Stream*>(native)));
  }
  StatusOr<std::unique_ptr<Event>> WrapEvent(void* native) override {
    if (native == nullptr) return Status::InvalidArgument("cpu WrapEvent: null event");
    if (!registry_->Has(HandleRegistry::kEvent, native)) {
      return Status::InvalidArgument(fmt::format(
          "cpu WrapEvent({}): not a live event of this cpu device (it takes the Event* of an "
          "event this device created; an event of another device is refused)",
          native));
    }
    auto* target = static_cast<CpuEvent*>(static_cast<Event*>(native));
    return std::unique_ptr<Event>(new CpuEvent(nullptr, target->state()));
  }

  // Any region to ranks of this process; regions of this device's shared allocations also to
  // other processes of this host (device.h).
  StatusOr<std::vector<std::byte>> ExportMemory(const void* base, size_t bytes,
                                                MemoryKind kind) override {
    if (kind == MemoryKind::kFile)
      return Status::InvalidArgument("ExportMemory: file memory is not memory");
    std::vector<std::byte> payload;
    if (auto shared = shared_.Find(base, bytes)) payload = EncodeShmPayload(*shared);
    return ExportCpuMemory(base, bytes, payload);
  }
  StatusOr<std::unique_ptr<PeerMapping>> ImportMemory(std::span<const std::byte> handle) override {
    return ImportCpuMemory(handle);
  }

 protected:
  void Free(std::byte* data, size_t, MemoryKind) noexcept override {
    if (auto shared = shared_.Take(data)) return FreeShm(*shared);
    std::free(data);
  }

 private:
  const DeviceInfo info_;
  const size_t alignment_;
  const std::shared_ptr<HandleRegistry> registry_ = std::make_shared<HandleRegistry>();
  ShmTable shared_;  // this device's shared allocations (all of them where memfds are had)
};

}  // namespace

std::unique_ptr<Device> OpenCpuDevice() { return std::make_unique<CpuDevice>(); }

}  // namespace kvferry
