#include "kvferry/metrics.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace kvferry {

double LatencyHistogram::UpperBound(int i) {
  if (i >= kBuckets) return std::numeric_limits<double>::infinity();
  return std::ldexp(1e-6, i);
}

int LatencyHistogram::BucketOf(double seconds) {
  for (int i = 0; i < kBuckets; ++i) {
    if (seconds <= UpperBound(i)) return i;
  }
  return kBuckets;
}

void LatencyHistogram::Add(double seconds) {
  ++counts_[BucketOf(seconds)];
  ++count_;
  sum_ += seconds;
}

double LatencyHistogram::Quantile(double q) const {
  if (count_ == 0) return 0;
  const auto rank = static_cast<int64_t>(std::ceil(q * static_cast<double>(count_)));
  int64_t seen = 0;
  for (int i = 0; i <= kBuckets; ++i) {
    seen += counts_[i];
    if (seen >= std::max<int64_t>(rank, 1)) return UpperBound(i);
  }
  return UpperBound(kBuckets);
}

}  // namespace kvferry
