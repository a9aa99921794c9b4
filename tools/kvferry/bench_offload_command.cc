// `kvferry bench offload`: GB/s of the tiered KV cache's copies (offload, onboard, both at once,
// partial, file tier) on model-shaped pools, each beside a baseline measured in the same run:
// one Stream::Copy of one contiguous buffer of the same bytes between the same memory kinds
// (= memcpy on the CPU device, cudaMemcpyAsync on CUDA), and for file backends raw O_DIRECT I/O
// on the same directory.
#include <fmt/format.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <random>
#include <set>

#include "kvferry/config.h"
#include "kvferry/slab_store.h"
#include "kvferry/tiering.h"
#include "testing/bench_support.h"
#include "testing/host_mirror.h"
#include "testing/raw_io_bench.h"
#include "testing/testdata.h"
#include "tools/kvferry/commands.h"
#include "tools/kvferry/output.h"

namespace kvferry::tools {
namespace {

using namespace std::chrono_literals;

struct OffloadBenchOptions {
  std::string device;
  std::string tier = "host";
  std::string dir;
  std::string model = "all";
  std::string layout = "all";
  // Layout of the host tier: "same" as the primary pool (default), or "block-major" (packed
  // blocks, one contiguous range each; with tiering.device_staging, whole-block copies of
  // per-layer pools then go gather -> staging -> one copy per block).
  std::string host_layout = "packed";
  bool verify = false;
  OutputFlags out;
  bool contiguous = false;
  int iters = 5;
  int64_t total_bytes = 128 << 20;
  // File tiers measured with --tier file; "memory" = the in-memory stand-in (no file).
  std::vector<std::string> file_backends = {"posix", "io_uring", "cufile"};
};

struct Row {
  std::string name;
  int64_t bytes = 0;
  double seconds = 0;
  std::string baseline;
  double baseline_seconds = 0;
  std::string verified = "no";  // "yes", "no" (not asked), "FAILED: ..."
  int64_t descriptors = 0;
  int64_t block_bytes = 0;
  int64_t blocks = 0;
  // The same fragments copied by a plain memcpy loop on this thread (host memory only): what
  // the layout itself costs, apart from the manager. 0 when not measured.
  double pattern_seconds = 0;
  // Median over iterations of baseline seconds / case seconds, each pair timed back to back: load
  // from other processes that comes and goes between iterations cancels out (on a shared
  // machine the ratio of the two medians can be off by 0.2-0.3 either way).
  double paired_ratio = 0;
  // File tier rows: the backend the store runs (caps.name) and its note (fallback reason etc.).
  std::string file_backend{};
  std::string file_note{};
  // The host tier's pool layout as created, and whether primary <-> host copies were staged.
  std::string host_pool{};
  bool staged = false;
};

double Gbps(int64_t bytes, double s) { return s > 0 ? bytes / s / 1e9 : 0; }

// The file tier to measure: `backend` ("posix", "io_uring", "cufile") through SlabStore::Open on
// `dir`, or "memory" (MemorySlabStore, no file at all). One at a time: a SlabStore locks its
// directory.
StatusOr<std::unique_ptr<SlabStore>> OpenFileTier(const std::string& backend,
                                                  const std::string& dir, int64_t block_bytes,
                                                  int64_t blocks) {
  if (backend == "memory") {
    return NewMemorySlabStore(block_bytes, blocks);
  }
  SlabStoreOptions so = SlabStoreOptionsFromConfig();
  so.dir = dir;
  so.slot_payload_bytes = block_bytes;
  so.max_slots = blocks;
  so.backend = backend;
  so.recover = "none";  // each backend starts from an empty tier (they share the directory)
  return SlabStore::Open(so);
}

struct Workload {
  std::string name;
  int32_t layers;
  int32_t tokens_per_block;
  LayoutKind layout;
};

// Names of the SlabStore's files (kvferry-slab*) in `dir`; empty when `dir` is empty.
std::set<std::string> SlabFiles(const std::string& dir) {
  std::set<std::string> out;
  if (dir.empty()) return out;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    std::string name = e.path().filename().string();
    if (name.rfind("kvferry-slab", 0) == 0) out.insert(name);
  }
  return out;
}

using Fn = std::function<Status()>;
using SecFn = std::function<StatusOr<double>()>;  // does the work, returns its own seconds

// One workload's pools, manager, block ids and test data. Heap-allocated and never moved: the
// tier views point into the pools.
struct Setup {
  int64_t bb = 0;     // block bytes
  int64_t n = 0;      // blocks per batch
  int64_t bytes = 0;  // n * bb
  int32_t tpb = 0;
  std::string prefix;
  std::optional<BlockPool> primary, host;
  TransferOptions topt;
  std::unique_ptr<TransferManager> tm;
  // A, B, C: disjoint primary sets; X, Y: host sets.
  std::vector<int64_t> A, B, C, X, Y;
  std::unique_ptr<Stream> io;
  std::optional<BlockPool> mirror;  // host copy of the primary pool (test data, checks)
};

class Bench {
 public:
  Bench(Device& dev, const OffloadBenchOptions& o) : dev_(dev), o_(o) {}

