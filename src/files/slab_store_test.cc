// The SlabStore conformance suite, run over every file backend this build has (posix with
// O_DIRECT, posix buffered, io_uring, cufile). A backend that can't run here is reported skipped.
#include "kvferry/slab_store.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/mount.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <thread>
#include <vector>

#include "files/posix_io.h"
#include "files/slot_header.h"
#include "testing/file_test_util.h"

namespace kvferry {
namespace {

using testing_files::AlignedAlloc;
using testing_files::AlignedBytes;
using testing_files::FillPattern;
using testing_files::ScratchDir;

struct BackendParam {
  std::string name;
  bool direct_io;
};

void PrintTo(const BackendParam& p, std::ostream* os) {
  *os << p.name << (p.direct_io ? " (O_DIRECT)" : " (buffered)");
}

std::string ParamName(const ::testing::TestParamInfo<BackendParam>& p) {
  return p.param.name + (p.param.direct_io ? "" : "_buffered");
}

// Injects one kind of fault into writes or reads of chosen slots' items.
class FaultyBackend : public FileBackendWrapper {
 public:
  enum class Fault { kNone, kEnospc, kEio, kShortWrite, kCorruptRead };
  using FileBackendWrapper::FileBackendWrapper;
  Fault fault = Fault::kNone;
  int64_t fail_offset = -1;  // only the item at this file offset; -1 = every item

  std::vector<Status> Write(std::span<const FileIo> ios, Deadline deadline) override {
    std::vector<Status> out(ios.size());
    std::vector<FileIo> pass;
    std::vector<size_t> pass_index;
    for (size_t i = 0; i < ios.size(); ++i) {
      const FileIo& io = ios[i];
      if (!Hit(io) || fault == Fault::kNone || fault == Fault::kCorruptRead) {
        pass.push_back(io);
        pass_index.push_back(i);
        continue;
      }
      switch (fault) {
        case Fault::kEnospc:
          out[i] = files_internal::ErrnoStatus(ENOSPC, "write", io.file->path(), io.offset);
          break;
        case Fault::kEio:
          out[i] = files_internal::ErrnoStatus(EIO, "write", io.file->path(), io.offset);
          break;
        case Fault::kShortWrite: {
          // The header block lands, the payload does not: the nastiest partial write.
          FileIo head{io.file, io.offset, io.segments.first(1)};
          (void)target()->Write({&head, 1}, deadline);
          out[i] = Status::DataLoss(fmt::format("short write to {} at offset {}: {} of {} bytes",
                                                io.file->path(), io.offset, kSlotHeaderBlock,
                                                files_internal::IoBytes(io)));
          break;
        }
        default:
          break;
      }
    }
    std::vector<Status> done = target()->Write(pass, deadline);
    for (size_t k = 0; k < pass.size(); ++k) out[pass_index[k]] = std::move(done[k]);
    return out;
  }

  std::vector<Status> Read(std::span<const FileIo> ios, Deadline deadline) override {
    std::vector<Status> out = target()->Read(ios, deadline);
    if (fault != Fault::kCorruptRead) return out;
    for (size_t i = 0; i < ios.size(); ++i) {
      if (!Hit(ios[i]) || !out[i].ok() || ios[i].segments.size() < 2) continue;
      const IoSegment& payload = ios[i].segments[1];
      static_cast<std::byte*>(payload.data)[payload.bytes / 2] ^= std::byte{0x40};
    }
    return out;
  }

 private:
  bool Hit(const FileIo& io) const { return fail_offset < 0 || io.offset == fail_offset; }
};

class SlabStoreConformance : public ::testing::TestWithParam<BackendParam> {
 protected:
  void SetUp() override {
    ASSERT_FALSE(dir_.path().empty());
    FileBackendOptions fo;
    fo.dir = dir_.path();
    fo.direct_io = GetParam().direct_io;
    fo.queue_depth = 8;
    StatusOr<std::unique_ptr<FileBackend>> b = Status::Unavailable("?");
    const std::string& n = GetParam().name;
    if (n == "posix") b = OpenPosixFileBackend(fo);
    if (n == "io_uring") b = OpenUringFileBackend(fo);
    if (n == "cufile") b = OpenCufileFileBackend(fo);
    if (!b.ok() && b.status().code() == StatusCode::kUnavailable) {
      GTEST_SKIP() << n << " unavailable here: " << b.status().message();
    }
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    backend_ = std::move(b).value();
    faulty_ = std::make_unique<FaultyBackend>(backend_.get());
  }

