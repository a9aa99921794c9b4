// Control messages between a generation rank and a context rank (docs/wire_format.md).
//
// Per request and (context rank, generation rank) pair:
//   gen -> ctx  FETCH   who is asking, its split and destination blocks, the access token
//   ctx -> gen  ACCEPT  or REJECT (reason)
//   gen -> ctx  CREDIT  receives are posted for chunks [0, n): the sender may send them
//   ctx -> gen  data    chunk k on data tag (transfer_id << 20 | k), after credit and readiness;
//                       or, one-sided (RMA), puts into the generation pool and staging then
//   ctx -> gen  CHUNK   chunks [k, k + n) are in place (flushed), with the payload checksum when
//                       asked (one chunk per message then); the last one may say COMPLETE too
//                       (one-sided pairs without checksums: no DONE, no COMPLETE)
//   gen -> ctx  DONE    every chunk of the pair is in place (not sent for a pair whose last CHUNK
//                       says complete)
//   ctx -> ctx  SIBLING this context rank's pairs are all done (or the request failed here), to
//                       every other context rank of the DP group
//   ctx -> gen  COMPLETE every pair of the request, on every context rank, is done: the whole
//                        generation instance holds the request (the context rank releases its
//                        lease; the generation rank reports complete once every context rank it
//                        fetched from said COMPLETE, or a CHUNK saying complete)
//   either      ABORT   the request ended on this side (timeout, cancel, error); stop
// Only pairs with something to move exchange messages (version 8). Completion is thus known on
// every rank of both instances from per-request acknowledgements, without any collective.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <variant>
#include <vector>

#include "kvferry/kv_model.h"
#include "kvferry/status.h"
#include "planner/planner.h"
#include "transceiver/wire/handle.h"

