// What instances exchange over any Rendezvous: rank addresses, the instance secret, handles.
// Each record names the instance id that wrote it, so a stale record of an earlier run under the
// same instance name is refused rather than used.
#include <fmt/format.h>

#include <random>

#include "base/wire.h"
#include "kvferry/rendezvous.h"

namespace kvferry {
namespace {

constexpr uint32_t kRecordMagic = 0x4956464B;  // "KFVI" little-endian
constexpr uint16_t kRecordVersion = 1;
constexpr size_t kMaxAddressBytes = 64 * 1024;

std::vector<std::byte> Record(uint64_t instance_id, std::span<const std::byte> payload) {
  WireWriter w;
  w.U32(kRecordMagic);
  w.U16(kRecordVersion);
  w.U64(instance_id);
  w.Bytes(payload);
  return w.Take();
}

// The payload of a record written by `instance_id`; refuses others naming `what`.
StatusOr<std::vector<std::byte>> Open(std::span<const std::byte> bytes, uint64_t instance_id,
                                      std::string_view what, size_t max_payload) {
  WireReader r(bytes);
  const uint32_t magic = r.U32("magic");
  const uint16_t version = r.U16("version");
  const uint64_t id = r.U64("instance id");
  const uint32_t n = r.Count("payload length", static_cast<uint32_t>(max_payload));
  if (!r.ok() || magic != kRecordMagic || version != kRecordVersion || r.remaining() != n) {
    return Status::InvalidArgument(fmt::format(
        "rendezvous {}: not a kvferry record (magic 0x{:08x}, version {}, {} of {} bytes){}", what,
        magic, version, r.ok() ? r.remaining() : 0, n,
        r.ok() ? "" : ": " + std::string(r.status().message())));
  }
  if (id != instance_id) {
    return Status::InvalidArgument(fmt::format(
        "rendezvous {}: written by instance id {:#x}, expected {:#x} (a stale record of an "
        "earlier run, or another instance under the same name)",
        what, id, instance_id));
  }
  auto payload = bytes.last(n);
  return std::vector<std::byte>(payload.begin(), payload.end());
}

std::span<const std::byte> AsBytes(std::string_view s) {
  return std::as_bytes(std::span(s.data(), s.size()));
}

}  // namespace

RendezvousKey RandomKey() {
  std::random_device rd;
  RendezvousKey key;
  for (size_t i = 0; i < key.size(); i += 4) {
    const uint32_t v = rd();
    for (size_t j = 0; j < 4; ++j) key[i + j] = static_cast<uint8_t>(v >> (8 * j));
  }
  return key;
}

Status PublishRankAddress(Rendezvous& rv, std::string_view instance, uint64_t instance_id,
                          int32_t rank, std::string_view address, Deadline deadline) {
  if (address.size() > kMaxAddressBytes) {
    return Status::InvalidArgument(
        fmt::format("address of {} bytes exceeds {}", address.size(), kMaxAddressBytes));
  }
  return rv.Put(fmt::format("{}/rank/{}", instance, rank), Record(instance_id, AsBytes(address)),
                deadline);
}

StatusOr<std::vector<std::string>> GatherRankAddresses(Rendezvous& rv, std::string_view instance,
                                                       uint64_t instance_id, int32_t ranks,
                                                       Deadline deadline) {
  if (ranks < 1 || ranks > 65536) {
    return Status::InvalidArgument(fmt::format("{} ranks: must be 1..65536", ranks));
  }
  std::vector<std::string> out;
  out.reserve(static_cast<size_t>(ranks));
  for (int32_t r = 0; r < ranks; ++r) {
    const std::string key = fmt::format("{}/rank/{}", instance, r);
    KVF_ASSIGN_OR_RETURN(std::vector<std::byte> bytes, rv.Get(key, deadline));
    KVF_ASSIGN_OR_RETURN(std::vector<std::byte> payload,
                         Open(bytes, instance_id, key, kMaxAddressBytes));
    out.emplace_back(reinterpret_cast<const char*>(payload.data()), payload.size());
  }
  return out;
}

Status PublishInstanceSecret(Rendezvous& rv, std::string_view instance, uint64_t instance_id,
                             const std::array<uint8_t, 16>& secret, Deadline deadline) {
  return rv.Put(fmt::format("{}/secret", instance),
                Record(instance_id, std::as_bytes(std::span(secret))), deadline);
}

StatusOr<std::array<uint8_t, 16>> FetchInstanceSecret(Rendezvous& rv, std::string_view instance,
                                                      uint64_t instance_id, Deadline deadline) {
  const std::string key = fmt::format("{}/secret", instance);
  KVF_ASSIGN_OR_RETURN(std::vector<std::byte> bytes, rv.Get(key, deadline));
  KVF_ASSIGN_OR_RETURN(std::vector<std::byte> payload, Open(bytes, instance_id, key, 16));
  std::array<uint8_t, 16> secret;
  if (payload.size() != secret.size()) {
    return Status::InvalidArgument(
        fmt::format("rendezvous {}: a secret of {} bytes, expected 16", key, payload.size()));
  }
  for (size_t i = 0; i < secret.size(); ++i) secret[i] = static_cast<uint8_t>(payload[i]);
  return secret;
}

std::string HandleKey(uint64_t request_id) { return fmt::format("handle/{}", request_id); }

Status PublishHandle(Rendezvous& rv, uint64_t request_id, std::span<const std::byte> handle,
                     Deadline deadline) {
  return rv.Put(HandleKey(request_id), handle, deadline);
}

StatusOr<std::vector<std::byte>> FetchHandle(Rendezvous& rv, uint64_t request_id,
                                             Deadline deadline) {
  return rv.Get(HandleKey(request_id), deadline);
}

}  // namespace kvferry
