// Control messages between a generation rank and a context rank (docs/wire_format.md).
//
// Per request and (context rank, generation rank) pair:
//   gen -> ctx  FETCH   who is asking, its split and destination blocks, the access token
//   ctx -> gen  ACCEPT  or REJECT (reason)
//   gen -> ctx  CREDIT  receives are posted for chunks [0, n): the sender may send them
//   ctx -> gen  data    chunk k on data tag (transfer_id << 20 | k), after credit and readiness
//   gen -> ctx  DONE    every chunk from every context rank is in place on this generation rank
//   ctx -> gen  COMPLETE every generation rank said DONE: the whole generation instance holds the
//                        request (the context rank releases its lease; the generation rank reports
//                        complete once every context rank said COMPLETE)
//   either      ABORT   the request ended on this side (timeout, cancel, error); stop
// Completion is thus known on every rank of both instances from per-request acknowledgements,
// without any collective among the ranks of an instance.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <variant>
#include <vector>

#include "kvferry/kv_model.h"
#include "kvferry/status.h"
#include "transceiver/handle.h"

namespace kvferry {

inline constexpr uint16_t kMessageMagic = 0x4D4B;  // "KM"
inline constexpr uint8_t kMessageVersion = 1;
inline constexpr int kChunkTagBits = 20;

struct FetchMsg {
  uint64_t request_id = 0;
  AccessToken token{};
  uint64_t gen_instance = 0;
  int32_t gen_rank = 0;
  uint32_t transfer_id = 0;
  KvShape shape;
  ParallelConfig parallel;  // dp_rank: the generation DP group decoding the request
  LayoutKind layout = LayoutKind::kBlockMajor;
  int64_t pool_blocks = 0;
  int64_t prompt_tokens = 0;
  int64_t reused_blocks = 0;
  // The chunking both sides plan with, chosen by the generation rank within the context's limits
  // (the handle's chunk_bytes and direct flag): identical plans on both sides depend on it.
  int64_t chunk_bytes = 0;
  int64_t direct_min_bytes = 0;
  std::vector<int64_t> blocks;
  std::string reply_address;
  bool operator==(const FetchMsg&) const = default;
};
struct AcceptMsg {
  uint64_t request_id = 0;
  uint32_t transfer_id = 0;
  bool operator==(const AcceptMsg&) const = default;
};
struct RejectMsg {
  uint64_t request_id = 0;
  uint32_t transfer_id = 0;
  uint8_t code = 0;  // StatusCode
  std::string reason;
  bool operator==(const RejectMsg&) const = default;
};
struct CreditMsg {
  uint64_t request_id = 0;
  uint32_t transfer_id = 0;
  uint32_t chunks = 0;  // receives posted for chunks [0, chunks)
  bool operator==(const CreditMsg&) const = default;
};
struct DoneMsg {
  uint64_t request_id = 0;
  uint32_t transfer_id = 0;
  int64_t bytes = 0;
  bool operator==(const DoneMsg&) const = default;
};
struct AbortMsg {
  uint64_t request_id = 0;
  uint32_t transfer_id = 0;
  uint8_t code = 0;
  std::string reason;
  bool operator==(const AbortMsg&) const = default;
};

struct CompleteMsg {
  uint64_t request_id = 0;
  uint32_t transfer_id = 0;
  bool operator==(const CompleteMsg&) const = default;
};

using ControlMsg =
    std::variant<FetchMsg, AcceptMsg, RejectMsg, CreditMsg, DoneMsg, AbortMsg, CompleteMsg>;

std::vector<std::byte> EncodeMessage(const ControlMsg& msg);
StatusOr<ControlMsg> DecodeMessage(std::span<const std::byte> bytes);

// The failure a peer reports in a REJECT or ABORT (code byte + reason), as a Status that is never
// OK: code 0 (OK) or a code this build does not know becomes kInternal naming the code, so a
// request a peer ended always ends with a reason.
Status PeerStatus(uint8_t code, std::string message);

inline uint64_t DataTag(uint32_t transfer_id, uint64_t chunk) {
  return (uint64_t{transfer_id} << kChunkTagBits) | (chunk & ((1u << kChunkTagBits) - 1));
}

}  // namespace kvferry
