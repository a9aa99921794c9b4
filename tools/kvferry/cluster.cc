#include "tools/kvferry/cluster.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <thread>

#include "selftest/run_watch.h"
#include "tools/kvferry/rank_processes.h"

namespace kvferry::tools {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// How long the surviving ranks get, beyond one request deadline, after a rank process died.
constexpr std::chrono::milliseconds kDeathGrace{3000};

json ParallelToWire(const ParallelConfig& p) {
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
  j["ctx"] = ParallelToWire(c.ctx);
  j["gen"] = ParallelToWire(c.gen);
  j["gen_tokens_per_block"] = c.gen_tokens_per_block;
  if (c.gen_dtype) j["gen_dtype"] = static_cast<int>(*c.gen_dtype);
  j["ctx_scales"] = static_cast<int>(c.ctx_scales);
  j["gen_scales"] = static_cast<int>(c.gen_scales);
  j["ctx_layout"] = c.ctx_layout.ToString();
  j["gen_layout"] = c.gen_layout.ToString();
  j["requests"] = c.requests;
  j["prompt_tokens"] = c.prompt_tokens;
  j["concurrency"] = c.concurrency;
  j["transport"] = c.transport;
  j["device"] = c.device;
  j["layer_wise"] = c.layer_wise;
  j["shared_prefix_blocks"] = c.shared_prefix_blocks;
  j["crash_ctx_rank"] = c.crash_ctx_rank;
  j["fault"] = c.fault;
  j["verify"] = c.verify;
  j["baseline"] = c.baseline;
  j["timeout_ms"] = c.timeout.count();
  j["give_up_ms"] = c.give_up.count();
  j["dir"] = c.dir;
  j["rendezvous"] = c.rendezvous;
  j["rendezvous_key"] = c.rendezvous_key;
  j["gpus"] = c.gpus;
  j["checksum"] = c.checksum;
  j["warmup"] = c.warmup;
  j["ctx_ahead"] = c.ctx_ahead;
  j["metrics_port"] = c.metrics_port;
  return j.dump();
}

// The config a rank process was given: any JSON error (syntax, a missing field, a wrong type) is
// an error naming it, never an exception that aborts the rank; the values are then validated as
// the command line's are.
StatusOr<SelftestConfig> ConfigFromJson(const std::string& s) try {
  json j = json::parse(s);
  SelftestConfig c;
  auto sh = j["shape"];
  c.shape = KvShape{sh[0], sh[1], sh[2], static_cast<DType>(sh[3].get<int>()), sh[4], sh[5]};
  c.ctx = ParallelFrom(j["ctx"]);
  c.gen = ParallelFrom(j["gen"]);
  c.gen_tokens_per_block = j.value("gen_tokens_per_block", 0);
  if (j.contains("gen_dtype")) c.gen_dtype = static_cast<DType>(j["gen_dtype"].get<int>());
  c.ctx_scales = static_cast<ScaleGranularity>(j.value("ctx_scales", 0));
  c.gen_scales = static_cast<ScaleGranularity>(j.value("gen_scales", 0));
  KVF_ASSIGN_OR_RETURN(c.ctx_layout, LayoutSpec::Parse(j["ctx_layout"].get<std::string>()));
  KVF_ASSIGN_OR_RETURN(c.gen_layout, LayoutSpec::Parse(j["gen_layout"].get<std::string>()));
  c.requests = j["requests"];
  c.prompt_tokens = j["prompt_tokens"].get<std::vector<int64_t>>();
  c.concurrency = j["concurrency"];
  c.transport = j["transport"];
  c.device = j["device"];
  c.layer_wise = j["layer_wise"];
  c.shared_prefix_blocks = j["shared_prefix_blocks"];
  c.crash_ctx_rank = j["crash_ctx_rank"];
  c.fault = j.value("fault", "");
  c.verify = j["verify"];
  c.baseline = j["baseline"];
  c.timeout = std::chrono::milliseconds(j["timeout_ms"].get<int64_t>());
  c.give_up = std::chrono::milliseconds(j.value("give_up_ms", int64_t{0}));
  c.dir = j["dir"];
  c.rendezvous = j.value("rendezvous", "");
  c.rendezvous_key = j.value("rendezvous_key", "");
  c.gpus = j.value("gpus", std::vector<int>{});
  c.checksum = j.value("checksum", true);
  c.warmup = j.value("warmup", 0);
  c.ctx_ahead = j.value("ctx_ahead", 0);
  c.metrics_port = j.value("metrics_port", -1);
  KVF_RETURN_IF_ERROR(ValidateSelftest(c));
  return c;
} catch (const json::exception& e) {
  return Status::InvalidArgument(fmt::format("malformed: {}", e.what()));
}

// A fresh directory from a mkdtemp template: mode 0700, a name nobody could have planted.
StatusOr<fs::path> MakePrivateDir(const fs::path& tmpl) {
  std::string name = tmpl.string();
  if (::mkdtemp(name.data()) == nullptr) {
    return Status::Unavailable(fmt::format("cannot make {}: {}", name, std::strerror(errno)));
  }
  return fs::path(name);
}

// A new file only this user can read (it holds the group key): 0600, never through a link.
Status WritePrivateFile(const std::string& path, const std::string& text) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) return Status::Unavailable(fmt::format("create {}: {}", path, std::strerror(errno)));
  size_t at = 0;
  while (at < text.size()) {
    const ssize_t n = ::write(fd, text.data() + at, text.size() - at);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = errno;
      ::close(fd);
      return Status::Unavailable(fmt::format("write {}: {}", path, std::strerror(err)));
    }
    at += static_cast<size_t>(n);
  }
  ::close(fd);
  return Status::Ok();
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
    // The reason reaches the summary through the result file (the parent may not see stderr).
    RankResult failed;
    failed.context = context;
    failed.rank = rank;
    failed.failed = 1;
    failed.errors.push_back(r.status().ToString());
    const std::string name = fmt::format("{}-{}.json", context ? "ctx" : "gen", rank);
    std::ofstream(fs::path(cfg.dir) / (name + ".tmp")) << ResultToJson(failed);
    std::error_code ec;
    fs::rename(fs::path(cfg.dir) / (name + ".tmp"), fs::path(cfg.dir) / name, ec);
    return 2;
  }
  return 0;
}

