// PriorityLru: the eviction order of one tier. Ids 0..n-1; each queued id has a priority
// 0..100; PopVictim takes the oldest id of the lowest non-empty priority. Intrusive lists over
// one preallocated array of nodes (links and priority of an id side by side: removing a prompt's
// prefix hits touches one cache line per id and its neighbours, not one in each of three
// arrays): nothing is allocated after construction. Thread-compatible.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

namespace kvferry::tiering {

class PriorityLru {
 public:
  static constexpr int kLevels = 101;
  explicit PriorityLru(int64_t n) : nodes_(static_cast<size_t>(n)) {
    head_.fill(-1);
    tail_.fill(-1);
  }
  int64_t size() const { return size_; }
  bool Contains(int64_t id) const { return nodes_[id].prio >= 0; }
  // Queues `id` as the newest of its priority. It must not be queued.
  void Push(int64_t id, int32_t priority) {
    Node& n = nodes_[id];
    n.prio = priority;
    n.prev = tail_[priority];
    n.next = -1;
    if (tail_[priority] >= 0) {
      nodes_[tail_[priority]].next = id;
    } else {
      head_[priority] = id;
    }
    tail_[priority] = id;
    ++size_;
  }
  // Removes `id` if queued.
  void Remove(int64_t id) {
    Node& n = nodes_[id];
    const int32_t p = n.prio;
    if (p < 0) return;
    if (n.prev >= 0) {
      nodes_[n.prev].next = n.next;
    } else {
      head_[p] = n.next;
    }
    if (n.next >= 0) {
      nodes_[n.next].prev = n.prev;
    } else {
      tail_[p] = n.prev;
    }
    n.prio = -1;
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
  struct Node {
    int64_t prev = -1, next = -1;
    int32_t prio = -1;  // -1: not queued
  };
  std::vector<Node> nodes_;
  std::array<int64_t, kLevels> head_{}, tail_{};
  int64_t size_ = 0;
};

}  // namespace kvferry::tiering
