#include "selftest/baseline.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <nlohmann/json.hpp>
#include <thread>

#include "selftest/run_files.h"
#include "testing/nixl_raw.h"

namespace kvferry {
namespace {

using std::chrono::milliseconds;

constexpr size_t kBaseMsg = 4 << 20;
constexpr int kBaseWindow = 16;

int64_t BaselineBytes(const SelftestConfig& cfg) {
  int64_t total = 0;
  for (int i = 0; i < cfg.requests; ++i) total += TokensOf(cfg, i) * cfg.shape.BytesPerToken();
  return std::clamp<int64_t>(total, 4 << 20, int64_t{1} << 30);
}

std::string Hex(std::span<const std::byte> b) {
  std::string s;
  for (std::byte x : b) s += fmt::format("{:02x}", std::to_integer<int>(x));
  return s;
}
std::vector<std::byte> Unhex(const std::string& s) {
  std::vector<std::byte> out;
  for (size_t i = 0; i + 1 < s.size(); i += 2)
    out.push_back(std::byte(std::stoi(s.substr(i, 2), nullptr, 16)));
  return out;
}

// The raw buffers live where the pools live: GPU memory when the transport takes it.
struct RawBuffer {
  Buffer buf;
  MemoryKind wire = MemoryKind::kHost;
  std::string where;
};
StatusOr<RawBuffer> RawAllocate(Device& dev, const Transport& t, size_t bytes) {
  RawBuffer r;
  const bool gpu = dev.info().platform != "cpu";
  if (gpu && t.caps().device_memory) {
    KVF_ASSIGN_OR_RETURN(r.buf, dev.Allocate(MemoryKind::kDevice, bytes));
    r.wire = MemoryKind::kDevice;
    r.where = "gpu";
  } else {
    KVF_ASSIGN_OR_RETURN(r.buf, dev.Allocate(MemoryKind::kPinnedHost, bytes));
    r.where = gpu ? "pinned host" : "host";
  }
  KVF_ASSIGN_OR_RETURN(auto s, dev.CreateStream());
  KVF_RETURN_IF_ERROR(s->Fill(r.buf.data(), 1, bytes));
  KVF_RETURN_IF_ERROR(s->Synchronize(DeadlineIn(milliseconds(30000))));
  return r;
}

// Whether `t` sends tagged messages from memory of `wire` kind (nixl: host memory only).
bool CanTagSend(const Transport& t, MemoryKind wire) {
  return wire != MemoryKind::kDevice || t.caps().device_memory_tagged;
}

// Operations in flight, oldest first, at most kBaseWindow once Add is used: both baseline sides
// keep the same window, the sender's puts or sends, the receiver's receives.
class OpWindow {
 public:
  OpWindow(Transport& t, Deadline deadline) : t_(t), deadline_(deadline) {}
  // Queues `op` without waiting (the warm-up puts).
  void Hold(std::unique_ptr<TransportOp> op) { ops_.push_back(std::move(op)); }
  // Queues `op`, then waits for the oldest when kBaseWindow are in flight.
  Status Add(std::unique_ptr<TransportOp> op) {
    ops_.push_back(std::move(op));
    if (ops_.size() < static_cast<size_t>(kBaseWindow)) return Status::Ok();
    KVF_RETURN_IF_ERROR(WaitOp(t_, *ops_.front(), deadline_));
    ops_.pop_front();
    return Status::Ok();
  }
  // Waits for every queued operation, oldest first.
  Status Drain() {
    while (!ops_.empty()) {
      KVF_RETURN_IF_ERROR(WaitOp(t_, *ops_.front(), deadline_));
      ops_.pop_front();
    }
    return Status::Ok();
  }

