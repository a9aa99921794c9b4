#include "testing/nixl_raw.h"

#include <fmt/format.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <deque>
#include <random>
#include <vector>

#include "kvferry/config.h"
#include "transport/nixl_api.h"
#include "transport/nixl_wire.h"

namespace kvferry {
namespace {

using namespace nixl_detail;

// A bare agent with the configured backend; destroyed with the object.
class BareAgent {
 public:
  static StatusOr<BareAgent> Create(const NixlApi* api, const char* role) {
    BareAgent a(api);
    std::random_device rd;
    a.name_ = fmt::format("kvferry-raw-{}-{}-{:08x}", role, getpid(), rd());
    CapiAgentConfig cfg{};
    cfg.thread_sync = kSyncNone;
    cfg.num_workers = 1;
    KVF_RETURN_IF_ERROR(FromCapi(api->create_configured_agent(a.name_.c_str(), &cfg, &a.agent_),
                                 "nixl_capi_create_configured_agent"));
    Params params = nullptr;
    KVF_RETURN_IF_ERROR(FromCapi(api->create_params(&params), "nixl_capi_create_params"));
    const std::string kvs = Config::Global().String("nixl.backend_params");
    for (size_t at = 0; at < kvs.size();) {
      size_t end = kvs.find(',', at);
      if (end == std::string::npos) end = kvs.size();
      const std::string kv = kvs.substr(at, end - at);
      const size_t eq = kv.find('=');
      if (eq != std::string::npos && eq > 0) {
        api->params_add(params, kv.substr(0, eq).c_str(), kv.substr(eq + 1).c_str());
      }
      at = end + 1;
    }
    Backend b = nullptr;
    const int rc =
        api->create_backend(a.agent_, Config::Global().String("nixl.backend").c_str(), params, &b);
    api->destroy_params(params);
    if (rc != kCapiSuccess) return Status::Unavailable("raw nixl: the backend did not start");
    api->destroy_backend(b);
    return a;
  }
  BareAgent(BareAgent&& o) noexcept
      : api_(o.api_), agent_(o.agent_), name_(std::move(o.name_)), regs_(std::move(o.regs_)) {
    o.agent_ = nullptr;
    o.regs_.clear();
  }
  ~BareAgent() {
    for (RegDlist r : regs_) {
      api_->deregister_mem(agent_, r, nullptr);
      api_->destroy_reg_dlist(r);
    }
    if (agent_) api_->destroy_agent(agent_);
  }
  Status Register(const void* buf, size_t bytes, const MemPlace& place) {
    RegDlist dl = nullptr;
    KVF_RETURN_IF_ERROR(FromCapi(api_->create_reg_dlist(place.mem, &dl), "create_reg_dlist"));
    regs_.push_back(dl);
    KVF_RETURN_IF_ERROR(FromCapi(api_->reg_dlist_add_desc(dl, reinterpret_cast<uintptr_t>(buf),
                                                          bytes, place.device, nullptr, 0),
                                 "reg_dlist_add_desc"));
    return FromCapi(api_->register_mem(agent_, dl, nullptr), "nixl_capi_register_mem");
  }
  Agent agent() const { return agent_; }
  const std::string& name() const { return name_; }

 private:
  explicit BareAgent(const NixlApi* api) : api_(api) {}
  const NixlApi* api_;
  Agent agent_ = nullptr;
  std::string name_;
  std::vector<RegDlist> regs_;
};

class Target final : public RawNixlTarget {
 public:
  Target(const NixlApi* api, BareAgent agent, std::string described)
      : api_(api), agent_(std::move(agent)), described_(std::move(described)) {
    api_->create_notif_map(&notifs_);
  }
  ~Target() override {
    if (notifs_) api_->destroy_notif_map(notifs_);
  }
  std::string Describe() const override { return described_; }
  void Progress() override {
    api_->get_notifs(agent_.agent(), notifs_, nullptr);  // progresses the backend's workers
    api_->notif_map_clear(notifs_);
  }

