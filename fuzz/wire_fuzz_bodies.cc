#include "wire_fuzz_bodies.h"

#include <xxhash.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "kvferry/kv_model.h"
#include "planner/planner.h"
#include "transceiver/engine/engine.h"
#include "transceiver/wire/handle.h"
#include "transceiver/wire/messages.h"
#include "transport/nixl_wire.h"
#include "transport/ucx_address.h"

namespace kvferry {
namespace {

// A failed invariant names its line (and the refusal its status) before aborting: the fuzz
// binaries inline the bodies, so the abort's stack alone does not say which check failed.
void CheckAt(bool ok, int line, const Status* st = nullptr) {
  if (ok) return;
  std::fprintf(stderr, "wire_fuzz_bodies.cc:%d: check failed%s%s\n", line, st ? ": " : "",
               st ? st->ToString().c_str() : "");
  std::abort();
}
#define Check(ok) CheckAt((ok), __LINE__)

// A refusal: one of the codes the decoders document, with a message naming what was wrong.
#define CheckRefusal(st)                                                                           \
  CheckAt(((st).code() == StatusCode::kInvalidArgument || (st).code() == StatusCode::kDataLoss) && \
              !(st).message().empty(),                                                             \
          __LINE__, &(st))

std::vector<std::byte> Bytes(const uint8_t* data, size_t size) {
  std::vector<std::byte> v(size);
  if (size) std::memcpy(v.data(), data, size);
  return v;
}

// The local instance a mode byte picks: what a generation (or context) rank of a real deployment
// could be, with a shape bounded as a real instance's is (a hostile peer can't choose ours).
struct Local {
  InstanceDesc desc;
  int64_t chunk_bytes = 4096;
  int64_t direct_min_bytes = 2048;
  int64_t reused = 0;
};

bool ShapeIsLocal(const KvShape& s) {
  return s.Validate().ok() && s.layers <= 64 && s.kv_heads <= 64 && s.head_dim <= 256 &&
         s.tokens_per_block <= 64;
}

Local PickLocal(const KvShape& shape, uint8_t bits) {
  static const ParallelConfig kSplits[] = {
      {1, 1, {}, 1, 0}, {2, 1, {}, 1, 0}, {1, 2, {}, 1, 0}, {4, 1, {}, 2, 1}};
  Local l;
  l.desc.shape = shape;
  l.desc.parallel = kSplits[bits & 3];
  l.desc.layout = (bits & 4) ? LayoutKind::kPerLayer : LayoutKind::kBlockMajor;
  l.desc.pool_blocks = 48;
  l.reused = (bits >> 3) & 1;
  if (bits & 16) l.direct_min_bytes = kNoDirect;
  if (bits & 32) l.chunk_bytes = 1 << 20;
  return l;
}

// A rank's own plan budget (Engine::plan_budget): its pool plus its staging, 8 chunks here. Both
// sides pass it to the planner, so a peer's handle or FETCH can't make them plan more.
int64_t PlanBudget(const Local& local) {
  auto slice = SliceOf(local.desc.shape, local.desc.parallel, 0);
  Check(slice.ok());
  auto layout = PoolLayout::Make(local.desc.layout,
                                 RankPoolDims(local.desc.shape, *slice, local.desc.pool_blocks),
                                 local.desc.shape.ElementBytes());
  Check(layout.ok());
  return layout->total_bytes() + local.chunk_bytes * 8;
}

// Every piece of a plan lies inside the pools of both ranks it names (a hostile handle or FETCH
// must not make a rank read or write outside its own pool).
void CheckPiecesInside(const std::vector<PairPlan>& pairs, const InstanceDesc& ctx,
                       const InstanceDesc& gen) {
  for (const PairPlan& pair : pairs) {
    auto cs = SliceOf(ctx.shape, ctx.parallel, pair.ctx_rank);
    auto gs = SliceOf(gen.shape, gen.parallel, pair.gen_rank);
    Check(cs.ok() && gs.ok());
    auto cl =
        LayoutOf(ctx, RankPoolDims(ctx.shape, *cs, ctx.pool_blocks), ctx.shape.ElementBytes());
    auto gl =
        LayoutOf(gen, RankPoolDims(gen.shape, *gs, gen.pool_blocks), gen.shape.ElementBytes());
    Check(cl.ok() && gl.ok());
    Check(static_cast<int64_t>(pair.chunks.size()) <= kMaxChunksPerPair);
    int64_t total = 0;
    for (const Chunk& c : pair.chunks) {
      int64_t chunk_total = 0;
      for (const Piece& p : c.pieces) {
        Check(p.bytes > 0 && p.rows > 0);
        Check(p.src_region >= 0 && p.src_region < cl->num_regions());
        Check(p.dst_region >= 0 && p.dst_region < gl->num_regions());
        const int64_t src_end = p.src_offset + (p.rows - 1) * p.src_pitch + p.bytes;
        const int64_t dst_end = p.dst_offset + (p.rows - 1) * p.dst_pitch + p.bytes;
        Check(p.src_offset >= 0 && src_end <= cl->region_bytes());
        Check(p.dst_offset >= 0 && dst_end <= gl->region_bytes());
        chunk_total += p.total();
      }
      Check(chunk_total == c.bytes);
      total += c.bytes;
    }
    Check(total == pair.bytes);
  }
}

}  // namespace

int HandleFuzzOne(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t mode = data[0];
  std::vector<std::byte> in = Bytes(data + 1, size - 1);
  if ((mode & 1) && in.size() >= 16) {  // re-seal: a valid checksum over the mutated bytes
    const uint64_t sum = XXH3_64bits(in.data(), in.size() - 8);
    for (int i = 0; i < 8; ++i) in[in.size() - 8 + i] = std::byte((sum >> (8 * i)) & 0xff);
  }
  auto h = DecodeHandle(in);
  if (!h.ok()) {
    CheckRefusal(h.status());
    return 0;
  }
  Check(EncodeHandle(*h) == in);
  auto again = DecodeHandle(EncodeHandle(*h));
  Check(again.ok() && *again == *h);
  // Plan as each generation rank of a local instance would (GenerationSide::Fetch).
  if (!ShapeIsLocal(h->shape)) return 0;
  Local local = PickLocal(h->shape, static_cast<uint8_t>(mode >> 1));
  if (!local.desc.parallel.Validate(local.desc.shape).ok()) return 0;
  PlanInput pin;
  pin.ctx = *h;  // the context instance the handle describes (an InstanceDesc)
  pin.gen = local.desc;
  pin.prompt_tokens = h->prompt_tokens;
  pin.ctx_blocks = h->blocks;
  for (int64_t b = 0; b < local.desc.pool_blocks; ++b) pin.gen_blocks.push_back(47 - b);
  pin.gen_reused_blocks = local.reused;
  pin.chunk_bytes = std::min(local.chunk_bytes, h->chunk_bytes);
  pin.direct_min_bytes = h->ctx_direct ? local.direct_min_bytes : kNoDirect;
  pin.layer_wise = h->layer_wise;
  pin.max_plan_bytes = PlanBudget(local);
  pin.max_chunks = PlanChunkCap(pin.max_plan_bytes, local.chunk_bytes);
  for (int32_t g = 0; g < local.desc.parallel.world_size(); ++g) {
    auto plan = PlanForGenRank(pin, g);
    if (!plan.ok()) {
      CheckRefusal(plan.status());
      continue;
    }
    CheckPiecesInside(*plan, pin.ctx, pin.gen);
  }
  return 0;
}

int MessageFuzzOne(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t mode = data[0];
  std::vector<std::byte> in;
  if (const uint8_t type = mode & 15; type != 0 && type <= 8) {
    in = {std::byte{kMessageMagic & 0xff}, std::byte{kMessageMagic >> 8},
          std::byte{kMessageVersion}, std::byte{type}};
  }
  std::vector<std::byte> rest = Bytes(data + 1, size - 1);
  in.insert(in.end(), rest.begin(), rest.end());
  if (!in.empty() && (mode & 15) != 0) {  // the harness built the header: it seals the message too
    const uint64_t seal = MessageSeal(in);
    for (size_t i = 0; i < kMessageSealBytes; ++i)
      in.push_back(std::byte((seal >> (8 * i)) & 0xff));
  }
  if (auto v = DecodeVersionMsg(in); v.ok()) Check(EncodeVersionMsg(*v) == in);
  auto m = DecodeMessage(in);
  if (!m.ok()) {
    CheckRefusal(m.status());
    return 0;
  }
  Check(EncodeMessage(*m, MessageVersionOf(in)) == in);
  auto again = DecodeMessage(EncodeMessage(*m));
  Check(again.ok() && *again == *m);
  auto* f = std::get_if<FetchMsg>(&*m);
  if (!f) return 0;
  // Plan as a context rank does for an accepted FETCH (ContextSide: token, tokens and chunk
  // bounds checked first). Re-sealed: the context's own shape, prompt and a valid token.
  static const KvShape kCtxShape{4, 4, 8, DType::kBf16, 2, 4};
  constexpr int64_t kCtxTokens = 10;
  Local local = PickLocal(kCtxShape, static_cast<uint8_t>(mode >> 5));
  if (mode & 16) {
    f->shape = kCtxShape;
    f->prompt_tokens = kCtxTokens;
  }
  if (f->prompt_tokens != kCtxTokens || f->chunk_bytes < 1 || f->chunk_bytes > local.chunk_bytes) {
    return 0;  // the context rank rejects these before planning
  }
  PlanInput pin;
  pin.ctx = local.desc;
  pin.gen = *f;  // the generation instance the FETCH describes
  pin.prompt_tokens = kCtxTokens;
  pin.ctx_blocks = {5, 6, 7};
  pin.gen_blocks = f->blocks;
  pin.gen_reused_blocks = f->reused_blocks;
  pin.chunk_bytes = f->chunk_bytes;
  pin.direct_min_bytes = f->direct_min_bytes;
  pin.max_plan_bytes = PlanBudget(local);
  pin.max_chunks = PlanChunkCap(pin.max_plan_bytes, local.chunk_bytes);
  for (int32_t c = 0; c < local.desc.parallel.world_size(); ++c) {
    auto plan = PlanForCtxRank(pin, c);
    if (!plan.ok()) {
      CheckRefusal(plan.status());
      continue;
    }
    CheckPiecesInside(*plan, pin.ctx, pin.gen);
  }
  return 0;
}

namespace {

// A worker address of UCX 1.22 (address version 1: uuid, then devices for tcp, sysv, posix, cma
// and self), from this build's own transport: the shape a peer's bytes are checked against before
// ucp_ep_create (UcxAddressShape; ucx_two_process_test checks the live address).
constexpr char kSampleWorker[] =
    "206c3e0cfb1ec2b82f0000637577cc2b320040975000000000004f030088f5b32655c24e75ee01060002c00002"
    "02cf1917b751389763344bd7e037370013230082c30f010e0102e9a6e9d73644c6a7f9ffffefcf1917b7513853"
    "9e3e4bd7e03737011323008287210208e9a6e9d73644c6278d5377cc2b320000705077ccab33004f2300883180"
    "0000000000000308e9a6e9d73644c627a7d377cc2b320000705077ccab33004f23008899390000040000c00408"
    "e9a6e9d73644c627478bbd37063600242e5077ccab330092210084993900008680";

const UcxAddressShape& SampleShape() {
  static const UcxAddressShape shape = [] {
    std::vector<uint8_t> raw;
    for (size_t i = 0; i + 1 < sizeof(kSampleWorker); i += 2)
      raw.push_back(
          static_cast<uint8_t>(std::stoi(std::string(kSampleWorker + i, 2), nullptr, 16)));
    auto s = UcxAddressShape::Learn(raw);
    Check(s.ok());
    return s.ok() ? *s : UcxAddressShape::Unchecked();
  }();
  return shape;
}

// UcxAddressShape::Check (in parentheses: Check is this file's invariant macro).
Status ShapeCheck(std::span<const uint8_t> a) { return (SampleShape().Check)(a); }

// What a peer can make a rank parse before it proved anything: worker-address bytes (a handle's
// address, a hello's). The check reads nothing past them; an address it accepts loses that
// verdict when cut short or extended.
void FuzzWorkerAddress(std::span<const uint8_t> a) {
  const Status st = ShapeCheck(a);
  if (!st.ok()) {
    CheckRefusal(st);
    return;
  }
  Check(!a.empty() && !ShapeCheck(a.first(a.size() - 1)).ok());
  std::vector<uint8_t> longer(a.begin(), a.end());
  longer.push_back(0);
  Check(!ShapeCheck(longer).ok());
}

}  // namespace

int UcxAddressFuzzOne(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  std::string text;
  if (data[0] & 2) {  // raw worker-address bytes
    FuzzWorkerAddress(std::span(data + 1, size - 1));
    return 0;
  }
  if (data[0] & 1) {
    text = EncodeUcxAddress(data + 1, size - 1);
    auto raw = DecodeUcxAddress(text);
    Check(raw.ok() && raw->size() == size - 1 &&
          (size == 1 || std::memcmp(raw->data(), data + 1, size - 1) == 0));
    return 0;
  }
  text.assign(reinterpret_cast<const char*>(data + 1), size - 1);
  auto raw = DecodeUcxAddress(text);
  if (!raw.ok()) {
    CheckRefusal(raw.status());
    return 0;
  }
  Check(EncodeUcxAddress(raw->data(), raw->size()) == text);
  // A transport's address (a handle's, a hello's): both workers' bytes go to the check.
  if (auto workers = DecodeUcxWorkerAddresses(text); workers.ok()) {
    FuzzWorkerAddress(workers->control);
    FuzzWorkerAddress(workers->data);
  } else {
    CheckRefusal(workers.status());
  }
  return 0;
}

int NixlWireFuzzOne(const uint8_t* data, size_t size) {
  using namespace nixl_detail;
  if (size == 0) return 0;
  const std::span<const std::byte> in(reinterpret_cast<const std::byte*>(data + 1), size - 1);
  const int mode = data[0] & 3;
  if (mode == 0 || mode == 3) {
    const std::string text(reinterpret_cast<const char*>(in.data()), in.size());
    auto a = DecodeNixlAddress(text);
    if (a.ok()) {  // hex digits of either case decode; the encoder writes lower case
      auto again = DecodeNixlAddress(EncodeNixlAddress(*a));
      Check(again.ok() && again->agent == a->agent && again->metadata == a->metadata);
    } else {
      CheckRefusal(a.status());
    }
  }
  if (mode == 1 || mode == 3) {
    auto k = DecodeNixlKey(in);
    if (k.ok()) {  // a version-2 key of host memory re-encodes as version 1: compare fields
      auto again = DecodeNixlKey(EncodeNixlKey(*k));
      Check(again.ok() && again->agent == k->agent && again->base == k->base &&
            again->size == k->size && again->mem == k->mem && again->device == k->device &&
            again->metadata == k->metadata);
      Check(k->mem == 0 || k->mem == 1);
      Check(k->base + k->size >= k->base);
    } else {
      CheckRefusal(k.status());
    }
  }
  if (mode == 2 || mode == 3) {
    auto n = DecodeNixlNotif(in);
    if (n.ok()) {
      Check(n->payload.empty() || (n->payload.data() >= in.data() &&
                                   n->payload.data() + n->payload.size() <= in.data() + in.size()));
      if (n->kind == kData)
        Check(n->offset <= n->total && n->payload.size() <= n->total - n->offset);
    } else {
      CheckRefusal(n.status());
    }
  }
  return 0;
}

}  // namespace kvferry