  // Named steps: pools and ids, test data, baseline buffers, the host-tier cases, the file tiers.
  Status Run(const Workload& w, std::vector<Row>& rows) {
    KVF_ASSIGN_OR_RETURN(std::unique_ptr<Setup> s, SetUp(w));
    KVF_RETURN_IF_ERROR(FillTestData(*s));
    KVF_RETURN_IF_ERROR(MakeBaselineBuffers(s->bytes));
    KVF_RETURN_IF_ERROR(HostCases(*s, rows));
    if (o_.tier != "file") return Status::Ok();
    return FileCases(*s, rows);
  }

 private:
  StatusOr<std::unique_ptr<Setup>> SetUp(const Workload& w) {
    auto s = std::make_unique<Setup>();
    PoolSpec spec;
    spec.shape = KvShape{w.layers, 8, 128, DType::kBf16, 2, w.tokens_per_block};
    spec.layout = w.layout;
    spec.memory = MemoryKind::kDevice;
    s->bb = static_cast<int64_t>(w.layers) * 2 * 8 * 128 * 2 * w.tokens_per_block;
    s->n = std::max<int64_t>(1, o_.total_bytes / s->bb);
    s->bytes = s->n * s->bb;
    s->tpb = w.tokens_per_block;
    s->prefix = w.name;
    const int64_t n = s->n;
    spec.blocks = 3 * n;
    KVF_ASSIGN_OR_RETURN(s->primary, BlockPool::Create(dev_, spec));
    spec.memory = MemoryKind::kPinnedHost;
    spec.blocks = 2 * n;
    if (o_.host_layout == "packed") {  // what CreatePackedHostPool makes for this primary
      KVF_ASSIGN_OR_RETURN(spec.layout, PackedHostLayout(*s->primary));
    }
    if (o_.host_layout == "block-major") spec.layout = LayoutKind::kBlockMajor;
    if (o_.host_layout == "block-major-nhd") spec.layout = LayoutKind::kBlockMajorNhd;
    KVF_ASSIGN_OR_RETURN(s->host, BlockPool::Create(dev_, spec));
    s->topt = TransferOptions::FromConfig();
    s->topt.file_staging_blocks = std::min<int64_t>(n, std::max<int64_t>(1, (256 << 20) / s->bb));
    KVF_ASSIGN_OR_RETURN(s->tm,
                         TransferManager::Create(dev_, *s->primary, &*s->host, nullptr, s->topt));
    // Shuffled unless --contiguous, so neighbours do not coalesce (eviction victims are rarely
    // neighbours).
    std::mt19937_64 rng(42);
    auto ids = [&](int64_t first) {
      std::vector<int64_t> v(n);
      std::iota(v.begin(), v.end(), first);
      if (!o_.contiguous) std::shuffle(v.begin(), v.end(), rng);
      return v;
    };
    s->A = ids(0);
    s->B = ids(n);
    s->C = ids(2 * n);
    s->X = ids(0);
    s->Y = ids(n);
    KVF_ASSIGN_OR_RETURN(s->io, dev_.CreateStream());
    return s;
  }

