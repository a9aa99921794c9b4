// `kvferry bench tiering`: a trace-driven run of the BlockManager. Conversations share a system
// prompt; each turn's prompt is the whole conversation so far plus new user tokens, and the
// answer is appended block by block, as a decoding engine would. The working set is larger than
// the primary and host tiers together, so blocks cycle through host and file. Measured per mode:
// hit rates per tier, bytes moved per tier, and the engine-visible stall of every call that
// allocates (AddSequence, AppendTokens) at p50/p99/max (wall and the calling thread's CPU time),
// beside the same trace with tiering disabled (primary only) and with on-demand tiering (no
// watermarks), all in the same run. The engine calls Poll once per simulated forward pass (its
// scheduler thread is idle then); Poll and RemoveSequence, where the watermarks run, are reported
// apart as upkeep.
#include <fmt/format.h>
#include <sched.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "kvferry/block_manager.h"
#include "kvferry/config.h"
#include "kvferry/slab_store.h"
#include "testing/bench_support.h"
#include "testing/testdata.h"
#include "tools/kvferry/commands.h"
#include "tools/kvferry/output.h"

namespace kvferry::tools {
namespace {

using namespace std::chrono_literals;

struct TieringBenchOptions {
  std::string device;
  int32_t layers = 32, kv_heads = 8, head_dim = 128, tokens_per_block = 16;
  int64_t primary_blocks = 256, host_blocks = 512, file_slots = 2048;
  int32_t conversations = 32, turns = 6;
  int32_t system_tokens = 512, user_tokens = 128, answer_tokens = 64;
  int64_t step_us = 1000;  // simulated forward pass per request
  std::string dir;
  std::string file_backend = "posix";
  // Pinned staging of the file tier in the tiered modes: deep enough for one request's burst of
  // demotions (the knob's default, 32, is run beside it: host victims then drop before their
  // demotion, and the file tier barely fills).
  int64_t file_staging_blocks = 128;
  uint64_t seed = 1;
  bool verify = false;
  // The engine's thread (the one calling the BlockManager) pinned to this CPU while it runs the
  // trace (the managers' threads are not); -1: not pinned. Separates the manager's own cost from
  // the scheduler's (on a VM, a p99 of tens of us can be a preemption).
  int32_t pin_cpu = -1;
  OutputFlags out;
};

struct Mode {
  std::string name;
  bool host = true, file = true;
  bool watermarks = true;
  bool knob_staging = false;  // tiering.file_staging_blocks instead of --file-staging-blocks
};

struct Result {
  Mode mode;
  BlockManagerStats st;
  int64_t prompt_tokens = 0, reused_tokens = 0, requests = 0, verified_blocks = 0;
  int64_t prompt_blocks = 0;  // full prompt blocks: the denominator of the hit rates
  std::vector<double> stall_us, ready_us;
  std::vector<double> add_us, append_us;  // stall_us by call: AddSequence, AppendTokens
  std::vector<double> stall_cpu_us;       // the caller thread's CPU time in those calls
  std::vector<double> upkeep_us;          // Poll (during the forward pass) and RemoveSequence
  std::vector<double> submit_us;          // of stall_us: handing batches to the TransferManager
  int64_t events = 0;
  double seconds = 0;
  std::string file_backend;
  int64_t file_staging_blocks = 0;
};

double Pct(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * (v.size() - 1) + 0.5))];
}

// sum(part) / sum(whole): the share of the callers' time that `part` was.
double Share(const std::vector<double>& part, const std::vector<double>& whole) {
  double p = 0, w = 0;
  for (double x : part) p += x;
  for (double x : whole) w += x;
  return w > 0 ? p / w : 0;
}

