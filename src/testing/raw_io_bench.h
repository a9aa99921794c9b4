// The raw-I/O baseline every file tier benchmark prints beside its own numbers: plain O_DIRECT
// pwrite/pread of the same bytes in the same directory, no slots, headers or checksums.
// Thread-compatible (call from one thread; it is a measurement).
#pragma once

#include <cstdint>
#include <string>

#include "kvferry/status.h"

namespace kvferry {

// Writes (write=true) or reads `bytes` (rounded up to `block`) of a scratch file in `dir` with
// O_DIRECT, one pwrite/pread of `block` bytes at a time, and returns GB/s (1e9 bytes per second).
// The I/Os cycle through a 4096-aligned buffer of `buffer_bytes` (rounded up to `block`; 0 = one
// block): give it the footprint of the path it is a baseline for (a batch of distinct blocks),
// since on virtual disks a cache-hot single buffer measures faster than real KV memory. Reading
// first writes the file (not timed). The scratch file is removed. kUnavailable when the filesystem
// of `dir` refuses O_DIRECT (tmpfs), kNotFound when `dir` does not exist, kResourceExhausted when
// the disk is full. `block` must be a multiple of 4096. No fsync: like the file tier, it measures
// what O_DIRECT hands to the device.
StatusOr<double> RawDirectIoGbps(const std::string& dir, int64_t bytes, int64_t block, bool write,
                                 int64_t buffer_bytes = 0);

}  // namespace kvferry