 private:
  const NixlApi* api_;
  BareAgent agent_;
  std::string described_;
  NotifMap notifs_ = nullptr;
};

}  // namespace

StatusOr<std::unique_ptr<RawNixlTarget>> RawNixlTarget::Create(void* buf, size_t bytes,
                                                               MemoryKind kind) {
  KVF_ASSIGN_OR_RETURN(const NixlApi* api, LoadNixl());
  KVF_ASSIGN_OR_RETURN(const MemPlace place, PlaceOf(buf, kind == MemoryKind::kDevice));
  KVF_ASSIGN_OR_RETURN(BareAgent agent, BareAgent::Create(api, "target"));
  KVF_RETURN_IF_ERROR(agent.Register(buf, bytes, place));
  void* md = nullptr;
  size_t len = 0;
  KVF_RETURN_IF_ERROR(FromCapi(api->get_local_md(agent.agent(), &md, &len), "get_local_md"));
  NixlKey k{agent.name(), reinterpret_cast<uint64_t>(buf), bytes, {}, place.mem, place.device};
  const auto* p = static_cast<const std::byte*>(md);
  k.metadata.assign(p, p + len);
  std::free(md);
  // A key's bytes as hex: agent, range and the full metadata (connection info included).
  std::string text;
  for (std::byte b : EncodeNixlKey(k)) text += fmt::format("{:02x}", static_cast<unsigned>(b));
  return std::unique_ptr<RawNixlTarget>(new Target(api, std::move(agent), std::move(text)));
}

StatusOr<double> RawNixlWrite(const std::string& target, const void* src, MemoryKind kind,
                              size_t msg, int window, int64_t msgs, Deadline deadline) {
  KVF_ASSIGN_OR_RETURN(const NixlApi* api, LoadNixl());
  std::vector<std::byte> bytes(target.size() / 2);
  for (size_t i = 0; i < bytes.size(); ++i) {
    bytes[i] = static_cast<std::byte>(std::stoi(target.substr(2 * i, 2), nullptr, 16));
  }
  KVF_ASSIGN_OR_RETURN(NixlKey k, DecodeNixlKey(bytes));
  if (k.size < msg * window) return Status::InvalidArgument("raw nixl: the target is too small");
  KVF_ASSIGN_OR_RETURN(const MemPlace place, PlaceOf(src, kind == MemoryKind::kDevice));
  KVF_ASSIGN_OR_RETURN(BareAgent agent, BareAgent::Create(api, "writer"));
  KVF_RETURN_IF_ERROR(agent.Register(src, msg * window, place));
  char* name = nullptr;
  KVF_RETURN_IF_ERROR(
      FromCapi(api->load_remote_md(agent.agent(), k.metadata.data(), k.metadata.size(), &name),
               "raw nixl: nixl_capi_load_remote_md"));
  std::free(name);
  struct InFlight {
    XferReq req;
  };
  std::deque<InFlight> window_q;
  auto post = [&](int64_t i) -> Status {
    const size_t slot = static_cast<size_t>(i % window);
    XferDlist l = nullptr, r = nullptr;
    api->create_xfer_dlist(place.mem, &l);
    api->create_xfer_dlist(k.mem, &r);
    api->xfer_dlist_add_desc(l, reinterpret_cast<uintptr_t>(src) + slot * msg, msg, place.device);
    api->xfer_dlist_add_desc(r, k.base + slot * msg, msg, k.device);
    XferReq q = nullptr;
    Status st =
        FromCapi(api->create_xfer_req(agent.agent(), kOpWrite, l, r, k.agent.c_str(), &q, nullptr),
                 "raw nixl: nixl_capi_create_xfer_req");
    api->destroy_xfer_dlist(l);
    api->destroy_xfer_dlist(r);
    KVF_RETURN_IF_ERROR(st);
    KVF_RETURN_IF_ERROR(
        FromCapi(api->post_xfer_req(agent.agent(), q, nullptr), "raw nixl: post_xfer_req"));
    window_q.push_back({q});
    return Status::Ok();
  };
  auto wait_oldest = [&]() -> Status {
    XferReq q = window_q.front().req;
    int rc;
    while ((rc = api->get_xfer_status(agent.agent(), q)) == kCapiInProg) {
      if (Clock::now() > deadline) return Status::DeadlineExceeded("raw nixl: a WRITE is pending");
    }
    api->release_xfer_req(agent.agent(), q);
    api->destroy_xfer_req(q);
    window_q.pop_front();
    return FromCapi(rc, "raw nixl: a WRITE");
  };
  // Warm-up: each slot once (connection, remote keys).
  for (int i = 0; i < window; ++i) KVF_RETURN_IF_ERROR(post(i));
  while (!window_q.empty()) KVF_RETURN_IF_ERROR(wait_oldest());
  const auto start = Clock::now();
  for (int64_t i = 0; i < msgs; ++i) {
    KVF_RETURN_IF_ERROR(post(i));
    if (window_q.size() >= static_cast<size_t>(window)) KVF_RETURN_IF_ERROR(wait_oldest());
  }
  while (!window_q.empty()) KVF_RETURN_IF_ERROR(wait_oldest());
  const double secs = std::chrono::duration<double>(Clock::now() - start).count();
  return msgs * double(msg) / secs / 1e9;
}

}  // namespace kvferry
