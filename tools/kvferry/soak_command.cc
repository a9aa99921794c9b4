// `kvferry soak`: thousands of requests through several splits and layouts with random cancels and
// injected faults; per-state counts, leaks, RSS growth and throughput (library: selftest/soak.h).
#include <fmt/format.h>
#include <malloc.h>

#include <cstdio>
#include <nlohmann/json.hpp>

#include "kvferry/config.h"
#include "selftest/soak.h"
#include "tools/kvferry/commands.h"
#include "tools/kvferry/output.h"
#include "tools/kvferry/process_soak.h"

namespace kvferry::tools {
namespace {

struct SoakFlags {
  SoakConfig cfg;
  int duration_s = 0;
  int timeout_ms = 300;
  double max_rss_growth_pct = 5;
  bool no_verify = false, progress = false, verbose = false;
  OutputFlags out;
  int metrics_port = -1;
  bool processes = false;
  bool epoch_requests_given = false, timeout_given = false;
};

// --processes: UCX ranks as processes, crash faults ending them (process_soak.h).
int RunProcessSoakCommand(const SoakFlags& f) {
  if (f.cfg.transport != "ucx") {
    fmt::print(stderr, "kvferry soak: --processes runs over ucx, not --transport {}\n",
               f.cfg.transport);
    return 2;
  }
  ProcessSoakConfig c;
  c.requests = f.cfg.requests;
  c.epoch_requests = f.epoch_requests_given ? f.cfg.epoch_requests : c.epoch_requests;
  if (f.timeout_given) c.timeout = std::chrono::milliseconds(f.timeout_ms);
  c.seed = f.cfg.seed;
  std::function<void(const ProcessSoakReport&)> progress;
  if (f.progress && !f.out.machine()) {
    progress = [](const ProcessSoakReport& r) {
      fmt::print(stderr, "  epoch {}: {} requests, {} verified, {} crashed, {:.0f} s\n", r.epochs,
                 r.requests, r.verified, r.crashed_epochs, r.seconds);
    };
  }
  auto report = RunProcessSoak(c, progress);
  if (!report.ok()) {
    fmt::print(stderr, "kvferry soak: {}\n", report.status().ToString());
    return report.status().code() == StatusCode::kInvalidArgument ? 2 : 1;
  }
  const ProcessSoakReport& r = *report;
  const bool pass = r.broken == 0 && r.verify_failures == 0;
  if (f.out.machine()) {
    Document doc("soak");
    doc.config() = {{"processes", true},
                    {"requests", c.requests},
                    {"epoch_requests", c.epoch_requests},
                    {"timeout_ms", c.timeout.count()},
                    {"transport", "ucx"},
                    {"seed", c.seed}};
    doc.summary() = {{"requests", r.requests},
                     {"epochs", r.epochs},
                     {"verified", r.verified},
                     {"failed", r.failed},
                     {"crashed_epochs", r.crashed_epochs},
                     {"faults_by_kind", r.faults_by_kind},
                     {"faults_by_step", r.faults_by_step},
                     {"verify_failures", r.verify_failures},
                     {"broken", r.broken},
                     {"seconds", r.seconds},
                     {"errors", r.errors},
                     {"pass", pass}};
    doc.SetResult(pass, r.errors.empty() ? "" : r.errors.front());
    doc.Print(f.out.format());
    return pass ? 0 : 1;
  }
  fmt::print(
      "kvferry soak --processes: {} requests over ucx processes in {} epochs, one fault each\n",
      r.requests, r.epochs);
  std::string kinds, steps;
  for (const auto& [k, n] : r.faults_by_kind) kinds += fmt::format(" {} {}", k, n);
  for (const auto& [k, n] : r.faults_by_step) steps += fmt::format(" {} {}", k, n);
  fmt::print("  faults by kind:{}\n  faults by step:{}\n", kinds, steps);
  fmt::print("  verified {}  failed {}  epochs a crash ended a rank's process {}\n", r.verified,
             r.failed, r.crashed_epochs);
  fmt::print("  broken promises {}  verify failures {}  {:.1f} s\n", r.broken, r.verify_failures,
             r.seconds);
  for (const auto& e : r.errors) fmt::print("  error: {}\n", e);
  fmt::print("{}\n", pass ? "PASS" : "FAIL");
  return pass ? 0 : 1;
}

nlohmann::json ReportJson(const SoakReport& r, bool pass) {
  return {{"requests", r.requests},
          {"faults_injected", r.faults_injected},
          {"fault_pct", r.requests ? 100.0 * r.faults_injected / r.requests : 0},
          {"cancels", r.cancels},
          {"forged", r.forged},
          {"faults_by_step", r.faults_by_step},
          {"faults_by_kind", r.faults_by_kind},
          {"epochs", r.epochs},
          {"request_states", r.request_states},
          {"rank_states", r.rank_states},
          {"not_exactly_once", r.not_exactly_once},
          {"late", r.late},
          {"leaked_leases", r.leaked_leases},
          {"leaked_staging", r.leaked_staging},
          {"verify_failures", r.verify_failures},
          {"rss_quarter_mib", r.rss_quarter_mib},
          {"rss_end_mib", r.rss_end_mib},
          {"rss_growth_pct", r.rss_growth_pct},
          {"anon_quarter_mib", r.anon_quarter_mib},
          {"anon_end_mib", r.anon_end_mib},
          {"anon_growth_pct", r.anon_growth_pct},
          {"heap_quarter_mib", r.heap_quarter_mib},
          {"heap_end_mib", r.heap_end_mib},
          {"heap_growth_pct", r.heap_growth_pct},
          {"growth_of", r.sanitizer ? "sanitizer heap" : "rss"},
          {"growth_pct", r.growth_pct},
          {"seconds", r.seconds},
          {"requests_per_second", r.requests_per_second},
          {"layouts", r.layouts},
          {"errors", r.errors},
          {"pass", pass}};
}

int RunSoakCommand(SoakFlags f) {
  if (f.processes) return RunProcessSoakCommand(f);
  f.cfg.duration = std::chrono::seconds(f.duration_s);
  f.cfg.timeout = std::chrono::milliseconds(f.timeout_ms);
  f.cfg.verify = !f.no_verify;
  if (f.duration_s < 0 || f.timeout_ms < 1 || !(f.max_rss_growth_pct >= 0)) {
    fmt::print(stderr,
               "kvferry soak: --duration-s={} must be >= 0, --timeout-ms={} >= 1, "
               "--max-rss-growth-pct={} >= 0\n",
               f.duration_s, f.timeout_ms, f.max_rss_growth_pct);
    return 2;
  }
  // Injected faults make every side log what it sees: thousands of lines. Errors only, unless
  // asked for.
  if (!f.verbose) (void)Config::Global().Set("log.level", "error");
  // One malloc arena: glibc otherwise gives threads arenas of their own that keep freed memory
  // (every epoch starts new progress threads), and RSS then grows with no byte leaked. With one
  // arena RSS follows what is allocated, which is what the soak is after.
  mallopt(M_ARENA_MAX, 1);
  SoakProgress progress;
  if (f.progress && !f.out.machine()) {
    progress = [](const SoakReport& r) {
      fmt::print(stderr,
                 "  {} requests, {} faults, {:.0f} s, RSS {:.1f} MiB (anonymous {:.2f}), heap "
                 "{:.2f} MiB\n",
                 r.requests, r.faults_injected, r.seconds, r.rss_end_mib, r.anon_end_mib,
                 r.heap_end_mib);
    };
  }
  // --metrics-port: every epoch's sides while it runs.
  MetricsBoard board;
  std::unique_ptr<MetricsServer> server;
  if (f.metrics_port >= 0) {
    auto s = board.Serve(static_cast<uint16_t>(f.metrics_port), "soak");
    if (!s.ok()) {
      fmt::print(stderr, "kvferry soak: {}\n", s.status().ToString());
      return 2;
    }
    server = std::move(s).value();
    f.cfg.metrics = &board;
  }
  Document doc("soak");
  doc.config() = {{"requests", f.cfg.requests},
                  {"duration_s", f.duration_s},
                  {"fault_rate", f.cfg.fault_rate},
                  {"cancel_rate", f.cfg.cancel_rate},
                  {"concurrency", f.cfg.concurrency},
                  {"epoch_requests", f.cfg.epoch_requests},
                  {"timeout_ms", f.timeout_ms},
                  {"transport", f.cfg.transport},
                  {"device", "cpu"},
                  {"seed", f.cfg.seed},
                  {"verify", f.cfg.verify},
                  {"max_rss_growth_pct", f.max_rss_growth_pct},
                  {"metrics_port", f.metrics_port}};
  auto report = RunSoak(f.cfg, progress);
  if (!report.ok()) {
    fmt::print(stderr, "kvferry soak: {}\n", report.status().ToString());
    return report.status().code() == StatusCode::kInvalidArgument ? 2 : 1;
  }
  const SoakReport& r = *report;
  const bool pass = r.not_exactly_once == 0 && r.leaked_leases == 0 && r.leaked_staging == 0 &&
                    r.verify_failures == 0 && r.growth_pct <= f.max_rss_growth_pct;
  if (f.out.machine()) {
    doc.summary() = ReportJson(r, pass);
    doc.config()["layouts"] = r.layouts;
    doc.SetResult(pass, r.errors.empty() ? "" : r.errors.front());
    doc.Print(f.out.format());
    return pass ? 0 : 1;
  }
  fmt::print("kvferry soak: {} requests over {} in {} epochs ({})\n", r.requests, f.cfg.transport,
             r.epochs, fmt::join(r.layouts, ", "));
  fmt::print("  faults injected {} ({:.1f}%)  cancels {}  forged handles {}\n", r.faults_injected,
             r.requests ? 100.0 * r.faults_injected / r.requests : 0.0, r.cancels, r.forged);
  std::string states;
  for (const auto& [s, n] : r.faults_by_step) states += fmt::format(" {} {}", s, n);
  fmt::print("  faults by step:{}\n", states);
  states.clear();
  for (const auto& [s, n] : r.faults_by_kind) states += fmt::format(" {} {}", s, n);
  fmt::print("  faults by kind:{}\n", states);
  states.clear();
  for (const auto& [s, n] : r.request_states) states += fmt::format(" {} {}", s, n);
  fmt::print("  requests:{}\n", states);
  states.clear();
  for (const auto& [s, n] : r.rank_states) states += fmt::format(" {} {}", s, n);
  fmt::print("  rank reports:{}\n", states);
  fmt::print("  not exactly one terminal state {}  late {}  verify failures {}\n",
             r.not_exactly_once, r.late, r.verify_failures);
  fmt::print("  leaked leases {}  leaked staging slots {}\n", r.leaked_leases, r.leaked_staging);
  const std::string limit = fmt::format(", limit {}%", f.max_rss_growth_pct);
  fmt::print("  RSS {:.2f} MiB after the first quarter, {:.2f} MiB at the end ({:+.2f}%{})\n",
             r.rss_quarter_mib, r.rss_end_mib, r.rss_growth_pct, r.sanitizer ? "" : limit);
  fmt::print(
      "  anonymous RSS {:.2f} -> {:.2f} MiB ({:+.2f}%), heap in use {:.2f} -> {:.2f} MiB "
      "({:+.2f}%{})\n",
      r.anon_quarter_mib, r.anon_end_mib, r.anon_growth_pct, r.heap_quarter_mib, r.heap_end_mib,
      r.heap_growth_pct,
      r.sanitizer ? limit + ": a sanitizer build, its RSS is mostly shadow" : "");
  fmt::print("  {:.1f} s, {:.0f} requests/s\n", r.seconds, r.requests_per_second);
  for (const auto& e : r.errors) fmt::print("  error: {}\n", e);
  fmt::print("{}\n", pass ? "PASS" : "FAIL");
  return pass ? 0 : 1;
}

}  // namespace

void AddSoakCommand(CLI::App& app) {
  auto f = std::make_shared<SoakFlags>();
  auto* cmd = app.add_subcommand(
      "soak",
      "many requests with random cancels and injected faults: every request ends exactly once, "
      "nothing leaks, memory stays flat");
  cmd->add_option("--requests", f->cfg.requests, "requests to run")->capture_default_str();
  cmd->add_option("--duration-s", f->duration_s,
                  "run this many seconds instead of --requests (the long soak)")
      ->capture_default_str();
  cmd->add_option("--fault-rate", f->cfg.fault_rate, "faults injected per request")
      ->capture_default_str();
  cmd->add_option("--cancel-rate", f->cfg.cancel_rate, "requests cancelled (either side)")
      ->capture_default_str();
  cmd->add_option("--forge-rate", f->cfg.forge_rate,
                  "requests fetched with a forged handle (the context ranks must refuse them)")
      ->capture_default_str();
  cmd->add_option("--concurrency", f->cfg.concurrency, "requests in flight")->capture_default_str();
  auto* epoch = cmd->add_option("--epoch-requests", f->cfg.epoch_requests,
                                "requests per layout before the next one (fresh transports; "
                                "--processes: per multi-process run, default 24)")
                    ->capture_default_str();
  auto* timeout = cmd->add_option("--timeout-ms", f->timeout_ms,
                                  "deadline of each request (--processes: default 2000)")
                      ->capture_default_str();
  cmd->add_option("--transport", f->cfg.transport,
                  "inproc|ucx (ucx workers in this process: no crash faults; see --processes)")
      ->capture_default_str();
  cmd->add_option("--seed", f->cfg.seed, "random seed (faults, cancels, sizes)")
      ->capture_default_str();
  cmd->add_option("--max-rss-growth-pct", f->max_rss_growth_pct,
                  "fail when RSS grows more than this from the first quarter to the end (in a "
                  "sanitizer build: the sanitizer allocator's bytes in use)")
      ->capture_default_str();
  cmd->add_flag("--no-verify", f->no_verify, "skip element checks of completed requests");
  AddOutputFlags(cmd, f->out);
  cmd->add_option("--metrics-port", f->metrics_port,
                  "serve Prometheus metrics of the running epoch's sides on 127.0.0.1:PORT (0: a "
                  "free port, named on stderr)")
      ->check(CLI::Range(0, 65535));
  cmd->add_flag("--progress", f->progress, "print a line per epoch");
  cmd->add_flag("--verbose", f->verbose, "keep the log level (default: errors only)");
  cmd->add_flag("--processes", f->processes,
                "--transport ucx with one process per rank (as selftest runs them) and one fault "
                "per run, crashes included: a crash ends a rank's process");
  cmd->callback([f, epoch, timeout] {
    f->epoch_requests_given = epoch->count() > 0;
    f->timeout_given = timeout->count() > 0;
    std::exit(RunSoakCommand(*f));
  });
}

}  // namespace kvferry::tools
