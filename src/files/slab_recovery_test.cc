// The file tier across restarts: a reopened SlabStore finds every slot that verifies (header and
// payload checksum) under its key and reclaims the rest; a writer killed mid-write (SIGKILL, in a
// forked child) never leaves a slot that verifies with the wrong bytes.
#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <map>
#include <thread>
#include <vector>

#include "files/slot_header.h"
#include "kvferry/slab_store.h"
#include "testing/file_test_util.h"

namespace kvferry {
namespace {

using testing_files::FillPattern;
using testing_files::ScratchDir;

constexpr int64_t kPayload = 2 * 4096 + 300;  // an unaligned tail, as real blocks may have

SlabStoreOptions Options(const std::string& dir, const std::string& backend = "posix") {
  SlabStoreOptions o;
  o.dir = dir;
  o.slot_payload_bytes = kPayload;
  o.slots_per_file = 4;
  o.max_slots = 10;
  o.max_in_flight = 3;
  o.backend = backend;
  return o;
}

// The payload of key k: a pattern seeded by the key, so any slot can be checked on its own.
std::vector<std::byte> PayloadOf(SlotKey k) {
  std::vector<std::byte> v(kPayload);
  FillPattern(v.data(), v.size(), k.hi * 31 + k.lo);
  return v;
}

Status WriteKey(SlabStore& s, SlotId slot, SlotKey key) {
  const std::vector<std::byte> src = PayloadOf(key);
  SlotWrite w{slot, key, src.data(), kPayload, MemoryKind::kHost};
  return s.Write({&w, 1})[0];
}

Status ReadKey(SlabStore& s, SlotId slot, SlotKey key, std::vector<std::byte>& dst) {
  dst.assign(kPayload, std::byte{0});
  SlotRead r{slot, key, dst.data(), kPayload, MemoryKind::kHost};
  return s.Read({&r, 1})[0];
}

void Poke(const std::string& path, int64_t offset, std::byte value) {
  int fd = ::open(path.c_str(), O_WRONLY);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::pwrite(fd, &value, 1, offset), 1);
  ::close(fd);
}

std::string SlabPath(const std::string& dir, int index) {
  return fmt::format("{}/kvferry-slab-{:05d}.kvf", dir, index);
}

TEST(SlabRecovery, ReopenFindsVerifiedSlotsAndReclaimsTheRest) {
  ScratchDir dir;
  {
    auto s = SlabStore::Open(Options(dir.path()));
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    for (SlotId i = 0; i < 7; ++i) {
      ASSERT_EQ(*(*s)->Allocate(), i);
      ASSERT_TRUE(WriteKey(**s, i, SlotKey{100, static_cast<uint64_t>(i)}).ok());
    }
  }
  const int64_t stride = SlabSlotBytes(kPayload);
  Poke(SlabPath(dir.path(), 0), 1 * stride + kSlotHeaderBlock + 77, std::byte{0x5a});  // payload
  Poke(SlabPath(dir.path(), 0), 2 * stride + 20, std::byte{0x77});                     // header
  Poke(SlabPath(dir.path(), 1), (5 - 4) * stride + kSlotHeaderBlock + kPayload - 1,
       std::byte{0x01});  // slot 5: the last payload byte (the unaligned tail)
  auto s = SlabStore::Open(Options(dir.path()));
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  std::map<SlotId, SlotKey> found;
  for (const RecoveredSlot& r : (*s)->Recovered()) {
    EXPECT_EQ(r.bytes, kPayload);
    found[r.slot] = r.key;
  }
  EXPECT_EQ(found.size(), 4u);
  for (SlotId i : {0, 3, 4, 6}) {
    ASSERT_TRUE(found.count(i)) << "slot " << i;
    EXPECT_EQ(found[i], (SlotKey{100, static_cast<uint64_t>(i)}));
    std::vector<std::byte> dst;
    ASSERT_TRUE(ReadKey(**s, i, found[i], dst).ok());
    EXPECT_EQ(dst, PayloadOf(found[i]));
  }
  // Corrupt slots are reclaimed: free again, handed out lowest first, never readable.
  EXPECT_EQ((*s)->free_slots(), 10 - 4);
  std::vector<std::byte> dst;
  EXPECT_EQ(ReadKey(**s, 1, SlotKey{100, 1}, dst).code(), StatusCode::kNotFound);
  EXPECT_EQ(*(*s)->Allocate(), 1);
  // A recovered slot is the caller's: released, it is free.
  (*s)->Release(6);
  EXPECT_EQ((*s)->free_slots(), 10 - 4);
}

TEST(SlabRecovery, HeadersModeDefersThePayloadCheckToTheRead) {
  ScratchDir dir;
  {
    auto s = SlabStore::Open(Options(dir.path()));
    ASSERT_TRUE(s.ok());
    for (SlotId i = 0; i < 2; ++i) {
      ASSERT_EQ(*(*s)->Allocate(), i);
      ASSERT_TRUE(WriteKey(**s, i, SlotKey{7, static_cast<uint64_t>(i)}).ok());
    }
  }
  Poke(SlabPath(dir.path(), 0), kSlotHeaderBlock + 5, std::byte{0x33});
  SlabStoreOptions o = Options(dir.path());
  o.recover = "headers";
  auto s = SlabStore::Open(o);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ((*s)->Recovered().size(), 2u);
  std::vector<std::byte> dst;
  Status st = ReadKey(**s, 0, SlotKey{7, 0}, dst);
  EXPECT_EQ(st.code(), StatusCode::kDataLoss);
  EXPECT_EQ(st.message(), "slot 0: checksum mismatch");
  EXPECT_TRUE(ReadKey(**s, 1, SlotKey{7, 1}, dst).ok());
  o.recover = "bogus";
  s = Status::Cancelled("closed");  // unlocks the directory
  EXPECT_EQ(SlabStore::Open(o).status().code(), StatusCode::kInvalidArgument);
}

// A writer process rewrites slots with new keys in a loop; it is killed at a random moment,
// possibly mid-write. After reopening, every slot that verifies holds exactly its key's bytes.
TEST(SlabRecovery, WriterKilledMidWriteNeverYieldsWrongBytes) {
  for (const std::string backend : {"posix", "io_uring"}) {
    for (int round = 0; round < 3; ++round) {
      ScratchDir dir;
      int ready[2];
      ASSERT_EQ(::pipe(ready), 0);
      const pid_t child = ::fork();
      ASSERT_GE(child, 0);
      if (child == 0) {
        ::close(ready[0]);
        auto s = SlabStore::Open(Options(dir.path(), backend));
        if (!s.ok()) ::_exit(3);
        for (SlotId i = 0; i < 10; ++i) (void)(*s)->Allocate();
        for (uint64_t gen = 1;; ++gen) {
          for (SlotId i = 0; i < 10; ++i) {
            if (!WriteKey(**s, i, SlotKey{gen, static_cast<uint64_t>(i)}).ok()) ::_exit(4);
          }
          if (gen == 1) {  // every slot written once: the parent may kill from now on
            const char one = 1;
            if (::write(ready[1], &one, 1) != 1) ::_exit(5);
          }
        }
      }
      ::close(ready[1]);
      char got = 0;
      ASSERT_EQ(::read(ready[0], &got, 1), 1) << "the writer died before its first round";
      ::close(ready[0]);
      std::this_thread::sleep_for(std::chrono::milliseconds(5 + 20 * round));
      ASSERT_EQ(::kill(child, SIGKILL), 0);
      int status = 0;
      ASSERT_EQ(::waitpid(child, &status, 0), child);
      ASSERT_TRUE(WIFSIGNALED(status)) << "the writer ended by itself: " << status;
      auto s = SlabStore::Open(Options(dir.path(), backend));
      ASSERT_TRUE(s.ok()) << s.status().ToString();
      const auto found = (*s)->Recovered();
      EXPECT_GE(found.size(), 9u) << backend;  // one slot at a time is being written
      for (const RecoveredSlot& r : found) {
        EXPECT_EQ(r.key.lo, static_cast<uint64_t>(r.slot));
        std::vector<std::byte> dst;
        ASSERT_TRUE(ReadKey(**s, r.slot, r.key, dst).ok());
        EXPECT_EQ(dst, PayloadOf(r.key)) << "slot " << r.slot << " generation " << r.key.hi;
      }
    }
  }
}

}  // namespace
}  // namespace kvferry
