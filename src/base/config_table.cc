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
    {"transfer.timeout_ms", KnobType::kInt, "30000",
     "deadline of one KV transfer, from first contact to the last byte", 1, 3600 * 1000, ""},
    {"tiering.file_staging_blocks", KnobType::kInt, "32",
     "pinned staging of the file tier, in blocks; also the largest batch to or from files", 1,
     1 << 20, ""},
    {"tiering.offload_min_priority", KnobType::kInt, "0",
     "evicted primary blocks with a retention priority below this are dropped, not offloaded "
     "(101 = never offload)",
     0, 101, ""},
    {"tiering.partial_reuse", KnobType::kBool, "true",
     "reuse the leading tokens of a partially matching cached block by copying them", 0, 0, ""},
    {"tiering.io_timeout_ms", KnobType::kInt, "30000",
     "how long the block manager waits for file-tier I/O on the eviction and onboard paths", 1,
     3600 * 1000, ""},
};

}  // namespace

KnobTable Knobs() { return {kKnobs, static_cast<int>(sizeof(kKnobs) / sizeof(kKnobs[0]))}; }

}  // namespace kvferry::internal
