// Every fuzz body in the normal build: the checked-in corpus (seeds and crash reproducers) and
// many inputs mutated from it, so a property broken by a change fails here without clang.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "protocol_fuzz_body.h"
#include "rendezvous_frame_fuzz_body.h"
#include "wire_fuzz_bodies.h"

namespace kvferry {
namespace {

using Body = int (*)(const uint8_t*, size_t);

struct Seeds {
  std::vector<std::vector<uint8_t>> all;     // every file of the corpus, run once each
  std::vector<std::vector<uint8_t>> mutate;  // those mutated: all but the "slow-*" files
};

// A corpus file named slow-* is a regression input that costs real work by design (a hostile
// handle planned up to the rank's budget: about 0.4 s under ASan); it runs once, and mutating it
// thousands of times would make this test take minutes (561 s under ASan).
Seeds Corpus(const std::string& target) {
  Seeds out;
  const std::filesystem::path dir = std::filesystem::path(KVFERRY_FUZZ_CORPUS) / target;
  std::vector<std::filesystem::path> files;
  for (const auto& e : std::filesystem::directory_iterator(dir)) files.push_back(e.path());
  std::sort(files.begin(), files.end());
  for (const auto& p : files) {
    std::ifstream f(p, std::ios::binary);
    out.all.emplace_back(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
    if (!p.filename().string().starts_with("slow-")) out.mutate.push_back(out.all.back());
  }
  return out;
}

// A libFuzzer-like mutation: byte flips, overwrites, inserts, erases, truncation, a new mode.
std::vector<uint8_t> Mutate(std::vector<uint8_t> in, std::mt19937_64& rng) {
  const int n = 1 + static_cast<int>(rng() % 4);
  for (int i = 0; i < n; ++i) {
    const size_t at = in.empty() ? 0 : rng() % in.size();
    switch (rng() % 6) {
      case 0:
        if (!in.empty()) in[at] ^= static_cast<uint8_t>(1u << (rng() % 8));
        break;
      case 1:
        if (!in.empty()) in[at] = static_cast<uint8_t>(rng());
        break;
      case 2:
        in.insert(in.begin() + static_cast<std::ptrdiff_t>(at), static_cast<uint8_t>(rng()));
        break;
      case 3:
        if (!in.empty()) in.erase(in.begin() + static_cast<std::ptrdiff_t>(at));
        break;
      case 4:
        in.resize(at);
        break;
      case 5:
        if (!in.empty()) in[0] = static_cast<uint8_t>(rng());
        break;
    }
  }
  return in;
}

void RunBody(const std::string& target, Body body, int mutated) {
  const Seeds corpus = Corpus(target);
  ASSERT_FALSE(corpus.mutate.empty()) << "no corpus for " << target;
  for (const auto& in : corpus.all) ASSERT_EQ(body(in.data(), in.size()), 0);
  std::mt19937_64 rng(20261201);
  for (int i = 0; i < mutated; ++i) {
    auto in = Mutate(corpus.mutate[rng() % corpus.mutate.size()], rng);
    ASSERT_EQ(body(in.data(), in.size()), 0);
  }
}

TEST(FuzzBodies, Handle) { RunBody("handle_fuzz", HandleFuzzOne, 20000); }
TEST(FuzzBodies, Message) { RunBody("message_fuzz", MessageFuzzOne, 20000); }
TEST(FuzzBodies, UcxAddress) { RunBody("ucx_address_fuzz", UcxAddressFuzzOne, 20000); }
TEST(FuzzBodies, NixlWire) { RunBody("nixl_wire_fuzz", NixlWireFuzzOne, 20000); }
TEST(FuzzBodies, Protocol) { RunBody("protocol_fuzz", ProtocolFuzzOne, 16); }
TEST(FuzzBodies, RendezvousFrame) {
  RunBody("rendezvous_frame_fuzz", RendezvousFrameFuzzOne, 20000);
}

}  // namespace
}  // namespace kvferry
