// Rendezvous frames: one request or reply on the TCP rendezvous (docs/wire_format.md,
// "Rendezvous"). Pure encode/decode, shared by the server, the client and the fuzz target.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kvferry/rendezvous.h"
#include "kvferry/status.h"

namespace kvferry::rendezvous {

inline constexpr uint32_t kFrameMagic = 0x5246564B;  // "KVFR" little-endian
inline constexpr uint16_t kFrameVersion = 1;
inline constexpr size_t kHeaderBytes = 12;  // magic, version, type, reserved, body length
inline constexpr size_t kTagBytes = 16;
inline constexpr uint32_t kMaxWaitMs = 2000;  // below the server's 5 s idle bound
inline constexpr size_t kMaxBodyBytes = kMaxRendezvousValueBytes + kMaxRendezvousKeyBytes + 64;

enum class FrameType : uint8_t {
  kPut = 1,
  kGet = 2,
  kErase = 3,
  kWait = 4,  // GET that the server holds until the key appears or wait_ms passed
  kOk = 0x81,
  kNotFound = 0x82,
  kRefused = 0x83,  // body: the reason; unsigned when the request's tag did not verify
};

struct Frame {
  FrameType type = FrameType::kGet;
  std::string key;               // kPut, kGet, kErase
  std::vector<std::byte> value;  // kPut; kOk answering kGet
  std::string reason;            // kRefused
  uint32_t wait_ms = 0;          // kWait: at most kMaxWaitMs

  bool operator==(const Frame&) const = default;
};

// Header, body and the keyed tag over both. `sign` false leaves the tag zero (refusals of
// requests whose own tag failed: the peer holds another key and could not check ours anyway).
std::vector<std::byte> EncodeFrame(const Frame& frame, const RendezvousKey& key, bool sign = true);

// The body length announced by a header (kHeaderBytes bytes), checked against the bound and the
// magic and version; the whole frame is kHeaderBytes + length + kTagBytes.
StatusOr<size_t> DecodeHeader(std::span<const std::byte> header);

// A whole frame. kInvalidArgument for a tag that does not verify under `key` (a peer with another
// key) or malformed fields, naming them.
StatusOr<Frame> DecodeFrame(std::span<const std::byte> bytes, const RendezvousKey& key);

}  // namespace kvferry::rendezvous
