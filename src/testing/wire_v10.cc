// Wire version 10's control messages, written out once and frozen (wire_v10.h).
#include "testing/wire_v10.h"

#include <fmt/format.h>
#include <xxhash.h>

#include "base/wire.h"

namespace kvferry::wire_v10 {
namespace {

constexpr uint16_t kMagic = 0x4D4B;
constexpr size_t kSeal = 8;
constexpr uint32_t kMaxKey = 1 << 12;
constexpr uint32_t kMaxRegions = 1 << 16;
constexpr uint32_t kMaxSlots = 1 << 20;
constexpr uint32_t kMaxRanks = 1 << 16;
constexpr uint32_t kMaxBlocks = 1 << 24;
constexpr size_t kMaxText = 1 << 16;

// ---- encoder ----

void Blob(WireWriter& w, const std::vector<std::byte>& b) { w.Bytes(b); }

void Region(WireWriter& w, const RemoteRegion& g) {
  w.U64(g.address);
  w.U64(g.bytes);
  Blob(w, g.rkey);
}

void Fetch(WireWriter& w, const FetchMsg& m) {
  w.U64(m.request_id);
  for (uint8_t b : m.token) w.U8(b);
  for (uint8_t b : m.handle_digest) w.U8(b);
  w.U64(m.gen_instance);
  w.I32(m.gen_rank);
  w.U32(m.transfer_id);
  w.I32(m.shape.layers);
  w.I32(m.shape.kv_heads);
  w.I32(m.shape.head_dim);
  w.U8(static_cast<uint8_t>(m.shape.dtype));
  w.U8(static_cast<uint8_t>(m.shape.kv_factor));
  w.I32(m.shape.tokens_per_block);
  w.I32(m.parallel.tp);
  w.I32(m.parallel.pp);
  w.U32(static_cast<uint32_t>(m.parallel.stage_layers.size()));
  for (int32_t l : m.parallel.stage_layers) w.I32(l);
  w.I32(m.parallel.dp_size);
  w.I32(m.parallel.dp_rank);
  w.U8(static_cast<uint8_t>(m.layout));
  w.I64(m.pool_blocks);
  w.I64(m.prompt_tokens);
  w.I64(m.reused_blocks);
  w.I64(m.chunk_bytes);
  w.I64(m.direct_min_bytes);
  w.U32(static_cast<uint32_t>(m.blocks.size()));
  for (int64_t b : m.blocks) w.I64(b);
  w.Str(m.reply_address);
  const bool peer = m.rma && !m.rma_target.peer_pool.empty();
  w.U8((m.rma ? 1 : 0) | (m.checksum ? 2 : 0) | (peer ? 4 : 0));
  if (!m.rma) return;
  w.U32(static_cast<uint32_t>(m.rma_target.pool.size()));
  for (const RemoteRegion& g : m.rma_target.pool) Region(w, g);
  Region(w, m.rma_target.staging);
  w.I64(m.rma_target.slot_bytes);
  w.U32(m.rma_target.slots);
  w.I64(m.rma_target.row_min_bytes);
  if (!peer) return;
  w.U32(static_cast<uint32_t>(m.rma_target.peer_pool.size()));
  for (const auto& h : m.rma_target.peer_pool) Blob(w, h);
}

void Body(WireWriter& w, const ControlMsg& msg) {
  if (auto* f = std::get_if<FetchMsg>(&msg)) return Fetch(w, *f);
  if (auto* a = std::get_if<AcceptMsg>(&msg)) {
    w.U64(a->request_id);
    w.U32(a->transfer_id);
    w.U8(a->peer_memory ? 2 : a->rma ? 1 : 0);
  } else if (auto* j = std::get_if<RejectMsg>(&msg)) {
    w.U64(j->request_id);
    w.U32(j->transfer_id);
    w.U8(j->code);
    w.Str(j->reason);
  } else if (auto* c = std::get_if<CreditMsg>(&msg)) {
    w.U64(c->request_id);
    w.U32(c->transfer_id);
    w.U32(c->chunks);
    w.U32(static_cast<uint32_t>(c->slots.size()));
    for (uint32_t s : c->slots) w.U32(s);
  } else if (auto* d = std::get_if<DoneMsg>(&msg)) {
    w.U64(d->request_id);
    w.U32(d->transfer_id);
    w.I64(d->bytes);
  } else if (auto* b = std::get_if<AbortMsg>(&msg)) {
    w.U64(b->request_id);
    w.U32(b->transfer_id);
    w.U8(b->code);
    w.Str(b->reason);
  } else if (auto* e = std::get_if<CompleteMsg>(&msg)) {
    w.U64(e->request_id);
    w.U32(e->transfer_id);
  } else if (auto* k = std::get_if<ChunkMsg>(&msg)) {
    w.U64(k->request_id);
    w.U32(k->transfer_id);
    w.U32(k->chunk);
    w.U32(k->count);
    w.U8((k->has_checksum ? 1 : 0) | (k->complete ? 2 : 0));
    w.U64(k->checksum);
  } else if (auto* s = std::get_if<SiblingMsg>(&msg)) {
    w.U64(s->request_id);
    for (uint8_t x : s->token) w.U8(x);
    w.I32(s->ctx_rank);
    w.U8(s->code);
    w.Str(s->reason);
  }
}

// ---- decoder ----

uint32_t CountOf(WireReader& r, const char* field, uint32_t max, size_t min_bytes) {
  const uint32_t n = r.Count(field, max);
  if (r.ok() && n * min_bytes > r.remaining()) r.Fail(fmt::format("{}: too many", field));
  return r.ok() ? n : 0;
}

std::vector<std::byte> ReadBlob(WireReader& r, const char* field, bool empty_ok) {
  std::vector<std::byte> b(CountOf(r, field, kMaxKey, 1));
  if (r.ok() && b.empty() && !empty_ok) r.Fail(fmt::format("{} is empty", field));
  for (std::byte& x : b) x = std::byte{r.U8(field)};
  return b;
}

RemoteRegion ReadRegion(WireReader& r) {
  RemoteRegion g;
  g.address = r.U64("region address");
  g.bytes = r.U64("region bytes");
  g.rkey = ReadBlob(r, "rkey", true);
  return g;
}

template <size_t N>
void ReadFixed(WireReader& r, std::array<uint8_t, N>& a, const char* field) {
  for (uint8_t& b : a) b = r.U8(field);
}

FetchMsg ReadFetch(WireReader& r) {
  FetchMsg m;
  m.request_id = r.U64("request_id");
  ReadFixed(r, m.token, "token");
  ReadFixed(r, m.handle_digest, "handle_digest");
  m.gen_instance = r.U64("gen_instance");
  m.gen_rank = r.I32("gen_rank");
  m.transfer_id = r.U32("transfer_id");
  m.shape.layers = r.I32("shape.layers");
  m.shape.kv_heads = r.I32("shape.kv_heads");
  m.shape.head_dim = r.I32("shape.head_dim");
  const uint8_t dtype = r.U8("shape.dtype");
  if (r.ok() && dtype > static_cast<uint8_t>(DType::kInt8)) r.Fail("shape.dtype is unknown");
  m.shape.dtype = static_cast<DType>(dtype);
  m.shape.kv_factor = r.U8("shape.kv_factor");
  m.shape.tokens_per_block = r.I32("shape.tokens_per_block");
  m.parallel.tp = r.I32("parallel.tp");
  m.parallel.pp = r.I32("parallel.pp");
  m.parallel.stage_layers.resize(CountOf(r, "parallel.stage_layers", kMaxRanks, 4));
  for (int32_t& l : m.parallel.stage_layers) l = r.I32("parallel.stage_layers[]");
  m.parallel.dp_size = r.I32("parallel.dp_size");
  m.parallel.dp_rank = r.I32("parallel.dp_rank");
  const uint8_t layout = r.U8("layout");
  // Version 10 knew layouts 0, 1 and 3..11 (2, custom, never travels).
  if (r.ok() && (layout > 11 || layout == 2)) r.Fail(fmt::format("layout {} is unknown", layout));
  m.layout = static_cast<LayoutKind>(layout);
  m.pool_blocks = r.I64("pool_blocks");
  m.prompt_tokens = r.I64("prompt_tokens");
  m.reused_blocks = r.I64("reused_blocks");
  m.chunk_bytes = r.I64("chunk_bytes");
  m.direct_min_bytes = r.I64("direct_min_bytes");
  m.blocks.resize(CountOf(r, "blocks", kMaxBlocks, 8));
  for (int64_t& b : m.blocks) b = r.I64("blocks[]");
  m.reply_address = r.Str("reply_address", kMaxText);
  const uint8_t flags = r.U8("fetch flags");
  if (r.ok() && ((flags & ~7) != 0 || (flags & 5) == 4)) r.Fail("unknown fetch flags");
  m.rma = (flags & 1) != 0;
  m.checksum = (flags & 2) != 0;
  if (!m.rma || !r.ok()) return m;
  m.rma_target.pool.resize(CountOf(r, "rma regions", kMaxRegions, 20));
  for (RemoteRegion& g : m.rma_target.pool) g = ReadRegion(r);
  m.rma_target.staging = ReadRegion(r);
  m.rma_target.slot_bytes = r.I64("slot_bytes");
  m.rma_target.slots = r.U32("slots");
  m.rma_target.row_min_bytes = r.I64("row_min_bytes");
  if (!(flags & 4)) return m;
  m.rma_target.peer_pool.resize(CountOf(r, "peer pool handles", kMaxRegions, 5));
  for (auto& h : m.rma_target.peer_pool) h = ReadBlob(r, "peer handle", false);
  if (r.ok() && (m.rma_target.peer_pool.empty() ||
                 m.rma_target.peer_pool.size() != m.rma_target.pool.size())) {
    r.Fail("peer pool handles do not match the rma regions");
  }
  return m;
}

ControlMsg ReadBody(WireReader& r, uint8_t type) {
  switch (type) {
    case 1:
      return ReadFetch(r);
    case 2: {
      AcceptMsg a;
      a.request_id = r.U64("request_id");
      a.transfer_id = r.U32("transfer_id");
      const uint8_t mode = r.U8("accept mode");
      if (r.ok() && mode > 2) r.Fail("unknown accept mode");
      a.rma = mode >= 1;
      a.peer_memory = mode == 2;
      return a;
    }
    case 3:
    case 6: {
      const uint64_t id = r.U64("request_id");
      const uint32_t tid = r.U32("transfer_id");
      const uint8_t code = r.U8("code");
      std::string reason = r.Str("reason", kMaxText);
      if (type == 3) return RejectMsg{id, tid, code, std::move(reason)};
      return AbortMsg{id, tid, code, std::move(reason)};
    }
    case 4: {
      CreditMsg c;
      c.request_id = r.U64("request_id");
      c.transfer_id = r.U32("transfer_id");
      c.chunks = r.U32("chunks");
      c.slots.resize(CountOf(r, "credit slots", kMaxSlots, 4));
      for (uint32_t& s : c.slots) s = r.U32("slot");
      return c;
    }
    case 5: {
      DoneMsg d;
      d.request_id = r.U64("request_id");
      d.transfer_id = r.U32("transfer_id");
      d.bytes = r.I64("bytes");
      return d;
    }
    case 7: {
      CompleteMsg e;
      e.request_id = r.U64("request_id");
      e.transfer_id = r.U32("transfer_id");
      return e;
    }
    case 8: {
      ChunkMsg k;
      k.request_id = r.U64("request_id");
      k.transfer_id = r.U32("transfer_id");
      k.chunk = r.U32("chunk");
      k.count = r.U32("chunk count");
      if (r.ok() && (k.count == 0 || k.count > kMaxSlots)) r.Fail("chunk count out of range");
      const uint8_t flags = r.U8("chunk flags");
      if (r.ok() && ((flags & ~3) != 0 || flags == 3)) r.Fail("bad chunk flags");
      k.has_checksum = (flags & 1) != 0;
      k.complete = (flags & 2) != 0;
      k.checksum = r.U64("checksum");
      return k;
    }
    default: {
      SiblingMsg s;
      s.request_id = r.U64("request_id");
      ReadFixed(r, s.token, "token");
      s.ctx_rank = r.I32("ctx_rank");
      s.code = r.U8("code");
      s.reason = r.Str("reason", kMaxText);
      if (r.ok() && s.ctx_rank < 0) r.Fail("ctx_rank is negative");
      return s;
    }
  }
}

}  // namespace

std::vector<std::byte> Encode(const ControlMsg& msg) {
  WireWriter w;
  w.U16(kMagic);
  w.U8(kVersion);
  w.U8(static_cast<uint8_t>(msg.index() + 1));
  Body(w, msg);
  std::vector<std::byte> out = w.Take();
  const uint64_t seal = XXH3_64bits(out.data(), out.size());
  for (size_t i = 0; i < kSeal; ++i) out.push_back(std::byte((seal >> (8 * i)) & 0xff));
  return out;
}

StatusOr<ControlMsg> Decode(std::span<const std::byte> sealed) {
  if (sealed.size() < 4 + kSeal) return Status::InvalidArgument("control message: too short");
  const std::span<const std::byte> body = sealed.first(sealed.size() - kSeal);
  WireReader r(body);
  const uint16_t magic = r.U16("magic");
  const uint8_t version = r.U8("version");
  const uint8_t type = r.U8("type");
  if (magic != kMagic) return Status::InvalidArgument("control message: bad magic");
  if (version != kVersion) {
    return Status::InvalidArgument(
        fmt::format("control message: version {} not supported", version));
  }
  uint64_t seal = 0;
  for (size_t i = 0; i < kSeal; ++i)
    seal |= uint64_t{std::to_integer<uint8_t>(sealed[body.size() + i])} << (8 * i);
  if (XXH3_64bits(body.data(), body.size()) != seal) {
    return Status::DataLoss("control message: seal does not match its bytes");
  }
  if (type < 1 || type > 9) {
    return Status::InvalidArgument(fmt::format("control message: unknown type {}", type));
  }
  ControlMsg out = ReadBody(r, type);
  if (r.ok() && r.remaining() != 0) r.Fail(fmt::format("{} trailing bytes", r.remaining()));
  if (!r.ok()) return r.status();
  return out;
}

}  // namespace kvferry::wire_v10
