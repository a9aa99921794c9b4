#include "base/config_table.h"

namespace kvferry::internal {
namespace {

constexpr int64_t kMaxInt = int64_t{1} << 50;

constexpr KnobDecl kKnobs[] = {
    {"log.level", KnobType::kString, "info", "least severe log level printed to stderr", 0, 0,
     "error|warn|info|debug"},
    {"device.default", KnobType::kString, "cpu",
     "device the tools use when --device is not given: cpu, cuda or cuda:N", 0, 0, ""},
    {"cpu.pinned_alignment", KnobType::kInt, "4096",
     "alignment in bytes of CPU-device allocations (must allow O_DIRECT I/O)", 64, 1 << 21, ""},
    {"cuda.copy_kernel_threshold", KnobType::kInt, "65536",
     "fragments below this many bytes are moved by the batched gather kernel, above it by the "
     "copy engine",
     0, kMaxInt, ""},
    {"files.backend", KnobType::kString, "posix",
     "file tier I/O backend; io_uring and cufile fall back to posix (logged) where unavailable", 0,
     0, "posix|io_uring|cufile"},
    {"files.slots_per_file", KnobType::kInt, "256",
     "slots per slab file of the file tier (files are created lazily, one at a time)", 1, 1 << 20,
     ""},
    {"files.direct_io", KnobType::kBool, "true",
     "file tier uses O_DIRECT where the filesystem allows it (tmpfs: buffered, logged)", 0, 0, ""},
    {"files.max_in_flight", KnobType::kInt, "16",
     "slots one file tier batch keeps in flight (io_uring depth; staging is sized by it)", 1, 4096,
     ""},
    {"files.io_timeout_ms", KnobType::kInt, "30000",
     "deadline of one file tier read or write batch", 1, 3600 * 1000, ""},
    {"transfer.timeout_ms", KnobType::kInt, "30000",
     "deadline of one KV transfer, from first contact to the last byte", 1, 3600 * 1000, ""},
};

}  // namespace

KnobTable Knobs() { return {kKnobs, static_cast<int>(sizeof(kKnobs) / sizeof(kKnobs[0]))}; }

}  // namespace kvferry::internal