// One (conversation, turn) of the trace, in the order the engine sees them.
std::vector<std::pair<int32_t, int32_t>> Trace(const TieringBenchOptions& o) {
  std::vector<std::pair<int32_t, int32_t>> out;
  std::vector<int32_t> next(o.conversations, 0);
  std::vector<int32_t> live(o.conversations);
  for (int32_t c = 0; c < o.conversations; ++c) live[c] = c;
  std::mt19937_64 rng(o.seed);
  while (!live.empty()) {
    const size_t k = rng() % live.size();
    const int32_t c = live[k];
    out.emplace_back(c, next[c]++);
    if (next[c] == o.turns) live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
  }
  return out;
}

double ThreadCpuUs() {
  timespec ts{};
  ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e6 + static_cast<double>(ts.tv_nsec) / 1e3;
}

// Times one engine-visible call: wall time (what the engine waits) and the calling thread's CPU
// time (the work done on it; the difference is time the thread was not running).
class CallTimer {
 public:
  explicit CallTimer(std::vector<double>& wall, std::vector<double>* cpu = nullptr)
      : wall_(wall), cpu_(cpu), t0_(Clock::now()), c0_(ThreadCpuUs()) {}
  ~CallTimer() {
    const double cpu = ThreadCpuUs() - c0_;
    wall_.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0_).count());
    if (cpu_ != nullptr) cpu_->push_back(cpu);
  }

 private:
  std::vector<double>& wall_;
  std::vector<double>* const cpu_;
  const Clock::time_point t0_;
  const double c0_;
};

int32_t UserToken(int32_t c, int32_t t, int32_t i) { return 1000000 + c * 100000 + t * 1000 + i; }
int32_t AnswerToken(int32_t c, int32_t t, int32_t i) {
  return 50000000 + c * 100000 + t * 1000 + i;
}

// Pins the calling thread to one CPU for its scope (no-op for cpu < 0) and restores its mask
// after. Taken once the managers exist: threads they start inherit their creator's mask, and must
// not share the engine's CPU.
class PinScope {
 public:
  static StatusOr<std::unique_ptr<PinScope>> Pin(int32_t cpu) {
    auto p = std::unique_ptr<PinScope>(new PinScope);
    if (cpu < 0) return p;
    if (::sched_getaffinity(0, sizeof(p->saved_), &p->saved_) != 0) {
      return Status::Internal(fmt::format("sched_getaffinity: {}", std::strerror(errno)));
    }
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    if (::sched_setaffinity(0, sizeof(set), &set) != 0) {
      return Status::InvalidArgument(
          fmt::format("--pin-cpu {}: sched_setaffinity: {}", cpu, std::strerror(errno)));
    }
    p->pinned_ = true;
    return p;
  }
  ~PinScope() {
    if (pinned_) (void)::sched_setaffinity(0, sizeof(saved_), &saved_);
  }

 private:
  PinScope() { CPU_ZERO(&saved_); }
  cpu_set_t saved_;
  bool pinned_ = false;
};

