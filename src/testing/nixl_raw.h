// Raw NIXL: two bare NIXL agents, one WRITE stream between them, with none of kvferry's transport
// around them. The baseline of `kvferry bench transfer --transport nixl` (selftest/baseline.cc):
// what NIXL itself moves between the same two processes, memory kind and message size.
//
// The target registers a buffer and describes itself (hex text of its metadata, taken after the
// registration, so it carries the buffer's keys: exchanged through the run's rendezvous); the
// writer loads that, and keeps `window` WRITE requests of `msg` bytes in flight, each one NIXL
// request (createXferReq, postXferReq, getXferStatus until done, releaseXferReq), as an
// application driving NIXL directly would. The target must be progressed while it is written to
// (NIXL's UCX over TCP lands the bytes in the target's progress). Host or GPU memory: kDevice
// buffers of a CUDA host are registered as VRAM of their device.
//
// Thread-compatible: each object is driven by one thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "kvferry/device.h"
#include "kvferry/status.h"

namespace kvferry {

class RawNixlTarget {
 public:
  // Registers [buf, buf + bytes) with a fresh agent (backend: knobs nixl.backend,
  // nixl.backend_params); kDevice: GPU memory (VRAM). kUnavailable when NIXL can't be used.
  static StatusOr<std::unique_ptr<RawNixlTarget>> Create(void* buf, size_t bytes, MemoryKind kind);
  virtual ~RawNixlTarget() = default;
  // Text for the writer: agent metadata with the registration, and the buffer's address and size.
  virtual std::string Describe() const = 0;
  // Drives the agent once.
  virtual void Progress() = 0;
};

// Writes `msgs` messages of `msg` bytes from `src` (window * msg bytes) into the target described
// by `target`, `window` in flight, slot i of src to slot i of the target's buffer; returns GB/s.
StatusOr<double> RawNixlWrite(const std::string& target, const void* src, MemoryKind kind,
                              size_t msg, int window, int64_t msgs, Deadline deadline);

}  // namespace kvferry