 private:
  Transport& t_;
  const Deadline deadline_;
  std::deque<std::unique_ptr<TransportOp>> ops_;
};

// The baseline's exchanges (addresses, keys, done and ack) go through the run's rendezvous.
Status PutText(Rendezvous& rv, std::string_view key, const std::string& s, Deadline deadline) {
  return rv.Put(fmt::format("baseline/{}", key), std::as_bytes(std::span(s.data(), s.size())),
                deadline);
}
StatusOr<std::string> GetText(Rendezvous& rv, std::string_view key, Deadline deadline) {
  KVF_ASSIGN_OR_RETURN(std::vector<std::byte> v, rv.Get(fmt::format("baseline/{}", key), deadline));
  return AsString(v);
}

}  // namespace

StatusOr<BaselineResult> BaselineSender(const SelftestConfig& cfg, const TransportMaker& make,
                                        Device& dev, const BaselineResult& copy) {
  auto deadline = DeadlineIn(cfg.timeout);
  KVF_ASSIGN_OR_RETURN(std::unique_ptr<Rendezvous> rv, ConnectRunRendezvous(cfg));
  KVF_ASSIGN_OR_RETURN(auto t, make());
  KVF_RETURN_IF_ERROR(PutText(*rv, "ctx-addr", t->LocalAddress(), deadline));
  KVF_ASSIGN_OR_RETURN(std::string gen_info, GetText(*rv, "gen-info", deadline));
  auto info = nlohmann::json::parse(gen_info);
  KVF_ASSIGN_OR_RETURN(PeerId peer, t->Connect(info["addr"].get<std::string>(), deadline));
  KVF_ASSIGN_OR_RETURN(RawBuffer src, RawAllocate(dev, *t, kBaseMsg * kBaseWindow));
  const int64_t total = BaselineBytes(cfg);
  const int64_t msgs = (total + kBaseMsg - 1) / kBaseMsg;
  const bool can_put = t->caps().one_sided && info.contains("rkey");
  std::vector<std::byte> rkey;
  uint64_t raddr = 0;
  if (can_put) {
    rkey = Unhex(info["rkey"].get<std::string>());
    raddr = info["raddr"].get<uint64_t>();
  }
  std::unique_ptr<MemoryRegistration> local;  // registered like the pools are
  if (can_put) {
    auto r = t->RegisterMemory(src.buf.data(), src.buf.size(), src.wire);
    if (r.ok()) local = std::move(r).value();
  }
  // One timed pass of `msgs` messages, put or tagged send, kBaseWindow in flight. Puts are
  // warmed first (each slot once, flushed): the first put to a region maps it (cuda_ipc opens the
  // peer's memory handle), a one-time cost the pools pay at their first request too.
  auto pass = [&](bool put) -> StatusOr<double> {
    OpWindow window(*t, deadline);
    for (int i = 0; put && i < kBaseWindow; ++i) {
      KVF_ASSIGN_OR_RETURN(auto op, t->Put(peer, src.buf.data() + i * kBaseMsg, kBaseMsg, src.wire,
                                           raddr + i * kBaseMsg, rkey));
      window.Hold(std::move(op));
    }
    if (put) {
      KVF_ASSIGN_OR_RETURN(auto flush, t->Flush(peer));
      KVF_RETURN_IF_ERROR(WaitOp(*t, *flush, deadline));
      KVF_RETURN_IF_ERROR(window.Drain());
    }
    auto start = Clock::now();
    for (int64_t i = 0; i < msgs; ++i) {
      size_t slot = static_cast<size_t>(i % kBaseWindow);
      std::byte* at = src.buf.data() + slot * kBaseMsg;
      StatusOr<std::unique_ptr<TransportOp>> op =
          put ? t->Put(peer, at, kBaseMsg, src.wire, raddr + slot * kBaseMsg, rkey)
              : t->Send(peer, static_cast<uint64_t>(i), at, kBaseMsg, src.wire);
      if (!op.ok()) return op.status();
      KVF_RETURN_IF_ERROR(window.Add(std::move(op).value()));
    }
    KVF_RETURN_IF_ERROR(window.Drain());
    if (put) {
      KVF_ASSIGN_OR_RETURN(auto flush, t->Flush(peer));
      KVF_RETURN_IF_ERROR(WaitOp(*t, *flush, deadline));
    }
    double secs = std::chrono::duration<double>(Clock::now() - start).count();
    return msgs * double(kBaseMsg) / secs / 1e9;
  };
  // The baseline is the faster of the raw methods the transport has: the honest ceiling.
  BaselineResult out;
  if (can_put) {
    KVF_ASSIGN_OR_RETURN(out.gbps, pass(true));
    out.name = fmt::format("raw {} put, {} memory, {} MiB x{} in flight", t->caps().name, src.where,
                           kBaseMsg >> 20, kBaseWindow);
  }
  // Tagged sends of GPU memory where the transport takes them (not nixl: one-sided only).
  double tag = 0.0;
  if (CanTagSend(*t, src.wire)) {
    KVF_ASSIGN_OR_RETURN(tag, pass(false));
  } else if (!can_put) {
    return Status::Unavailable(fmt::format(
        "no raw {} baseline: GPU memory neither put (no registration) nor sent", t->caps().name));
  }
  if (tag > out.gbps) {
    out.gbps = tag;
    out.name = fmt::format("raw {} tag send, {} memory, {} MiB x{} in flight", t->caps().name,
                           src.where, kBaseMsg >> 20, kBaseWindow);
  }
  out.name += " [" + t->DescribePeer(peer) + "]";  // the transports UCX picked
  // NIXL: also two bare agents' WRITEs of the same bytes (no kvferry transport around them).
  if (info.contains("nixl_raw")) {
    auto raw = RawNixlWrite(info["nixl_raw"].get<std::string>(), src.buf.data(), src.wire, kBaseMsg,
                            kBaseWindow, msgs, deadline);
    if (raw.ok() && *raw > out.gbps) {
      out.gbps = *raw;
      out.name = fmt::format("raw nixl agent write (no kvferry), {} memory, {} MiB x{} in flight",
                             src.where, kBaseMsg >> 20, kBaseWindow);
    } else {
      out.name += raw.ok() ? fmt::format(" (raw nixl agent write: {:.2f} GB/s)", *raw)
                           : " (raw nixl agent write: " + raw.status().ToString() + ")";
    }
  }
  const nlohmann::json done = {
      {"gbps", out.gbps}, {"name", out.name}, {"copy_gbps", copy.gbps}, {"copy_name", copy.name}};
  KVF_RETURN_IF_ERROR(PutText(*rv, "done", done.dump(), deadline));
  // Keep the transport alive until the receiver has seen the end.
  KVF_ASSIGN_OR_RETURN(std::string ack, GetText(*rv, "ack", deadline));
  local.reset();
  return out;
}

StatusOr<ReceivedBaselines> BaselineReceiver(const SelftestConfig& cfg, const TransportMaker& make,
                                             Device& dev) {
  auto deadline = DeadlineIn(cfg.timeout);
  KVF_ASSIGN_OR_RETURN(std::unique_ptr<Rendezvous> rv, ConnectRunRendezvous(cfg));
  KVF_ASSIGN_OR_RETURN(auto t, make());
  KVF_ASSIGN_OR_RETURN(RawBuffer dst, RawAllocate(dev, *t, kBaseMsg * kBaseWindow));
  nlohmann::json info;
  info["addr"] = t->LocalAddress();
  std::unique_ptr<MemoryRegistration> reg;
  if (t->caps().one_sided) {
    auto r = t->RegisterMemory(dst.buf.data(), dst.buf.size(), dst.wire);
    if (r.ok()) {
      reg = std::move(r).value();
      info["rkey"] = Hex(reg->PackedKey());
      info["raddr"] = reg->address();
    }
  }
  // NIXL: a bare agent's target on the same buffer, for the sender's raw NIXL pass.
  std::unique_ptr<RawNixlTarget> nixl_raw;
  if (cfg.transport == "nixl") {
    auto target = RawNixlTarget::Create(dst.buf.data(), dst.buf.size(), dst.wire);
    if (target.ok()) {
      nixl_raw = std::move(target).value();
      info["nixl_raw"] = nixl_raw->Describe();
    }
  }
  KVF_RETURN_IF_ERROR(PutText(*rv, "gen-info", info.dump(), deadline));
  KVF_ASSIGN_OR_RETURN(std::string ctx_addr, GetText(*rv, "ctx-addr", deadline));
  KVF_ASSIGN_OR_RETURN(PeerId peer, t->Connect(ctx_addr, deadline));
  if (CanTagSend(*t, dst.wire)) {  // the tagged-send pass (after the put pass, if any)
    const int64_t msgs = (BaselineBytes(cfg) + kBaseMsg - 1) / kBaseMsg;
    OpWindow window(*t, deadline);
    for (int64_t i = 0; i < msgs; ++i) {
      size_t slot = static_cast<size_t>(i % kBaseWindow);
      KVF_ASSIGN_OR_RETURN(auto op, t->Recv(peer, static_cast<uint64_t>(i),
                                            dst.buf.data() + slot * kBaseMsg, kBaseMsg, dst.wire));
      KVF_RETURN_IF_ERROR(window.Add(std::move(op)));
    }
    KVF_RETURN_IF_ERROR(window.Drain());
  }
  // Keep progressing (one-sided puts need the target alive) until the sender is done (asked of
  // the rendezvous every 10 ms, each look a few ms at most).
  std::string done;
  for (Deadline look = Clock::now();;) {
    t->Progress();
    if (nixl_raw) nixl_raw->Progress();
    if (Clock::now() >= look) {
      auto d = GetText(*rv, "done", DeadlineIn(milliseconds(3)));
      if (d.ok()) {
        done = std::move(d).value();
        break;
      }
      look = DeadlineIn(milliseconds(10));
    }
    if (Clock::now() > deadline) return Status::DeadlineExceeded("baseline sender did not finish");
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  KVF_RETURN_IF_ERROR(PutText(*rv, "ack", "1", deadline));
  auto j = nlohmann::json::parse(done, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return Status::Internal("baseline sender's result: " + done);
  ReceivedBaselines out;
  out.raw = {j.value("gbps", 0.0), j.value("name", std::string())};
  out.copy = {j.value("copy_gbps", 0.0), j.value("copy_name", std::string())};
  return out;
}

Status BaselineBystander(const SelftestConfig& cfg, const TransportMaker& make) {
  if (cfg.transport != "mpi") return Status::Ok();
  KVF_ASSIGN_OR_RETURN(auto t, make());
  KVF_ASSIGN_OR_RETURN(std::unique_ptr<Rendezvous> rv, ConnectRunRendezvous(cfg));
  KVF_ASSIGN_OR_RETURN(std::string ack, GetText(*rv, "ack", DeadlineIn(cfg.timeout)));
  return Status::Ok();
}

StatusOr<BaselineResult> CopyBaseline(const SelftestConfig& cfg, Device& dev) {
  const size_t bytes =
      static_cast<size_t>(std::min<int64_t>(BaselineBytes(cfg), int64_t{256} << 20));
  const bool gpu = dev.info().platform != "cpu";
  const MemoryKind kind = gpu ? MemoryKind::kDevice : MemoryKind::kHost;
  // On a GPU, the destination is on generation rank 0's GPU: a peer copy when it is another.
  const std::string to = RankDevice(cfg, false, 0);
  std::unique_ptr<Device> other;
  if (gpu && to != RankDevice(cfg, true, 0)) {
    KVF_ASSIGN_OR_RETURN(other, OpenDevice(to));
  }
  KVF_ASSIGN_OR_RETURN(Buffer a, dev.Allocate(kind, bytes));
  KVF_ASSIGN_OR_RETURN(Buffer b, (other ? *other : dev).Allocate(kind, bytes));
  KVF_ASSIGN_OR_RETURN(auto s, dev.CreateStream());
  KVF_RETURN_IF_ERROR(s->Fill(a.data(), 1, bytes));
  KVF_RETURN_IF_ERROR(s->Fill(b.data(), 2, bytes));
  KVF_RETURN_IF_ERROR(s->Synchronize(DeadlineIn(milliseconds(30000))));
  double best = 0;
  for (int i = 0; i < 3; ++i) {
    auto start = Clock::now();
    KVF_RETURN_IF_ERROR(s->Copy(b.data(), a.data(), bytes));
    KVF_RETURN_IF_ERROR(s->Synchronize(DeadlineIn(milliseconds(30000))));
    const double secs = std::chrono::duration<double>(Clock::now() - start).count();
    best = std::max(best, bytes / secs / 1e9);
  }
  if (!gpu) {
    // The CPU device's copy streams its stores (device/host_copy.h) and beats libc's memcpy
    // here; the one-copy limit is the faster of the two, each the best of three.
    double libc = 0;
    for (int i = 0; i < 3; ++i) {
      auto start = Clock::now();
      std::memcpy(b.data(), a.data(), bytes);
      const double secs = std::chrono::duration<double>(Clock::now() - start).count();
      libc = std::max(libc, bytes / secs / 1e9);
    }
    return BaselineResult{
        std::max(best, libc),
        fmt::format("one copy of {} MiB, {}: the faster of the device's copy ({:.1f} GB/s) and "
                    "memcpy ({:.1f} GB/s)",
                    bytes >> 20, dev.info().name, best, libc)};
  }
  return BaselineResult{
      best, fmt::format("one {} of {} MiB, {}{}", gpu ? "cudaMemcpy" : "memcpy", bytes >> 20,
                        dev.info().name, other ? fmt::format(" to {}", to) : "")};
}

}  // namespace kvferry
