// A request's KV cache from a context (prefill) process to a generation (decode) process, both
// on memory the "engine" owns: each side wraps its own per-layer K and V buffers (BlockPool::Wrap)
// in a different layout, and the two processes meet through the TCP rendezvous. Only the public
// API (include/kvferry) is used.
//
//   transfer [--transport ucx]          runs both: the context side here, the generation side in a
//                                       child process; exit 0 when every byte arrived
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "kvferry/device.h"
#include "kvferry/pool.h"
#include "kvferry/rendezvous.h"
#include "kvferry/transceiver.h"
#include "kvferry/transport.h"

extern char** environ;

namespace {

using kvferry::Status;

constexpr uint64_t kRequest = 7;
constexpr uint64_t kContextId = 1;  // tells restarts of the context instance apart
constexpr int64_t kPromptTokens = 20;
constexpr int64_t kBlocks = 8;
const kvferry::KvShape kShape{/*layers=*/4,    /*kv_heads=*/2,
                              /*head_dim=*/16, kvferry::DType::kBf16,
                              /*kv_factor=*/2, /*tokens_per_block=*/8};

kvferry::Deadline In(int seconds) { return kvferry::Clock::now() + std::chrono::seconds(seconds); }

int Fail(const char* what, const Status& st) {
  std::fprintf(stderr, "transfer: %s: %s\n", what, st.ToString().c_str());
  return 1;
}

// The value of element (layer, kv, token of the request, head, dim): what the context computed.
uint16_t Expected(int64_t l, int64_t kv, int64_t token, int64_t h, int64_t d) {
  return static_cast<uint16_t>(1 + l * 4099 + kv * 2053 + token * 131 + h * 17 + d);
}

// The engine's own KV memory, as an SGLang-style engine holds it: one K and one V buffer per
// layer, each [block][token][head][dim] (layout kPerLayerKvNhd), or as vLLM does: one buffer per
// layer, [kv][block][token][head][dim] (layout kPerLayer).
struct EngineKv {
  bool per_layer_kv;
  std::vector<std::vector<uint16_t>> buffers;

