// The context handle: what a context instance hands back when a request's KV is ready, and what
// a generation instance needs to fetch it. Versioned bytes, documented in docs/wire_format.md.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kvferry/kv_model.h"
#include "kvferry/status.h"

namespace kvferry {

inline constexpr uint32_t kHandleMagic = 0x4846564B;  // "KVFH" little-endian
inline constexpr uint16_t kHandleVersion = 1;

using AccessToken = std::array<uint8_t, 16>;

struct ContextHandle {
  uint64_t request_id = 0;
  AccessToken token{};
  KvShape shape;
  ParallelConfig parallel;  // dp_rank: the DP group that served the request
  LayoutKind layout = LayoutKind::kBlockMajor;
  int64_t pool_blocks = 0;
  int64_t prompt_tokens = 0;
  bool layer_wise = false;  // flag bit 0: layers become ready one by one; plan one layer per piece
  bool ctx_direct = true;   // flag bit 1: the context can send chunks straight from its pool
  int64_t chunk_bytes = 0;  // the context's staging chunk size: the largest packed chunk it sends
  std::vector<int64_t> blocks;
  std::vector<std::string> addresses;  // transport address of every context rank

  bool operator==(const ContextHandle&) const = default;
};

std::vector<std::byte> EncodeHandle(const ContextHandle& handle);
// Refuses malformed, truncated or corrupted bytes and unknown versions with kInvalidArgument
// (kDataLoss for a checksum mismatch), naming what was wrong.
StatusOr<ContextHandle> DecodeHandle(std::span<const std::byte> bytes);

// The access token of a request: a keyed hash of the instance secret and what the handle
// promises (request id, blocks, tokens), so a handle altered or made up elsewhere is refused.
AccessToken MakeAccessToken(const std::array<uint8_t, 16>& secret, uint64_t request_id,
                            std::span<const int64_t> blocks, int64_t prompt_tokens);
// A SIBLING's token (messages.h): XXH3-128 keyed by the instance secret over the request's access
// token, the sending context rank and its code. Only a rank holding the secret can make it; a
// generation instance holds the access token, not the secret.
AccessToken MakeSiblingToken(const std::array<uint8_t, 16>& secret, const AccessToken& request,
                             int32_t ctx_rank, uint8_t code);

class WireWriter;
class WireReader;
// Shared with the control messages.
void EncodeShape(WireWriter& w, const KvShape& s);
KvShape DecodeShape(WireReader& r);
void EncodeParallel(WireWriter& w, const ParallelConfig& p);
ParallelConfig DecodeParallel(WireReader& r);
LayoutKind DecodeLayout(WireReader& r);
void EncodeBlocks(WireWriter& w, const std::vector<int64_t>& blocks);
std::vector<int64_t> DecodeBlocks(WireReader& r);

}  // namespace kvferry
