#include "device/cuda/copy_engine_batch.h"

#include <algorithm>

#include "device/cuda/cuda_util.h"

namespace kvferry::internal::cuda {
namespace {

// A 2-D fragment is expanded into at most this many list entries.
constexpr size_t kMaxListedRows = 256;
// Entries per cudaMemcpyBatchAsync call (the attribute arrays are per call).
constexpr size_t kMaxPerCall = 4096;

}  // namespace

void CopyEngineBatch::Clear() {
  dsts_.clear();
  srcs_.clear();
  sizes_.clear();
  singles_.clear();
  rects_.clear();
}

void CopyEngineBatch::Add(const CopyDesc& c, bool pageable) {
  const size_t rows = std::max<size_t>(c.rows, 1);
  if (pageable) {
    if (rows == 1) {
      singles_.push_back(c);
    } else {
      rects_.push_back(c);
    }
    return;
  }
  if (rows == 1) {
    dsts_.push_back(c.dst);
    srcs_.push_back(c.src);
    sizes_.push_back(c.bytes);
    return;
  }
  if (c.bytes < list_row_ || rows > kMaxListedRows) {
    rects_.push_back(c);
    return;
  }
  for (size_t r = 0; r < rows; ++r) {
    dsts_.push_back(static_cast<std::byte*>(c.dst) + r * c.dst_pitch);
    srcs_.push_back(static_cast<const std::byte*>(c.src) + r * c.src_pitch);
    sizes_.push_back(c.bytes);
  }
}

Status CopyEngineBatch::Submit(cudaStream_t stream) {
  for (const CopyDesc& c : singles_) {
    KVF_RETURN_IF_ERROR(CudaCheck(cudaMemcpyAsync(c.dst, c.src, c.bytes, cudaMemcpyDefault, stream),
                                  "cuda:{} CopyBatch cudaMemcpyAsync({} bytes)", ordinal_,
                                  c.bytes));
  }
  for (const CopyDesc& c : rects_) {
    KVF_RETURN_IF_ERROR(
        CudaCheck(cudaMemcpy2DAsync(c.dst, c.dst_pitch, c.src, c.src_pitch, c.bytes, c.rows,
                                    cudaMemcpyDefault, stream),
                  "cuda:{} CopyBatch cudaMemcpy2DAsync({} rows of {} bytes, pitches {}/{})",
                  ordinal_, c.rows, c.bytes, c.dst_pitch, c.src_pitch));
  }
  if (dsts_.empty()) return Status::Ok();
  if (!batched_ || dsts_.size() == 1) return SubmitOneByOne(stream);
  cudaMemcpyAttributes attr{};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;  // sources are written by earlier work
  attr.flags = cudaMemcpyFlagDefault;
  for (size_t at = 0; at < dsts_.size(); at += kMaxPerCall) {
    const size_t n = std::min(kMaxPerCall, dsts_.size() - at);
    size_t first = 0;
    cudaError_t err = cudaMemcpyBatchAsync(dsts_.data() + at, srcs_.data() + at, sizes_.data() + at,
                                           n, &attr, &first, 1, stream);
    if (err == cudaSuccess) continue;
    if (at == 0 && (err == cudaErrorNotSupported || err == cudaErrorCallRequiresNewerDriver)) {
      // An older driver: one call per fragment from now on (nothing of this batch was queued).
      cudaGetLastError();
      batched_ = false;
      return SubmitOneByOne(stream);
    }
    return CudaError(err, fmt::format("cuda:{} cudaMemcpyBatchAsync({} copies, {} bytes first)",
                                      ordinal_, n, sizes_[at]));
  }
  return Status::Ok();
}

Status CopyEngineBatch::SubmitOneByOne(cudaStream_t stream) {
  for (size_t i = 0; i < dsts_.size(); ++i) {
    KVF_RETURN_IF_ERROR(
        CudaCheck(cudaMemcpyAsync(dsts_[i], srcs_[i], sizes_[i], cudaMemcpyDefault, stream),
                  "cuda:{} CopyBatch cudaMemcpyAsync({} bytes)", ordinal_, sizes_[i]));
  }
  return Status::Ok();
}

}  // namespace kvferry::internal::cuda
