#include "transceiver/wire/handle.h"

#include <fmt/format.h>
#include <xxhash.h>

#include <initializer_list>
#include <span>

#include "base/siphash.h"
#include "base/wire.h"
#include "transceiver/wire/field_io.h"
#include "transceiver/wire/records.h"

namespace kvferry {
namespace wire {
namespace {

constexpr size_t kMaxAddress = 1 << 16;
constexpr uint16_t kFlagLayerWise = 1;
constexpr uint16_t kFlagCtxDirect = 2;
constexpr size_t kTokenOffset = 16;  // after magic, version, flags and request_id

uint64_t Checksum(std::span<const std::byte> b) { return XXH3_64bits(b.data(), b.size()); }

// What follows magic and version (docs/wire_format.md); the checksum of it all ends the handle.
template <typename Io>
void Fields(Io& io, Ref<Io, ContextHandle> h) {
  uint16_t flags = (h.layer_wise ? kFlagLayerWise : 0) | (h.ctx_direct ? kFlagCtxDirect : 0);
  io.U16(flags, "flags");
  io.Check((flags & ~(kFlagLayerWise | kFlagCtxDirect)) == 0,
           [&] { return fmt::format("unknown flags {:#x}", flags); });
  io.Set(h.layer_wise, (flags & kFlagLayerWise) != 0);
  io.Set(h.ctx_direct, (flags & kFlagCtxDirect) != 0);
  io.U64(h.request_id, "request_id");
  io.Fixed(h.token, "token");
  InstanceFields(io, h);
  io.I64(h.prompt_tokens, "prompt_tokens");
  io.I64(h.chunk_bytes, "chunk_bytes");
  BlocksField(io, h.blocks);
  io.List(h.addresses, "addresses", Limit{.max = kMaxRanks, .min_bytes = 4},
          [](auto& io, auto& a) { io.Str(a, "addresses[]", kMaxAddress); });
}

void WriteBody(WireWriter& w, const ContextHandle& h) {
  FieldWriter io(w);
  Fields(io, h);
}

void ReadBody(WireReader& r, ContextHandle& h) {
  FieldReader io(r);
  Fields(io, h);
}

Status Refused(const Status& s) { return s.WithContext("context handle refused"); }

// Magic, version and checksum: a handle of this build's version, whole and unchanged.
Status CheckEnvelope(std::span<const std::byte> bytes) {
  if (bytes.size() < 16) {
    return Status::InvalidArgument(fmt::format("{} bytes is too short for a handle", bytes.size()));
  }
  WireReader r(bytes);
  if (uint32_t magic = r.U32("magic"); magic != kHandleMagic) {
    return Status::InvalidArgument(fmt::format("bad magic {:#010x}; not a kvferry handle", magic));
  }
  if (uint16_t version = r.U16("version"); version != kHandleVersion) {
    return Status::InvalidArgument(fmt::format(
        "version {} is not supported (this build reads version {})", version, kHandleVersion));
  }
  uint64_t want = 0;
  for (int i = 0; i < 8; ++i)
    want |= uint64_t(std::to_integer<uint8_t>(bytes[bytes.size() - 8 + i])) << (8 * i);
  if (Checksum(bytes.first(bytes.size() - 8)) != want) {
    return Status::DataLoss("checksum mismatch: the handle is truncated or corrupted");
  }
  return Status::Ok();
}

// What the fields promise must hang together.
Status CheckConsistent(const ContextHandle& h) {
  KVF_RETURN_IF_ERROR(h.shape.Validate());
  KVF_RETURN_IF_ERROR(h.parallel.Validate(h.shape));
  if (static_cast<int32_t>(h.addresses.size()) != h.parallel.world_size()) {
    return Status::InvalidArgument(fmt::format("{} addresses for a context instance of {} ranks",
                                               h.addresses.size(), h.parallel.world_size()));
  }
  if (h.prompt_tokens < 1) return Status::InvalidArgument("prompt_tokens must be positive");
  if (h.pool_blocks < 1) return Status::InvalidArgument("pool_blocks must be positive");
  if (h.chunk_bytes < 1) return Status::InvalidArgument("chunk_bytes must be positive");
  return Status::Ok();
}

}  // namespace
}  // namespace wire

std::vector<std::byte> EncodeHandle(const ContextHandle& h) {
  WireWriter w;
  w.U32(kHandleMagic);
  w.U16(kHandleVersion);
  wire::WriteBody(w, h);
  w.U64(wire::Checksum(w.buffer()));
  return w.Take();
}

std::pair<std::vector<std::byte>, AccessToken> SealHandle(ContextHandle h,
                                                          const std::array<uint8_t, 16>& secret) {
  h.token = {};
  std::vector<std::byte> bytes = EncodeHandle(h);
  h.token = HandleToken(secret, HandleDigestOf(bytes));
  return {EncodeHandle(h), h.token};
}

HandleDigest HandleDigestOf(std::span<const std::byte> b) {
  using wire::kTokenOffset;
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
  if (Status st = wire::CheckEnvelope(bytes); !st.ok()) return wire::Refused(st);
  WireReader r(bytes.first(bytes.size() - 8));
  r.U32("magic");
  r.U16("version");
  ContextHandle h;
  wire::ReadBody(r, h);
  if (r.ok() && r.remaining() != 0) r.Fail(fmt::format("{} trailing bytes", r.remaining()));
  if (!r.ok()) return wire::Refused(r.status());
  if (Status st = wire::CheckConsistent(h); !st.ok()) return wire::Refused(st);
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
