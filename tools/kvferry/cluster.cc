#include "tools/kvferry/cluster.h"

#include <fmt/format.h>
#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <thread>

#include "tools/kvferry/rank_processes.h"

namespace kvferry::tools {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// How long the surviving ranks get, beyond one request deadline, after a rank process died.
constexpr std::chrono::milliseconds kDeathGrace{3000};

json ParallelJson(const ParallelConfig& p) {
  return {{"tp", p.tp},
          {"pp", p.pp},
          {"stage_layers", p.stage_layers},
          {"dp_size", p.dp_size},
          {"dp_rank", p.dp_rank}};
}
ParallelConfig ParallelFrom(const json& j) {
  ParallelConfig p;
  p.tp = j["tp"];
  p.pp = j["pp"];
  p.stage_layers = j["stage_layers"].get<std::vector<int32_t>>();
  p.dp_size = j["dp_size"];
  p.dp_rank = j["dp_rank"];
  return p;
}

// The config travels to rank processes as one JSON argument.
std::string ConfigToJson(const SelftestConfig& c) {
  json j;
  j["shape"] = {c.shape.layers,    c.shape.kv_heads,
                c.shape.head_dim,  static_cast<int>(c.shape.dtype),
                c.shape.kv_factor, c.shape.tokens_per_block};
  j["ctx"] = ParallelJson(c.ctx);
  j["gen"] = ParallelJson(c.gen);
  j["ctx_layout"] = static_cast<int>(c.ctx_layout);
  j["gen_layout"] = static_cast<int>(c.gen_layout);
  j["requests"] = c.requests;
  j["prompt_tokens"] = c.prompt_tokens;
  j["concurrency"] = c.concurrency;
  j["transport"] = c.transport;
  j["device"] = c.device;
  j["layer_wise"] = c.layer_wise;
  j["shared_prefix_blocks"] = c.shared_prefix_blocks;
  j["crash_ctx_rank"] = c.crash_ctx_rank;
  j["verify"] = c.verify;
  j["baseline"] = c.baseline;
  j["timeout_ms"] = c.timeout.count();
  j["dir"] = c.dir;
  j["gpus"] = c.gpus;
  j["checksum"] = c.checksum;
  return j.dump();
}

SelftestConfig ConfigFromJson(const std::string& s) {
  json j = json::parse(s);
  SelftestConfig c;
  auto sh = j["shape"];
  c.shape = KvShape{sh[0], sh[1], sh[2], static_cast<DType>(sh[3].get<int>()), sh[4], sh[5]};
  c.ctx = ParallelFrom(j["ctx"]);
  c.gen = ParallelFrom(j["gen"]);
  c.ctx_layout = static_cast<LayoutKind>(j["ctx_layout"].get<int>());
  c.gen_layout = static_cast<LayoutKind>(j["gen_layout"].get<int>());
  c.requests = j["requests"];
  c.prompt_tokens = j["prompt_tokens"].get<std::vector<int64_t>>();
  c.concurrency = j["concurrency"];
  c.transport = j["transport"];
  c.device = j["device"];
  c.layer_wise = j["layer_wise"];
  c.shared_prefix_blocks = j["shared_prefix_blocks"];
  c.crash_ctx_rank = j["crash_ctx_rank"];
  c.verify = j["verify"];
  c.baseline = j["baseline"];
  c.timeout = std::chrono::milliseconds(j["timeout_ms"].get<int64_t>());
  c.dir = j["dir"];
  c.gpus = j.value("gpus", std::vector<int>{});
  c.checksum = j.value("checksum", true);
  return c;
}

TransportMaker MakerFor(const SelftestConfig& cfg) {
  return [name = cfg.transport, host = cfg.device == "cpu"]() {
    TransportOptions t;
    t.name = name;
    t.device_memory_is_host = host;
    return CreateTransport(t);
  };
}

int RunRank(const SelftestConfig& cfg, bool context, int rank) {
  auto r = context ? RunContextRank(cfg, rank, MakerFor(cfg))
                   : RunGenerationRank(cfg, rank, MakerFor(cfg));
  if (!r.ok()) {
    std::cerr << fmt::format("kvferry {} rank {}: {}\n", context ? "context" : "generation", rank,
                             r.status().ToString());
    return 2;
  }
  return 0;
}

}  // namespace

// "12/32 requests done (generation ranks: 12 14)" from the ranks' progress files.
void PrintProgress(const fs::path& dir, const SelftestConfig& cfg, Clock::time_point start) {
  std::string per_rank;
  for (int g = 0; g < cfg.gen.world_size(); ++g) {
    std::ifstream f(dir / fmt::format("progress-gen-{}", g));
    int done = 0, total = 0;
    if (f) f >> done >> total;
    per_rank += fmt::format(" {}", done);
  }
  double secs = std::chrono::duration<double>(Clock::now() - start).count();
  fmt::print("  [{:5.1f} s] requests done per generation rank:{}\n", secs, per_rank);
  std::fflush(stdout);
}

