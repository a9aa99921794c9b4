// The control messages, each described once (field_io.h): a Fields function per message names its
// fields in wire order (docs/wire_format.md), and EncodeMessage and DecodeMessage both run it.
#include "transceiver/wire/messages.h"

#include <fmt/format.h>
#include <xxhash.h>

#include <type_traits>

#include "transceiver/wire/field_io.h"
#include "transceiver/wire/records.h"

namespace kvferry {
namespace wire {
namespace {

// The type byte of a message is its index in ControlMsg plus one.
enum MsgType : uint8_t {
  kFetch = 1,
  kAccept,
  kReject,
  kCredit,
  kDone,
  kAbort,
  kComplete,
  kChunk,
  kSibling
};
template <MsgType type, typename M>
constexpr bool kTypeIs = std::is_same_v<std::variant_alternative_t<type - 1, ControlMsg>, M>;
static_assert(kTypeIs<kFetch, FetchMsg> && kTypeIs<kAccept, AcceptMsg> &&
              kTypeIs<kReject, RejectMsg> && kTypeIs<kCredit, CreditMsg> &&
              kTypeIs<kDone, DoneMsg> && kTypeIs<kAbort, AbortMsg> &&
              kTypeIs<kComplete, CompleteMsg> && kTypeIs<kChunk, ChunkMsg> &&
              kTypeIs<kSibling, SiblingMsg> && std::variant_size_v<ControlMsg> == kSibling);

// FETCH flags.
constexpr uint8_t kFetchRma = 1;       // an RMA target follows
constexpr uint8_t kFetchChecksum = 2;  // send each chunk's digest
constexpr uint8_t kFetchPeerPool = 4;  // the target ends with peer pool handles (with kFetchRma)
// CHUNK flags.
constexpr uint8_t kChunkHasChecksum = 1;
constexpr uint8_t kChunkComplete = 2;

constexpr uint32_t kMaxKeyBytes = 1 << 12;
constexpr uint32_t kMaxRegions = 1 << 16;
constexpr uint32_t kMaxCreditSlots = 1 << 20;
constexpr size_t kMaxText = 1 << 16;  // reasons, the reply address

// u64 address, u64 bytes, u32 n + n bytes rkey.
template <typename Io>
void Fields(Io& io, Ref<Io, RemoteRegion> g) {
  io.U64(g.address, "region address");
  io.U64(g.bytes, "region bytes");
  io.Blob(g.rkey, "rkey", Limit{.max = kMaxKeyBytes, .min_bytes = 1});
}

// The RMA target of a FETCH with flag kFetchRma; the peer pool handles only with kFetchPeerPool.
template <typename Io>
void RmaTargetFields(Io& io, Ref<Io, RmaTarget> t, bool peer_pool) {
  io.List(t.pool, "rma regions", Limit{.max = kMaxRegions, .min_bytes = 20},
          [](auto& io, auto& g) { Fields(io, g); });
  Fields(io, t.staging);
  io.I64(t.slot_bytes, "slot_bytes");
  io.U32(t.slots, "slots");
  io.I64(t.row_min_bytes, "row_min_bytes");
  if (!peer_pool) return;
  io.List(t.peer_pool, "peer pool handles", Limit{.max = kMaxRegions, .min_bytes = 5},
          [](auto& io, auto& h) {
            io.Blob(h, "peer handle",
                    Limit{.max = kMaxKeyBytes, .min_bytes = 1, .empty_ok = false});
          });
  // The flag says handles follow: none at all is not a form the writer makes. One more than the
  // regions: the generation pool's per-block scales (checked against the FETCH's scales when
  // mapped).
  io.Check(!t.peer_pool.empty() && (t.peer_pool.size() == t.pool.size() ||
                                    (!t.pool.empty() && t.peer_pool.size() == t.pool.size() + 1)),
           [&] {
             return fmt::format(
                 "{} peer pool handles for {} rma regions (flag 4 needs one per region, and one "
                 "more for per-block scales)",
                 t.peer_pool.size(), t.pool.size());
           });
}

// The plan inputs block of a FETCH, after transfer_id.
template <typename Io>
void PlanInputFields(Io& io, Ref<Io, FetchPlanInputs> p) {
  InstanceFields(io, p);
  io.I64(p.prompt_tokens, "prompt_tokens");
  io.I64(p.reused_blocks, "reused_blocks");
  io.I64(p.chunk_bytes, "chunk_bytes");
  io.I64(p.direct_min_bytes, "direct_min_bytes");
  BlocksField(io, p.blocks);
}

template <typename Io>
void Fields(Io& io, Ref<Io, FetchMsg> m) {
  io.U64(m.request_id, "request_id");
  io.Fixed(m.token, "token");
  io.Fixed(m.handle_digest, "handle_digest");
  io.U64(m.gen_instance, "gen_instance");
  io.I32(m.gen_rank, "gen_rank");
  io.U32(m.transfer_id, "transfer_id");
  PlanInputFields(io, m);
  io.Str(m.reply_address, "reply_address", kMaxText);
  uint8_t flags = (m.rma ? kFetchRma : 0) | (m.checksum ? kFetchChecksum : 0) |
                  (m.rma && !m.rma_target.peer_pool.empty() ? kFetchPeerPool : 0);
  io.U8(flags, "fetch flags");
  io.Check((flags & ~(kFetchRma | kFetchChecksum | kFetchPeerPool)) == 0 &&
               (flags & (kFetchRma | kFetchPeerPool)) != kFetchPeerPool,
           [&] { return fmt::format("unknown fetch flags {:#x}", flags); });
  io.Set(m.rma, (flags & kFetchRma) != 0);
  io.Set(m.checksum, (flags & kFetchChecksum) != 0);
  if ((flags & kFetchRma) && io.ok()) RmaTargetFields(io, m.rma_target, flags & kFetchPeerPool);
}

template <typename Io>
void Fields(Io& io, Ref<Io, AcceptMsg> m) {
  io.U64(m.request_id, "request_id");
  io.U32(m.transfer_id, "transfer_id");
  uint8_t mode = m.peer_memory ? 2 : m.rma ? 1 : 0;  // tagged, puts, copies into peer memory
  io.U8(mode, "accept mode");
  io.Check(mode <= 2, [&] { return fmt::format("unknown accept mode {}", mode); });
  io.Set(m.rma, mode >= 1);
  io.Set(m.peer_memory, mode == 2);
}

// REJECT and ABORT: u64 request_id, u32 transfer_id, u8 code, string reason.
template <typename Io, typename M>
void FailureFields(Io& io, M& m) {
  io.U64(m.request_id, "request_id");
  io.U32(m.transfer_id, "transfer_id");
  io.U8(m.code, "code");
  io.Str(m.reason, "reason", kMaxText);
}
template <typename Io>
void Fields(Io& io, Ref<Io, RejectMsg> m) {
  FailureFields(io, m);
}
template <typename Io>
void Fields(Io& io, Ref<Io, AbortMsg> m) {
  FailureFields(io, m);
}

template <typename Io>
void Fields(Io& io, Ref<Io, CreditMsg> m) {
  io.U64(m.request_id, "request_id");
  io.U32(m.transfer_id, "transfer_id");
  io.U32(m.chunks, "chunks");
  io.List(m.slots, "credit slots", Limit{.max = kMaxCreditSlots, .min_bytes = 4},
          [](auto& io, auto& slot) { io.U32(slot, "slot"); });
}

template <typename Io>
void Fields(Io& io, Ref<Io, DoneMsg> m) {
  io.U64(m.request_id, "request_id");
  io.U32(m.transfer_id, "transfer_id");
  io.I64(m.bytes, "bytes");
}

template <typename Io>
void Fields(Io& io, Ref<Io, CompleteMsg> m) {
  io.U64(m.request_id, "request_id");
  io.U32(m.transfer_id, "transfer_id");
}

template <typename Io>
void Fields(Io& io, Ref<Io, ChunkMsg> m) {
  io.U64(m.request_id, "request_id");
  io.U32(m.transfer_id, "transfer_id");
  io.U32(m.chunk, "chunk");
  io.U32(m.count, "chunk count");
  io.Check(m.count != 0 && m.count <= kMaxCreditSlots, [&] {
    return fmt::format("chunk count {} is 0 or exceeds {}", m.count, kMaxCreditSlots);
  });
  uint8_t flags = (m.has_checksum ? kChunkHasChecksum : 0) | (m.complete ? kChunkComplete : 0);
  io.U8(flags, "chunk flags");
  io.Check((flags & ~(kChunkHasChecksum | kChunkComplete)) == 0,
           [&] { return fmt::format("chunk flags {:#x} has unknown bits", flags); });
  io.Check(flags != (kChunkHasChecksum | kChunkComplete),
           [] { return std::string("a chunk that says complete carries no checksum"); });
  io.Set(m.has_checksum, (flags & kChunkHasChecksum) != 0);
  io.Set(m.complete, (flags & kChunkComplete) != 0);
  io.U64(m.checksum, "checksum");
}

template <typename Io>
void Fields(Io& io, Ref<Io, SiblingMsg> m) {
  io.U64(m.request_id, "request_id");
  io.Fixed(m.token, "token");
  io.I32(m.ctx_rank, "ctx_rank");
  io.U8(m.code, "code");
  io.Str(m.reason, "reason", kMaxText);
  io.Check(m.ctx_rank >= 0, [&] { return fmt::format("ctx_rank {} is negative", m.ctx_rank); });
}

void WriteBody(WireWriter& w, const ControlMsg& msg) {
  std::visit(
      [&w](const auto& m) {
        FieldWriter io(w);
        Fields(io, m);
      },
      msg);
}

// The body of a message of type index + 1, after its header.
template <size_t index>
ControlMsg ReadBody(WireReader& r) {
  std::variant_alternative_t<index, ControlMsg> m;
  FieldReader io(r);
  Fields(io, m);
  return m;
}
template <size_t... index>
constexpr auto BodyReaders(std::index_sequence<index...>) {
  return std::array<ControlMsg (*)(WireReader&), sizeof...(index)>{&ReadBody<index>...};
}
constexpr auto kBodyReaders =
    BodyReaders(std::make_index_sequence<std::variant_size_v<ControlMsg>>());

struct Header {
  uint16_t magic = 0;
  uint8_t version = 0;
  uint8_t type = 0;
};

// Magic, version and seal: a message of a version `accept` holds, arrived as sent. `body` is what
// the seal covers (the header and the fields).
Status CheckEnvelope(std::span<const std::byte> sealed, std::span<const std::byte> body,
                     const Header& h, VersionRange accept) {
  if (h.magic != kMessageMagic) {
    return Status::InvalidArgument(fmt::format("control message: bad magic {:#06x}", h.magic));
  }
  if (!accept.Has(h.version)) {
    return Status::InvalidArgument(
        fmt::format("control message: version {}; this rank speaks {}..{}", h.version,
                    accept.oldest, accept.newest));
  }
  uint64_t seal = 0;
  for (size_t i = 0; i < kMessageSealBytes; ++i)
    seal |= uint64_t{std::to_integer<uint8_t>(sealed[body.size() + i])} << (8 * i);
  if (const uint64_t sum = MessageSeal(body); sum != seal) {
    return Status::DataLoss(fmt::format(
        "control message (type {}): seal {:#018x} does not match its bytes ({:#018x}): corrupted",
        h.type, seal, sum));
  }
  return Status::Ok();
}

}  // namespace
}  // namespace wire

// The seal: a FETCH, CREDIT or CHUNK changed on the way would otherwise direct puts to where the
// generation rank never said (a FETCH's layout or target decides where a context rank writes).
uint64_t MessageSeal(std::span<const std::byte> body) {
  return XXH3_64bits(body.data(), body.size());
}

namespace {
std::vector<std::byte> Sealed(WireWriter& w) {
  std::vector<std::byte> out = w.Take();
  const uint64_t seal = MessageSeal(out);
  for (size_t i = 0; i < kMessageSealBytes; ++i) out.push_back(std::byte((seal >> (8 * i)) & 0xff));
  return out;
}
}  // namespace

std::vector<std::byte> EncodeMessage(const ControlMsg& msg, uint8_t version) {
  WireWriter w;
  w.U16(kMessageMagic);
  w.U8(version);
  w.U8(static_cast<uint8_t>(msg.index() + 1));
  wire::WriteBody(w, msg);
  return Sealed(w);
}

uint8_t MessageVersionOf(std::span<const std::byte> bytes) {
  if (bytes.size() < 4) return 0;
  const uint16_t magic = std::to_integer<uint16_t>(bytes[0]) |
                         static_cast<uint16_t>(std::to_integer<uint16_t>(bytes[1]) << 8);
  return magic == kMessageMagic ? std::to_integer<uint8_t>(bytes[2]) : 0;
}

std::vector<std::byte> EncodeVersionMsg(VersionRange speaks) {
  WireWriter w;
  w.U16(kMessageMagic);
  w.U8(speaks.newest);
  w.U8(kVersionMsgType);
  w.U8(speaks.oldest);
  return Sealed(w);
}

bool IsVersionMsg(std::span<const std::byte> bytes) {
  return MessageVersionOf(bytes) != 0 && std::to_integer<uint8_t>(bytes[3]) == kVersionMsgType;
}

StatusOr<VersionRange> DecodeVersionMsg(std::span<const std::byte> sealed) {
  constexpr size_t kBytes = 5 + kMessageSealBytes;
  if (sealed.size() != kBytes || !IsVersionMsg(sealed)) {
    return Status::InvalidArgument(
        fmt::format("VERSION message: {} bytes, not a VERSION of {} bytes", sealed.size(), kBytes));
  }
  const std::span<const std::byte> body = sealed.first(5);
  uint64_t seal = 0;
  for (size_t i = 0; i < kMessageSealBytes; ++i)
    seal |= uint64_t{std::to_integer<uint8_t>(sealed[body.size() + i])} << (8 * i);
  if (MessageSeal(body) != seal) {
    return Status::DataLoss("VERSION message: seal does not match its bytes: corrupted");
  }
  VersionRange v{std::to_integer<uint8_t>(body[4]), std::to_integer<uint8_t>(body[2])};
  if (v.oldest == 0 || v.oldest > v.newest) {
    return Status::InvalidArgument(
        fmt::format("VERSION message: oldest {} is 0 or above version {}", v.oldest, v.newest));
  }
  return v;
}

StatusOr<ControlMsg> DecodeMessage(std::span<const std::byte> sealed, VersionRange accept) {
  if (sealed.size() < 4 + kMessageSealBytes) {
    return Status::InvalidArgument(
        fmt::format("control message: {} bytes, fewer than a header and its seal", sealed.size()));
  }
  const std::span<const std::byte> body = sealed.first(sealed.size() - kMessageSealBytes);
  WireReader r(body);
  wire::Header h;
  h.magic = r.U16("magic");
  h.version = r.U8("version");
  h.type = r.U8("type");
  KVF_RETURN_IF_ERROR(wire::CheckEnvelope(sealed, body, h, accept));
  if (h.type < 1 || h.type > wire::kBodyReaders.size()) {
    return Status::InvalidArgument(fmt::format("control message: unknown type {}", h.type));
  }
  ControlMsg out = wire::kBodyReaders[h.type - 1](r);
  if (r.ok() && r.remaining() != 0) r.Fail(fmt::format("{} trailing bytes", r.remaining()));
  if (!r.ok()) return r.status().WithContext("control message");
  return out;
}

Status PeerStatus(uint8_t code, std::string message) {
  if (code == 0 || code > static_cast<uint8_t>(StatusCode::kResourceExhausted)) {
    return Status::Internal(
        fmt::format("peer reported status code {} (not a failure code): {}", code, message));
  }
  return Status(static_cast<StatusCode>(code), std::move(message));
}

}  // namespace kvferry
