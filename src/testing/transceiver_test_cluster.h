// The in-process cluster harness of the transceiver tests: every rank of a context and a
// generation instance in one process over the in-process transport, pools filled with test data,
// transports wrapped by hooks (corrupting, tampering, one without one-sided operations).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <fstream>
#include <functional>
#include <optional>

#include "kvferry/config.h"
#include "kvferry/inproc_transport.h"
#include "kvferry/transceiver.h"
#include "testing/testdata.h"
#include "transceiver/engine/engine.h"
#include "transceiver/wire/handle.h"
#include "transceiver/wire/messages.h"

namespace kvferry::txtest {

using std::chrono::milliseconds;

// Forwards everything to an in-process transport; tests override what they need (a corrupting or
// a tampering peer, one without one-sided operations).
class TestTransport : public Transport {
 public:
  explicit TestTransport(std::unique_ptr<Transport> base) : base_(std::move(base)) {
    caps_ = base_->caps();
  }
  const TransportCaps& caps() const override { return caps_; }
  std::string LocalAddress() const override { return base_->LocalAddress(); }
  StatusOr<PeerId> Connect(std::string_view a, Deadline d) override { return base_->Connect(a, d); }
  StatusOr<std::unique_ptr<TransportOp>> Send(PeerId p, uint64_t tag, const void* buf, size_t n,
                                              MemoryKind k) override {
    return base_->Send(p, tag, buf, n, k);
  }
  StatusOr<std::unique_ptr<TransportOp>> Recv(PeerId p, uint64_t tag, void* buf, size_t n,
                                              MemoryKind k) override {
    return base_->Recv(p, tag, buf, n, k);
  }
  void Cancel(TransportOp& op) override { base_->Cancel(op); }
  Status SendControl(PeerId p, std::span<const std::byte> b) override {
    return base_->SendControl(p, b);
  }
  std::optional<ControlMessage> PollControl() override { return base_->PollControl(); }
  bool Progress() override { return base_->Progress(); }
  StatusOr<std::unique_ptr<MemoryRegistration>> RegisterMemory(void* ptr, size_t n,
                                                               MemoryKind k) override {
    return base_->RegisterMemory(ptr, n, k);
  }
  StatusOr<std::unique_ptr<TransportOp>> Put(PeerId p, const void* local, size_t n, MemoryKind k,
                                             uint64_t addr,
                                             std::span<const std::byte> rkey) override {
    return base_->Put(p, local, n, k, addr, rkey);
  }
  StatusOr<std::unique_ptr<TransportOp>> Flush(PeerId p) override { return base_->Flush(p); }

 protected:
  std::unique_ptr<Transport> base_;
  TransportCaps caps_;
};

// Flips one byte of the n-th data message or put (inproc copies at the call: a copy will do).
class CorruptingTransport final : public TestTransport {
 public:
  CorruptingTransport(std::unique_ptr<Transport> base, int nth)
      : TestTransport(std::move(base)), nth_(nth) {}
  StatusOr<std::unique_ptr<TransportOp>> Send(PeerId p, uint64_t tag, const void* buf, size_t n,
                                              MemoryKind k) override {
    if (--nth_ != 0) return base_->Send(p, tag, buf, n, k);
    copy_.assign(static_cast<const std::byte*>(buf), static_cast<const std::byte*>(buf) + n);
    copy_[n / 2] ^= std::byte{0x40};
    return base_->Send(p, tag, copy_.data(), n, k);
  }
  StatusOr<std::unique_ptr<TransportOp>> Put(PeerId p, const void* local, size_t n, MemoryKind k,
                                             uint64_t addr,
                                             std::span<const std::byte> rkey) override {
    if (--nth_ != 0) return base_->Put(p, local, n, k, addr, rkey);
    copy_.assign(static_cast<const std::byte*>(local), static_cast<const std::byte*>(local) + n);
    copy_[n / 2] ^= std::byte{0x40};
    return base_->Put(p, copy_.data(), n, k, addr, rkey);
  }

