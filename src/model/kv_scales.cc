// KvScales (kv_model.h): the KV scales of a quantized cache, per tensor, per head or per block.
#include <fmt/format.h>

#include <cmath>

#include "kvferry/kv_model.h"

namespace kvferry {

std::string_view ScaleGranularityName(ScaleGranularity granularity) {
  switch (granularity) {
    case ScaleGranularity::kNone:
      return "none";
    case ScaleGranularity::kTensor:
      return "tensor";
    case ScaleGranularity::kHead:
      return "head";
    case ScaleGranularity::kBlock:
      return "block";
  }
  return "unknown";
}

int64_t KvScales::CountFor(ScaleGranularity granularity, const KvShape& shape) {
  const int64_t tensors = static_cast<int64_t>(shape.layers) * shape.kv_factor;
  switch (granularity) {
    case ScaleGranularity::kNone:
    case ScaleGranularity::kBlock:  // in the pool (BlockPool::block_scales), not here
      return 0;
    case ScaleGranularity::kTensor:
      return tensors;
    case ScaleGranularity::kHead:
      return tensors * shape.kv_heads;
  }
  return -1;
}

Status KvScales::Check(const KvShape& shape) const {
  const int64_t want = CountFor(granularity, shape);
  if (want < 0) {
    return Status::InvalidArgument(
        fmt::format("kv scales: granularity {} is unknown", static_cast<int>(granularity)));
  }
  if (static_cast<int64_t>(values.size()) != want) {
    return Status::InvalidArgument(fmt::format(
        "kv scales per {}: {} values, and the shape ({} layers, kv_factor {}, {} kv heads) takes "
        "{}",
        ScaleGranularityName(granularity), values.size(), shape.layers, shape.kv_factor,
        shape.kv_heads, want));
  }
  for (size_t i = 0; i < values.size(); ++i) {
    if (!std::isfinite(values[i]) || values[i] <= 0) {
      return Status::InvalidArgument(fmt::format(
          "kv scales: value {} is {}; scales must be finite and positive", i, values[i]));
    }
  }
  return Status::Ok();
}

float KvScales::At(const KvShape& shape, int64_t layer, int64_t kv, int64_t head) const {
  switch (granularity) {
    case ScaleGranularity::kNone:
    case ScaleGranularity::kBlock:  // per block: the pool's (BlockPool::block_scales)
      return 1.0f;
    case ScaleGranularity::kTensor:
      return values[static_cast<size_t>(layer * shape.kv_factor + kv)];
    case ScaleGranularity::kHead:
      return values[static_cast<size_t>((layer * shape.kv_factor + kv) * shape.kv_heads + head)];
  }
  return 1.0f;
}

}  // namespace kvferry
