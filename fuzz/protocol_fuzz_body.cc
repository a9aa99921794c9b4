#include "protocol_fuzz_body.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <thread>
#include <vector>

#include "kvferry/config.h"
#include "kvferry/inproc_transport.h"
#include "kvferry/pool.h"
#include "kvferry/transceiver.h"
#include "kvferry/transport.h"
#include "testing/testdata.h"
#include "transceiver/engine/engine.h"
#include "transceiver/wire/handle.h"
#include "transceiver/wire/messages.h"

namespace kvferry {
namespace {

using std::chrono::milliseconds;

constexpr milliseconds kTimeout{80};
constexpr milliseconds kAbortGrace{40};
constexpr milliseconds kUnknownWait{30};
// Scheduling slack beyond deadline + grace: sanitizers on a loaded two-core machine.
constexpr milliseconds kSlack{3000};
constexpr int kPublishable = 4;  // request ids 100..103 can be published; 104..107 never are
constexpr int64_t kPoolBlocks = 16;
constexpr uint64_t kGenInstance = 11;
const KvShape kShape{4, 2, 8, DType::kFp16, 2, 4};

void Check(bool ok, const char* what) {
  if (ok) return;
  std::fprintf(stderr, "protocol_fuzz: property broken: %s\n", what);
  std::abort();
}

class Input {
 public:
  Input(const uint8_t* d, size_t n) : d_(d), n_(n) {}
  bool more() const { return i_ < n_; }
  uint8_t U8() { return i_ < n_ ? d_[i_++] : 0; }
  uint32_t U32() {
    uint32_t v = 0;
    for (int k = 0; k < 4; ++k) v |= uint32_t{U8()} << (8 * k);
    return v;
  }
  int64_t I64() { return static_cast<int64_t>(uint64_t{U32()} | uint64_t{U32()} << 32); }
  template <typename T, size_t N>
  T Pick(const T (&table)[N]) {
    return table[U8() % N];
  }

 private:
  const uint8_t* d_;
  size_t n_;
  size_t i_ = 0;
};

struct Request {
  uint64_t id = 0;
  std::vector<int64_t> ctx_blocks, gen_blocks;
  int64_t tokens = 0;
  int64_t reused = 0;
  std::vector<std::byte> handle;
  bool published = false;
  bool fetched = false;
  Clock::time_point last_start;
};

class Harness {
 public:
  explicit Harness(uint8_t config) : device_(OpenCpuDevice()), fabric_(InProcFabric::Create()) {
    TransceiverOptions o;
    o.transport = "inproc";
    o.timeout = kTimeout;
    o.chunk_bytes = 512;
    o.staging_chunks = 1;  // one slot per rank: a leaked slot stalls the final request
    o.direct_min_bytes = (config & 4) ? 1 << 30 : 256;
    o.instance_secret[0] = 7;
    const LayoutKind ctx_layout = (config & 1) ? LayoutKind::kPerLayer : LayoutKind::kBlockMajor;
    const LayoutKind gen_layout = (config & 2) ? LayoutKind::kPerLayer : LayoutKind::kBlockMajor;
    std::vector<std::string> addresses;
    for (int r = 0; r < 2; ++r) {
      ctx_pools_.push_back(MakePool({2, 1, {}, 1, 0}, r, ctx_layout));
      auto side = ContextSide::Create(*device_, ctx_pools_.back(), o, NewTransport());
      Check(side.ok(), "context side starts");
      ctx_.push_back(std::move(side).value());
      addresses.push_back(ctx_.back()->address());
    }
    for (auto& c : ctx_) Check(c->SetInstanceAddresses(addresses).ok(), "addresses set");
    o.instance_id = kGenInstance;
    gen_pools_.push_back(MakePool({1, 1, {}, 1, 0}, 0, gen_layout));
    auto gen = GenerationSide::Create(*device_, gen_pools_.back(), o, NewTransport());
    Check(gen.ok(), "generation side starts");
    gen_ = std::move(gen).value();
    hostile_ = NewTransport();
    for (int r = 0; r < 2; ++r) {
      ctx_peer_[r] = hostile_->Connect(ctx_[r]->address(), DeadlineIn(milliseconds(100))).value();
    }
    gen_peer_ = hostile_->Connect(gen_->address(), DeadlineIn(milliseconds(100))).value();
    for (int k = 0; k < 2 * kPublishable; ++k) {
      Request& r = requests_[k];
      r.id = 100 + k;
      for (int64_t i = 0; i < 3; ++i) {
        r.ctx_blocks.push_back(4 * (k % kPublishable) + i);
        r.gen_blocks.push_back(15 - 4 * (k % kPublishable) - i);
      }
    }
  }