 private:
  int nth_;
  std::vector<std::byte> copy_;  // the send is matched later: keep the bytes
};

using TransportHook = std::function<std::unique_ptr<Transport>(std::unique_ptr<Transport>)>;

struct SideSpec {
  KvShape shape;
  ParallelConfig parallel;
  LayoutKind layout = LayoutKind::kBlockMajor;
  int64_t blocks = 16;
  int wire_version = 0;  // TransceiverOptions::wire_version of the side's ranks (0: the knob)
  // With layout kCustom: every rank's region split and strides (elements; CustomSide).
  RegionSplit split = RegionSplit::kNone;
  PoolStrides strides{};
  KvScales scales{};  // TransceiverOptions::kv_scales of the side's ranks
};

// `s` with distinct KV scales at granularity `g`: value i is base + 0.0137 i.
inline SideSpec WithScales(SideSpec s, ScaleGranularity g, float base) {
  s.scales.granularity = g;
  for (int64_t i = 0; i < KvScales::CountFor(g, s.shape); ++i)
    s.scales.values.push_back(base + 0.0137f * static_cast<float>(i));
  return s;
}

// A side whose pools have a custom layout: the in-region axes `order` (outermost first), each
// block followed by `pad` elements; strides from rank 0's dims (the cases' ranks share them).
inline SideSpec CustomSide(KvShape shape, ParallelConfig parallel, RegionSplit split,
                           std::vector<int> order, int64_t pad) {
  SideSpec s{shape, parallel, LayoutKind::kCustom};
  s.split = split;
  const PoolDims dims = RankPoolDims(shape, SliceOf(shape, parallel, 0).value(), s.blocks);
  int64_t extent = 1;  // elements spanned by the axes inside
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    s.strides[*it] = *it == kBlockAxis ? extent + pad : extent;
    extent = s.strides[*it] * dims[*it];
  }
  return s;
}

struct Instance {
  std::vector<BlockPool> pools;
  std::vector<std::string> addresses;
};

class Cluster {
 public:
  Cluster(SideSpec ctx, SideSpec gen, TransceiverOptions options = {}, TransportHook ctx_hook = {},
          TransportHook gen_hook = {})
      : device_(OpenCpuDevice()), fabric_(InProcFabric::Create()), ctx_spec_(ctx), gen_spec_(gen) {
    options.transport = "inproc";
    if (options.timeout.count() == 0) options.timeout = milliseconds(5000);
    options.instance_secret[0] = 42;
    options.wire_version = ctx.wire_version;
    options.kv_scales = ctx.scales;
    for (int r = 0; r < ctx.parallel.world_size(); ++r) {
      ctx_pools_.push_back(MakePool(ctx, r));
      auto t = Transport();
      if (ctx_hook) t = ctx_hook(std::move(t));
      ctx_.push_back(std::move(
          ContextSide::Create(*device_, ctx_pools_.back(), options, std::move(t)).value()));
    }
    std::vector<std::string> addrs;
    for (auto& c : ctx_) addrs.push_back(c->address());
    for (auto& c : ctx_) EXPECT_TRUE(c->SetInstanceAddresses(addrs).ok());
    options.instance_id = 7;
    options.wire_version = gen.wire_version;
    options.kv_scales = gen.scales;
    for (int r = 0; r < gen.parallel.world_size(); ++r) {
      gen_pools_.push_back(MakePool(gen, r));
      auto t = Transport();
      if (gen_hook) t = gen_hook(std::move(t));
      gen_.push_back(std::move(
          GenerationSide::Create(*device_, gen_pools_.back(), options, std::move(t)).value()));
    }
  }

  std::unique_ptr<kvferry::Transport> Transport() {
    TransportOptions t;
    t.name = "inproc";
    t.fabric = fabric_;
    return std::move(CreateTransport(t).value());
  }

  BlockPool MakePool(const SideSpec& s, int rank) {
    PoolSpec p{s.shape, s.parallel, rank, s.layout, MemoryKind::kHost, s.blocks};
    p.block_scales = s.scales.granularity == ScaleGranularity::kBlock;
    auto pool = [&]() -> StatusOr<BlockPool> {
      if (s.layout != LayoutKind::kCustom) return BlockPool::Create(*device_, p);
      const PoolDims dims =
          RankPoolDims(s.shape, SliceOf(s.shape, s.parallel, rank).value(), s.blocks);
      KVF_ASSIGN_OR_RETURN(PoolLayout layout,
                           PoolLayout::Custom(dims, s.strides, s.split, s.shape.ElementBytes()));
      return BlockPool::Create(*device_, p, layout);
    }();
    EXPECT_TRUE(pool.ok()) << pool.status().ToString();
    for (int i = 0; i < pool->num_regions(); ++i)
      std::memset(pool->region(i), 0xA5, pool->layout().region_bytes());
    if (pool->block_scales())
      std::memset(pool->block_scales(), 0xA5, static_cast<size_t>(pool->block_scale_count()) * 4);
    return std::move(pool).value();
  }