StatusOr<Result> RunMode(Device& dev, const TieringBenchOptions& o, const Mode& mode) {
  PoolSpec spec;
  spec.shape = KvShape{o.layers, o.kv_heads, o.head_dim, DType::kBf16, 2, o.tokens_per_block};
  spec.layout = LayoutKind::kBlockMajor;
  spec.memory = MemoryKind::kDevice;
  spec.blocks = o.primary_blocks;
  KVF_ASSIGN_OR_RETURN(BlockPool primary, BlockPool::Create(dev, spec));
  std::optional<BlockPool> host;
  if (mode.host) {
    spec.memory = MemoryKind::kPinnedHost;
    spec.blocks = o.host_blocks;
    KVF_ASSIGN_OR_RETURN(host, BlockPool::Create(dev, spec));
  }
  const int64_t bb = primary.layout().block_bytes();
  std::unique_ptr<SlabStore> store;
  if (mode.file) {
    if (o.file_backend == "memory") {
      store = NewMemorySlabStore(bb, o.file_slots);
    } else {
      SlabStoreOptions so = SlabStoreOptionsFromConfig();
      so.dir = o.dir;
      so.slot_payload_bytes = bb;
      so.max_slots = o.file_slots;
      so.backend = o.file_backend;
      so.recover = "none";  // every mode starts from an empty file tier
      KVF_ASSIGN_OR_RETURN(store, SlabStore::Open(so));
    }
  }
  TransferOptions topt = TransferOptions::FromConfig();
  if (!mode.knob_staging) topt.file_staging_blocks = o.file_staging_blocks;
  KVF_ASSIGN_OR_RETURN(
      auto tm, TransferManager::Create(dev, primary, host ? &*host : nullptr, store.get(), topt));
  BlockManagerOptions bo = BlockManagerOptions::FromConfig();
  bo.identity.model_id = "bench-tiering";
  bo.identity.shape = spec.shape;
  if (!mode.watermarks) bo.free_low_pct = bo.free_high_pct = 0;
  KVF_ASSIGN_OR_RETURN(auto bm, BlockManager::Create(*tm, bo));
  KVF_ASSIGN_OR_RETURN(std::unique_ptr<PinScope> pinned, PinScope::Pin(o.pin_cpu));

  Result res;
  res.mode = mode;
  res.file_staging_blocks = tm->file_staging_blocks();
  if (store) res.file_backend = store->backend().name;
  const int32_t tpb = o.tokens_per_block;
  std::vector<std::vector<int32_t>> history(o.conversations);
  for (auto& h : history) {
    for (int32_t i = 0; i < o.system_tokens; ++i) h.push_back(i + 1);
  }
  // Which request's KV each token position holds: the system prompt is everyone's (0).
  auto request_of = [&](int32_t c, int64_t block) -> uint64_t {
    return block * tpb < o.system_tokens ? 0 : static_cast<uint64_t>(c + 1);
  };
  uint64_t id = 1;
  const auto t_start = Clock::now();
  for (const auto& [c, t] : Trace(o)) {
    std::vector<int32_t>& h = history[c];
    for (int32_t i = 0; i < o.user_tokens; ++i) h.push_back(UserToken(c, t, i));
    StatusOr<Admission> admitted = Status::Internal("not run");
    int64_t submitted = bm->stats().submit_ns;
    {
      CallTimer timer(res.stall_us, &res.stall_cpu_us);
      admitted = bm->AddSequence(id, h);
    }
    res.add_us.push_back(res.stall_us.back());
    res.submit_us.push_back(static_cast<double>(bm->stats().submit_ns - submitted) / 1e3);
    KVF_ASSIGN_OR_RETURN(Admission a, std::move(admitted));
    auto t0 = Clock::now();
    KVF_ASSIGN_OR_RETURN(Readiness r, bm->WaitReady(id, DeadlineIn(60s)));
    res.ready_us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    if (!r.ready) return Status::DeadlineExceeded("bench tiering: onboards pending after 60 s");
    res.prompt_tokens += static_cast<int64_t>(h.size());
    res.prompt_blocks += static_cast<int64_t>(h.size()) / tpb;
    res.reused_tokens += r.reused_tokens;
    if (o.verify) {  // CPU device: the engine's side, outside the timed calls
      KVF_RETURN_IF_ERROR(tm->WaitSubmitted(DeadlineIn(60s)));
      KVF_RETURN_IF_ERROR(tm->offload_stream().Synchronize(DeadlineIn(60s)));
      KVF_RETURN_IF_ERROR(tm->onboard_stream().Synchronize(DeadlineIn(60s)));
      for (size_t i = 0; i < a.blocks.size(); ++i) {
        const int64_t first = static_cast<int64_t>(i) * tpb;
        BlockTokens where{a.blocks[i], first, tpb};
        if (first + tpb <= r.reused_tokens) {
          KVF_ASSIGN_OR_RETURN(auto bad, CheckBlock(primary, request_of(c, i), where));
          if (bad) {
            return Status::DataLoss(fmt::format(
                "bench tiering: conversation {} turn {} block {}: {}", c, t, i, bad->ToString()));
          }
          ++res.verified_blocks;
        } else {
          KVF_RETURN_IF_ERROR(FillBlock(primary, request_of(c, i), where));
        }
      }
    }
    // The forward pass: the engine's scheduler thread is idle and keeps the tiers moving.
    const auto step_end = Clock::now() + std::chrono::microseconds(o.step_us);
    {
      CallTimer timer(res.upkeep_us);
      bm->Poll();
    }
    std::this_thread::sleep_until(step_end);
    // Decoding: the answer, one block of tokens per step.
    for (int32_t done = 0; done < o.answer_tokens; done += tpb) {
      std::vector<int32_t> chunk;
      for (int32_t i = done; i < std::min(o.answer_tokens, done + tpb); ++i) {
        chunk.push_back(AnswerToken(c, t, i));
      }
      Status appended;
      submitted = bm->stats().submit_ns;
      {
        CallTimer timer(res.stall_us, &res.stall_cpu_us);
        appended = bm->AppendTokens(id, chunk);
      }
      res.append_us.push_back(res.stall_us.back());
      res.submit_us.push_back(static_cast<double>(bm->stats().submit_ns - submitted) / 1e3);
      KVF_RETURN_IF_ERROR(appended);
      h.insert(h.end(), chunk.begin(), chunk.end());
      if (o.verify) {
        KVF_ASSIGN_OR_RETURN(auto blocks, bm->Blocks(id));
        KVF_RETURN_IF_ERROR(tm->WaitSubmitted(DeadlineIn(60s)));
        KVF_RETURN_IF_ERROR(tm->offload_stream().Synchronize(DeadlineIn(60s)));
        const int64_t first = static_cast<int64_t>(h.size() - chunk.size());
        for (int64_t p = first; p < static_cast<int64_t>(h.size());) {
          const int64_t b = p / tpb, n = std::min<int64_t>(tpb - p % tpb, h.size() - p);
          KVF_RETURN_IF_ERROR(FillBlock(primary, request_of(c, b), BlockTokens{blocks[b], p, n}));
          p += n;
        }
      }
    }
    Status removed;
    {
      CallTimer timer(res.upkeep_us);
      removed = bm->RemoveSequence(id++);
    }
    KVF_RETURN_IF_ERROR(removed);
    res.events += static_cast<int64_t>(bm->DrainEvents().size());  // a router's drain, untimed
    ++res.requests;
  }
  res.seconds = std::chrono::duration<double>(Clock::now() - t_start).count();
  KVF_RETURN_IF_ERROR(tm->Drain(DeadlineIn(60s)));
  bm->Poll();
  res.st = bm->stats();
  return res;
}