  SlabStoreOptions Options(int64_t payload = kPayload, int64_t max_slots = 24) {
    SlabStoreOptions o;
    o.dir = dir_.path();
    o.slot_payload_bytes = payload;
    o.slots_per_file = 5;
    o.max_slots = max_slots;
    o.max_in_flight = 4;  // smaller than the batches, so windows are exercised
    o.io_timeout_ms = 30000;
    o.file_backend = faulty_.get();
    return o;
  }

  std::unique_ptr<SlabStore> OpenStore(const SlabStoreOptions& o) {
    auto s = SlabStore::Open(o);
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    return s.ok() ? std::move(s).value() : nullptr;
  }

  std::string SlabPath(int index) const {
    return fmt::format("{}/kvferry-slab-{:05d}.kvf", dir_.path(), index);
  }

  // Writes one slot from a fresh pattern; returns the source.
  std::vector<std::byte> WriteOne(SlabStore& s, SlotId slot, SlotKey key, int64_t bytes,
                                  uint64_t seed) {
    std::vector<std::byte> src(bytes);
    FillPattern(src.data(), bytes, seed);
    SlotWrite w{slot, key, src.data(), bytes, MemoryKind::kHost};
    auto st = s.Write({&w, 1});
    EXPECT_TRUE(st[0].ok()) << st[0].ToString();
    return src;
  }

  Status ReadOne(SlabStore& s, SlotId slot, SlotKey key, std::vector<std::byte>& dst) {
    SlotRead r{slot, key, dst.data(), static_cast<int64_t>(dst.size()), MemoryKind::kHost};
    return s.Read({&r, 1})[0];
  }

  // Overwrites `bytes` at `offset` of a slab file, behind the store's back.
  void Poke(int file, int64_t offset, std::byte value) {
    int fd = ::open(SlabPath(file).c_str(), O_WRONLY);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::pwrite(fd, &value, 1, offset), 1);
    ::fsync(fd);
    ::close(fd);
  }

