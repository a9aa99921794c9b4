#include "kvferry/inproc_transport.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cstring>
#include <deque>
#include <list>
#include <map>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "base/thread_annotations.h"

namespace kvferry {
namespace {

constexpr std::string_view kScheme = "inproc:";

struct OpState {
  std::atomic<bool> done{false};
  Status status;
  size_t bytes = 0;
  void Complete(Status st, size_t n) {
    status = std::move(st);
    bytes = n;
    done.store(true, std::memory_order_release);
  }
};

class InProcOp final : public TransportOp {
 public:
  explicit InProcOp(std::shared_ptr<OpState> s) : s_(std::move(s)) {}
  bool Done() const override { return s_->done.load(std::memory_order_acquire); }
  Status status() const override { return Done() ? s_->status : Status::Ok(); }
  size_t bytes() const override { return Done() ? s_->bytes : 0; }
  const std::shared_ptr<OpState>& state() const { return s_; }

 private:
  std::shared_ptr<OpState> s_;
};

std::unique_ptr<TransportOp> Wrap(std::shared_ptr<OpState> s) {
  return std::make_unique<InProcOp>(std::move(s));
}

std::unique_ptr<TransportOp> FailedOp(Status st) {
  auto s = std::make_shared<OpState>();
  s->Complete(std::move(st), 0);
  return Wrap(std::move(s));
}

class Fabric final : public InProcFabric {
 public:
  struct PendingSend {
    std::string from;
    uint64_t tag;
    const std::byte* buf;
    size_t bytes;
    std::shared_ptr<OpState> op;
  };
  struct PendingRecv {
    std::string from;  // empty: any peer
    uint64_t tag;
    std::byte* buf;
    size_t capacity;
    std::shared_ptr<OpState> op;
  };
  // A region registered for one-sided access; keys name it by id.
  struct Region {
    std::byte* base;
    size_t bytes;
  };
  struct Node {
    bool alive = true;
    std::map<uint64_t, Region> regions;  // by registration id
    std::list<PendingSend> sends;        // messages waiting for a receive at this node
    std::list<PendingRecv> recvs;        // receives posted at this node
    std::deque<std::pair<std::string, std::vector<std::byte>>> control;
    int wakeup_fd = -1;  // the owning transport's eventfd, written when control arrives
  };

  Status Kill(std::string_view address) override {
    MutexLock lock(mu);
    return KillLocked(address);
  }

  Status KillLocked(std::string_view address) REQUIRES(mu) {
    auto it = nodes.find(address);
    if (it == nodes.end())
      return Status::NotFound("no inproc transport at " + std::string(address));
    const std::string addr(address);
    auto dead = [&] { return Status::Unavailable("inproc peer " + addr + " is dead"); };
    Node& node = it->second;
    node.alive = false;
    for (auto& s : node.sends) s.op->Complete(dead(), 0);
    for (auto& r : node.recvs) r.op->Complete(dead(), 0);
    node.sends.clear();
    node.recvs.clear();
    node.control.clear();
    for (auto& [name, other] : nodes) {
      other.sends.remove_if([&](PendingSend& s) {
        if (s.from != addr) return false;
        s.op->Complete(dead(), 0);
        return true;
      });
      other.recvs.remove_if([&](PendingRecv& r) {
        if (r.from != addr) return false;
        r.op->Complete(dead(), 0);
        return true;
      });
    }
    return Status::Ok();
  }

  Mutex mu;
  std::map<std::string, Node, std::less<>> nodes GUARDED_BY(mu);
  uint64_t next_id GUARDED_BY(mu) = 0;
  uint64_t next_region GUARDED_BY(mu) = 1;
};

// Key: "IPRK" + u64 registration id (little-endian).
constexpr size_t kKeyBytes = 12;

class InProcRegistration final : public MemoryRegistration {
 public:
  InProcRegistration(std::shared_ptr<Fabric> fabric, std::string owner, uint64_t id,
                     std::byte* base, size_t bytes, std::vector<std::byte> owned)
      : fabric_(std::move(fabric)),
        owner_(std::move(owner)),
        base_(base),
        bytes_(bytes),
        owned_(std::move(owned)) {
    const char magic[4] = {'I', 'P', 'R', 'K'};
    std::memcpy(key_.data(), magic, 4);
    for (int i = 0; i < 8; ++i) key_[4 + i] = static_cast<std::byte>(id >> (8 * i));
    id_ = id;
  }
  ~InProcRegistration() override {
    MutexLock lock(fabric_->mu);
    auto it = fabric_->nodes.find(owner_);
    if (it != fabric_->nodes.end()) it->second.regions.erase(id_);
  }
  std::span<const std::byte> PackedKey() const override { return key_; }
  uint64_t address() const override { return reinterpret_cast<uint64_t>(base_); }
  size_t size() const override { return bytes_; }

