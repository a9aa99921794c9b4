// Device staging on the CUDA device (label gpu; skipped without a GPU): a per-layer primary pool
// on cuda:0, whole-block and partial moves (shuffled ids, batches larger than the staging)
// offloaded and onboarded through device staging, into a host tier packed per block
// (block-major-nhd: one link copy per block) and into a per-layer host tier (staged in the
// primary's own order), byte for byte the same as the CPU device's direct copies of the same moves.
#include <gtest/gtest.h>

#include <memory>
#include <optional>
#include <vector>

#include "device/cuda_entry.h"
#include "kvferry/tiering.h"
#include "testing/host_mirror.h"
#include "testing/tiering_test_util.h"

namespace kvferry::tiering {
namespace {

using std::chrono::seconds;

constexpr KvShape kShape{4, 4, 64, DType::kBf16, 2, 16};  // 8 KiB per (layer, kv) of a block
constexpr int64_t kBlocks = 12;

PoolSpec Spec(LayoutKind layout, MemoryKind memory) {
  PoolSpec s;
  s.shape = kShape;
  s.layout = layout;
  s.memory = memory;
  s.blocks = kBlocks;
  return s;
}

// One side of the comparison: a device's primary and host pools and its transfer manager.
struct Side {
  std::unique_ptr<Device> dev;
  std::optional<BlockPool> primary, host, mirror;  // mirror: host copy of the primary (CUDA)
  std::unique_ptr<Stream> io;
  std::unique_ptr<TransferManager> tm;

  Side(std::unique_ptr<Device> d, LayoutKind host_layout, DeviceStaging staging)
      : dev(std::move(d)) {
    primary = BlockPool::Create(*dev, Spec(LayoutKind::kPerLayer, MemoryKind::kDevice)).value();
    host = BlockPool::Create(*dev, Spec(host_layout, MemoryKind::kPinnedHost)).value();
    mirror = MakeHostMirror(*dev, *primary).value();
    io = dev->CreateStream().value();
    TransferOptions o;
    o.device_staging = staging;
    o.device_staging_blocks =
        4;  // two halves of 2: batches of 7 go in 4 chunks, halves alternating
    tm = TransferManager::Create(*dev, *primary, &*host, nullptr, o).value();
  }
  void Fill() {
    testing::FillAll(*mirror, 100);
    ASSERT_TRUE(CopyWholePool(*io, *mirror, *primary).ok());
    testing::FillAll(*host, 700);
  }
  std::vector<std::byte> PrimaryBytes() {
    EXPECT_TRUE(CopyWholePool(*io, *primary, *mirror).ok());
    return testing::Snapshot(*mirror);
  }
  void Run(Tier from, Tier to, const std::vector<BlockMove>& moves) {
    auto b = tm->Move(from, to, moves);
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    ASSERT_TRUE(b->Wait(DeadlineIn(seconds(30))).ok());
  }
};

void StagedMatchesCpu(LayoutKind host_layout) {
  if (internal::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA GPU present";
  Side gpu(OpenDevice("cuda:0").value(), host_layout, DeviceStaging::kAlways);
  Side cpu(OpenCpuDevice(), host_layout, DeviceStaging::kNever);
  ASSERT_TRUE(gpu.tm->device_staged()) << LayoutKindName(host_layout);
  ASSERT_FALSE(cpu.tm->device_staged());
  gpu.Fill();
  cpu.Fill();
  // Shuffled ids: a batch of whole blocks (staged: 7 moves through halves of 2), then a batch
  // mixing whole blocks (0 or 16 tokens) with partial ones (direct), each way.
  const std::vector<BlockMove> out = {{3, 9}, {1, 4}, {0, 7}, {6, 1}, {11, 3}, {2, 10}, {9, 6}};
  const std::vector<BlockMove> out_mixed = {{7, 0, 5}, {10, 2, 1}, {5, 11, 16}, {8, 5, 9}};
  const std::vector<BlockMove> in = {{9, 6}, {4, 11}, {11, 3}, {5, 10}, {0, 1}, {3, 7}, {1, 0}};
  const std::vector<BlockMove> in_mixed = {{0, 2, 3}, {2, 4, 15}, {7, 8, 1}, {6, 9, 16}};
  for (const auto* batch : {&out, &out_mixed}) {
    gpu.Run(Tier::kPrimary, Tier::kHost, *batch);
    cpu.Run(Tier::kPrimary, Tier::kHost, *batch);
    EXPECT_TRUE(testing::Snapshot(*gpu.host) == testing::Snapshot(*cpu.host))
        << "offload of " << batch->size() << " moves, host tier " << LayoutKindName(host_layout);
  }
  for (const auto* batch : {&in, &in_mixed}) {
    gpu.Run(Tier::kHost, Tier::kPrimary, *batch);
    cpu.Run(Tier::kHost, Tier::kPrimary, *batch);
    EXPECT_TRUE(gpu.PrimaryBytes() == cpu.PrimaryBytes())
        << "onboard of " << batch->size() << " moves, host tier " << LayoutKindName(host_layout);
  }
}

TEST(StagedCuda, PackedHostTierMatchesTheCpuDevice) {
  StagedMatchesCpu(LayoutKind::kBlockMajorNhd);
}

TEST(StagedCuda, PerLayerHostTierMatchesTheCpuDevice) { StagedMatchesCpu(LayoutKind::kPerLayer); }

// auto (the default) stages a per-layer pool only into a host tier packed in its own in-block
// order: not into a transposing one (block-major, HND: 128-byte rows here), nor a per-layer one.
TEST(StagedCuda, AutoStagesOnlyIntoAPackedHostTierOfTheSameOrder) {
  if (internal::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA GPU present";
  auto dev = OpenDevice("cuda:0").value();
  auto primary = BlockPool::Create(*dev, Spec(LayoutKind::kPerLayer, MemoryKind::kDevice)).value();
  EXPECT_EQ(TransferOptions{}.device_staging, DeviceStaging::kAuto);
  for (LayoutKind host_layout :
       {LayoutKind::kBlockMajorNhd, LayoutKind::kBlockMajor, LayoutKind::kPerLayer}) {
    auto host = BlockPool::Create(*dev, Spec(host_layout, MemoryKind::kPinnedHost)).value();
    auto tm = TransferManager::Create(*dev, primary, &host, nullptr, TransferOptions{}).value();
    EXPECT_EQ(tm->device_staged(), host_layout == LayoutKind::kBlockMajorNhd)
        << LayoutKindName(host_layout);
  }
}

}  // namespace
}  // namespace kvferry::tiering
