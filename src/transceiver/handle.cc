#include "transceiver/handle.h"

#include <fmt/format.h>
#include <xxhash.h>

#include <initializer_list>
#include <span>

#include "base/siphash.h"
#include "base/wire.h"

namespace kvferry {
namespace {

constexpr uint32_t kMaxRanks = 1 << 16;
constexpr uint32_t kMaxBlocks = 1 << 24;
constexpr size_t kMaxAddress = 1 << 16;
constexpr uint16_t kFlagLayerWise = 1;
constexpr uint16_t kFlagCtxDirect = 2;

uint64_t Checksum(std::span<const std::byte> b) { return XXH3_64bits(b.data(), b.size()); }

}  // namespace

void EncodeShape(WireWriter& w, const KvShape& s) {
  w.I32(s.layers);
  w.I32(s.kv_heads);
  w.I32(s.head_dim);
  w.U8(static_cast<uint8_t>(s.dtype));
  w.U8(static_cast<uint8_t>(s.kv_factor));
  w.I32(s.tokens_per_block);
}

KvShape DecodeShape(WireReader& r) {
  KvShape s;
  s.layers = r.I32("shape.layers");
  s.kv_heads = r.I32("shape.kv_heads");
  s.head_dim = r.I32("shape.head_dim");
  uint8_t dt = r.U8("shape.dtype");
  if (dt > static_cast<uint8_t>(DType::kInt8)) r.Fail(fmt::format("shape.dtype {} is unknown", dt));
  s.dtype = static_cast<DType>(dt);
  s.kv_factor = r.U8("shape.kv_factor");
  s.tokens_per_block = r.I32("shape.tokens_per_block");
  return s;
}

void EncodeParallel(WireWriter& w, const ParallelConfig& p) {
  w.I32(p.tp);
  w.I32(p.pp);
  w.U32(static_cast<uint32_t>(p.stage_layers.size()));
  for (int32_t l : p.stage_layers) w.I32(l);
  w.I32(p.dp_size);
  w.I32(p.dp_rank);
}

ParallelConfig DecodeParallel(WireReader& r) {
  ParallelConfig p;
  p.tp = r.I32("parallel.tp");
  p.pp = r.I32("parallel.pp");
  uint32_t n = r.Count("parallel.stage_layers", kMaxRanks);
  for (uint32_t i = 0; i < n && r.ok(); ++i)
    p.stage_layers.push_back(r.I32("parallel.stage_layers[]"));
  p.dp_size = r.I32("parallel.dp_size");
  p.dp_rank = r.I32("parallel.dp_rank");
  return p;
}

LayoutKind DecodeLayout(WireReader& r) {
  uint8_t layout = r.U8("layout");
  if (layout > static_cast<uint8_t>(kLastLayoutKind) ||
      layout == static_cast<uint8_t>(LayoutKind::kCustom)) {
    r.Fail(fmt::format("layout {} is unknown (named layouts are 0, 1 and 3..{})", layout,
                       static_cast<int>(kLastLayoutKind)));
  }
  return static_cast<LayoutKind>(layout);
}

void EncodeBlocks(WireWriter& w, const std::vector<int64_t>& blocks) {
  w.U32(static_cast<uint32_t>(blocks.size()));
  for (int64_t b : blocks) w.I64(b);
}

std::vector<int64_t> DecodeBlocks(WireReader& r) {
  std::vector<int64_t> blocks;
  uint32_t n = r.Count("blocks", kMaxBlocks);
  if (r.ok() && r.remaining() < size_t{n} * 8) r.Fail("blocks: truncated");
  for (uint32_t i = 0; i < n && r.ok(); ++i) blocks.push_back(r.I64("blocks[]"));
  return blocks;
}

std::vector<std::byte> EncodeHandle(const ContextHandle& h) {
  WireWriter w;
  w.U32(kHandleMagic);
  w.U16(kHandleVersion);
  w.U16((h.layer_wise ? kFlagLayerWise : 0) | (h.ctx_direct ? kFlagCtxDirect : 0));
  w.U64(h.request_id);
  for (uint8_t b : h.token) w.U8(b);
  EncodeShape(w, h.shape);
  EncodeParallel(w, h.parallel);
  w.U8(static_cast<uint8_t>(h.layout));
  w.I64(h.pool_blocks);
  w.I64(h.prompt_tokens);
  w.I64(h.chunk_bytes);
  EncodeBlocks(w, h.blocks);
  w.U32(static_cast<uint32_t>(h.addresses.size()));
  for (const std::string& a : h.addresses) w.Str(a);
  uint64_t sum = Checksum(w.buffer());
  w.U64(sum);
  return w.Take();
}

std::pair<std::vector<std::byte>, AccessToken> SealHandle(ContextHandle h,
                                                          const std::array<uint8_t, 16>& secret) {
  h.token = {};
  std::vector<std::byte> bytes = EncodeHandle(h);
  h.token = HandleToken(secret, HandleDigestOf(bytes));
  return {EncodeHandle(h), h.token};
}

namespace {
constexpr size_t kTokenOffset = 16;
}  // namespace

HandleDigest HandleDigestOf(std::span<const std::byte> b) {
  HandleDigest d{};
  if (b.size() < kTokenOffset + 16 + 8) return d;
  XXH3_state_t* state = XXH3_createState();
  XXH3_128bits_reset(state);
  XXH3_128bits_update(state, b.data(), kTokenOffset);
  XXH3_128bits_update(state, b.data() + kTokenOffset + 16, b.size() - kTokenOffset - 16 - 8);
  const XXH128_hash_t h = XXH3_128bits_digest(state);
  XXH3_freeState(state);
  for (int i = 0; i < 8; ++i) {
    d[i] = static_cast<uint8_t>(h.low64 >> (8 * i));
    d[8 + i] = static_cast<uint8_t>(h.high64 >> (8 * i));
  }
  return d;
}

AccessToken HandleToken(const std::array<uint8_t, 16>& secret, const HandleDigest& digest) {
  std::array<std::byte, 8 + 16> msg{};
  constexpr char kDomain[8] = {'k', 'v', 'f', 'h', 'a', 'n', 'd', 'l'};
  for (size_t i = 0; i < 8; ++i) msg[i] = static_cast<std::byte>(kDomain[i]);
  for (size_t i = 0; i < 16; ++i) msg[8 + i] = static_cast<std::byte>(digest[i]);
  return SipHash128Of(secret, msg);
}

StatusOr<ContextHandle> DecodeHandle(std::span<const std::byte> bytes) {
  auto refuse = [](const Status& s) { return s.WithContext("context handle refused"); };
  if (bytes.size() < 16) {
    return refuse(
        Status::InvalidArgument(fmt::format("{} bytes is too short for a handle", bytes.size())));
  }
  WireReader r(bytes);
  if (uint32_t magic = r.U32("magic"); magic != kHandleMagic) {
    return refuse(
        Status::InvalidArgument(fmt::format("bad magic {:#010x}; not a kvferry handle", magic)));
  }
  uint16_t version = r.U16("version");
  if (version != kHandleVersion) {
    return refuse(Status::InvalidArgument(fmt::format(
        "version {} is not supported (this build reads version {})", version, kHandleVersion)));
  }
  // Integrity before parsing further: the last 8 bytes are the checksum of everything before.
  uint64_t want = 0;
  for (int i = 0; i < 8; ++i)
    want |= uint64_t(std::to_integer<uint8_t>(bytes[bytes.size() - 8 + i])) << (8 * i);
  if (Checksum(bytes.first(bytes.size() - 8)) != want) {
    return refuse(Status::DataLoss("checksum mismatch: the handle is truncated or corrupted"));
  }
  WireReader body(bytes.first(bytes.size() - 8));
  body.U32("magic");
  body.U16("version");
  uint16_t flags = body.U16("flags");
  if ((flags & ~(kFlagLayerWise | kFlagCtxDirect)) != 0) {
    body.Fail(fmt::format("unknown flags {:#x}", flags));
  }
  ContextHandle h;
  h.layer_wise = (flags & kFlagLayerWise) != 0;
  h.ctx_direct = (flags & kFlagCtxDirect) != 0;
  h.request_id = body.U64("request_id");
  for (auto& b : h.token) b = body.U8("token");
  h.shape = DecodeShape(body);
  h.parallel = DecodeParallel(body);
  h.layout = DecodeLayout(body);
  h.pool_blocks = body.I64("pool_blocks");
  h.prompt_tokens = body.I64("prompt_tokens");
  h.chunk_bytes = body.I64("chunk_bytes");
  h.blocks = DecodeBlocks(body);
  uint32_t na = body.Count("addresses", kMaxRanks);
  for (uint32_t i = 0; i < na && body.ok(); ++i)
    h.addresses.push_back(body.Str("addresses[]", kMaxAddress));
  if (body.ok() && body.remaining() != 0)
    body.Fail(fmt::format("{} trailing bytes", body.remaining()));
  if (!body.ok()) return refuse(body.status());
  // Semantic checks: what the fields promise must hang together.
  Status st = h.shape.Validate();
  if (st.ok()) st = h.parallel.Validate(h.shape);
  if (st.ok() && static_cast<int32_t>(h.addresses.size()) != h.parallel.world_size()) {
    st = Status::InvalidArgument(fmt::format("{} addresses for a context instance of {} ranks",
                                             h.addresses.size(), h.parallel.world_size()));
  }
  if (st.ok() && h.prompt_tokens < 1)
    st = Status::InvalidArgument("prompt_tokens must be positive");
  if (st.ok() && h.pool_blocks < 1) st = Status::InvalidArgument("pool_blocks must be positive");
  if (st.ok() && h.chunk_bytes < 1) st = Status::InvalidArgument("chunk_bytes must be positive");
  if (!st.ok()) return refuse(st);
  return h;
}

namespace {

// XXH3-128 with `seed` over secret || each part || secret.
AccessToken KeyedToken(const std::array<uint8_t, 16>& secret, uint64_t seed,
                       std::initializer_list<std::span<const std::byte>> parts) {
  XXH3_state_t* state = XXH3_createState();
  XXH3_128bits_reset_withSeed(state, seed);
  XXH3_128bits_update(state, secret.data(), secret.size());
  for (std::span<const std::byte> p : parts) XXH3_128bits_update(state, p.data(), p.size());
  XXH3_128bits_update(state, secret.data(), secret.size());
  XXH128_hash_t h = XXH3_128bits_digest(state);
  XXH3_freeState(state);
  AccessToken t{};
  for (int i = 0; i < 8; ++i) {
    t[i] = static_cast<uint8_t>(h.low64 >> (8 * i));
    t[8 + i] = static_cast<uint8_t>(h.high64 >> (8 * i));
  }
  return t;
}

template <typename T>
std::span<const std::byte> Bytes(const T& v) {
  return std::as_bytes(std::span(&v, 1));
}

}  // namespace

AccessToken MakeSiblingToken(const std::array<uint8_t, 16>& secret, const AccessToken& request,
                             int32_t ctx_rank, uint8_t code) {
  return KeyedToken(secret, 0x6b76666572736962ULL,
                    {std::as_bytes(std::span(request)), Bytes(ctx_rank), Bytes(code)});
}

}  // namespace kvferry
