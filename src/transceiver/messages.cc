#include "transceiver/messages.h"

#include <fmt/format.h>

#include "base/wire.h"

namespace kvferry {
namespace {

enum MsgType : uint8_t { kFetch = 1, kAccept, kReject, kCredit, kDone, kAbort, kComplete };

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
  }
  void operator()(const AcceptMsg& m) {
    Header(w, kAccept);
    w.U64(m.request_id);
    w.U32(m.transfer_id);
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
  void operator()(const AbortMsg& m) {
    Header(w, kAbort);
    w.U64(m.request_id);
    w.U32(m.transfer_id);
    w.U8(m.code);
    w.Str(m.reason);
  }
};

}  // namespace

std::vector<std::byte> EncodeMessage(const ControlMsg& msg) {
  WireWriter w;
  std::visit(Encoder{w}, msg);
  return w.Take();
}

StatusOr<ControlMsg> DecodeMessage(std::span<const std::byte> bytes) {
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
  ControlMsg out;
  switch (type) {
    case kFetch: {
      FetchMsg m;
      m.request_id = r.U64("request_id");
      for (auto& b : m.token) b = r.U8("token");
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
      out = std::move(m);
      break;
    }
    case kAccept: {
      AcceptMsg m;
      m.request_id = r.U64("request_id");
      m.transfer_id = r.U32("transfer_id");
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
    case kCredit: {
      CreditMsg m;
      m.request_id = r.U64("request_id");
      m.transfer_id = r.U32("transfer_id");
      m.chunks = r.U32("chunks");
      out = m;
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