// The parent's patience, from the ranks' progress files (run_watch.h): every rank's last request
// that made progress, plus a rank's stall limit and kParentGrace. Files are read at most every 250
// ms.
class ProgressDeadline {
 public:
  ProgressDeadline(fs::path dir, const SelftestConfig& cfg)
      : dir_(std::move(dir)), limit_(StallLimit(cfg) + kParentGrace), last_change_(Clock::now()) {}
  Deadline Get() {
    auto now = Clock::now();
    if (now >= next_read_) {
      next_read_ = now + std::chrono::milliseconds(250);
      // Each file says "done total started progressed"; only the last is progress.
      std::string all;
      std::error_code ec;
      for (const auto& e : fs::directory_iterator(dir_, ec)) {
        if (e.path().filename().string().rfind("progress-", 0) != 0) continue;
        std::ifstream f(e.path());
        int64_t done = 0, total = 0, started = 0, progressed = 0;
        f >> done >> total >> started >> progressed;
        all += fmt::format("{}:{} ", e.path().filename().string(), progressed);
      }
      if (all != seen_) {
        seen_ = std::move(all);
        last_change_ = now;
      }
    }
    return last_change_ + limit_;
  }

 private:
  const fs::path dir_;
  const std::chrono::milliseconds limit_;
  Clock::time_point last_change_, next_read_{};
  std::string seen_;
};

// Why the ranks still running should stop (empty: they should not): a rank process died, or
// every rank of one instance has ended (the other has nobody left to serve or be served by).
// `nc` and `ng`: the context and generation ranks among `procs` (in that order); a role with no
// rank here (a `kvferry instance` of the other role) is never "all ended".
std::string WhyStop(const std::vector<RankGroup::Rank>& procs, int nc, int ng) {
  for (const RankGroup::Rank& r : procs) {
    if (r.ended && r.wait_status != 0)
      return fmt::format("{} (pid {}) ended: {}", r.label, r.pid, r.How());
  }
  if (procs.size() != static_cast<size_t>(nc + ng)) return {};  // one mpirun
  auto all_ended = [&](int from, int to) {
    for (int i = from; i < to; ++i) {
      if (!procs[i].ended) return false;
    }
    return from < to;
  };
  if (all_ended(0, nc)) return "every context rank has ended";
  if (all_ended(nc, nc + ng)) return "every generation rank has ended";
  return {};
}