  static constexpr int64_t kPayload = 3 * 4096 + 100;  // not a multiple of 4096
  ScratchDir dir_;
  std::unique_ptr<FileBackend> backend_;
  std::unique_ptr<FaultyBackend> faulty_;
};

TEST_P(SlabStoreConformance, RoundTripManySlotsInBatches) {
  auto s = OpenStore(Options());
  ASSERT_TRUE(s);
  EXPECT_EQ(s->capacity(), 24);
  EXPECT_EQ(SlabSlotBytes(kPayload), 4096 + 4 * 4096);
  const int kSlots = 24;
  const int64_t sizes[] = {0, 1, 4095, 4096, 4097, 8192, kPayload, 12345};
  // Sources: aligned ones in place, unaligned ones (offset by 1) through staging.
  auto region = AlignedAlloc(kSlots * 5 * 4096 + 64);
  std::vector<SlotWrite> writes;
  std::vector<SlotId> ids;
  for (int i = 0; i < kSlots; ++i) {
    auto id = s->Allocate();
    ASSERT_TRUE(id.ok());
    ids.push_back(*id);
    int64_t bytes = sizes[i % 8];
    std::byte* src = region.get() + i * 5 * 4096 + (i % 3 == 2 ? 1 : 0);
    FillPattern(src, bytes, 100 + i);
    writes.push_back({*id, {uint64_t(i), ~uint64_t(i)}, src, bytes, MemoryKind::kHost});
  }
  EXPECT_EQ(s->free_slots(), 0);
  EXPECT_EQ(s->Allocate().status().code(), StatusCode::kResourceExhausted);
  // Batches of 7 (windows of 4 inside).
  for (size_t b = 0; b < writes.size(); b += 7) {
    auto st = s->Write(std::span(writes).subspan(b, std::min<size_t>(7, writes.size() - b)));
    for (auto& x : st) ASSERT_TRUE(x.ok()) << x.ToString();
  }
  // Read back in reverse, in one batch, some into unaligned destinations.
  auto out = AlignedAlloc(kSlots * 5 * 4096 + 64);
  std::memset(out.get(), 0xEE, kSlots * 5 * 4096 + 64);
  std::vector<SlotRead> reads;
  for (int i = kSlots - 1; i >= 0; --i) {
    std::byte* dst = out.get() + i * 5 * 4096 + (i % 2 == 1 ? 3 : 0);
    reads.push_back({ids[i], writes[i].key, dst, writes[i].bytes, MemoryKind::kPinnedHost});
  }
  auto st = s->Read(reads);
  for (size_t k = 0; k < reads.size(); ++k) {
    ASSERT_TRUE(st[k].ok()) << st[k].ToString();
    int i = kSlots - 1 - static_cast<int>(k);
    ASSERT_EQ(std::memcmp(reads[k].dst, writes[i].src, writes[i].bytes), 0) << "slot " << ids[i];
    // Nothing written past the payload.
    EXPECT_EQ(static_cast<std::byte*>(reads[k].dst)[writes[i].bytes], std::byte{0xEE});
  }
  // Files were made lazily, 5 slots each, the last one short.
  EXPECT_TRUE(std::filesystem::exists(SlabPath(4)));
  EXPECT_FALSE(std::filesystem::exists(SlabPath(5)));
  EXPECT_EQ(static_cast<int64_t>(std::filesystem::file_size(SlabPath(4))),
            4 * SlabSlotBytes(kPayload));
}

TEST_P(SlabStoreConformance, LazyFilesAndReleaseReuse) {
  auto s = OpenStore(Options());
  ASSERT_TRUE(s);
  auto a = s->Allocate();
  ASSERT_TRUE(a.ok());
  EXPECT_FALSE(std::filesystem::exists(SlabPath(0)));  // no write yet
  WriteOne(*s, *a, {1, 1}, 100, 1);
  EXPECT_TRUE(std::filesystem::exists(SlabPath(0)));
  EXPECT_FALSE(std::filesystem::exists(SlabPath(1)));
  s->Release(*a);
  s->Release(*a);  // no-op
  EXPECT_EQ(s->free_slots(), 24);
  auto b = s->Allocate();
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(*b, *a);  // released slots are reused first
  std::vector<std::byte> dst(100);
  EXPECT_EQ(ReadOne(*s, *b, {1, 1}, dst).code(), StatusCode::kNotFound);  // forgotten on release
}

TEST_P(SlabStoreConformance, ReopenWithRecoverNoneForgetsOldContents) {
  SlotId id;
  {
    auto s = OpenStore(Options());
    ASSERT_TRUE(s);
    id = *s->Allocate();
    WriteOne(*s, id, {7, 7}, 5000, 3);
    // A second store on the same directory at once is refused.
    auto other = SlabStore::Open(Options());
    EXPECT_EQ(other.status().code(), StatusCode::kUnavailable) << other.status().ToString();
  }
  SlabStoreOptions none = Options();
  none.recover = "none";
  auto s = OpenStore(none);
  ASSERT_TRUE(s);
  EXPECT_TRUE(s->Recovered().empty());
  EXPECT_EQ(s->free_slots(), 24);
  std::vector<std::byte> dst(5000);
  Status st = ReadOne(*s, id, {7, 7}, dst);
  EXPECT_EQ(st.code(), StatusCode::kNotFound) << st.ToString();
  // The old files are reused in place.
  id = *s->Allocate();
  auto src = WriteOne(*s, id, {8, 8}, 5000, 4);
  ASSERT_TRUE(ReadOne(*s, id, {8, 8}, dst).ok());
  EXPECT_EQ(dst, src);
}

TEST_P(SlabStoreConformance, CorruptedPayloadByteIsDataLoss) {
  auto s = OpenStore(Options());
  ASSERT_TRUE(s);
  SlotId id = -1;
  for (int i = 0; i < 8; ++i) id = *s->Allocate();  // id 7: file 1, slot 2 of it
  WriteOne(*s, id, {5, 5}, kPayload, 5);
  Poke(1, 2 * SlabSlotBytes(kPayload) + kSlotHeaderBlock + 1000, std::byte{0x5A});
  std::vector<std::byte> dst(kPayload);
  Status st = ReadOne(*s, id, {5, 5}, dst);
  EXPECT_EQ(st.code(), StatusCode::kDataLoss);
  EXPECT_EQ(st.message(), "slot 7: checksum mismatch") << st.ToString();
  // A corrupted byte in the unaligned tail is caught too.
  WriteOne(*s, id, {5, 5}, kPayload, 6);
  Poke(1, 2 * SlabSlotBytes(kPayload) + kSlotHeaderBlock + kPayload - 1, std::byte{0x01});
  EXPECT_EQ(ReadOne(*s, id, {5, 5}, dst).code(), StatusCode::kDataLoss);
}

TEST_P(SlabStoreConformance, CorruptSlotIsLoggedOncePerContents) {
  auto s = OpenStore(Options());
  ASSERT_TRUE(s);
  SlotId id = -1;
  for (int i = 0; i < 8; ++i) id = *s->Allocate();  // id 7: file 1, slot 2 of it
  std::vector<std::byte> dst(kPayload);
  auto count = [](const std::string& text) {
    size_t n = 0;
    for (size_t at = 0; (at = text.find("dropping corrupt slot 7 of", at)) != std::string::npos;
         ++at)
      ++n;
    return n;
  };
  testing::internal::CaptureStderr();
  WriteOne(*s, id, {5, 5}, kPayload, 5);
  Poke(1, 2 * SlabSlotBytes(kPayload) + kSlotHeaderBlock + 1000, std::byte{0x5A});
  EXPECT_EQ(ReadOne(*s, id, {5, 5}, dst).code(), StatusCode::kDataLoss);
  EXPECT_EQ(ReadOne(*s, id, {5, 5}, dst).code(), StatusCode::kDataLoss);
  std::string once = testing::internal::GetCapturedStderr();
  EXPECT_EQ(count(once), 1u) << once;
  EXPECT_NE(once.find("slot 7: checksum mismatch"), std::string::npos) << once;
  // New contents, corrupted again: logged again.
  testing::internal::CaptureStderr();
  WriteOne(*s, id, {5, 5}, kPayload, 6);
  Poke(1, 2 * SlabSlotBytes(kPayload) + kSlotHeaderBlock + 1000, std::byte{0x5B});
  EXPECT_EQ(ReadOne(*s, id, {5, 5}, dst).code(), StatusCode::kDataLoss);
  std::string again = testing::internal::GetCapturedStderr();
  EXPECT_EQ(count(again), 1u) << again;
}

TEST_P(SlabStoreConformance, CorruptedHeaderIsDataLoss) {
  auto s = OpenStore(Options());
  ASSERT_TRUE(s);
  SlotId id = *s->Allocate();
  WriteOne(*s, id, {5, 5}, 300, 5);
  Poke(0, 20, std::byte{0x77});  // a key byte
  std::vector<std::byte> dst(300);
  Status st = ReadOne(*s, id, {5, 5}, dst);
  EXPECT_EQ(st.code(), StatusCode::kDataLoss);
  EXPECT_NE(st.message().find("slot 0: header checksum mismatch"), std::string_view::npos)
      << st.ToString();
}

TEST_P(SlabStoreConformance, TruncatedFileIsDataLoss) {
  auto s = OpenStore(Options());
  ASSERT_TRUE(s);
  std::vector<SlotId> ids;
  for (int i = 0; i < 5; ++i) ids.push_back(*s->Allocate());
  for (SlotId id : ids) WriteOne(*s, id, {9, uint64_t(id)}, kPayload, id);
  // Cut file 0 in the middle of slot 4's payload.
  ASSERT_EQ(::truncate(SlabPath(0).c_str(), 4 * SlabSlotBytes(kPayload) + 8192), 0);
  std::vector<std::byte> dst(kPayload);
  Status st = ReadOne(*s, 4, {9, 4}, dst);
  EXPECT_EQ(st.code(), StatusCode::kDataLoss);
  EXPECT_NE(st.message().find("slot 4: truncated file"), std::string_view::npos) << st.ToString();
  EXPECT_TRUE(ReadOne(*s, 3, {9, 3}, dst).ok());  // its neighbour is intact
}

TEST_P(SlabStoreConformance, ReusedSlotWithOldKeyFails) {
  auto s = OpenStore(Options());
  ASSERT_TRUE(s);
  SlotId id = *s->Allocate();
  WriteOne(*s, id, {1, 2}, 4096, 1);
  s->Release(id);
  ASSERT_EQ(*s->Allocate(), id);
  WriteOne(*s, id, {3, 4}, 4096, 2);
  std::vector<std::byte> dst(4096);
  Status st = ReadOne(*s, id, {1, 2}, dst);
  EXPECT_EQ(st.code(), StatusCode::kDataLoss);
  EXPECT_EQ(st.message(), "slot 0: key differs (reused slot)");
  // Wrong size is refused too.
  std::vector<std::byte> small(100);
  EXPECT_EQ(ReadOne(*s, id, {3, 4}, small).code(), StatusCode::kDataLoss);
}

TEST_P(SlabStoreConformance, MisplacedSlotOnDiskIsDataLoss) {
  // The on-disk header check, independent of the in-memory map: copy slot 1 over slot 2.
  auto s = OpenStore(Options());
  ASSERT_TRUE(s);
  for (int i = 0; i < 3; ++i) ASSERT_EQ(*s->Allocate(), i);
  for (int i = 1; i < 3; ++i) WriteOne(*s, i, {4, 4}, 4096, 1);  // same key, same bytes
  std::vector<char> slot1(SlabSlotBytes(kPayload));
  int fd = ::open(SlabPath(0).c_str(), O_RDWR);
  ASSERT_EQ(::pread(fd, slot1.data(), slot1.size(), SlabSlotBytes(kPayload)),
            static_cast<ssize_t>(slot1.size()));
  ASSERT_EQ(::pwrite(fd, slot1.data(), slot1.size(), 2 * SlabSlotBytes(kPayload)),
            static_cast<ssize_t>(slot1.size()));
  ::fsync(fd);
  ::close(fd);
  std::vector<std::byte> dst(4096);
  Status st = ReadOne(*s, 2, {4, 4}, dst);
  EXPECT_EQ(st.code(), StatusCode::kDataLoss);
  EXPECT_NE(st.message().find("header names slot 1"), std::string_view::npos) << st.ToString();
}

TEST_P(SlabStoreConformance, InjectedWriteFaultsLeaveSlotUnwritten) {
  using Fault = FaultyBackend::Fault;
  auto s = OpenStore(Options());
  ASSERT_TRUE(s);
  std::vector<SlotId> ids;
  for (int i = 0; i < 3; ++i) ids.push_back(*s->Allocate());
  const int64_t free_before = s->free_slots();
  struct Case {
    Fault fault;
    StatusCode code;
    std::string_view text;
  } cases[] = {{Fault::kEnospc, StatusCode::kResourceExhausted, "no space left in "},
               {Fault::kEio, StatusCode::kDataLoss, "I/O error"},
               {Fault::kShortWrite, StatusCode::kDataLoss, "short write"}};
  for (const Case& c : cases) {
    // Slot 1 keeps its earlier contents only if it was never hit; write all three, fail slot 1.
    std::vector<std::vector<std::byte>> srcs(3, std::vector<std::byte>(6000));
    std::vector<SlotWrite> ws;
    for (int i = 0; i < 3; ++i) {
      FillPattern(srcs[i].data(), 6000, 40 + i);
      ws.push_back({ids[i], {10, uint64_t(i)}, srcs[i].data(), 6000, MemoryKind::kHost});
    }
    faulty_->fault = c.fault;
    faulty_->fail_offset = 1 * SlabSlotBytes(kPayload);
    auto st = s->Write(ws);
    faulty_->fault = Fault::kNone;
    EXPECT_TRUE(st[0].ok()) << st[0].ToString();
    EXPECT_TRUE(st[2].ok()) << st[2].ToString();
    EXPECT_EQ(st[1].code(), c.code) << st[1].ToString();
    EXPECT_NE(st[1].message().find(c.text), std::string_view::npos) << st[1].ToString();
    EXPECT_TRUE(st[1].message().starts_with("slot 1: ")) << st[1].ToString();
    if (c.fault == Fault::kEnospc) {
      EXPECT_NE(st[1].message().find(dir_.path()), std::string_view::npos) << st[1].ToString();
    }
    EXPECT_EQ(s->free_slots(), free_before);
    std::vector<std::byte> dst(6000);
    EXPECT_EQ(ReadOne(*s, ids[1], {10, 1}, dst).code(), StatusCode::kNotFound);
    ASSERT_TRUE(ReadOne(*s, ids[2], {10, 2}, dst).ok());
    EXPECT_EQ(dst, srcs[2]);
    // The slot stays usable: the same write succeeds once the fault is gone.
    auto again = s->Write(std::span(ws).subspan(1, 1));
    ASSERT_TRUE(again[0].ok()) << again[0].ToString();
    ASSERT_TRUE(ReadOne(*s, ids[1], {10, 1}, dst).ok());
    EXPECT_EQ(dst, srcs[1]);
  }
}

TEST_P(SlabStoreConformance, CorruptedReadIsDataLoss) {
  auto s = OpenStore(Options());
  ASSERT_TRUE(s);
  SlotId id = *s->Allocate();
  auto src = WriteOne(*s, id, {2, 2}, 3 * 4096, 1);  // page-multiple: payload read in place
  faulty_->fault = FaultyBackend::Fault::kCorruptRead;
  std::vector<std::byte> dst(3 * 4096);
  Status st = ReadOne(*s, id, {2, 2}, dst);
  EXPECT_EQ(st.code(), StatusCode::kDataLoss);
  EXPECT_EQ(st.message(), "slot 0: checksum mismatch");
  faulty_->fault = FaultyBackend::Fault::kNone;
  EXPECT_TRUE(ReadOne(*s, id, {2, 2}, dst).ok());
  EXPECT_EQ(dst, src);
}

TEST_P(SlabStoreConformance, BadArguments) {
  auto s = OpenStore(Options());
  ASSERT_TRUE(s);
  std::vector<std::byte> buf(kPayload + 1);
  SlotWrite unallocated{3, {}, buf.data(), 10, MemoryKind::kHost};
  EXPECT_EQ(s->Write({&unallocated, 1})[0].code(), StatusCode::kInvalidArgument);
  SlotId id = *s->Allocate();
  SlotWrite too_big{id, {}, buf.data(), kPayload + 1, MemoryKind::kHost};
  EXPECT_EQ(s->Write({&too_big, 1})[0].code(), StatusCode::kInvalidArgument);
  SlotWrite out_of_range{99, {}, buf.data(), 1, MemoryKind::kHost};
  EXPECT_EQ(s->Write({&out_of_range, 1})[0].code(), StatusCode::kInvalidArgument);
  SlotWrite file_kind{id, {}, buf.data(), 1, MemoryKind::kFile};
  EXPECT_EQ(s->Write({&file_kind, 1})[0].code(), StatusCode::kInvalidArgument);
  // Device memory without a device (and a backend that can't do device memory) is refused.
  if (!s->backend().device_memory) {
    SlotWrite dev{id, {}, buf.data(), 1, MemoryKind::kDevice};
    EXPECT_EQ(s->Write({&dev, 1})[0].code(), StatusCode::kInvalidArgument);
  }
}

TEST_P(SlabStoreConformance, CpuDeviceMemoryInPlace) {
  std::unique_ptr<Device> cpu = OpenCpuDevice();
  SlabStoreOptions o = Options();
  o.device = cpu.get();
  auto s = OpenStore(o);
  ASSERT_TRUE(s);
  auto src = cpu->Allocate(MemoryKind::kDevice, kPayload);
  auto dst = cpu->Allocate(MemoryKind::kDevice, kPayload);
  ASSERT_TRUE(src.ok() && dst.ok());
  FillPattern(src->data(), kPayload, 77);
  SlotId id = *s->Allocate();
  SlotWrite w{id, {1, 9}, src->data(), kPayload, MemoryKind::kDevice};
  ASSERT_TRUE(s->Write({&w, 1})[0].ok());
  SlotRead r{id, {1, 9}, dst->data(), kPayload, MemoryKind::kDevice};
  Status st = s->Read({&r, 1})[0];
  ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_EQ(std::memcmp(src->data(), dst->data(), kPayload), 0);
}

// A device whose memory the store must not touch directly (platform is not "cpu"), backed by the
// CPU device: exercises the staged path used for GPU memory with posix/io_uring.
class FakeGpu : public Device {
 public:
  FakeGpu() { info_.platform = "fakegpu"; }
  const DeviceInfo& info() const override { return info_; }
  StatusOr<Buffer> Allocate(MemoryKind kind, size_t bytes) override {
    ++allocations;
    return cpu_->Allocate(kind, bytes);  // owned (and freed) by the CPU device
  }
  StatusOr<std::unique_ptr<Stream>> CreateStream() override {
    ++streams;
    return cpu_->CreateStream();
  }
  StatusOr<std::unique_ptr<Event>> CreateEvent() override { return cpu_->CreateEvent(); }
  int allocations = 0;
  int streams = 0;