namespace kvferry {

inline constexpr uint16_t kMessageMagic = 0x4D4B;  // "KM"
// Version 3: every message ends with the XXH3-64 of its bytes (kMessageSealBytes, little-endian);
// one whose seal does not match (corrupted on the way) is refused like any undecodable message.
// Version 4: peer memory (FETCH flag 4 and its handles, ACCEPT mode 2), CHUNK counts.
// Version 5: a CHUNK's checksum is the chunk digest (device/run_digest.h: XXH64 per 4 KiB segment
// of each piece, XXH3-64 of those), which a GPU computes where the bytes are; it was XXH3-64 of the
// chunk's bytes.
// Version 6: a CHUNK may say the request is complete (flags bit 1): a context rank that alone
// serves its DP group and copied every chunk into the mapped peer pools ends the pair with its last
// CHUNK, with no DONE and no COMPLETE (two messages fewer per pair).
// Version 7: ACCEPT only for pairs with chunks that do not copy into peer memory: a peer-memory
// pair's first CHUNK stands for ACCEPT mode 2, and a pair with no chunks gets no answer (its
// generation rank sends DONE once its other pairs' chunks are in place). TP2->TP4: 28 messages
// per request instead of 36.
// Version 8: only pairs with something to move exchange messages (planner.h CtxRanksToFetch; a
// context rank that sends nothing to anyone hears from the group's first generation rank). The
// context ranks of a DP group tell each other when their part is done (SIBLING) and every pair's
// last CHUNK says complete once all are (peer memory; other pairs: DONE, then COMPLETE).
// TP2->TP4 with peer memory: 10 messages per request instead of 28.
// Version 9: FETCH carries the digest of the handle the generation rank decoded (handle.h,
// HandleDigestOf) after the token, which is the instance's MAC of that digest (handle version 2):
// a context rank checks it before anything else and leaves a FETCH that fails it unanswered.
// Version 10: a one-sided pair by transport puts without checksums ends with its last CHUNK
// saying complete too, like a peer-memory pair: its puts are flushed, so the bytes are in the
// generation rank's memory (only the unpacking of staged rows, its own work, is left); no DONE, no
// COMPLETE. A 128-token request by UCX puts took the DONE -> COMPLETE round trip, two more
// wake-ups of the progress threads, on its critical path.
// Version 11: a put pair's last CHUNK whose rows came packed goes at once, not saying complete,
// while the request waits for other pairs; the pair then gets COMPLETE. The encoding is version
// 10's: only the header's version byte and this behaviour differ.
inline constexpr uint8_t kMessageVersion = 11;
// The oldest version this build still speaks to a peer (docs/wire_format.md, "Versions"): a pair
// with a peer of version 10 runs version 10's encoding and behaviour. Older peers are refused.
inline constexpr uint8_t kOldestMessageVersion = 10;
inline constexpr size_t kMessageSealBytes = 8;
inline constexpr int kChunkTagBits = 20;

// A registered region of the generation rank that a context rank may put into.
struct RemoteRegion {
  uint64_t address = 0;
  uint64_t bytes = 0;
  std::vector<std::byte> rkey;  // the transport's packed remote key
  bool operator==(const RemoteRegion&) const = default;
};

// Where a context rank puts a transfer's bytes (FETCH, when the generation rank's transport is
// one-sided): pool regions for pieces whose rows are at least row_min_bytes long, staging slots
// (credited one per chunk) for the rest, packed.
struct RmaTarget {
  std::vector<RemoteRegion> pool;  // one per pool region, in region order
  RemoteRegion staging;            // slots of slot_bytes each, back to back
  int64_t slot_bytes = 0;
  uint32_t slots = 0;
  int64_t row_min_bytes = 0;
  // Device::ExportMemory handles of the pool regions, one per region (empty: not offered). A
  // context rank of the same host that maps them copies every piece straight into the pool with
  // its own stream (ACCEPT mode peer memory): no transport, no staging.
  std::vector<std::vector<std::byte>> peer_pool;
  bool operator==(const RmaTarget&) const = default;
};

inline constexpr uint32_t kNoSlot = 0xFFFFFFFF;

// What a FETCH tells a context rank to plan with: the generation instance (InstanceDesc: shape,
// parallel config, whose dp_rank is the generation DP group decoding the request, layout, pool
// blocks) and the generation side's part of the request (planner.h PlanInput). One value: every
// generation rank of a request sends the same, and a context rank plans again only for a FETCH
// whose plan inputs differ (==) from those it planned with.
struct FetchPlanInputs : InstanceDesc {
  int64_t prompt_tokens = 0;
  int64_t reused_blocks = 0;
  // The chunking both sides plan with, chosen by the generation rank within the context's limits
  // (the handle's chunk_bytes and direct flag): identical plans on both sides depend on it.
  int64_t chunk_bytes = 0;
  int64_t direct_min_bytes = 0;
  std::vector<int64_t> blocks;  // destination blocks on every generation rank
  bool operator==(const FetchPlanInputs&) const = default;
};

struct FetchMsg : FetchPlanInputs {
  uint64_t request_id = 0;
  AccessToken token{};
  HandleDigest handle_digest{};  // of the handle the generation rank decoded
  uint64_t gen_instance = 0;
  int32_t gen_rank = 0;
  uint32_t transfer_id = 0;
  std::string reply_address;
  bool checksum = false;  // send each chunk's digest in a CHUNK message
  bool rma = false;       // rma_target is set: the context rank may put
  RmaTarget rma_target;
  const FetchPlanInputs& plan_inputs() const { return *this; }
  bool operator==(const FetchMsg&) const = default;
};
struct AcceptMsg {
  uint64_t request_id = 0;
  uint32_t transfer_id = 0;
  bool rma = false;  // the context rank puts (else it sends tagged data messages)
  // ... by copying into the mapped pool (rma_target.peer_pool), not by transport puts.
  bool peer_memory = false;
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
  // RMA: the staging slot of each chunk newly credited by this message, in chunk order
  // (kNoSlot for a chunk with nothing packed). Empty on the tagged path.
  std::vector<uint32_t> slots;
  bool operator==(const CreditMsg&) const = default;
};
struct ChunkMsg {
  uint64_t request_id = 0;
  uint32_t transfer_id = 0;
  uint32_t chunk = 0;
  uint32_t count = 1;  // chunks [chunk, chunk + count) are in place (no checksum when > 1)
  bool has_checksum = false;
  uint64_t checksum = 0;  // the chunk digest of its bytes in plan order (rma.h)
  // The last CHUNK of the pair, and the request is complete on every rank of both instances: the
  // context rank saw its every chunk land in the generation rank's memory (peer-memory copies
  // landed, or puts flushed), and every other context rank of its DP group said the same
  // (SIBLING), so neither DONE nor COMPLETE follows. Never with a checksum (the generation rank
  // could still refuse the chunk).
  bool complete = false;
  bool operator==(const ChunkMsg&) const = default;
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

// Between the context ranks of one DP group (wire version 8): this rank's part of the request is
// done (code 0: every generation rank it serves holds its bytes), or the request ended here (the
// failure's code and reason). A rank completes a request once it and every other rank of its
// group are done. A rank takes the message only when its token is MakeSiblingToken (handle.h) of
// the request's access token, the sender and the code under the instance secret.
struct SiblingMsg {
  uint64_t request_id = 0;
  AccessToken token{};  // MakeSiblingToken
  int32_t ctx_rank = 0;
  uint8_t code = 0;  // 0: done; else the StatusCode the request ended with
  std::string reason;
  bool operator==(const SiblingMsg&) const = default;
};

using ControlMsg = std::variant<FetchMsg, AcceptMsg, RejectMsg, CreditMsg, DoneMsg, AbortMsg,
                                CompleteMsg, ChunkMsg, SiblingMsg>;

// The message versions a rank encodes and decodes, oldest to newest.
struct VersionRange {
  uint8_t oldest = kOldestMessageVersion;
  uint8_t newest = kMessageVersion;
  bool Has(uint8_t v) const { return v >= oldest && v <= newest; }
  bool operator==(const VersionRange&) const = default;
};

// `version` in [kOldestMessageVersion, kMessageVersion]: the header says it (versions 10 and 11
// share every body).
std::vector<std::byte> EncodeMessage(const ControlMsg& msg, uint8_t version = kMessageVersion);
// Refuses a message of a version outside `accept`, naming both ("version 9; this rank speaks
// 10..11").
StatusOr<ControlMsg> DecodeMessage(std::span<const std::byte> bytes, VersionRange accept = {});
// The header's version byte; 0 when `bytes` is too short or its magic is not kMessageMagic.
uint8_t MessageVersionOf(std::span<const std::byte> bytes);

// VERSION (type 10, since version 11): the first message a rank sends a peer it has not heard
// from, advertising what it speaks. Its form is frozen for every later version, so any version
// can read it: header `magic, u8 speaks, u8 10`, body `u8 oldest` (the oldest version the sender
// still serves), seal. A version-10 rank drops it as undecodable (one warning per peer).
inline constexpr uint8_t kVersionMsgType = 10;
std::vector<std::byte> EncodeVersionMsg(VersionRange speaks);
// Whether `bytes` claim to be a VERSION (magic and type), of whatever version.
bool IsVersionMsg(std::span<const std::byte> bytes);
// The range a VERSION advertises (oldest <= newest, both >= 1), checking the seal.
StatusOr<VersionRange> DecodeVersionMsg(std::span<const std::byte> bytes);
// The seal of a message's bytes before it (EncodeMessage appends it; fuzz harnesses re-seal).
uint64_t MessageSeal(std::span<const std::byte> body);

// The failure a peer reports in a REJECT or ABORT (code byte + reason), as a Status that is never
// OK: code 0 (OK) or a code this build does not know becomes kInternal naming the code, so a
// request a peer ended always ends with a reason.
Status PeerStatus(uint8_t code, std::string message);

inline uint64_t DataTag(uint32_t transfer_id, uint64_t chunk) {
  return (uint64_t{transfer_id} << kChunkTagBits) | (chunk & ((1u << kChunkTagBits) - 1));
}

}  // namespace kvferry
