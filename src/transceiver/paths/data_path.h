// A pair's data path: how the chunks of one (context rank, generation rank) pair of a request move,
// as one object per pair, chosen once (paths/choose.h) instead of flags every step tests.
//
// Why: three paths move a pair's chunks, and they differ in every step: who posts what before the
// bytes move (tagged receives and credits; one-sided staging slots named in credits; nothing for
// peer memory), how a chunk moves (a tagged send; puts and a flush; a copy batch on the context
// rank's stream), how the generation rank learns a chunk is in place (its receive completes; a
// CHUNK message), and what an ending request must wait for. UCX's ucp_proto and NIXL's
// makeXferReq pick one protocol per transfer, once; so do the sides here: a new path (a network
// path across hosts, a layout conversion) is one more implementation and one more row of the
// choice table, and the sides do not change.
//
// Each side has its own interface, shaped after what that side does with a pair:
// - SendPath (context side): answer the FETCH (Open), take credits (Credit), move chunks and reap
//   their ends (Advance), say what is outstanding, cancel or abandon it when the request ends.
// - RecvPath (generation side): post receives, credits or placeholders (Post), land chunks
//   (Land: unpack, checksum, count), take CHUNK reports (OnChunk), cancel when the request ends.
// The sides read one property of a chosen path, one_sided(): the context rank writes into the
// generation rank's memory (the generation rank watches it; an error end says it stopped).
// A path talks to its side only through PathHost (the engine's resources and the side's answers:
// send a control message, count a chunk, fail the request). The protocol (pair_state.h) stays
// with the sides: a path reads a pair's phase, never changes it.
//
// Thread-compatible: every path runs on its side's progress thread.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string_view>
#include <vector>

#include "kvferry/device.h"
#include "kvferry/pool.h"
#include "kvferry/status.h"
#include "kvferry/transport.h"
#include "planner/planner.h"
#include "transceiver/engine/leases.h"
#include "transceiver/pair_state.h"
#include "transceiver/wire/messages.h"

namespace kvferry {

enum class DataPathKind : uint8_t {
  kTagged,      // two-sided tagged messages: the generation rank posts a receive per chunk
  kOneSided,    // transport puts into the generation pool and its credited staging slots
  kPeerMemory,  // the context rank's stream copies into the generation pool, mapped (one host)
};
std::string_view DataPathName(DataPathKind kind);  // "tagged", "one-sided", "peer-memory"

// Chunks that landed in the generation pool and were not reported yet: one contiguous range,
// since a pair's peer-memory batches complete in order on one stream.
struct LandedChunks {
  size_t first = 0;
  uint32_t count = 0;
  // Their packed rows wait in the generation rank's staging slots until it hears of them (puts):
  // such a report is not held while the request waits for other pairs or context ranks.
  bool staged = false;
  void Add(size_t chunk, uint32_t n) {
    if (count == 0) first = chunk;
    count += n;
  }
};

// What a path reads and updates of its request (the sides' request records derive from it).
struct PathRequest {
  uint64_t id = 0;
  int32_t ready_end = 0;  // context side: global layers [0, ready_end) are ready to go
  int64_t bytes = 0;      // bytes in place so far
  bool ending = false;    // a terminal state is decided; operations drain
  Clock::time_point ended_at;
};

// What a path reads of its pair (the sides' pair records derive from it): fixed when the pair is
// made, except the phase, which only the side changes (pair_state.h).
struct PathPair {
  explicit PathPair(PairSide side) : state(side) {}
  int32_t rank = 0;  // the peer's rank in its instance
  PeerId peer = kAnyPeer;
  uint32_t transfer_id = 0;
  PairPlan plan;          // the pair's chunks (none: the context rank sends this pair nothing)
  bool checksum = false;  // CHUNK messages carry each chunk's digest (asked in FETCH)
  // The dtype conversion the sender makes while packing (planner.h PlanConversion), if any.
  std::optional<Conversion> conversion;
  PairState state;
};

// What a path needs of its side: the engine's resources, and the side's answers. Implemented by
// the Engine (engine/engine.h), which passes Fail on to its side; every call on the progress
// thread.
class PathHost {
 public:
  virtual ~PathHost() = default;
  virtual Transport& transport() = 0;
  virtual Stream& stream() = 0;
  virtual const BlockPool& pool() const = 0;
  // A staging slot (an empty lease when none is free) and its bytes.
  virtual StagingLease AcquireSlot() = 0;
  virtual std::byte* SlotData(const StagingLease& slot) const = 0;
  // A pooled device event (an empty lease when none can be made).
  virtual EventLease AcquireEvent() = 0;
  virtual EventPool& event_pool() = 0;
  // The memory kind a transport is told for the pool and for staging, and whether chunks may
  // move pool to pool (the transport reaches the pool's memory).
  virtual MemoryKind pool_wire_kind() const = 0;
  virtual MemoryKind staging_wire_kind() const = 0;
  virtual bool direct_ok() const = 0;
  // The chunk digest of a chunk's bytes in this rank's pool (rma.h ChunkDigester).
  virtual StatusOr<uint64_t> ChunkDigest(const Chunk& chunk, bool context_side) = 0;
  // The chunk digest of a chunk packed (and converted) into staging `slot`, once its pack
  // completed: the generation side's digest of the same bytes in its pool.
  virtual StatusOr<uint64_t> PackedDigest(const Chunk& chunk, const StagingLease& slot) = 0;
  virtual void SendMsg(PeerId peer, const ControlMsg& msg) = 0;
  // A chunk of the request is in place (metrics); `started` is when its move began.
  virtual void NoteChunk(uint64_t request_id, int64_t bytes, Clock::time_point started) = 0;
  // Ends the request with an error at once (ABORT to its pairs, operations cancelled): a path
  // that fails reads `r.ending` set when this returns.
  virtual void Fail(PathRequest& r, Status why) = 0;
  // The same for the live request `request_id`, when it is not ending yet.
  virtual void FailById(uint64_t request_id, const Status& why) = 0;
  // A pair of this side moves its data by `kind` (Metrics' data_path says which).
  virtual void NotePathUsed(DataPathKind kind) = 0;
  // Copy descriptors reused across calls.
  std::vector<CopyDesc>& scratch() { return scratch_; }

