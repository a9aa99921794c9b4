// Copy-engine submission of a CopyBatch: the fragments a CUDA stream routes to the copy engines
// (large ones, ones a kernel can't reach, or small ones of a direction configured for the copy
// engine), gathered and submitted with as few driver calls as possible.
//
// Why: one cudaMemcpyAsync per fragment costs a driver call (~2 us) per fragment; with shuffled
// 2 MiB blocks that gap alone kept the tier copies at 0.91 of one contiguous copy on the H200.
// cudaMemcpyBatchAsync (CUDA 12.8+) takes the whole list in one call and lets the driver keep the
// copy engine busy. 2-D fragments whose rows are wide enough are expanded into their rows (one
// list entry each); narrow-row 2-D fragments stay cudaMemcpy2DAsync (one call, the engine walks
// the rows). Pageable host memory never goes into the batch (the driver stages it; the plain call
// is the documented path).
//
// Private to src/device/cuda/. Not thread-safe: one per stream, used by the stream's thread.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <vector>

#include "kvferry/device.h"
#include "kvferry/status.h"

namespace kvferry::internal::cuda {

class CopyEngineBatch {
 public:
  // `batched`: submit through cudaMemcpyBatchAsync (falls back to one call per fragment, for
  // good, when the runtime or driver does not support it). `ordinal`: for error messages.
  // `list_row`: 2-D fragments with rows at least this wide are listed row by row
  // (cuda.copy_engine_list_row_bytes); narrower ones go to cudaMemcpy2DAsync.
  CopyEngineBatch(int ordinal, bool batched, size_t list_row = 16 << 10)
      : ordinal_(ordinal), batched_(batched), list_row_(list_row) {}

  void Clear();
  // Adds one fragment. `pageable`: one end is pageable host memory (never batched).
  void Add(const CopyDesc& c, bool pageable);
  bool empty() const { return dsts_.empty() && singles_.empty() && rects_.empty(); }
  size_t entries() const { return dsts_.size(); }
  // Enqueues everything added since Clear() on `stream`.
  Status Submit(cudaStream_t stream);
  // True once cudaMemcpyBatchAsync was found unsupported (then every submit is one call each).
  bool fell_back() const { return !batched_; }

 private:
  Status SubmitOneByOne(cudaStream_t stream);

  const int ordinal_;
  bool batched_;
  const size_t list_row_;
  std::vector<void*> dsts_;
  std::vector<const void*> srcs_;
  std::vector<size_t> sizes_;
  std::vector<CopyDesc> singles_;  // pageable: cudaMemcpyAsync each
  std::vector<CopyDesc> rects_;    // narrow rows: cudaMemcpy2DAsync each
};

}  // namespace kvferry::internal::cuda