  // Test data goes through a host mirror of the primary pool: on a GPU, host threads can't touch
  // the primary pool. Without --verify every page is touched once.
  Status FillTestData(Setup& s) {
    BlockPool& primary = *s.primary;
    if (o_.verify) {
      KVF_ASSIGN_OR_RETURN(s.mirror, tiering::MakeHostMirror(dev_, primary));
      for (int64_t i = 0; i < s.n; ++i) {
        KVF_RETURN_IF_ERROR(FillBlock(*s.mirror, 1000 + i, BlockTokens{s.A[i], 0, s.tpb}));
        KVF_RETURN_IF_ERROR(FillBlock(*s.mirror, 5000 + i, BlockTokens{s.C[i], 0, s.tpb}));
      }
      KVF_RETURN_IF_ERROR(tiering::CopyWholePool(*s.io, *s.mirror, primary));
    } else {
      for (int32_t r = 0; r < primary.num_regions(); ++r) {
        KVF_RETURN_IF_ERROR(s.io->Fill(primary.region(r), 1, primary.layout().region_bytes()));
      }
      KVF_RETURN_IF_ERROR(s.io->Synchronize(DeadlineIn(600s)));
      for (int32_t r = 0; r < s.host->num_regions(); ++r)  // pinned host: host-accessible
        std::memset(s.host->region(r), 2, s.host->layout().region_bytes());
    }
    return Status::Ok();
  }

  std::vector<BlockMove> Moves(const Setup& s, const std::vector<int64_t>& src,
                               const std::vector<int64_t>& dst, int32_t tokens) const {
    std::vector<BlockMove> m;
    for (int64_t i = 0; i < s.n; ++i)
      m.emplace_back(src[i], dst[i], tokens, BlockKey{1, uint64_t(i)});
    return m;
  }

  // A plain memcpy loop over the fragments the manager would copy (CPU device only).
  Fn Pattern(const Setup& s, const std::vector<BlockMove>& m, bool to_host) const {
    if (dev_.info().platform != "cpu") return nullptr;
    auto d = std::make_shared<std::vector<CopyDesc>>();
    AppendBlockCopies(to_host ? *s.primary : *s.host, to_host ? *s.host : *s.primary, m, *d);
    return [d] {
      for (const CopyDesc& c : *d) {
        for (size_t r = 0; r < c.rows; ++r) {
          std::memcpy(static_cast<std::byte*>(c.dst) + r * c.dst_pitch,
                      static_cast<const std::byte*>(c.src) + r * c.src_pitch, c.bytes);
        }
      }
      return Status::Ok();
    };
  }

  // "yes", "no" (not asked) or "FAILED: why": every block of `blocks` holds request `req`'s
  // first `tokens` tokens.
  std::string Verify(Setup& s, const BlockPool& pool, const std::vector<int64_t>& blocks,
                     uint64_t req, int64_t tokens) {
    if (!o_.verify) return "no";
    const BlockPool* check = &pool;
    if (&pool == &*s.primary) {
      Status st = tiering::CopyWholePool(*s.io, *s.primary, *s.mirror);
      if (!st.ok()) return "FAILED: " + st.ToString();
      check = &*s.mirror;
    }
    for (int64_t i = 0; i < s.n; ++i) {
      auto r = CheckBlock(*check, req + i, BlockTokens{blocks[i], 0, tokens});
      if (!r.ok()) return "FAILED: " + r.status().ToString();
      if (r->has_value()) return "FAILED: " + (*r)->ToString();
    }
    return "yes";
  }

  // Moves `m` from one tier to another and waits; file batches go in staging-sized parts.
  static Status RunOn(TransferManager& t, Tier from, Tier to, const std::vector<BlockMove>& m,
                      int64_t* desc) {
    const size_t chunk = (from == Tier::kFile || to == Tier::kFile)
                             ? static_cast<size_t>(t.file_staging_blocks())
                             : m.size();
    std::vector<TransferBatch> batches;
    int64_t d = 0;
    for (size_t at = 0; at < m.size(); at += chunk) {
      std::span<const BlockMove> part(m.data() + at, std::min(chunk, m.size() - at));
      KVF_ASSIGN_OR_RETURN(TransferBatch b, t.Move(from, to, part));
      if (chunk != m.size()) KVF_RETURN_IF_ERROR(b.Wait(DeadlineIn(600s)));
      batches.push_back(b);
    }
    for (auto& b : batches) {
      KVF_RETURN_IF_ERROR(b.Wait(DeadlineIn(600s)));
      d += static_cast<int64_t>(b.descriptors());
    }
    if (desc) *desc = d;
    return Status::Ok();
  }

  Fn D2h(int64_t size) {
    return [this, size] { return Copy(0, size); };
  }
  Fn H2d(int64_t size) {
    return [this, size] { return Copy(1, size); };
  }

