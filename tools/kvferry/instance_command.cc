// `kvferry instance`: this host's ranks of one instance (context or generation) of a transfer run,
// meeting the other instance, started by another command here or on another host, through the
// rendezvous; with --bench, the run is measured as `bench transfer` measures it.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>

#include "kvferry/rendezvous.h"
#include "tools/kvferry/cluster.h"
#include "tools/kvferry/commands.h"
#include "tools/kvferry/transfer_flags.h"

namespace kvferry::tools {
namespace {

// `kvferry instance`: this host's ranks of one instance, meeting the other instance through an
// external rendezvous.
struct InstanceFlags {
  std::string role = "context";
  std::string ranks;  // "" (all), "N", "A-B" or "A,B,C"
  std::string rendezvous;
  std::string key_file;
  bool bench = false;  // measured as bench transfer measures (baselines, warm-up)
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

int RunInstanceCommand(Flags f, const InstanceFlags& i) {
  ApplyModel(f);
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
  if (i.bench) {
    // As bench transfer: raw transport bandwidth between context rank 0 and generation rank 0
    // (here: across whatever joins the two commands' hosts) and one copy in context rank 0, both
    // after the transfers; warm-up requests left out; the context side publishes ahead.
    cfg->baseline = true;
    cfg->warmup = f.warmup;
    cfg->ctx_ahead = cfg->concurrency;
  }
  auto ranks = ParseRanks(i, *cfg);
  if (!ranks.ok()) return fail(ranks.status());
  doc.config() = ConfigJson(f, *cfg);
  doc.config()["role"] = i.role;
  doc.config()["rendezvous"] = i.rendezvous;
  std::vector<int> here;
  for (const RankId& r : *ranks) here.push_back(r.rank);
  doc.config()["ranks"] = here;
  doc.config()["bench"] = i.bench;
  doc.config()["model"] = f.model;
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
    const bool ok = r.failed == 0 && (r.context || !cfg->verify || r.verified == r.requests) &&
                    !r.fault_missed && r.leaked == 0;
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
  // The measured row, where every generation rank ran here (the summary is over the generation
  // ranks; the baselines came from context rank 0 through the rendezvous).
  const bool whole =
      i.role == "generation" && static_cast<int>(results->size()) == cfg->gen.world_size();
  if (i.bench && whole) {
    SelftestSummary s = Summarize(*cfg, *results);
    nlohmann::json row = BenchRow(s, cfg->prompt_tokens.front(), *cfg, *results);
    row["role"] = "summary";
    if (!f.out.machine()) {
      PrintBenchHeader(cfg->warmup);
      PrintBenchRow(row, s, cfg->verify);
      PrintMedian(*results);
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
  AddMeasureFlags(cmd, *f);
  cmd->add_flag("--bench", i->bench,
                "measure the run as bench transfer does: GB/s and latencies without the --warmup "
                "requests, beside raw transport bandwidth between context rank 0 and generation "
                "rank 0 (over the same link, after the transfers) and one copy in context rank 0; "
                "the generation instance prints the row when all its ranks run in its command. "
                "Give it to both instances");
  cmd->callback([f, i] { std::exit(RunInstanceCommand(*f, *i)); });
}

}  // namespace kvferry::tools