  void Run(Input& in) {
    for (int step = 0; step < 64 && in.more(); ++step) {
      const uint8_t op = in.U8();
      Request& r = requests_[(op >> 5) & 7];
      switch (op & 7) {
        case 0:
          Publish(r, &in, (op & 8) != 0);
          break;
        case 1:
          Fetch(r, in, (op & 8) != 0);
          break;
        case 2:
          Inject(ctx_peer_[(op >> 3) & 1], r, in);
          break;
        case 3:
          Inject(gen_peer_, r, in);
          break;
        case 4:
          if (op & 8) {
            (void)ctx_[(op >> 4) & 1]->Cancel(r.id);
          } else {
            (void)gen_->Cancel(r.id);
          }
          break;
        case 5:
          std::this_thread::sleep_for(milliseconds(in.U8() % 8));
          break;
        case 6: {
          std::vector<std::byte> junk(in.U8() % 24);
          for (auto& b : junk) b = std::byte{in.U8()};
          (void)hostile_->SendControl((op & 8) ? gen_peer_ : ctx_peer_[(op >> 4) & 1], junk);
          break;
        }
        case 7:
          for (int c = 0; c < 2; ++c) {
            if ((op >> (3 + c)) & 1) (void)ctx_[c]->MarkLayersReady(r.id, kShape.layers);
          }
          break;
      }
      DrainHostile();
    }
  }

  // Every request ends once on every rank that knows it, in time; then a request that needs
  // every staging slot goes through.
  void Finish() {
    Clock::time_point last = Clock::now();
    for (auto& [k, r] : requests_) last = std::max(last, r.last_start);
    const Deadline until = last + kTimeout + kAbortGrace + kSlack;
    std::map<uint64_t, int> ctx_seen[2], gen_seen;
    std::map<uint64_t, TransferStatus> gen_final;
    size_t ctx_want = 0, gen_want = 0;
    for (auto& [k, r] : requests_) {
      ctx_want += r.published;
      gen_want += r.fetched;
    }
    for (int c = 0; c < 2; ++c) {
      size_t got = 0;
      while (got < ctx_want && Clock::now() < until) {
        for (const TransferStatus& s : ctx_[c]->Poll(ctx_want - got, until)) {
          Check(IsTerminal(s.state), "only terminal states are reported");
          Check(s.state == TransferState::kComplete || !s.reason.ok(), "a failure has a reason");
          ++ctx_seen[c][s.request_id];
          ++got;
        }
      }
    }
    size_t got = 0;
    while (got < gen_want && Clock::now() < until) {
      for (const TransferStatus& s : gen_->Poll(gen_want - got, until)) {
        Check(IsTerminal(s.state), "only terminal states are reported");
        Check(s.state == TransferState::kComplete || !s.reason.ok(), "a failure has a reason");
        ++gen_seen[s.request_id];
        gen_final[s.request_id] = s;
        ++got;
      }
    }
    for (auto& [k, r] : requests_) {
      for (int c = 0; c < 2; ++c) {
        Check(ctx_seen[c][r.id] == (r.published ? 1 : 0),
              "every published request ends exactly once on every context rank, in time");
      }
      Check(gen_seen[r.id] == (r.fetched ? 1 : 0),
            "every fetched request ends exactly once on the generation rank, in time");
      if (r.fetched && gen_final[r.id].state == TransferState::kComplete) {
        Check(Holds(r.id, r.gen_blocks, r.tokens, r.reused),
              "a request reported complete holds the context's data");
      }
    }
    // Nothing leaked: no staging slot is held and no request is live once every request ended.
    for (auto& c : ctx_) {
      Check(c->stats().staging_slots_in_use == 0, "no context staging slot held");
      Check(c->stats().live_requests == 0, "no context request (lease) outlives its report");
    }
    Check(gen_->stats().staging_slots_in_use == 0, "no generation staging slot held");
    Check(gen_->stats().live_requests == 0, "no generation request outlives its report");
    // The ranks still serve. Completion itself is not required: under a starved fuzzing machine a
    // request may time out at 80 ms (the counters above are what prove nothing leaked).
    FreshRequest(999);
  }

  bool FreshRequest(uint64_t id) {
    Request fresh;
    fresh.id = id;
    fresh.ctx_blocks = {3, 7, 11};
    fresh.gen_blocks = {0, 4, 8};
    fresh.tokens = 11;
    Check(Publish(fresh, nullptr, false), "a fresh request is published after the program");
    Check(gen_->Fetch(fresh.handle, fresh.gen_blocks, 0).ok(), "a fresh request is fetched");
    const Deadline until = DeadlineIn(kTimeout + kAbortGrace + kSlack);
    std::function<std::vector<TransferStatus>(Deadline)> polls[] = {
        [&](Deadline d) { return ctx_[0]->Poll(1, d); },
        [&](Deadline d) { return ctx_[1]->Poll(1, d); },
        [&](Deadline d) { return gen_->Poll(1, d); }};
    bool complete = true;
    for (auto& poll : polls) {
      std::vector<TransferStatus> st;
      while (st.empty() && Clock::now() < until) st = poll(until);
      Check(st.size() == 1 && st[0].request_id == id, "the fresh request ends, once, in time");
      if (st[0].state != TransferState::kComplete) {
        std::fprintf(stderr, "protocol_fuzz: fresh request %llu: %s\n",
                     static_cast<unsigned long long>(id), st[0].reason.ToString().c_str());
        complete = false;
      }
    }
    if (complete) Check(Holds(id, fresh.gen_blocks, fresh.tokens, 0), "fresh data arrived");
    return complete;
  }

