#include "rendezvous/frame.h"

#include <fmt/format.h>
#include <xxhash.h>

#include <algorithm>
#include <cstring>

#include "base/wire.h"

namespace kvferry::rendezvous {
namespace {

std::array<std::byte, kTagBytes> Tag(std::span<const std::byte> signed_bytes,
                                     const RendezvousKey& key) {
  XXH3_state_t* state = XXH3_createState();
  XXH3_128bits_reset_withSeed(state, 0x6b7666722d72763aULL);
  XXH3_128bits_update(state, key.data(), key.size());
  XXH3_128bits_update(state, signed_bytes.data(), signed_bytes.size());
  XXH3_128bits_update(state, key.data(), key.size());
  XXH128_hash_t h = XXH3_128bits_digest(state);
  XXH3_freeState(state);
  std::array<std::byte, kTagBytes> out;
  for (int i = 0; i < 8; ++i) {
    out[i] = static_cast<std::byte>(h.low64 >> (8 * i));
    out[8 + i] = static_cast<std::byte>(h.high64 >> (8 * i));
  }
  return out;
}

bool KnownType(uint8_t t) {
  switch (static_cast<FrameType>(t)) {
    case FrameType::kPut:
    case FrameType::kGet:
    case FrameType::kErase:
    case FrameType::kWait:
    case FrameType::kOk:
    case FrameType::kNotFound:
    case FrameType::kRefused:
      return true;
  }
  return false;
}

bool HasKey(FrameType t) {
  return t == FrameType::kPut || t == FrameType::kGet || t == FrameType::kErase ||
         t == FrameType::kWait;
}

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

}  // namespace

std::vector<std::byte> EncodeFrame(const Frame& frame, const RendezvousKey& key, bool sign) {
  WireWriter body;
  if (HasKey(frame.type)) body.Str(frame.key);
  if (frame.type == FrameType::kPut || frame.type == FrameType::kOk) body.Bytes(frame.value);
  if (frame.type == FrameType::kRefused) body.Str(frame.reason);
  if (frame.type == FrameType::kWait) body.U32(frame.wait_ms);
  WireWriter w;
  w.U32(kFrameMagic);
  w.U16(kFrameVersion);
  w.U8(static_cast<uint8_t>(frame.type));
  w.U8(0);
  w.U32(static_cast<uint32_t>(body.size()));
  std::vector<std::byte> out = w.Take();
  out.insert(out.end(), body.buffer().begin(), body.buffer().end());
  std::array<std::byte, kTagBytes> tag{};
  if (sign) tag = Tag(out, key);
  out.insert(out.end(), tag.begin(), tag.end());
  return out;
}

StatusOr<size_t> DecodeHeader(std::span<const std::byte> header) {
  if (header.size() < kHeaderBytes) {
    return Status::InvalidArgument(
        fmt::format("rendezvous frame header of {} bytes: needs {}", header.size(), kHeaderBytes));
  }
  WireReader r(header.first(kHeaderBytes));
  const uint32_t magic = r.U32("magic");
  const uint16_t version = r.U16("version");
  const uint8_t type = r.U8("type");
  r.U8("reserved");
  const uint32_t length = r.U32("body length");
  if (magic != kFrameMagic) {
    return Status::InvalidArgument(fmt::format(
        "not a rendezvous frame: magic 0x{:08x}, expected 0x{:08x}", magic, kFrameMagic));
  }
  if (version != kFrameVersion) {
    return Status::InvalidArgument(
        fmt::format("rendezvous frame version {}; this kvferry speaks {}", version, kFrameVersion));
  }
  if (!KnownType(type)) {
    return Status::InvalidArgument(fmt::format("rendezvous frame type 0x{:02x} is unknown", type));
  }
  if (length > kMaxBodyBytes) {
    return Status::InvalidArgument(
        fmt::format("rendezvous frame body of {} bytes exceeds {}", length, kMaxBodyBytes));
  }
  return static_cast<size_t>(length);
}

StatusOr<Frame> DecodeFrame(std::span<const std::byte> bytes, const RendezvousKey& key) {
  KVF_ASSIGN_OR_RETURN(size_t length, DecodeHeader(bytes));
  if (bytes.size() != kHeaderBytes + length + kTagBytes) {
    return Status::InvalidArgument(
        fmt::format("rendezvous frame of {} bytes; its header announces {}", bytes.size(),
                    kHeaderBytes + length + kTagBytes));
  }
  Frame frame;
  frame.type = static_cast<FrameType>(static_cast<uint8_t>(bytes[6]));
  const auto signed_bytes = bytes.first(kHeaderBytes + length);
  const auto tag = bytes.last(kTagBytes);
  const auto expected = Tag(signed_bytes, key);
  if (!std::equal(tag.begin(), tag.end(), expected.begin())) {
    if (frame.type == FrameType::kRefused) {
      WireReader r(bytes.subspan(kHeaderBytes, length));
      const std::string reason = r.Str("reason", kMaxBodyBytes);
      return Status::InvalidArgument(
          fmt::format("the rendezvous refused us unsigned{}{} (it holds another group key)",
                      r.ok() ? ": " : "", r.ok() ? reason : ""));
    }
    return Status::InvalidArgument(
        "rendezvous frame not signed with this group's key (a stale key, or another deployment)");
  }
  const auto body = bytes.subspan(kHeaderBytes, length);
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
  if (!r.ok()) return r.status();
  if (end != body.size()) {
    return Status::InvalidArgument(
        fmt::format("rendezvous frame has {} trailing body bytes", body.size() - end));
  }
  if (HasKey(frame.type)) KVF_RETURN_IF_ERROR(CheckKey(frame.key));
  return frame;
}

}  // namespace kvferry::rendezvous
