// The CPU device: streams are worker threads draining ordered queues, events are completion
// counters, all memory is aligned host memory. It exists so that every piece of logic above the
// device layer runs, and is tested, on a machine without a GPU.
#include <fmt/format.h>

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

#include "kvferry/config.h"
#include "kvferry/device.h"

namespace kvferry {
namespace {

// Shared between an event and the stream tasks that complete it.
struct EventState {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t recorded = 0;   // generation of the last Record()
  uint64_t completed = 0;  // highest generation whose work has finished
};

class CpuEvent final : public Event {
 public:
  CpuEvent() : state_(std::make_shared<EventState>()) {}
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
};

class CpuStream final : public Stream {
 public:
  CpuStream() : worker_([this] { Run(); }) {}
  ~CpuStream() override {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }

  Status Copy(void* dst, const void* src, size_t bytes) override {
    return Enqueue([=] { std::memcpy(dst, src, bytes); });
  }

  Status CopyBatch(std::span<const CopyDesc> copies) override {
    return Enqueue([v = std::vector<CopyDesc>(copies.begin(), copies.end())] {
      for (const CopyDesc& c : v) {
        if (c.rows <= 1) {
          std::memcpy(c.dst, c.src, c.bytes);
          continue;
        }
        auto* d = static_cast<std::byte*>(c.dst);
        auto* s = static_cast<const std::byte*>(c.src);
        for (size_t r = 0; r < c.rows; ++r)
          std::memcpy(d + r * c.dst_pitch, s + r * c.src_pitch, c.bytes);
      }
    });
  }

  Status Copy2D(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width,
                size_t height) override {
    if (width > dst_pitch || width > src_pitch) {
      return Status::InvalidArgument(fmt::format(
          "Copy2D: width {} exceeds a pitch (dst {}, src {})", width, dst_pitch, src_pitch));
    }
    return Enqueue([=] {
      auto* d = static_cast<std::byte*>(dst);
      auto* s = static_cast<const std::byte*>(src);
      for (size_t r = 0; r < height; ++r) std::memcpy(d + r * dst_pitch, s + r * src_pitch, width);
    });
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
    std::unique_lock lock(mu_);
    uint64_t want = enqueued_;
    if (!done_cv_.wait_until(lock, deadline, [&] { return finished_ >= want; })) {
      return Status::DeadlineExceeded(
          fmt::format("cpu stream: {} operations still pending at the deadline", want - finished_));
    }
    return Status::Ok();
  }

  bool Query() override {
    std::lock_guard lock(mu_);
    return finished_ >= enqueued_;
  }

 private:
  Status Enqueue(std::function<void()> fn) {
    {
      std::lock_guard lock(mu_);
      queue_.push_back(std::move(fn));
      ++enqueued_;
    }
    cv_.notify_one();
    return Status::Ok();
  }

  void Run() {
    std::unique_lock lock(mu_);
    while (true) {
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and drained
      std::function<void()> fn = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      fn();
      lock.lock();
      ++finished_;
      done_cv_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;               // work queued or stop
  std::condition_variable done_cv_;          // an operation finished
  std::deque<std::function<void()>> queue_;  // guarded by mu_
  uint64_t enqueued_ = 0;                    // guarded by mu_
  uint64_t finished_ = 0;                    // guarded by mu_
  bool stop_ = false;                        // guarded by mu_
  std::thread worker_;                       // last: starts after the members above exist
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
    size_t rounded = (bytes + alignment_ - 1) / alignment_ * alignment_;
    void* p = std::aligned_alloc(alignment_, rounded);
    if (p == nullptr) {
      return Status::ResourceExhausted(fmt::format(
          "cpu device: could not allocate {} bytes of {} memory", bytes, MemoryKindName(kind)));
    }
    return MakeBuffer(static_cast<std::byte*>(p), bytes, kind);
  }

  StatusOr<std::unique_ptr<Stream>> CreateStream() override {
    return std::unique_ptr<Stream>(new CpuStream());
  }
  StatusOr<std::unique_ptr<Event>> CreateEvent() override {
    return std::unique_ptr<Event>(new CpuEvent());
  }

 protected:
  void Free(std::byte* data, size_t, MemoryKind) noexcept override { std::free(data); }

 private:
  const DeviceInfo info_;
  const size_t alignment_;
};

}  // namespace

std::unique_ptr<Device> OpenCpuDevice() { return std::make_unique<CpuDevice>(); }

}  // namespace kvferry
