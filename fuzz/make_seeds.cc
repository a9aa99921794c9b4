// Writes the seed corpora checked in under fuzz/corpus/<target>/ (valid inputs of every decoder
// and a few protocol programs). Usage: make_seeds fuzz/corpus
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

#include "rendezvous/frame.h"
#include "transceiver/wire/seeds.h"
#include "transport/nixl_wire.h"
#include "transport/ucx_address.h"

namespace kvferry {
namespace {

void Write(const std::filesystem::path& dir, const std::string& name, uint8_t mode,
           const std::vector<std::byte>& body) {
  std::filesystem::create_directories(dir);
  std::ofstream f(dir / name, std::ios::binary);
  f.put(static_cast<char>(mode));
  f.write(reinterpret_cast<const char*>(body.data()), static_cast<std::streamsize>(body.size()));
}

std::vector<std::byte> Raw(std::initializer_list<int> bytes) {
  std::vector<std::byte> v;
  for (int b : bytes) v.push_back(std::byte(b));
  return v;
}

// The bytes of a hex string.
std::vector<std::byte> Hex(std::string_view hex) {
  std::vector<std::byte> v;
  for (size_t i = 0; i + 1 < hex.size(); i += 2)
    v.push_back(std::byte(std::stoi(std::string(hex.substr(i, 2)), nullptr, 16)));
  return v;
}

// A UCX 1.22 worker address (address version 1), as the fuzz body's sample (wire_fuzz_bodies.cc).
constexpr std::string_view kWorker =
    "206c3e0cfb1ec2b82f0000637577cc2b320040975000000000004f030088f5b32655c24e75ee01060002c00002"
    "02cf1917b751389763344bd7e037370013230082c30f010e0102e9a6e9d73644c6a7f9ffffefcf1917b7513853"
    "9e3e4bd7e03737011323008287210208e9a6e9d73644c6278d5377cc2b320000705077ccab33004f2300883180"
    "0000000000000308e9a6e9d73644c627a7d377cc2b320000705077ccab33004f23008899390000040000c00408"
    "e9a6e9d73644c627478bbd37063600242e5077ccab330092210084993900008680";

void WriteAll(const std::filesystem::path& root) {
  for (const WireSeed& s : WireSeeds()) Write(root / s.target, s.name, s.mode, s.bytes);

  const uint8_t addr[] = {0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 1, 2, 3};
  std::string text = EncodeUcxAddress(addr, sizeof(addr));
  Write(root / "ucx_address_fuzz", "text", 0,
        std::vector<std::byte>(reinterpret_cast<const std::byte*>(text.data()),
                               reinterpret_cast<const std::byte*>(text.data() + text.size())));
  Write(root / "ucx_address_fuzz", "raw", 1,
        std::vector<std::byte>(reinterpret_cast<const std::byte*>(addr),
                               reinterpret_cast<const std::byte*>(addr) + sizeof(addr)));

  // Worker addresses: raw bytes (mode 2), and a transport address of two of them (mode 0).
  const std::vector<std::byte> worker = Hex(kWorker);
  Write(root / "ucx_address_fuzz", "worker_v1", 2, worker);
  std::vector<uint8_t> w(reinterpret_cast<const uint8_t*>(worker.data()),
                         reinterpret_cast<const uint8_t*>(worker.data()) + worker.size());
  const std::string both = EncodeUcxWorkerAddresses({w, w});
  Write(root / "ucx_address_fuzz", "transport_two_workers", 0,
        std::vector<std::byte>(reinterpret_cast<const std::byte*>(both.data()),
                               reinterpret_cast<const std::byte*>(both.data() + both.size())));

  // NIXL's wire: an address (mode 0), keys of host and GPU memory (mode 1), notifications
  // (mode 2).
  {
    using namespace nixl_detail;
    const auto bytes = [](std::string_view t) {
      return std::vector<std::byte>(reinterpret_cast<const std::byte*>(t.data()),
                                    reinterpret_cast<const std::byte*>(t.data() + t.size()));
    };
    const std::string address = EncodeNixlAddress({"kvferry-1-abc", bytes("agent metadata")});
    Write(root / "nixl_wire_fuzz", "address", 0, bytes(address));
    Write(root / "nixl_wire_fuzz", "key_dram", 1,
          EncodeNixlKey({"kvferry-1-abc", 0x10000, 4096, bytes("partial metadata")}));
    Write(root / "nixl_wire_fuzz", "key_vram", 1,
          EncodeNixlKey({"kvferry-1-abc", 0x7f0000000000, 1 << 20, bytes("md"), 1, 2}));
    auto data = NixlNotifHeader(kData, address, 7, 10, 4);
    for (std::byte b : bytes("abcdef")) data.push_back(b);
    Write(root / "nixl_wire_fuzz", "notif_data_hello", 2, data);
    Write(root / "nixl_wire_fuzz", "notif_ack", 2, NixlNotifHeader(kAck, "", 7, 0, 0));
  }

  // Protocol programs: config byte, then ops (see protocol_fuzz_body.cc, Harness::Run).
  Write(root / "protocol_fuzz", "publish_fetch", 0, Raw({0x00, 9, 0x01, 0}));
  Write(root / "protocol_fuzz", "per_layer_two_requests", 3,
        Raw({0x00, 12, 0x20, 5, 0x01, 1, 0x21, 0, 0x05, 3}));
  Write(root / "protocol_fuzz", "forged_complete", 0,
        Raw({0x00, 9, 0x01, 0, 0x03, 1, 0, 4, 0x03, 2, 0, 4}));
  Write(root / "protocol_fuzz", "hostile_fetch_first", 4,
        Raw({0x00, 7, 0x02, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0x01, 0}));
  Write(root / "protocol_fuzz", "layer_wise_cancel", 1,
        Raw({0x08, 11, 0x01, 0, 0x05, 2, 0x1f, 0x0c, 0x04}));
  Write(root / "protocol_fuzz", "mutated_handle_abort", 0,
        Raw({0x00, 10, 0x09, 0, 3, 1, 0x03, 1, 3, 3, 0x06, 4, 1, 2, 3, 4}));

  // Rendezvous frames, re-sealed by the body under its key (mode bit 0), with the length set
  // (bit 1), in an open connection's context (bit 2) except the greetings.
  using rendezvous::FrameType;
  const std::pair<const char*, rendezvous::Frame> frames[] = {
      {"hello", {.type = FrameType::kHello}},
      {"challenge", {.type = FrameType::kChallenge}},
      {"put",
       {.type = FrameType::kPut, .key = "ctx/rank/0", .value = Raw({1, 2, 3}), .sequence = 1}},
      {"get", {.type = FrameType::kGet, .key = "handle/42", .sequence = 2}},
      {"erase", {.type = FrameType::kErase, .key = "handle/42", .sequence = 3}},
      {"wait", {.type = FrameType::kWait, .key = "handle/43", .wait_ms = 1500, .sequence = 4}},
      {"ok", {.type = FrameType::kOk, .value = Raw({7, 7}), .sequence = 4}},
      {"not_found", {.type = FrameType::kNotFound, .sequence = 5}},
      {"refused", {.type = FrameType::kRefused, .reason = "store full", .sequence = 6}},
  };
  for (const auto& [name, f] : frames) {
    const bool greeting = f.type == FrameType::kHello || f.type == FrameType::kChallenge;
    Write(root / "rendezvous_frame_fuzz", name, greeting ? 3 : 7,
          rendezvous::EncodeFrame(f, RendezvousKey{}, {}, /*sign=*/false));
  }
  Write(root / "rendezvous_frame_fuzz", "version1_get", 0,
        Raw({0x4B, 0x56, 0x46, 0x52, 1, 0, 2, 0, 5, 0, 0, 0, 1, 0, 0, 0, 'k'}));
}

}  // namespace
}  // namespace kvferry

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR (writes CORPUS_DIR/<target>/<seed>)\n", argv[0]);
    return 2;
  }
  kvferry::WriteAll(argv[1]);
  return 0;
}