 private:
  std::unique_ptr<Transport> NewTransport() {
    TransportOptions t;
    t.name = "inproc";
    t.fabric = fabric_;
    auto tr = CreateTransport(t);
    Check(tr.ok(), "inproc transport");
    return std::move(tr).value();
  }

  BlockPool MakePool(ParallelConfig split, int rank, LayoutKind layout) {
    auto pool = BlockPool::Create(
        *device_, PoolSpec{kShape, split, rank, layout, MemoryKind::kHost, kPoolBlocks});
    Check(pool.ok(), "pool");
    for (int i = 0; i < pool->num_regions(); ++i)
      std::memset(pool->region(i), 0x5A, static_cast<size_t>(pool->layout().region_bytes()));
    return std::move(pool).value();
  }

  bool Publish(Request& r, Input* in, bool layer_wise) {
    if (r.published || (in && r.id >= 100 + kPublishable)) return false;
    if (in) r.tokens = 1 + in->U8() % 12;
    const int tpb = kShape.tokens_per_block;
    for (int c = 0; c < 2; ++c) {
      for (size_t i = 0; i < r.ctx_blocks.size(); ++i) {
        const int64_t valid = std::min<int64_t>(tpb, r.tokens - static_cast<int64_t>(i) * tpb);
        if (valid <= 0) continue;
        Check(FillBlock(ctx_pools_[c], r.id, {r.ctx_blocks[i], int64_t(i) * tpb, valid}).ok(),
              "fill");
      }
      auto h = layer_wise ? ctx_[c]->BeginLayerWise(r.id, r.ctx_blocks, r.tokens)
                          : ctx_[c]->MarkReady(r.id, r.ctx_blocks, r.tokens);
      Check(h.ok(), "a request is published");
      Check(c == 0 || *h == r.handle, "both context ranks return the same handle");
      r.handle = *h;
    }
    r.published = true;
    r.last_start = Clock::now();
    return true;
  }

  void Fetch(Request& r, Input& in, bool mutate) {
    if (!r.published || r.fetched) return;
    r.reused = in.U8() % 2;
    std::vector<std::byte> handle = r.handle;
    if (mutate) {  // a router passing a handle altered in fields the token does not cover
      ContextHandle h = DecodeHandle(handle).value();
      switch (in.U8() % 4) {
        case 0:
          h.pool_blocks = in.Pick<int64_t>({1, 17, int64_t{1} << 40, int64_t{1} << 62});
          break;
        case 1:
          h.chunk_bytes = in.Pick<int64_t>({1, 64, 4096, INT64_MAX});
          break;
        case 2:
          h.ctx_direct = !h.ctx_direct;
          break;
        case 3:
          h.addresses[in.U8() % 2] = "inproc:424242";
          break;
      }
      handle = EncodeHandle(h);
    }
    r.last_start = Clock::now();
    r.fetched = gen_->Fetch(handle, r.gen_blocks, r.reused).ok();
  }

