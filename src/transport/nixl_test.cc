// NIXL loaded at run time: where it is found, what is refused, what `kvferry info` reports.
// Tests that need NIXL itself are skipped (saying why) where it can't be loaded.
#include <gtest/gtest.h>

#include <algorithm>

#include "kvferry/config.h"
#include "kvferry/nixl_info.h"
#include "kvferry/transport.h"
#include "transport/nixl_api.h"

namespace kvferry::nixl_detail {
namespace {

// Restores a knob when the test ends.
struct KnobGuard {
  std::string name;
  ~KnobGuard() { (void)Config::Global().Reset(name); }
};

TEST(NixlRuntime, ReportsVersionPluginsAndBackendOrWhyNot) {
  auto info = QueryNixlRuntime();
  if (!info.ok()) {
    EXPECT_EQ(info.status().code(), StatusCode::kUnavailable);
    EXPECT_FALSE(info.status().message().empty());
    GTEST_SKIP() << info.status().ToString();
  }
  EXPECT_EQ(info->version.rfind("1.5.", 0), 0u) << info->version;
  EXPECT_NE(info->library_path.find("libnixl_capi.so"), std::string::npos);
  EXPECT_NE(std::find(info->plugins.begin(), info->plugins.end(), "UCX"), info->plugins.end());
  EXPECT_EQ(info->backend, "UCX");
  EXPECT_TRUE(info->backend_status.ok()) << info->backend_status.ToString();
}

TEST(NixlRuntime, AMissingLibraryIsUnavailableNamingIt) {
  KnobGuard g{"nixl.library"};
  ASSERT_TRUE(Config::Global().Set("nixl.library", "/nonexistent/nixl").ok());
  auto api = LoadNixl();
  ASSERT_FALSE(api.ok());
  EXPECT_EQ(api.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(api.status().message().find("/nonexistent/nixl"), std::string::npos);
  TransportOptions o;
  o.name = "nixl";
  auto t = CreateTransport(o);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(t.status().message().find("/nonexistent/nixl"), std::string::npos);
}

TEST(NixlRuntime, AnUnknownBackendIsUnavailable) {
  if (auto api = LoadNixl(); !api.ok()) GTEST_SKIP() << api.status().ToString();
  KnobGuard g{"nixl.backend"};
  ASSERT_TRUE(Config::Global().Set("nixl.backend", "NO_SUCH_PLUGIN").ok());
  auto info = QueryNixlRuntime();
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->backend_status.code(), StatusCode::kUnavailable);
  EXPECT_NE(info->backend_status.message().find("NO_SUCH_PLUGIN"), std::string::npos);
  TransportOptions o;
  o.name = "nixl";
  EXPECT_EQ(CreateTransport(o).status().code(), StatusCode::kUnavailable);
}

}  // namespace
}  // namespace kvferry::nixl_detail