nlohmann::json ToJson(const Result& r, int64_t bb, const std::string& device) {
  const double looked = std::max<int64_t>(r.prompt_blocks, 1);
  return {{"mode", r.mode.name},
          {"device", device},
          {"requests", r.requests},
          {"prompt_blocks", r.prompt_blocks},
          {"hits", {r.st.hits[0], r.st.hits[1], r.st.hits[2]}},
          {"hit_rate", {r.st.hits[0] / looked, r.st.hits[1] / looked, r.st.hits[2] / looked}},
          {"reused_fraction", r.prompt_tokens ? double(r.reused_tokens) / r.prompt_tokens : 0.0},
          {"bytes_to_host", r.st.offloaded * bb},
          {"bytes_to_file", r.st.demoted * bb},
          {"bytes_from_host", r.st.hits[1] * bb},
          {"bytes_from_file", r.st.hits[2] * bb},
          {"dropped", {r.st.dropped[0], r.st.dropped[1], r.st.dropped[2]}},
          {"stall_us_p50", Pct(r.stall_us, 0.50)},
          {"stall_us_p90", Pct(r.stall_us, 0.90)},
          {"stall_us_p99", Pct(r.stall_us, 0.99)},
          {"stall_us_p999", Pct(r.stall_us, 0.999)},
          {"add_sequence_us_p50", Pct(r.add_us, 0.50)},
          {"add_sequence_us_p99", Pct(r.add_us, 0.99)},
          {"append_tokens_us_p99", Pct(r.append_us, 0.99)},
          {"stall_calls", r.stall_us.size()},
          {"stall_us_max", Pct(r.stall_us, 1.0)},
          {"stall_cpu_us_p50", Pct(r.stall_cpu_us, 0.50)},
          {"stall_cpu_us_p99", Pct(r.stall_cpu_us, 0.99)},
          {"stall_cpu_us_max", Pct(r.stall_cpu_us, 1.0)},
          {"submit_us_p50", Pct(r.submit_us, 0.50)},
          {"submit_us_p99", Pct(r.submit_us, 0.99)},
          {"submit_share", Share(r.submit_us, r.stall_us)},
          {"upkeep_us_p50", Pct(r.upkeep_us, 0.50)},
          {"upkeep_us_p99", Pct(r.upkeep_us, 0.99)},
          {"events", r.events},
          {"ready_wait_us_p50", Pct(r.ready_us, 0.50)},
          {"ready_wait_us_p99", Pct(r.ready_us, 0.99)},
          {"background_evictions", r.st.background_evictions},
          {"inline_evictions", r.st.inline_evictions},
          {"abandoned", r.st.abandoned},
          {"verified_blocks", r.verified_blocks},
          {"file_backend", r.file_backend},
          {"file_staging_blocks", r.file_staging_blocks},
          {"seconds", r.seconds}};
}

