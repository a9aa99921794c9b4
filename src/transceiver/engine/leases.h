// Leases on the engine's reused resources: staging slots and pooled device events.
//
// Why a type: a staging slot (one chunk of the engine's staging buffer) or a pooled event (the
// end of a pack or an unpack on the engine's stream) used to be an int or an Event* that every
// path had to hand back by hand: the chunk sent, the request ended, the operation abandoned after
// the grace period, a send that could not be posted. A lease is the only way to hold one: it is
// move-only, and its destructor (or Reset) returns the resource to its pool exactly once, so an
// operation that goes away, on any path, gives back what it held, and nothing can go back twice.
// Moving a lease moves the duty to return it; an empty lease (none was free) returns nothing.
//
// Ordering: returning a slot whose pack or unpack is still queued on the engine's stream is safe
// (the next use of the slot is queued behind it on the same stream); a slot a transport may still
// read or write (a send or put not complete) must stay leased, which is why the sides keep the
// lease inside the operation that uses it and drop it with that operation.
//
// Thread-compatible: used on the engine's progress thread only, except StagingPool::in_use(),
// which Engine::Stats reads from any thread. A pool must outlive its leases (the engine's pools
// are members of the Engine base, destroyed after the sides' requests).
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

class StagingPool;
class EventPool;

// One staging slot: index() in [0, the pool's size). Move-only.
class StagingLease {
 public:
  StagingLease() = default;
  StagingLease(StagingLease&& o) noexcept
      : pool_(std::exchange(o.pool_, nullptr)), slot_(std::exchange(o.slot_, -1)) {}
  StagingLease& operator=(StagingLease&& o) noexcept {
    if (this != &o) {
      Reset();
      pool_ = std::exchange(o.pool_, nullptr);
      slot_ = std::exchange(o.slot_, -1);
    }
    return *this;
  }
  StagingLease(const StagingLease&) = delete;
  StagingLease& operator=(const StagingLease&) = delete;
  ~StagingLease() { Reset(); }

  explicit operator bool() const { return pool_ != nullptr; }
  // The slot's number; -1 when empty.
  int index() const { return slot_; }
  // Returns the slot now (nothing when empty).
  inline void Reset();

 private:
  friend class StagingPool;
  StagingLease(StagingPool* pool, int slot) : pool_(pool), slot_(slot) {}
  StagingPool* pool_ = nullptr;
  int slot_ = -1;
};

// A fixed set of slots, the most recently returned handed out first.
class StagingPool {
 public:
  explicit StagingPool(int count = 0) { Resize(count); }
  StagingPool(const StagingPool&) = delete;
  StagingPool& operator=(const StagingPool&) = delete;
  // Only while no lease is out.
  void Resize(int count) {
    free_.clear();
    for (int i = count - 1; i >= 0; --i) free_.push_back(i);
  }
  // An empty lease when every slot is out.
  StagingLease Acquire() {
    if (free_.empty()) return StagingLease();
    const int s = free_.back();
    free_.pop_back();
    in_use_.fetch_add(1, std::memory_order_relaxed);
    return StagingLease(this, s);
  }
  // Slots leased now (any thread).
  int64_t in_use() const { return in_use_.load(std::memory_order_relaxed); }
  size_t free() const { return free_.size(); }

 private:
  friend class StagingLease;
  void Return(int slot) {
    free_.push_back(slot);
    in_use_.fetch_sub(1, std::memory_order_relaxed);
  }
  std::vector<int> free_;
  std::atomic<int64_t> in_use_{0};
};

inline void StagingLease::Reset() {
  if (pool_ != nullptr) std::exchange(pool_, nullptr)->Return(std::exchange(slot_, -1));
}

// One pooled device event. Move-only.
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
  Event* operator->() const { return event_; }
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
