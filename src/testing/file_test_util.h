// Test helpers of the file tier: scratch directories and aligned buffers. Tests only.
#pragma once

#include <stdlib.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>

namespace kvferry::testing_files {

// A fresh directory under TMPDIR (or /tmp), removed with its contents on destruction.
class ScratchDir {
 public:
  explicit ScratchDir(const std::string& base = "") {
    std::string root = base;
    if (root.empty()) root = std::filesystem::temp_directory_path().string();  // honours TMPDIR
    std::string tmpl = root + "/kvferry-files-XXXXXX";
    path_ = mkdtemp(tmpl.data()) ? tmpl : std::string();
  }
  ~ScratchDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
using AlignedBytes = std::unique_ptr<std::byte, FreeDeleter>;

inline AlignedBytes AlignedAlloc(size_t bytes, size_t align = 4096) {
  void* p = nullptr;
  if (posix_memalign(&p, align, bytes == 0 ? align : bytes) != 0) return nullptr;
  return AlignedBytes(static_cast<std::byte*>(p));
}

// Deterministic bytes for (seed, index).
inline void FillPattern(std::byte* p, size_t bytes, uint64_t seed) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = 0; i < bytes; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    p[i] = static_cast<std::byte>(x & 0xff);
  }
}

}  // namespace kvferry::testing_files
