#include "device/run_digest.h"

#include <xxhash.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <vector>

#include "device/digest_core.h"

namespace kvferry {

static_assert(kDigestSegmentBytes == digest::kSegmentBytes);

size_t DigestSegmentCount(std::span<const DigestRun> runs) {
  size_t n = 0;
  for (const DigestRun& r : runs) {
    if (r.bytes == 0 || r.rows == 0) continue;
    n += (r.bytes * r.rows + kDigestSegmentBytes - 1) / kDigestSegmentBytes;
  }
  return n;
}

Status Stream::Digest(std::span<const DigestRun> runs, uint64_t* out) {
  return HostCallback([runs = std::vector<DigestRun>(runs.begin(), runs.end()), out] {
    internal::DigestOnHost(runs, out);
  });
}

namespace internal {

void DigestOnHost(std::span<const DigestRun> runs, uint64_t* out) {
  alignas(64) std::byte segment[kDigestSegmentBytes];
  for (const DigestRun& r : runs) {
    if (r.bytes == 0 || r.rows == 0) continue;
    const auto* base = static_cast<const std::byte*>(r.data);
    if (r.rows == 1) {  // contiguous: one call per segment
      for (size_t off = 0; off < r.bytes; off += kDigestSegmentBytes)
        *out++ = XXH64(base + off, std::min(kDigestSegmentBytes, r.bytes - off), 0);
      continue;
    }
    // Rows back to back, cut every kDigestSegmentBytes of the packed bytes, each segment gathered
    // into one buffer first: memcpy streams short strided rows in several times faster than
    // XXH64's own loads do (0.7 against 9 GB/s for 256-byte rows 1 KiB apart, measured).
    size_t in_segment = 0;
    for (size_t row = 0; row < r.rows; ++row) {
      const std::byte* p = base + row * r.pitch;
      size_t left = r.bytes;
      while (left > 0) {
        const size_t take = std::min(left, kDigestSegmentBytes - in_segment);
        std::memcpy(segment + in_segment, p, take);
        p += take;
        left -= take;
        in_segment += take;
        if (in_segment == kDigestSegmentBytes) {
          *out++ = XXH64(segment, kDigestSegmentBytes, 0);
          in_segment = 0;
        }
      }
    }
    if (in_segment > 0) *out++ = XXH64(segment, in_segment, 0);
  }
}

uint64_t CombineDigests(std::span<const uint64_t> digests) {
  static_assert(std::endian::native == std::endian::little,
                "the chunk digest hashes the segment digests as little-endian bytes");
  return XXH3_64bits(digests.data(), digests.size_bytes());
}

}  // namespace internal
}  // namespace kvferry
