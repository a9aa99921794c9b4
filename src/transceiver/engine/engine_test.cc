// The engine's teardown: copies still queued on its stream finish before staging is freed.
#include "transceiver/engine/engine.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <thread>

#include "kvferry/inproc_transport.h"
#include "kvferry/pool.h"
#include "kvferry/transport.h"

namespace kvferry {
namespace {

// A CPU device that records whether a copy ran after its buffers were freed.
class RecordingDevice final : public Device {
 public:
  const DeviceInfo& info() const override { return cpu_->info(); }
  StatusOr<Buffer> Allocate(MemoryKind kind, size_t bytes) override {
    KVF_ASSIGN_OR_RETURN(Buffer b, cpu_->Allocate(kind, bytes));
    std::byte* data = b.data();
    owned_.emplace(data, std::move(b));
    return MakeBuffer(data, bytes, kind);
  }
  StatusOr<std::unique_ptr<Stream>> CreateStream() override { return cpu_->CreateStream(); }
  StatusOr<std::unique_ptr<Event>> CreateEvent() override { return cpu_->CreateEvent(); }

  std::atomic<int> frees{0};

 protected:
  void Free(std::byte* data, size_t, MemoryKind) noexcept override {
    ++frees;
    owned_.erase(data);
  }

 private:
  std::unique_ptr<Device> cpu_ = OpenCpuDevice();
  std::map<std::byte*, Buffer> owned_;
};

// A side with nothing to do: the engine's parts alone.
class IdleSide final : public EngineSide {
 public:
  void Fail(PathRequest&, Status) override {}
  void FailById(uint64_t, const Status&) override {}
  void OnControl(PeerId, ControlMsg) override {}
  bool Advance() override { return false; }
  void OnTick(Clock::time_point) override {}
  bool OnStop() override { return true; }
  bool InFlight() const override { return false; }
  std::chrono::microseconds QuietNap() const override { return {}; }
  bool QuietNapHearsPeers() const override { return true; }
};

TEST(Engine, DestructionWaitsForCopiesQueuedOnItsStreamBeforeFreeingStaging) {
  RecordingDevice device;
  PoolSpec spec{KvShape{2, 2, 16, DType::kFp16, 2, 4},
                ParallelConfig{},
                0,
                LayoutKind::kBlockMajor,
                MemoryKind::kHost,
                4};
  auto pool = BlockPool::Create(device, spec);
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  TransceiverOptions topt;
  topt.transport = "inproc";
  EngineOptions opt = ResolveOptions(topt, device);
  opt.rma = false;
  opt.chunk_bytes = 4096;
  opt.staging_chunks = 2;
  TransportOptions t;
  t.name = "inproc";
  t.fabric = InProcFabric::Create();
  auto transport = CreateTransport(t);
  ASSERT_TRUE(transport.ok()) << transport.status().ToString();
  IdleSide side;
  auto engine = std::make_unique<Engine>(device, *pool, opt, std::move(transport).value(), side);
  ASSERT_TRUE(engine->Start().ok());

  // The copy into a staging slot is queued behind a slow callback, as a chunk's unpack or pack
  // may be when a side is destroyed mid-transfer; it must run while staging is still allocated.
  const int frees_before = device.frees.load();
  std::atomic<int> frees_seen_by_copy{-1};
  std::byte* dst = nullptr;
  {
    StagingLease slot = engine->AcquireSlot();  // given back before the engine goes
    ASSERT_TRUE(slot);
    dst = engine->SlotData(slot);
  }
  ASSERT_TRUE(engine->stream()
                  .HostCallback([] { std::this_thread::sleep_for(std::chrono::milliseconds(50)); })
                  .ok());
  ASSERT_TRUE(engine->stream()
                  .HostCallback([&] {
                    frees_seen_by_copy = device.frees.load();
                    std::memset(dst, 0x5A, 64);
                  })
                  .ok());
  engine.reset();
  EXPECT_EQ(frees_seen_by_copy.load(), frees_before)
      << "a copy queued on the engine's stream ran after staging was freed";
  EXPECT_GT(device.frees.load(), frees_before);
}

}  // namespace
}  // namespace kvferry
