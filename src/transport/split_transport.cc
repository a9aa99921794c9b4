#include "transport/split_transport.h"

#include <fmt/format.h>

#include <chrono>
#include <string>
#include <unordered_map>
#include <vector>

#include "base/log.h"
#include "base/wire.h"

namespace kvferry {
namespace {

using std::chrono::milliseconds;

constexpr uint8_t kPlain = 0;
constexpr uint8_t kWithAddress = 1;
constexpr size_t kMaxAddress = size_t{1} << 24;
// How long learning a peer that wrote to us may take (the one-sided transport's Connect: NIXL
// loads the peer's metadata, no round trip).
constexpr milliseconds kLearnTimeout{5000};

class SplitTransport final : public Transport {
 public:
  SplitTransport(std::unique_ptr<Transport> one_sided, std::unique_ptr<Transport> messages)
      : one_sided_(std::move(one_sided)), messages_(std::move(messages)) {
    address_ = one_sided_->LocalAddress() + "+" + messages_->LocalAddress();
    const TransportCaps& r = one_sided_->caps();
    const TransportCaps& m = messages_->caps();
    caps_.name = r.name;
    caps_.tag_bits = m.tag_bits;
    caps_.device_memory = r.device_memory;
    caps_.device_memory_tagged = m.device_memory && m.device_memory_tagged;
    caps_.one_sided = r.one_sided;
    caps_.detects_crashed_peers = r.detects_crashed_peers || m.detects_crashed_peers;
    const size_t hello = 1 + 4 + address_.size();
    caps_.max_control_bytes = m.max_control_bytes > hello ? m.max_control_bytes - hello : 0;
  }

  const TransportCaps& caps() const override { return caps_; }
  std::string LocalAddress() const override { return address_; }

  StatusOr<PeerId> Connect(std::string_view address, Deadline deadline) override {
    const size_t plus = address.find('+');
    if (plus == std::string_view::npos || address.find('+', plus + 1) != std::string_view::npos) {
      return Status::InvalidArgument(
          fmt::format("{} transport with a separate control channel: address '{}' is not "
                      "'<one-sided address>+<messages address>'",
                      caps_.name, address.substr(0, 32)));
    }
    KVF_ASSIGN_OR_RETURN(PeerId m, messages_->Connect(address.substr(plus + 1), deadline));
    PeerId id = Learned(m);
    Peer& p = peers_[static_cast<size_t>(id)];
    if (p.one_sided < 0) {
      auto r = one_sided_->Connect(address.substr(0, plus), deadline);
      if (!r.ok()) return r.status();
      p.one_sided = *r;
      p.why.clear();
    }
    return id;
  }

  StatusOr<std::unique_ptr<TransportOp>> Send(PeerId peer, uint64_t tag, const void* buf,
                                              size_t bytes, MemoryKind kind) override {
    KVF_ASSIGN_OR_RETURN(Peer * p, Find(peer));
    return messages_->Send(p->messages, tag, buf, bytes, kind);
  }
  StatusOr<std::unique_ptr<TransportOp>> Recv(PeerId peer, uint64_t tag, void* buf, size_t capacity,
                                              MemoryKind kind) override {
    if (peer == kAnyPeer) return messages_->Recv(kAnyPeer, tag, buf, capacity, kind);
    KVF_ASSIGN_OR_RETURN(Peer * p, Find(peer));
    return messages_->Recv(p->messages, tag, buf, capacity, kind);
  }
  // Sends and receives are the messages transport's (one-sided ops are not cancelled).
  void Cancel(TransportOp& op) override { messages_->Cancel(op); }

  Status SendControl(PeerId peer, std::span<const std::byte> bytes) override {
    KVF_ASSIGN_OR_RETURN(Peer * p, Find(peer));
    WireWriter w;
    if (p->address_sent) {
      w.U8(kPlain);
    } else {
      w.U8(kWithAddress);
      w.Str(address_);
    }
    std::vector<std::byte> out = w.Take();
    out.insert(out.end(), bytes.begin(), bytes.end());
    KVF_RETURN_IF_ERROR(messages_->SendControl(p->messages, out));
    p->address_sent = true;
    return Status::Ok();
  }

  std::optional<ControlMessage> PollControl() override {
    while (auto m = messages_->PollControl()) {
      WireReader r(m->bytes);
      const uint8_t form = r.U8("control form");
      std::string address;
      if (r.ok() && form == kWithAddress) address = r.Str("sender address", kMaxAddress);
      if (r.ok() && form != kPlain && form != kWithAddress) {
        r.Fail(fmt::format("control form {}", form));
      }
      if (!r.ok()) {
        Log(LogLevel::kWarn, "{} transport: a control message dropped: {}", caps_.name,
            r.status().ToString());
        continue;
      }
      const PeerId id = Learned(m->from);
      if (!address.empty()) Learn(peers_[static_cast<size_t>(id)], address);
      ControlMessage out;
      out.from = id;
      out.bytes.assign(m->bytes.begin() + static_cast<std::ptrdiff_t>(r.position()),
                       m->bytes.end());
      return out;
    }
    return std::nullopt;
  }

