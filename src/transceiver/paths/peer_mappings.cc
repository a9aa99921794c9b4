#include "transceiver/paths/peer_mappings.h"

#include "base/log.h"

namespace kvferry {

StatusOr<MappedPeerPool> PeerMappings::Map(const std::vector<std::vector<std::byte>>& handles) {
  MappedPeerPool out;
  out.regions.reserve(handles.size());
  out.holds.reserve(handles.size());
  for (const auto& h : handles) {
    auto it = mapped_.find(h);
    if (it == mapped_.end()) {
      KVF_ASSIGN_OR_RETURN(it, MapNew(h));
    }
    it->second.last_use = ++uses_;
    out.regions.push_back(it->second.mapping.get());
    out.holds.push_back(it->second.mapping);
  }
  return out;
}

StatusOr<std::map<std::vector<std::byte>, PeerMappings::Mapped>::iterator> PeerMappings::MapNew(
    const std::vector<std::byte>& handle) {
  if (auto bad = unmappable_.find(handle); bad != unmappable_.end()) return bad->second;
  auto m = [&] {
    ProfileScope timed(&profile_, ProfilePhase::kPeerImport);
    return device_.ImportMemory(handle);
  }();
  if (!m.ok()) {
    if (unmappable_.size() >= 1024) unmappable_.clear();
    unmappable_.emplace(handle, m.status());
    return m.status();
  }
  auto decoded = DecodePeerHandle(handle);  // ImportMemory decoded it already: can't fail
  if (!decoded.ok()) return decoded.status();
  Evict(max_mapped_ - 1);
  Mapped entry;
  entry.mapping = std::shared_ptr<PeerMapping>(std::move(m).value());
  entry.watch = std::make_unique<ExporterWatch>(*decoded);
  auto it = mapped_.emplace(handle, std::move(entry)).first;
  count_.store(mapped_.size(), std::memory_order_relaxed);
  return it;
}

void PeerMappings::Retire(std::shared_ptr<PeerMapping> mapping) {
  Retired r{std::move(mapping), nullptr};
  if (auto ev = device_.CreateEvent(); ev.ok() && stream_.Record(**ev).ok())
    r.passed = std::move(ev).value();
  retired_.push_back(std::move(r));  // no event: kept until the side goes
}

void PeerMappings::Evict(size_t keep) {
  while (mapped_.size() > keep) {
    auto victim = mapped_.end();
    for (auto it = mapped_.begin(); it != mapped_.end(); ++it) {
      if (it->second.mapping.use_count() > 1) continue;  // a live pair copies into it
      if (victim == mapped_.end() || it->second.last_use < victim->second.last_use) victim = it;
    }
    if (victim == mapped_.end()) return;
    Log(LogLevel::kDebug, "transceiver: unmapped a peer pool region ({} mapped, at most {})",
        mapped_.size(), max_mapped_);
    Retire(std::move(victim->second.mapping));
    mapped_.erase(victim);
    count_.store(mapped_.size(), std::memory_order_relaxed);
  }
}

void PeerMappings::Sweep(Clock::time_point now) {
  if (now < next_sweep_) return;
  next_sweep_ = now + std::chrono::seconds(1);
  for (auto it = mapped_.begin(); it != mapped_.end();) {
    if (it->second.mapping.use_count() == 1 && !it->second.watch->alive()) {
      Retire(std::move(it->second.mapping));
      it = mapped_.erase(it);
    } else {
      ++it;
    }
  }
  // Regions a pair held past the bound when they were mapped go once it let them go.
  Evict(max_mapped_);
  count_.store(mapped_.size(), std::memory_order_relaxed);
  std::erase_if(retired_, [](Retired& r) { return r.passed && r.passed->Query(); });
}

}  // namespace kvferry
