// The NIXL transport's registrations and one-sided transfers (nixl_transport.cc says how puts
// gather into NIXL requests and when a request is complete).
#include <fmt/format.h>

#include "transport/nixl_transport_impl.h"

namespace kvferry {
namespace nixl_detail {

void NixlTransport::ReleaseXfer(Xfer& x) {
  if (x.req) {
    if (api_->release_xfer_req(agent_, x.req) == kCapiSuccess) {
      api_->destroy_xfer_req(x.req);
      x.req = nullptr;
    }
  }
  if (x.req == nullptr) {
    for (RegDlist t : x.temps) {
      api_->deregister_mem(agent_, t, nullptr);
      api_->destroy_reg_dlist(t);
    }
    x.temps.clear();
  }
}

void NixlTransport::FailXfer(Xfer& x, const Status& st) {
  for (auto& s : x.ops) Finish(*s, st);
  ReleaseXfer(x);
}

void NixlTransport::PostXfer(Xfer x) {
  XferDlist l = nullptr, r = nullptr;
  Status st =
      FromCapi(api_->create_xfer_dlist(x.local_place.mem, &l), "nixl_capi_create_xfer_dlist");
  if (st.ok()) {
    st = FromCapi(api_->create_xfer_dlist(x.remote_place.mem, &r), "nixl_capi_create_xfer_dlist");
  }
  for (size_t i = 0; st.ok() && i < x.sizes.size(); ++i) {
    st = FromCapi(api_->xfer_dlist_add_desc(l, x.local[i], x.sizes[i], x.local_place.device),
                  "xfer_dlist_add_desc");
    if (st.ok()) {
      st = FromCapi(api_->xfer_dlist_add_desc(r, x.remote[i], x.sizes[i], x.remote_place.device),
                    "xfer_dlist_add_desc");
    }
  }
  if (st.ok()) {
    const int rc =
        api_->create_xfer_req(agent_, x.op, l, r, peers_[x.peer].agent.c_str(), &x.req, nullptr);
    if (rc != kCapiSuccess) {
      x.req = nullptr;
      st = Status::InvalidArgument(fmt::format(
          "nixl_capi_create_xfer_req ({} descriptors to peer {}): NIXL refused the transfer ({}): "
          "a range outside the registrations it knows (NIXL logs why)",
          x.sizes.size(), x.peer, rc));
    }
  }
  if (l) api_->destroy_xfer_dlist(l);
  if (r) api_->destroy_xfer_dlist(r);
  if (st.ok()) {
    const int rc = api_->post_xfer_req(agent_, x.req, nullptr);
    if (rc == kCapiSuccess) {
      for (auto& s : x.ops) Finish(*s, Status::Ok());
    } else if (rc != kCapiInProg) {
      st = Status::Unavailable(
          fmt::format("nixl_capi_post_xfer_req to peer {} failed ({})", x.peer, rc));
    }
  }
  if (!st.ok())
    for (auto& s : x.ops) Finish(*s, st);
  x.local.clear();
  x.remote.clear();
  x.sizes.clear();
  xfers_.push_back(std::move(x));  // released by PollXfers
}

void NixlTransport::PostBatches() {
  for (auto& [peer, b] : batches_) PostXfer(std::move(b));
  batches_.clear();
}

bool NixlTransport::PollXfers() {
  bool any = false;
  for (size_t i = 0; i < xfers_.size();) {
    Xfer& x = xfers_[i];
    bool all_done = true;
    for (const auto& s : x.ops) all_done &= s->done;
    const int rc =
        all_done || x.req == nullptr ? kCapiSuccess : api_->get_xfer_status(agent_, x.req);
    if (rc == kCapiInProg) {
      ++i;
      continue;
    }
    any = true;
    for (auto& s : x.ops) {
      Finish(*s, rc == kCapiSuccess
                     ? Status::Ok()
                     : Status::Unavailable(fmt::format(
                           "nixl transport: transfer to peer {} failed ({})", x.peer, rc)));
    }
    ReleaseXfer(x);
    if (x.req) zombies_.push_back(std::move(x));
    xfers_[i] = std::move(xfers_.back());
    xfers_.pop_back();
  }
  for (size_t i = 0; i < zombies_.size();) {
    ReleaseXfer(zombies_[i]);
    if (zombies_[i].req == nullptr) {
      zombies_[i] = std::move(zombies_.back());
      zombies_.pop_back();
    } else {
      ++i;
    }
  }
  for (auto& [peer, puts] : puts_) {
    std::erase_if(puts, [](const auto& s) { return s->done; });
  }
  return any;
}

StatusOr<std::unique_ptr<MemoryRegistration>> NixlTransport::RegisterMemory(void* ptr, size_t bytes,
                                                                            MemoryKind kind) {
  KVF_RETURN_IF_ERROR(CheckKind(kind));
  if (bytes == 0) return Status::InvalidArgument("nixl transport: registering 0 bytes");
  const bool gpu = kind == MemoryKind::kDevice && !device_is_host_;
  if (ptr == nullptr && gpu) {
    return Status::InvalidArgument("nixl transport: GPU memory is registered, not allocated here");
  }
  KVF_ASSIGN_OR_RETURN(const MemPlace place, PlaceOf(ptr, gpu));
  void* owned = nullptr;
  if (ptr == nullptr) {
    if (posix_memalign(&owned, 4096, bytes) != 0) {
      return Status::ResourceExhausted(fmt::format("nixl transport: {} bytes", bytes));
    }
    ptr = owned;
  }
  RegDlist dl = nullptr;
  Status st = FromCapi(api_->create_reg_dlist(place.mem, &dl), "nixl_capi_create_reg_dlist");
  if (st.ok()) {
    st = FromCapi(api_->reg_dlist_add_desc(dl, reinterpret_cast<uintptr_t>(ptr), bytes,
                                           place.device, nullptr, 0),
                  "nixl_capi_reg_dlist_add_desc");
  }
  if (st.ok()) st = FromCapi(api_->register_mem(agent_, dl, nullptr), "nixl_capi_register_mem");
  void* md = nullptr;
  size_t md_len = 0;
  if (st.ok()) {
    st = FromCapi(api_->get_local_partial_md(agent_, dl, &md, &md_len, nullptr),
                  "nixl_capi_get_local_partial_md");
    if (!st.ok()) api_->deregister_mem(agent_, dl, nullptr);
  }
  if (!st.ok()) {
    if (dl) api_->destroy_reg_dlist(dl);
    std::free(owned);
    return st.WithContext("nixl transport: registering memory");
  }
  Blob md_owner(md);
  NixlKey k{name_, reinterpret_cast<uint64_t>(ptr), bytes, {}, place.mem, place.device};
  auto b = AsBytes(md, md_len);
  k.metadata.assign(b.begin(), b.end());
  regs_[k.base] = Registered{bytes, place};
  return std::unique_ptr<MemoryRegistration>(
      new NixlRegistration(this, dl, owned, k.base, bytes, EncodeNixlKey(k)));
}

void NixlTransport::Deregister(RegDlist dlist, uint64_t addr) {
  regs_.erase(addr);
  api_->deregister_mem(agent_, dlist, nullptr);
  api_->destroy_reg_dlist(dlist);
}

StatusOr<std::unique_ptr<TransportOp>> NixlTransport::Transfer(int op, PeerId peer,
                                                               const void* local, size_t bytes,
                                                               MemoryKind kind,
                                                               uint64_t remote_addr,
                                                               std::span<const std::byte> rkey) {
  KVF_RETURN_IF_ERROR(CheckKind(kind));
  KVF_ASSIGN_OR_RETURN(NixlKey key, DecodeNixlKey(rkey));
  if (remote_addr < key.base || bytes > key.size || remote_addr - key.base > key.size - bytes) {
    return Status::InvalidArgument(
        fmt::format("nixl transport: {} bytes at {:#x} lie outside the registration [{:#x}, +{})",
                    bytes, remote_addr, key.base, key.size));
  }
  KVF_RETURN_IF_ERROR(CheckPeer(peer));
  auto p = ReadyPeer(peer);
  if (!p.ok()) return DoneOp(peer, bytes, p.status());
  if (key.agent != (*p)->agent) {
    return Status::InvalidArgument(
        fmt::format("nixl transport: a key of agent '{}' used for peer {} (agent '{}')", key.agent,
                    peer, (*p)->agent));
  }
  if (bytes == 0) return DoneOp(peer, 0, Status::Ok());
  const std::string key_bytes(reinterpret_cast<const char*>(rkey.data()), rkey.size());
  if (!(*p)->keys.count(key_bytes)) {
    KVF_RETURN_IF_ERROR(LoadMetadata(key.metadata, key.agent, "the metadata in a key"));
    (*p)->keys.insert(key_bytes);
  }
  const auto addr = reinterpret_cast<uint64_t>(local);
  auto reg = regs_.upper_bound(addr);
  const bool registered =
      reg != regs_.begin() && (--reg, addr - reg->first <= reg->second.size &&
                                          bytes <= reg->second.size - (addr - reg->first));
  MemPlace place;
  if (registered) {
    place = reg->second.place;
  } else {
    KVF_ASSIGN_OR_RETURN(place, PlaceOf(local, kind == MemoryKind::kDevice && !device_is_host_));
  }
  RegDlist temp = nullptr;
  if (!registered) {
    Status st = FromCapi(api_->create_reg_dlist(place.mem, &temp), "nixl_capi_create_reg_dlist");
    if (st.ok()) {
      st = FromCapi(api_->reg_dlist_add_desc(temp, addr, bytes, place.device, nullptr, 0),
                    "nixl_capi_reg_dlist_add_desc");
    }
    if (st.ok()) st = FromCapi(api_->register_mem(agent_, temp, nullptr), "register_mem");
    if (!st.ok()) {
      if (temp) api_->destroy_reg_dlist(temp);
      return st.WithContext(op == kOpWrite ? "nixl transport: put" : "nixl transport: get");
    }
  }
  auto s = std::make_shared<OpState>();
  s->peer = peer;
  s->bytes = bytes;
  // Puts to a peer gather into one request (one NIXL transfer, one endpoint flush), posted by
  // Flush, by the next Progress, or when it is large; a get goes at once.
  const MemPlace remote_place{key.mem, key.device};
  Xfer one;
  if (op == kOpWrite) {  // a request's lists have one memory type each: a new batch when it changes
    auto b = batches_.find(peer);
    if (b != batches_.end() &&
        (b->second.local_place != place || b->second.remote_place != remote_place)) {
      PostXfer(std::move(b->second));
      batches_.erase(b);
    }
  }
  Xfer& x = op == kOpWrite ? batches_[peer] : one;
  x.peer = peer;
  x.op = op;
  x.local_place = place;
  x.remote_place = remote_place;
  x.ops.push_back(s);
  x.local.push_back(addr);
  x.remote.push_back(remote_addr);
  x.sizes.push_back(bytes);
  if (temp) x.temps.push_back(temp);
  if (op == kOpWrite) {
    puts_[peer].push_back(s);
    if (x.sizes.size() >= kMaxBatch) {
      PostXfer(std::move(x));
      batches_.erase(peer);
    }
  } else {
    PostXfer(std::move(one));
  }
  return std::unique_ptr<TransportOp>(new NixlOp(std::move(s)));
}

StatusOr<std::unique_ptr<TransportOp>> NixlTransport::Put(PeerId peer, const void* local,
                                                          size_t bytes, MemoryKind kind,
                                                          uint64_t remote_addr,
                                                          std::span<const std::byte> rkey) {
  return Transfer(kOpWrite, peer, local, bytes, kind, remote_addr, rkey);
}

StatusOr<std::unique_ptr<TransportOp>> NixlTransport::Get(PeerId peer, void* local, size_t bytes,
                                                          MemoryKind kind, uint64_t remote_addr,
                                                          std::span<const std::byte> rkey) {
  return Transfer(kOpRead, peer, local, bytes, kind, remote_addr, rkey);
}

// A flush: done when every put it waits for is.
class FlushOp final : public TransportOp {
 public:
  FlushOp(std::vector<std::shared_ptr<OpState>> puts) : puts_(std::move(puts)) {}
  bool Done() const override {
    for (const auto& s : puts_) {
      if (!s->done) return false;
    }
    return true;
  }
  Status status() const override {
    for (const auto& s : puts_) {
      if (s->done && !s->status.ok()) return s->status;
    }
    return Status::Ok();
  }
  size_t bytes() const override { return 0; }

 private:
  std::vector<std::shared_ptr<OpState>> puts_;
};

StatusOr<std::unique_ptr<TransportOp>> NixlTransport::Flush(PeerId peer) {
  KVF_RETURN_IF_ERROR(CheckPeer(peer));
  if (auto p = LivePeer(peer); !p.ok()) return DoneOp(peer, 0, p.status());
  if (auto b = batches_.find(peer); b != batches_.end()) {
    PostXfer(std::move(b->second));
    batches_.erase(b);
  }
  std::vector<std::shared_ptr<OpState>> pending;
  if (auto it = puts_.find(peer); it != puts_.end()) pending = it->second;
  return std::unique_ptr<TransportOp>(new FlushOp(std::move(pending)));
}

}  // namespace nixl_detail
}  // namespace kvferry
