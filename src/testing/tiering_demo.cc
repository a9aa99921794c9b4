#include "testing/tiering_demo.h"

#include <fmt/format.h>

#include <optional>

#include "testing/host_mirror.h"
#include "testing/memory_slab_store.h"
#include "testing/testdata.h"

namespace kvferry {

namespace {

KvShape DemoShape() {
  return KvShape{
      /*layers=*/4,           /*kv_heads=*/2, /*head_dim=*/64, DType::kBf16, 2,
      /*tokens_per_block=*/16};
}

}  // namespace

int64_t TieringDemoBlockBytes() {
  const KvShape s = DemoShape();
  return s.BytesPerToken() * s.tokens_per_block;
}

StatusOr<TieringDemoReport> RunTieringDemo(Device& device, const TieringDemoOptions& o,
                                           SlabStore* file,
                                           const std::function<void(std::string_view)>& say) {
  PoolSpec spec;
  spec.shape = DemoShape();
  spec.layout = o.layout;
  spec.memory = MemoryKind::kDevice;
  spec.blocks = o.primary_blocks;
  KVF_ASSIGN_OR_RETURN(BlockPool primary, BlockPool::Create(device, spec));
  spec.memory = MemoryKind::kPinnedHost;
  spec.blocks = o.host_blocks;
  KVF_ASSIGN_OR_RETURN(BlockPool host, BlockPool::Create(device, spec));
  std::optional<tiering::MemorySlabStore> mem;
  if (file == nullptr && o.file_slots > 0) {
    mem.emplace(primary.layout().block_bytes(), o.file_slots);
    file = &*mem;
  }
  KVF_ASSIGN_OR_RETURN(auto tm, TransferManager::Create(device, primary, &host, file,
                                                        TransferOptions::FromConfig()));
  BlockManagerOptions bo = BlockManagerOptions::FromConfig();
  bo.identity.model_id = "demo-model";
  bo.identity.shape = spec.shape;
  KVF_ASSIGN_OR_RETURN(auto bm, BlockManager::Create(*tm, bo));
  const int64_t tpb = spec.shape.tokens_per_block;
  say(fmt::format("pools: primary {} blocks, host {} blocks, file {} slots ({}); block {} KiB",
                  o.primary_blocks, o.host_blocks, file ? file->capacity() : 0,
                  file ? file->backend().name : "none", primary.layout().block_bytes() / 1024));
  // Each conversation: a 32-token system prompt shared by all, then 32 tokens of its own.
  const int64_t sys = 2 * tpb, own = 2 * tpb;
  auto prompt = [&](int32_t c) {
    std::vector<int32_t> t;
    for (int64_t i = 0; i < sys; ++i) t.push_back(static_cast<int32_t>(7 + i));
    for (int64_t i = 0; i < own; ++i) t.push_back(static_cast<int32_t>(100000 * (c + 1) + i));
    return t;
  };
  // The KV an engine would compute: the system prompt's blocks are the same for everyone.
  auto request_of = [&](int32_t c, int64_t block) -> uint64_t {
    return block * tpb < sys ? 0 : static_cast<uint64_t>(c + 1);
  };
  TieringDemoReport rep;
  uint64_t seq_id = 1;
  auto stream = device.CreateStream();
  if (!stream.ok()) return stream.status();
  KVF_ASSIGN_OR_RETURN(BlockPool mirror, tiering::MakeHostMirror(device, primary));
  for (int32_t round = 0; round < o.rounds; ++round) {
    for (int32_t k = 0; k < o.conversations; ++k) {
      // Later rounds revisit the most recent conversations first: they are still in upper tiers.
      const int32_t c = round % 2 == 0 ? k : o.conversations - 1 - k;
      const auto p = prompt(c);
      KVF_ASSIGN_OR_RETURN(Admission a, bm->AddSequence(seq_id, p));
      // File reads land in the background: the final reuse once they have.
      KVF_ASSIGN_OR_RETURN(Readiness ready,
                           bm->WaitReady(seq_id, DeadlineIn(std::chrono::seconds(30))));
      if (!ready.ready) return Status::DeadlineExceeded("demo: onboards still pending after 30 s");
      a.reused_tokens = ready.reused_tokens;
      KVF_RETURN_IF_ERROR(tm->Drain(DeadlineIn(std::chrono::seconds(30))));
      rep.prompt_tokens += static_cast<int64_t>(p.size());
      rep.reused_tokens += a.reused_tokens;
      // Check what was reused, compute the rest (through the host mirror: on a GPU, host
      // threads can't touch the primary pool).
      KVF_RETURN_IF_ERROR(tiering::CopySameBlocks(**stream, primary, mirror, a.blocks));
      for (size_t i = 0; i < a.blocks.size(); ++i) {
        const int64_t first = static_cast<int64_t>(i) * tpb;
        BlockTokens where{a.blocks[i], first, tpb};
        if (first < a.reused_tokens) {
          KVF_ASSIGN_OR_RETURN(auto bad, CheckBlock(mirror, request_of(c, i), where));
          if (bad) {
            return Status::DataLoss(fmt::format(
                "demo: reused block {} of conversation {} is wrong: {}", i, c, bad->ToString()));
          }
          ++rep.verified_blocks;
        } else {
          KVF_RETURN_IF_ERROR(FillBlock(mirror, request_of(c, i), where));
        }
      }
      KVF_RETURN_IF_ERROR(tiering::CopySameBlocks(**stream, mirror, primary, a.blocks));
      say(
          fmt::format("round {} conversation {}: {} prompt tokens, reused {} (hits primary {}, "
                      "host {}, file {}){}",
                      round + 1, c, p.size(), a.reused_tokens, a.hits[0], a.hits[1], a.hits[2],
                      a.misses.empty() ? "" : fmt::format(", {} misses", a.misses.size())));
      KVF_RETURN_IF_ERROR(bm->RemoveSequence(seq_id++));
    }
  }
  KVF_RETURN_IF_ERROR(tm->Drain(DeadlineIn(std::chrono::seconds(30))));
  for (const KvEvent& e : bm->DrainEvents()) ++rep.events[static_cast<int>(e.kind)];
  rep.stats = bm->stats();
  rep.transfers = tm->stats();
  rep.file_backend = file ? file->backend().name : "none";
  const auto& s = rep.stats;
  say(
      fmt::format("evictions: {} offloaded primary->host, {} demoted host->file, dropped "
                  "{}/{}/{} (primary/host/file)",
                  s.offloaded, s.demoted, s.dropped[0], s.dropped[1], s.dropped[2]));
  say(
      fmt::format("prefix hits: primary {}, host {}, file {}; {} blocks onboarded; {} of {} "
                  "prompt tokens reused; {} reused blocks verified byte for byte",
                  s.hits[0], s.hits[1], s.hits[2], s.onboarded, rep.reused_tokens,
                  rep.prompt_tokens, rep.verified_blocks));
  say(
      fmt::format("copies: {} batches, {} blocks, {} descriptors, {:.1f} MiB; file writes {} "
                  "reads {}; router events: {} stored, {} moved, {} removed",
                  rep.transfers.batches, rep.transfers.blocks, rep.transfers.descriptors,
                  rep.transfers.bytes / double(1 << 20), rep.transfers.file_writes,
                  rep.transfers.file_reads, rep.events[0], rep.events[1], rep.events[2]));
  return rep;
}

}  // namespace kvferry