 private:
  const std::shared_ptr<Fabric> fabric_;
  const std::string owner_;
  std::byte* const base_;
  const size_t bytes_;
  std::vector<std::byte> owned_;
  std::array<std::byte, kKeyBytes> key_{};
  uint64_t id_ = 0;
};

StatusOr<uint64_t> DecodeKey(std::span<const std::byte> key) {
  if (key.size() != kKeyBytes || std::memcmp(key.data(), "IPRK", 4) != 0) {
    return Status::InvalidArgument("inproc: not a remote key (" + std::to_string(key.size()) +
                                   " bytes)");
  }
  uint64_t id = 0;
  for (int i = 0; i < 8; ++i) id |= uint64_t(std::to_integer<uint8_t>(key[4 + i])) << (8 * i);
  return id;
}

class InProcTransport final : public Transport {
 public:
  InProcTransport(std::shared_ptr<Fabric> fabric, bool device_is_host)
      : fabric_(std::move(fabric)) {
    caps_.name = "inproc";
    caps_.tag_bits = 64;
    caps_.device_memory = device_is_host;
    caps_.one_sided = true;
    caps_.detects_crashed_peers = true;  // InProcFabric::Kill
    caps_.max_control_bytes = size_t{1} << 20;
    wakeup_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);  // -1: callers poll
    MutexLock lock(fabric_->mu);
    address_ = std::string(kScheme) + std::to_string(fabric_->next_id++);
    fabric_->nodes[address_].wakeup_fd = wakeup_fd_;
  }

  ~InProcTransport() override {
    {
      MutexLock lock(fabric_->mu);
      (void)fabric_->KillLocked(address_);
      fabric_->nodes[address_].wakeup_fd = -1;
    }
    if (wakeup_fd_ >= 0) close(wakeup_fd_);
  }

  const TransportCaps& caps() const override { return caps_; }
  std::string LocalAddress() const override { return address_; }

  StatusOr<PeerId> Connect(std::string_view address, Deadline) override {
    if (address.substr(0, kScheme.size()) != kScheme || address.size() == kScheme.size()) {
      return Status::InvalidArgument("not an inproc address: '" + std::string(address) + "'");
    }
    {
      MutexLock lock(fabric_->mu);
      auto it = fabric_->nodes.find(address);
      if (it == fabric_->nodes.end()) {
        return Status::Unavailable("no inproc transport at " + std::string(address));
      }
      if (!it->second.alive) {
        return Status::Unavailable("inproc transport at " + std::string(address) + " is dead");
      }
    }
    return PeerFor(address);
  }

  StatusOr<std::unique_ptr<TransportOp>> Send(PeerId peer, uint64_t tag, const void* buf,
                                              size_t bytes, MemoryKind kind) override {
    KVF_RETURN_IF_ERROR(CheckKind(kind));
    KVF_ASSIGN_OR_RETURN(const std::string* dest, PeerAddress(peer));
    auto op = std::make_shared<OpState>();
    MutexLock lock(fabric_->mu);
    Fabric::Node& me = fabric_->nodes[address_];
    if (!me.alive) return FailedOp(Status::Unavailable("inproc transport was killed"));
    auto it = fabric_->nodes.find(*dest);
    if (it == fabric_->nodes.end() || !it->second.alive) {
      return FailedOp(Status::Unavailable("inproc peer " + *dest + " is dead"));
    }
    Fabric::Node& node = it->second;
    for (auto r = node.recvs.begin(); r != node.recvs.end(); ++r) {
      if (r->tag != tag || (!r->from.empty() && r->from != address_)) continue;
      Deliver(static_cast<const std::byte*>(buf), bytes, *op, *r);
      node.recvs.erase(r);
      return Wrap(std::move(op));
    }
    node.sends.push_back({address_, tag, static_cast<const std::byte*>(buf), bytes, op});
    return Wrap(std::move(op));
  }

