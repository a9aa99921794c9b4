// PeerMappings: the generation pools' regions a context rank mapped for the peer-memory path, by
// handle. At most `max_mapped` regions not in use by a pair stay mapped (the least recently used
// unmapped first); those of an exporter that exited (or revoked its export) go within a second
// (Sweep). An unmapped region is retired, not closed: it goes once the side's stream passed every
// copy queued before (an abandoned pair's copies may still write into it). A handle that did not
// map is remembered with its error, so it is not tried again on every fetch.
//
// Thread-compatible: the progress thread only, except count().
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "device/peer_memory.h"
#include "kvferry/device.h"
#include "transceiver/engine/progress_profile.h"
#include "transceiver/paths/peer_memory.h"

namespace kvferry {

class PeerMappings {
 public:
  // `stream`: the side's copy stream (what retired regions wait for).
  PeerMappings(Device& device, Stream& stream, ProgressProfile& profile, int64_t max_mapped)
      : device_(device),
        stream_(stream),
        profile_(profile),
        max_mapped_(static_cast<size_t>(std::max<int64_t>(max_mapped, 1))) {}
  // Closes every mapping: the stream must have drained first.
  ~PeerMappings() = default;

  // The mappings of `handles` (one per region), or why they can't be mapped.
  StatusOr<MappedPeerPool> Map(const std::vector<std::vector<std::byte>>& handles);
  // Unmaps what the bound and the exporters' ends ask for; does something at most once a second.
  void Sweep(Clock::time_point now);
  // Regions mapped now, as of the progress thread's last change (any thread; tests).
  size_t count() const { return count_.load(std::memory_order_relaxed); }

 private:
  struct Mapped {
    std::shared_ptr<PeerMapping> mapping;  // use_count() > 1: a pair holds it
    std::unique_ptr<ExporterWatch> watch;
    uint64_t last_use = 0;
  };
  // An unmapped region waiting for the stream to pass `passed` (recorded when it was unmapped).
  struct Retired {
    std::shared_ptr<PeerMapping> mapping;
    std::unique_ptr<Event> passed;
  };
  // Maps one region the first time.
  StatusOr<std::map<std::vector<std::byte>, Mapped>::iterator> MapNew(
      const std::vector<std::byte>& handle);
  void Retire(std::shared_ptr<PeerMapping> mapping);
  // Evicts least recently used unheld regions until at most `keep` remain (or none is unheld).
  void Evict(size_t keep);

  Device& device_;
  Stream& stream_;
  ProgressProfile& profile_;
  const size_t max_mapped_;
  std::map<std::vector<std::byte>, Mapped> mapped_;
  std::vector<Retired> retired_;
  uint64_t uses_ = 0;  // LRU clock
  std::atomic<size_t> count_{0};
  Clock::time_point next_sweep_{};
  std::map<std::vector<std::byte>, Status> unmappable_;
};

}  // namespace kvferry
