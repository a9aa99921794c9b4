// What `kvferry selftest`, `kvferry bench transfer` and `kvferry instance` share: the flags of a
// transfer run (shape, splits, layouts, requests), their config, and the JSON and text they print.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "selftest/selftest.h"
#include "tools/kvferry/output.h"

namespace kvferry::tools {

struct SplitFlags {
  int tp = 1, pp = 1, dp = 1;
  std::vector<int32_t> pp_layers;
  ParallelConfig Make() const { return ParallelConfig{tp, pp, pp_layers, dp, 0}; }
};

struct Flags {
  int layers = 8, kv_heads = 8, head_dim = 128, tokens_per_block = 32;
  int ctx_tokens_per_block = 0, gen_tokens_per_block = 0;  // 0: tokens_per_block
  std::string dtype = "bf16";
  std::string ctx_dtype, gen_dtype;  // empty: dtype
  std::string ctx_scales = "none", gen_scales = "none";
  bool mla = false;
  SplitFlags ctx, gen;
  std::string ctx_layout = "block-major", gen_layout = "block-major";
  int requests = 16, concurrency = 4;
  std::vector<int64_t> prompt_tokens{100};
  std::string transport = "ucx";
  std::string device;
  bool layer_wise = false, no_verify = false, progress = false;
  OutputFlags out;
  int metrics_port = -1;
  int shared_prefix_blocks = 0;
  int crash_ctx_rank = -1;
  std::string fault;
  std::vector<int> gpus;
  // Default: on; off when the dtypes differ (a converting pair with checksums packs instead of
  // copying into the mapped generation pool: the default keeps the fast path).
  std::optional<bool> checksum;
  int timeout_ms = 60000;
  int give_up_ms = 0;
  std::string model;
  int warmup = 1;
  bool unconverted = true;  // bench transfer: also run a conversion's transfer without it
};

// The shape, split, layout and request flags of every transfer command.
void AddShapeFlags(CLI::App* cmd, Flags& f);
// What a measurement adds: --model, --warmup, --no-verify.
void AddMeasureFlags(CLI::App* cmd, Flags& f);
// --model: sets layers, kv heads and head dim.
void ApplyModel(Flags& f);

StatusOr<SelftestConfig> ToConfig(const Flags& f);
// " (N tokens per block, DTYPE)" for what the generation side's shape changes from the context
// side's (block size, dtype); empty when nothing.
std::string GenBlockNote(const SelftestConfig& c);
// " (blocks of C -> G tokens)" when the two sides' block sizes differ (bench's header line).
std::string BlockSizeNote(const Flags& f);

nlohmann::json SummaryJson(const SelftestSummary& s);
// The configuration every document echoes.
nlohmann::json ConfigJson(const Flags& f, const SelftestConfig& c);
nlohmann::json SlowestJson(const std::vector<RankResult>& ranks);
void PrintSlowest(const std::vector<RankResult>& ranks);
nlohmann::json MedianJson(const std::vector<RankResult>& ranks);
void PrintMedian(const std::vector<RankResult>& ranks);

// --transport nixl where NIXL can't be used here (it is loaded at run time): the run is skipped,
// saying why, with exit status kExitSkipped (ctest's SKIP_RETURN_CODE for the nixl cases).
constexpr int kExitSkipped = 77;
bool NixlMissing(const Flags& f, const char* command);

// A measured row (bench transfer, instance --bench): the summary beside its same-run baselines.
nlohmann::json BenchRow(const SelftestSummary& s, int64_t tokens, const SelftestConfig& cfg,
                        const std::vector<RankResult>& ranks);
// The column heads of PrintBenchRow, after a line on the warm-up requests left out.
void PrintBenchHeader(int warmup);
void PrintBenchRow(const nlohmann::json& row, const SelftestSummary& s, bool verify);

}  // namespace kvferry::tools