  StatusOr<std::unique_ptr<TransportOp>> Recv(PeerId peer, uint64_t tag, void* buf, size_t capacity,
                                              MemoryKind kind) override {
    KVF_RETURN_IF_ERROR(CheckKind(kind));
    std::string from;
    if (peer != kAnyPeer) {
      KVF_ASSIGN_OR_RETURN(const std::string* a, PeerAddress(peer));
      from = *a;
    }
    auto op = std::make_shared<OpState>();
    Fabric::PendingRecv recv{from, tag, static_cast<std::byte*>(buf), capacity, op};
    MutexLock lock(fabric_->mu);
    Fabric::Node& me = fabric_->nodes[address_];
    if (!me.alive) return FailedOp(Status::Unavailable("inproc transport was killed"));
    for (auto s = me.sends.begin(); s != me.sends.end(); ++s) {
      if (s->tag != tag || (!from.empty() && s->from != from)) continue;
      Deliver(s->buf, s->bytes, *s->op, recv);
      me.sends.erase(s);
      return Wrap(std::move(op));
    }
    if (!from.empty()) {
      auto it = fabric_->nodes.find(from);
      if (it == fabric_->nodes.end() || !it->second.alive) {
        return FailedOp(Status::Unavailable("inproc peer " + from + " is dead"));
      }
    }
    me.recvs.push_back(std::move(recv));
    return Wrap(std::move(op));
  }

  void Cancel(TransportOp& op) override {
    auto* mine = dynamic_cast<InProcOp*>(&op);
    if (mine == nullptr || mine->Done()) return;
    OpState* target = mine->state().get();
    MutexLock lock(fabric_->mu);
    for (auto& [name, node] : fabric_->nodes) {
      node.recvs.remove_if([&](Fabric::PendingRecv& r) { return r.op.get() == target; });
      node.sends.remove_if([&](Fabric::PendingSend& s) { return s.op.get() == target; });
    }
    if (!mine->Done()) target->Complete(Status::Cancelled("inproc op cancelled"), 0);
  }

  Status SendControl(PeerId peer, std::span<const std::byte> bytes) override {
    if (bytes.size() > caps_.max_control_bytes) {
      return Status::InvalidArgument("control message of " + std::to_string(bytes.size()) +
                                     " bytes exceeds " + std::to_string(caps_.max_control_bytes));
    }
    KVF_ASSIGN_OR_RETURN(const std::string* dest, PeerAddress(peer));
    MutexLock lock(fabric_->mu);
    if (!fabric_->nodes[address_].alive) return Status::Unavailable("inproc transport was killed");
    auto it = fabric_->nodes.find(*dest);
    if (it == fabric_->nodes.end() || !it->second.alive) {
      return Status::Unavailable("inproc peer " + *dest + " is dead");
    }
    it->second.control.emplace_back(address_, std::vector<std::byte>(bytes.begin(), bytes.end()));
    if (it->second.wakeup_fd >= 0) {
      const uint64_t one = 1;
      (void)!write(it->second.wakeup_fd, &one, sizeof one);  // fails only when the count is full
    }
    return Status::Ok();
  }

  int WakeupFd() override { return wakeup_fd_; }
  bool ArmWakeup() override {
    if (wakeup_fd_ < 0) return false;
    uint64_t count = 0;
    (void)!read(wakeup_fd_, &count, sizeof count);  // clear it; a message after this sets it
    MutexLock lock(fabric_->mu);
    return fabric_->nodes[address_].control.empty();
  }

  std::optional<ControlMessage> PollControl() override {
    std::pair<std::string, std::vector<std::byte>> msg;
    {
      MutexLock lock(fabric_->mu);
      auto& q = fabric_->nodes[address_].control;
      if (q.empty()) return std::nullopt;
      msg = std::move(q.front());
      q.pop_front();
    }
    return ControlMessage{PeerFor(msg.first), std::move(msg.second)};
  }

  bool Progress() override { return false; }  // every match completes at once

  StatusOr<std::unique_ptr<MemoryRegistration>> RegisterMemory(void* ptr, size_t bytes,
                                                               MemoryKind kind) override {
    KVF_RETURN_IF_ERROR(CheckKind(kind));
    if (bytes == 0) return Status::InvalidArgument("inproc: empty registration");
    std::vector<std::byte> owned;
    if (ptr == nullptr) {
      owned.resize(bytes);
      ptr = owned.data();
    }
    MutexLock lock(fabric_->mu);
    const uint64_t id = fabric_->next_region++;
    fabric_->nodes[address_].regions[id] = Fabric::Region{static_cast<std::byte*>(ptr), bytes};
    return std::unique_ptr<MemoryRegistration>(std::make_unique<InProcRegistration>(
        fabric_, address_, id, static_cast<std::byte*>(ptr), bytes, std::move(owned)));
  }

