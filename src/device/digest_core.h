// The segment digest's arithmetic, shared by the host and the CUDA kernel (digest_kernel.cu).
//
// Why one header for both: a chunk digest (run_digest.h) is only useful if the side that sends and
// the side that receives compute the same value wherever the bytes are (CPU or GPU). XXH64 and the
// walk over a run's rows are written once here, as plain functions with no library calls, compiled
// by nvcc for the kernel and by the host compiler for tests (run_digest_test.cc checks them, lane
// by lane as the kernel runs them, against libxxhash's XXH64 on the host).
//
// How the kernel splits a segment: XXH64 keeps four independent accumulators, lane j consuming the
// 8-byte word at offset 32 k + 8 j of every 32-byte stripe k. Four threads take one lane each
// (LaneAccumulate) and lane 0 merges them and hashes the tail (SegmentFinish); the result equals
// XXH64(segment bytes, seed 0).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define KVF_HD __host__ __device__ __forceinline__
#define KVF_UNROLL _Pragma("unroll")
#else
#define KVF_HD inline
#define KVF_UNROLL
#endif

namespace kvferry::digest {

// Bytes per segment: kDigestSegmentBytes of kvferry/device.h (run_digest.cc checks they agree;
// this header stays free of the public one, which nvcc need not see).
inline constexpr uint64_t kSegmentBytes = 4096;

inline constexpr uint64_t kP1 = 0x9E3779B185EBCA87ULL;
inline constexpr uint64_t kP2 = 0xC2B2AE3D27D4EB4FULL;
inline constexpr uint64_t kP3 = 0x165667B19E3779F9ULL;
inline constexpr uint64_t kP4 = 0x85EBCA77C2B2AE63ULL;
inline constexpr uint64_t kP5 = 0x27D4EB2F165667C5ULL;

KVF_HD uint64_t Rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
KVF_HD uint64_t Round(uint64_t acc, uint64_t input) {
  acc += input * kP2;
  return Rotl(acc, 31) * kP1;
}
KVF_HD uint64_t MergeRound(uint64_t acc, uint64_t val) {
  acc ^= Round(0, val);
  return acc * kP1 + kP4;
}
// Lane j's initial accumulator (seed 0).
KVF_HD uint64_t LaneInit(int lane) {
  return lane == 0 ? kP1 + kP2 : lane == 1 ? kP2 : lane == 2 ? 0 : 0 - kP1;
}

// Reads the packed bytes of a run (rows of `bytes` bytes, `pitch` apart) from a position given as
// (row, col), little-endian, advancing as it goes. Words inside one row at an 8-byte aligned
// address are one load; the rest are put together byte by byte.
struct RowCursor {
  const uint8_t* data;
  uint64_t bytes;  // per row, > 0
  uint64_t pitch;
  uint64_t row = 0;
  uint64_t col = 0;

  KVF_HD void Seek(uint64_t offset) {
    row = offset / bytes;
    col = offset % bytes;
  }
  KVF_HD void Skip(uint64_t n) {  // n is at most 24: a loop, no 64-bit division
    col += n;
    while (col >= bytes) {
      col -= bytes;
      ++row;
    }
  }
  KVF_HD uint8_t Byte() {
    const uint8_t v = data[row * pitch + col];
    Skip(1);
    return v;
  }
  KVF_HD uint64_t Bytes(int n) {  // n <= 8, little-endian
    uint64_t v = 0;
    for (int i = 0; i < n; ++i) v |= static_cast<uint64_t>(Byte()) << (8 * i);
    return v;
  }
  KVF_HD uint64_t Word() {
    const uint8_t* p = data + row * pitch + col;
    if (col + 8 <= bytes && (reinterpret_cast<uintptr_t>(p) & 7) == 0) {
      Skip(8);
      return *reinterpret_cast<const uint64_t*>(p);
    }
    return Bytes(8);
  }
};

// Lane `lane` (0..3) of the segment [start, start + len) of a run: its accumulator after every
// full 32-byte stripe (the initial value when len < 32). Eight words are loaded before any is
// used: on a GPU, a chunk of a few MiB is only a few thousand lanes, too few to hide memory
// latency one load at a time.
KVF_HD uint64_t LaneAccumulate(RowCursor c, uint64_t start, uint64_t len, int lane) {
  constexpr int kInFlight = 8;
  uint64_t acc = LaneInit(lane);
  const uint64_t stripes = len / 32;
  c.Seek(start + 8 * static_cast<uint64_t>(lane));
  uint64_t k = 0;
  for (; k + kInFlight <= stripes; k += kInFlight) {
    uint64_t w[kInFlight];
    KVF_UNROLL
    for (int u = 0; u < kInFlight; ++u) {
      w[u] = c.Word();
      c.Skip(24);
    }
    KVF_UNROLL
    for (int u = 0; u < kInFlight; ++u) acc = Round(acc, w[u]);
  }
  for (; k < stripes; ++k) {
    acc = Round(acc, c.Word());
    c.Skip(24);
  }
  return acc;
}

// XXH64 of the segment from the four lanes' accumulators (ignored when len < 32): the merge, the
// tail after the last full stripe and the avalanche.
KVF_HD uint64_t SegmentFinish(RowCursor c, uint64_t start, uint64_t len, uint64_t v1, uint64_t v2,
                              uint64_t v3, uint64_t v4) {
  uint64_t h;
  if (len >= 32) {
    h = Rotl(v1, 1) + Rotl(v2, 7) + Rotl(v3, 12) + Rotl(v4, 18);
    h = MergeRound(h, v1);
    h = MergeRound(h, v2);
    h = MergeRound(h, v3);
    h = MergeRound(h, v4);
  } else {
    h = kP5;
  }
  h += len;
  uint64_t rest = len % 32;
  c.Seek(start + len - rest);
  while (rest >= 8) {
    h ^= Round(0, c.Word());
    h = Rotl(h, 27) * kP1 + kP4;
    rest -= 8;
  }
  if (rest >= 4) {
    h ^= c.Bytes(4) * kP1;
    h = Rotl(h, 23) * kP2 + kP3;
    rest -= 4;
  }
  while (rest > 0) {
    h ^= c.Byte() * kP5;
    h = Rotl(h, 11) * kP1;
    --rest;
  }
  h ^= h >> 33;
  h *= kP2;
  h ^= h >> 29;
  h *= kP3;
  h ^= h >> 32;
  return h;
}

}  // namespace kvferry::digest
