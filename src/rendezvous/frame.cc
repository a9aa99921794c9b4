#include "rendezvous/frame.h"

#include <fmt/format.h>

#include <algorithm>

#include "base/siphash.h"
#include "base/wire.h"

namespace kvferry::rendezvous {
namespace {

std::array<std::byte, kTagBytes> Tag(std::span<const std::byte> bytes, const RendezvousKey& key,
                                     const Context& context) {
  SipHash128 mac(key);
  mac.Update(context.client);
  mac.Update(context.server);
  mac.Update(bytes);
  return mac.Finish();
}

bool Verifies(std::span<const std::byte> signed_bytes, std::span<const std::byte> tag,
              const RendezvousKey& key, const Context& context) {
  const auto expected = Tag(signed_bytes, key, context);
  uint8_t diff = 0;  // constant time: a timing oracle would leak the tag byte by byte
  for (size_t i = 0; i < kTagBytes; ++i) {
    diff |= static_cast<uint8_t>(tag[i] ^ expected[i]);
  }
  return diff == 0;
}

bool KnownType(uint8_t t) {
  switch (static_cast<FrameType>(t)) {
    case FrameType::kPut:
    case FrameType::kGet:
    case FrameType::kErase:
    case FrameType::kWait:
    case FrameType::kHello:
    case FrameType::kOk:
    case FrameType::kNotFound:
    case FrameType::kRefused:
    case FrameType::kChallenge:
      return true;
  }
  return false;
}

bool HasKey(FrameType t) {
  return t == FrameType::kPut || t == FrameType::kGet || t == FrameType::kErase ||
         t == FrameType::kWait;
}

bool HasNonce(FrameType t) { return t == FrameType::kHello || t == FrameType::kChallenge; }

Status CheckKey(const std::string& key) {
  if (key.empty() || key.size() > kMaxRendezvousKeyBytes) {
    return Status::InvalidArgument(fmt::format("rendezvous key of {} bytes: must be 1..{}",
                                               key.size(), kMaxRendezvousKeyBytes));
  }
  for (char c : key) {
    if (c < 0x21 || c > 0x7e) {
      return Status::InvalidArgument(
          fmt::format("rendezvous key '{}' has a byte 0x{:02x} that is not printable", key,
                      static_cast<uint8_t>(c)));
    }
  }
  return Status::Ok();
}

// The body's fields into `frame` (its type set); kInvalidArgument naming a malformed field.
Status DecodeBody(std::span<const std::byte> body, Frame& frame) {
  WireReader r(body);
  if (HasKey(frame.type)) frame.key = r.Str("key", kMaxRendezvousKeyBytes);
  size_t end = r.position();
  if (r.ok() && (frame.type == FrameType::kPut || frame.type == FrameType::kOk)) {
    const uint32_t n = r.Count("value length", kMaxRendezvousValueBytes);
    if (r.ok() && r.remaining() < n) r.Fail(fmt::format("value of {} bytes is truncated", n));
    if (r.ok()) {
      const auto value = body.subspan(r.position(), n);
      frame.value.assign(value.begin(), value.end());
    }
    end = r.position() + (r.ok() ? n : 0);
  }
  if (r.ok() && frame.type == FrameType::kRefused) {
    frame.reason = r.Str("reason", kMaxBodyBytes);
    end = r.position();
  }
  if (r.ok() && frame.type == FrameType::kWait) {
    frame.wait_ms = r.U32("wait_ms");
    if (r.ok() && frame.wait_ms > kMaxWaitMs) {
      r.Fail(fmt::format("wait of {} ms exceeds {}", frame.wait_ms, kMaxWaitMs));
    }
    end = r.position();
  }
  if (r.ok() && HasNonce(frame.type)) {
    if (r.remaining() < kNonceBytes) r.Fail("nonce is truncated");
    if (r.ok()) std::copy_n(body.begin() + r.position(), kNonceBytes, frame.nonce.begin());
    end = r.position() + kNonceBytes;
  }
  if (!r.ok()) return r.status();
  if (end != body.size()) {
    return Status::InvalidArgument(
        fmt::format("rendezvous frame has {} trailing body bytes", body.size() - end));
  }
  if (HasKey(frame.type)) KVF_RETURN_IF_ERROR(CheckKey(frame.key));
  return Status::Ok();
}

}  // namespace

std::vector<std::byte> EncodeFrame(const Frame& frame, const RendezvousKey& key,
                                   const Context& context, bool sign) {
  WireWriter body;
  if (HasKey(frame.type)) body.Str(frame.key);
  if (frame.type == FrameType::kPut || frame.type == FrameType::kOk) body.Bytes(frame.value);
  if (frame.type == FrameType::kRefused) body.Str(frame.reason);
  if (frame.type == FrameType::kWait) body.U32(frame.wait_ms);
  if (HasNonce(frame.type)) {
    body.buffer().insert(body.buffer().end(), frame.nonce.begin(), frame.nonce.end());
  }
  WireWriter w;
  w.U32(kFrameMagic);
  w.U16(kFrameVersion);
  w.U8(static_cast<uint8_t>(frame.type));
  w.U8(0);
  w.U32(static_cast<uint32_t>(body.size()));
  w.U64(frame.sequence);
  std::vector<std::byte> out = w.Take();
  std::array<std::byte, kTagBytes> tag{};
  if (sign) tag = Tag(out, key, context);
  out.insert(out.end(), tag.begin(), tag.end());
  out.insert(out.end(), body.buffer().begin(), body.buffer().end());
  if (sign) tag = Tag(out, key, context);
  out.insert(out.end(), tag.begin(), tag.end());
  return out;
}

std::vector<std::byte> EncodeVersion1Refusal(std::string_view reason) {
  WireWriter body;
  body.Str(reason);
  WireWriter w;
  w.U32(kFrameMagic);
  w.U16(1);
  w.U8(static_cast<uint8_t>(FrameType::kRefused));
  w.U8(0);
  w.U32(static_cast<uint32_t>(body.size()));
  std::vector<std::byte> out = w.Take();
  out.insert(out.end(), body.buffer().begin(), body.buffer().end());
  out.resize(out.size() + 16);  // version 1's tag, zero: unsigned
  return out;
}

Status CheckVersion(std::span<const std::byte> prefix) {
  WireReader r(prefix.first(std::min(prefix.size(), kVersionBytes)));
  if (prefix.size() >= 4) {
    const uint32_t magic = r.U32("magic");
    if (magic != kFrameMagic) {
      return Status::InvalidArgument(fmt::format(
          "not a rendezvous frame: magic 0x{:08x}, expected 0x{:08x}", magic, kFrameMagic));
    }
  }
  if (prefix.size() >= kVersionBytes) {
    const uint16_t version = r.U16("version");
    if (version != kFrameVersion) {
      return Status::InvalidArgument(fmt::format(
          "rendezvous frame version {}; this kvferry speaks {} (run one kvferry version across "
          "the deployment)",
          version, kFrameVersion));
    }
  }
  return Status::Ok();
}

StatusOr<Header> ParseHeader(std::span<const std::byte> header) {
  if (header.size() < kHeaderBytes) {
    return Status::InvalidArgument(
        fmt::format("rendezvous frame header of {} bytes: needs {}", header.size(), kHeaderBytes));
  }
  KVF_RETURN_IF_ERROR(CheckVersion(header));
  WireReader r(header.first(kHeaderBytes));
  r.U32("magic");
  r.U16("version");
  const uint8_t type = r.U8("type");
  const uint8_t reserved = r.U8("reserved");
  const uint32_t length = r.U32("body length");
  const uint64_t sequence = r.U64("sequence");
  if (reserved != 0) {
    return Status::InvalidArgument(
        fmt::format("rendezvous frame reserved byte is 0x{:02x}, not 0", reserved));
  }
  if (!KnownType(type)) {
    return Status::InvalidArgument(fmt::format("rendezvous frame type 0x{:02x} is unknown", type));
  }
  if (length > kMaxBodyBytes) {
    return Status::InvalidArgument(
        fmt::format("rendezvous frame body of {} bytes exceeds {}", length, kMaxBodyBytes));
  }
  if (HasNonce(static_cast<FrameType>(type)) && length != kNonceBytes) {
    return Status::InvalidArgument(
        fmt::format("rendezvous greeting body of {} bytes: a nonce is {}", length, kNonceBytes));
  }
  return Header{static_cast<FrameType>(type), length, sequence};
}

StatusOr<Header> VerifyHeader(std::span<const std::byte> sealed, const RendezvousKey& key,
                              const Context& context) {
  KVF_ASSIGN_OR_RETURN(Header header, ParseHeader(sealed));
  if (sealed.size() < kSealedHeaderBytes) {
    return Status::InvalidArgument(fmt::format("rendezvous sealed header of {} bytes: needs {}",
                                               sealed.size(), kSealedHeaderBytes));
  }
  if (!Verifies(sealed.first(kHeaderBytes), sealed.subspan(kHeaderBytes, kTagBytes), key,
                context)) {
    return Status::InvalidArgument(
        "rendezvous frame not signed with this group's key for this connection (another key, "
        "another deployment, or a frame replayed from another connection)");
  }
  return header;
}

StatusOr<Frame> DecodeFrame(std::span<const std::byte> bytes, const RendezvousKey& key,
                            const Context& context) {
  KVF_ASSIGN_OR_RETURN(Header header, ParseHeader(bytes));
  if (bytes.size() != header.frame_bytes()) {
    return Status::InvalidArgument(
        fmt::format("rendezvous frame of {} bytes; its header announces {}", bytes.size(),
                    header.frame_bytes()));
  }
  Frame frame;
  frame.type = header.type;
  frame.sequence = header.sequence;
  const auto body = bytes.subspan(kSealedHeaderBytes, header.body_bytes);
  const bool verifies =
      Verifies(bytes.first(kHeaderBytes), bytes.subspan(kHeaderBytes, kTagBytes), key, context) &&
      Verifies(bytes.first(bytes.size() - kTagBytes), bytes.last(kTagBytes), key, context);
  if (!verifies) {
    if (frame.type == FrameType::kRefused) {
      WireReader r(body);
      const std::string reason = r.Str("reason", kMaxBodyBytes);
      return Status::InvalidArgument(
          fmt::format("the rendezvous refused us unsigned{}{} (it holds another group key)",
                      r.ok() ? ": " : "", r.ok() ? reason : ""));
    }
    return Status::InvalidArgument(
        "rendezvous frame not signed with this group's key for this connection (a stale key, "
        "another deployment, or a frame replayed from another connection)");
  }
  KVF_RETURN_IF_ERROR(DecodeBody(body, frame));
  return frame;
}

}  // namespace kvferry::rendezvous