  // Offload, onboard, both at once, partial (the first half of each block's tokens).
  Status HostCases(Setup& s, std::vector<Row>& rows) {
    const size_t first_row = rows.size();
    KVF_RETURN_IF_ERROR(HostRows(s, rows));
    for (size_t i = first_row; i < rows.size(); ++i) {
      rows[i].host_pool = std::string(LayoutKindName(s.host->spec().layout));
      rows[i].staged = s.tm->device_staged();
    }
    return Status::Ok();
  }

  Status HostRows(Setup& s, std::vector<Row>& rows) {
    TransferManager& tm = *s.tm;
    const int64_t bytes = s.bytes, bb = s.bb, n = s.n;
    const int32_t tpb = s.tpb;
    auto off = Moves(s, s.A, s.X, 0);
    Row r{s.prefix + " offload", bytes, 0, "copy dev->pinned", 0, "no", 0, bb, n};
    KVF_RETURN_IF_ERROR(Measure(
        r, [&] { return RunOn(tm, Tier::kPrimary, Tier::kHost, off, &r.descriptors); }, D2h(bytes),
        Pattern(s, off, true)));
    r.verified = Verify(s, *s.host, s.X, 1000, tpb);
    rows.push_back(r);
    auto on = Moves(s, s.X, s.B, 0);
    r = Row{s.prefix + " onboard", bytes, 0, "copy pinned->dev", 0, "no", 0, bb, n};
    KVF_RETURN_IF_ERROR(Measure(
        r, [&] { return RunOn(tm, Tier::kHost, Tier::kPrimary, on, &r.descriptors); }, H2d(bytes),
        Pattern(s, on, false)));
    r.verified = Verify(s, *s.primary, s.B, 1000, tpb);
    rows.push_back(r);
    // Both at once: onboard X -> B while offloading C -> Y.
    auto off2 = Moves(s, s.C, s.Y, 0);
    r = Row{s.prefix + " both", 2 * bytes, 0, "both copies at once", 0, "no", 0, bb, 2 * n};
    KVF_RETURN_IF_ERROR(Measure(
        r,
        [&]() -> Status {
          KVF_ASSIGN_OR_RETURN(auto b1, tm.Onboard(Tier::kHost, on));
          KVF_ASSIGN_OR_RETURN(auto b2, tm.Offload(Tier::kHost, off2));
          KVF_RETURN_IF_ERROR(b1.Wait(DeadlineIn(600s)));
          KVF_RETURN_IF_ERROR(b2.Wait(DeadlineIn(600s)));
          r.descriptors = static_cast<int64_t>(b1.descriptors() + b2.descriptors());
          return Status::Ok();
        },
        [this, bytes] { return CopyBoth(bytes); }, nullptr));
    if (o_.verify) {
      r.verified = Verify(s, *s.host, s.Y, 5000, tpb);
      if (r.verified == "yes") r.verified = Verify(s, *s.primary, s.B, 1000, tpb);
    }
    rows.push_back(r);
    const int32_t half = std::max(1, tpb / 2);
    auto part = Moves(s, s.C, s.X, half);
    const int64_t pbytes = bytes / tpb * half;
    r = Row{s.prefix + fmt::format(" partial {}/{}", half, tpb),
            pbytes,
            0,
            "copy dev->pinned",
            0,
            "no",
            0,
            bb,
            n};
    KVF_RETURN_IF_ERROR(Measure(
        r, [&] { return RunOn(tm, Tier::kPrimary, Tier::kHost, part, &r.descriptors); },
        D2h(pbytes), Pattern(s, part, true)));
    r.verified = Verify(s, *s.host, s.X, 5000, half);
    rows.push_back(r);
    return Status::Ok();
  }

  // Each file backend: offload to and onboard from the file tier, beside raw O_DIRECT I/O of
  // the same bytes on the same directory (src/testing/raw_io_bench.h; its own timing: the read's
  // untimed pre-write and the scratch file's creation are left out), or beside the same-bytes
  // copy for the in-memory store.
  Status FileCases(Setup& s, std::vector<Row>& rows) {
    // Whatever ends the run (an error included), the slab files (and lock) it created go; the
    // stores are closed before (they are destroyed first, being declared after this).
    struct RemoveNewSlabFiles {
      const std::string dir;
      const std::set<std::string> before;
      ~RemoveNewSlabFiles() {
        for (const std::string& f : SlabFiles(dir)) {
          if (!before.contains(f)) {
            std::error_code ec;
            std::filesystem::remove(std::filesystem::path(dir) / f, ec);
          }
        }
      }
    } remove_new_slab_files{o_.dir, SlabFiles(o_.dir)};
    for (const std::string& want : o_.file_backends)
      KVF_RETURN_IF_ERROR(FileBackendCases(s, want, rows));
    return Status::Ok();
  }

