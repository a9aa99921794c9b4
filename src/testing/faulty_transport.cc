#include "testing/faulty_transport.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstring>

#include "base/log.h"
#include "transceiver/wire/messages.h"

namespace kvferry {
namespace {

// An op the fault changed: a hidden or swallowed completion, a send that never left, a receive
// corrupted once it lands. Done only once the op it wraps is (its buffer is then free).
class FaultOp final : public TransportOp {
 public:
  std::shared_ptr<TransportOp> inner;  // null: completed at once with `bytes_sent`
  size_t bytes_sent = 0;
  Clock::time_point hide_until{};
  bool swallow = false;
  bool cancelled = false;
  mutable std::byte* corrupt = nullptr;  // receive buffer: one byte flips once the receive is done

  bool Done() const override {
    if (!inner) return true;
    if (!inner->Done()) return false;
    if (cancelled) return true;
    if (swallow || Clock::now() < hide_until) return false;
    if (corrupt && inner->status().ok() && inner->bytes() > 0) {
      corrupt[inner->bytes() / 2] ^= std::byte{0x5A};
      corrupt = nullptr;
    }
    return true;
  }
  Status status() const override {
    if (!Done()) return Status::Ok();
    if (cancelled) return Status::Cancelled("cancelled (fault-injected op)");
    return inner ? inner->status() : Status::Ok();
  }
  size_t bytes() const override {
    if (!Done() || cancelled) return 0;
    return inner ? inner->bytes() : bytes_sent;
  }
};

// The step a control message is. A CHUNK message (one-sided path: "chunk k is in place") is the
// DATA step where it arrives; where it leaves, the puts before it were the DATA steps.
std::optional<FaultStep> StepOf(std::span<const std::byte> bytes, bool incoming) {
  auto msg = DecodeMessage(bytes);
  if (!msg.ok()) return std::nullopt;
  return std::visit(
      [incoming](const auto& m) -> std::optional<FaultStep> {
        using T = std::decay_t<decltype(m)>;
        if constexpr (std::is_same_v<T, FetchMsg>) return FaultStep::kFetch;
        if constexpr (std::is_same_v<T, AcceptMsg>) return FaultStep::kAccept;
        if constexpr (std::is_same_v<T, RejectMsg>) return FaultStep::kReject;
        if constexpr (std::is_same_v<T, CreditMsg>) return FaultStep::kCredit;
        if constexpr (std::is_same_v<T, DoneMsg>) return FaultStep::kDone;
        if constexpr (std::is_same_v<T, CompleteMsg>) return FaultStep::kComplete;
        if constexpr (std::is_same_v<T, AbortMsg>) return FaultStep::kAbort;
        if constexpr (std::is_same_v<T, ChunkMsg>) {
          if (incoming) return FaultStep::kData;
          return std::nullopt;
        }
        return std::nullopt;
      },
      *msg);
}

void FlipMiddle(std::vector<std::byte>& bytes) {
  if (!bytes.empty()) bytes[bytes.size() / 2] ^= std::byte{0x5A};
}

std::string Lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

}  // namespace

std::string_view FaultStepName(FaultStep step) {
  switch (step) {
    case FaultStep::kFetch:
      return "FETCH";
    case FaultStep::kAccept:
      return "ACCEPT";
    case FaultStep::kReject:
      return "REJECT";
    case FaultStep::kCredit:
      return "CREDIT";
    case FaultStep::kData:
      return "DATA";
    case FaultStep::kDone:
      return "DONE";
    case FaultStep::kComplete:
      return "COMPLETE";
    case FaultStep::kAbort:
      return "ABORT";
  }
  return "?";
}

std::string_view FaultKindName(FaultKind kind) {
  switch (kind) {
    case FaultKind::kCrash:
      return "crash";
    case FaultKind::kStall:
      return "stall";
    case FaultKind::kDrop:
      return "drop";
    case FaultKind::kDuplicate:
      return "duplicate";
    case FaultKind::kCorrupt:
      return "corrupt";
  }
  return "?";
}

StatusOr<FaultPoint> ParseFaultPoint(std::string_view text) {
  std::vector<std::string_view> f;
  for (size_t at = 0;;) {
    size_t colon = text.find(':', at);
    f.push_back(text.substr(at, colon == std::string_view::npos ? colon : colon - at));
    if (colon == std::string_view::npos) break;
    at = colon + 1;
  }
  auto bad = [&](std::string_view what) {
    return Status::InvalidArgument(fmt::format(
        "fault '{}': {} (expected SIDE:RANK:STEP:NTH:KIND[:STALL_MS], e.g. ctx:1:CREDIT:3:crash)",
        text, what));
  };
  if (f.size() != 5 && f.size() != 6) return bad(fmt::format("{} fields", f.size()));
  FaultPoint p;
  const std::string side = Lower(f[0]);
  if (side != "ctx" && side != "gen") return bad(fmt::format("side '{}' is not ctx or gen", f[0]));
  p.context = side == "ctx";
  auto number = [](std::string_view s, int64_t lo, int64_t hi) -> std::optional<int64_t> {
    int64_t v = 0;
    auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    if (ec != std::errc{} || end != s.data() + s.size() || v < lo || v > hi) return std::nullopt;
    return v;
  };
  auto rank = number(f[1], 0, 1 << 20);
  if (!rank) return bad(fmt::format("rank '{}' is not a number in [0, {}]", f[1], 1 << 20));
  p.rank = static_cast<int>(*rank);
  bool found = false;
  for (FaultStep s : kAllFaultSteps) {
    if (Lower(FaultStepName(s)) == Lower(f[2])) p.spec.step = s, found = true;
  }
  if (!found)
    return bad(
        fmt::format("step '{}' is not one of FETCH ACCEPT REJECT CREDIT DATA DONE COMPLETE "
                    "ABORT",
                    f[2]));
  auto nth = number(f[3], 1, int64_t{1} << 40);
  if (!nth) return bad(fmt::format("nth '{}' is not a positive number", f[3]));
  p.spec.nth = *nth;
  found = false;
  for (FaultKind k : kAllFaultKinds) {
    if (FaultKindName(k) == Lower(f[4])) p.spec.kind = k, found = true;
  }
  if (!found)
    return bad(fmt::format("kind '{}' is not one of crash stall drop duplicate corrupt", f[4]));
  if (f.size() == 6) {
    auto ms = number(f[5], 1, 3600 * 1000);
    if (!ms) return bad(fmt::format("stall '{}' is not a number of ms in [1, 3600000]", f[5]));
    p.spec.stall = std::chrono::milliseconds(*ms);
  }
  return p;
}

std::string FaultPointString(const FaultPoint& p) {
  return fmt::format("{}:{}:{}:{}:{}:{}", p.context ? "ctx" : "gen", p.rank,
                     FaultStepName(p.spec.step), p.spec.nth, FaultKindName(p.spec.kind),
                     p.spec.stall.count());
}

FaultyTransport::FaultyTransport(std::unique_ptr<Transport> target, FaultSpec spec,
                                 std::function<void()> crash)
    : TransportWrapper(std::move(target)),
      spec_(spec),
      counts_(std::size(kAllFaultSteps), 0),
      crash_(std::move(crash)) {}

FaultyTransport::~FaultyTransport() {
  // Our extra ops name buffers we own: the target completes them when it goes, so it goes first.
  target_.reset();
}

void FaultyTransport::Arm(FaultSpec spec) {
  std::lock_guard lock(arm_mu_);
  spec_ = spec;
  std::fill(counts_.begin(), counts_.end(), 0);
  armed_ = true;
}

std::optional<FaultSpec> FaultyTransport::Hit(FaultStep step) {
  std::lock_guard lock(arm_mu_);
  if (!armed_ || spec_.step != step) return std::nullopt;
  if (++counts_[static_cast<size_t>(step)] != spec_.nth) return std::nullopt;
  armed_ = false;
  ++fired_;
  Log(LogLevel::kDebug, "fault injected at {} #{}: {}", FaultStepName(step), spec_.nth,
      FaultKindName(spec_.kind));
  return spec_;
}

void FaultyTransport::MaybeCrash() {
  if (!crash_pending_ || crashed_) return;
  crashed_ = true;
  out_held_.clear();
  in_held_.clear();
  in_dup_.clear();
  if (crash_) crash_();
}

StatusOr<std::unique_ptr<TransportOp>> FaultyTransport::DataOut(const void* buf, size_t bytes,
                                                                MemoryKind kind,
                                                                const PostFn& post) {
  MaybeCrash();
  std::optional<FaultSpec> f = Hit(FaultStep::kData);
  if (!f) return post(buf);
  const bool host = kind != MemoryKind::kDevice;
  auto wrap = std::make_unique<FaultOp>();
  switch (f->kind) {
    case FaultKind::kCrash:
      crash_pending_ = true;
      return post(buf);
    case FaultKind::kDrop:
      wrap->bytes_sent = bytes;
      return std::unique_ptr<TransportOp>(std::move(wrap));
    case FaultKind::kStall: {
      KVF_ASSIGN_OR_RETURN(wrap->inner, post(buf));
      wrap->hide_until = Clock::now() + f->stall;
      return std::unique_ptr<TransportOp>(std::move(wrap));
    }
    case FaultKind::kDuplicate: {
      KVF_ASSIGN_OR_RETURN(auto op, post(buf));
      if (!host) return op;
      Extra e{Clock::now() + f->stall, std::vector<std::byte>(bytes), nullptr};
      if (bytes > 0) std::memcpy(e.buffer.data(), buf, bytes);
      auto dup = post(e.buffer.data());
      if (dup.ok()) {
        e.op = std::move(dup).value();
        extras_.push_back(std::move(e));
      }
      return op;
    }
    case FaultKind::kCorrupt: {
      if (!host) return post(buf);
      Extra e{Clock::time_point::max(), std::vector<std::byte>(bytes), nullptr};
      if (bytes > 0) std::memcpy(e.buffer.data(), buf, bytes);
      FlipMiddle(e.buffer);
      KVF_ASSIGN_OR_RETURN(auto op, post(e.buffer.data()));
      e.op = std::move(op);
      wrap->inner = e.op;
      extras_.push_back(std::move(e));
      return std::unique_ptr<TransportOp>(std::move(wrap));
    }
  }
  return post(buf);
}

StatusOr<std::unique_ptr<TransportOp>> FaultyTransport::Send(PeerId peer, uint64_t tag,
                                                             const void* buf, size_t bytes,
                                                             MemoryKind kind) {
  return DataOut(buf, bytes, kind,
                 [&](const void* b) { return target_->Send(peer, tag, b, bytes, kind); });
}

StatusOr<std::unique_ptr<TransportOp>> FaultyTransport::Put(PeerId peer, const void* local,
                                                            size_t bytes, MemoryKind kind,
                                                            uint64_t remote_addr,
                                                            std::span<const std::byte> rkey) {
  return DataOut(local, bytes, kind, [&](const void* b) {
    return target_->Put(peer, b, bytes, kind, remote_addr, rkey);
  });
}

StatusOr<std::unique_ptr<TransportOp>> FaultyTransport::Recv(PeerId peer, uint64_t tag, void* buf,
                                                             size_t capacity, MemoryKind kind) {
  MaybeCrash();
  // The one-sided path's watch receive (chunk number all ones: it only notices a dead context
  // rank) carries no chunk: not a DATA step.
  constexpr uint64_t kChunkMask = (uint64_t{1} << kChunkTagBits) - 1;
  if ((tag & kChunkMask) == kChunkMask) return target_->Recv(peer, tag, buf, capacity, kind);
  std::optional<FaultSpec> f = Hit(FaultStep::kData);
  if (!f) return target_->Recv(peer, tag, buf, capacity, kind);
  KVF_ASSIGN_OR_RETURN(std::unique_ptr<TransportOp> op,
                       target_->Recv(peer, tag, buf, capacity, kind));
  auto wrap = std::make_unique<FaultOp>();
  wrap->inner = std::move(op);
  switch (f->kind) {
    case FaultKind::kCrash:
      crash_pending_ = true;
      break;
    case FaultKind::kDrop:
      wrap->swallow = true;
      break;
    case FaultKind::kStall:
      wrap->hide_until = Clock::now() + f->stall;
      break;
    case FaultKind::kDuplicate: {
      Extra e{Clock::now() + f->stall, std::vector<std::byte>(capacity), nullptr};
      auto dup = target_->Recv(peer, tag, e.buffer.data(), capacity, MemoryKind::kHost);
      if (dup.ok()) {
        e.op = std::move(dup).value();
        extras_.push_back(std::move(e));
      }
      break;
    }
    case FaultKind::kCorrupt:
      if (kind != MemoryKind::kDevice) wrap->corrupt = static_cast<std::byte*>(buf);
      break;
  }
  return std::unique_ptr<TransportOp>(std::move(wrap));
}

void FaultyTransport::Cancel(TransportOp& op) {
  MaybeCrash();
  auto* f = dynamic_cast<FaultOp*>(&op);
  if (!f) return target_->Cancel(op);
  if (f->Done()) return;
  f->cancelled = true;
  if (f->inner && !f->inner->Done()) target_->Cancel(*f->inner);
}

Status FaultyTransport::SendControl(PeerId peer, std::span<const std::byte> bytes) {
  MaybeCrash();
  if (crashed_) return target_->SendControl(peer, bytes);
  std::optional<FaultSpec> f;
  if (auto step = StepOf(bytes, false)) f = Hit(*step);
  std::vector<std::byte> copy(bytes.begin(), bytes.end());
  int copies = 1;
  if (f) {
    switch (f->kind) {
      case FaultKind::kCrash:
        crash_pending_ = true;
        break;
      case FaultKind::kStall:
        out_held_.push_back(Held{Clock::now() + f->stall, peer, std::move(copy)});
        return Status::Ok();
      case FaultKind::kDrop:
        return Status::Ok();
      case FaultKind::kDuplicate:
        copies = 2;
        break;
      case FaultKind::kCorrupt:
        FlipMiddle(copy);
        break;
    }
  }
  Status st = Status::Ok();
  for (int i = 0; i < copies; ++i) {
    if (out_held_.empty()) {
      Status sent = target_->SendControl(peer, copy);
      if (st.ok()) st = std::move(sent);
    } else {
      // Behind a stalled message, in order.
      out_held_.push_back(Held{Clock::now(), peer, copy});
    }
  }
  FlushHeld();
  return st;
}

bool FaultyTransport::FlushHeld() {
  bool any = false;
  const auto now = Clock::now();
  while (!out_held_.empty() && out_held_.front().until <= now) {
    Held h = std::move(out_held_.front());
    out_held_.pop_front();
    Status st = target_->SendControl(h.peer, h.bytes);
    if (!st.ok())
      Log(LogLevel::kDebug, "faulty transport: a held control message failed: {}", st.ToString());
    any = true;
  }
  return any;
}

std::optional<ControlMessage> FaultyTransport::PollControl() {
  MaybeCrash();
  if (!in_dup_.empty()) {
    ControlMessage m = std::move(in_dup_.front());
    in_dup_.pop_front();
    return m;
  }
  while (true) {
    // Everything arriving behind a stalled message waits behind it.
    if (!in_held_.empty()) {
      while (auto m = target_->PollControl())
        in_held_.push_back(Held{Clock::now(), m->from, std::move(m->bytes)});
      if (in_held_.front().until > Clock::now()) return std::nullopt;
      Held h = std::move(in_held_.front());
      in_held_.pop_front();
      return ControlMessage{h.peer, std::move(h.bytes)};
    }
    std::optional<ControlMessage> m = target_->PollControl();
    if (!m || crashed_) return m;
    std::optional<FaultSpec> f;
    if (auto step = StepOf(m->bytes, true)) f = Hit(*step);
    if (!f) return m;
    switch (f->kind) {
      case FaultKind::kCrash:
        crash_pending_ = true;
        return m;
      case FaultKind::kStall:
        in_held_.push_back(Held{Clock::now() + f->stall, m->from, std::move(m->bytes)});
        continue;
      case FaultKind::kDrop:
        continue;
      case FaultKind::kDuplicate:
        in_dup_.push_back(*m);
        return m;
      case FaultKind::kCorrupt:
        FlipMiddle(m->bytes);
        return m;
    }
    return m;
  }
}

bool FaultyTransport::ReapExtras() {
  bool any = false;
  const auto now = Clock::now();
  for (auto it = extras_.begin(); it != extras_.end();) {
    if (!it->op->Done() && now >= it->cancel_at) target_->Cancel(*it->op);
    if (it->op->Done() && it->op.use_count() == 1) {
      it = extras_.erase(it);
      any = true;
    } else {
      ++it;
    }
  }
  return any;
}

bool FaultyTransport::Progress() {
  MaybeCrash();
  bool any = FlushHeld();
  any |= ReapExtras();
  return target_->Progress() || any;
}

}  // namespace kvferry
