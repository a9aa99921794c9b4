// The text form of a UCX worker address, as LocalAddress() reports it (no UCX types here).
//
// "ucx1:" + lowercase hex of: u32 little-endian length N | N worker-address bytes |
// u32 little-endian FNV-1a of those N bytes. The length and checksum let Connect() reject a
// truncated or garbage address with kInvalidArgument before UCX parses it (which would crash).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvferry/status.h"

namespace kvferry {

std::string EncodeUcxAddress(const void* worker_address, size_t bytes);
// The worker-address bytes, or kInvalidArgument naming what is wrong.
StatusOr<std::vector<uint8_t>> DecodeUcxAddress(std::string_view text);

uint32_t LoadU32Le(const uint8_t* p);

// A UCX transport has two workers (control, data; see ucx_transport_impl.h). Its address text
// is EncodeUcxAddress of: u32 little-endian length C | C control-worker bytes | data-worker bytes.
struct UcxWorkerAddresses {
  std::vector<uint8_t> control;
  std::vector<uint8_t> data;
};
std::string EncodeUcxWorkerAddresses(const UcxWorkerAddresses& a);
StatusOr<UcxWorkerAddresses> DecodeUcxWorkerAddresses(std::string_view text);

// What a structurally valid worker address of this UCX build looks like, learned from one of its
// own (Learn). UCX unpacks a worker address without its length and asserts (SIGABRT) on an unknown
// version nibble: a forged or corrupted address must not reach ucp_ep_create. Check walks the
// packed layout of UCX 1.22's address versions 1 (its default) and 2 (ucp/wireup/address.c,
// non-unified mode) with bounds: the header (version, flags) equal to this build's own, every
// device and interface entry inside the bytes, at most 128 interfaces and 64 endpoint addresses
// each, and no byte left over. What stays trusted is the content of a well-formed entry (transport
// addresses that UCX's transports parse: a socket address, a shared-memory segment id, a pid for
// CMA) and that the named peer is the one meant: the address proves nothing about who made it.
class UcxAddressShape {
 public:
  // The shape of `own` (this process's worker address), or kUnavailable when `own` is not in the
  // layout this code knows (unified mode, another address version): then Check refuses nothing
  // and says so once in the log.
  static StatusOr<UcxAddressShape> Learn(std::span<const uint8_t> own);
  // A shape that checks nothing (Learn failed).
  static UcxAddressShape Unchecked() { return UcxAddressShape(); }
  // Ok, or kInvalidArgument naming the offset and what is wrong.
  Status Check(std::span<const uint8_t> address) const;
  bool checks() const { return checks_; }

 private:
  bool checks_ = false;
  std::array<uint8_t, 2> header_{};  // version and flags (version 1: one byte; 2: two)
  size_t header_bytes_ = 0;
  size_t attr_bytes_ = 0;  // a packed interface's attributes (v1: 16, v2: 10; +1 with an index)
};

}  // namespace kvferry
