// The one-sided path (transport puts; rma.h says why and how a FETCH's target is checked): the
// generation rank registered its pool and staging and sent their keys in its FETCH (RmaTarget);
// it credits a staging slot for every chunk with packed bytes (CREDIT names the slots). The
// context rank puts every row of at least row_min_bytes pool to pool, packs the shorter ones into
// a local slot and puts that into the credited remote slot, flushes, and says CHUNK; the
// generation rank unpacks the slot. The generation rank watches the context rank (a receive it
// never matches) since no operation of its own would notice its death.
#pragma once

#include <vector>

#include "transceiver/paths/op_send.h"

namespace kvferry {

class OneSidedSend final : public OpSendPath {
 public:
  OneSidedSend(int64_t max_inflight, RmaTarget target)
      : OpSendPath(max_inflight), target_(std::move(target)) {}
  DataPathKind kind() const override { return DataPathKind::kOneSided; }
  bool one_sided() const override { return true; }
  void Open(PathHost& host, const PathRequest& r, const PathPair& p) override;
  Status Credit(const PathPair& p, const CreditMsg& c) override;
  bool Advance(PathHost& host, PathRequest& r, PathPair& p) override;

 private:
  // Starts the next chunk: its packed rows into a staging slot, its direct rows put (false: no
  // slot free). The error names the chunk.
  StatusOr<bool> Start(PathHost& host, const PathPair& p);
  // Puts packed slots, flushes, and reaps the chunks whose puts and flush completed.
  bool Reap(PathHost& host, PathRequest& r, const PathPair& p);

  const RmaTarget target_;
  std::vector<uint32_t> slots_;  // the generation staging slot credited per chunk
};

class OneSidedRecv final : public RecvPath {
 public:
  OneSidedRecv(PathOffer offer, std::chrono::milliseconds abort_grace, int64_t max_inflight,
               int64_t row_min)
      : RecvPath(offer, abort_grace), max_inflight_(max_inflight), row_min_(row_min) {}
  DataPathKind kind() const override { return DataPathKind::kOneSided; }
  bool one_sided() const override { return true; }
  // Peer memory offered too: no slot is credited before the answer says whether the context
  // rank copies into the pool (then no CREDIT is ever needed) or puts.
  bool awaits_messages(const PathPair& p) const override { return awaits_answer(p); }
  // Puts without checksums: the last CHUNK says complete (the context side's OpSendPath::Folds).
  bool folds(const PathPair& p) const override { return !p.checksum && !p.plan.chunks.empty(); }
  bool Post(PathHost& host, PathRequest& r, const PathPair& p) override;

 protected:
  int64_t unpack_row_min() const override { return row_min_; }

 private:
  bool awaits_answer(const PathPair& p) const {
    return offer_.peer_memory && p.state.Is(PairPhase::kFetched);
  }
  const int64_t max_inflight_;
  const int64_t row_min_;  // rows at least this long arrive in the pool
};

}  // namespace kvferry
