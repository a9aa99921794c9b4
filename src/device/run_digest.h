// Digests of scattered byte runs on the host, and the chunk digest built from them.
//
// The chunk digest (docs/wire_format.md, "chunk digest", wire version 5) of a list of runs is
// XXH3-64 over the little-endian segment digests of Stream::Digest (XXH64 of every
// kDigestSegmentBytes of each run's packed bytes). A device computes the segment digests where the
// bytes are (a kernel on CUDA, digest_kernel.cu); the host combines the few digests. Segments
// restart at each run, so two sides that see the same runs in the same order (a chunk's pieces,
// read from the source pool on one side and from the destination pool on the other, with their
// own pitches) agree whatever the memory layout.
//
// Cost on the host: one XXH64 pass (libxxhash, scalar): about half the speed of version 4's XXH3-64
// (SIMD) on contiguous bytes, as fast or faster on short strided rows, whose segments are gathered
// with memcpy first (docs/reliability.md has the figures). Thread-safe.
#pragma once

#include <cstdint>
#include <span>

#include "kvferry/device.h"

namespace kvferry::internal {

// Stream::Digest's values, computed on the calling thread (the runs must be host-readable).
void DigestOnHost(std::span<const DigestRun> runs, uint64_t* out);

// XXH3-64 (seed 0) of the segment digests as little-endian bytes: the chunk digest.
uint64_t CombineDigests(std::span<const uint64_t> digests);

}  // namespace kvferry::internal