  // Ranks of the DP group `group` of a side.
  static std::vector<int> Group(const SideSpec& s, int group) {
    std::vector<int> out;
    for (int r = 0; r < s.parallel.world_size(); ++r) {
      if (SliceOf(s.shape, s.parallel, r)->dp_group == group) out.push_back(r);
    }
    return out;
  }

  // Fills the request's blocks on the serving context group and marks it ready; the handle.
  // only_rank >= 0: on that context rank alone (the others mark it ready later).
  std::vector<std::byte> Publish(uint64_t id, const std::vector<int64_t>& blocks, int64_t tokens,
                                 int ctx_group = 0, bool layer_wise = false, int only_rank = -1) {
    const int tpb = ctx_spec_.shape.tokens_per_block;
    std::vector<std::byte> handle;
    for (int r : Group(ctx_spec_, ctx_group)) {
      if (only_rank >= 0 && r != only_rank) continue;
      for (size_t i = 0; i < blocks.size(); ++i) {
        int64_t valid = std::min<int64_t>(tpb, tokens - static_cast<int64_t>(i) * tpb);
        if (valid > 0) {
          EXPECT_TRUE(FillBlock(ctx_pools_[r], id, {blocks[i], int64_t(i) * tpb, valid}).ok());
        }
      }
      auto h = layer_wise ? ctx_[r]->BeginLayerWise(id, blocks, tokens)
                          : ctx_[r]->MarkReady(id, blocks, tokens);
      EXPECT_TRUE(h.ok()) << h.status().ToString();
      if (h.ok()) {
        if (!handle.empty()) {
          size_t at = 0;
          while (at < std::min(handle.size(), h->size()) && handle[at] == (*h)[at]) ++at;
          EXPECT_EQ(handle, *h)
              << "every context rank returns the same handle; first difference at byte " << at
              << " of " << handle.size() << "/" << h->size();
        }
        handle = *h;
      }
    }
    return handle;
  }

  Status Fetch(const std::vector<std::byte>& handle, const std::vector<int64_t>& blocks,
               int64_t reused = 0, int gen_group = 0) {
    for (int r : Group(gen_spec_, gen_group)) {
      Status st = gen_[r]->Fetch(handle, blocks, reused);
      if (!st.ok()) return st;
    }
    return Status::Ok();
  }

  // Waits for `n` terminal statuses on every rank of the groups; returns them all.
  std::vector<TransferStatus> Drain(int ctx_group, int gen_group, size_t n,
                                    milliseconds wait = milliseconds(10000)) {
    std::vector<TransferStatus> all;
    auto deadline = DeadlineIn(wait);
    for (int r : Group(ctx_spec_, ctx_group)) {
      size_t got = 0;
      while (got < n && Clock::now() < deadline) {
        auto s = ctx_[r]->Poll(n - got, deadline);
        got += s.size();
        all.insert(all.end(), s.begin(), s.end());
      }
    }
    for (int r : Group(gen_spec_, gen_group)) {
      size_t got = 0;
      while (got < n && Clock::now() < deadline) {
        auto s = gen_[r]->Poll(n - got, deadline);
        got += s.size();
        all.insert(all.end(), s.begin(), s.end());
      }
    }
    return all;
  }

  // Checks every generation rank's blocks [reused, needed) hold the request's values (converted
  // to the generation dtype when it differs from the context's), the
  // reused blocks were not touched, and (sentinels) no byte of any other block changed from the
  // 0xA5 every pool starts with.
  void Verify(uint64_t id, const std::vector<int64_t>& blocks, int64_t tokens, int64_t reused = 0,
              int gen_group = 0, bool sentinels = false) {
    const int tpb = gen_spec_.shape.tokens_per_block;
    for (int r = 0; sentinels && r < static_cast<int>(gen_pools_.size()); ++r) {
      const BlockPool& pool = gen_pools_[r];
      for (int64_t b = 0; b < pool.blocks(); ++b) {
        if (std::find(blocks.begin(), blocks.end(), b) != blocks.end()) continue;
        const std::vector<Extent> extents = pool.BlockExtents(std::vector<int64_t>{b}).value();
        for (const Extent& e : extents) {
          const std::byte* at = pool.Address(e);
          for (int64_t i = 0; i < e.bytes; ++i) {
            ASSERT_EQ(at[i], std::byte{0xA5})
                << "gen rank " << r << " block " << b << " (not a destination) byte " << i;
          }
        }
      }
    }
    for (int r : Group(gen_spec_, gen_group)) {
      for (size_t i = 0; i < blocks.size(); ++i) {
        int64_t valid = std::min<int64_t>(tpb, tokens - static_cast<int64_t>(i) * tpb);
        if (valid <= 0) continue;
        BlockTokens where{blocks[i], int64_t(i) * tpb, valid};
        auto m = CheckBlock(gen_pools_[r], id, where, ctx_spec_.shape.dtype, ctx_spec_.scales,
                            gen_spec_.scales);
        ASSERT_TRUE(m.ok());
        if (static_cast<int64_t>(i) < reused) {
          EXPECT_TRUE(m->has_value())
              << "reused block " << i << " was overwritten on gen rank " << r;
        } else {
          EXPECT_FALSE(m->has_value())
              << "gen rank " << r << " block " << i << ": " << (*m)->ToString();
        }
      }
    }
  }

