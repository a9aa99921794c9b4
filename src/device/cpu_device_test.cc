#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <vector>

#include "device/device_conformance.h"

namespace kvferry::testing {

std::unique_ptr<Device> DeviceUnderTest() { return OpenCpuDevice(); }

namespace {

TEST(CpuDevice, OpenByName) {
  auto d = OpenDevice("cpu");
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ((*d)->info().platform, "cpu");
  EXPECT_EQ(OpenDevice("tpu").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(OpenDevice("cuda:x").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ListDevices().front(), "cpu");
}

TEST(CpuDevice, AllocationsAreAlignedForDirectIo) {
  auto d = OpenCpuDevice();
  for (size_t n : {1, 4095, 4096, 1 << 20}) {
    auto b = d->Allocate(MemoryKind::kPinnedHost, n);
    ASSERT_TRUE(b.ok());
    EXPECT_EQ(reinterpret_cast<uintptr_t>(b->data()) % 4096, 0u);
  }
}

// Device and pinned memory are resident from allocation on, as cudaMalloc / cudaHostAlloc memory
// is: before, the first copy into each 4 KiB page took a page fault and a page clear, and a host
// tier's first offloads ran at about half the speed of a memcpy between touched buffers.
TEST(CpuDevice, DeviceAndPinnedMemoryIsResidentAtAllocation) {
  auto d = OpenCpuDevice();
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  for (MemoryKind kind : {MemoryKind::kDevice, MemoryKind::kPinnedHost}) {
    auto b = d->Allocate(kind, 64 << 20);
    ASSERT_TRUE(b.ok());
    const size_t pages = (b->size() + page - 1) / page;
    std::vector<unsigned char> resident(pages);
    ASSERT_EQ(::mincore(b->data(), b->size(), resident.data()), 0);
    size_t in = 0;
    for (unsigned char r : resident) in += r & 1;
    EXPECT_EQ(in, pages) << MemoryKindName(kind);
  }
}

}  // namespace
}  // namespace kvferry::testing
