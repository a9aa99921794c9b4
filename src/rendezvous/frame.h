// Rendezvous frames: one request or reply on the TCP rendezvous (docs/wire_format.md,
// "Rendezvous"). Pure encode/decode, shared by the server, the client and the fuzz target.
//
// Version 2 authenticates before anything is buffered and binds every frame to its connection:
// a frame is a 20-byte header (magic, version, type, body length, sequence number), a tag over
// the header, the body and a tag over all of it. Both tags are SipHash-2-4-128 under the group
// key over the connection's 32-byte context and the bytes before them. A connection opens with
// HELLO (the client's random nonce) answered by CHALLENGE (the server's random nonce); the
// context is then client nonce ‖ server nonce, and the client numbers its requests 1, 2, 3...
// (each reply carries the number of the request it answers). So a reader checks the 36-byte
// sealed header before it takes a body of up to 1 MiB, and a frame captured on one connection
// does not verify on another or twice on the same one.
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
inline constexpr uint16_t kFrameVersion = 2;
inline constexpr size_t kVersionBytes = 6;  // magic and version: all a reader needs to refuse
inline constexpr size_t kHeaderBytes = 20;  // magic, version, type, reserved, length, sequence
inline constexpr size_t kTagBytes = 16;
inline constexpr size_t kSealedHeaderBytes = kHeaderBytes + kTagBytes;
inline constexpr size_t kNonceBytes = 16;
inline constexpr uint32_t kMaxWaitMs = 2000;  // below the server's 5 s idle bound
inline constexpr size_t kMaxBodyBytes = kMaxRendezvousValueBytes + kMaxRendezvousKeyBytes + 64;
inline constexpr size_t kMaxFrameBytes = kSealedHeaderBytes + kMaxBodyBytes + kTagBytes;
// HELLO and CHALLENGE: a nonce body.
inline constexpr size_t kGreetingBytes = kSealedHeaderBytes + kNonceBytes + kTagBytes;

enum class FrameType : uint8_t {
  kPut = 1,
  kGet = 2,
  kErase = 3,
  kWait = 4,   // GET that the server holds until the key appears or wait_ms passed
  kHello = 5,  // opens a connection; body: the client's nonce
  kOk = 0x81,
  kNotFound = 0x82,
  kRefused = 0x83,    // body: the reason; unsigned when the request's tag did not verify
  kChallenge = 0x84,  // answers HELLO; body: the server's nonce
};

using Nonce = std::array<std::byte, kNonceBytes>;

// What a connection's tags cover besides the frame: all zero for HELLO, client nonce ‖ zero for
// CHALLENGE, client nonce ‖ server nonce for every frame after.
struct Context {
  Nonce client{};
  Nonce server{};
  bool operator==(const Context&) const = default;
};

struct Frame {
  FrameType type = FrameType::kGet;
  std::string key{};               // kPut, kGet, kErase, kWait
  std::vector<std::byte> value{};  // kPut; kOk answering kGet or kWait
  std::string reason{};            // kRefused
  uint32_t wait_ms = 0;            // kWait: at most kMaxWaitMs
  uint64_t sequence = 0;           // requests 1, 2, ... on a connection; a reply: its request's
  Nonce nonce{};                   // kHello, kChallenge

  bool operator==(const Frame&) const = default;
};

// The fields of a header, read but not yet authenticated.
struct Header {
  FrameType type = FrameType::kGet;
  size_t body_bytes = 0;
  uint64_t sequence = 0;
  size_t frame_bytes() const { return kSealedHeaderBytes + body_bytes + kTagBytes; }
};

// Header, header tag, body and frame tag. `sign` false leaves both tags zero (refusals of
// requests whose own tag failed: the peer holds another key and could not check ours anyway).
std::vector<std::byte> EncodeFrame(const Frame& frame, const RendezvousKey& key,
                                   const Context& context, bool sign = true);

// A REFUSED in frame version 1 (12-byte header, unsigned), so that a client of version 1 reads
// why it is refused instead of garbage.
std::vector<std::byte> EncodeVersion1Refusal(std::string_view reason);

// Magic and version from the first kVersionBytes of a frame (fewer: OK so far). A frame of
// another version is refused naming both versions.
Status CheckVersion(std::span<const std::byte> prefix);

// The header's fields (kHeaderBytes at least), checked against the magic, version, known types
// and the body bound. Not authenticated: see VerifyHeader.
StatusOr<Header> ParseHeader(std::span<const std::byte> header);

// The sealed header (kSealedHeaderBytes at least): its fields, and its tag under `key` and
// `context`. kInvalidArgument naming what failed.
StatusOr<Header> VerifyHeader(std::span<const std::byte> sealed, const RendezvousKey& key,
                              const Context& context);

// A whole frame: both tags verified under `key` and `context`, every field checked.
// kInvalidArgument for a tag that does not verify (another key, another connection, a replay)
// or malformed fields, naming them.
StatusOr<Frame> DecodeFrame(std::span<const std::byte> bytes, const RendezvousKey& key,
                            const Context& context);

}  // namespace kvferry::rendezvous