StatusOr<std::vector<RankResult>> RunCluster(const SelftestConfig& in, bool progress) {
  SelftestConfig cfg = in;
  fs::path dir =
      fs::temp_directory_path() / fmt::format("kvferry-{}-{}", getpid(), std::random_device{}());
  fs::create_directories(dir);
  cfg.dir = dir.string();
  struct Cleanup {
    fs::path d;
    ~Cleanup() {
      std::error_code ec;
      fs::remove_all(d, ec);
    }
  } cleanup{dir};
  KVF_RETURN_IF_ERROR(ValidateSelftest(cfg));
  if (cfg.transport == "inproc") return RunInProcess(cfg);
  const int nc = cfg.ctx.world_size(), ng = cfg.gen.world_size();
  std::string exe = fs::canonical("/proc/self/exe").string();
  // The config travels in a file: mpirun mangles long JSON arguments.
  std::string conf = (dir / "config.json").string();
  {
    std::ofstream f(conf);
    f << ConfigToJson(cfg);
  }
  // Ranks, their process group and the directory: gone however this process ends.
  KVF_ASSIGN_OR_RETURN(std::unique_ptr<RankGroup> group, RankGroup::Create(dir));
  if (cfg.transport == "mpi") {
    KVF_RETURN_IF_ERROR(
        group->Spawn("mpirun", {"mpirun", "--allow-run-as-root", "--oversubscribe", "-np",
                                std::to_string(nc + ng), "--mca", "btl", "self,vader,tcp", exe,
                                "--rank-of-cluster", "mpi", "--cluster-config", conf}));
  } else {
    for (int r = 0; r < nc; ++r) {
      KVF_RETURN_IF_ERROR(group->Spawn(
          fmt::format("context rank {}", r),
          {exe, "--rank-of-cluster", fmt::format("ctx:{}", r), "--cluster-config", conf}));
    }
    for (int r = 0; r < ng; ++r) {
      KVF_RETURN_IF_ERROR(group->Spawn(
          fmt::format("generation rank {}", r),
          {exe, "--rank-of-cluster", fmt::format("gen:{}", r), "--cluster-config", conf}));
    }
  }
  auto start = Clock::now();
  std::function<void()> tick;
  if (progress) tick = [&] { PrintProgress(dir, cfg, start); };
  const Deadline run_deadline = DeadlineIn(cfg.timeout * 3);
  // Once a rank process has died, the others get one request deadline plus a grace to end what
  // they have in flight and write their results; then the run is over (nothing waits for a
  // request that can no longer be served).
  std::optional<Deadline> after_death;
  auto deadline = [&] {
    if (!after_death) {
      for (const RankGroup::Rank& r : group->ranks()) {
        if (r.ended && r.wait_status != 0) after_death = DeadlineIn(cfg.timeout + kDeathGrace);
      }
    }
    return after_death ? std::min(*after_death, run_deadline) : run_deadline;
  };
  Status waited = group->Wait(deadline, tick);
  std::vector<RankResult> out;
  int missing = 0;
  for (int r = 0; r < nc + ng; ++r) {
    const bool context = r < nc;
    const int rank = context ? r : r - nc;
    fs::path f =
        dir / (context ? fmt::format("ctx-{}.json", rank) : fmt::format("gen-{}.json", rank));
    std::ifstream in_file(f);
    if (!in_file) {
      // A rank that died or gave up still counts: its failure shows in the summary, beside what
      // the surviving ranks reported, with how its process ended.
      const auto& procs = group->ranks();
      const RankGroup::Rank& proc = procs[std::min<size_t>(r, procs.size() - 1)];
      RankResult dead;
      dead.context = context;
      dead.rank = rank;
      dead.failed = 1;
      dead.errors.push_back(fmt::format("left no result: {}", proc.Describe()));
      out.push_back(std::move(dead));
      ++missing;
      continue;
    }
    std::string text((std::istreambuf_iterator<char>(in_file)), std::istreambuf_iterator<char>());
    KVF_ASSIGN_OR_RETURN(RankResult res, ResultFromJson(text));
    out.push_back(std::move(res));
  }
  if (missing == nc + ng)
    return waited.ok() ? Status::Unavailable("no rank left a result") : waited;
  return out;
}

int MaybeRunRank(int argc, char** argv) {
  if (argc != 5 || std::string(argv[1]) != "--rank-of-cluster" ||
      std::string(argv[3]) != "--cluster-config")
    return -1;
  std::ifstream conf(argv[4]);
  std::string text((std::istreambuf_iterator<char>(conf)), std::istreambuf_iterator<char>());
  if (text.empty()) {
    std::cerr << "kvferry: cannot read cluster config " << argv[4] << "\n";
    return 2;
  }
  SelftestConfig cfg = ConfigFromJson(text);
  std::string who = argv[2];
  if (who == "mpi") {
    // OpenMPI tells each process its rank; context ranks come first.
    const char* r = std::getenv("OMPI_COMM_WORLD_RANK");
    if (!r) r = std::getenv("PMI_RANK");
    if (!r) {
      std::cerr << "kvferry: --rank-of-cluster mpi outside mpirun\n";
      return 2;
    }
    int world = std::atoi(r), nc = cfg.ctx.world_size();
    return world < nc ? RunRank(cfg, true, world) : RunRank(cfg, false, world - nc);
  }
  bool context = who.rfind("ctx:", 0) == 0;
  return RunRank(cfg, context, std::atoi(who.c_str() + 4));
}

}  // namespace kvferry::tools
