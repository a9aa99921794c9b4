#include "kvferry/status.h"

#include <gtest/gtest.h>

namespace kvferry {
namespace {

StatusOr<int> Half(int x) {
  if (x % 2) return Status::InvalidArgument("odd");
  return x / 2;
}

Status Quarter(int x, int* out) {
  KVF_ASSIGN_OR_RETURN(int h, Half(x));
  KVF_ASSIGN_OR_RETURN(int q, Half(h));
  *out = q;
  return Status::Ok();
}

TEST(Status, OkAndErrors) {
  EXPECT_TRUE(Status().ok());
  EXPECT_EQ(Status().ToString(), "OK");
  Status s = Status::NotFound("block 7");
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_EQ(s.ToString(), "NOT_FOUND: block 7");
  EXPECT_EQ(s.WithContext("onboard").ToString(), "NOT_FOUND: onboard: block 7");
  Status copy = s;
  EXPECT_EQ(copy.message(), "block 7");
  EXPECT_TRUE(Status().WithContext("x").ok());
}

TEST(StatusOr, ValueOrError) {
  auto a = Half(8);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(*a, 4);
  EXPECT_EQ(Half(3).status().code(), StatusCode::kInvalidArgument);
  int out = -1;
  EXPECT_TRUE(Quarter(8, &out).ok());
  EXPECT_EQ(out, 2);
  out = -1;
  EXPECT_FALSE(Quarter(6, &out).ok());
  EXPECT_EQ(out, -1) << "no output is set on failure";
}

}  // namespace
}  // namespace kvferry
