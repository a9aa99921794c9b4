// Leases on the engine's reused resources.
//
// A staging slot (one chunk of the staging buffer) and a pooled device event (for a pack or an
// unpack) are held by a move-only lease from the moment they are taken until the lease goes: its
// destructor, or Reset(), returns the resource to its pool exactly once, on every path (the chunk
// completed, the request aborted or failed, the operation dropped with its request). Moving a
// lease moves the duty to return it; an empty lease (none was free) returns nothing.
//
// Everything here is used on the engine's progress thread only (thread-compatible), except the
// slot pool's in-use count, which Stats() reads from any thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "kvferry/device.h"
#include "kvferry/status.h"

namespace kvferry {

class SlotPool;
class EventPool;

// A staging slot: index() in [0, the pool's size). Move-only.
class SlotLease {
 public:
  SlotLease() = default;
  SlotLease(SlotLease&& o) noexcept
      : pool_(std::exchange(o.pool_, nullptr)), slot_(std::exchange(o.slot_, -1)) {}
  SlotLease& operator=(SlotLease&& o) noexcept {
    if (this != &o) {
      Reset();
      pool_ = std::exchange(o.pool_, nullptr);
      slot_ = std::exchange(o.slot_, -1);
    }
    return *this;
  }
  SlotLease(const SlotLease&) = delete;
  SlotLease& operator=(const SlotLease&) = delete;
  ~SlotLease() { Reset(); }

  explicit operator bool() const { return pool_ != nullptr; }
  int index() const { return slot_; }
  // Returns the slot now (nothing when empty).
  inline void Reset();

 private:
  friend class SlotPool;
  SlotLease(SlotPool* pool, int slot) : pool_(pool), slot_(slot) {}
  SlotPool* pool_ = nullptr;
  int slot_ = -1;
};

// A fixed set of slots, handed out most recently returned first.
class SlotPool {
 public:
  explicit SlotPool(int count = 0) { Resize(count); }
  SlotPool(const SlotPool&) = delete;
  SlotPool& operator=(const SlotPool&) = delete;
  // Only while no lease is out.
  void Resize(int count) {
    free_.clear();
    for (int i = count - 1; i >= 0; --i) free_.push_back(i);
  }
  // An empty lease when every slot is out.
  SlotLease Acquire() {
    if (free_.empty()) return SlotLease();
    const int s = free_.back();
    free_.pop_back();
    in_use_.fetch_add(1, std::memory_order_relaxed);
    return SlotLease(this, s);
  }
  int64_t in_use() const { return in_use_.load(std::memory_order_relaxed); }
  size_t free() const { return free_.size(); }

 private:
  friend class SlotLease;
  void Return(int slot) {
    free_.push_back(slot);
    in_use_.fetch_sub(1, std::memory_order_relaxed);
  }
  std::vector<int> free_;
  std::atomic<int64_t> in_use_{0};
};

inline void SlotLease::Reset() {
  if (pool_ != nullptr) std::exchange(pool_, nullptr)->Return(std::exchange(slot_, -1));
}

// A device event of the pool. Move-only.
class EventLease {
 public:
  EventLease() = default;
  EventLease(EventLease&& o) noexcept
      : pool_(std::exchange(o.pool_, nullptr)), event_(std::exchange(o.event_, nullptr)) {}
  EventLease& operator=(EventLease&& o) noexcept {
    if (this != &o) {
      Reset();
      pool_ = std::exchange(o.pool_, nullptr);
      event_ = std::exchange(o.event_, nullptr);
    }
    return *this;
  }
  EventLease(const EventLease&) = delete;
  EventLease& operator=(const EventLease&) = delete;
  ~EventLease() { Reset(); }

  explicit operator bool() const { return event_ != nullptr; }
  Event& operator*() const { return *event_; }
  Event* get() const { return event_; }
  // Returns the event now (nothing when empty).
  inline void Reset();

 private:
  friend class EventPool;
  EventLease(EventPool* pool, Event* event) : pool_(pool), event_(event) {}
  EventPool* pool_ = nullptr;
  Event* event_ = nullptr;
};

// Events made on demand by `make` and reused: in steady state no event is created.
class EventPool {
 public:
  using Maker = std::function<StatusOr<std::unique_ptr<Event>>()>;
  explicit EventPool(Maker make) : make_(std::move(make)) {}
  EventPool(const EventPool&) = delete;
  EventPool& operator=(const EventPool&) = delete;
  // A reused event, or a new one; an empty lease when none can be made.
  EventLease Acquire() {
    if (free_.empty()) {
      auto e = make_();
      if (!e.ok()) return EventLease();
      events_.push_back(std::move(e).value());
      ++out_;
      return EventLease(this, events_.back().get());
    }
    Event* e = free_.back();
    free_.pop_back();
    ++out_;
    return EventLease(this, e);
  }
  // Events made so far, and those leased now.
  size_t made() const { return events_.size(); }
  size_t out() const { return out_; }

 private:
  friend class EventLease;
  void Return(Event* e) {
    free_.push_back(e);
    --out_;
  }
  Maker make_;
  std::vector<std::unique_ptr<Event>> events_;
  std::vector<Event*> free_;
  size_t out_ = 0;
};

inline void EventLease::Reset() {
  if (pool_ != nullptr) std::exchange(pool_, nullptr)->Return(std::exchange(event_, nullptr));
}

}  // namespace kvferry
