// The bytes on the wire do not change unless the version does: every message type and the handle,
// encoded now, equal the bytes the encoders of wire version 11 (handle version 2) produced. Two
// sources of those bytes: the fuzz seeds checked in under fuzz/corpus (written by make_seeds), and
// the hex below, taken from the encoders before the wire was described once (wire/), for the
// fields the seeds leave empty (rkeys, peer handles, stage layers, every flag and mode).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "transceiver/wire/handle.h"
#include "transceiver/wire/messages.h"
#include "transceiver/wire/seeds.h"

namespace kvferry {
namespace {

std::string Hex(std::span<const std::byte> bytes) {
  std::string s;
  for (std::byte b : bytes) s += fmt::format("{:02x}", std::to_integer<int>(b));
  return s;
}

std::vector<std::byte> FromHex(std::string_view hex) {
  std::vector<std::byte> v;
  for (size_t i = 0; i + 1 < hex.size(); i += 2)
    v.push_back(std::byte(std::stoi(std::string(hex.substr(i, 2)), nullptr, 16)));
  return v;
}

TEST(WireGolden, EverySeedEncodesToItsCheckedInBytes) {
  const std::vector<WireSeed> seeds = WireSeeds();
  ASSERT_EQ(seeds.size(), 23u);
  // KVFERRY_WRITE_SEEDS=1 writes the seeds that have no file yet (a new seed's first run).
  const char* write = std::getenv("KVFERRY_WRITE_SEEDS");
  for (const WireSeed& s : seeds) {
    const auto path = std::filesystem::path(KVFERRY_FUZZ_CORPUS) / s.target / s.name;
    if (write && std::string_view(write) == "1" && !std::filesystem::exists(path)) {
      std::ofstream out(path, std::ios::binary);
      out.put(static_cast<char>(s.mode));
      out.write(reinterpret_cast<const char*>(s.bytes.data()),
                static_cast<std::streamsize>(s.bytes.size()));
    }
    std::ifstream in(path, std::ios::binary);
    ASSERT_TRUE(in) << path;
    std::vector<char> file((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::vector<std::byte> want(file.size());
    for (size_t i = 0; i < file.size(); ++i) want[i] = std::byte(file[i]);
    ASSERT_FALSE(want.empty()) << path;
    EXPECT_EQ(std::to_integer<int>(want[0]), s.mode) << path;
    EXPECT_EQ(Hex(s.bytes), Hex(std::span(want).subspan(1))) << path;
  }
}

ContextHandle FullHandle() {
  ContextHandle h;
  h.request_id = 0x0123456789abcdefULL;
  h.token = {9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 0xff, 0xfe, 0xfd, 0xfc, 0xfb, 0xfa};
  h.shape = KvShape{32, 8, 128, DType::kFp8E4M3, 2, 32};
  h.parallel = ParallelConfig{2, 2, {20, 12}, 2, 1};
  h.layout = LayoutKind::kPerLayer;
  h.pool_blocks = 100;
  h.prompt_tokens = 70;
  h.layer_wise = true;
  h.ctx_direct = false;
  h.chunk_bytes = 1 << 20;
  h.blocks = {4, 5, -6};
  h.addresses = {"a", "bb", "", "dddd"};
  return h;
}

FetchMsg FullFetch() {
  FetchMsg f;
  f.request_id = 0xfedcba9876543210ULL;
  for (size_t i = 0; i < f.token.size(); ++i) f.token[i] = static_cast<uint8_t>(i + 1);
  for (size_t i = 0; i < f.handle_digest.size(); ++i)
    f.handle_digest[i] = static_cast<uint8_t>(0xa0 + i);
  f.gen_instance = 77;
  f.gen_rank = -3;
  f.transfer_id = 0x80000001u;
  f.shape = KvShape{4, 2, 8, DType::kFp16, 1, 16};
  f.parallel = ParallelConfig{4, 2, {3, 1}, 2, 1};
  f.layout = LayoutKind::kPerLayer;
  f.pool_blocks = 50;
  f.prompt_tokens = 33;
  f.reused_blocks = 1;
  f.chunk_bytes = 4096;
  f.direct_min_bytes = 1 << 18;
  f.blocks = {1, 2, 3};
  f.reply_address = "ucx:host:1234";
  return f;
}

FetchMsg RmaFetch(bool checksum, bool peer) {
  FetchMsg f = FullFetch();
  f.checksum = checksum;
  f.rma = true;
  f.rma_target.pool = {RemoteRegion{0x1000, 4096, {std::byte{1}, std::byte{2}}},
                       RemoteRegion{0x9000, 8192, {std::byte{3}}}};
  f.rma_target.staging = RemoteRegion{0x20000, 65536, {std::byte{4}, std::byte{5}}};
  f.rma_target.slot_bytes = 16384;
  f.rma_target.slots = 4;
  f.rma_target.row_min_bytes = 8192;
  if (peer) f.rma_target.peer_pool = {{std::byte{7}, std::byte{8}}, {std::byte{9}}};
  return f;
}

struct Golden {
  const char* name;
  ControlMsg msg;
  const char* hex;
};

TEST(WireGolden, EveryMessageAndTheHandleEncodeToTheVersion11Bytes) {
  FetchMsg checksum_only = FullFetch();
  checksum_only.checksum = true;
  ChunkMsg complete{1, 2, 3, 40, false, 0, true};
  const Golden messages[] = {
      {"fetch", FullFetch(),
       "4b4d0b011032547698badcfe0102030405060708090a0b0c0d0e0f10a0a1a2a3a4a5a6a7a8a9aaabacad"
       "aeaf4d00000000000000fdffffff01000080040000000200000008000000010110000000040000000200"
       "000002000000030000000100000002000000010000000132000000000000002100000000000000010000"
       "000000000000100000000000000000040000000000030000000100000000000000020000000000000003"
       "000000000000000d0000007563783a686f73743a31323334002894b0a80519fccd"},
      {"fetch_checksum", checksum_only,
       "4b4d0b011032547698badcfe0102030405060708090a0b0c0d0e0f10a0a1a2a3a4a5a6a7a8a9aaabacad"
       "aeaf4d00000000000000fdffffff01000080040000000200000008000000010110000000040000000200"
       "000002000000030000000100000002000000010000000132000000000000002100000000000000010000"
       "000000000000100000000000000000040000000000030000000100000000000000020000000000000003"
       "000000000000000d0000007563783a686f73743a3132333402a45781453ccab09e"},
      {"fetch_rma", RmaFetch(false, false),
       "4b4d0b011032547698badcfe0102030405060708090a0b0c0d0e0f10a0a1a2a3a4a5a6a7a8a9aaabacad"
       "aeaf4d00000000000000fdffffff01000080040000000200000008000000010110000000040000000200"
       "000002000000030000000100000002000000010000000132000000000000002100000000000000010000"
       "000000000000100000000000000000040000000000030000000100000000000000020000000000000003"
       "000000000000000d0000007563783a686f73743a31323334010200000000100000000000000010000000"
       "000000020000000102009000000000000000200000000000000100000003000002000000000000000100"
       "00000000020000000405004000000000000004000000002000000000000010dc00d0528f6f9c"},
      {"fetch_rma_checksum_peer", RmaFetch(true, true),
       "4b4d0b011032547698badcfe0102030405060708090a0b0c0d0e0f10a0a1a2a3a4a5a6a7a8a9aaabacad"
       "aeaf4d00000000000000fdffffff01000080040000000200000008000000010110000000040000000200"
       "000002000000030000000100000002000000010000000132000000000000002100000000000000010000"
       "000000000000100000000000000000040000000000030000000100000000000000020000000000000003"
       "000000000000000d0000007563783a686f73743a31323334070200000000100000000000000010000000"
       "000000020000000102009000000000000000200000000000000100000003000002000000000000000100"
       "000000000200000004050040000000000000040000000020000000000000020000000200000007080100"
       "0000092cac6faa2b6bad55"},
      {"accept_tagged", AcceptMsg{1, 2, false, false},
       "4b4d0b020100000000000000020000000033cb5fb83fe4b099"},
      {"accept_rma", AcceptMsg{1, 2, true, false},
       "4b4d0b02010000000000000002000000016d57c2a7a75101a6"},
      {"accept_peer", AcceptMsg{1, 2, true, true},
       "4b4d0b020100000000000000020000000274b852a982ccf76a"},
      {"reject", RejectMsg{0x1122334455667788ULL, 9, 3, "no room"},
       "4b4d0b0388776655443322110900000003070000006e6f20726f6f6d185567196a7ed3bd"},
      {"credit", CreditMsg{1, 2, 9, {}},
       "4b4d0b040100000000000000020000000900000000000000b9c54901ffaec76f"},
      {"credit_slots", CreditMsg{1, 2, 9, {3, kNoSlot, 0}},
       "4b4d0b04010000000000000002000000090000000300000003000000ffffffff0000000042f048b15a4b"
       "b18e"},
      {"chunk_checksum", ChunkMsg{1, 2, 3, 1, true, 0xfeedbeefcafef00dULL},
       "4b4d0b080100000000000000020000000300000001000000010df0fecaefbeedfe914e747371e60310"},
      {"chunk_count", ChunkMsg{1, 2, 3, 40, false, 0},
       "4b4d0b0801000000000000000200000003000000280000000000000000000000009362a93784b35430"},
      {"chunk_complete", complete,
       "4b4d0b080100000000000000020000000300000028000000020000000000000000840004393a11fa1a"},
      {"done", DoneMsg{1, 2, -99},
       "4b4d0b050100000000000000020000009dffffffffffffff96a7182ecce8be4c"},
      {"abort", AbortMsg{1, 2, 4, "late"},
       "4b4d0b0601000000000000000200000004040000006c61746594e641b9bd89392f"},
      {"complete", CompleteMsg{5, 6}, "4b4d0b0705000000000000000600000057a577368081b4c2"},
      {"sibling", SiblingMsg{1, {9, 8, 7}, 3, 0, {}},
       "4b4d0b090100000000000000090807000000000000000000000000000300000000000000002f4d104097"
       "f7bbb8"},
      {"sibling_failed", SiblingMsg{1, {1}, 0, 4, "timed out"},
       "4b4d0b0901000000000000000100000000000000000000000000000000000000040900000074696d6564"
       "206f75749f2b94791bb58f84"},
  };
  for (const Golden& g : messages) {
    EXPECT_EQ(Hex(EncodeMessage(g.msg)), g.hex) << g.name;
    auto back = DecodeMessage(FromHex(g.hex));
    EXPECT_TRUE(back.ok()) << g.name << ": " << back.status().ToString();
    if (back.ok()) {
      EXPECT_EQ(*back, g.msg) << g.name;
    }
  }
  const std::string handle_hex =
      "4b56464802000100efcdab896745230109080706050403020100fffefdfcfbfa20000000080000008000"
      "0000030220000000020000000200000002000000140000000c0000000200000001000000016400000000"
      "000000460000000000000000001000000000000300000004000000000000000500000000000000faffff"
      "ffffffffff040000000100000061020000006262000000000400000064646464fce6c514b8154d33";
  EXPECT_EQ(Hex(EncodeHandle(FullHandle())), handle_hex);
  auto handle = DecodeHandle(FromHex(handle_hex));
  EXPECT_TRUE(handle.ok()) << handle.status().ToString();
  if (handle.ok()) {
    EXPECT_EQ(*handle, FullHandle());
  }
  const std::string sealed_hex =
      "4b56464802000100efcdab89674523014a5be52efedbbfbc920309a3fa20c62b20000000080000008000"
      "0000030220000000020000000200000002000000140000000c0000000200000001000000016400000000"
      "000000460000000000000000001000000000000300000004000000000000000500000000000000faffff"
      "ffffffffff0400000001000000610200000062620000000004000000646464645ad2ce6eaa3d742b";
  EXPECT_EQ(Hex(SealHandle(FullHandle(), {1, 2, 3, 4}).first), sealed_hex);
}

}  // namespace
}  // namespace kvferry
