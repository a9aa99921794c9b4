// The context handle: what a context instance hands back when a request's KV is ready, and what
// a generation instance needs to fetch it. Versioned bytes, documented in docs/wire_format.md.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "kvferry/kv_model.h"
#include "kvferry/status.h"
#include "planner/planner.h"

namespace kvferry {

inline constexpr uint32_t kHandleMagic = 0x4846564B;  // "KVFH" little-endian
// Version 2: the access token authenticates every byte of the handle (HandleToken), not only
// (request id, blocks, tokens): a handle with its layout, flags or addresses altered is refused.
inline constexpr uint16_t kHandleVersion = 2;

using AccessToken = std::array<uint8_t, 16>;
// XXH3-128 of a handle's bytes with its token and checksum left out (HandleDigestOf).
using HandleDigest = std::array<uint8_t, 16>;

// The context instance it describes (InstanceDesc: shape, parallel config, whose dp_rank is the DP
// group that served the request, layout, pool blocks) is the context side of the plan's inputs.
struct ContextHandle : InstanceDesc {
  uint64_t request_id = 0;
  AccessToken token{};
  int64_t prompt_tokens = 0;
  bool layer_wise = false;  // flag bit 0: layers become ready one by one; plan one layer per piece
  bool ctx_direct = true;   // flag bit 1: the context can send chunks straight from its pool
  int64_t chunk_bytes = 0;  // the context's staging chunk size: the largest packed chunk it sends
  std::vector<int64_t> blocks;
  std::vector<std::string> addresses;  // transport address of every context rank

  bool operator==(const ContextHandle&) const = default;
};

// The bytes of `handle` as it is (its token unchanged: tests re-encode altered handles).
std::vector<std::byte> EncodeHandle(const ContextHandle& handle);
// The bytes of `handle` with its token set to HandleToken(secret, digest of those bytes); the
// token is returned too (the context side keeps it).
std::pair<std::vector<std::byte>, AccessToken> SealHandle(ContextHandle handle,
                                                          const std::array<uint8_t, 16>& secret);
// Refuses malformed, truncated or corrupted bytes and unknown versions with kInvalidArgument
// (kDataLoss for a checksum mismatch), naming what was wrong.
StatusOr<ContextHandle> DecodeHandle(std::span<const std::byte> bytes);

// The digest of handle bytes DecodeHandle accepted: XXH3-128 of bytes [0, 16) and
// [32, size - 8) (all but the token and the checksum). A generation rank sends it in FETCH.
HandleDigest HandleDigestOf(std::span<const std::byte> handle_bytes);
// The access token of a handle: SipHash-2-4-128 keyed by the instance secret over "kvfhandl" and
// the handle's digest. A context rank recomputes it from a FETCH's digest before anything else: a
// FETCH whose token does not match came from no handle of this instance (made up, or altered:
// its digest differs) and gets no answer at all.
AccessToken HandleToken(const std::array<uint8_t, 16>& secret, const HandleDigest& digest);
// A SIBLING's token (messages.h): XXH3-128 keyed by the instance secret over the request's access
// token, the sending context rank and its code. Only a rank holding the secret can make it; a
// generation instance holds the access token, not the secret.
AccessToken MakeSiblingToken(const std::array<uint8_t, 16>& secret, const AccessToken& request,
                             int32_t ctx_rank, uint8_t code);

}  // namespace kvferry
