// The UCX transport's one-sided half: registration, remote keys, put, get, flush, and what its
// endpoints run over.
//
// Packed key (MemoryRegistration::PackedKey), byte by byte (version 1):
//   0..3  "kvrk"   4  version (1)   5  memory type (0 host, 1 cuda)   6..7  zero
//   8..15 registration address, 16..23 registration size (little-endian u64)
//   24..  the UCX remote key (ucp_rkey_pack)
// The address and size let a putter refuse a range outside the registration before UCX sees it.
#include <cstring>
#include <string>

#include "transport/ucx_transport_impl.h"

namespace kvferry::ucx_detail {
namespace {

constexpr char kKeyMagic[4] = {'k', 'v', 'r', 'k'};
constexpr uint8_t kKeyVersion = 1;
constexpr size_t kKeyHeader = 24;

void PutU64(std::vector<std::byte>& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<std::byte>(v >> (8 * i)));
}

uint64_t LoadU64(const std::byte* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = v << 8 | static_cast<uint8_t>(p[i]);
  return v;
}

std::string Hex(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof(buf), "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

}  // namespace

StatusOr<std::unique_ptr<MemoryRegistration>> UcxTransport::RegisterMemory(void* ptr, size_t bytes,
                                                                           MemoryKind kind) {
  KVF_RETURN_IF_ERROR(CheckKind(kind));
  if (bytes == 0) return Status::InvalidArgument("ucx: empty registration");
  const bool cuda = kind == MemoryKind::kDevice && !device_is_host_;
  ucp_mem_map_params_t mp{};
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                  UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
  if (ptr == nullptr) {
    // UCX allocates: on one host, shared memory that peers' puts reach with a plain copy.
    if (cuda) return Status::InvalidArgument("ucx: allocating device memory is not supported");
    mp.field_mask |= UCP_MEM_MAP_PARAM_FIELD_FLAGS;
    mp.flags = UCP_MEM_MAP_ALLOCATE;
  }
  mp.address = ptr;
  mp.length = bytes;
  mp.memory_type = cuda ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST;
  ucp_mem_h memh = nullptr;
  ucs_status_t st = ucp_mem_map(context_.get(), &mp, &memh);
  if (st != UCS_OK) {
    return FromUcs(st, "ucp_mem_map of " + std::to_string(bytes) + " bytes of " +
                           (cuda ? "cuda" : "host") + " memory");
  }
  if (ptr == nullptr) {
    ucp_mem_attr_t ma{};
    ma.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS;
    st = ucp_mem_query(memh, &ma);
    if (st != UCS_OK) {
      ucp_mem_unmap(context_.get(), memh);
      return FromUcs(st, "ucp_mem_query");
    }
    ptr = ma.address;
  }
  void* key = nullptr;
  size_t key_len = 0;
  st = ucp_rkey_pack(context_.get(), memh, &key, &key_len);
  if (st != UCS_OK) {
    ucp_mem_unmap(context_.get(), memh);
    return FromUcs(st, "ucp_rkey_pack");
  }
  std::vector<std::byte> packed;
  packed.reserve(kKeyHeader + key_len);
  for (char c : kKeyMagic) packed.push_back(static_cast<std::byte>(c));
  packed.push_back(static_cast<std::byte>(kKeyVersion));
  packed.push_back(static_cast<std::byte>(cuda ? 1 : 0));
  packed.push_back(std::byte{0});
  packed.push_back(std::byte{0});
  PutU64(packed, reinterpret_cast<uintptr_t>(ptr));
  PutU64(packed, bytes);
  packed.insert(packed.end(), static_cast<std::byte*>(key), static_cast<std::byte*>(key) + key_len);
  ucp_rkey_buffer_release(key);
  return std::unique_ptr<MemoryRegistration>(
      std::make_unique<UcxRegistration>(context_.get(), memh, std::move(packed), ptr, bytes));
}

StatusOr<ucp_rkey_h> UcxTransport::RemoteKeyFor(Peer& p, std::span<const std::byte> rkey,
                                                uint64_t remote_addr, size_t bytes) {
  if (rkey.size() <= kKeyHeader || std::memcmp(rkey.data(), kKeyMagic, 4) != 0 ||
      static_cast<uint8_t>(rkey[4]) != kKeyVersion) {
    return Status::InvalidArgument("ucx: not a kvferry packed key (" + std::to_string(rkey.size()) +
                                   " bytes)");
  }
  const uint64_t base = LoadU64(rkey.data() + 8), size = LoadU64(rkey.data() + 16);
  if (remote_addr < base || bytes > size || remote_addr - base > size - bytes) {
    return Status::InvalidArgument("ucx: " + std::to_string(bytes) + " bytes at " +
                                   Hex(remote_addr) + " lie outside the registration [" +
                                   Hex(base) + ", +" + std::to_string(size) + ")");
  }
  const auto* last = p.last_key;
  if (last != nullptr && last->first.size() == rkey.size() &&
      std::memcmp(last->first.data(), rkey.data(), rkey.size()) == 0) {
    return last->second.handle.get();
  }
  std::string bytes_key(reinterpret_cast<const char*>(rkey.data()), rkey.size());
  auto it = p.rkeys.find(bytes_key);
  if (it == p.rkeys.end()) {
    ucp_rkey_h h = nullptr;
    const ucs_status_t st = ucp_ep_rkey_unpack(p.data_ep, rkey.data() + kKeyHeader, &h);
    if (st != UCS_OK) return FromUcs(st, "ucp_ep_rkey_unpack");
    it = p.rkeys.emplace(std::move(bytes_key), RemoteKey{RkeyPtr(h), base, size}).first;
  }
  p.last_key = &*it;
  return it->second.handle.get();
}

StatusOr<std::unique_ptr<TransportOp>> UcxTransport::Put(PeerId peer, const void* local,
                                                         size_t bytes, MemoryKind kind,
                                                         uint64_t remote_addr,
                                                         std::span<const std::byte> rkey) {
  KVF_RETURN_IF_ERROR(CheckKind(kind));
  KVF_ASSIGN_OR_RETURN(Peer * p, ReadyPeer(peer));
  if (p->dead) return Dead(peer, bytes);
  KVF_ASSIGN_OR_RETURN(ucp_rkey_h key, RemoteKeyFor(*p, rkey, remote_addr, bytes));
  auto s = NewOp(peer, false);
  s->bytes = bytes;
  ucp_request_param_t prm = Param(s.get(), kind, false);
  ucs_status_ptr_t r = ucp_put_nbx(p->data_ep, local, bytes, remote_addr, key, &prm);
  return Posted(std::move(s), r, "ucp_put_nbx");
}

StatusOr<std::unique_ptr<TransportOp>> UcxTransport::Get(PeerId peer, void* local, size_t bytes,
                                                         MemoryKind kind, uint64_t remote_addr,
                                                         std::span<const std::byte> rkey) {
  KVF_RETURN_IF_ERROR(CheckKind(kind));
  KVF_ASSIGN_OR_RETURN(Peer * p, ReadyPeer(peer));
  if (p->dead) return Dead(peer, bytes);
  KVF_ASSIGN_OR_RETURN(ucp_rkey_h key, RemoteKeyFor(*p, rkey, remote_addr, bytes));
  auto s = NewOp(peer, false);
  s->bytes = bytes;
  ucp_request_param_t prm = Param(s.get(), kind, false);
  ucs_status_ptr_t r = ucp_get_nbx(p->data_ep, local, bytes, remote_addr, key, &prm);
  return Posted(std::move(s), r, "ucp_get_nbx");
}

StatusOr<std::unique_ptr<TransportOp>> UcxTransport::Flush(PeerId peer) {
  KVF_ASSIGN_OR_RETURN(Peer * p, ReadyPeer(peer));
  if (p->dead) return Dead(peer, 0);
  auto s = NewOp(peer, false);
  ucp_request_param_t prm = Param(s.get(), MemoryKind::kHost, false);
  prm.op_attr_mask &= ~static_cast<uint32_t>(UCP_OP_ATTR_FIELD_MEMORY_TYPE);
  ucs_status_ptr_t r = ucp_ep_flush_nbx(p->data_ep, &prm);
  return Posted(std::move(s), r, "ucp_ep_flush_nbx");
}

namespace {

std::string EpTransports(ucp_ep_h ep) {
  ucp_transport_entry_t entries[16] = {};
  ucp_ep_attr_t attr{};
  attr.field_mask = UCP_EP_ATTR_FIELD_TRANSPORTS;
  attr.transports.entries = entries;
  attr.transports.num_entries = 16;
  attr.transports.entry_size = sizeof(ucp_transport_entry_t);
  if (ucp_ep_query(ep, &attr) != UCS_OK) return "?";
  std::string out;
  for (unsigned i = 0; i < attr.transports.num_entries && i < 16; ++i) {
    const std::string e = std::string(entries[i].transport_name ? entries[i].transport_name : "?") +
                          "/" + (entries[i].device_name ? entries[i].device_name : "?");
    if (out.find(e) != std::string::npos) continue;
    out += (out.empty() ? "" : " ") + e;
  }
  return out.empty() ? "none" : out;
}

}  // namespace

std::string UcxTransport::DescribePeer(PeerId peer) {
  if (peer < 0 || static_cast<size_t>(peer) >= peers_.size()) return "unknown peer";
  const Peer& p = peers_[peer];
  if (p.dead) return "dead: " + p.death.ToString();
  if (p.ctrl_ep == nullptr) return "not connected yet";
  return "data " + EpTransports(p.data_ep) + "; control " + EpTransports(p.ctrl_ep);
}

}  // namespace kvferry::ucx_detail
