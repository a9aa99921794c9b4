#include "device/host_copy.h"

#include <cstring>

#if defined(__x86_64__)
#include <emmintrin.h>
#include <xmmintrin.h>
#define KVFERRY_HOST_COPY_STREAMS 1
#else
#define KVFERRY_HOST_COPY_STREAMS 0
#endif

namespace kvferry {
namespace {

constexpr size_t kLine = 64;
constexpr size_t kMinStreamedRow = 256;

#if KVFERRY_HOST_COPY_STREAMS
// Software prefetch of the source, kPrefetchAhead bytes ahead of the copy in the order the rows are
// read (the end of a row reaches into the next row's start). The hardware prefetchers follow one
// address stream and lose it at every jump of a pitched copy: on the 2-core CI machine (AMD EPYC)
// streaming 16 KiB rows from a 32 KiB source pitch, a TP2->TP4 head slice, ran at 7-9 GB/s against
// 14-23 with this prefetch (CopyHostRows over 64 MiB, medians of 25); contiguous 4 MiB copies
// stayed at 17-19 GB/s.
constexpr size_t kPrefetchAhead = 8192;

class SourcePrefetch {
 public:
  SourcePrefetch(const std::byte* src, size_t src_pitch, size_t bytes, size_t rows)
      : src_(src),
        pitch_(src_pitch),
        bytes_(bytes),
        rows_(rows),
        ahead_rows_(kPrefetchAhead / bytes),
        ahead_off_(kPrefetchAhead % bytes) {}
  // At the start of row r (a row's unaligned head and tail are not lines: each row starts over).
  void StartRow(size_t r) {
    row_ = r + ahead_rows_;
    off_ = ahead_off_;
  }
  // Called once per line copied: prefetches the line kPrefetchAhead bytes of rows further on.
  void Next() {
    if (row_ >= rows_) return;
    _mm_prefetch(reinterpret_cast<const char*>(src_ + row_ * pitch_ + off_), _MM_HINT_T0);
    off_ += kLine;
    if (off_ >= bytes_) {
      off_ = 0;
      ++row_;
    }
  }

 private:
  const std::byte* src_;
  size_t pitch_, bytes_, rows_;
  size_t ahead_rows_, ahead_off_;  // kPrefetchAhead in whole rows and the rest
  size_t row_ = 0, off_ = 0;
};

// `dst` 64-byte aligned, `bytes` a multiple of 64.
void StreamLines(std::byte* dst, const std::byte* src, size_t bytes, SourcePrefetch& ahead) {
  for (size_t i = 0; i < bytes; i += kLine) {
    ahead.Next();
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
    SourcePrefetch ahead(s, src_pitch, bytes, rows);
    for (size_t r = 0; r < rows; ++r, d += dst_pitch, s += src_pitch) {
      ahead.StartRow(r);
      // Head: up to the destination's next line boundary; then whole lines; then the tail.
      const size_t head = (kLine - reinterpret_cast<uintptr_t>(d) % kLine) % kLine;
      std::memcpy(d, s, head);
      const size_t body = (bytes - head) / kLine * kLine;
      StreamLines(d + head, s + head, body, ahead);
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
