// The tagged path: two-sided messages with receiver matching, on every transport. The generation
// rank posts a receive per chunk (into its pool for a direct chunk, else into a staging slot)
// within its staging and in-flight bounds and credits them by count (CREDIT); the context rank
// sends each credited chunk straight from its pool (direct) or packed into a staging slot. A
// completed receive is the chunk in place; a CHUNK message comes only with a checksum.
#pragma once

#include "transceiver/paths/op_send.h"

namespace kvferry {

class TaggedSend final : public OpSendPath {
 public:
  using OpSendPath::OpSendPath;
  DataPathKind kind() const override { return DataPathKind::kTagged; }
  bool one_sided() const override { return false; }
  void Open(PathHost& host, const PathRequest& r, const PathPair& p) override;
  Status Credit(const PathPair& p, const CreditMsg& c) override;
  bool Advance(PathHost& host, PathRequest& r, PathPair& p) override;

 private:
  // Starts the next chunk: a direct send, or a pack into a staging slot (false: no slot free).
  StatusOr<bool> Start(PathHost& host, const PathPair& p);
  // Sends the packed chunks and reaps the sends that completed.
  bool Reap(PathHost& host, PathRequest& r, const PathPair& p);
};

class TaggedRecv final : public RecvPath {
 public:
  TaggedRecv(PathOffer offer, std::chrono::milliseconds abort_grace, int64_t max_inflight)
      : RecvPath(offer, abort_grace), max_inflight_(max_inflight) {}
  DataPathKind kind() const override { return DataPathKind::kTagged; }
  bool one_sided() const override { return false; }
  bool Post(PathHost& host, PathRequest& r, const PathPair& p) override;

 private:
  const int64_t max_inflight_;
};

}  // namespace kvferry
