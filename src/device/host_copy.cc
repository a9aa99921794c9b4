#include "device/host_copy.h"

#include <algorithm>
#include <cstring>
#include <tuple>
#include <vector>

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

#if KVFERRY_HOST_COPY_STREAMS
// `bytes` (a multiple of 64) to a 64-byte aligned `d` with streaming stores.
inline void StreamAligned(std::byte* d, const std::byte* s, size_t bytes) {
  for (size_t i = 0; i < bytes; i += kLine) {
    const auto* from = reinterpret_cast<const __m128i*>(s + i);
    auto* to = reinterpret_cast<__m128i*>(d + i);
    const __m128i a = _mm_loadu_si128(from);
    const __m128i b = _mm_loadu_si128(from + 1);
    const __m128i c = _mm_loadu_si128(from + 2);
    const __m128i e = _mm_loadu_si128(from + 3);
    _mm_stream_si128(to, a);
    _mm_stream_si128(to + 1, b);
    _mm_stream_si128(to + 2, c);
    _mm_stream_si128(to + 3, e);
  }
}
#endif

// One row of `bytes`, with streaming stores for its whole destination lines when `streaming`.
void CopyRow(std::byte* d, const std::byte* s, size_t bytes, bool streaming) {
#if KVFERRY_HOST_COPY_STREAMS
  if (streaming && bytes >= kMinStreamedRow) {
    // Head and tail memcpy calls only when there are bytes to copy: two calls of nothing per
    // 256-byte row cost HND -> NHD half its rate (5.5 GB/s against 10.7).
    const size_t head = (kLine - reinterpret_cast<uintptr_t>(d) % kLine) % kLine;
    if (head) std::memcpy(d, s, head);
    const size_t body = (bytes - head) / kLine * kLine;
    for (size_t i = head; i < head + body; i += kLine) {
      const auto* from = reinterpret_cast<const __m128i*>(s + i);
      auto* to = reinterpret_cast<__m128i*>(d + i);
      const __m128i a = _mm_loadu_si128(from);
      const __m128i b = _mm_loadu_si128(from + 1);
      const __m128i c = _mm_loadu_si128(from + 2);
      const __m128i e = _mm_loadu_si128(from + 3);
      _mm_stream_si128(to, a);
      _mm_stream_si128(to + 1, b);
      _mm_stream_si128(to + 2, c);
      _mm_stream_si128(to + 3, e);
    }
    if (head + body < bytes) std::memcpy(d + head + body, s + head + body, bytes - head - body);
    return;
  }
#else
  (void)streaming;
#endif
  std::memcpy(d, s, bytes);
}

// A 3-D descriptor, walked in the destination's address order: rows outer when the planes
// interleave within one destination row step (HND -> NHD: a token's heads side by side), planes
// outer otherwise. Streaming stores are not fenced here: the caller fences once after its batch
// (a fence per descriptor drains the write-combining buffers every 64 KiB and halved the rate).
// Measured on the CPU machine (AMD EPYC, 2 cores), Llama-3-8B blocks of 8 heads x 32 tokens x
// 256 B, 128 MiB, streaming stores: HND -> NHD 10.2-11.0 GB/s in destination order with one fence
// against 4.6 plane by plane through CopyHostRows (a fence per plane); NHD -> HND 7.4-7.7 against
// 4.1 (one memcpy of the same bytes 6.9-7.1, the streaming flat copy 8.2-8.8).
void CopyPlanes(const CopyDesc& c, bool streaming) {
  const auto* s = static_cast<const std::byte*>(c.src);
  auto* d = static_cast<std::byte*>(c.dst);
  const size_t rows = std::max<size_t>(c.rows, 1);
  const bool rows_outer = c.dst_plane_pitch < c.dst_pitch;
  const size_t outer = rows_outer ? rows : c.planes;
  const size_t inner = rows_outer ? c.planes : rows;
  const size_t d_out = rows_outer ? c.dst_pitch : c.dst_plane_pitch;
  const size_t d_in = rows_outer ? c.dst_plane_pitch : c.dst_pitch;
  const size_t s_out = rows_outer ? c.src_pitch : c.src_plane_pitch;
  const size_t s_in = rows_outer ? c.src_plane_pitch : c.src_pitch;
#if KVFERRY_HOST_COPY_STREAMS
  const uintptr_t lines =
      reinterpret_cast<uintptr_t>(d) | c.dst_pitch | c.dst_plane_pitch | c.bytes;
  if (streaming && c.bytes >= kMinStreamedRow && lines % kLine == 0) {
    for (size_t o = 0; o < outer; ++o) {
      for (size_t i = 0; i < inner; ++i) {
        StreamAligned(d + o * d_out + i * d_in, s + o * s_out + i * s_in, c.bytes);
      }
    }
    return;
  }
#endif
  for (size_t o = 0; o < outer; ++o) {
    for (size_t i = 0; i < inner; ++i)
      CopyRow(d + o * d_out + i * d_in, s + o * s_out + i * s_in, c.bytes, streaming);
  }
}

}  // namespace