 private:
  std::vector<CopyDesc> scratch_;
};

// The context side's half of a pair's path.
class SendPath {
 public:
  virtual ~SendPath() = default;
  virtual DataPathKind kind() const = 0;
  // The sender writes into the receiver's memory (one-sided, peer memory): an ending request
  // tells the generation rank it stopped, so that it may reuse its slots and blocks.
  virtual bool one_sided() const = 0;
  // The pair is accepted: answers the FETCH where the path has an answer (ACCEPT naming it).
  virtual void Open(PathHost& host, const PathRequest& r, const PathPair& p) = 0;
  // A CREDIT from the generation rank: an error fails the request.
  virtual Status Credit(const PathPair& p, const CreditMsg& c) = 0;
  // Starts the chunks that may go and reaps those that went; true when it did something. A
  // failure fails the request through host.Fail.
  virtual bool Advance(PathHost& host, PathRequest& r, PathPair& p) = 0;
  // Chunks started and not yet known in place (transport operations, copy batches).
  virtual size_t outstanding() const = 0;
  // Transport operations the progress loop must drive are in flight.
  virtual bool transport_pending() const { return outstanding() > 0; }
  // Every chunk of `p` started and none outstanding.
  bool drained(const PathPair& p) const {
    return next_ == p.plan.chunks.size() && outstanding() == 0;
  }
  // The request ends: cancels what the transport can take back.
  virtual void Cancel(Transport& /*transport*/) {}
  // The grace period passed: forgets what is still outstanding.
  virtual void Abandon() = 0;
  // Every chunk landed and the pair's last CHUNK waits to say the request is complete (one-sided
  // without checksums: neither DONE nor COMPLETE is exchanged); null otherwise. The side sends it
  // (DropHeldReport after) when the request completes, or at once, not saying complete, when it
  // is staged and the request still waits for others (the pair then gets COMPLETE).
  virtual const LandedChunks* held_report() const { return nullptr; }
  virtual void DropHeldReport() {}

