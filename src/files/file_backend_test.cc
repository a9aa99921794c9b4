#include "kvferry/file_backend.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "files/posix_io.h"
#include "testing/file_test_util.h"

namespace kvferry {
namespace {

using files_internal::PosixIoFns;
using testing_files::AlignedAlloc;
using testing_files::FillPattern;
using testing_files::ScratchDir;

TEST(FileBackend, MissingDirIsNotFoundNamingIt) {
  FileBackendOptions o;
  o.dir = "/nonexistent/kvferry-dir";
  for (const std::string& name : FileBackendNames()) {
    auto b = OpenFileBackend(name, o);
    ASSERT_FALSE(b.ok()) << name;
    EXPECT_EQ(b.status().code(), StatusCode::kNotFound) << b.status().ToString();
    EXPECT_NE(b.status().message().find("/nonexistent/kvferry-dir"), std::string_view::npos);
  }
}

TEST(FileBackend, FileInsteadOfDirIsInvalidArgument) {
  ScratchDir d;
  std::string f = d.path() + "/plain";
  ::close(::open(f.c_str(), O_CREAT | O_WRONLY, 0644));
  FileBackendOptions o;
  o.dir = f;
  auto b = OpenPosixFileBackend(o);
  EXPECT_EQ(b.status().code(), StatusCode::kInvalidArgument) << b.status().ToString();
}

TEST(FileBackend, UnknownNameIsInvalidArgument) {
  ScratchDir d;
  FileBackendOptions o;
  o.dir = d.path();
  EXPECT_EQ(OpenFileBackend("floppy", o).status().code(), StatusCode::kInvalidArgument);
}

TEST(FileBackend, ErrnoConversion) {
  using files_internal::ErrnoStatus;
  Status s = ErrnoStatus(ENOSPC, "write", "/data/kv/slab-1", 4096);
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("no space left in /data/kv"), std::string_view::npos) << s.ToString();
  EXPECT_EQ(ErrnoStatus(EIO, "read", "/x/y", 0).code(), StatusCode::kDataLoss);
  EXPECT_EQ(ErrnoStatus(EBADF, "read", "/x/y", 0).code(), StatusCode::kInternal);
}

// System calls that move at most 1000 bytes at a time and fail every third call with EINTR.
int g_calls = 0;
ssize_t ChoppyPwritev(int fd, const iovec* iov, int, off_t off) {
  if (++g_calls % 3 == 0) {
    errno = EINTR;
    return -1;
  }
  size_t n = std::min<size_t>(iov[0].iov_len, 1000);
  return ::pwrite(fd, iov[0].iov_base, n, off);
}
ssize_t ChoppyPreadv(int fd, const iovec* iov, int, off_t off) {
  if (++g_calls % 3 == 0) {
    errno = EINTR;
    return -1;
  }
  size_t n = std::min<size_t>(iov[0].iov_len, 1000);
  return ::pread(fd, iov[0].iov_base, n, off);
}
ssize_t StuckPwritev(int, const iovec*, int, off_t) { return 0; }

TEST(PosixTransfer, FinishesShortTransfersAndRetriesEintr) {
  ScratchDir d;
  FileBackendCaps caps;
  caps.name = "posix-choppy";
  auto backend =
      files_internal::MakePosixFileBackend(caps, PosixIoFns{ChoppyPwritev, ChoppyPreadv});
  auto f = backend->Open(d.path() + "/f", 20000);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  std::vector<std::byte> a(5000), b(7000), ra(5000), rb(7000);
  FillPattern(a.data(), a.size(), 1);
  FillPattern(b.data(), b.size(), 2);
  IoSegment ws[] = {{a.data(), 5000, MemoryKind::kHost}, {b.data(), 7000, MemoryKind::kHost}};
  FileIo w{f->get(), 100, ws};
  auto st = backend->Write({&w, 1}, DeadlineIn(std::chrono::seconds(10)));
  ASSERT_TRUE(st[0].ok()) << st[0].ToString();
  IoSegment rs[] = {{ra.data(), 5000, MemoryKind::kHost}, {rb.data(), 7000, MemoryKind::kHost}};
  FileIo r{f->get(), 100, rs};
  st = backend->Read({&r, 1}, DeadlineIn(std::chrono::seconds(10)));
  ASSERT_TRUE(st[0].ok()) << st[0].ToString();
  EXPECT_EQ(ra, a);
  EXPECT_EQ(rb, b);
}

TEST(PosixTransfer, NoProgressIsAShortWriteError) {
  ScratchDir d;
  FileBackendCaps caps;
  caps.name = "posix-stuck";
  auto backend = files_internal::MakePosixFileBackend(caps, PosixIoFns{StuckPwritev, ::preadv});
  auto f = backend->Open(d.path() + "/f", 8192);
  ASSERT_TRUE(f.ok());
  std::vector<std::byte> a(100);
  IoSegment ws[] = {{a.data(), 100, MemoryKind::kHost}};
  FileIo w{f->get(), 0, ws};
  auto st = backend->Write({&w, 1}, DeadlineIn(std::chrono::seconds(10)));
  EXPECT_EQ(st[0].code(), StatusCode::kDataLoss);
  EXPECT_NE(st[0].message().find("short write"), std::string_view::npos) << st[0].ToString();
}

class BackendConformance : public ::testing::TestWithParam<std::string> {};

TEST_P(BackendConformance, BatchRoundTripAndTruncatedRead) {
  ScratchDir d;
  FileBackendOptions o;
  o.dir = d.path();
  o.queue_depth = 4;
  StatusOr<std::unique_ptr<FileBackend>> b = Status::Unavailable("?");
  if (GetParam() == "posix") b = OpenPosixFileBackend(o);
  if (GetParam() == "io_uring") b = OpenUringFileBackend(o);
  if (GetParam() == "cufile") b = OpenCufileFileBackend(o);
  if (!b.ok() && b.status().code() == StatusCode::kUnavailable) {
    GTEST_SKIP() << GetParam() << " unavailable here: " << b.status().message();
  }
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  FileBackend& be = **b;
  const int64_t kChunk = 64 * 1024;
  const int kItems = 10;
  auto f = be.Open(d.path() + "/f", kChunk * kItems);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  auto src = AlignedAlloc(kChunk * kItems);
  auto dst = AlignedAlloc(kChunk * kItems);
  FillPattern(src.get(), kChunk * kItems, 9);
  std::vector<IoSegment> segs(kItems);
  std::vector<FileIo> ios(kItems);
  for (int i = 0; i < kItems; ++i) {
    segs[i] = {src.get() + i * kChunk, kChunk, MemoryKind::kHost};
    ios[i] = {f->get(), (kItems - 1 - i) * kChunk, {&segs[i], 1}};  // reversed order
  }
  for (const Status& s : be.Write(ios, DeadlineIn(std::chrono::seconds(30)))) {
    ASSERT_TRUE(s.ok()) << s.ToString();
  }
  for (int i = 0; i < kItems; ++i) segs[i].data = dst.get() + i * kChunk;
  for (const Status& s : be.Read(ios, DeadlineIn(std::chrono::seconds(30)))) {
    ASSERT_TRUE(s.ok()) << s.ToString();
  }
  EXPECT_EQ(std::memcmp(src.get(), dst.get(), kChunk * kItems), 0);

  // Truncate the file under the backend: the last item reads past the end.
  ASSERT_EQ(::truncate((d.path() + "/f").c_str(), kChunk * (kItems - 1)), 0);
  auto st = be.Read(std::span<const FileIo>(&ios[0], 1), DeadlineIn(std::chrono::seconds(30)));
  EXPECT_EQ(st[0].code(), StatusCode::kDataLoss) << st[0].ToString();
  EXPECT_NE(st[0].message().find("truncated"), std::string_view::npos) << st[0].ToString();
}

TEST_P(BackendConformance, PastDeadlineEndsEveryItemAndLeavesTheBackendUsable) {
  ScratchDir d;
  FileBackendOptions o;
  o.dir = d.path();
  o.queue_depth = 4;
  StatusOr<std::unique_ptr<FileBackend>> b = Status::Unavailable("?");
  if (GetParam() == "posix") b = OpenPosixFileBackend(o);
  if (GetParam() == "io_uring") b = OpenUringFileBackend(o);
  if (GetParam() == "cufile") b = OpenCufileFileBackend(o);
  if (!b.ok() && b.status().code() == StatusCode::kUnavailable) {
    GTEST_SKIP() << GetParam() << " unavailable here: " << b.status().message();
  }
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  FileBackend& be = **b;
  const int64_t kChunk = 1 << 20;
  const int kItems = 16;
  auto f = be.Open(d.path() + "/f", kChunk * kItems);
  ASSERT_TRUE(f.ok());
  auto src = AlignedAlloc(kChunk * kItems);
  FillPattern(src.get(), kChunk * kItems, 4);
  std::vector<IoSegment> segs(kItems);
  std::vector<FileIo> ios(kItems);
  for (int i = 0; i < kItems; ++i) {
    segs[i] = {src.get() + i * kChunk, kChunk, MemoryKind::kHost};
    ios[i] = {f->get(), i * kChunk, {&segs[i], 1}};
  }
  auto st = be.Write(ios, Clock::now() - std::chrono::seconds(1));
  ASSERT_EQ(st.size(), ios.size());
  int late = 0;
  for (const Status& s : st) {
    EXPECT_TRUE(s.ok() || s.code() == StatusCode::kDeadlineExceeded) << s.ToString();
    late += !s.ok();
  }
  EXPECT_GT(late, 0);
  for (const Status& s : be.Write(ios, DeadlineIn(std::chrono::seconds(30)))) {
    EXPECT_TRUE(s.ok()) << s.ToString();
  }
}

INSTANTIATE_TEST_SUITE_P(All, BackendConformance, ::testing::Values("posix", "io_uring", "cufile"));

}  // namespace
}  // namespace kvferry
