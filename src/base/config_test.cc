#include "kvferry/config.h"

#include <gtest/gtest.h>

namespace kvferry {
namespace {

TEST(Config, DefaultsAreListedWithDocs) {
  auto knobs = Config::Global().List();
  ASSERT_FALSE(knobs.empty());
  for (const auto& k : knobs) {
    EXPECT_FALSE(k.doc.empty()) << k.name;
    EXPECT_EQ(k.env_var.rfind("KVFERRY_", 0), 0u) << k.name;
  }
  EXPECT_EQ(Config::Global().Int("transfer.timeout_ms"), 30000);
}

TEST(Config, SetValidatesAndResets) {
  Config& c = Config::Global();
  EXPECT_TRUE(c.Set("transfer.timeout_ms", "500").ok());
  EXPECT_EQ(c.Int("transfer.timeout_ms"), 500);
  Status bad = c.Set("transfer.timeout_ms", "0");
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("transfer.timeout_ms"), std::string_view::npos) << bad.ToString();
  EXPECT_EQ(c.Set("transfer.timeout_ms", "12x").code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(c.Set("log.level", "loud").code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(c.Set("no.such.knob", "1").code(), StatusCode::kNotFound);
  EXPECT_TRUE(c.Reset("transfer.timeout_ms").ok());
  EXPECT_EQ(c.Int("transfer.timeout_ms"), 30000);
}

}  // namespace
}  // namespace kvferry