  std::unique_ptr<Device> device_;
  std::shared_ptr<InProcFabric> fabric_;
  SideSpec ctx_spec_, gen_spec_;
  std::deque<BlockPool> ctx_pools_, gen_pools_;  // deque: sides hold references to pools
  std::vector<std::unique_ptr<ContextSide>> ctx_;
  std::vector<std::unique_ptr<GenerationSide>> gen_;
};

inline KvShape Shape(int kv_heads = 4, int kv_factor = 2, DType dt = DType::kFp16) {
  return KvShape{6, kv_heads, 16, dt, kv_factor, 4};
}

inline void ExpectAllComplete(const std::vector<TransferStatus>& st, size_t n) {
  EXPECT_EQ(st.size(), n);
  for (const TransferStatus& s : st) {
    EXPECT_EQ(s.state, TransferState::kComplete)
        << "request " << s.request_id << ": " << s.reason.ToString();
  }
}

class FetchTamperer final : public TestTransport {
 public:
  FetchTamperer(std::unique_ptr<Transport> base, std::function<void(FetchMsg&)> edit)
      : TestTransport(std::move(base)), edit_(std::move(edit)) {}
  Status SendControl(PeerId p, std::span<const std::byte> b) override {
    auto m = DecodeMessage(b);
    if (m.ok() && std::holds_alternative<FetchMsg>(*m)) {
      edit_(std::get<FetchMsg>(*m));
      return base_->SendControl(p, EncodeMessage(*m, MessageVersionOf(b)));
    }
    return base_->SendControl(p, b);
  }

 private:
  std::function<void(FetchMsg&)> edit_;
};

class NoRma final : public TestTransport {
 public:
  explicit NoRma(std::unique_ptr<Transport> base) : TestTransport(std::move(base)) {
    caps_.one_sided = false;
  }
};

// transfer.peer_memory for one scope: tests of the transport put path turn it off (auto maps the
// peer pool of every CPU-device rank, in one process too, and moves no byte through the transport).
class PeerMemoryKnob {
 public:
  explicit PeerMemoryKnob(const char* value = "on") {
    EXPECT_TRUE(Config::Global().Set("transfer.peer_memory", value).ok());
  }
  ~PeerMemoryKnob() { EXPECT_TRUE(Config::Global().Reset("transfer.peer_memory").ok()); }
  PeerMemoryKnob(const PeerMemoryKnob&) = delete;
  PeerMemoryKnob& operator=(const PeerMemoryKnob&) = delete;
};

// A pid no process or thread can have (above the kernel's pid_max). Not a handle's pid + 1: that
// can be a thread of this very process (/proc/<tid>/fd is the process's own table), and then the
// "other process" maps this process's own memfd and the fallback under test never happens (the
// TSan build failed that way under ctest).
inline uint32_t NoSuchPid() {
  std::ifstream in("/proc/sys/kernel/pid_max");
  uint32_t pid_max = 4194304;  // the kernel's largest pid_max
  in >> pid_max;
  return pid_max + 1;
}

inline TransceiverOptions SmallChunks(bool rma) {
  TransceiverOptions o;
  o.chunk_bytes = 4096;
  o.staging_chunks = 3;
  o.direct_min_bytes = 2048;
  o.rma = rma;
  o.checksum = true;
  o.timeout = milliseconds(2000);
  return o;
}

}  // namespace kvferry::txtest