// A rank number in [0, limit), all digits; nullopt otherwise.
std::optional<int> ParseRankNumber(std::string_view text, int limit) {
  if (text.empty() || text.size() > 9) return std::nullopt;
  int v = 0;
  for (char c : text) {
    if (c < '0' || c > '9') return std::nullopt;
    v = v * 10 + (c - '0');
  }
  if (v >= limit) return std::nullopt;
  return v;
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

namespace {

// Starts `ranks` (context ranks first) of `cfg`'s instances in processes of this host, waits for
// them and collects their results. The ranks meet the others (started here or elsewhere) through
// cfg.rendezvous.
StatusOr<std::vector<RankResult>> RunRanks(SelftestConfig cfg, const std::vector<RankId>& ranks,
                                           bool progress) {
  // The run's directory holds the group key (config.json): private to this user.
  std::error_code tmp_ec;
  const fs::path tmp = fs::temp_directory_path(tmp_ec);
  if (tmp_ec)
    return Status::Unavailable(fmt::format("no temporary directory: {}", tmp_ec.message()));
  KVF_ASSIGN_OR_RETURN(fs::path dir, MakePrivateDir(tmp / "kvferry-XXXXXX"));
  cfg.dir = dir.string();
  struct Cleanup {
    std::vector<fs::path> dirs;
    ~Cleanup() {
      std::error_code ec;
      for (const fs::path& d : dirs) fs::remove_all(d, ec);
    }
  } cleanup{{dir}};
  if (cfg.transport == "inproc") return RunInProcess(cfg);
  const int nc = static_cast<int>(
      std::count_if(ranks.begin(), ranks.end(), [](const RankId& r) { return r.context; }));
  const int ng = static_cast<int>(ranks.size()) - nc;
  std::error_code ec;
  const std::string exe = fs::canonical("/proc/self/exe", ec).string();
  if (ec) {
    return Status::Unavailable(fmt::format(
        "cannot start rank processes: /proc/self/exe: {} (was the kvferry binary replaced while "
        "it ran?)",
        ec.message()));
  }
  // The config travels in a file: mpirun mangles long JSON arguments.
  std::string conf = (dir / "config.json").string();
  KVF_RETURN_IF_ERROR(WritePrivateFile(conf, ConfigToJson(cfg)));
  // OpenMPI's shared-memory transport (vader) keeps one segment file per rank in /dev/shm, and
  // its session directory (PMIx's store) in TMPDIR; both are removed by MPI_Finalize and mpirun,
  // so a killed job left them behind (4 MiB a rank). They go in a directory of this run instead,
  // which the janitor removes however the run ends.
  fs::path mpi_shm;
  if (cfg.transport == "mpi") {
    const bool dev_shm = fs::is_directory("/dev/shm", tmp_ec);
    KVF_ASSIGN_OR_RETURN(
        mpi_shm, MakePrivateDir((dev_shm ? fs::path("/dev/shm") : dir) / "kvferry-mpi-XXXXXX"));
    if (dev_shm) cleanup.dirs.push_back(mpi_shm);
  }
  // Ranks, their process group and the directories: gone however this process ends.
  KVF_ASSIGN_OR_RETURN(std::unique_ptr<RankGroup> group, RankGroup::Create(cleanup.dirs));
  if (cfg.transport == "mpi") {
    KVF_RETURN_IF_ERROR(group->Spawn(
        "mpirun", {"mpirun", "--allow-run-as-root", "--oversubscribe", "-np",
                   std::to_string(nc + ng), "--mca", "btl", "self,vader,tcp", "--mca",
                   "orte_tmpdir_base", mpi_shm.string(), "--mca", "btl_vader_backing_directory",
                   mpi_shm.string(), exe, "--rank-of-cluster", "mpi", "--cluster-config", conf}));
  } else {
    for (const RankId& r : ranks) {
      KVF_RETURN_IF_ERROR(group->Spawn(
          fmt::format("{} rank {}", r.context ? "context" : "generation", r.rank),
          {exe, "--rank-of-cluster", fmt::format("{}:{}", r.context ? "ctx" : "gen", r.rank),
           "--cluster-config", conf}));
    }
  }
  auto start = Clock::now();
  std::function<void()> tick;
  if (progress) tick = [&] { PrintProgress(dir, cfg, start); };
  ProgressDeadline progress_deadline(dir, cfg);
  // Once a rank process has died, or every rank of one instance has ended, the others get one
  // request deadline plus a grace to end what they have in flight and write their results; then
  // the run is over (nothing waits for a request that can no longer be served).
  std::optional<Deadline> wind_down;
  auto deadline = [&] {
    if (!wind_down) {
      std::string why = WhyStop(group->ranks(), nc, ng);
      if (!why.empty()) {
        wind_down = DeadlineIn(cfg.timeout + kDeathGrace);
        // The others start nothing more and report (run_watch.h).
        const fs::path stop = RunWatch::StopFile(cfg);
        std::ofstream(stop.string() + ".tmp") << why << "\n";
        std::error_code ec;
        fs::rename(stop.string() + ".tmp", stop, ec);
      }
    }
    Deadline d = progress_deadline.Get();
    return wind_down ? std::min(*wind_down, d) : d;
  };
  // Ranks killed at the deadline say so in their result below (RankGroup::Rank::Describe).
  (void)group->Wait(deadline, tick);
  if (tick) tick();  // the final count, however short the run
  std::vector<RankResult> out;
  for (size_t i = 0; i < ranks.size(); ++i) {
    const auto [context, rank] = ranks[i];
    fs::path f =
        dir / (context ? fmt::format("ctx-{}.json", rank) : fmt::format("gen-{}.json", rank));
    std::ifstream in_file(f);
    if (!in_file) {
      // A rank that died or gave up still counts: its failure shows in the summary, beside what
      // the surviving ranks reported, with how its process ended.
      const auto& procs = group->ranks();
      const RankGroup::Rank& proc = procs[std::min(i, procs.size() - 1)];
      RankResult dead;
      dead.context = context;
      dead.rank = rank;
      dead.failed = 1;
      const bool own = procs.size() == ranks.size();
      dead.errors.push_back(fmt::format("no result (its process{}, pid {}: {})",
                                        own ? "" : " " + proc.label, proc.pid, proc.How()));
      out.push_back(std::move(dead));
      continue;
    }
    std::string text((std::istreambuf_iterator<char>(in_file)), std::istreambuf_iterator<char>());
    KVF_ASSIGN_OR_RETURN(RankResult res, ResultFromJson(text));
    out.push_back(std::move(res));
  }
  return out;
}

}  // namespace

StatusOr<std::vector<RankResult>> RunCluster(const SelftestConfig& in, bool progress) {
  SelftestConfig cfg = in;
  cfg.dir = "(set by RunRanks)";
  KVF_RETURN_IF_ERROR(ValidateSelftest(cfg));
  // The ranks meet through a rendezvous this process serves (loopback, a fresh group key), as
  // the instances of a deployment would through theirs.
  const RendezvousKey key = RandomKey();
  KVF_ASSIGN_OR_RETURN(std::unique_ptr<RendezvousServer> rendezvous,
                       RendezvousServer::Start("127.0.0.1", 0, key));
  cfg.rendezvous = rendezvous->address();
  cfg.rendezvous_key = RendezvousKeyHex(key);
  std::vector<RankId> ranks;
  for (int r = 0; r < cfg.ctx.world_size(); ++r) ranks.push_back({true, r});
  for (int r = 0; r < cfg.gen.world_size(); ++r) ranks.push_back({false, r});
  return RunRanks(cfg, ranks, progress);
}

StatusOr<std::vector<RankResult>> RunInstance(const SelftestConfig& in,
                                              const std::vector<RankId>& ranks, bool progress) {
  if (in.transport == "inproc" || in.transport == "mpi") {
    return Status::InvalidArgument(fmt::format(
        "transport {}: an instance of its own needs a transport between processes that meet "
        "through the rendezvous (ucx)",
        in.transport));
  }
  if (in.rendezvous.empty() || in.rendezvous_key.empty()) {
    return Status::InvalidArgument("an instance needs the rendezvous' address and group key");
  }
  if (ranks.empty()) return Status::InvalidArgument("an instance needs at least one rank here");
  SelftestConfig cfg = in;
  cfg.dir = "(set by RunRanks)";
  KVF_RETURN_IF_ERROR(ValidateSelftest(cfg));
  for (const RankId& r : ranks) {
    const int n = r.context ? cfg.ctx.world_size() : cfg.gen.world_size();
    if (r.rank < 0 || r.rank >= n) {
      return Status::InvalidArgument(fmt::format("{} rank {} outside [0, {})",
                                                 r.context ? "context" : "generation", r.rank, n));
    }
  }
  return RunRanks(cfg, ranks, progress);
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
  StatusOr<SelftestConfig> parsed = ConfigFromJson(text);
  if (!parsed.ok()) {
    std::cerr << fmt::format("kvferry: cluster config {}: {}\n", argv[4],
                             parsed.status().ToString());
    return 2;
  }
  const SelftestConfig& cfg = *parsed;
  const int nc = cfg.ctx.world_size(), ng = cfg.gen.world_size();
  const std::string who = argv[2];
  if (who == "mpi") {
    // OpenMPI tells each process its rank; context ranks come first.
    const char* r = std::getenv("OMPI_COMM_WORLD_RANK");
    if (!r) r = std::getenv("PMI_RANK");
    if (!r) {
      std::cerr << "kvferry: --rank-of-cluster mpi outside mpirun\n";
      return 2;
    }
    const std::optional<int> world = ParseRankNumber(r, nc + ng);
    if (!world) {
      std::cerr << fmt::format("kvferry: MPI rank '{}' is not in [0, {})\n", r, nc + ng);
      return 2;
    }
    return *world < nc ? RunRank(cfg, true, *world) : RunRank(cfg, false, *world - nc);
  }
  const bool context = who.starts_with("ctx:");
  const std::optional<int> rank = context || who.starts_with("gen:")
                                      ? ParseRankNumber(who.substr(4), context ? nc : ng)
                                      : std::nullopt;
  if (!rank) {
    std::cerr << fmt::format(
        "kvferry: --rank-of-cluster '{}': expected mpi, ctx:N (N < {}) or gen:N (N < {})\n", who,
        nc, ng);
    return 2;
  }
  return RunRank(cfg, context, *rank);
}

}  // namespace kvferry::tools