  Status FileBackendCases(Setup& s, const std::string& want, std::vector<Row>& rows) {
    const int64_t bytes = s.bytes, bb = s.bb, n = s.n;
    KVF_ASSIGN_OR_RETURN(std::unique_ptr<SlabStore> store, OpenFileTier(want, o_.dir, bb, n));
    const FileBackendCaps caps = store->backend();
    if (caps.name != want && want != "memory") {
      // cufile / io_uring unavailable: SlabStore fell back to posix. Measured as posix already.
      if (fallback_noted_.insert(want).second) {
        fmt::print(stderr, "bench offload: file tier {}: runs as {} ({}); not measured twice\n",
                   want, caps.name, caps.note);
      }
      return Status::Ok();
    }
    KVF_ASSIGN_OR_RETURN(auto ftm,
                         TransferManager::Create(dev_, *s.primary, &*s.host, store.get(), s.topt));
    std::vector<BlockMove> fo, fi;
    for (int64_t i = 0; i < n; ++i) {
      KVF_ASSIGN_OR_RETURN(SlotId slot, store->Allocate());
      fo.emplace_back(s.A[i], slot, 0, BlockKey{7, uint64_t(i)});
      fi.emplace_back(slot, s.B[i], 0, BlockKey{7, uint64_t(i)});
    }
    const std::string be = want == "memory" ? "memory" : caps.name;
    Fn fw_base = D2h(bytes), fr_base = H2d(bytes);
    SecFn fw_raw, fr_raw;
    std::string fw_name = "copy dev->pinned", fr_name = "copy pinned->dev";
    if (be != "memory") {
      const std::string dir = o_.dir;
      auto raw = [dir, bytes, bb](bool write) -> SecFn {
        return [dir, bytes, bb, write]() -> StatusOr<double> {
          KVF_ASSIGN_OR_RETURN(double g, RawDirectIoGbps(dir, bytes, bb, write));
          return g > 0 ? bytes / (g * 1e9) : 0.0;
        };
      };
      fw_base = fr_base = nullptr;
      fw_name = "raw O_DIRECT write";
      fr_name = "raw O_DIRECT read";
      StatusOr<double> probe = RawDirectIoGbps(dir, 1 << 20, 1 << 20, true);
      if (probe.ok()) {
        fw_raw = raw(true);
        fr_raw = raw(false);
      } else if (probe.status().code() == StatusCode::kUnavailable) {
        fmt::print(stderr, "bench offload: no raw O_DIRECT baseline: {}\n",
                   probe.status().ToString());
        fw_name = fr_name = "none (no O_DIRECT)";
      } else {
        return probe.status().WithContext("raw O_DIRECT baseline");
      }
    }
    Row r{s.prefix + " file[" + be + "] offload", bytes, 0, fw_name, 0, "no", 0, bb, n};
    r.file_backend = caps.name;
    r.file_note = caps.note;
    KVF_RETURN_IF_ERROR(Measure(
        r, [&] { return RunOn(*ftm, Tier::kPrimary, Tier::kFile, fo, &r.descriptors); }, fw_base,
        nullptr, fw_raw));
    rows.push_back(r);
    const size_t offload_row = rows.size() - 1;
    if (o_.verify) {  // scramble B so the onboard check proves the bytes came from the file
      for (int64_t b : s.B) KVF_RETURN_IF_ERROR(FillBlock(*s.mirror, 99, BlockTokens{b, 0, s.tpb}));
      KVF_RETURN_IF_ERROR(tiering::CopyWholePool(*s.io, *s.mirror, *s.primary));
    }
    r = Row{s.prefix + " file[" + be + "] onboard", bytes, 0, fr_name, 0, "no", 0, bb, n};
    r.file_backend = caps.name;
    r.file_note = caps.note;
    KVF_RETURN_IF_ERROR(Measure(
        r, [&] { return RunOn(*ftm, Tier::kFile, Tier::kPrimary, fi, &r.descriptors); }, fr_base,
        nullptr, fr_raw));
    r.verified = Verify(s, *s.primary, s.B, 1000, s.tpb);
    rows.push_back(r);
    // The offload is checked by the round trip: what the onboard read back is what it wrote.
    rows[offload_row].verified = r.verified;
    return Status::Ok();
  }

