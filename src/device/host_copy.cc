#include "device/host_copy.h"

#include <cstring>

#if defined(__x86_64__)
#include <emmintrin.h>
#define KVFERRY_HOST_COPY_STREAMS 1
#else
#define KVFERRY_HOST_COPY_STREAMS 0
#endif

namespace kvferry {
namespace {

constexpr size_t kLine = 64;
constexpr size_t kMinStreamedRow = 256;

#if KVFERRY_HOST_COPY_STREAMS
// `dst` 64-byte aligned, `bytes` a multiple of 64.
void StreamLines(std::byte* dst, const std::byte* src, size_t bytes) {
  for (size_t i = 0; i < bytes; i += kLine) {
    const auto* s = reinterpret_cast<const __m128i*>(src + i);
    auto* d = reinterpret_cast<__m128i*>(dst + i);
    const __m128i a = _mm_loadu_si128(s);
    const __m128i b = _mm_loadu_si128(s + 1);
    const __m128i c = _mm_loadu_si128(s + 2);
    const __m128i e = _mm_loadu_si128(s + 3);
    _mm_stream_si128(d, a);
    _mm_stream_si128(d + 1, b);
    _mm_stream_si128(d + 2, c);
    _mm_stream_si128(d + 3, e);
  }
}
#endif

}  // namespace

void CopyHostRows(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t bytes,
                  size_t rows, bool streaming) {
  auto* d = static_cast<std::byte*>(dst);
  const auto* s = static_cast<const std::byte*>(src);
#if KVFERRY_HOST_COPY_STREAMS
  if (streaming && bytes >= kMinStreamedRow) {
    for (size_t r = 0; r < rows; ++r, d += dst_pitch, s += src_pitch) {
      // Head: up to the destination's next line boundary; then whole lines; then the tail.
      const size_t head = (kLine - reinterpret_cast<uintptr_t>(d) % kLine) % kLine;
      std::memcpy(d, s, head);
      const size_t body = (bytes - head) / kLine * kLine;
      StreamLines(d + head, s + head, body);
      std::memcpy(d + head + body, s + head + body, bytes - head - body);
    }
    _mm_sfence();  // streaming stores are weakly ordered: make them visible like a memcpy's
    return;
  }
#else
  (void)streaming;
#endif
  for (size_t r = 0; r < rows; ++r, d += dst_pitch, s += src_pitch) std::memcpy(d, s, bytes);
}

bool UseStreamingStores(size_t total_bytes, size_t row_bytes, int64_t min_total_bytes) {
  return KVFERRY_HOST_COPY_STREAMS && min_total_bytes > 0 &&
         total_bytes >= static_cast<uint64_t>(min_total_bytes) && row_bytes >= kMinStreamedRow;
}

bool HostCopyCanStream() { return KVFERRY_HOST_COPY_STREAMS != 0; }

}  // namespace kvferry
