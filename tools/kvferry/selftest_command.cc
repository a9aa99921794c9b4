// `kvferry selftest` and `kvferry bench transfer`: a context instance and a generation instance as
// separate processes (one per rank), requests streamed between them, every element verified.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <nlohmann/json.hpp>

#include "kvferry/config.h"
#include "tools/kvferry/cluster.h"
#include "tools/kvferry/commands.h"
#include "tools/kvferry/transfer_flags.h"

namespace kvferry::tools {
namespace {

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
  const bool pass = s.failed == 0 && s.verified == s.requests && !s.fault_missed && s.leaked == 0;
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
  // The sides' made-up scales differ (SideScales) whenever either has some.
  if (f.ctx_scales != "none" || f.gen_scales != "none")
    parts.push_back(fmt::format("scales per {} -> per {}", f.ctx_scales, f.gen_scales));
  return fmt::format("{}", fmt::join(parts, ", "));
}

// The same transfer without the conversion: the generation side in the context side's layout,
// block size and dtype, and no scales on either side (the sides' made-up scales differ, so with
// any the bytes would still be requantized).
Flags Unconverted(const Flags& f) {
  Flags g = f;
  g.gen_layout = f.ctx_layout;
  g.gen_tokens_per_block = f.ctx_tokens_per_block ? f.ctx_tokens_per_block : f.tokens_per_block;
  g.gen_dtype = f.ctx_dtype;
  g.ctx_scales = g.gen_scales = "none";
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
    PrintBenchHeader(f.warmup);
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
    if (s.failed || s.fault_missed || s.leaked) rc = 1;
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
            "layout, block size and dtype, no scales, same run, data path {}): ratio of request "
            "rates {:.2f}\n",
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

}  // namespace

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
  AddMeasureFlags(cmd, *f);
  cmd->get_option("--concurrency")
      ->description(
          "requests in flight per generation rank (the context side publishes as many again "
          "ahead); 0: from the request size, 2 to 16 (8 GiB of requests in flight on a GPU, 2 GiB "
          "on the CPU)");
  cmd->add_option("--sweep", *sweep, "prompt lengths to measure (tokens)")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--unconverted", f->unconverted,
                  "when the sides' layouts or block sizes differ, also run the same transfer with "
                  "the generation side stored like the context side, right after each row, and "
                  "print the ratio")
      ->capture_default_str();
  cmd->callback([f, sweep] { std::exit(RunBenchTransfer(*f, *sweep)); });
}

}  // namespace kvferry::tools