void CopyHostRowPieces(std::span<const RowPiece> pieces, const void* src, size_t src_pitch,
                       size_t rows, bool streaming) {
  const auto* s = static_cast<const std::byte*>(src);
  size_t width = 0;
  for (const RowPiece& p : pieces) width += p.bytes;
#if KVFERRY_HOST_COPY_STREAMS
  if (streaming && width >= kMinStreamedRow) {
    SourcePrefetch ahead(s, src_pitch, width, rows);
    for (size_t r = 0; r < rows; ++r, s += src_pitch) {
      ahead.StartRow(r);
      const std::byte* from = s;
      for (const RowPiece& p : pieces) {
        auto* d = static_cast<std::byte*>(p.dst) + r * p.dst_pitch;
        if (p.bytes < kMinStreamedRow) {  // would flush partial write-combining buffers
          std::memcpy(d, from, p.bytes);
        } else {
          // Head: up to the destination's next line boundary; then whole lines; then the tail.
          const size_t head = (kLine - reinterpret_cast<uintptr_t>(d) % kLine) % kLine;
          std::memcpy(d, from, head);
          const size_t body = (p.bytes - head) / kLine * kLine;
          StreamLines(d + head, from + head, body, ahead);
          std::memcpy(d + head + body, from + head + body, p.bytes - head - body);
        }
        from += p.bytes;
      }
    }
    _mm_sfence();  // streaming stores are weakly ordered: make them visible like a memcpy's
    return;
  }
#else
  (void)streaming;
#endif
  for (size_t r = 0; r < rows; ++r, s += src_pitch) {
    const std::byte* from = s;
    for (const RowPiece& p : pieces) {
      std::memcpy(static_cast<std::byte*>(p.dst) + r * p.dst_pitch, from, p.bytes);
      from += p.bytes;
    }
  }
}

void CopyHostRows(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t bytes,
                  size_t rows, bool streaming) {
  const RowPiece piece{dst, dst_pitch, bytes};
  CopyHostRowPieces({&piece, 1}, src, src_pitch, rows, streaming);
}

void CopyHostBatch(std::span<CopyDesc> copies, int64_t streaming_min_bytes) {
  size_t total = 0;
  for (const CopyDesc& c : copies) total += c.bytes * std::max<size_t>(c.rows, 1) * c.planes;
  // Pitched descriptors (a slice of each source row) first, sorted so that the slices of the same
  // rows sit next to each other in source order; the rest keep their order at the end.
  const auto pitched = [](const CopyDesc& c) {
    return c.planes == 1 && c.rows > 1 && c.bytes > 0 && c.bytes < c.src_pitch;
  };
  const auto rest = std::stable_partition(copies.begin(), copies.end(), pitched);
  std::sort(copies.begin(), rest, [](const CopyDesc& a, const CopyDesc& b) {
    return std::tuple(a.rows, a.src_pitch, reinterpret_cast<uintptr_t>(a.src)) <
           std::tuple(b.rows, b.src_pitch, reinterpret_cast<uintptr_t>(b.src));
  });
  std::vector<RowPiece> pieces;
  for (auto it = copies.begin(); it != rest;) {
    // A group: descriptors whose slices follow each other within one source row.
    const CopyDesc& first = *it;
    size_t width = 0;
    pieces.clear();
    for (; it != rest && it->rows == first.rows && it->src_pitch == first.src_pitch &&
           it->src == static_cast<const std::byte*>(first.src) + width &&
           width + it->bytes <= first.src_pitch;
         ++it) {
      pieces.push_back({it->dst, it->dst_pitch, it->bytes});
      width += it->bytes;
    }
    CopyHostRowPieces(pieces, first.src, first.src_pitch, first.rows,
                      UseStreamingStores(total, width, streaming_min_bytes));
  }
  bool fence = false;  // streaming planes copied: fence once at the end
  for (auto it = rest; it != copies.end(); ++it) {
    const bool streaming = UseStreamingStores(total, it->bytes, streaming_min_bytes);
    if (it->planes > 1) {
      CopyPlanes(*it, streaming);
      fence = fence || streaming;
    } else {
      CopyHostRows(it->dst, it->dst_pitch, it->src, it->src_pitch, it->bytes,
                   std::max<size_t>(it->rows, 1), streaming);
    }
  }
#if KVFERRY_HOST_COPY_STREAMS
  if (fence) _mm_sfence();  // streaming stores are weakly ordered: make them visible
#else
  (void)fence;
#endif
}

bool UseStreamingStores(size_t total_bytes, size_t row_bytes, int64_t min_total_bytes) {
  return KVFERRY_HOST_COPY_STREAMS && min_total_bytes > 0 &&
         total_bytes >= static_cast<uint64_t>(min_total_bytes) && row_bytes >= kMinStreamedRow;
}

bool HostCopyCanStream() { return KVFERRY_HOST_COPY_STREAMS != 0; }

}  // namespace kvferry
