// The tiered KV cache on memory the "engine" owns: the primary pool wraps the engine's per-layer
// KV buffers (BlockPool::Wrap); evicted blocks go down to pinned host memory and to a file tier
// (SlabStore, slab files in a directory), the primary blocks are overwritten, and a prefix hit
// brings them back, byte for byte. Only the public API (include/kvferry) is used.
//
//   tiering [DIR]     the file tier's directory (default: a new one under /tmp, removed after)
#include "kvferry/tiering.h"

#include <stdlib.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "kvferry/device.h"
#include "kvferry/pool.h"
#include "kvferry/slab_store.h"

namespace {

using kvferry::BlockMove;
using kvferry::Status;
using kvferry::Tier;

const kvferry::KvShape kShape{/*layers=*/4,    /*kv_heads=*/2,
                              /*head_dim=*/32, kvferry::DType::kFp16,
                              /*kv_factor=*/2, /*tokens_per_block=*/16};
constexpr int64_t kBlocks = 16;
constexpr int64_t kPerLayerElems = 2 * kBlocks * 16 * 2 * 32;  // [kv][block][token][head][dim]

int Fail(const char* what, const Status& st) {
  std::fprintf(stderr, "tiering: %s: %s\n", what, st.ToString().c_str());
  return 1;
}

// Element i of layer l's buffer, for the bytes of logical block `tag`.
uint16_t Value(int64_t l, int64_t i, int64_t tag) {
  return static_cast<uint16_t>(tag * 7919 + l * 131 + i % 4093 + 1);
}

// Visits every element of block `b` of a per-layer NHD buffer ([kv][block][token][head][dim]).
template <typename F>
void ForBlock(int64_t b, F&& f) {
  const int64_t block_elems = 16 * 2 * 32;
  for (int64_t kv = 0; kv < 2; ++kv)
    for (int64_t j = 0; j < block_elems; ++j) f((kv * kBlocks + b) * block_elems + j);
}

int Run(const std::string& dir) {
  auto device = kvferry::OpenCpuDevice();

  // The engine's KV cache: one buffer per layer, vLLM style.
  std::vector<std::vector<uint16_t>> layers(kShape.layers, std::vector<uint16_t>(kPerLayerElems));
  std::vector<kvferry::ExternalRegion> regions;
  for (auto& buf : layers) {
    kvferry::ExternalRegion r;  // region l holds layer l (its position in the list)
    r.base = buf.data();
    r.bytes = static_cast<int64_t>(buf.size() * sizeof(uint16_t));
    r.memory = kvferry::MemoryKind::kDevice;
    regions.push_back(r);
  }
  kvferry::PoolSpec spec;
  spec.shape = kShape;
  spec.layout = kvferry::LayoutKind::kPerLayer;
  spec.memory = kvferry::MemoryKind::kDevice;
  spec.blocks = kBlocks;
  auto primary = kvferry::BlockPool::Wrap(*device, spec, regions);
  if (!primary.ok()) return Fail("wrap", primary.status());

  // The host tier: pinned host memory, each block one contiguous range in the primary's own
  // in-block order (block-major-nhd under this per-layer pool), so that on a GPU a per-layer
  // block is gathered on the device and crosses PCIe as one copy (device staging).
  auto host = kvferry::CreatePackedHostPool(*device, *primary, /*blocks=*/8);
  if (!host.ok()) return Fail("host pool", host.status());

  // The file tier: slots of one whole block each.
  kvferry::SlabStoreOptions so = kvferry::SlabStoreOptionsFromConfig();
  so.dir = dir;
  so.slot_payload_bytes = kShape.BytesPerToken() * kShape.tokens_per_block;
  so.max_slots = 8;
  auto file = kvferry::SlabStore::Open(so);
  if (!file.ok()) return Fail("file tier", file.status());

  auto manager = kvferry::TransferManager::Create(*device, *primary, &*host, file->get());
  if (!manager.ok()) return Fail("transfer manager", manager.status());
  kvferry::TransferManager& tm = **manager;

  // Blocks 0..3 hold a prefix the engine may reuse; 0 and 1 go to host memory, 2 and 3 to files.
  for (int64_t b = 0; b < 4; ++b)
    for (int64_t l = 0; l < kShape.layers; ++l)
      ForBlock(b, [&](int64_t i) { layers[l][i] = Value(l, i, b); });
  std::vector<int64_t> slots;
  for (int i = 0; i < 2; ++i) {
    auto slot = (*file)->Allocate();
    if (!slot.ok()) return Fail("allocate slot", slot.status());
    slots.push_back(*slot);
  }
  const kvferry::BlockKey k2{0xabc, 2}, k3{0xabc, 3};  // the identity of the bytes (prefix hash)
  const std::vector<BlockMove> to_host = {{0, 0}, {1, 1}};
  const std::vector<BlockMove> to_file = {{2, slots[0], 0, k2}, {3, slots[1], 0, k3}};
  auto a = tm.Offload(Tier::kHost, to_host);
  auto b = tm.Offload(Tier::kFile, to_file);
  if (!a.ok() || !b.ok()) return Fail("offload", !a.ok() ? a.status() : b.status());
  const auto deadline = kvferry::Clock::now() + std::chrono::seconds(30);
  if (Status st = a->Wait(deadline); !st.ok()) return Fail("offload to host", st);
  if (Status st = b->Wait(deadline); !st.ok()) return Fail("offload to file", st);

  // The engine reuses the primary blocks for other requests...
  for (auto& buf : layers) std::fill(buf.begin(), buf.end(), uint16_t{0xdead});
  // ...and later the prefix is hit: onboard into blocks 8..11.
  const std::vector<BlockMove> from_host = {{0, 8}, {1, 9}};
  const std::vector<BlockMove> from_file = {{slots[0], 10, 0, k2}, {slots[1], 11, 0, k3}};
  auto c = tm.Onboard(Tier::kHost, from_host);
  auto d = tm.Onboard(Tier::kFile, from_file);
  if (!c.ok() || !d.ok()) return Fail("onboard", !c.ok() ? c.status() : d.status());
  if (Status st = c->Wait(deadline); !st.ok()) return Fail("onboard from host", st);
  if (Status st = d->Wait(deadline); !st.ok()) return Fail("onboard from file", st);
  if (Status st = tm.Drain(deadline); !st.ok()) return Fail("drain", st);

  int64_t checked = 0;
  for (int64_t b = 0; b < 4; ++b)
    for (int64_t l = 0; l < kShape.layers; ++l) {
      bool ok = true;
      ForBlock(8 + b, [&](int64_t i) {
        const int64_t src_i = i - 8 * 16 * 2 * 32;  // the same element of block b
        ok = ok && layers[l][i] == Value(l, src_i, b);
        ++checked;
      });
      if (!ok) {
        std::fprintf(stderr, "tiering: block %ld layer %ld came back wrong\n", 8 + b, l);
        return 1;
      }
    }
  const kvferry::TransferStats s = tm.stats();
  std::printf(
      "tiering: %ld elements back from host and file (%s backend); %ld file writes, %ld "
      "reads; PASS\n",
      checked, (*file)->backend().name.c_str(), s.file_writes, s.file_reads);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir;
  bool temp = argc < 2;
  if (temp) {
    char tmpl[] = "/tmp/kvferry-tiering-XXXXXX";
    if (mkdtemp(tmpl) == nullptr) {
      std::perror("tiering: mkdtemp");
      return 1;
    }
    dir = tmpl;
  } else {
    dir = argv[1];
  }
  const int rc = Run(dir);
  if (temp) std::filesystem::remove_all(dir);
  return rc;
}
