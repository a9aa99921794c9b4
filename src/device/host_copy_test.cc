// The CPU device's host copies (host_copy.h): streaming and cached stores give the same bytes for
// every destination alignment, row length and pitch, never touch a byte outside the rows, and the
// threshold picks streaming only for large operations of long rows; a CPU stream's copies above
// cpu.streaming_copy_min_bytes land intact.
#include "device/host_copy.h"

#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "kvferry/config.h"
#include "kvferry/device.h"

namespace kvferry {
namespace {

std::vector<std::byte> Pattern(size_t n, uint32_t seed) {
  std::vector<std::byte> v(n);
  uint32_t x = seed * 2654435761u + 1;
  for (auto& b : v) {
    x = x * 1664525u + 1013904223u;
    b = static_cast<std::byte>(x >> 24);
  }
  return v;
}

TEST(HostCopy, StreamingAndCachedCopiesAgreeForEveryAlignmentAndLength) {
  const std::vector<std::byte> src = Pattern(1 << 16, 7);
  for (bool streaming : {false, true}) {
    for (size_t dst_off : {0, 1, 15, 16, 63, 64, 100}) {
      for (size_t src_off : {0, 3, 64}) {
        for (size_t n : {0, 1, 63, 64, 255, 256, 257, 1000, 4096, 4096 + 65, 40000}) {
          std::vector<std::byte> dst(n + 256, std::byte{0xee});
          CopyHostBytes(dst.data() + dst_off, src.data() + src_off, n, streaming);
          ASSERT_EQ(std::memcmp(dst.data() + dst_off, src.data() + src_off, n), 0)
              << "streaming " << streaming << " dst+" << dst_off << " src+" << src_off << " n "
              << n;
          for (size_t i = 0; i < dst.size(); ++i) {
            if (i < dst_off || i >= dst_off + n) {
              ASSERT_EQ(dst[i], std::byte{0xee}) << "byte " << i << " outside the copy, n " << n;
            }
          }
        }
      }
    }
  }
}

TEST(HostCopy, RowsWithPitchesLandAndLeaveTheGapsAlone) {
  const size_t rows = 37, row = 300, src_pitch = 333, dst_pitch = 513;
  const std::vector<std::byte> src = Pattern(rows * src_pitch, 3);
  for (bool streaming : {false, true}) {
    std::vector<std::byte> dst(rows * dst_pitch + 64, std::byte{0x5a});
    CopyHostRows(dst.data() + 5, dst_pitch, src.data() + 1, src_pitch, row, rows, streaming);
    for (size_t r = 0; r < rows; ++r) {
      ASSERT_EQ(std::memcmp(dst.data() + 5 + r * dst_pitch, src.data() + 1 + r * src_pitch, row), 0)
          << "row " << r;
      const size_t gap_end = r + 1 < rows ? 5 + (r + 1) * dst_pitch : dst.size();
      for (size_t i = 5 + r * dst_pitch + row; i < gap_end; ++i) {
        ASSERT_EQ(dst[i], std::byte{0x5a}) << "gap after row " << r;
      }
    }
  }
}

TEST(HostCopy, StreamsOnlyLargeOperationsOfLongRows) {
  const bool can = HostCopyCanStream();
  EXPECT_EQ(UseStreamingStores(size_t{64} << 20, size_t{4} << 20, int64_t{8} << 20), can);
  EXPECT_EQ(UseStreamingStores(size_t{8} << 20, 16384, int64_t{8} << 20), can);
  EXPECT_FALSE(UseStreamingStores((size_t{8} << 20) - 1, 16384, int64_t{8} << 20));
  EXPECT_FALSE(UseStreamingStores(size_t{64} << 20, 255, int64_t{8} << 20));  // short rows
  EXPECT_FALSE(UseStreamingStores(size_t{64} << 20, size_t{4} << 20, 0));     // knob: never
  // By default a TP2->TP4 peer batch of a 128-token Llama-3-8B request streams: 4 MiB of 16 KiB
  // rows (8 MiB, the first default, left it to memcpy).
  const int64_t knob = Config::Global().Int("cpu.streaming_copy_min_bytes");
  EXPECT_EQ(UseStreamingStores(size_t{4} << 20, 16384, knob), can) << knob;
}

// CopyHostBatch lands every piece of source rows sliced by several descriptors, whatever their
// order, with duplicated slices, another pitch, pieces under 256 bytes and contiguous copies in
// the same batch, streaming or not, and writes nothing between the pieces.
TEST(HostCopy, BatchOfPiecesOfTheSameRowsLandsEveryPiece) {
  const size_t rows = 29, pitch = 4096, other_pitch = 3000;
  const std::vector<std::byte> src = Pattern(rows * pitch, 5);
  const std::vector<std::byte> other = Pattern(rows * other_pitch, 6);
  for (int64_t min : {0, 1}) {
    std::vector<std::byte> dst(1 << 20, std::byte{0x77});
    std::byte* d = dst.data();
    const std::byte* s = src.data();
    struct Expect {
      size_t dst_off, dst_pitch;
      const std::byte* src;
      size_t src_pitch, bytes, rows;
    };
    // Halves and quarters of the same rows out of order, one slice twice, a short piece, a slice
    // of rows of another pitch, and a contiguous copy.
    const std::vector<Expect> want = {
        {0, 2048, s + 2048, pitch, 2048, rows},
        {70000, 1024, s + 1024, pitch, 1024, rows},
        {110000, 1100, s, pitch, 1024, rows},
        {150000, 2048, s + 2048, pitch, 2048, rows},
        {220000, 200, s + 100, pitch, 100, rows},
        {230000, 1600, other.data() + 1400, other_pitch, 1600, rows},
        {300001, 0, s + 5, 0, 50000, 1},
    };
    std::vector<CopyDesc> descs;
    for (const Expect& e : want) {
      descs.push_back({d + e.dst_off, e.src, e.bytes, e.rows, e.dst_pitch, e.src_pitch});
    }
    CopyHostBatch(descs, min);
    std::vector<bool> written(dst.size());
    for (const Expect& e : want) {
      for (size_t r = 0; r < e.rows; ++r) {
        ASSERT_EQ(std::memcmp(d + e.dst_off + r * e.dst_pitch, e.src + r * e.src_pitch, e.bytes), 0)
            << "piece at " << e.dst_off << " row " << r << " min " << min;
        for (size_t i = 0; i < e.bytes; ++i) written[e.dst_off + r * e.dst_pitch + i] = true;
      }
    }
    for (size_t i = 0; i < dst.size(); ++i) {
      if (!written[i]) {
        ASSERT_EQ(dst[i], std::byte{0x77}) << "byte " << i << " min " << min;
      }
    }
  }
}

// 3-D descriptors (planes of rows) in both walking orders (planes interleaved within a destination
// row step, HND -> NHD, and planes apart, NHD -> HND), streaming and cached, with the destination
// on and off 64-byte lines and rows of whole lines and not: every row lands, nothing else moves.
TEST(HostCopy, PlanesLandInEitherOrderForEveryAlignment) {
  const size_t heads = 3, tokens = 5;
  for (size_t row : {size_t{256}, size_t{320}, size_t{70}}) {
    const std::vector<std::byte> src = Pattern(heads * tokens * row + 64, 9);
    for (bool to_nhd : {true, false}) {
      for (size_t shift : {size_t{0}, size_t{16}, size_t{1}}) {
        for (int64_t min : {0, 1}) {
          std::vector<std::byte> buf(heads * tokens * row + 256, std::byte{0x77});
          std::byte* d = buf.data() + (64 - reinterpret_cast<uintptr_t>(buf.data()) % 64) + shift;
          CopyDesc c{};
          c.dst = d;
          c.src = src.data();
          c.bytes = row;
          c.rows = tokens;
          c.planes = heads;
          if (to_nhd) {  // source [head][token], destination [token][head]
            c.src_pitch = row;
            c.src_plane_pitch = tokens * row;
            c.dst_pitch = heads * row;
            c.dst_plane_pitch = row;
          } else {  // source [token][head], destination [head][token]
            c.src_pitch = heads * row;
            c.src_plane_pitch = row;
            c.dst_pitch = row;
            c.dst_plane_pitch = tokens * row;
          }
          std::vector<CopyDesc> one{c};
          CopyHostBatch(one, min);
          std::vector<bool> written(buf.size());
          for (size_t q = 0; q < heads; ++q) {
            for (size_t r = 0; r < tokens; ++r) {
              const size_t at = q * c.dst_plane_pitch + r * c.dst_pitch;
              ASSERT_EQ(
                  std::memcmp(d + at, src.data() + q * c.src_plane_pitch + r * c.src_pitch, row), 0)
                  << "row " << row << " to_nhd " << to_nhd << " shift " << shift << " min " << min
                  << " plane " << q << " row " << r;
              for (size_t i = 0; i < row; ++i) written[(d - buf.data()) + at + i] = true;
            }
          }
          for (size_t i = 0; i < buf.size(); ++i) {
            if (!written[i]) {
              ASSERT_EQ(buf[i], std::byte{0x77}) << "byte " << i;
            }
          }
        }
      }
    }
  }
}

// A CPU stream copies every way it is asked (Copy, CopyBatch with 1-D and 2-D descriptors,
// Copy2D) above and below the streaming threshold; the bytes match either way.
TEST(HostCopy, CpuStreamCopiesAboveAndBelowTheThreshold) {
  for (const char* min : {"0", "4096"}) {
    ASSERT_TRUE(Config::Global().Set("cpu.streaming_copy_min_bytes", min).ok());
    auto dev = OpenCpuDevice();
    auto s = dev->CreateStream();
    ASSERT_TRUE(s.ok());
    const size_t n = (size_t{1} << 20) + 77;
    const std::vector<std::byte> src = Pattern(n, 11);
    std::vector<std::byte> a(n), b(n), c(n);
    ASSERT_TRUE((*s)->Copy(a.data(), src.data(), n).ok());
    const CopyDesc descs[] = {
        {b.data() + 1, src.data() + 1, n / 2, 1, 0, 0},
        {b.data() + 1 + n / 2, src.data() + 1 + n / 2, 1000, (n / 2 - 1) / 1000, 1000, 1000}};
    ASSERT_TRUE((*s)->CopyBatch(descs).ok());
    ASSERT_TRUE((*s)->Copy2D(c.data(), 4096, src.data(), 4096, 4000, n / 4096).ok());
    ASSERT_TRUE((*s)->Synchronize(Clock::now() + std::chrono::seconds(30)).ok());
    EXPECT_EQ(std::memcmp(a.data(), src.data(), n), 0) << "min " << min;
    const size_t batch = 1 + n / 2 + (n / 2 - 1) / 1000 * 1000;
    EXPECT_EQ(std::memcmp(b.data() + 1, src.data() + 1, batch - 1), 0) << "min " << min;
    for (size_t r = 0; r < n / 4096; ++r) {
      ASSERT_EQ(std::memcmp(c.data() + r * 4096, src.data() + r * 4096, 4000), 0) << "row " << r;
    }
  }
  ASSERT_TRUE(Config::Global().Reset("cpu.streaming_copy_min_bytes").ok());
}

}  // namespace
}  // namespace kvferry