  explicit EngineKv(bool split_kv) : per_layer_kv(split_kv) {
    const int64_t per_kv = kBlocks * kShape.tokens_per_block * kShape.kv_heads * kShape.head_dim;
    const int n = split_kv ? kShape.layers * 2 : kShape.layers;
    buffers.assign(n, std::vector<uint16_t>(split_kv ? per_kv : 2 * per_kv, 0));
  }
  uint16_t& at(int64_t l, int64_t kv, int64_t block, int64_t t, int64_t h, int64_t d) {
    const int64_t tpb = kShape.tokens_per_block, heads = kShape.kv_heads, dim = kShape.head_dim;
    const int64_t in_kv = ((block * tpb + t) * heads + h) * dim + d;
    if (per_layer_kv) return buffers[l * 2 + kv][in_kv];
    return buffers[l][kv * kBlocks * tpb * heads * dim + in_kv];
  }
  std::vector<kvferry::ExternalRegion> Regions() {
    std::vector<kvferry::ExternalRegion> r;
    for (size_t i = 0; i < buffers.size(); ++i) {
      const int64_t l = per_layer_kv ? i / 2 : i;
      kvferry::ExternalRegion e;  // a tensor: data pointer, bytes, memory kind, GPU ordinal
      e.base = buffers[i].data();
      e.bytes = static_cast<int64_t>(buffers[i].size() * sizeof(uint16_t));
      e.memory = kvferry::MemoryKind::kDevice;  // the CPU device's "device memory" is host memory
      e.layers = {l, l + 1};                    // what it holds (so the order is free)
      e.kv =
          per_layer_kv ? kvferry::Range{int64_t(i % 2), int64_t(i % 2 + 1)} : kvferry::Range{0, 2};
      r.push_back(e);
    }
    return r;
  }
  kvferry::PoolSpec Spec() const {
    kvferry::PoolSpec s;
    s.shape = kShape;
    s.layout = per_layer_kv ? kvferry::LayoutKind::kPerLayerKvNhd : kvferry::LayoutKind::kPerLayer;
    s.memory = kvferry::MemoryKind::kDevice;  // the CPU device's "device memory" is host memory
    s.blocks = kBlocks;
    return s;
  }
};

// Waits until the request is terminal on this side.
template <typename Side>
Status AwaitEnd(Side& side) {
  for (;;) {
    for (const kvferry::TransferStatus& s : side.Poll(1, In(30))) {
      if (s.request_id != kRequest) continue;
      if (s.state == kvferry::TransferState::kComplete) return Status::Ok();
      return Status::Internal(std::string(kvferry::TransferStateName(s.state)) + ": " +
                              s.reason.ToString());
    }
  }
}

int Generation(const std::string& rv_address, const kvferry::RendezvousKey& key,
               const std::string& transport) {
  auto device = kvferry::OpenCpuDevice();
  auto rv = kvferry::ConnectRendezvous(rv_address, key);
  if (!rv.ok()) return Fail("connect rendezvous", rv.status());
  EngineKv kv(/*split_kv=*/false);  // vLLM-style: one buffer per layer
  auto regions = kv.Regions();
  auto pool = kvferry::BlockPool::Wrap(*device, kv.Spec(), regions);
  if (!pool.ok()) return Fail("wrap", pool.status());
  kvferry::TransceiverOptions options;
  options.transport = transport;
  options.instance_id = 2;
  auto side = kvferry::GenerationSide::Create(*device, *pool, options);
  if (!side.ok()) return Fail("generation side", side.status());
  auto handle = kvferry::FetchHandle(**rv, kRequest, In(30));
  if (!handle.ok()) return Fail("fetch handle", handle.status());
  const std::vector<int64_t> blocks = {5, 6, 7};  // where this engine puts the request
  if (Status st = (*side)->Fetch(*handle, blocks, 0); !st.ok()) return Fail("fetch", st);
  if (Status st = AwaitEnd(**side); !st.ok()) return Fail("generation", st);
  int64_t checked = 0;
  for (int64_t l = 0; l < kShape.layers; ++l)
    for (int64_t k = 0; k < 2; ++k)
      for (int64_t tok = 0; tok < kPromptTokens; ++tok)
        for (int64_t h = 0; h < kShape.kv_heads; ++h)
          for (int64_t d = 0; d < kShape.head_dim; ++d) {
            const int64_t b = blocks[tok / kShape.tokens_per_block];
            if (kv.at(l, k, b, tok % kShape.tokens_per_block, h, d) != Expected(l, k, tok, h, d)) {
              std::fprintf(stderr,
                           "transfer: layer %ld kv %ld token %ld head %ld dim %ld differs\n", l, k,
                           tok, h, d);
              return 1;
            }
            ++checked;
          }
  std::printf("generation: %ld elements of request %lu verified\n", checked, kRequest);
  return 0;
}

int Context(const char* self, const std::string& transport) {
  auto device = kvferry::OpenCpuDevice();
  const kvferry::RendezvousKey key = kvferry::RandomKey();
  auto server = kvferry::RendezvousServer::Start("127.0.0.1", 0, key);
  if (!server.ok()) return Fail("rendezvous server", server.status());
  auto rv = kvferry::ConnectRendezvous((*server)->address(), key);
  if (!rv.ok()) return Fail("connect rendezvous", rv.status());

  // The generation process: this program again, told where the rendezvous is and its key.
  std::string key_hex;
  for (uint8_t b : key)
    key_hex += "0123456789abcdef"[b >> 4], key_hex += "0123456789abcdef"[b & 15];
  std::string address = (*server)->address();
  std::vector<char*> argv = {
      const_cast<char*>(self), const_cast<char*>("--generation"),    address.data(),
      key_hex.data(),          const_cast<char*>(transport.c_str()), nullptr};
  pid_t child = 0;
  if (posix_spawn(&child, self, nullptr, nullptr, argv.data(), environ) != 0) {
    std::perror("transfer: posix_spawn");
    return 1;
  }

  EngineKv kv(/*split_kv=*/true);  // SGLang-style: K and V buffers per layer
  const std::vector<int64_t> blocks = {0, 1, 2};
  for (int64_t l = 0; l < kShape.layers; ++l)
    for (int64_t k = 0; k < 2; ++k)
      for (int64_t tok = 0; tok < kPromptTokens; ++tok)
        for (int64_t h = 0; h < kShape.kv_heads; ++h)
          for (int64_t d = 0; d < kShape.head_dim; ++d)
            kv.at(l, k, blocks[tok / kShape.tokens_per_block], tok % kShape.tokens_per_block, h,
                  d) = Expected(l, k, tok, h, d);
  auto regions = kv.Regions();
  auto pool = kvferry::BlockPool::Wrap(*device, kv.Spec(), regions);
  if (!pool.ok()) return Fail("wrap", pool.status());

  kvferry::TransceiverOptions options;
  options.transport = transport;
  options.instance_id = kContextId;
  options.instance_secret = kvferry::NewInstanceSecret();  // rank 0 would publish it for the others
  auto side = kvferry::ContextSide::Create(*device, *pool, options);
  if (!side.ok()) return Fail("context side", side.status());
  // Every rank publishes its address; each gathers all of them (one rank here).
  Status st = kvferry::PublishRankAddress(**rv, "ctx", kContextId, 0, (*side)->address(), In(10));
  if (!st.ok()) return Fail("publish address", st);
  auto addresses = kvferry::GatherRankAddresses(**rv, "ctx", kContextId, 1, In(10));
  if (!addresses.ok()) return Fail("gather addresses", addresses.status());
  if (st = (*side)->SetInstanceAddresses(*addresses); !st.ok()) return Fail("addresses", st);

  // Prefill is done: hand the request over.
  auto handle = (*side)->MarkReady(kRequest, blocks, kPromptTokens);
  if (!handle.ok()) return Fail("mark ready", handle.status());
  if (st = kvferry::PublishHandle(**rv, kRequest, *handle, In(10)); !st.ok()) {
    return Fail("publish handle", st);
  }
  const Status ended = AwaitEnd(**side);
  int wstatus = 0;
  waitpid(child, &wstatus, 0);
  if (!ended.ok()) return Fail("context", ended);
  if (!WIFEXITED(wstatus) || WEXITSTATUS(wstatus) != 0) {
    std::fprintf(stderr, "transfer: the generation process failed (status %d)\n", wstatus);
    return 1;
  }
  std::printf("context: request %lu complete over %s; PASS\n", kRequest, transport.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 5 && std::strcmp(argv[1], "--generation") == 0) {
    kvferry::RendezvousKey key{};
    for (size_t i = 0; i < key.size(); ++i)
      key[i] = std::stoi(std::string(argv[3] + 2 * i, 2), nullptr, 16);
    return Generation(argv[2], key, argv[4]);
  }
  std::string transport = "ucx";
  if (argc == 3 && std::strcmp(argv[1], "--transport") == 0) transport = argv[2];
  bool available = false;
  for (const std::string& t : kvferry::AvailableTransports()) available |= t == transport;
  if (!available || transport == "inproc") {
    std::printf("transfer: SKIP: no transport '%s' between processes in this build\n",
                transport.c_str());
    return 77;
  }
  return Context("/proc/self/exe", transport);
}
