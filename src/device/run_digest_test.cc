// The chunk digest on the host: the arithmetic the CUDA kernel runs (digest_core.h, lane by lane)
// equals libxxhash's XXH64 of every segment, over rows of any width, pitch and alignment; the
// host path (DigestOnHost) gives the same values; the combined digest changes when a byte flips,
// when two segments swap or when two runs swap, and ignores bytes between rows.
#include "device/run_digest.h"

#include <gtest/gtest.h>
#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <vector>

#include "device/digest_core.h"

namespace kvferry {
namespace {

// A run's packed bytes (rows back to back).
std::vector<uint8_t> Packed(const DigestRun& r) {
  std::vector<uint8_t> out;
  const auto* base = static_cast<const uint8_t*>(r.data);
  for (size_t i = 0; i < r.rows; ++i)
    out.insert(out.end(), base + i * r.pitch, base + i * r.pitch + r.bytes);
  return out;
}

// libxxhash's XXH64 of every segment of the packed bytes.
std::vector<uint64_t> Reference(std::span<const DigestRun> runs) {
  std::vector<uint64_t> out;
  for (const DigestRun& r : runs) {
    const std::vector<uint8_t> p = Packed(r);
    for (size_t at = 0; at < p.size(); at += kDigestSegmentBytes)
      out.push_back(XXH64(p.data() + at, std::min(kDigestSegmentBytes, p.size() - at), 0));
  }
  return out;
}

// What the kernel computes: four lanes per segment, then the merge and tail on lane 0.
std::vector<uint64_t> AsTheKernelDoes(std::span<const DigestRun> runs) {
  std::vector<uint64_t> out;
  for (const DigestRun& r : runs) {
    if (r.bytes == 0 || r.rows == 0) continue;
    const uint64_t total = r.bytes * r.rows;
    digest::RowCursor c{static_cast<const uint8_t*>(r.data), r.bytes, r.pitch};
    for (uint64_t start = 0; start < total; start += kDigestSegmentBytes) {
      const uint64_t len = std::min<uint64_t>(kDigestSegmentBytes, total - start);
      uint64_t v[4];
      for (int lane = 0; lane < 4; ++lane) v[lane] = digest::LaneAccumulate(c, start, len, lane);
      out.push_back(digest::SegmentFinish(c, start, len, v[0], v[1], v[2], v[3]));
    }
  }
  return out;
}

std::vector<uint64_t> OnHost(std::span<const DigestRun> runs) {
  std::vector<uint64_t> out(DigestSegmentCount(runs));
  internal::DigestOnHost(runs, out.data());
  return out;
}

uint64_t ChunkDigest(std::span<const DigestRun> runs) {
  return internal::CombineDigests(OnHost(runs));
}

// Random runs inside `mem`: row widths around the word, stripe and segment sizes, pitches with
// gaps, bases at every alignment.
std::vector<DigestRun> RandomRuns(std::mt19937_64& rng, std::vector<uint8_t>& mem) {
  static constexpr size_t kWidths[] = {1,   3,   7,    8,    24,   31,   32,    33,   100,
                                       128, 256, 1000, 4096, 4097, 5000, 16384, 65536};
  std::vector<DigestRun> runs;
  const int n = 1 + static_cast<int>(rng() % 6);
  for (int i = 0; i < n; ++i) {
    const size_t bytes = kWidths[rng() % std::size(kWidths)];
    const size_t rows = 1 + rng() % 24;
    const size_t pitch = bytes + rng() % 19;
    const size_t span = (rows - 1) * pitch + bytes;
    if (span + 8 > mem.size()) continue;
    const size_t at = rng() % (mem.size() - span);
    runs.push_back(DigestRun{mem.data() + at, bytes, rows, pitch});
  }
  return runs;
}

TEST(RunDigest, KernelArithmeticAndHostPathEqualXxh64OfEverySegment) {
  std::mt19937_64 rng(7);
  std::vector<uint8_t> mem(2 << 20);
  for (auto& b : mem) b = static_cast<uint8_t>(rng());
  for (int trial = 0; trial < 200; ++trial) {
    const std::vector<DigestRun> runs = RandomRuns(rng, mem);
    const std::vector<uint64_t> want = Reference(runs);
    ASSERT_EQ(DigestSegmentCount(runs), want.size()) << "trial " << trial;
    ASSERT_EQ(AsTheKernelDoes(runs), want) << "trial " << trial;
    ASSERT_EQ(OnHost(runs), want) << "trial " << trial;
  }
  // Edge sizes of one contiguous run: empty, shorter than a stripe, a stripe, a segment +- 1.
  for (size_t n :
       {size_t{0}, size_t{1}, size_t{31}, size_t{32}, size_t{63}, kDigestSegmentBytes - 1,
        kDigestSegmentBytes, kDigestSegmentBytes + 1, 3 * kDigestSegmentBytes + 13}) {
    const DigestRun r{mem.data() + 1, n, 1, 0};
    EXPECT_EQ(AsTheKernelDoes({&r, 1}), Reference({&r, 1})) << n << " bytes";
    EXPECT_EQ(OnHost({&r, 1}), Reference({&r, 1})) << n << " bytes";
  }
}

TEST(RunDigest, ZeroRowsOrBytesAddNoSegment) {
  std::vector<uint8_t> mem(64, 1);
  const DigestRun runs[] = {{mem.data(), 0, 5, 8}, {mem.data(), 8, 0, 8}, {mem.data(), 8, 1, 0}};
  EXPECT_EQ(DigestSegmentCount(runs), 1u);
  EXPECT_EQ(AsTheKernelDoes(runs).size(), 1u);
}

TEST(RunDigest, ChunkDigestCatchesAFlippedByteAndIgnoresGaps) {
  std::mt19937_64 rng(11);
  std::vector<uint8_t> mem(1 << 20);
  for (auto& b : mem) b = static_cast<uint8_t>(rng());
  // Head-sliced rows (256 of every 1024 bytes) and one contiguous run.
  const DigestRun runs[] = {{mem.data(), 256, 64, 1024}, {mem.data() + (512 << 10), 40000, 1, 0}};
  const uint64_t clean = ChunkDigest(runs);
  for (size_t at : {size_t{0}, size_t{255}, size_t{1024 + 7}, size_t{63 * 1024 + 255},
                    size_t{(512 << 10) + 4096}, size_t{(512 << 10) + 39999}}) {
    mem[at] ^= 0x01;
    EXPECT_NE(ChunkDigest(runs), clean) << "byte " << at << " flipped";
    mem[at] ^= 0x01;
  }
  mem[300] ^= 0xFF;  // between rows: not part of the chunk
  EXPECT_EQ(ChunkDigest(runs), clean);
  mem[300] ^= 0xFF;
  EXPECT_EQ(ChunkDigest(runs), clean);
}

TEST(RunDigest, ChunkDigestCatchesSwappedSegmentsAndSwappedRuns) {
  std::mt19937_64 rng(13);
  std::vector<uint8_t> mem(4 * kDigestSegmentBytes);
  for (auto& b : mem) b = static_cast<uint8_t>(rng());
  const DigestRun whole{mem.data(), 2 * kDigestSegmentBytes, 1, 0};
  const uint64_t clean = ChunkDigest({&whole, 1});
  // The same segments in the other order: the same segment digests, swapped.
  std::swap_ranges(mem.begin(), mem.begin() + kDigestSegmentBytes,
                   mem.begin() + kDigestSegmentBytes);
  EXPECT_NE(ChunkDigest({&whole, 1}), clean);
  // Two runs (pieces) in the other order.
  const DigestRun a{mem.data(), 100, 3, 200}, b{mem.data() + 2 * kDigestSegmentBytes, 5000, 1, 0};
  const DigestRun ab[] = {a, b}, ba[] = {b, a};
  EXPECT_NE(ChunkDigest(ab), ChunkDigest(ba));
}

}  // namespace
}  // namespace kvferry
