// `kvferry selftest` and `kvferry bench transfer`: a context instance and a generation instance as
// separate processes (one per rank), requests streamed between them, every element verified.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <tuple>

#include "kvferry/config.h"
#include "kvferry/nixl_info.h"
#include "kvferry/rendezvous.h"
#include "selftest/timeline_json.h"
#include "tools/kvferry/cluster.h"
#include "tools/kvferry/commands.h"
#include "tools/kvferry/output.h"

namespace kvferry::tools {
namespace {

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

void AddShapeFlags(CLI::App* cmd, Flags& f) {
  cmd->add_option("--layers", f.layers, "attention layers")->capture_default_str();
  cmd->add_option("--kv-heads", f.kv_heads, "KV heads per layer")->capture_default_str();
  cmd->add_option("--head-dim", f.head_dim, "elements per head")->capture_default_str();
  cmd->add_option("--tokens-per-block", f.tokens_per_block, "tokens per KV block")
      ->capture_default_str();
  cmd->add_option("--ctx-tokens-per-block", f.ctx_tokens_per_block,
                  "the context instance's tokens per block (default: --tokens-per-block)");
  cmd->add_option("--gen-tokens-per-block", f.gen_tokens_per_block,
                  "the generation instance's tokens per block (default: --tokens-per-block); one "
                  "side's must be a multiple of the other's");
  cmd->add_option("--dtype", f.dtype, "fp32|fp16|bf16|fp8|int8")->capture_default_str();
  cmd->add_option("--ctx-dtype", f.ctx_dtype, "the context instance's dtype (default: --dtype)");
  cmd->add_option("--gen-dtype", f.gen_dtype,
                  "the generation instance's dtype (default: --dtype); the context side converts "
                  "while packing (fp32|fp16|bf16|fp8, fp8 being e4m3)");
  for (auto [flag, value, side] : {std::tuple{"--ctx-scales", &f.ctx_scales, "context"},
                                   std::tuple{"--gen-scales", &f.gen_scales, "generation"}}) {
    cmd->add_option(flag, *value,
                    fmt::format("the {} instance's KV scales: none|tensor (one per layer and K/V, "
                                "as vLLM's k_scale/v_scale)|head (one per layer, K/V and head), "
                                "made-up distinct values; the context side converts with both "
                                "sides' scales, each element checked",
                                side))
        ->check(CLI::IsMember({"none", "tensor", "head"}))
        ->capture_default_str();
  }
  cmd->add_flag("--mla", f.mla, "MLA latent cache: one head, K only (kv factor 1)");
  cmd->add_option("--ctx-tp", f.ctx.tp)->capture_default_str();
  cmd->add_option("--ctx-pp", f.ctx.pp)->capture_default_str();
  cmd->add_option("--ctx-dp", f.ctx.dp, "attention DP groups of the context instance")
      ->capture_default_str();
  cmd->add_option("--ctx-pp-layers", f.ctx.pp_layers,
                  "layers of each context PP stage (uneven splits)")
      ->delimiter(',');
  cmd->add_option("--gen-tp", f.gen.tp)->capture_default_str();
  cmd->add_option("--gen-pp", f.gen.pp)->capture_default_str();
  cmd->add_option("--gen-dp", f.gen.dp, "attention DP groups of the generation instance")
      ->capture_default_str();
  cmd->add_option("--gen-pp-layers", f.gen.pp_layers, "layers of each generation PP stage")
      ->delimiter(',');
  const char* const layouts =
      "a named layout: block-major|per-layer|per-layer-hnd|per-layer-kv|per-layer-kv-hnd|"
      "flashinfer|flashinfer-hnd|block-major-nhd|vllm-cpu|vllm-hnd|vllm-nhd; or explicit strides "
      "as custom:SPLIT:AXES[:pad=N], e.g. custom:per-layer:head,block,kv,token,dim:pad=64 (SPLIT "
      "one|per-layer|per-kv|per-layer-kv; AXES inside a region outermost first, dim last; N "
      "elements after each block)";
  cmd->add_option("--ctx-layout", f.ctx_layout, layouts)->capture_default_str();
  cmd->add_option("--gen-layout", f.gen_layout, layouts)->capture_default_str();
  cmd->add_option("--requests", f.requests,
                  fmt::format("requests to transfer (at most {})", kSelftestMaxRequests))
      ->capture_default_str();
  cmd->add_option("--prompt-tokens", f.prompt_tokens, "prompt lengths, cycled over requests")
      ->delimiter(',');
  cmd->add_option("--concurrency", f.concurrency, "requests in flight per rank")
      ->capture_default_str();
  cmd->add_option("--transport", f.transport, "inproc|ucx|mpi|nixl")->capture_default_str();
  cmd->add_option("--device", f.device, "cpu|cuda (default: knob device.default)");
  cmd->add_flag("--layer-wise", f.layer_wise, "send each layer once prefill marks it ready");
  cmd->add_option("--crash-ctx-rank", f.crash_ctx_rank,
                  "fault injection: this context rank dies after publishing its first request "
                  "(the run must end, failed, within the deadlines)");
  cmd->add_option("--fault", f.fault,
                  "fault injection at a protocol step: SIDE:RANK:STEP:NTH:KIND[:STALL_MS], e.g. "
                  "ctx:1:CREDIT:3:crash (steps FETCH ACCEPT REJECT CREDIT DATA DONE COMPLETE "
                  "ABORT; kinds crash stall drop duplicate corrupt)");
  cmd->add_option("--shared-prefix-blocks", f.shared_prefix_blocks,
                  "blocks every request shares (a system prompt): fetched once, then reused")
      ->capture_default_str();
  cmd->add_option("--timeout-ms", f.timeout_ms, "deadline of each request")->capture_default_str();
  cmd->add_option("--give-up-ms", f.give_up_ms,
                  "how long a rank waits without a request completing or failing before it gives "
                  "up on the rest (0: the deadline + abort grace + 1 s); longer outlives network "
                  "cuts longer than the deadline")
      ->check(CLI::Range(0, 24 * 3600 * 1000))
      ->capture_default_str();
  AddOutputFlags(cmd, f.out);
  cmd->add_option("--metrics-port", f.metrics_port,
                  "each rank serves Prometheus metrics on 127.0.0.1: context rank r at PORT + r, "
                  "generation rank r at PORT + context ranks + r (0: free ports, named on stderr)")
      ->check(CLI::Range(0, 65535));
  cmd->add_flag("--progress", f.progress, "print progress every second while it runs");
  cmd->add_option("--gpus", f.gpus,
                  "GPU of each rank process, cycled over context ranks then generation ranks "
                  "(default: the local rank modulo the visible GPUs)")
      ->delimiter(',');
  cmd->add_option("--checksum", f.checksum,
                  "per-chunk payload checksums (GPU pools too), verified by the generation side "
                  "(default: true, false when --ctx-dtype and --gen-dtype differ: with them a "
                  "converting pair sums the converted chunks in staging, so it packs instead of "
                  "copying into the mapped generation pool)");
}

// " (N tokens per block, DTYPE)" for what the generation side's shape changes from the context
// side's (block size, dtype); empty when nothing.
std::string GenBlockNote(const SelftestConfig& c) {
  const KvShape g = SideShape(c, false);
  std::vector<std::string> parts;
  if (g.tokens_per_block != c.shape.tokens_per_block)
    parts.push_back(fmt::format("{} tokens per block", g.tokens_per_block));
  if (g.dtype != c.shape.dtype) parts.push_back(std::string(DTypeName(g.dtype)));
  return parts.empty() ? "" : fmt::format(" ({})", fmt::join(parts, ", "));
}

// " (blocks of C -> G tokens)" when the two sides' block sizes differ (bench's header line).
std::string BlockSizeNote(const Flags& f) {
  const int c = f.ctx_tokens_per_block ? f.ctx_tokens_per_block : f.tokens_per_block;
  const int g = f.gen_tokens_per_block ? f.gen_tokens_per_block : f.tokens_per_block;
  return c == g ? "" : fmt::format(" (blocks of {} -> {} tokens)", c, g);
}

StatusOr<SelftestConfig> ToConfig(const Flags& f) {
  SelftestConfig c;
  KVF_ASSIGN_OR_RETURN(DType dt, ParseDType(f.ctx_dtype.empty() ? f.dtype : f.ctx_dtype));
  KVF_ASSIGN_OR_RETURN(DType gen_dt, ParseDType(f.gen_dtype.empty() ? f.dtype : f.gen_dtype));
  c.shape =
      KvShape{f.layers,      f.mla ? 1 : f.kv_heads,
              f.head_dim,    dt,
              f.mla ? 1 : 2, f.ctx_tokens_per_block ? f.ctx_tokens_per_block : f.tokens_per_block};
  c.gen_tokens_per_block =
      f.gen_tokens_per_block ? f.gen_tokens_per_block : c.shape.tokens_per_block;
  if (gen_dt != dt) c.gen_dtype = gen_dt;
  const auto grain = [](const std::string& s) {
    return s == "tensor" ? ScaleGranularity::kTensor
           : s == "head" ? ScaleGranularity::kHead
                         : ScaleGranularity::kNone;
  };
  c.ctx_scales = grain(f.ctx_scales);
  c.gen_scales = grain(f.gen_scales);
  c.ctx = f.ctx.Make();
  c.gen = f.gen.Make();
  KVF_ASSIGN_OR_RETURN(c.ctx_layout, LayoutSpec::Parse(f.ctx_layout));
  KVF_ASSIGN_OR_RETURN(c.gen_layout, LayoutSpec::Parse(f.gen_layout));
  c.requests = f.requests;
  c.prompt_tokens = f.prompt_tokens;
  c.concurrency = f.concurrency;
  c.transport = f.transport;
  c.device = f.device.empty() ? Config::Global().String("device.default") : f.device;
  c.layer_wise = f.layer_wise;
  c.shared_prefix_blocks = f.shared_prefix_blocks;
  c.crash_ctx_rank = f.crash_ctx_rank;
  c.fault = f.fault;
  c.verify = !f.no_verify;
  c.gpus = f.gpus;
  // Checksums with a conversion make the pair pack (the digest covers the converted chunk).
  c.checksum = f.checksum.value_or(!c.gen_dtype.has_value() && f.ctx_scales == f.gen_scales);
  c.timeout = std::chrono::milliseconds(f.timeout_ms);
  c.give_up = std::chrono::milliseconds(f.give_up_ms);
  c.metrics_port = f.metrics_port;
  c.dir = "(set by RunCluster)";
  KVF_RETURN_IF_ERROR(ValidateSelftest(c));
  return c;
}

nlohmann::json SummaryJson(const SelftestSummary& s) {
  return {{"requests", s.requests},
          {"completed", s.completed},
          {"verified", s.verified},
          {"failed", s.failed},
          {"bytes", s.bytes},
          {"seconds", s.seconds},
          {"gbps", s.gbps},
          {"p50_ms", s.p50_ms},
          {"p90_ms", s.p90_ms},
          {"p99_ms", s.p99_ms},
          {"cpu_us_per_request", s.cpu_us_per_request},
          {"control_cpu_us_per_request", s.control_cpu_us_per_request},
          {"control_cpu_with_warmup_us_per_request", s.control_cpu_with_warmup_us_per_request},
          {"thread_cpu_us_per_request", s.thread_cpu_us_per_request},
          {"data_path", s.data_path},
          {"errors", s.errors}};
}

// The configuration every document echoes.
nlohmann::json ConfigJson(const Flags& f, const SelftestConfig& c) {
  return {{"shape", ShapeJson(c.shape)},
          {"ctx",
           {{"parallel", ParallelJson(c.ctx)},
            {"layout", f.ctx_layout},
            {"tokens_per_block", c.shape.tokens_per_block},
            {"dtype", DTypeName(c.shape.dtype)}}},
          {"gen",
           {{"parallel", ParallelJson(c.gen)},
            {"layout", f.gen_layout},
            {"tokens_per_block", SideShape(c, false).tokens_per_block},
            {"dtype", DTypeName(SideShape(c, false).dtype)}}},
          {"transport", c.transport},
          {"device", c.device},
          {"requests", c.requests},
          {"prompt_tokens", c.prompt_tokens},
          {"concurrency", c.concurrency},
          {"layer_wise", c.layer_wise},
          {"shared_prefix_blocks", c.shared_prefix_blocks},
          {"verify", c.verify},
          {"checksum", c.checksum},
          {"timeout_ms", c.timeout.count()},
          {"give_up_ms", c.give_up.count()},
          {"fault", c.fault},
          {"crash_ctx_rank", c.crash_ctx_rank},
          {"metrics_port", c.metrics_port}};
}

// The slowest request of the run: the longest timeline over every rank.
std::optional<std::pair<const RankResult*, RequestTimeline>> SlowestOf(
    const std::vector<RankResult>& ranks) {
  std::optional<std::pair<const RankResult*, RequestTimeline>> out;
  for (const RankResult& r : ranks) {
    if (r.slowest && (!out || r.slowest->end > out->second.end)) out.emplace(&r, *r.slowest);
  }
  return out;
}

nlohmann::json SlowestJson(const std::vector<RankResult>& ranks) {
  auto s = SlowestOf(ranks);
  if (!s) return nullptr;
  nlohmann::json j = TimelineToJson(s->second);
  j["side"] = s->first->context ? "context" : "generation";
  j["rank"] = s->first->rank;
  return j;
}

void PrintSlowest(const std::vector<RankResult>& ranks) {
  if (auto s = SlowestOf(ranks)) {
    fmt::print("  slowest: {} rank {}: {}\n", s->first->context ? "context" : "generation",
               s->first->rank, TimelineText(s->second));
  }
}

// A typical request on each side: the medians over the side's ranks of each rank's median
// timeline (MedianTimeline: phases counted from the fetch, so the ranks' medians have fetch 0).
std::optional<RequestTimeline> MedianOf(const std::vector<RankResult>& ranks, bool context) {
  std::vector<RequestTimeline> medians;
  for (const RankResult& r : ranks) {
    if (r.context == context && r.median) medians.push_back(*r.median);
  }
  return MedianTimeline(medians);
}

nlohmann::json MedianJson(const std::vector<RankResult>& ranks) {
  nlohmann::json j = nlohmann::json::object();
  for (bool context : {true, false}) {
    if (auto m = MedianOf(ranks, context)) {
      nlohmann::json t = TimelineToJson(*m);
      t.erase("request_id");
      j[context ? "context" : "generation"] = std::move(t);
    }
  }
  return j;
}

void PrintMedian(const std::vector<RankResult>& ranks) {
  auto at = [](double s) { return s < 0 ? std::string("never") : fmt::format("{:.3f}", s * 1e3); };
  std::string line;
  for (bool context : {true, false}) {
    if (auto m = MedianOf(ranks, context)) {
      line += fmt::format("{}{}: first byte {}, last byte {}, complete {}",
                          line.empty() ? "" : " | ", context ? "context" : "generation",
                          at(m->first_byte), at(m->last_byte), at(m->end));
    }
  }
  if (!line.empty()) fmt::print("  median request, ms after its fetch: {}\n", line);
}

// --transport nixl where NIXL can't be used here (it is loaded at run time): the run is skipped,
// saying why, with exit status kExitSkipped (ctest's SKIP_RETURN_CODE for the nixl cases).
constexpr int kExitSkipped = 77;
bool NixlMissing(const Flags& f, const char* command) {
  if (f.transport != "nixl") return false;
  auto nixl = QueryNixlRuntime();
  const Status why = nixl.ok() ? nixl->backend_status : nixl.status();
  if (why.ok()) return false;
  fmt::print(stderr, "kvferry {}: skipped: transport nixl is unavailable here: {}\n", command,
             why.ToString());
  if (!f.out.machine()) fmt::print("SKIPPED\n");
  return true;
}

int RunSelftest(const Flags& f) {
  Document doc("selftest");
  auto cfg = ToConfig(f);
  if (!cfg.ok()) {
    fmt::print(stderr, "kvferry selftest: {}\n", cfg.status().ToString());
    return 2;
  }
  doc.config() = ConfigJson(f, *cfg);
  if (NixlMissing(f, "selftest")) return kExitSkipped;
  auto ranks = RunCluster(*cfg, f.progress && !f.out.machine());
  if (!ranks.ok()) {
    fmt::print(stderr, "kvferry selftest: {}\n", ranks.status().ToString());
    doc.summary() = {{"requests", f.requests}, {"verified", 0}, {"failed", f.requests}};
    doc.SetResult(false, ranks.status().ToString());
    doc.Print(f.out.format());
    return 1;
  }
  SelftestSummary s = Summarize(*cfg, *ranks);
  const bool pass = s.failed == 0 && s.verified == s.requests && !s.fault_missed;
  if (f.out.machine()) {
    doc.summary() = SummaryJson(s);
    doc.summary()["slowest"] = SlowestJson(*ranks);
    doc.summary()["median"] = MedianJson(*ranks);
    doc.SetResult(pass, s.errors.empty() ? "" : s.errors.front());
    doc.Print(f.out.format());
  } else {
    fmt::print("kvferry selftest: {} | ctx {} {} -> gen {} {}{} | {} over {} on {}\n",
               cfg->shape.ToString(), cfg->ctx.ToString(), f.ctx_layout, cfg->gen.ToString(),
               f.gen_layout, GenBlockNote(*cfg), f.requests, cfg->transport, cfg->device);
    fmt::print("  requests {}  verified {}  failed {}  prefix hits {}  data path {}\n", s.requests,
               s.verified, s.failed, s.prefix_hits, s.data_path);
    fmt::print(
        "  {:.1f} MB in {:.3f} s = {:.2f} GB/s (wall time with test-data fills and checks; bench "
        "transfer measures transfers alone)\n  latency p50 {:.2f} ms p90 {:.2f} ms p99 {:.2f} "
        "ms\n",
        s.bytes / 1e6, s.seconds, s.gbps, s.p50_ms, s.p90_ms, s.p99_ms);
    PrintMedian(*ranks);
    PrintSlowest(*ranks);
    for (const auto& e : s.errors) fmt::print("  error: {}\n", e);
    fmt::print("{}\n", pass ? "PASS" : "FAIL");
  }
  return pass ? 0 : 1;
}

struct ModelShape {
  const char* name;
  int layers, kv_heads, head_dim;
};
constexpr ModelShape kModels[] = {{"llama3-8b", 32, 8, 128}, {"llama3-70b", 80, 8, 128}};

// bench transfer, step by step: the model preset, one sweep point, its row.
void ApplyModel(Flags& f) {
  for (const ModelShape& m : kModels) {
    if (f.model == m.name) {
      f.layers = m.layers;
      f.kv_heads = m.kv_heads;
      f.head_dim = m.head_dim;
    }
  }
}

nlohmann::json BenchRow(const SelftestSummary& s, int64_t tokens, const SelftestConfig& cfg,
                        const std::vector<RankResult>& ranks) {
  nlohmann::json row = SummaryJson(s);
  row["case"] = fmt::format("{}tok", tokens);
  row["tokens"] = tokens;
  row["baseline"] = s.baseline_name;
  row["baseline_gbps"] = s.baseline_gbps;
  row["copy_baseline"] = s.copy_name;
  row["copy_gbps"] = s.copy_gbps;
  row["copy_ratio"] = s.copy_gbps > 0 ? s.gbps / s.copy_gbps : 0;
  row["checksum"] = cfg.checksum;
  row["warmup"] = cfg.warmup;
  row["warmup_overlap"] = s.warmup_overlap;  // timed requests started beside a warm-up one (0)
  row["concurrency"] = cfg.concurrency;
  row["ratio"] = s.baseline_gbps > 0 ? s.gbps / s.baseline_gbps : 0;
  row["verified_all"] = cfg.verify && s.failed == 0;  // --no-verify checks nothing
  row["slowest"] = SlowestJson(ranks);
  row["median"] = MedianJson(ranks);
  if (!s.profile.empty()) {
    nlohmann::json profile = nlohmann::json::object();
    for (const auto& [side, values] : s.profile) {
      for (const auto& [name, value] : values) profile[side][name] = value;
    }
    row["profile"] = std::move(profile);
  }
  return row;
}

void PrintBenchRow(const nlohmann::json& row, const SelftestSummary& s, bool verify) {
  fmt::print(
      "{:>8} {:>6} {:>10.1f} {:>9.2f} {:>9.2f} {:>9.2f} {:>9.0f} {:>9.0f} {:>10.2f} {:>7.2f} "
      "{:>10.2f} {:>7.2f}  {}: {} | {}{}{}\n",
      row["tokens"].get<int64_t>(), row["concurrency"].get<int>(), s.bytes / 1e6, s.gbps, s.p50_ms,
      s.p99_ms, s.control_cpu_us_per_request, s.thread_cpu_us_per_request, s.baseline_gbps,
      row["ratio"].get<double>(), s.copy_gbps, row["copy_ratio"].get<double>(), s.data_path,
      s.baseline_name, s.copy_name, s.failed ? "  FAILED" : "",
      verify || s.failed ? "" : "  (not verified: --no-verify)");
  // transfer.profile: where each side's progress-thread CPU went, per measured request.
  for (const auto& [side, values] : s.profile) {
    std::string line;
    for (const auto& [name, value] : values) {
      if (value == 0) continue;
      line += fmt::format(" {}={:.{}f}", name, value, name.starts_with("copy_busy") ? 2 : 1);
    }
    fmt::print("  profile {}:{}\n", side, line);
  }
  for (const auto& e : s.errors) fmt::print("  error: {}\n", e);
}

// --concurrency 0 (bench transfer's default): requests in flight per rank from the request's
// size, so that the generation pools hold about kInflightBytes (GPU; the context pools twice
// that) or a quarter of it on the CPU: many small requests, at least two large ones.
constexpr int64_t kInflightBytes = int64_t{8} << 30;
int AutoConcurrency(const Flags& f, int64_t tokens) {
  auto dt = ParseDType(f.dtype);
  const int64_t elem = dt.ok() ? DTypeSize(*dt) : 2;
  const int64_t request =
      std::max<int64_t>(1, tokens * f.layers * (f.mla ? 1 : 2 * f.kv_heads) * f.head_dim * elem);
  const bool gpu =
      (f.device.empty() ? Config::Global().String("device.default") : f.device).rfind("cuda", 0) ==
      0;
  const int64_t budget = gpu ? kInflightBytes : kInflightBytes / 4;
  return static_cast<int>(std::clamp<int64_t>(budget / request, 2, 16));
}

// What the generation side converts, e.g. "per-layer-hnd -> per-layer, blocks of 64 -> 16
// tokens"; empty when both sides store alike.
std::string ConversionName(const Flags& f) {
  std::vector<std::string> parts;
  if (f.ctx_layout != f.gen_layout)
    parts.push_back(fmt::format("{} -> {}", f.ctx_layout, f.gen_layout));
  const int c = f.ctx_tokens_per_block ? f.ctx_tokens_per_block : f.tokens_per_block;
  const int g = f.gen_tokens_per_block ? f.gen_tokens_per_block : f.tokens_per_block;
  if (c != g) parts.push_back(fmt::format("blocks of {} -> {} tokens", c, g));
  const std::string& cd = f.ctx_dtype.empty() ? f.dtype : f.ctx_dtype;
  const std::string& gd = f.gen_dtype.empty() ? f.dtype : f.gen_dtype;
  if (cd != gd) parts.push_back(fmt::format("{} -> {}", cd, gd));
  if (f.ctx_scales != f.gen_scales)
    parts.push_back(fmt::format("scales per {} -> per {}", f.ctx_scales, f.gen_scales));
  return fmt::format("{}", fmt::join(parts, ", "));
}

// The same transfer without the conversion: the generation side in the context side's layout,
// block size and dtype.
Flags Unconverted(const Flags& f) {
  Flags g = f;
  g.gen_layout = f.ctx_layout;
  g.gen_tokens_per_block = f.ctx_tokens_per_block ? f.ctx_tokens_per_block : f.tokens_per_block;
  g.gen_dtype = f.ctx_dtype;
  g.gen_scales = f.ctx_scales;
  return g;
}

int RunBenchTransfer(Flags f, const std::vector<int64_t>& sweep) {
  ApplyModel(f);
  Document doc("bench transfer");
  {
    // Checked before anything is printed or started (--concurrency 0 is resolved per row).
    Flags checked = f;
    checked.concurrency = std::max(1, f.concurrency);
    auto cfg = ToConfig(checked);
    if (!cfg.ok()) {
      fmt::print(stderr, "kvferry bench transfer: {}\n", cfg.status().ToString());
      return 2;
    }
    doc.config() = ConfigJson(f, *cfg);
    doc.config()["concurrency"] = f.concurrency;  // 0: from each row's request size
    doc.config()["sweep"] = sweep;
    doc.config()["model"] = f.model;
  }
  if (NixlMissing(f, "bench transfer")) return kExitSkipped;
  if (!f.out.machine()) {
    fmt::print(
        "kvferry bench transfer: {} layers x {} kv heads x {} ({}) ctx tp{}pp{} {} -> gen "
        "tp{}pp{} {}{} over {}\n",
        f.layers, f.kv_heads, f.head_dim,
        f.ctx_dtype == f.gen_dtype
            ? f.dtype
            : fmt::format("{} -> {}", f.ctx_dtype.empty() ? f.dtype : f.ctx_dtype,
                          f.gen_dtype.empty() ? f.dtype : f.gen_dtype),
        f.ctx.tp, f.ctx.pp, f.ctx_layout, f.gen.tp, f.gen.pp, f.gen_layout, BlockSizeNote(f),
        f.transport);
    if (f.warmup > 0)
      fmt::print(
          "  GB/s, latencies and us/r leave out the first {} request(s) of each generation "
          "rank, which end before the others start; ctl us/r: progress-thread CPU per request in "
          "iterations that did work, all us/r: all of it (idle polling too), all ranks\n",
          f.warmup);
    fmt::print("{:>8} {:>6} {:>10} {:>9} {:>9} {:>9} {:>9} {:>9} {:>10} {:>7} {:>10} {:>7}  {}\n",
               "tokens", "in flt", "MB", "GB/s", "p50 ms", "p99 ms", "ctl us/r", "all us/r",
               "raw GB/s", "ratio", "copy GB/s", "ratio", "data path: raw | copy baselines");
  }
  int rc = 0;
  std::string first_error;
  const std::string conversion = ConversionName(f);
  // One cluster run of `tokens`-token requests: its config, summary and ranks, or none (said).
  struct Run {
    SelftestConfig cfg;
    SelftestSummary s;
    std::vector<RankResult> ranks;
  };
  auto run = [&](const Flags& g, int64_t tokens) -> std::optional<Run> {
    Flags one = g;
    one.prompt_tokens = {tokens};
    if (one.concurrency == 0) one.concurrency = AutoConcurrency(one, tokens);
    auto cfg = ToConfig(one);
    if (!cfg.ok()) {
      fmt::print(stderr, "kvferry bench transfer: {}\n", cfg.status().ToString());
      if (first_error.empty()) first_error = cfg.status().ToString();
      rc = 2;
      return std::nullopt;
    }
    cfg->baseline = true;
    // The context instance keeps as many requests again published ahead: a generation slot
    // that frees finds its next handle waiting (a serving context instance has prefilled
    // requests queued), so the measurement is the transfers', not the handle exchange's.
    cfg->ctx_ahead = cfg->concurrency;
    cfg->warmup = std::max(0, f.warmup);
    auto ranks = RunCluster(*cfg, f.progress && !f.out.machine());
    if (!ranks.ok()) {
      fmt::print(stderr, "kvferry bench transfer ({} tokens): {}\n", tokens,
                 ranks.status().ToString());
      if (first_error.empty()) first_error = ranks.status().ToString();
      rc = 1;
      return std::nullopt;
    }
    SelftestSummary s = Summarize(*cfg, *ranks);
    if (s.failed || s.fault_missed) rc = 1;
    if (rc != 0 && first_error.empty() && !s.errors.empty()) first_error = s.errors.front();
    return Run{*cfg, std::move(s), std::move(ranks).value()};
  };
  for (int64_t tokens : sweep) {
    std::optional<Run> r = run(f, tokens);
    if (!r) {
      if (rc == 2) return 2;
      continue;
    }
    nlohmann::json row = BenchRow(r->s, tokens, r->cfg, r->ranks);
    row["conversion"] = conversion;
    // A conversion is also measured without it, right after, in the same run: the generation
    // instance taking the context instance's layout and block size, all else equal.
    std::optional<Run> plain;
    if (!conversion.empty() && f.unconverted) plain = run(Unconverted(f), tokens);
    if (plain) {
      // Of request rates (the same requests): with a dtype conversion the two move different
      // bytes, so GB/s are weighed by each run's destination element size.
      const double per_byte = static_cast<double>(SideShape(plain->cfg, false).ElementBytes()) /
                              static_cast<double>(SideShape(r->cfg, false).ElementBytes());
      row["unconverted_gbps"] = plain->s.gbps;
      row["unconverted_ratio"] = plain->s.gbps > 0 ? r->s.gbps / plain->s.gbps * per_byte : 0;
      row["unconverted_data_path"] = plain->s.data_path;
    }
    if (!f.out.machine()) {
      PrintBenchRow(row, r->s, r->cfg.verify);
      if (plain) {
        fmt::print(
            "  conversion {}: {:.2f} GB/s without it (generation side in the context side's "
            "layout, block size and dtype, same run, data path {}): ratio of request rates "
            "{:.2f}\n",
            conversion, plain->s.gbps, plain->s.data_path, row["unconverted_ratio"].get<double>());
      }
      PrintMedian(r->ranks);
      if (sweep.size() == 1) PrintSlowest(r->ranks);
    }
    doc.AddRow(std::move(row));
  }
  doc.SetResult(rc == 0, first_error);
  doc.Print(f.out.format());
  return rc;
}

// `kvferry instance`: this host's ranks of one instance, meeting the other instance through an
// external rendezvous.
struct InstanceFlags {
  std::string role = "context";
  std::string ranks;  // "" (all), "N", "A-B" or "A,B,C"
  std::string rendezvous;
  std::string key_file;
};

StatusOr<std::vector<RankId>> ParseRanks(const InstanceFlags& i, const SelftestConfig& cfg) {
  const bool context = i.role == "context";
  const int n = context ? cfg.ctx.world_size() : cfg.gen.world_size();
  std::vector<RankId> out;
  auto number = [&](std::string_view t) -> StatusOr<int> {
    int v = 0;
    if (t.empty() || t.size() > 6 || !std::all_of(t.begin(), t.end(), ::isdigit) ||
        (v = std::stoi(std::string(t))) >= n) {
      return Status::InvalidArgument(
          fmt::format("--ranks '{}': '{}' is not a {} rank in [0, {})", i.ranks, t, i.role, n));
    }
    return v;
  };
  if (i.ranks.empty()) {
    for (int r = 0; r < n; ++r) out.push_back({context, r});
    return out;
  }
  std::string_view rest = i.ranks;
  while (!rest.empty()) {
    const size_t comma = rest.find(',');
    std::string_view item = rest.substr(0, comma);
    rest = comma == std::string_view::npos ? "" : rest.substr(comma + 1);
    const size_t dash = item.find('-');
    KVF_ASSIGN_OR_RETURN(int first, number(item.substr(0, dash)));
    int last = first;
    if (dash != std::string_view::npos) {
      KVF_ASSIGN_OR_RETURN(last, number(item.substr(dash + 1)));
    }
    for (int r = first; r <= last; ++r) {
      if (std::any_of(out.begin(), out.end(), [&](const RankId& x) { return x.rank == r; })) {
        return Status::InvalidArgument(fmt::format("--ranks '{}': rank {} twice", i.ranks, r));
      }
      out.push_back({context, r});
    }
  }
  return out;
}

// The rendezvous group key: 32 hex digits in `path` (a file only its owner reads), or in the
// environment variable KVFERRY_RENDEZVOUS_KEY. Never a command-line argument: `ps` shows those.
StatusOr<std::string> ReadGroupKey(const std::string& path) {
  std::string text;
  if (!path.empty()) {
    std::ifstream in(path);
    if (!in) return Status::NotFound(fmt::format("--rendezvous-key-file {}: cannot read", path));
    std::getline(in, text);
  } else if (const char* env = std::getenv("KVFERRY_RENDEZVOUS_KEY")) {
    text = env;
  } else {
    return Status::InvalidArgument(
        "the rendezvous group key: --rendezvous-key-file PATH or KVFERRY_RENDEZVOUS_KEY");
  }
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.pop_back();
  KVF_ASSIGN_OR_RETURN(RendezvousKey key, ParseRendezvousKeyHex(text));
  return RendezvousKeyHex(key);
}

int RunInstanceCommand(const Flags& f, const InstanceFlags& i) {
  Document doc("instance");
  auto fail = [&](const Status& s) {
    fmt::print(stderr, "kvferry instance: {}\n", s.ToString());
    doc.SetResult(false, s.ToString());
    if (f.out.machine()) doc.Print(f.out.format());
    return 2;
  };
  auto cfg = ToConfig(f);
  if (!cfg.ok()) return fail(cfg.status());
  auto key = ReadGroupKey(i.key_file);
  if (!key.ok()) return fail(key.status());
  cfg->rendezvous = i.rendezvous;
  cfg->rendezvous_key = *key;
  auto ranks = ParseRanks(i, *cfg);
  if (!ranks.ok()) return fail(ranks.status());
  doc.config() = ConfigJson(f, *cfg);
  doc.config()["role"] = i.role;
  doc.config()["rendezvous"] = i.rendezvous;
  std::vector<int> here;
  for (const RankId& r : *ranks) here.push_back(r.rank);
  doc.config()["ranks"] = here;
  if (!f.out.machine()) {
    const ParallelConfig& split = i.role == "context" ? cfg->ctx : cfg->gen;
    fmt::print("kvferry instance: {} instance, ranks {} here (tp{} pp{} dp{}), {}, rendezvous {}\n",
               i.role, fmt::join(here, ","), split.tp, split.pp, split.dp_size, cfg->transport,
               i.rendezvous);
    std::fflush(stdout);
  }
  auto results = RunInstance(*cfg, *ranks, f.progress && !f.out.machine());
  if (!results.ok()) return fail(results.status());
  bool pass = true;
  std::string first_error;
  for (const RankResult& r : *results) {
    const bool ok = r.failed == 0 && (r.context || r.verified == r.requests) && !r.fault_missed;
    pass = pass && ok;
    if (first_error.empty() && !r.errors.empty()) first_error = r.errors.front();
    nlohmann::json row = {{"role", r.context ? "context" : "generation"},
                          {"rank", r.rank},
                          {"requests", r.requests},
                          {"verified", r.verified},
                          {"failed", r.failed},
                          {"bytes", r.bytes},
                          {"seconds", r.seconds},
                          {"data_path", r.data_path},
                          {"errors", r.errors}};
    if (!f.out.machine()) {
      fmt::print("  {} rank {}: {} requests, {} failed{}, {:.1f} MB in {:.2f} s ({}){}\n",
                 r.context ? "context" : "generation", r.rank, r.requests, r.failed,
                 r.context ? "" : fmt::format(", {} verified", r.verified), r.bytes / 1e6,
                 r.seconds, r.data_path.empty() ? "no data path" : r.data_path,
                 r.errors.empty() ? "" : ": " + r.errors.front());
    }
    doc.AddRow(std::move(row));
  }
  doc.SetResult(pass, first_error);
  if (f.out.machine()) {
    doc.Print(f.out.format());
  } else {
    fmt::print("{}\n", pass ? "PASS" : "FAIL");
  }
  return pass ? 0 : 1;
}

}  // namespace

void AddInstanceCommand(CLI::App& app) {
  auto f = std::make_shared<Flags>();
  auto i = std::make_shared<InstanceFlags>();
  auto* cmd = app.add_subcommand(
      "instance",
      "start this host's ranks of one instance (context or generation) of a selftest run; they "
      "meet the other instance, started by another command here or on another host, through the "
      "rendezvous (kvferry rendezvous). Every command of a run gives the same shape, split, "
      "layout and request flags");
  AddShapeFlags(cmd, *f);
  cmd->add_option("--role", i->role, "context|generation")
      ->required()
      ->check(CLI::IsMember({"context", "generation"}));
  cmd->add_option("--ranks", i->ranks,
                  "the ranks of the role that run here: N, A-B or A,B,... (default: all)");
  cmd->add_option("--rendezvous", i->rendezvous, "HOST:PORT of the run's rendezvous server")
      ->required();
  cmd->add_option("--rendezvous-key-file", i->key_file,
                  "file holding the group key (32 hex digits; default: the environment "
                  "variable KVFERRY_RENDEZVOUS_KEY)");
  cmd->callback([f, i] { std::exit(RunInstanceCommand(*f, *i)); });
}

void AddSelftestCommand(CLI::App& app) {
  auto f = std::make_shared<Flags>();
  auto* cmd = app.add_subcommand(
      "selftest", "run a context and a generation instance as processes and verify every element");
  AddShapeFlags(cmd, *f);
  cmd->callback([f] { std::exit(RunSelftest(*f)); });
}

void AddBenchTransferCommand(CLI::App& bench) {
  auto f = std::make_shared<Flags>();
  f->checksum = false;  // measured alone; --checksum true measures its cost
  f->concurrency = 0;   // from the request size (AutoConcurrency)
  auto sweep = std::make_shared<std::vector<int64_t>>(std::vector<int64_t>{128, 1024, 4096});
  auto* cmd = bench.add_subcommand(
      "transfer", "context -> generation GB/s and latency beside raw transport bandwidth");
  AddShapeFlags(cmd, *f);
  cmd->get_option("--concurrency")
      ->description(
          "requests in flight per generation rank (the context side publishes as many again "
          "ahead); 0: from the request size, 2 to 16 (8 GiB of requests in flight on a GPU, 2 GiB "
          "on the CPU)");
  cmd->add_option("--model", f->model, "llama3-8b|llama3-70b: sets layers, kv heads, head dim");
  cmd->add_option("--sweep", *sweep, "prompt lengths to measure (tokens)")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--warmup", f->warmup,
                  "leading requests of each generation rank left out of GB/s and latencies "
                  "(connection setup, first registrations and peer mappings); still transferred")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--unconverted", f->unconverted,
                  "when the sides' layouts or block sizes differ, also run the same transfer with "
                  "the generation side stored like the context side, right after each row, and "
                  "print the ratio")
      ->capture_default_str();
  cmd->add_flag("--no-verify", f->no_verify,
                "skip element checks (they cost CPU time on this machine)");
  cmd->callback([f, sweep] { std::exit(RunBenchTransfer(*f, *sweep)); });
}

}  // namespace kvferry::tools
