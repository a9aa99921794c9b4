// What this build of kvferry has: optional backends found at configure time, with versions.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#pragma GCC visibility push(default)  // the public API (kvferry/export.h)
namespace kvferry {

struct Feature {
  std::string name;  // "cuda", "ucx", "mpi", "cufile", "nccl", "io_uring"
  bool present = false;
  std::string version;  // empty when absent or unknown
  std::string note;     // where it came from, or why it is absent
};

std::string_view Version();
std::vector<Feature> BuildFeatures();

}  // namespace kvferry
#pragma GCC visibility pop