  // Times the case, its baseline and (if any) its fragment pattern interleaved, iteration by
  // iteration, so that load from other processes hits all three alike; medians after a warm-up.
  // `timed_base`, when set, replaces `base` and reports its own seconds.
  Status Measure(Row& r, const Fn& fn, const Fn& base, const Fn& pat,
                 const SecFn& timed_base = nullptr) {
    std::vector<double> t[3];
    const Fn* fns[3] = {&fn, &base, &pat};
    for (int i = 0; i < o_.iters + 1; ++i) {
      for (int k = 0; k < 3; ++k) {
        if (k == 1 && timed_base) {
          KVF_ASSIGN_OR_RETURN(double s, timed_base());
          if (i > 0) t[k].push_back(s);
          continue;
        }
        if (!*fns[k]) continue;
        auto t0 = Clock::now();
        KVF_RETURN_IF_ERROR((*fns[k])());
        if (i > 0) t[k].push_back(std::chrono::duration<double>(Clock::now() - t0).count());
      }
    }
    auto med = [](std::vector<double>& v) {
      if (v.empty()) return 0.0;
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
    };
    std::vector<double> paired;
    for (size_t i = 0; i < std::min(t[0].size(), t[1].size()); ++i) {
      if (t[0][i] > 0) paired.push_back(t[1][i] / t[0][i]);
    }
    r.paired_ratio = med(paired);
    r.seconds = med(t[0]);
    r.baseline_seconds = med(t[1]);
    r.pattern_seconds = med(t[2]);
    return Status::Ok();
  }

  // Baseline buffers: dev_[i] / pinned_[i], two pairs, so "both" runs two copies at once.
  Status MakeBaselineBuffers(int64_t bytes) {
    for (int i = 0; i < 2; ++i) {
      KVF_ASSIGN_OR_RETURN(dev_buf_[i], dev_.Allocate(MemoryKind::kDevice, bytes));
      KVF_ASSIGN_OR_RETURN(pinned_buf_[i], dev_.Allocate(MemoryKind::kPinnedHost, bytes));
      if (!streams_[i]) {
        KVF_ASSIGN_OR_RETURN(streams_[i], dev_.CreateStream());
      }
      // Device memory is the GPU's on the CUDA device: touch it through the stream.
      KVF_RETURN_IF_ERROR(streams_[i]->Fill(dev_buf_[i].data(), 1, bytes));
      KVF_RETURN_IF_ERROR(streams_[i]->Synchronize(DeadlineIn(600s)));
      std::memset(pinned_buf_[i].data(), 2, bytes);
    }
    return Status::Ok();
  }
  // One Stream::Copy of one contiguous buffer: dir 0 = device -> pinned, 1 = pinned -> device.
  Status Copy(int dir, int64_t size) {
    KVF_RETURN_IF_ERROR(dir == 0
                            ? streams_[0]->Copy(pinned_buf_[0].data(), dev_buf_[0].data(), size)
                            : streams_[0]->Copy(dev_buf_[0].data(), pinned_buf_[0].data(), size));
    return streams_[0]->Synchronize(DeadlineIn(600s));
  }
  Status CopyBoth(int64_t size) {
    KVF_RETURN_IF_ERROR(streams_[0]->Copy(pinned_buf_[0].data(), dev_buf_[0].data(), size));
    KVF_RETURN_IF_ERROR(streams_[1]->Copy(dev_buf_[1].data(), pinned_buf_[1].data(), size));
    KVF_RETURN_IF_ERROR(streams_[0]->Synchronize(DeadlineIn(600s)));
    return streams_[1]->Synchronize(DeadlineIn(600s));
  }

