#include "tools/kvferry/transfer_flags.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "kvferry/config.h"
#include "kvferry/nixl_info.h"
#include "selftest/timeline_json.h"

namespace kvferry::tools {

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
                                "made-up distinct values|block (fp8 only: one per block, layer, "
                                "K/V and head, in the pool; the context's made up, the "
                                "generation's computed from each block's values); the context "
                                "side converts with both sides' scales, each element checked",
                                side))
        ->check(CLI::IsMember({"none", "tensor", "head", "block"}))
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

void AddMeasureFlags(CLI::App* cmd, Flags& f) {
  cmd->add_option("--model", f.model, "llama3-8b|llama3-70b: sets layers, kv heads, head dim");
  cmd->add_option("--warmup", f.warmup,
                  "leading requests of each generation rank left out of GB/s and latencies "
                  "(connection setup, first registrations and peer mappings); still transferred")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_flag("--no-verify", f.no_verify,
                "skip element checks (they cost CPU time on this machine)");
}

namespace {

struct ModelShape {
  const char* name;
  int layers, kv_heads, head_dim;
};
constexpr ModelShape kModels[] = {{"llama3-8b", 32, 8, 128}, {"llama3-70b", 80, 8, 128}};

}  // namespace

void ApplyModel(Flags& f) {
  for (const ModelShape& m : kModels) {
    if (f.model == m.name) {
      f.layers = m.layers;
      f.kv_heads = m.kv_heads;
      f.head_dim = m.head_dim;
    }
  }
}

std::string GenBlockNote(const SelftestConfig& c) {
  const KvShape g = SideShape(c, false);
  std::vector<std::string> parts;
  if (g.tokens_per_block != c.shape.tokens_per_block)
    parts.push_back(fmt::format("{} tokens per block", g.tokens_per_block));
  if (g.dtype != c.shape.dtype) parts.push_back(std::string(DTypeName(g.dtype)));
  return parts.empty() ? "" : fmt::format(" ({})", fmt::join(parts, ", "));
}

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
    return s == "tensor"  ? ScaleGranularity::kTensor
           : s == "head"  ? ScaleGranularity::kHead
           : s == "block" ? ScaleGranularity::kBlock
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

namespace {

// The slowest request of the run: the longest timeline over every rank.
std::optional<std::pair<const RankResult*, RequestTimeline>> SlowestOf(
    const std::vector<RankResult>& ranks) {
  std::optional<std::pair<const RankResult*, RequestTimeline>> out;
  for (const RankResult& r : ranks) {
    if (r.slowest && (!out || r.slowest->end > out->second.end)) out.emplace(&r, *r.slowest);
  }
  return out;
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

}  // namespace

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

void PrintBenchHeader(int warmup) {
  if (warmup > 0)
    fmt::print(
        "  GB/s, latencies and us/r leave out the first {} request(s) of each generation "
        "rank, which end before the others start; ctl us/r: progress-thread CPU per request in "
        "iterations that did work, all us/r: all of it (idle polling too), all ranks\n",
        warmup);
  fmt::print("{:>8} {:>6} {:>10} {:>9} {:>9} {:>9} {:>9} {:>9} {:>10} {:>7} {:>10} {:>7}  {}\n",
             "tokens", "in flt", "MB", "GB/s", "p50 ms", "p99 ms", "ctl us/r", "all us/r",
             "raw GB/s", "ratio", "copy GB/s", "ratio", "data path: raw | copy baselines");
}

}  // namespace kvferry::tools
