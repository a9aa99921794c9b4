// Host-memory copies of the CPU device, and the choice between cached and streaming stores.
//
// Why this exists: a memcpy larger than the caches writes every destination line twice over the
// memory bus. A regular store first reads the line it writes (read for ownership), so a copy of N
// bytes moves 3N; a non-temporal ("streaming") store writes whole lines straight to memory and
// moves 2N. glibc switches to streaming stores only above x86_non_temporal_threshold (240 MiB on
// the 2-core CI machine), so every copy of a KV transfer (4 MiB blocks, batches of at most 64 MiB)
// took the 3N path: measured on that machine, per CPU second of the copying thread, 8.8 GB/s for
// glibc memcpy in 4 MiB pieces, 10.8 GB/s for one 256 MiB glibc memcpy (its streaming path),
// 14.5-15.7 GB/s for CopyHostBytes' streaming loop in 4 MiB or 16 KiB pieces.
//
// The cost of streaming: the destination is not left in the caches. That is right for what the
// CPU device copies in bulk (KV bytes for another process's pool, an offloaded block), wrong for
// a small buffer read right after, hence the threshold on the size of the whole operation (knob
// cpu.streaming_copy_min_bytes, 1 MiB: the L2 of a core here; a TP2->TP4 peer batch of a
// 128-token Llama-3-8B request is 4 MiB of 16 KiB rows, and at 8 MiB it was left to memcpy).
//
// Thread-safety: pure functions of their arguments.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "kvferry/device.h"

namespace kvferry {

// Copies `rows` rows of `bytes` each, row r from `src + r * src_pitch` to `dst + r * dst_pitch`
// (not overlapping), with streaming stores where `streaming` and the platform has them (x86-64:
// SSE2 movntdq, 64 bytes per step; each row's unaligned destination head and its tail go through
// memcpy), else memcpy. A streaming copy prefetches its source 8 KiB ahead in row order (across
// row ends): a pitched source loses the hardware prefetchers at every row (2.4x slower at
// TP2->TP4's 16 KiB head slices without it). Stores are fenced once before it returns: the bytes
// are visible to other threads and processes as after a memcpy.
void CopyHostRows(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t bytes,
                  size_t rows, bool streaming);
inline void CopyHostBytes(void* dst, const void* src, size_t bytes, bool streaming) {
  CopyHostRows(dst, bytes, src, bytes, bytes, 1, streaming);
}

// One destination of CopyHostRowPieces: `bytes` of each source row to `dst + r * dst_pitch`.
struct RowPiece {
  void* dst;
  size_t dst_pitch;
  size_t bytes;
};

// CopyHostRows for source rows cut into pieces that go to different places: each row of `src`
// (row r at `src + r * src_pitch`) is read once, front to back, its first pieces[0].bytes to
// pieces[0], the next pieces[1].bytes to pieces[1], and so on. One pass with one prefetch stream
// over the whole width, where a copy per piece would read each row's pieces as separate strided
// streams. Pieces shorter than 256 bytes go through memcpy.
void CopyHostRowPieces(std::span<const RowPiece> pieces, const void* src, size_t src_pitch,
                       size_t rows, bool streaming);

// Copies every descriptor of a Stream::CopyBatch, in no particular order (destinations must not
// overlap; `copies` is reordered). Pitched descriptors that take adjacent slices of the same
// source rows (a TP2->TP4 peer batch takes a request's two 16 KiB head slices of every 32 KiB row
// as two descriptors when their ranges are fetched together) become one CopyHostRowPieces. The
// whole batch streams when it writes at least `streaming_min_bytes` (UseStreamingStores).
void CopyHostBatch(std::span<CopyDesc> copies, int64_t streaming_min_bytes);

// Whether an operation that writes `total_bytes` in rows of `row_bytes` streams: the total is at
// least `min_total_bytes` (0: never) and a row is long enough to fill whole cache lines (256
// bytes; shorter rows would flush partial write-combining buffers).
bool UseStreamingStores(size_t total_bytes, size_t row_bytes, int64_t min_total_bytes);

// Whether CopyHostBytes has a streaming path on this build (false: it is memcpy throughout).
bool HostCopyCanStream();

}  // namespace kvferry