 protected:
  size_t next_ = 0;  // the next chunk to start
};

// A chunk the generation rank receives: in flight from posting to landing.
struct RecvOp {
  size_t chunk = 0;
  StagingLease slot;                // staging slot; empty when received in place
  std::unique_ptr<TransportOp> op;  // pending receive (tagged path)
  EventLease unpacked;              // pending unpack from the slot
  bool arrived = false;             // the bytes are in the slot or the pool
  bool landed = false;              // ... and unpacked: the chunk is in the pool
  bool notified = false;            // CHUNK received (one-sided paths, or checksums asked)
  bool has_checksum = false;
  uint64_t checksum = 0;
  Clock::time_point started = Clock::now();  // metrics: the chunk's latency
};

// What a generation rank's FETCH offered the context rank (the same to every pair of a request).
struct PathOffer {
  bool one_sided = false;    // an RMA target: the pool and staging registered for puts
  bool peer_memory = false;  // ... and the pool regions exported for a same-host peer to map
};

// The generation side's half of a pair's path. Chunks are posted in order (whatever the path
// posts: receives, credited slots, or nothing) and land through one loop: arrived (the receive
// completed, or a CHUNK said so on a one-sided path), unpacked from staging when packed, checked
// against its CHUNK's checksum when asked, counted.
class RecvPath {
 public:
  RecvPath(PathOffer offer, std::chrono::milliseconds abort_grace)
      : offer_(offer), abort_grace_(abort_grace) {}
  virtual ~RecvPath() = default;
  virtual DataPathKind kind() const = 0;
  // The context rank writes into this rank's memory (puts or copies): watch it, and after an
  // end wait for it to stop (ABORT or COMPLETE) or for the grace period.
  virtual bool one_sided() const = 0;
  const PathOffer& offer() const { return offer_; }
  // The path was chosen by the context rank's answer (RecvPathForAnswer) and replaces the one the
  // FETCH offered: what it posts at once (a CHUNK may follow its answer in the same drain).
  virtual void Start(PathHost& /*host*/, PathRequest& /*r*/, const PathPair& /*p*/) {}
  // Posts what the path posts before chunks move (receives, credits, placeholders); true when it
  // did something. A failure fails the request through host.Fail.
  virtual bool Post(PathHost& host, PathRequest& r, const PathPair& p) = 0;
  // Lands what arrived: unpacks, checks and counts chunks in place, and after an end drops the
  // operations that may go; true when it did something.
  bool Land(PathHost& host, PathRequest& r, PathPair& p);
  // A CHUNK: marks the chunks it reports (a failure fails the request).
  void OnChunk(PathHost& host, PathRequest& r, const PathPair& p, const ChunkMsg& k);
  // A CHUNK saying complete comes only for a one-sided pair (before ACCEPT: one that offered peer
  // memory), and is its last: checked before the pair's phase moves, so that the context rank is
  // told.
  Status CheckComplete(const PathRequest& r, const PathPair& p, const ChunkMsg& k) const;
  // The pair's last CHUNK says complete (one-sided without checksums): no DONE.
  virtual bool folds(const PathPair& /*p*/) const { return false; }
  // Every chunk of the pair was posted and reported by a CHUNK (a folding pair may then take
  // COMPLETE: its last CHUNK came on its own).
  bool reported_all(const PathPair& p) const;
  // The pair waits only for the context rank's messages (its CHUNK or ACCEPT), nothing of ours
  // to drive (the side may nap).
  virtual bool awaits_messages(const PathPair& /*p*/) const { return false; }
  // Receives or unpacks of ours are in flight.
  bool work_pending() const;
  bool idle() const { return inflight_.empty(); }
  size_t completed() const { return completed_; }
  // The request ends: cancels the pending receives.
  void Cancel(Transport& transport);

 protected:
  // Rows at least this long arrive in the pool, not packed (kNoDirect: none).
  virtual int64_t unpack_row_min() const;
  // After an end, the context rank may still write into a one-sided pair's slots and blocks until
  // it says it stopped, or the grace period passes.
  bool Quiet(const PathRequest& r, const PathPair& p) const;

  const PathOffer offer_;
  const std::chrono::milliseconds abort_grace_;
  size_t next_post_ = 0;
  size_t credited_ = 0;
  size_t completed_ = 0;
  std::deque<RecvOp> inflight_;

 private:
  // Drops the op at `it` once nothing may still write into it (after an end; else steps past
  // it); true when dropped.
  bool DrainEnded(const PathRequest& r, const PathPair& p, std::deque<RecvOp>::iterator& it);
  // The chunk's checksum matches its CHUNK's (or none was asked).
  Status Verify(PathHost& host, const PathRequest& r, const PathPair& p, const RecvOp& o);
};

}  // namespace kvferry
