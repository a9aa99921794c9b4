#include "device/cuda/desc_ring.h"

#include <algorithm>

namespace kvferry::internal::cuda {

StatusOr<GatherDesc*> DescRing::Reserve(size_t n) {
  Reclaim();
  size_t start = 0;
  if (!FindSpace(n, &start)) {
    KVF_RETURN_IF_ERROR(Grow(n));
    start = 0;
  }
  pending_start_ = start;
  pending_count_ = n;
  return static_cast<GatherDesc*>(region_.get()) + start;
}

Status DescRing::Commit(cudaStream_t stream) {
  EventHandle ev;
  if (!spare_.empty()) {
    ev = std::move(spare_.back());
    spare_.pop_back();
  } else {
    KVF_ASSIGN_OR_RETURN(ev, EventHandle::Create(false));
  }
  Status st = CudaCheck(cudaEventRecord(ev.get(), stream), "cudaEventRecord(descriptor ring)");
  if (!st.ok()) {
    spare_.push_back(std::move(ev));
    return st;
  }
  inflight_.push_back(Slice{pending_start_, pending_count_, std::move(ev)});
  head_ = pending_start_ + pending_count_;
  return Status::Ok();
}

void DescRing::Reclaim() {
  while (!inflight_.empty() && cudaEventQuery(inflight_.front().done.get()) == cudaSuccess) {
    spare_.push_back(std::move(inflight_.front().done));
    inflight_.erase(inflight_.begin());  // few slices in flight: a short move
  }
  cudaGetLastError();  // cudaErrorNotReady is not an error; real ones surface at Synchronize
  std::erase_if(retired_, [](Retired& r) { return cudaEventQuery(r.done.get()) == cudaSuccess; });
  cudaGetLastError();
  if (inflight_.empty()) head_ = 0;
}

bool DescRing::FindSpace(size_t n, size_t* start) const {
  if (n > capacity_) return false;
  if (inflight_.empty()) {
    *start = 0;
    return true;
  }
  const size_t tail = inflight_.front().start;
  if (head_ > tail) {  // busy [tail, head): free [head, cap) and [0, tail)
    if (capacity_ - head_ >= n) {
      *start = head_;
      return true;
    }
    if (tail >= n) {
      *start = 0;
      return true;
    }
    return false;
  }
  // busy [tail, cap) and [0, head) (head == tail: full)
  if (tail - head_ >= n) {
    *start = head_;
    return true;
  }
  return false;
}

Status DescRing::Grow(size_t n) {
  size_t cap = std::max(kInitialSlots, capacity_ * 2);
  while (cap < n) cap *= 2;
  KVF_ASSIGN_OR_RETURN(PinnedRegion bigger, PinnedRegion::Create(cap * sizeof(GatherDesc)));
  if (!inflight_.empty()) {
    // Stream order: the newest slice's event completes after every older launch.
    retired_.push_back(Retired{std::move(region_), std::move(inflight_.back().done)});
    inflight_.pop_back();
    for (Slice& s : inflight_) spare_.push_back(std::move(s.done));
    inflight_.clear();
  }
  region_ = std::move(bigger);
  capacity_ = cap;
  head_ = 0;
  return Status::Ok();
}

}  // namespace kvferry::internal::cuda