int RunBenchTiering(const TieringBenchOptions& o) {
  const std::string device =
      o.device.empty() ? Config::Global().String("device.default") : o.device;
  auto dev = OpenDevice(device);
  if (!dev.ok()) {
    fmt::print(stderr, "bench tiering: {}\n", dev.status().ToString());
    return 2;
  }
  if (o.file_backend != "memory") {
    struct stat sb;
    if (o.dir.empty() || ::stat(o.dir.c_str(), &sb) != 0 || !S_ISDIR(sb.st_mode)) {
      fmt::print(stderr,
                 "bench tiering: --dir '{}' must be an existing directory for the file tier (or "
                 "--file-backend memory)\n",
                 o.dir);
      return 2;
    }
  }
  if (o.verify && (*dev)->info().platform != "cpu") {
    fmt::print(stderr,
               "bench tiering: --verify needs --device cpu (it fills blocks from the host)\n");
    return 2;
  }
  if (auto probe = PinScope::Pin(o.pin_cpu); !probe.ok()) {  // refused before any mode runs
    fmt::print(stderr, "bench tiering: {}\n", probe.status().ToString());
    return 2;
  }
  const std::vector<Mode> modes = {{"tiered", true, true, true},
                                   {"tiered-on-demand", true, true, false},
                                   {"tiered-knob-staging", true, true, true, true},
                                   {"primary-only", false, false, false}};
  std::vector<Result> results;
  for (const Mode& m : modes) {
    auto r = RunMode(**dev, o, m);
    if (!r.ok()) {
      fmt::print(stderr, "bench tiering: {}: {}\n", m.name, r.status().ToString());
      return 1;
    }
    results.push_back(std::move(r).value());
    if (!o.dir.empty()) {  // the store is closed: remove its files
      std::error_code ec;
      for (const auto& e : std::filesystem::directory_iterator(o.dir, ec)) {
        if (e.path().filename().string().rfind("kvferry-slab", 0) == 0) {
          std::filesystem::remove(e.path(), ec);
        }
      }
    }
  }
  const int64_t bb = int64_t{o.layers} * 2 * o.kv_heads * o.head_dim * 2 * o.tokens_per_block;
  if (o.out.machine()) {
    Document doc("bench tiering");
    doc.config() = {{"device", (*dev)->info().name},
                    {"shape", ShapeJson(KvShape{o.layers, o.kv_heads, o.head_dim, DType::kBf16, 2,
                                                o.tokens_per_block})},
                    {"layout", "block-major"},
                    {"primary_blocks", o.primary_blocks},
                    {"host_blocks", o.host_blocks},
                    {"file_slots", o.file_slots},
                    {"file_backend", o.file_backend},
                    {"file_staging_blocks", o.file_staging_blocks},
                    {"conversations", o.conversations},
                    {"turns", o.turns},
                    {"system_tokens", o.system_tokens},
                    {"user_tokens", o.user_tokens},
                    {"answer_tokens", o.answer_tokens},
                    {"step_us", o.step_us},
                    {"seed", o.seed},
                    {"pin_cpu", o.pin_cpu},
                    {"verify", o.verify}};
    for (const Result& r : results) doc.AddRow(ToJson(r, bb, (*dev)->info().name));
    doc.Print(o.out.format());
    return 0;
  }
  const int64_t distinct =
      (o.system_tokens + int64_t{o.conversations} * o.turns * (o.user_tokens + o.answer_tokens)) /
      o.tokens_per_block;
  fmt::print(
      "kvferry bench tiering: device {} ({}), {} conversations x {} turns, blocks of {} KiB; "
      "working set ~{} blocks vs primary {} + host {} (+ file {}, {})\n",
      device, (*dev)->info().name, o.conversations, o.turns, bb >> 10, distinct, o.primary_blocks,
      o.host_blocks, o.file_slots, o.file_backend);
  fmt::print(
      "stall = wall time of each AddSequence/AppendTokens call (cpu: the calling thread's CPU time "
      "in it); ready wait = WaitReady; upkeep = Poll (once per forward pass) and RemoveSequence, "
      "where the watermarks run; submit99 = p99 of the part of each stall spent handing batches "
      "to the TransferManager\n");
  fmt::print(
      "hit rates: prompt blocks found per tier / all full prompt blocks; dropped: blocks that "
      "left the cache (host: no free block or disk bandwidth in time); file staging {} blocks "
      "(tiered-knob-staging: the tiering.file_staging_blocks knob, {})\n",
      o.file_staging_blocks, Config::Global().Int("tiering.file_staging_blocks"));
  fmt::print(
      "{:<18} {:>7} {:>7} {:>7} {:>7} {:>7} {:>7} {:>7} {:>7} {:>13} {:>9} {:>9} {:>9} {:>9} {:>9} "
      "{:>9} {:>9}\n",
      "mode", "hit P", "hit H", "hit F", "reused", "GB->H", "GB->F", "GB<-H", "GB<-F", "dropped",
      "stall p50", "p99 us", "max us", "cpu p99", "ready p99", "upkeep99", "submit99");
  for (const Result& r : results) {
    const nlohmann::json j = ToJson(r, bb, "");
    fmt::print(
        "{:<18} {:>7.3f} {:>7.3f} {:>7.3f} {:>7.3f} {:>7.2f} {:>7.2f} {:>7.2f} {:>7.2f} {:>13} "
        "{:>9.1f} {:>9.1f} {:>9.1f} {:>9.1f} {:>9.1f} {:>9.1f} {:>9.1f}\n",
        r.mode.name, j["hit_rate"][0].get<double>(), j["hit_rate"][1].get<double>(),
        j["hit_rate"][2].get<double>(), j["reused_fraction"].get<double>(),
        j["bytes_to_host"].get<int64_t>() / 1e9, j["bytes_to_file"].get<int64_t>() / 1e9,
        j["bytes_from_host"].get<int64_t>() / 1e9, j["bytes_from_file"].get<int64_t>() / 1e9,
        fmt::format("{}/{}/{}", r.st.dropped[0], r.st.dropped[1], r.st.dropped[2]),
        Pct(r.stall_us, 0.5), Pct(r.stall_us, 0.99), Pct(r.stall_us, 1.0),
        Pct(r.stall_cpu_us, 0.99), Pct(r.ready_us, 0.99), Pct(r.upkeep_us, 0.99),
        Pct(r.submit_us, 0.99));
  }
  fmt::print("stall distribution (us, {} calls per mode; engine thread {}):\n",
             results.empty() ? 0 : results[0].stall_us.size(),
             o.pin_cpu >= 0 ? fmt::format("pinned to cpu {}", o.pin_cpu) : "not pinned");
  fmt::print("{:<18} {:>8} {:>8} {:>8} {:>8} {:>8} {:>10} {:>10} {:>10}\n", "mode", "p50", "p90",
             "p99", "p99.9", "max", "add p50", "add p99", "append p99");
  for (const Result& r : results) {
    fmt::print(
        "{:<18} {:>8.1f} {:>8.1f} {:>8.1f} {:>8.1f} {:>8.1f} {:>10.1f} {:>10.1f} {:>10.1f}\n",
        r.mode.name, Pct(r.stall_us, 0.5), Pct(r.stall_us, 0.9), Pct(r.stall_us, 0.99),
        Pct(r.stall_us, 0.999), Pct(r.stall_us, 1.0), Pct(r.add_us, 0.5), Pct(r.add_us, 0.99),
        Pct(r.append_us, 0.99));
  }
  return 0;
}

}  // namespace

