// The file tier's directory and files against another local user (docs/security.md): a symbolic
// link or hard link planted among the slab files is refused and its target left alone, files are
// made 0600, and a directory another user can write (or owns) is refused at open.
#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "kvferry/slab_store.h"
#include "testing/file_test_util.h"

namespace kvferry {
namespace {

namespace fs = std::filesystem;
using testing_files::ScratchDir;

constexpr uid_t kNobody = 65534;

SlabStoreOptions SmallStoreOptions(const std::string& dir) {
  SlabStoreOptions o;
  o.dir = dir;
  o.backend = "posix";
  o.direct_io = false;
  o.slot_payload_bytes = 4096;
  o.slots_per_file = 4;
  o.max_slots = 8;
  return o;
}

std::string SlabFile(const std::string& dir, int index) {
  return fmt::format("{}/kvferry-slab-{:05d}.kvf", dir, index);
}

std::string ReadAll(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

void WriteAll(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
}

// Writes one slot; the status of the write.
Status WriteOne(SlabStore& s) {
  StatusOr<SlotId> id = s.Allocate();
  if (!id.ok()) return id.status();
  std::vector<std::byte> src(4096, std::byte{7});
  SlotWrite w{*id, {1, 2}, src.data(), 4096, MemoryKind::kHost};
  return s.Write({&w, 1})[0];
}

int ModeOf(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) return -1;
  return static_cast<int>(st.st_mode & 07777);
}

// A symbolic link planted where a slab file will be created: the write fails naming the link,
// and the file it points to keeps its bytes (it was truncated and overwritten before).
TEST(SlabStoreSecurity, SymlinkedSlabFileIsRefusedAndItsTargetUntouched) {
  ScratchDir d, elsewhere;
  const std::string victim = elsewhere.path() + "/precious";
  WriteAll(victim, "precious bytes");
  ASSERT_EQ(::symlink(victim.c_str(), SlabFile(d.path(), 0).c_str()), 0);
  for (const char* recover : {"none", "verify"}) {
    SlabStoreOptions o = SmallStoreOptions(d.path());
    o.recover = recover;
    StatusOr<std::unique_ptr<SlabStore>> s = SlabStore::Open(o);
    Status st = s.ok() ? WriteOne(**s) : s.status();  // recovery looks at the file at open
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << recover << ": " << st.ToString();
    EXPECT_NE(st.message().find("symbolic link"), std::string_view::npos) << st.ToString();
    EXPECT_TRUE(ReadAll(victim) == "precious bytes")
        << recover << ": the link's target was written";
  }
}

// A hard link to another file of the same user is refused the same way.
TEST(SlabStoreSecurity, HardLinkedSlabFileIsRefused) {
  ScratchDir d;
  const std::string victim = d.path() + "/notes";
  WriteAll(victim, "notes");
  ASSERT_EQ(::link(victim.c_str(), SlabFile(d.path(), 0).c_str()), 0);
  SlabStoreOptions o = SmallStoreOptions(d.path());
  o.recover = "none";
  auto s = SlabStore::Open(o);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  Status st = WriteOne(**s);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
  EXPECT_NE(st.message().find("hard links"), std::string_view::npos) << st.ToString();
  EXPECT_TRUE(ReadAll(victim) == "notes") << "the linked file was written";
}

// Slab and lock files are 0600 whatever the umask; an older 0644 slab file is narrowed.
TEST(SlabStoreSecurity, FilesAreReadableByTheOwnerOnly) {
  ScratchDir d;
  const mode_t old_mask = ::umask(0);
  {
    WriteAll(SlabFile(d.path(), 1), "");
    ASSERT_EQ(::chmod(SlabFile(d.path(), 1).c_str(), 0644), 0);
    auto s = SlabStore::Open(SmallStoreOptions(d.path()));
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    ASSERT_TRUE(WriteOne(**s).ok());
    for (int i = 0; i < 4; ++i) ASSERT_TRUE(WriteOne(**s).ok());  // slot 4: file 1
    EXPECT_EQ(ModeOf(SlabFile(d.path(), 0)), 0600);
    EXPECT_EQ(ModeOf(SlabFile(d.path(), 1)), 0600);
    EXPECT_EQ(ModeOf(d.path() + "/kvferry-slab.lock"), 0600);
  }
  ::umask(old_mask);
}

TEST(SlabStoreSecurity, DirectoryWritableByOthersIsRefused) {
  for (mode_t mode : {0777, 0770, 01777}) {
    ScratchDir d;
    ASSERT_EQ(::chmod(d.path().c_str(), mode), 0);
    auto s = SlabStore::Open(SmallStoreOptions(d.path()));
    EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument) << fmt::format("{:o}", mode);
    EXPECT_NE(s.status().message().find("writable by"), std::string_view::npos)
        << s.status().ToString();
    EXPECT_TRUE(fs::is_empty(d.path())) << "nothing is created in a refused directory";
  }
  ScratchDir d;
  ASSERT_EQ(::chmod(d.path().c_str(), 0755), 0);  // readable by others: allowed (files are 0600)
  EXPECT_TRUE(SlabStore::Open(SmallStoreOptions(d.path())).ok());
}

// A symbolic link to the directory is followed when it is the user's own (or root's), as
// `--dir /data` -> /mnt/nvme/kv is; another user's link, or another user's directory, is not.
TEST(SlabStoreSecurity, DirectoryOfAnotherUserIsRefused) {
  ScratchDir d, links;
  const std::string own_link = links.path() + "/mine";
  ASSERT_EQ(::symlink(d.path().c_str(), own_link.c_str()), 0);
  {
    auto s = SlabStore::Open(SmallStoreOptions(own_link));
    EXPECT_TRUE(s.ok()) << s.status().ToString();
  }
  if (::geteuid() != 0) GTEST_SKIP() << "making files of another user needs root";
  ASSERT_EQ(::lchown(own_link.c_str(), kNobody, kNobody), 0);
  auto s = SlabStore::Open(SmallStoreOptions(own_link));
  EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("symbolic link owned by uid 65534"), std::string_view::npos)
      << s.status().ToString();
  ASSERT_EQ(::chown(d.path().c_str(), kNobody, kNobody), 0);
  s = SlabStore::Open(SmallStoreOptions(d.path()));
  EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("owned by uid 65534"), std::string_view::npos)
      << s.status().ToString();
}

// A slab file another user made (here: root gives it away) is never read nor written: neither
// recovered at open nor used for a write.
TEST(SlabStoreSecurity, SlabFileOfAnotherUserIsRefused) {
  if (::geteuid() != 0) GTEST_SKIP() << "making files of another user needs root";
  ScratchDir d;
  WriteAll(SlabFile(d.path(), 0), "theirs");
  ASSERT_EQ(::chown(SlabFile(d.path(), 0).c_str(), kNobody, kNobody), 0);
  ASSERT_EQ(::chmod(SlabFile(d.path(), 0).c_str(), 0666), 0);
  SlabStoreOptions o = SmallStoreOptions(d.path());
  o.recover = "none";
  auto s = SlabStore::Open(o);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  Status st = WriteOne(**s);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
  EXPECT_NE(st.message().find("owned by uid 65534"), std::string_view::npos) << st.ToString();
  EXPECT_TRUE(ReadAll(SlabFile(d.path(), 0)) == "theirs") << "the other user's file was written";
}

}  // namespace
}  // namespace kvferry