  std::set<std::string> fallback_noted_;  // backends whose posix fallback was reported
  Buffer dev_buf_[2], pinned_buf_[2];
  std::unique_ptr<Stream> streams_[2];
  Device& dev_;
  const OffloadBenchOptions& o_;
};

int RunBenchOffload(const OffloadBenchOptions& o) {
  std::string device = o.device.empty() ? Config::Global().String("device.default") : o.device;
  auto dev = OpenDevice(device);
  if (!dev.ok()) {
    fmt::print(stderr, "bench offload: {}\n", dev.status().ToString());
    return 2;
  }
  if (o.host_layout != "block-major" && o.host_layout != "block-major-nhd" &&
      o.host_layout != "same" && o.host_layout != "packed") {
    fmt::print(stderr,
               "bench offload: --host-layout must be packed, same, block-major or "
               "block-major-nhd, not "
               "'{}'\n",
               o.host_layout);
    return 2;
  }
  if (o.tier != "host" && o.tier != "file") {
    fmt::print(stderr, "bench offload: --tier must be host or file, not '{}'\n", o.tier);
    return 2;
  }
  bool needs_dir = false;
  for (const std::string& b : o.file_backends) {
    if (b != "posix" && b != "io_uring" && b != "cufile" && b != "memory") {
      fmt::print(stderr,
                 "bench offload: --file-backend must be posix, io_uring, cufile or memory, not "
                 "'{}'\n",
                 b);
      return 2;
    }
    needs_dir |= b != "memory";
  }
  if (o.tier == "file" && needs_dir && o.dir.empty()) {
    fmt::print(stderr,
               "bench offload: --tier file needs --dir (an existing directory on the disk to "
               "measure), or --file-backend memory\n");
    return 2;
  }
  if (!o.dir.empty()) {
    struct stat sb;
    if (::stat(o.dir.c_str(), &sb) != 0) {
      fmt::print(stderr, "bench offload: --dir {}: {}\n", o.dir, std::strerror(errno));
      return 2;
    }
    if (!S_ISDIR(sb.st_mode)) {
      fmt::print(stderr, "bench offload: --dir {}: not a directory\n", o.dir);
      return 2;
    }
  }
  std::vector<Workload> all = {
      {"llama3-8b block-major", 32, 16, LayoutKind::kBlockMajor},  // 2 MiB blocks
      {"llama3-8b per-layer", 32, 16, LayoutKind::kPerLayer},      // 32 KiB fragments
      {"llama3-70b block-major", 80, 8, LayoutKind::kBlockMajor},  // 2.5 MiB blocks
      {"llama3-70b per-layer", 80, 8, LayoutKind::kPerLayer},      // 16 KiB fragments
  };
  std::vector<Row> rows;
  Bench bench(**dev, o);
  for (const Workload& w : all) {
    if (o.model != "all" && w.name.find("llama3-" + o.model + " ") != 0) continue;
    if (o.layout != "all" && w.name.find(o.layout) == std::string::npos) continue;
    Status st = bench.Run(w, rows);
    if (!st.ok()) {
      fmt::print(stderr, "bench offload: {}: {}\n", w.name, st.ToString());
      return 1;
    }
  }
  bool failed = false;
  for (const Row& r : rows) failed |= r.verified.rfind("FAILED", 0) == 0;
  if (o.out.machine()) {
    Document doc("bench offload");
    doc.config() = {{"device", (*dev)->info().name},
                    {"tier", o.tier},
                    {"model", o.model},
                    {"layout", o.layout},
                    {"host_layout", o.host_layout},
                    {"file_backends", o.file_backends},
                    {"iters", o.iters},
                    {"total_bytes", o.total_bytes},
                    {"contiguous", o.contiguous},
                    {"verify", o.verify},
                    {"shape",
                     "kv_heads 8, head_dim 128, bf16, K and V; layers and tokens per "
                     "block per case"}};
    for (const Row& r : rows) {
      const double g = Gbps(r.bytes, r.seconds), bg = Gbps(r.bytes, r.baseline_seconds);
      nlohmann::json j = {{"case", r.name},
                          {"device", (*dev)->info().name},
                          {"bytes", r.bytes},
                          {"seconds", r.seconds},
                          {"gbps", g},
                          {"baseline", r.baseline},
                          {"baseline_gbps", bg},
                          {"ratio", bg > 0 ? g / bg : 0},
                          {"ratio_paired", r.paired_ratio},
                          {"verified", r.verified},
                          {"blocks", r.blocks},
                          {"block_bytes", r.block_bytes},
                          {"descriptors", r.descriptors},
                          {"pattern_gbps", Gbps(r.bytes, r.pattern_seconds)},
                          {"iters", o.iters},
                          {"host_layout", o.host_layout}};
      if (!r.host_pool.empty()) {
        j["host_pool_layout"] = r.host_pool;
        j["device_staged"] = r.staged;
      }
      if (!r.file_backend.empty()) {
        j["file_backend"] = r.file_backend;
        j["file_note"] = r.file_note;
      }
      doc.AddRow(std::move(j));
    }
    doc.SetResult(!failed);
    doc.Print(o.out.format());
    return failed ? 1 : 0;
  }
  fmt::print(
      "kvferry bench offload: device {} ({}), median of {} after a warm-up, ids {}, host tier "
      "{}\n",
      device, (*dev)->info().name, o.iters, o.contiguous ? "contiguous" : "shuffled",
      o.host_layout == "same"     ? "in the primary layout"
      : o.host_layout == "packed" ? "packed in the primary's block order (CreatePackedHostPool)"
                                  : o.host_layout);
  fmt::print(
      "ratio = GB/s / baseline GB/s (one contiguous copy of the same bytes, same run); paired = "
      "median of the per-iteration ratios (case and baseline timed back to back); pattern = GB/s "
      "of a plain memcpy loop over the same fragments (cpu only)\n");
  fmt::print("{:<48} {:>7} {:>5} {:>7} {:>20} {:>7} {:>6} {:>6} {:>8} {}\n", "case", "MiB", "desc",
             "GB/s", "baseline", "GB/s", "ratio", "paired", "pattern", "verified");
  for (const Row& r : rows) {
    const double g = Gbps(r.bytes, r.seconds), bg = Gbps(r.bytes, r.baseline_seconds);
    const double pg = Gbps(r.bytes, r.pattern_seconds);
    fmt::print("{:<48} {:>7.1f} {:>5} {:>7.2f} {:>20} {:>7.2f} {:>6.2f} {:>6.2f} {:>8} {}\n",
               r.name, r.bytes / double(1 << 20), r.descriptors, g, r.baseline, bg,
               bg > 0 ? g / bg : 0, r.paired_ratio, pg > 0 ? fmt::format("{:.2f}", pg) : "-",
               r.verified);
  }
  std::set<std::string> noted;
  for (const Row& r : rows) {
    if (r.file_backend.empty() || !noted.insert(r.file_backend).second) continue;
    fmt::print("file backend {}: {}\n", r.file_backend, r.file_note.empty() ? "-" : r.file_note);
  }
  return failed ? 1 : 0;
}

}  // namespace

