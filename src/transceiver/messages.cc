#include "transceiver/messages.h"

#include <fmt/format.h>
#include <xxhash.h>

#include "base/wire.h"

namespace kvferry {
namespace {

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
// CHUNK flags.
constexpr uint8_t kChunkHasChecksum = 1;
constexpr uint8_t kChunkComplete = 2;

constexpr uint32_t kMaxKeyBytes = 1 << 12;
constexpr uint32_t kMaxRegions = 1 << 16;
constexpr uint32_t kMaxCreditSlots = 1 << 20;

void EncodeRegion(WireWriter& w, const RemoteRegion& r) {
  w.U64(r.address);
  w.U64(r.bytes);
  w.U32(static_cast<uint32_t>(r.rkey.size()));
  for (std::byte b : r.rkey) w.U8(std::to_integer<uint8_t>(b));
}

RemoteRegion DecodeRegion(WireReader& r) {
  RemoteRegion g;
  g.address = r.U64("region address");
  g.bytes = r.U64("region bytes");
  const uint32_t n = r.U32("rkey length");
  if (!r.ok()) return g;
  if (n > kMaxKeyBytes || n > r.remaining()) {
    r.Fail(fmt::format("rkey length {} exceeds {} or the {} bytes left", n, kMaxKeyBytes,
                       r.remaining()));
    return g;
  }
  g.rkey.resize(n);
  for (auto& b : g.rkey) b = std::byte{r.U8("rkey")};
  return g;
}

void Header(WireWriter& w, MsgType t) {
  w.U16(kMessageMagic);
  w.U8(kMessageVersion);
  w.U8(t);
}

struct Encoder {
  WireWriter& w;
  void operator()(const FetchMsg& m) {
    Header(w, kFetch);
    w.U64(m.request_id);
    for (uint8_t b : m.token) w.U8(b);
    for (uint8_t b : m.handle_digest) w.U8(b);
    w.U64(m.gen_instance);
    w.I32(m.gen_rank);
    w.U32(m.transfer_id);
    EncodeShape(w, m.shape);
    EncodeParallel(w, m.parallel);
    w.U8(static_cast<uint8_t>(m.layout));
    w.I64(m.pool_blocks);
    w.I64(m.prompt_tokens);
    w.I64(m.reused_blocks);
    w.I64(m.chunk_bytes);
    w.I64(m.direct_min_bytes);
    EncodeBlocks(w, m.blocks);
    w.Str(m.reply_address);
    w.U8(static_cast<uint8_t>((m.rma ? 1 : 0) | (m.checksum ? 2 : 0) |
                              (m.rma && !m.rma_target.peer_pool.empty() ? 4 : 0)));
    if (m.rma) {
      const RmaTarget& t = m.rma_target;
      w.U32(static_cast<uint32_t>(t.pool.size()));
      for (const RemoteRegion& g : t.pool) EncodeRegion(w, g);
      EncodeRegion(w, t.staging);
      w.I64(t.slot_bytes);
      w.U32(t.slots);
      w.I64(t.row_min_bytes);
      if (!t.peer_pool.empty()) {
        w.U32(static_cast<uint32_t>(t.peer_pool.size()));
        for (const auto& h : t.peer_pool) {
          w.U32(static_cast<uint32_t>(h.size()));
          for (std::byte b : h) w.U8(std::to_integer<uint8_t>(b));
        }
      }
    }
  }
  void operator()(const AcceptMsg& m) {
    Header(w, kAccept);
    w.U64(m.request_id);
    w.U32(m.transfer_id);
    w.U8(m.peer_memory ? 2 : m.rma ? 1 : 0);
  }
  void operator()(const ChunkMsg& m) {
    Header(w, kChunk);
    w.U64(m.request_id);
    w.U32(m.transfer_id);
    w.U32(m.chunk);
    w.U32(m.count);
    w.U8(static_cast<uint8_t>((m.has_checksum ? kChunkHasChecksum : 0) |
                              (m.complete ? kChunkComplete : 0)));
    w.U64(m.checksum);
  }
  void operator()(const RejectMsg& m) {
    Header(w, kReject);
    w.U64(m.request_id);
    w.U32(m.transfer_id);
    w.U8(m.code);
    w.Str(m.reason);
  }
  void operator()(const CreditMsg& m) {
    Header(w, kCredit);
    w.U64(m.request_id);
    w.U32(m.transfer_id);
    w.U32(m.chunks);
    w.U32(static_cast<uint32_t>(m.slots.size()));
    for (uint32_t slot : m.slots) w.U32(slot);
  }
  void operator()(const DoneMsg& m) {
    Header(w, kDone);
    w.U64(m.request_id);
    w.U32(m.transfer_id);
    w.I64(m.bytes);
  }
  void operator()(const CompleteMsg& m) {
    Header(w, kComplete);
    w.U64(m.request_id);
    w.U32(m.transfer_id);
  }
  void operator()(const SiblingMsg& m) {
    Header(w, kSibling);
    w.U64(m.request_id);
    for (auto b : m.token) w.U8(b);
    w.I32(m.ctx_rank);
    w.U8(m.code);
    w.Str(m.reason);
  }
  void operator()(const AbortMsg& m) {
    Header(w, kAbort);
    w.U64(m.request_id);
    w.U32(m.transfer_id);
    w.U8(m.code);
    w.Str(m.reason);
  }
};

}  // namespace

// The seal: a FETCH, CREDIT or CHUNK changed on the way would otherwise direct puts to where the
// generation rank never said (a FETCH's layout or target decides where a context rank writes).
uint64_t MessageSeal(std::span<const std::byte> body) {
  return XXH3_64bits(body.data(), body.size());
}

std::vector<std::byte> EncodeMessage(const ControlMsg& msg) {
  WireWriter w;
  std::visit(Encoder{w}, msg);
  std::vector<std::byte> out = w.Take();
  const uint64_t seal = MessageSeal(out);
  for (size_t i = 0; i < kMessageSealBytes; ++i) out.push_back(std::byte((seal >> (8 * i)) & 0xff));
  return out;
}

StatusOr<ControlMsg> DecodeMessage(std::span<const std::byte> sealed) {
  if (sealed.size() < 4 + kMessageSealBytes) {
    return Status::InvalidArgument(
        fmt::format("control message: {} bytes, fewer than a header and its seal", sealed.size()));
  }
  const std::span<const std::byte> bytes = sealed.first(sealed.size() - kMessageSealBytes);
  uint64_t seal = 0;
  for (size_t i = 0; i < kMessageSealBytes; ++i)
    seal |= uint64_t{std::to_integer<uint8_t>(sealed[bytes.size() + i])} << (8 * i);
  WireReader r(bytes);
  uint16_t magic = r.U16("magic");
  uint8_t version = r.U8("version");
  uint8_t type = r.U8("type");
  if (!r.ok()) return r.status().WithContext("control message");
  if (magic != kMessageMagic) {
    return Status::InvalidArgument(fmt::format("control message: bad magic {:#06x}", magic));
  }
  if (version != kMessageVersion) {
    return Status::InvalidArgument(
        fmt::format("control message: version {} not supported", version));
  }
  if (const uint64_t sum = MessageSeal(bytes); sum != seal) {
    return Status::DataLoss(fmt::format(
        "control message (type {}): seal {:#018x} does not match its bytes ({:#018x}): corrupted",
        type, seal, sum));
  }
  ControlMsg out;
  switch (type) {
    case kFetch: {
      FetchMsg m;
      m.request_id = r.U64("request_id");
      for (auto& b : m.token) b = r.U8("token");
      for (auto& b : m.handle_digest) b = r.U8("handle_digest");
      m.gen_instance = r.U64("gen_instance");
      m.gen_rank = r.I32("gen_rank");
      m.transfer_id = r.U32("transfer_id");
      m.shape = DecodeShape(r);
      m.parallel = DecodeParallel(r);
      m.layout = DecodeLayout(r);
      m.pool_blocks = r.I64("pool_blocks");
      m.prompt_tokens = r.I64("prompt_tokens");
      m.reused_blocks = r.I64("reused_blocks");
      m.chunk_bytes = r.I64("chunk_bytes");
      m.direct_min_bytes = r.I64("direct_min_bytes");
      m.blocks = DecodeBlocks(r);
      m.reply_address = r.Str("reply_address", 1 << 16);
      const uint8_t flags = r.U8("fetch flags");
      if (r.ok() && ((flags & ~7u) != 0 || (flags & 5) == 4))
        r.Fail(fmt::format("unknown fetch flags {:#x}", flags));
      m.rma = flags & 1;
      m.checksum = flags & 2;
      if (m.rma && r.ok()) {
        const uint32_t n = r.U32("rma regions");
        if (r.ok() && (n > kMaxRegions || n > r.remaining() / 20)) {
          r.Fail(fmt::format("{} rma regions exceed {} or the bytes left", n, kMaxRegions));
        }
        for (uint32_t i = 0; i < n && r.ok(); ++i) m.rma_target.pool.push_back(DecodeRegion(r));
        m.rma_target.staging = DecodeRegion(r);
        m.rma_target.slot_bytes = r.I64("slot_bytes");
        m.rma_target.slots = r.U32("slots");
        m.rma_target.row_min_bytes = r.I64("row_min_bytes");
        if ((flags & 4) && r.ok()) {
          const uint32_t k = r.U32("peer pool handles");
          // Flag 4 says handles follow: none at all is not a form the encoder writes.
          if (r.ok() && (k == 0 || k != m.rma_target.pool.size())) {
            r.Fail(
                fmt::format("{} peer pool handles for {} rma regions (flag 4 needs at least one)",
                            k, m.rma_target.pool.size()));
          }
          for (uint32_t i = 0; i < k && r.ok(); ++i) {
            const uint32_t len = r.U32("peer handle length");
            if (r.ok() && (len == 0 || len > kMaxKeyBytes || len > r.remaining())) {
              r.Fail(fmt::format("peer handle length {} is 0 or exceeds {} or the {} bytes left",
                                 len, kMaxKeyBytes, r.remaining()));
              break;
            }
            std::vector<std::byte> h(len);
            for (auto& b : h) b = static_cast<std::byte>(r.U8("peer handle"));
            m.rma_target.peer_pool.push_back(std::move(h));
          }
        }
      }
      out = std::move(m);
      break;
    }
    case kAccept: {
      AcceptMsg m;
      m.request_id = r.U64("request_id");
      m.transfer_id = r.U32("transfer_id");
      const uint8_t mode = r.U8("accept mode");
      if (r.ok() && mode > 2) r.Fail(fmt::format("unknown accept mode {}", mode));
      m.rma = mode >= 1;
      m.peer_memory = mode == 2;
      out = m;
      break;
    }
    case kReject:
    case kAbort: {
      uint64_t id = r.U64("request_id");
      uint32_t tid = r.U32("transfer_id");
      uint8_t code = r.U8("code");
      std::string reason = r.Str("reason", 1 << 16);
      if (type == kReject)
        out = RejectMsg{id, tid, code, std::move(reason)};
      else
        out = AbortMsg{id, tid, code, std::move(reason)};
      break;
    }
    case kComplete: {
      CompleteMsg m;
      m.request_id = r.U64("request_id");
      m.transfer_id = r.U32("transfer_id");
      out = m;
      break;
    }
    case kSibling: {
      SiblingMsg m;
      m.request_id = r.U64("request_id");
      for (auto& b : m.token) b = r.U8("token");
      m.ctx_rank = r.I32("ctx_rank");
      m.code = r.U8("code");
      m.reason = r.Str("reason", 1 << 16);
      if (r.ok() && m.ctx_rank < 0) r.Fail(fmt::format("ctx_rank {} is negative", m.ctx_rank));
      out = std::move(m);
      break;
    }
    case kCredit: {
      CreditMsg m;
      m.request_id = r.U64("request_id");
      m.transfer_id = r.U32("transfer_id");
      m.chunks = r.U32("chunks");
      const uint32_t n = r.U32("credit slots");
      if (r.ok() && (n > kMaxCreditSlots || n > r.remaining() / 4)) {
        r.Fail(fmt::format("{} credit slots exceed {} or the bytes left", n, kMaxCreditSlots));
      }
      for (uint32_t i = 0; i < n && r.ok(); ++i) m.slots.push_back(r.U32("slot"));
      out = std::move(m);
      break;
    }
    case kDone: {
      DoneMsg m;
      m.request_id = r.U64("request_id");
      m.transfer_id = r.U32("transfer_id");
      m.bytes = r.I64("bytes");
      out = m;
      break;
    }
    case kChunk: {
      ChunkMsg m;
      m.request_id = r.U64("request_id");
      m.transfer_id = r.U32("transfer_id");
      m.chunk = r.U32("chunk");
      m.count = r.U32("chunk count");
      if (r.ok() && (m.count == 0 || m.count > kMaxCreditSlots)) {
        r.Fail(fmt::format("chunk count {} is 0 or exceeds {}", m.count, kMaxCreditSlots));
      }
      const uint8_t flags = r.U8("chunk flags");
      if (r.ok() && (flags & ~(kChunkHasChecksum | kChunkComplete)) != 0)
        r.Fail(fmt::format("chunk flags {:#x} has unknown bits", flags));
      if (r.ok() && flags == (kChunkHasChecksum | kChunkComplete))
        r.Fail("a chunk that says complete carries no checksum");
      m.has_checksum = (flags & kChunkHasChecksum) != 0;
      m.complete = (flags & kChunkComplete) != 0;
      m.checksum = r.U64("checksum");
      out = m;
      break;
    }
    default:
      return Status::InvalidArgument(fmt::format("control message: unknown type {}", type));
  }
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
