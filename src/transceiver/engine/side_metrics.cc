#include "transceiver/engine/side_metrics.h"

#include <algorithm>

namespace kvferry {
namespace {

double Since(Clock::time_point t0, Clock::time_point t) {
  return t == Clock::time_point{} ? -1 : std::chrono::duration<double>(t - t0).count();
}

}  // namespace

void SideMetrics::OnStatus(const TransferStatus& s) {
  const auto now = Clock::now();
  auto [it, fresh] = live_.try_emplace(s.request_id);
  Live& l = it->second;
  if (fresh) {
    l.created = now;
    l.wall = std::chrono::system_clock::now();
    started_.fetch_add(1, std::memory_order_relaxed);
  }
  if (s.state == TransferState::kInProgress && !l.has_fetch) {
    l.fetch = now;
    l.has_fetch = true;
  }
  if (!IsTerminal(s.state)) return;
  const int idx = static_cast<int>(s.state) - static_cast<int>(TransferState::kComplete);
  ended_[idx].fetch_add(1, std::memory_order_relaxed);
  if (s.state != TransferState::kComplete) {
    const auto code = static_cast<size_t>(s.reason.code());
    if (code < codes_.size()) codes_[code].fetch_add(1, std::memory_order_relaxed);
  }
  bytes_.fetch_add(s.bytes, std::memory_order_relaxed);
  const double secs = std::chrono::duration<double>(now - l.created).count();
  request_ns_.fetch_add(static_cast<int64_t>(secs * 1e9), std::memory_order_relaxed);
  request_latency_.Add(secs);
  RequestTimeline t;
  t.request_id = s.request_id;
  t.state = std::string(TransferStateName(s.state));
  t.code = std::string(StatusCodeName(s.reason.code()));
  t.bytes = s.bytes;
  t.chunks = l.chunks;
  t.created = l.wall;
  t.fetch = Since(l.created, l.fetch);
  t.first_byte = Since(l.created, l.first);
  t.last_byte = Since(l.created, l.last);
  t.end = secs;
  live_.erase(it);
  MutexLock lock(mu_);
  if (!has_slowest_ || t.end > slowest_.end) {
    slowest_ = t;
    has_slowest_ = true;
  }
  recent_.push_back(std::move(t));
  if (recent_.size() > kRecentTimelines) recent_.pop_front();
}

void SideMetrics::OnChunk(uint64_t request_id, int64_t bytes, Clock::time_point started) {
  const auto now = Clock::now();
  chunks_.fetch_add(1, std::memory_order_relaxed);
  chunk_bytes_.fetch_add(bytes, std::memory_order_relaxed);
  chunk_latency_.Add(std::chrono::duration<double>(now - started).count());
  auto it = live_.find(request_id);
  if (it == live_.end()) return;
  if (it->second.first == Clock::time_point{}) it->second.first = now;
  it->second.last = now;
  ++it->second.chunks;
}

void SideMetrics::Fill(TransceiverMetrics& m) const {
  auto get = [](const std::atomic<int64_t>& a) { return a.load(std::memory_order_relaxed); };
  m.requests_started = get(started_);
  m.requests_complete = get(ended_[0]);
  m.requests_error = get(ended_[1]);
  m.requests_timed_out = get(ended_[2]);
  m.requests_cancelled = get(ended_[3]);
  m.errors_by_code.clear();
  for (size_t c = 0; c < codes_.size(); ++c) {
    if (int64_t n = get(codes_[c]); n > 0)
      m.errors_by_code.emplace_back(std::string(StatusCodeName(static_cast<StatusCode>(c))), n);
  }
  m.bytes = get(bytes_);
  m.request_seconds = static_cast<double>(get(request_ns_)) / 1e9;
  m.chunks = get(chunks_);
  m.chunk_bytes = get(chunk_bytes_);
  m.request_latency = request_latency_.Snapshot();
  m.chunk_latency = chunk_latency_.Snapshot();
}

std::vector<RequestTimeline> SideMetrics::Timelines() const {
  MutexLock lock(mu_);
  std::vector<RequestTimeline> out(recent_.begin(), recent_.end());
  const uint64_t slowest_id = slowest_.request_id;
  if (has_slowest_ && std::none_of(out.begin(), out.end(), [&](const RequestTimeline& t) {
        return t.request_id == slowest_id;
      })) {
    out.push_back(slowest_);
  }
  return out;
}

}  // namespace kvferry
