#include <gtest/gtest.h>

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

}  // namespace
}  // namespace kvferry::testing
