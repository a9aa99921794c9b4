// TransportWrapper: a Transport that forwards every call to another one, for tests and fault
// injection to subclass and override only what they change (LevelDB's EnvWrapper, kvferry's
// FileBackendWrapper).
//
// Unlike FileBackendWrapper it owns its target: a transport is handed over owned to the side that
// drives it (ContextSide::Create, GenerationSide::Create), so the wrapper is what they own. A
// subclass that keeps buffers a pending operation of the target still names must destroy the
// target first (reset target_ in its destructor): destroying a transport completes its ops.
//
// Thread-safety: as the target's (thread-compatible: one owner thread at a time).
#pragma once

#include <memory>
#include <utility>

#include "kvferry/transport.h"

#pragma GCC visibility push(default)  // the public API (kvferry/export.h)
namespace kvferry {

class TransportWrapper : public Transport {
 public:
  explicit TransportWrapper(std::unique_ptr<Transport> target) : target_(std::move(target)) {}
  Transport* target() const { return target_.get(); }

  const TransportCaps& caps() const override { return target_->caps(); }
  std::string LocalAddress() const override { return target_->LocalAddress(); }
  StatusOr<PeerId> Connect(std::string_view address, Deadline deadline) override {
    return target_->Connect(address, deadline);
  }
  StatusOr<std::unique_ptr<TransportOp>> Send(PeerId peer, uint64_t tag, const void* buf,
                                              size_t bytes, MemoryKind kind) override {
    return target_->Send(peer, tag, buf, bytes, kind);
  }
  StatusOr<std::unique_ptr<TransportOp>> Recv(PeerId peer, uint64_t tag, void* buf, size_t capacity,
                                              MemoryKind kind) override {
    return target_->Recv(peer, tag, buf, capacity, kind);
  }
  void Cancel(TransportOp& op) override { target_->Cancel(op); }
  Status SendControl(PeerId peer, std::span<const std::byte> bytes) override {
    return target_->SendControl(peer, bytes);
  }
  std::optional<ControlMessage> PollControl() override { return target_->PollControl(); }
  bool Progress() override { return target_->Progress(); }
  int WakeupFd() override { return target_->WakeupFd(); }
  bool ArmWakeup() override { return target_->ArmWakeup(); }
  StatusOr<std::unique_ptr<MemoryRegistration>> RegisterMemory(void* ptr, size_t bytes,
                                                               MemoryKind kind) override {
    return target_->RegisterMemory(ptr, bytes, kind);
  }
  StatusOr<std::unique_ptr<TransportOp>> Put(PeerId peer, const void* local, size_t bytes,
                                             MemoryKind kind, uint64_t remote_addr,
                                             std::span<const std::byte> rkey) override {
    return target_->Put(peer, local, bytes, kind, remote_addr, rkey);
  }
  StatusOr<std::unique_ptr<TransportOp>> Flush(PeerId peer) override {
    return target_->Flush(peer);
  }
  StatusOr<std::unique_ptr<TransportOp>> Get(PeerId peer, void* local, size_t bytes,
                                             MemoryKind kind, uint64_t remote_addr,
                                             std::span<const std::byte> rkey) override {
    return target_->Get(peer, local, bytes, kind, remote_addr, rkey);
  }
  std::string DescribePeer(PeerId peer) override { return target_->DescribePeer(peer); }

 protected:
  std::unique_ptr<Transport> target_;
};

}  // namespace kvferry
#pragma GCC visibility pop