void AddBenchTieringCommand(CLI::App& bench) {
  auto* cmd = bench.add_subcommand(
      "tiering", "trace-driven block manager run: hit rates, bytes per tier, allocation stall");
  auto o = std::make_shared<TieringBenchOptions>();
  cmd->add_option("--device", o->device, "cpu | cuda | cuda:N (default: the device.default knob)");
  cmd->add_option("--layers", o->layers, "KV shape: layers")->check(CLI::Range(1, 1024));
  cmd->add_option("--kv-heads", o->kv_heads, "KV shape: KV heads")->check(CLI::Range(1, 1024));
  cmd->add_option("--head-dim", o->head_dim, "KV shape: head dim")->check(CLI::Range(1, 4096));
  cmd->add_option("--tokens-per-block", o->tokens_per_block, "KV shape: tokens per block")
      ->check(CLI::Range(1, 4096));
  cmd->add_option("--primary-blocks", o->primary_blocks, "primary (device) pool blocks")
      ->check(CLI::Range(int64_t{4}, int64_t{1} << 24));
  cmd->add_option("--host-blocks", o->host_blocks, "host tier blocks")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 24));
  cmd->add_option("--file-slots", o->file_slots, "file tier slots")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 24));
  cmd->add_option("--conversations", o->conversations, "conversations in the trace")
      ->check(CLI::Range(1, 100000));
  cmd->add_option("--turns", o->turns, "turns per conversation")->check(CLI::Range(1, 1000));
  cmd->add_option("--system-tokens", o->system_tokens, "shared system prompt tokens")
      ->check(CLI::Range(0, 1 << 20));
  cmd->add_option("--user-tokens", o->user_tokens, "new prompt tokens per turn")
      ->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--answer-tokens", o->answer_tokens, "generated tokens per turn")
      ->check(CLI::Range(0, 1 << 20));
  cmd->add_option("--step-us", o->step_us, "simulated forward pass per request, microseconds")
      ->check(CLI::Range(int64_t{0}, int64_t{10000000}));
  cmd->add_option("--dir", o->dir, "directory of the file tier (slab files removed at the end)");
  cmd->add_option("--file-backend", o->file_backend, "posix | io_uring | memory")
      ->check(CLI::IsMember({"posix", "io_uring", "memory"}));
  cmd->add_option("--file-staging-blocks", o->file_staging_blocks,
                  "pinned file staging of the tiered modes, in blocks (tiered-knob-staging: the "
                  "tiering.file_staging_blocks knob)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  cmd->add_option("--seed", o->seed, "trace order seed");
  cmd->add_flag("--verify", o->verify, "check every reused block byte for byte (cpu device)");
  cmd->add_option("--pin-cpu", o->pin_cpu,
                  "pin the engine's thread (the one calling the block manager) to this CPU; -1: "
                  "not pinned")
      ->check(CLI::Range(-1, CPU_SETSIZE - 1));
  AddOutputFlags(cmd, o->out);
  cmd->callback([o] { std::exit(RunBenchTiering(*o)); });
}

}  // namespace kvferry::tools