 protected:
  void Free(std::byte*, size_t, MemoryKind) noexcept override {}

 private:
  std::unique_ptr<Device> cpu_ = OpenCpuDevice();
  DeviceInfo info_;
};

TEST_P(SlabStoreConformance, GpuMemoryIsStagedAndVerifiedBeforeCopy) {
  FakeGpu gpu;
  SlabStoreOptions o = Options();
  o.device = &gpu;
  auto s = OpenStore(o);
  ASSERT_TRUE(s);
  if (s->backend().device_memory) GTEST_SKIP() << "backend reads device memory directly";
  auto src = gpu.Allocate(MemoryKind::kDevice, kPayload);
  auto dst = gpu.Allocate(MemoryKind::kDevice, kPayload);
  ASSERT_TRUE(src.ok() && dst.ok());
  FillPattern(src->data(), kPayload, 91);
  SlotId id = *s->Allocate();
  SlotWrite w{id, {6, 6}, src->data(), kPayload, MemoryKind::kDevice};
  ASSERT_TRUE(s->Write({&w, 1})[0].ok());
  EXPECT_GE(gpu.streams, 1);      // copied through a stream of the device
  EXPECT_GE(gpu.allocations, 3);  // pinned staging came from the device
  SlotRead r{id, {6, 6}, dst->data(), kPayload, MemoryKind::kDevice};
  Status st = s->Read({&r, 1})[0];
  ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_EQ(std::memcmp(src->data(), dst->data(), kPayload), 0);
  // A corrupt slot is caught in staging: the device destination is left as it was.
  std::memset(dst->data(), 0xAB, kPayload);
  Poke(0, kSlotHeaderBlock + 77, std::byte{0x42});
  st = s->Read({&r, 1})[0];
  EXPECT_EQ(st.code(), StatusCode::kDataLoss) << st.ToString();
  for (int64_t i = 0; i < kPayload; ++i) ASSERT_EQ(dst->data()[i], std::byte{0xAB}) << i;
}

TEST_P(SlabStoreConformance, ConcurrentBatches) {
  auto s = OpenStore(Options(kPayload, 40));
  ASSERT_TRUE(s);
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 5; ++round) {
        std::vector<SlotId> ids;
        std::vector<std::vector<std::byte>> srcs;
        std::vector<SlotWrite> ws;
        for (int i = 0; i < 2; ++i) {
          auto id = s->Allocate();
          if (!id.ok()) {
            ++failures;
            return;
          }
          ids.push_back(*id);
          srcs.emplace_back(7000);
          FillPattern(srcs.back().data(), 7000, t * 1000 + round * 10 + i);
        }
        for (int i = 0; i < 2; ++i) {
          ws.push_back({ids[i],
                        {uint64_t(t), uint64_t(round * 10 + i)},
                        srcs[i].data(),
                        7000,
                        MemoryKind::kHost});
        }
        for (auto& st : s->Write(ws)) failures += !st.ok();
        for (int i = 0; i < 2; ++i) {
          std::vector<std::byte> dst(7000);
          SlotRead r{ids[i], ws[i].key, dst.data(), 7000, MemoryKind::kHost};
          failures += !s->Read({&r, 1})[0].ok();
          failures += dst != srcs[i];
          s->Release(ids[i]);
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(s->free_slots(), 40);
}

// A real full disk: a 1 MiB tmpfs. Needs root and mount(2); skipped where the sandbox forbids it.
TEST_P(SlabStoreConformance, RealEnospcOnSmallTmpfs) {
  ScratchDir mnt;
  if (::mount("tmpfs", mnt.path().c_str(), "tmpfs", 0, "size=1m,mode=0700") != 0) {
    GTEST_SKIP() << "can't mount a 1 MiB tmpfs here (" << std::strerror(errno)
                 << "); the real-ENOSPC test needs root and mount(2)";
  }
  struct Unmount {
    std::string p;
    ~Unmount() { ::umount2(p.c_str(), MNT_DETACH); }
  } unmount{mnt.path()};
  FileBackendOptions fo;
  fo.dir = mnt.path();
  fo.direct_io = GetParam().direct_io;
  StatusOr<std::unique_ptr<FileBackend>> b = OpenFileBackend(GetParam().name, fo);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  SlabStoreOptions o;
  o.dir = mnt.path();
  o.slot_payload_bytes = 200 * 1024;  // 204 KiB + 4 KiB header per slot, 1 slot per file
  o.slots_per_file = 1;
  o.max_slots = 8;  // 1.7 MiB: more than the tmpfs holds
  o.file_backend = b->get();
  auto s = OpenStore(o);
  ASSERT_TRUE(s);
  std::vector<std::vector<std::byte>> srcs;
  int written = 0;
  Status first_error;
  for (int i = 0; i < 8; ++i) {
    SlotId id = *s->Allocate();
    srcs.emplace_back(o.slot_payload_bytes);
    FillPattern(srcs.back().data(), srcs.back().size(), i);
    SlotWrite w{id, {0, uint64_t(i)}, srcs.back().data(), o.slot_payload_bytes, MemoryKind::kHost};
    Status st = s->Write({&w, 1})[0];
    if (st.ok()) {
      ++written;
    } else if (first_error.ok()) {
      first_error = st;
    }
  }
  EXPECT_GE(written, 3);
  EXPECT_LT(written, 8);
  EXPECT_EQ(first_error.code(), StatusCode::kResourceExhausted) << first_error.ToString();
  EXPECT_NE(first_error.message().find("no space left in " + mnt.path()), std::string_view::npos)
      << first_error.ToString();
  // What was written before the disk filled is intact.
  for (int i = 0; i < written; ++i) {
    std::vector<std::byte> dst(o.slot_payload_bytes);
    SlotRead r{i, {0, uint64_t(i)}, dst.data(), o.slot_payload_bytes, MemoryKind::kHost};
    ASSERT_TRUE(s->Read({&r, 1})[0].ok());
    EXPECT_EQ(dst, srcs[i]);
  }
}

// A filesystem that refuses O_DIRECT (ramfs; tmpfs accepts it since Linux 6.6): the backend
// says so in its caps and the store works buffered.
TEST(SlabStore, NoODirectFallsBackToBuffered) {
  ScratchDir mnt;
  if (::mount("ramfs", mnt.path().c_str(), "ramfs", 0, nullptr) != 0) {
    GTEST_SKIP() << "can't mount a ramfs here (" << std::strerror(errno) << ")";
  }
  struct Unmount {
    std::string p;
    ~Unmount() { ::umount2(p.c_str(), MNT_DETACH); }
  } unmount{mnt.path()};
  for (const std::string& name : FileBackendNames()) {
    if (name == "cufile") continue;  // needs O_DIRECT: falls back to posix, tested elsewhere
    SlabStoreOptions o;
    o.dir = mnt.path();
    o.backend = name;
    o.slot_payload_bytes = 5000;
    o.max_slots = 2;
    auto s = SlabStore::Open(o);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    EXPECT_EQ((*s)->backend().name, name);
    EXPECT_FALSE((*s)->backend().direct_io);
    EXPECT_NE((*s)->backend().note.find("refuses O_DIRECT"), std::string::npos)
        << (*s)->backend().note;
    EXPECT_FALSE(std::filesystem::exists(mnt.path() + "/.kvferry-direct-probe"));
    std::vector<std::byte> src(5000), dst(5000);
    FillPattern(src.data(), src.size(), 3);
    SlotId id = *(*s)->Allocate();
    SlotWrite w{id, {1, 1}, src.data() + 1, 4999, MemoryKind::kHost};
    ASSERT_TRUE((*s)->Write({&w, 1})[0].ok());
    SlotRead r{id, {1, 1}, dst.data(), 4999, MemoryKind::kHost};
    ASSERT_TRUE((*s)->Read({&r, 1})[0].ok());
    EXPECT_EQ(std::memcmp(dst.data(), src.data() + 1, 4999), 0);
  }
}

TEST(SlabStore, MissingDirIsNotFoundNamingIt) {
  SlabStoreOptions o;
  o.dir = "/nonexistent/kv-tier";
  o.slot_payload_bytes = 4096;
  o.max_slots = 4;
  auto s = SlabStore::Open(o);
  EXPECT_EQ(s.status().code(), StatusCode::kNotFound);
  EXPECT_NE(s.status().message().find("/nonexistent/kv-tier"), std::string_view::npos);
}

TEST(SlabStore, BadOptions) {
  ScratchDir d;
  SlabStoreOptions o;
  o.dir = d.path();
  o.slot_payload_bytes = 0;
  o.max_slots = 4;
  EXPECT_EQ(SlabStore::Open(o).status().code(), StatusCode::kInvalidArgument);
}

TEST(SlabStore, OptionsFromConfigAndFallback) {
  ScratchDir d;
  SlabStoreOptions o = SlabStoreOptionsFromConfig();
  EXPECT_EQ(o.backend, "posix");
  EXPECT_EQ(o.slots_per_file, 256);
  o.dir = d.path();
  o.slot_payload_bytes = 4096;
  o.max_slots = 4;
  o.backend = "cufile";  // falls back to posix where GDS is not there
  auto s = SlabStore::Open(o);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  if ((*s)->backend().name == "posix") {
    EXPECT_NE((*s)->backend().note.find("cufile unavailable"), std::string::npos)
        << (*s)->backend().note;
  }
}

std::vector<BackendParam> AllBackends() {
  return {
      {"posix", true}, {"posix", false}, {"io_uring", true}, {"io_uring", false}, {"cufile", true}};
}

INSTANTIATE_TEST_SUITE_P(All, SlabStoreConformance, ::testing::ValuesIn(AllBackends()), ParamName);

}  // namespace
}  // namespace kvferry
