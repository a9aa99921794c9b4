#include "base/siphash.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace kvferry {
namespace {

// The reference implementation's vectors_sip128 (veorq/SipHash vectors.h: key 00..0f, message
// 00..len-1), once whole and once fed in two pieces.
TEST(SipHash, MatchesTheReferenceVectors) {
  const std::pair<size_t, std::string_view> want[] = {
      {0, "a3817f04ba25a8e66df67214c7550293"}, {1, "da87c1d86b99af44347659119b22fc45"},
      {2, "8177228da4a45dc7fca38bdef60affe4"}, {7, "a1f1ebbed8dbc153c0b84aa61ff08239"},
      {8, "3b62a9ba6258f5610f83e264f31497b4"}, {9, "264499060ad9baabc47f8b02bb6d71ed"}};
  std::array<uint8_t, 16> key{};
  for (size_t i = 0; i < key.size(); ++i) key[i] = static_cast<uint8_t>(i);
  for (const auto& [len, hex] : want) {
    std::vector<std::byte> msg(len);
    for (size_t i = 0; i < len; ++i) msg[i] = static_cast<std::byte>(i);
    std::string whole;
    for (uint8_t b : SipHash128Of(key, msg)) whole += fmt::format("{:02x}", b);
    EXPECT_EQ(whole, hex) << len << " bytes at once";
    SipHash128 mac(key);
    mac.Update(std::span(msg).first(len / 2));
    mac.Update(std::span(msg).subspan(len / 2));
    std::string pieces;
    for (std::byte b : mac.Finish()) pieces += fmt::format("{:02x}", std::to_integer<int>(b));
    EXPECT_EQ(pieces, hex) << len << " bytes in two pieces";
  }
}

}  // namespace
}  // namespace kvferry