void AddBenchOffloadCommand(CLI::App& bench) {
  auto* cmd = bench.add_subcommand("offload", "GB/s of KV offload/onboard between tiers");
  auto o = std::make_shared<OffloadBenchOptions>();
  cmd->add_option("--device", o->device, "cpu | cuda | cuda:N (default: the device.default knob)");
  cmd->add_option("--tier", o->tier, "host | file (file also runs the host cases)");
  cmd->add_option("--dir", o->dir, "directory for the file tier and its raw O_DIRECT baseline");
  cmd->add_option("--model", o->model, "8b | 70b | all");
  cmd->add_option("--layout", o->layout, "block-major | per-layer | all");
  cmd->add_option("--host-layout", o->host_layout,
                  "host tier layout: packed (default: each block one range in the primary's "
                  "in-block order, what CreatePackedHostPool makes) | same (as the primary) | "
                  "block-major ([layer][kv][head][token][dim] blocks) | block-major-nhd "
                  "([layer][kv][token][head][dim] blocks)");
  cmd->add_option("--file-backend", o->file_backends,
                  "file tiers to measure with --tier file: posix, io_uring, cufile, memory "
                  "(in-memory stand-in); default posix io_uring cufile (one falling back to "
                  "posix is reported, not measured twice)")
      ->delimiter(',');
  cmd->add_flag("--verify", o->verify, "check every byte after each round trip (CheckBlock)");
  AddOutputFlags(cmd, o->out);
  cmd->add_flag("--contiguous", o->contiguous, "consecutive block ids (coalesce into few copies)");
  cmd->add_option("--iters", o->iters, "timed repetitions (median), after one warm-up")
      ->check(CLI::Range(1, 1000));
  cmd->add_option("--total-bytes", o->total_bytes, "bytes moved per batch")
      ->check(CLI::Range(int64_t{1} << 20, int64_t{1} << 40));
  cmd->callback([o] { std::exit(RunBenchOffload(*o)); });
}

}  // namespace kvferry::tools
