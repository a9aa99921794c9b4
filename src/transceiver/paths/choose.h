// Which data path a pair takes, decided once: what this rank can do (at start), what the
// generation rank offers (its FETCH), and what the context rank answers. Every test of a
// capability or knob that picks a path is here; the sides hold the chosen SendPath / RecvPath.
//
// This rank (SetUpLocalPaths, at Engine::Start):
//   one-sided here   = transfer.rma on, the transport has one-sided operations, it reaches the
//                      pool's memory, and registering the pool and staging succeeds
//   peer memory here = one-sided here, transfer.peer_memory on (auto: GPU pools and CPU-device
//                      pools), and every pool region exports (Device::ExportMemory)
// A generation rank offers what it has (OfferOf): one-sided with its RMA target, peer memory with
// its exported regions. A context rank answers each FETCH by kSendPaths below; the generation
// rank receives by kRecvPaths.
//
// A new path (a network path across hosts, a layout conversion) is one more DataPathKind, one
// more capability here, and its rows in the two tables.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kvferry/device.h"
#include "kvferry/pool.h"
#include "kvferry/transport.h"
#include "transceiver/paths/data_path.h"
#include "transceiver/paths/pack.h"
#include "transceiver/paths/peer_memory.h"
#include "transceiver/rma.h"

namespace kvferry {

// transfer.peer_memory: offer / use mapped peer pools for GPU pools and CPU-device pools (auto),
// for every pool a device can share (on), never (off).
enum class PeerMemoryMode { kAuto, kOn, kOff };

// What this rank can do, decided once at start.
struct LocalPaths {
  LocalRma rma;         // the pool and staging registered for one-sided access (or none)
  std::string rma_why;  // why there is no one-sided path here
  // This rank's pool regions exported for a same-host peer to map, then its per-block scales
  // when it has them (empty: not offered).
  std::vector<std::vector<std::byte>> exported_pool;
  bool one_sided() const { return rma.staging != nullptr; }
};

// Registers and exports what the knobs and capabilities allow (the table at the top). `cpu`: the
// CPU device (every kind is host memory). Never fails: what can't be set up is off, and says why.
LocalPaths SetUpLocalPaths(Transport& transport, Device& device, const BlockPool& pool,
                           const Buffer& staging, MemoryKind pool_wire_kind,
                           MemoryKind staging_wire_kind, bool direct_ok, bool rma_knob,
                           PeerMemoryMode peer_knob);

// What Metrics reports as the side's data path: peer memory once a pair used it (`used_paths`: a
// bit per DataPathKind), else one-sided where this rank can, else tagged.
std::string_view SideDataPath(const LocalPaths& local, unsigned used_paths);

// The context rank's choice, one row per case (a pair's FETCH, this rank, the offered pool):
struct SendPathRow {
  bool offers_one_sided;  // the FETCH carries an RMA target
  bool one_sided_here;    // LocalPaths::one_sided()
  bool peer_pool_maps;    // offered, transfer.peer_memory not off here, mapped and large enough
  DataPathKind path;
};
inline constexpr SendPathRow kSendPaths[] = {
    {false, false, false, DataPathKind::kTagged}, {false, true, false, DataPathKind::kTagged},
    {true, false, false, DataPathKind::kTagged},  // logged once: why not one-sided
    {true, true, false, DataPathKind::kOneSided}, {true, true, true, DataPathKind::kPeerMemory},
};
// The row of kSendPaths (a pool is mapped only where the first two say one-sided).
DataPathKind SendPathFor(bool offers_one_sided, bool one_sided_here, bool peer_pool_maps);

struct SendSettings {
  int64_t max_inflight = 1;      // transfer.max_inflight_per_pair
  int64_t peer_batch_bytes = 0;  // transfer.peer_batch_bytes
  PeerMemoryMode peer_knob = PeerMemoryMode::kAuto;
};

// Makes each accepted pair's SendPath (context side).
class SendPathChooser {
 public:
  using MapPeerPool =
      std::function<StatusOr<MappedPeerPool>(const std::vector<std::vector<std::byte>>& handles)>;
  SendPathChooser(const LocalPaths& local, SendSettings settings, PeerMemoryCopies& copies,
                  ProgressProfile* profile, MapPeerPool map)
      : local_(local),
        settings_(settings),
        copies_(copies),
        profile_(profile),
        map_(std::move(map)) {}
  // The path of the pair FETCH `f` asks for (its RMA target moved into the path), or why the FETCH
  // is refused (an RMA target that does not fit the generation layout it names). A pair that
  // converts dtypes puts no rows pool to pool: the sender converts while packing, or while
  // copying into the peer's pool (per-block scales too, into the peer's mapped scales).
  StatusOr<std::unique_ptr<SendPath>> Choose(FetchMsg& f, bool converts);

 private:
  // The pool FETCH `f` offers, mapped and checked against its target (and its per-block scales,
  // the last handle, against its shape); empty (and logged once) when not.
  std::optional<MappedPeerPool> MapOffered(const FetchMsg& f);

  const LocalPaths& local_;
  const SendSettings settings_;
  PeerMemoryCopies& copies_;
  ProgressProfile* const profile_;
  const MapPeerPool map_;
  bool rma_said_ = false;   // logged once why a one-sided fetch is served tagged
  bool peer_said_ = false;  // logged once why offered peer memory is not used
};

// What a generation rank's FETCH offers, from what it can do.
PathOffer OfferOf(const LocalPaths& local);
// Fills `f`'s one-sided fields from the offer: the RMA target (slots of `slot_bytes`, rows of at
// least `row_min` pool to pool) and the exported regions.
void DescribeOffer(const LocalPaths& local, int64_t slot_bytes, uint32_t slots, int64_t row_min,
                   FetchMsg& f);

// The generation rank's paths: by the offer until the context rank answers, then by the answer
// (ACCEPT, or a first CHUNK standing for ACCEPT with peer memory):
//
//   offer                 | answer      | path
//   ----------------------+-------------+------------------------------------------------------
//   tagged                | (none yet)  | tagged: receives posted and credited at once
//   one-sided             | (none yet)  | one-sided: slots credited at once
//   one-sided + peer mem. | (none yet)  | one-sided, nothing credited until the answer
//   any                   | tagged      | tagged (slots credited so far go back: nothing was put)
//   one-sided             | one-sided   | one-sided (kept)
//   tagged                | one-sided   | error: no target was offered
//   one-sided + peer mem. | peer memory | peer memory (nothing posted but placeholders)
//   otherwise             | peer memory | error: none was offered
struct RecvSettings {
  int64_t max_inflight = 1;
  std::chrono::milliseconds abort_grace{0};
  int64_t row_min = kNoDirect;  // the FETCH's rma_target.row_min_bytes
};
std::unique_ptr<RecvPath> RecvPathForOffer(const PathOffer& offer, const RecvSettings& settings);
// Null: the current path stays. An error names the context rank `ctx_rank` and what it answered.
StatusOr<std::unique_ptr<RecvPath>> RecvPathForAnswer(const RecvPath& current,
                                                      const AcceptMsg& answer,
                                                      const RecvSettings& settings,
                                                      int32_t ctx_rank);

}  // namespace kvferry