  // Completes at once: the bytes are visible at the peer when Put returns. A key that names no
  // live registration of the peer, or a range outside it, fails the op (nothing is written).
  StatusOr<std::unique_ptr<TransportOp>> Put(PeerId peer, const void* local, size_t bytes,
                                             MemoryKind kind, uint64_t remote_addr,
                                             std::span<const std::byte> rkey) override {
    KVF_RETURN_IF_ERROR(CheckKind(kind));
    KVF_ASSIGN_OR_RETURN(const std::string* dest, PeerAddress(peer));
    KVF_ASSIGN_OR_RETURN(uint64_t id, DecodeKey(rkey));
    MutexLock lock(fabric_->mu);
    if (!fabric_->nodes[address_].alive)
      return FailedOp(Status::Unavailable("inproc transport was killed"));
    auto it = fabric_->nodes.find(*dest);
    if (it == fabric_->nodes.end() || !it->second.alive) {
      return FailedOp(Status::Unavailable("inproc peer " + *dest + " is dead"));
    }
    auto reg = it->second.regions.find(id);
    if (reg == it->second.regions.end()) {
      return FailedOp(Status::InvalidArgument("inproc: remote key " + std::to_string(id) +
                                              " names no registration of peer " + *dest));
    }
    const uint64_t base = reinterpret_cast<uint64_t>(reg->second.base);
    if (remote_addr < base || remote_addr - base > reg->second.bytes ||
        bytes > reg->second.bytes - (remote_addr - base)) {
      return FailedOp(Status::InvalidArgument(
          "inproc: put of " + std::to_string(bytes) + " bytes at " + std::to_string(remote_addr) +
          " is outside the registration [" + std::to_string(base) + ", +" +
          std::to_string(reg->second.bytes) + ") of peer " + *dest));
    }
    if (bytes > 0) std::memcpy(reinterpret_cast<void*>(remote_addr), local, bytes);
    auto op = std::make_shared<OpState>();
    op->Complete(Status::Ok(), bytes);
    return Wrap(std::move(op));
  }

  StatusOr<std::unique_ptr<TransportOp>> Flush(PeerId peer) override {
    KVF_ASSIGN_OR_RETURN(const std::string* dest, PeerAddress(peer));
    MutexLock lock(fabric_->mu);
    auto it = fabric_->nodes.find(*dest);
    if (!fabric_->nodes[address_].alive || it == fabric_->nodes.end() || !it->second.alive) {
      return FailedOp(Status::Unavailable("inproc peer " + *dest + " is dead"));
    }
    auto op = std::make_shared<OpState>();
    op->Complete(Status::Ok(), 0);
    return Wrap(std::move(op));
  }

 private:
  Status CheckKind(MemoryKind kind) const {
    if (kind == MemoryKind::kFile) return Status::InvalidArgument("inproc: kFile is not memory");
    if (kind == MemoryKind::kDevice && !caps_.device_memory) {
      return Status::InvalidArgument("inproc: kDevice buffers are GPU memory in this process");
    }
    return Status::Ok();
  }

  // Called with the fabric lock held.
  static void Deliver(const std::byte* src, size_t bytes, OpState& send, Fabric::PendingRecv& r) {
    if (bytes > r.capacity) {
      r.op->Complete(Status::InvalidArgument("message of " + std::to_string(bytes) +
                                             " bytes is larger than the receive buffer (" +
                                             std::to_string(r.capacity) + ")"),
                     0);
      send.Complete(Status::Ok(), bytes);
      return;
    }
    if (bytes > 0) std::memcpy(r.buf, src, bytes);
    r.op->Complete(Status::Ok(), bytes);
    send.Complete(Status::Ok(), bytes);
  }

  StatusOr<const std::string*> PeerAddress(PeerId peer) const {
    if (peer < 0 || static_cast<size_t>(peer) >= peers_.size()) {
      return Status::InvalidArgument("unknown peer id " + std::to_string(peer));
    }
    return &peers_[peer];
  }

  PeerId PeerFor(std::string_view address) {
    auto it = peer_ids_.find(std::string(address));
    if (it != peer_ids_.end()) return it->second;
    peers_.emplace_back(address);
    const PeerId id = static_cast<PeerId>(peers_.size() - 1);
    peer_ids_.emplace(std::string(address), id);
    return id;
  }

  const std::shared_ptr<Fabric> fabric_;
  TransportCaps caps_;
  std::string address_;
  int wakeup_fd_ = -1;             // owned; readable once a control message came since ArmWakeup
  std::deque<std::string> peers_;  // PeerId -> address (deque: stable references)
  std::unordered_map<std::string, PeerId> peer_ids_;
};

}  // namespace

std::shared_ptr<InProcFabric> InProcFabric::Create() { return std::make_shared<Fabric>(); }

StatusOr<std::unique_ptr<Transport>> CreateInProcTransport(const TransportOptions& options) {
  if (!options.fabric) return Status::InvalidArgument("inproc transport needs options.fabric");
  auto fabric = std::static_pointer_cast<Fabric>(options.fabric);
  return std::unique_ptr<Transport>(
      std::make_unique<InProcTransport>(std::move(fabric), options.device_memory_is_host));
}

}  // namespace kvferry
