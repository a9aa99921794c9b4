// The text form of a UCX worker address, as LocalAddress() reports it (no UCX types here).
//
// "ucx1:" + lowercase hex of: u32 little-endian length N | N worker-address bytes |
// u32 little-endian FNV-1a of those N bytes. The length and checksum let Connect() reject a
// truncated or garbage address with kInvalidArgument before UCX parses it (which would crash).
#pragma once

#include <cstddef>
#include <cstdint>
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

}  // namespace kvferry