  // One control message from the hostile peer: fields aimed at live requests and transfers.
  void Inject(PeerId to, const Request& r, Input& in) {
    const uint32_t tid = in.U8() % 8;  // the generation rank numbers its transfers 1, 2, ...
    const uint8_t code = in.Pick<uint8_t>({0, 1, 3, 6, 7, 200});
    ControlMsg msg;
    switch (in.U8() % 9) {
      case 0: {
        FetchMsg f;
        f.request_id = r.id;
        if (!r.handle.empty()) f.token = DecodeHandle(r.handle).value().token;
        f.gen_instance = in.Pick<uint64_t>({kGenInstance, 12});
        f.gen_rank = in.U8() % 4;
        f.transfer_id = tid;
        f.shape = kShape;
        f.parallel = in.Pick<ParallelConfig>({{1, 1, {}, 1, 0},
                                              {2, 1, {}, 1, 0},
                                              {1, 2, {}, 1, 0},
                                              {4, 1, {}, 2, 1},
                                              {1 << 16, 1 << 16, {}, 1, 0},
                                              {1, 1, {}, 1, 3}});
        f.layout = (in.U8() & 1) ? LayoutKind::kPerLayer : LayoutKind::kBlockMajor;
        f.pool_blocks = in.Pick<int64_t>({16, 3, int64_t{1} << 40, 0, -1, int64_t{1} << 60});
        f.prompt_tokens = in.Pick<int64_t>({r.tokens, r.tokens, 1, INT64_MAX});
        f.reused_blocks = in.Pick<int64_t>({0, 1, -1, 3, INT64_MIN});
        f.chunk_bytes = in.Pick<int64_t>({512, 1, 256, 4096, 0});
        f.direct_min_bytes = in.Pick<int64_t>({kNoDirect, 0, 256, -5});
        f.blocks = in.Pick<std::vector<int64_t>>(
            {r.gen_blocks, {0, 0, 0}, {}, {-1, int64_t{1} << 40, 2}, {13, 14, 15, 12}});
        msg = std::move(f);
        break;
      }
      case 1:
        msg = CreditMsg{r.id, tid, in.Pick<uint32_t>({1, 2, 3, 1000, UINT32_MAX}),
                        in.Pick<std::vector<uint32_t>>({{}, {0}, {kNoSlot}, {7, 0, UINT32_MAX}})};
        break;
      case 2:
        msg = DoneMsg{r.id, tid, in.Pick<int64_t>({0, 1024, -1, INT64_MAX})};
        break;
      case 3:
        msg = AbortMsg{r.id, tid, code, "hostile abort"};
        break;
      case 4:
        msg = CompleteMsg{r.id, tid};
        break;
      case 5:
        msg = AcceptMsg{r.id, tid};
        break;
      case 6:
        msg = RejectMsg{r.id, tid, code, "hostile reject"};
        break;
      case 7:
        if (in.U8() & 1) {
          msg = CreditMsg{r.id ^ 1, tid + 1, 1, {}};  // a neighbour's request, a stale transfer
        } else {
          const uint8_t flags = in.U8();
          msg = ChunkMsg{r.id,
                         tid,
                         in.Pick<uint32_t>({0, 1, 5, UINT32_MAX}),
                         in.Pick<uint32_t>({1, 1, 2, 1u << 20}),
                         (flags & 1) != 0 && (flags & 2) == 0,
                         in.I64() < 0 ? 0u : 1u,
                         (flags & 2) != 0};  // says complete (in phase fetched: accepts too)
        }
        break;
      case 8: {  // another context rank's word, forged: the peer holds no instance secret
        SiblingMsg m{r.id, {}, in.Pick<int32_t>({0, 1, 2, -1, INT32_MAX}), code, "hostile sibling"};
        if (!r.handle.empty()) m.token = DecodeHandle(r.handle).value().token;
        msg = std::move(m);
        break;
      }
    }
    (void)hostile_->SendControl(to, EncodeMessage(msg));
  }

  void DrainHostile() {
    hostile_->Progress();
    while (hostile_->PollControl()) {
    }
  }

  // The generation pool holds request `id`'s values in blocks [reused, needed).
  bool Holds(uint64_t id, const std::vector<int64_t>& blocks, int64_t tokens, int64_t reused) {
    const int tpb = kShape.tokens_per_block;
    for (size_t i = static_cast<size_t>(reused); i < blocks.size(); ++i) {
      const int64_t valid = std::min<int64_t>(tpb, tokens - static_cast<int64_t>(i) * tpb);
      if (valid <= 0) continue;
      auto m = CheckBlock(gen_pools_[0], id, {blocks[i], int64_t(i) * tpb, valid});
      if (!m.ok() || m->has_value()) return false;
    }
    return true;
  }

  std::unique_ptr<Device> device_;
  std::shared_ptr<InProcFabric> fabric_;
  std::deque<BlockPool> ctx_pools_, gen_pools_;  // sides hold references
  std::vector<std::unique_ptr<ContextSide>> ctx_;
  std::unique_ptr<GenerationSide> gen_;
  std::unique_ptr<Transport> hostile_;
  PeerId ctx_peer_[2] = {kAnyPeer, kAnyPeer};
  PeerId gen_peer_ = kAnyPeer;
  std::map<int, Request> requests_;
};

void ConfigureOnce() {
  static const bool done = [] {
    Config& c = Config::Global();
    Check(c.Set("transfer.unknown_request_wait_ms", std::to_string(kUnknownWait.count())).ok() &&
              c.Set("transfer.abort_grace_ms", std::to_string(kAbortGrace.count())).ok(),
          "knobs");
    return true;
  }();
  (void)done;
}

}  // namespace

int ProtocolFuzzOne(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  ConfigureOnce();
  Input in(data + 1, size - 1);
  Harness h(data[0]);
  h.Run(in);
  h.Finish();
  return 0;
}

}  // namespace kvferry
