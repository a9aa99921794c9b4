// What the NIXL transport puts on the wire beside NIXL's own bytes: its address text, the packed
// key of a registration, and the header of each notification. Explicit little-endian (base/wire.h);
// every decoder checks lengths and returns kInvalidArgument naming the field, never reads past
// its input. NIXL's metadata blobs inside them are opaque here; NIXL parses them (and refuses a
// malformed one with an error, which the transport reports).
//
// Address text: "nixl1:" then hex of
//   u32 name length N, N bytes agent name, u32 metadata length M, M bytes of the agent's
//   metadata (nixl_capi_get_local_md at creation: connection info, no registrations).
// Packed key, bytes (version 1, host memory):
//   "NXK1", u32 N + agent name, u64 base address, u64 size, u32 M + M bytes partial metadata
//   (nixl_capi_get_local_partial_md of that one registration).
// Version 2 (GPU memory; host memory keeps version 1, which older peers read):
//   "NXK2", u32 N + agent name, u64 base address, u64 size, u8 NIXL memory type (0 DRAM,
//   1 VRAM), u64 device id (the CUDA ordinal for VRAM), u32 M + M bytes partial metadata.
// Notification, byte 0 = kind | kHelloBit:
//   with kHelloBit: u32 L + L bytes of the sender's address text follow first (the first
//   notification to a peer carries it, so the receiver can answer).
//   kControl: the control message's bytes.  kBye: nothing.  kPing: nothing.
//   kData: u64 tag, u64 message length, u64 offset of this fragment, then its bytes.
//   kAck: u64 tag: the receiver took the whole message with that tag (the sender's op completes).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvferry/status.h"

namespace kvferry::nixl_detail {

struct NixlAddress {
  std::string agent;
  std::vector<std::byte> metadata;
};
std::string EncodeNixlAddress(const NixlAddress& a);
StatusOr<NixlAddress> DecodeNixlAddress(std::string_view text);

struct NixlKey {
  std::string agent;
  uint64_t base = 0;
  uint64_t size = 0;
  std::vector<std::byte> metadata;
  int mem = 0;          // CapiMemType: kMemDram, kMemVram
  uint64_t device = 0;  // NIXL's devId of the region (CUDA ordinal for VRAM)
};
std::vector<std::byte> EncodeNixlKey(const NixlKey& k);
StatusOr<NixlKey> DecodeNixlKey(std::span<const std::byte> bytes);

enum NotifKind : uint8_t {
  kControl = 0,
  kBye = 1,
  kPing = 2,
  kData = 3,
  kAck = 4,
  kHelloBit = 0x80
};

struct NixlNotif {
  uint8_t kind = kControl;                  // without kHelloBit
  std::string hello_address;                // non-empty: the sender's address came with it
  uint64_t tag = 0, total = 0, offset = 0;  // kData (kAck: tag)
  std::span<const std::byte> payload;       // into the decoded bytes
};
// Header bytes for a notification (the payload is appended by the caller).
std::vector<std::byte> NixlNotifHeader(uint8_t kind, std::string_view hello_address, uint64_t tag,
                                       uint64_t total, uint64_t offset);
StatusOr<NixlNotif> DecodeNixlNotif(std::span<const std::byte> bytes);

// The largest fragment of a tagged message in one notification.
inline constexpr size_t kNixlFragmentBytes = size_t{256} << 10;

}  // namespace kvferry::nixl_detail
