// Shared host memory between processes (host_shm.h): a forked child exports CPU-device
// allocations, the test process maps them by handle, writes through the mapping and the child
// checks what it sees; bad handles (another host, a dead process, a descriptor that is not
// kvferry's memfd, sizes that don't match, a wrapped region) are refused by name.
#include "device/host_shm.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "device/peer_memory.h"
#include "kvferry/device.h"

namespace kvferry {
namespace {

constexpr size_t kBytes = 3 * 4096 + 100;  // not a multiple of the page size

bool WriteAll(int fd, const void* p, size_t n) {
  const auto* c = static_cast<const char*>(p);
  while (n > 0) {
    ssize_t w = write(fd, c, n);
    if (w <= 0) return false;
    c += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}
bool ReadAll(int fd, void* p, size_t n) {
  auto* c = static_cast<char*>(p);
  while (n > 0) {
    ssize_t r = read(fd, c, n);
    if (r <= 0) return false;
    c += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}
bool SendBytes(int fd, const std::vector<std::byte>& b) {
  uint32_t n = static_cast<uint32_t>(b.size());
  return WriteAll(fd, &n, 4) && WriteAll(fd, b.data(), b.size());
}
std::vector<std::byte> RecvBytes(int fd) {
  uint32_t n = 0;
  if (!ReadAll(fd, &n, 4)) return {};
  std::vector<std::byte> b(n);
  if (!ReadAll(fd, b.data(), n)) return {};
  return b;
}

// The exporting child: sends its handles (host region, pinned region, a wrapped vector, and a
// memfd that isn't kvferry's plus a pipe, as raw descriptor numbers), waits for the parent's
// "written", then exits 0 when the host region holds 0x5a everywhere and its guard pages (the
// pinned region's bytes) are untouched.
class Exporter {
 public:
  Exporter() {
    int to_parent[2], to_child[2];
    if (pipe(to_parent) != 0 || pipe(to_child) != 0) return;
    pid_ = fork();
    if (pid_ == 0) {
      close(to_parent[0]);
      close(to_child[1]);
      _exit(Child(to_parent[1], to_child[0]));
    }
    close(to_parent[1]);
    close(to_child[0]);
    from_ = to_parent[0];
    to_ = to_child[1];
    for (int i = 0; i < 3; ++i) handles_.push_back(RecvBytes(from_));
    uint32_t fds[2] = {};
    ReadAll(from_, fds, sizeof fds);
    other_memfd_ = fds[0];
    pipe_fd_ = fds[1];
  }
  // Tells the child the writes are done; its exit status (0: it saw them, and nothing else).
  int Finish() {
    char c = 'w';
    WriteAll(to_, &c, 1);
    close(to_);
    close(from_);
    int status = 0;
    waitpid(pid_, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 100 + WTERMSIG(status);
  }
  const std::vector<std::byte>& host() const { return handles_[0]; }
  const std::vector<std::byte>& pinned() const { return handles_[1]; }
  const std::vector<std::byte>& wrapped() const { return handles_[2]; }
  pid_t pid() const { return pid_; }
  uint32_t other_memfd() const { return other_memfd_; }
  uint32_t pipe_fd() const { return pipe_fd_; }

 private:
  static int Child(int out, int in) {
    auto dev = OpenCpuDevice();
    auto host = dev->Allocate(MemoryKind::kHost, kBytes);
    auto pinned = dev->Allocate(MemoryKind::kPinnedHost, kBytes);
    if (!host.ok() || !pinned.ok()) return 2;
    std::memset(host->data(), 0x11, kBytes);
    std::memset(pinned->data(), 0x22, kBytes);
    std::vector<std::byte> wrapped(kBytes);
    auto h1 = dev->ExportMemory(host->data(), kBytes, MemoryKind::kHost);
    auto h2 = dev->ExportMemory(pinned->data(), kBytes, MemoryKind::kPinnedHost);
    auto h3 = dev->ExportMemory(wrapped.data(), kBytes, MemoryKind::kHost);
    if (!h1.ok() || !h2.ok() || !h3.ok()) return 3;
    const int other = memfd_create("not-kvferry", MFD_CLOEXEC);
    int p[2];
    if (other < 0 || ftruncate(other, 65536) != 0 || pipe(p) != 0) return 4;
    const uint32_t fds[2] = {static_cast<uint32_t>(other), static_cast<uint32_t>(p[0])};
    if (!SendBytes(out, *h1) || !SendBytes(out, *h2) || !SendBytes(out, *h3) ||
        !WriteAll(out, fds, sizeof fds))
      return 5;
    char c = 0;
    if (!ReadAll(in, &c, 1)) return 6;
    for (size_t i = 0; i < kBytes; ++i) {
      if (host->data()[i] != std::byte{0x5a}) return 7;
      if (pinned->data()[i] != std::byte{0x22}) return 8;
    }
    return 0;
  }

  pid_t pid_ = -1;
  int from_ = -1, to_ = -1;
  std::vector<std::vector<std::byte>> handles_;
  uint32_t other_memfd_ = 0, pipe_fd_ = 0;
};

std::vector<std::byte> WithPayload(const std::vector<std::byte>& handle,
                                   void (*edit)(PeerHandle&, ShmPayload&)) {
  PeerHandle h = DecodePeerHandle(handle).value();
  ShmPayload p = DecodeShmPayload(h.payload).value();
  edit(h, p);
  h.payload = EncodeShmPayload(p);
  return EncodePeerHandle(h);
}

void ExpectRefused(Device& dev, const std::vector<std::byte>& handle, StatusCode code,
                   const std::string& says) {
  auto m = dev.ImportMemory(handle);
  ASSERT_FALSE(m.ok()) << "mapped: " << says;
  EXPECT_EQ(m.status().code(), code) << m.status().ToString();
  EXPECT_NE(m.status().message().find(says), std::string_view::npos) << m.status().ToString();
}

TEST(HostShm, AnotherProcessMapsAndWritesTheExportedRegionOnly) {
  Exporter child;
  ASSERT_GT(child.pid(), 0);
  ASSERT_EQ(child.host().size(), 52 + kShmPayloadBytes);  // header of version 3, then the payload
  auto dev = OpenCpuDevice();
  auto m = dev->ImportMemory(child.host());
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  ASSERT_EQ((*m)->size(), kBytes);
  for (size_t i = 0; i < kBytes; ++i) ASSERT_EQ((*m)->data()[i], std::byte{0x11}) << i;
  std::memset((*m)->data(), 0x5a, kBytes);
  auto p = dev->ImportMemory(child.pinned());
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ((*p)->data()[kBytes - 1], std::byte{0x22});
  EXPECT_EQ(child.Finish(), 0) << "the child did not see exactly the writes to its host region";
  // The child is gone: its pages stay valid while mapped here.
  EXPECT_EQ((*m)->data()[kBytes - 1], std::byte{0x5a});
  EXPECT_NE(ShmOpenMethod(), "none");
}

TEST(HostShm, BadHandlesAreRefusedNamingTheValues) {
  Exporter child;
  ASSERT_GT(child.pid(), 0);
  auto dev = OpenCpuDevice();
  // A wrapped region (not kvferry's allocation) of another process.
  ExpectRefused(*dev, child.wrapped(), StatusCode::kUnavailable, "not shared memory");
  // Another host.
  PeerHandle h = DecodePeerHandle(child.host()).value();
  h.host[3] ^= 0x40;
  ExpectRefused(*dev, EncodePeerHandle(h), StatusCode::kUnavailable, "another host");
  // A descriptor that is a memfd, but not kvferry's; one that is a pipe; one not open at all.
  static uint32_t other = 0, pipe_fd = 0;
  other = child.other_memfd();
  pipe_fd = child.pipe_fd();
  ExpectRefused(*dev, WithPayload(child.host(), [](PeerHandle&, ShmPayload& p) { p.fd = other; }),
                StatusCode::kInvalidArgument, "not kvferry's memfd");
  ExpectRefused(*dev, WithPayload(child.host(), [](PeerHandle&, ShmPayload& p) { p.fd = pipe_fd; }),
                StatusCode::kInvalidArgument, "pipe:");
  ExpectRefused(*dev, WithPayload(child.host(), [](PeerHandle&, ShmPayload& p) { p.fd = 100000; }),
                StatusCode::kUnavailable, "descriptor 100000 of process");
  // The right descriptor with another token (a reused pid and descriptor number).
  ExpectRefused(*dev, WithPayload(child.host(), [](PeerHandle&, ShmPayload& p) { p.token ^= 1; }),
                StatusCode::kInvalidArgument, "not kvferry's memfd");
  // Sizes: the memfd's size misdeclared, a region running past it, an offset past it.
  ExpectRefused(*dev,
                WithPayload(child.host(), [](PeerHandle&, ShmPayload& p) { p.file_bytes *= 2; }),
                StatusCode::kInvalidArgument, "the handle declares");
  ExpectRefused(*dev,
                WithPayload(child.host(), [](PeerHandle& h, ShmPayload&) { h.bytes += 8192; }),
                StatusCode::kInvalidArgument, "runs past");
  ExpectRefused(
      *dev,
      WithPayload(child.host(), [](PeerHandle&, ShmPayload& p) { p.offset = p.file_bytes - 10; }),
      StatusCode::kInvalidArgument, "runs past");
  // A payload cut short.
  h = DecodePeerHandle(child.host()).value();
  h.payload.resize(10);
  ExpectRefused(*dev, EncodePeerHandle(h), StatusCode::kInvalidArgument, "payload of 10 bytes");
  // Nothing was written: the child still sees 0x11, so it reports "not 0x5a" (7).
  EXPECT_EQ(child.Finish(), 7);
  // The child exited: its pid names no process (or another one, without this descriptor).
  ExpectRefused(*dev, child.host(), StatusCode::kUnavailable, "can't open");
}

TEST(HostShm, AllocationsAreAlignedSharedAndLeaveNoFiles) {
  auto dev = OpenCpuDevice();
  std::vector<Buffer> bufs;
  for (size_t n : {size_t{1}, size_t{4096}, size_t{1} << 20}) {
    for (MemoryKind k : {MemoryKind::kHost, MemoryKind::kPinnedHost, MemoryKind::kDevice}) {
      auto b = dev->Allocate(k, n);
      ASSERT_TRUE(b.ok()) << b.status().ToString();
      EXPECT_EQ(reinterpret_cast<uintptr_t>(b->data()) % 4096, 0u);
      std::memset(b->data(), 1, n);
      auto h = dev->ExportMemory(b->data(), n, k);
      ASSERT_TRUE(h.ok()) << h.status().ToString();
      EXPECT_EQ(DecodePeerHandle(*h)->payload.size(), kShmPayloadBytes) << "not shared: " << n;
      // A sub-range is shared too (a pool region inside an allocation); past the end it isn't.
      auto sub = dev->ExportMemory(b->data() + n / 2, n - n / 2, k);
      ASSERT_TRUE(sub.ok());
      EXPECT_EQ(DecodeShmPayload(DecodePeerHandle(*sub)->payload)->offset, n / 2);
      auto past = dev->ExportMemory(b->data(), n + 8192, k);
      ASSERT_TRUE(past.ok());
      EXPECT_TRUE(DecodePeerHandle(*past)->payload.empty());
      bufs.push_back(std::move(b).value());
    }
  }
  // memfds live in no directory: /dev/shm holds no kvferry file.
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm", ec)) {
    EXPECT_EQ(e.path().filename().string().find("kvferry"), std::string::npos) << e.path();
  }
}

}  // namespace
}  // namespace kvferry