  bool Progress() override {
    const bool a = one_sided_->Progress();
    const bool b = messages_->Progress();
    return a || b;
  }
  int WakeupFd() override { return messages_->WakeupFd(); }
  bool ArmWakeup() override { return messages_->ArmWakeup(); }

  StatusOr<std::unique_ptr<MemoryRegistration>> RegisterMemory(void* ptr, size_t bytes,
                                                               MemoryKind kind) override {
    return one_sided_->RegisterMemory(ptr, bytes, kind);
  }
  StatusOr<std::unique_ptr<TransportOp>> Put(PeerId peer, const void* local, size_t bytes,
                                             MemoryKind kind, uint64_t remote_addr,
                                             std::span<const std::byte> rkey) override {
    KVF_ASSIGN_OR_RETURN(PeerId r, OneSidedPeer(peer));
    return one_sided_->Put(r, local, bytes, kind, remote_addr, rkey);
  }
  StatusOr<std::unique_ptr<TransportOp>> Get(PeerId peer, void* local, size_t bytes,
                                             MemoryKind kind, uint64_t remote_addr,
                                             std::span<const std::byte> rkey) override {
    KVF_ASSIGN_OR_RETURN(PeerId r, OneSidedPeer(peer));
    return one_sided_->Get(r, local, bytes, kind, remote_addr, rkey);
  }
  StatusOr<std::unique_ptr<TransportOp>> Flush(PeerId peer) override {
    KVF_ASSIGN_OR_RETURN(PeerId r, OneSidedPeer(peer));
    return one_sided_->Flush(r);
  }

  std::string DescribePeer(PeerId peer) override {
    auto p = Find(peer);
    if (!p.ok()) return caps_.name;
    return fmt::format("{}; control and tagged: {}",
                       (*p)->one_sided >= 0 ? one_sided_->DescribePeer((*p)->one_sided)
                                            : caps_.name + " (not connected)",
                       messages_->DescribePeer((*p)->messages));
  }

 private:
  struct Peer {
    PeerId messages = kAnyPeer;
    PeerId one_sided = kAnyPeer;  // kAnyPeer until its address is known and connected
    std::string why = "it has not said its address yet";  // while one_sided is not known
    bool address_sent = false;
  };

  StatusOr<Peer*> Find(PeerId peer) {
    if (peer < 0 || static_cast<size_t>(peer) >= peers_.size()) {
      return Status::InvalidArgument(fmt::format("{} transport: no peer {}", caps_.name, peer));
    }
    return &peers_[static_cast<size_t>(peer)];
  }

  StatusOr<PeerId> OneSidedPeer(PeerId peer) {
    KVF_ASSIGN_OR_RETURN(Peer * p, Find(peer));
    if (p->one_sided < 0) {
      return Status::Unavailable(fmt::format("{} transport: no one-sided connection to peer {}: {}",
                                             caps_.name, peer, p->why));
    }
    return p->one_sided;
  }

  // The peer whose messages-transport id is `m` (added on first sight).
  PeerId Learned(PeerId m) {
    if (auto it = by_messages_.find(m); it != by_messages_.end()) return it->second;
    const auto id = static_cast<PeerId>(peers_.size());
    peers_.push_back(Peer{m});
    by_messages_.emplace(m, id);
    return id;
  }

  // Connects the one-sided side of a peer that wrote to us with its address.
  void Learn(Peer& p, const std::string& address) {
    if (p.one_sided >= 0) return;
    const size_t plus = address.find('+');
    if (plus == std::string::npos) {
      p.why = "its address has no one-sided part";
      return;
    }
    auto r =
        one_sided_->Connect(std::string_view(address).substr(0, plus), DeadlineIn(kLearnTimeout));
    if (r.ok()) {
      p.one_sided = *r;
      p.why.clear();
    } else {
      p.why = r.status().ToString();
      Log(LogLevel::kWarn, "{} transport: a peer that wrote to us can't be reached one-sided: {}",
          caps_.name, p.why);
    }
  }

  std::unique_ptr<Transport> one_sided_, messages_;
  std::string address_;
  TransportCaps caps_;
  std::vector<Peer> peers_;  // by PeerId
  std::unordered_map<PeerId, PeerId> by_messages_;
};

}  // namespace

std::unique_ptr<Transport> MakeSplitTransport(std::unique_ptr<Transport> one_sided,
                                              std::unique_ptr<Transport> messages) {
  return std::make_unique<SplitTransport>(std::move(one_sided), std::move(messages));
}

}  // namespace kvferry
