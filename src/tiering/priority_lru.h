// PriorityLru: the eviction order of one tier. Ids 0..n-1; each queued id has a priority
// 0..100; PopVictim takes the oldest id of the lowest non-empty priority. Intrusive lists over
// preallocated arrays: nothing is allocated after construction. Thread-compatible.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

namespace kvferry::tiering {

class PriorityLru {
 public:
  static constexpr int kLevels = 101;
  explicit PriorityLru(int64_t n) : prev_(n, -1), next_(n, -1), prio_(n, -1) {
    head_.fill(-1);
    tail_.fill(-1);
  }
  int64_t size() const { return size_; }
  bool Contains(int64_t id) const { return prio_[id] >= 0; }
  // Queues `id` as the newest of its priority. It must not be queued.
  void Push(int64_t id, int32_t priority) {
    prio_[id] = priority;
    prev_[id] = tail_[priority];
    next_[id] = -1;
    if (tail_[priority] >= 0) {
      next_[tail_[priority]] = id;
    } else {
      head_[priority] = id;
    }
    tail_[priority] = id;
    ++size_;
  }
  // Removes `id` if queued.
  void Remove(int64_t id) {
    const int32_t p = prio_[id];
    if (p < 0) return;
    if (prev_[id] >= 0) {
      next_[prev_[id]] = next_[id];
    } else {
      head_[p] = next_[id];
    }
    if (next_[id] >= 0) {
      prev_[next_[id]] = prev_[id];
    } else {
      tail_[p] = prev_[id];
    }
    prio_[id] = -1;
    --size_;
  }
  // The next victim (left queued), or -1.
  int64_t Peek() const {
    if (size_ == 0) return -1;
    for (int p = 0; p < kLevels; ++p) {
      if (head_[p] >= 0) return head_[p];
    }
    return -1;
  }
  int64_t PopVictim() {
    int64_t id = Peek();
    if (id >= 0) Remove(id);
    return id;
  }

 private:
  std::vector<int64_t> prev_, next_;
  std::vector<int32_t> prio_;
  std::array<int64_t, kLevels> head_{}, tail_{};
  int64_t size_ = 0;
};

}  // namespace kvferry::tiering
