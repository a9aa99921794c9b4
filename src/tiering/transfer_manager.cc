// TransferManager: see include/kvferry/tiering.h for the contract.
#include <fmt/format.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>

#include "base/log.h"
#include "kvferry/config.h"
#include "kvferry/slab_store.h"
#include "kvferry/tiering.h"
#include "metrics/atomic_histogram.h"
#include "tiering/copy_plan.h"

namespace kvferry {

std::string_view TierName(Tier tier) {
  switch (tier) {
    case Tier::kPrimary:
      return "primary";
    case Tier::kHost:
      return "host";
    case Tier::kFile:
      return "file";
  }
  return "?";
}

TransferOptions TransferOptions::FromConfig() {
  TransferOptions o;
  const Config& c = Config::Global();
  o.file_staging_blocks = c.Int("tiering.file_staging_blocks");
  const std::string staging = c.String("tiering.device_staging");
  o.device_staging = staging == "always"  ? DeviceStaging::kAlways
                     : staging == "never" ? DeviceStaging::kNever
                                          : DeviceStaging::kAuto;
  o.device_staging_blocks = c.Int("tiering.device_staging_blocks");
  return o;
}

namespace internal {

// Copies of one direction (from tier x 3 + to tier), for metrics(). Shared with the batches, so a
// handle that outlives the manager still records into live memory.
struct TierCopyCounters {
  std::atomic<int64_t> batches{0}, blocks{0}, bytes{0};
  AtomicHistogram latency;
};
using CopyCounters = std::array<TierCopyCounters, 9>;

// One batch. Recycled by the manager once finished and no handle refers to it; `seq` changes on
// every reuse, so a stale reference (BlockRef below) to an earlier use reads as finished.
struct BatchState {
  std::unique_ptr<Event> event;
  uint64_t seq = 0;                   // guarded by the manager's mutex
  int stream = 0;                     // 0 = offload stream, 1 = onboard stream
  uint64_t dep_mark = 0;              // dedup of dependencies while planning a batch
  std::atomic<bool> recorded{false};  // `event` captures this batch's copies
  std::mutex mu;
  std::condition_variable cv;
  bool host_done = false;  // guarded by mu: the host-side part (file I/O) is over
  std::vector<Status> items;
  size_t descriptors = 0;
  // Metrics: the batch's direction, when it was submitted, and whether its end was recorded.
  std::shared_ptr<CopyCounters> counters;
  int direction = 0;
  Clock::time_point submitted;
  std::atomic<bool> observed{true};
  void ObserveDone() {
    if (counters && !observed.exchange(true))
      (*counters)[direction].latency.Add(
          std::chrono::duration<double>(Clock::now() - submitted).count());
  }
};

}  // namespace internal

using internal::BatchState;

bool TransferBatch::Query() const {
  if (!s_) return true;
  {
    std::lock_guard lock(s_->mu);
    if (!s_->host_done) return false;
  }
  if (!s_->event->Query()) return false;
  s_->ObserveDone();
  return true;
}

Status TransferBatch::Wait(Deadline deadline) const {
  if (!s_) return Status::Ok();
  {
    std::unique_lock lock(s_->mu);
    if (!s_->cv.wait_until(lock, deadline, [&] { return s_->host_done; })) {
      return Status::DeadlineExceeded("transfer batch: file I/O still pending at the deadline");
    }
  }
  KVF_RETURN_IF_ERROR(s_->event->Synchronize(deadline));
  s_->ObserveDone();
  for (const Status& st : s_->items) {
    if (!st.ok()) return st;
  }
  return Status::Ok();
}

const std::vector<Status>& TransferBatch::items() const {
  static const std::vector<Status> kEmpty;
  return s_ ? s_->items : kEmpty;
}
size_t TransferBatch::size() const { return s_ ? s_->items.size() : 0; }
size_t TransferBatch::descriptors() const { return s_ ? s_->descriptors : 0; }

namespace {

constexpr int kOffloadStream = 0;
constexpr int kOnboardStream = 1;

struct BlockRef {
  BatchState* b = nullptr;
  uint64_t seq = 0;
};

// Per-block ordering state of a pool: the batch that last wrote the block and, per stream, the
// batches that read it since.
struct BlockState {
  BlockRef write;
  BlockRef read[2];
  uint64_t dst_mark = 0;  // seq of the last batch that wrote it: catches duplicate destinations
  uint64_t src_mark = 0;  // seq of the last batch that read it: catches a block read and written
};

struct FileItem {
  int64_t pool_block;  // block in the pool side
  int64_t slot;
  int64_t staging;
  int32_t tokens;
  BlockKey key;
};

// Work for the file worker, in submission order.
struct FileJob {
  std::shared_ptr<BatchState> batch;
  bool write = false;  // pool -> file; else file -> pool
  Tier pool_tier = Tier::kPrimary;
  std::vector<FileItem> items;
  std::vector<BlockRef> deps;  // onboards: what the staging -> pool copy waits for
  int64_t staging_count = 0;
};

}  // namespace

struct TransferManager::Impl {
  Device* device = nullptr;
  BlockPool* pools[2] = {nullptr, nullptr};  // primary, host
  SlabStore* file = nullptr;
  TransferOptions options;
  std::unique_ptr<Stream> streams[2];
  std::unique_ptr<Event> sync_events[2];
  std::unique_ptr<Event> compute_event;

  tiering::TierView views[2];
  std::vector<std::byte*> region_ptrs[2];
  // File staging: a ring of packed blocks in pinned memory, handed out and freed in FIFO order.
  Buffer staging;
  std::optional<PoolLayout> staging_layout;
  std::byte* staging_region[1] = {nullptr};
  tiering::TierView staging_view;
  int64_t staging_blocks = 0;
  // Device staging of primary <-> host copies, one per copy stream (stream order makes reuse
  // safe); see DeviceStaging in tiering.h.
  Buffer dstaging[2];
  std::optional<PoolLayout> dstaging_layout;
  std::byte* dstaging_region[2][1] = {{nullptr}, {nullptr}};
  tiering::TierView dstaging_view[2];
  int64_t dstaging_blocks = 0;  // 0: copies go direct

  mutable std::mutex mu;
  std::condition_variable cv;  // staging freed, a batch recorded, the worker went idle
  std::vector<BlockState> state[2];
  std::vector<std::shared_ptr<BatchState>> batches;
  size_t batch_cursor = 0;
  uint64_t next_seq = 1;
  int64_t staging_head = 0;  // next to free
  int64_t staging_used = 0;
  int64_t unrecorded = 0;  // file onboards whose staging -> pool copy is not queued yet
  std::deque<FileJob> jobs;
  bool worker_busy = false;
  bool stop = false;
  TransferStats stats;
  std::shared_ptr<internal::CopyCounters> counters = std::make_shared<internal::CopyCounters>();
  std::vector<CopyDesc> desc;          // reused planning buffer (caller thread)
  std::vector<CopyDesc> worker_desc;   // reused planning buffer (worker)
  std::vector<BatchState*> deps;       // reused
  std::vector<SlotWrite> slot_writes;  // worker
  std::vector<SlotRead> slot_reads;    // worker
  std::thread worker;

  ~Impl() {
    {
      std::lock_guard lock(mu);
      stop = true;
    }
    cv.notify_all();
    if (worker.joinable()) worker.join();
    for (auto& s : streams) {
      if (s) (void)s->Synchronize(Clock::now() + std::chrono::hours(1));
    }
  }

  int64_t Blocks(Tier t) const {
    switch (t) {
      case Tier::kPrimary:
        return pools[0]->blocks();
      case Tier::kHost:
        return pools[1] ? pools[1]->blocks() : 0;
      case Tier::kFile:
        return file ? file->capacity() : 0;
    }
    return 0;
  }

  std::shared_ptr<BatchState> AcquireBatch() {
    for (size_t n = 0; n < batches.size(); ++n) {
      size_t i = (batch_cursor + n) % batches.size();
      auto& b = batches[i];
      if (b.use_count() != 1) continue;
      {
        std::lock_guard lock(b->mu);
        if (!b->host_done) continue;
      }
      if (!b->event->Query()) continue;
      b->ObserveDone();
      batch_cursor = i + 1;
      return b;
    }
    auto ev = device->CreateEvent();
    if (!ev.ok()) return nullptr;
    auto b = std::make_shared<BatchState>();
    b->event = std::move(ev).value();
    batches.push_back(b);
    return b;
  }

  // Adds the batch behind `r` to `deps` if work on `stream` must wait for it. Waits (releasing the
  // lock) while it is a file onboard whose copy is not queued yet.
  void AddDep(std::unique_lock<std::mutex>& lock, const BlockRef& r, int stream, uint64_t mark) {
    if (r.b == nullptr) return;
    while (r.b->seq == r.seq && !r.b->recorded.load()) cv.wait(lock);
    if (r.b->seq != r.seq) return;  // recycled: finished long ago
    if (r.b->stream == stream || r.b->dep_mark == mark) return;
    if (r.b->event->Query()) return;
    r.b->dep_mark = mark;
    deps.push_back(r.b);
  }

  Status EnqueueWaits(int stream) {
    for (BatchState* d : deps) KVF_RETURN_IF_ERROR(streams[stream]->Wait(*d->event));
    return Status::Ok();
  }

  // Plans moves[i].src -> moves[i].dst between two views, coalescing consecutive ids. `src_id` /
  // `dst_id` map a move to its block index in each view.
  template <typename SrcId, typename DstId>
  size_t Plan(const tiering::TierView& sv, const tiering::TierView& dv, size_t n, SrcId src_id,
              DstId dst_id, std::span<const int32_t> tokens_of, std::vector<CopyDesc>& out,
              int64_t* bytes) {
    const int64_t tpb = sv.layout->dims()[kTokenAxis];
    const int64_t plane_bytes = sv.layout->block_bytes() / tpb;
    size_t emitted = 0;
    size_t i = 0;
    while (i < n) {
      int64_t s0 = src_id(i), d0 = dst_id(i);
      if (s0 < 0) {  // skipped item
        ++i;
        continue;
      }
      int64_t t = tokens_of[i] <= 0 ? tpb : std::min<int64_t>(tokens_of[i], tpb);
      size_t j = i + 1;
      while (j < n && src_id(j) == s0 + static_cast<int64_t>(j - i) &&
             dst_id(j) == d0 + static_cast<int64_t>(j - i) &&
             (tokens_of[j] <= 0 ? tpb : std::min<int64_t>(tokens_of[j], tpb)) == t) {
        ++j;
      }
      int64_t count = static_cast<int64_t>(j - i);
      emitted += tiering::AppendRunCopies(sv, s0, dv, d0, count, t, out);
      *bytes += count * plane_bytes * t;
      i = j;
    }
    return emitted;
  }

  // True when a primary <-> host batch goes through device staging: staging is set up and every
  // move copies whole blocks.
  bool Staged(Tier from, Tier to, std::span<const BlockMove> moves) const {
    if (dstaging_blocks == 0 || from == to || from == Tier::kFile || to == Tier::kFile) {
      return false;
    }
    const int64_t tpb = pools[0]->shape().tokens_per_block;
    for (const BlockMove& mv : moves) {
      if (mv.tokens != 0 && mv.tokens != tpb) return false;
    }
    return true;
  }

  // Queues a staged batch on `stream`: per chunk of staging, the gather into staging and the
  // copy out of it (two CopyBatch calls). Returns descriptors queued; adds bytes moved.
  StatusOr<size_t> CopyStaged(int stream, Tier from, Tier to, std::span<const BlockMove> moves,
                              std::span<const int32_t> toks, int64_t* bytes) {
    size_t descs = 0;
    const tiering::TierView& sv = views[static_cast<int>(from)];
    const tiering::TierView& dv = views[static_cast<int>(to)];
    const tiering::TierView& st = dstaging_view[stream];
    for (size_t at = 0; at < moves.size(); at += static_cast<size_t>(dstaging_blocks)) {
      const size_t n = std::min(moves.size() - at, static_cast<size_t>(dstaging_blocks));
      auto slot = [](size_t i) { return static_cast<int64_t>(i); };
      auto chunk_toks = toks.subspan(at, n);
      for (int leg = 0; leg < 2; ++leg) {
        desc.clear();
        int64_t ignored = 0;
        if (leg == 0) {
          Plan(
              sv, st, n, [&](size_t i) { return moves[at + i].src; }, slot, chunk_toks, desc,
              bytes);
        } else {
          Plan(
              st, dv, n, slot, [&](size_t i) { return moves[at + i].dst; }, chunk_toks, desc,
              &ignored);
        }
        if (!desc.empty()) KVF_RETURN_IF_ERROR(streams[stream]->CopyBatch(desc));
        descs += desc.size();
      }
    }
    return descs;
  }

  // Sets up device staging when options and layouts call for it (Create).
  Status SetUpDeviceStaging(const TransferOptions& o) {
    if (pools[1] == nullptr || o.device_staging == DeviceStaging::kNever) return Status::Ok();
    if (o.device_staging == DeviceStaging::kAuto && device->info().platform == "cpu") {
      return Status::Ok();  // host memory both sides: staging is only an extra copy
    }
    if (o.device_staging_blocks <= 0) {
      return Status::InvalidArgument(fmt::format(
          "transfer manager: device_staging_blocks={} must be positive", o.device_staging_blocks));
    }
    KVF_ASSIGN_OR_RETURN(PoolLayout packed,
                         tiering::PackedLayoutLike(pools[1]->layout(), o.device_staging_blocks));
    // It helps only when a primary block is several fragments and a host block is one range.
    std::byte* fake[1] = {nullptr};
    tiering::TierView pv = views[0], hv = views[1], sv{&packed, fake};
    std::vector<CopyDesc> probe;
    const int64_t tpb = pools[0]->shape().tokens_per_block;
    const size_t direct = tiering::AppendRunCopies(pv, 0, hv, 0, 1, tpb, probe);
    const size_t link = tiering::AppendRunCopies(sv, 0, hv, 0, 1, tpb, probe);
    if (direct <= 1 || link != 1) return Status::Ok();
    dstaging_layout = std::move(packed);
    for (int i = 0; i < 2; ++i) {
      KVF_ASSIGN_OR_RETURN(dstaging[i],
                           device->Allocate(MemoryKind::kDevice,
                                            static_cast<size_t>(dstaging_layout->total_bytes())));
      dstaging_region[i][0] = dstaging[i].data();
      dstaging_view[i] = tiering::TierView{&*dstaging_layout, dstaging_region[i]};
    }
    dstaging_blocks = o.device_staging_blocks;
    return Status::Ok();
  }

  void WorkerLoop();
  void RunWrite(FileJob& job);
  void RunRead(FileJob& job);
  void FinishHost(BatchState& b) {
    {
      std::lock_guard lock(b.mu);
      b.host_done = true;
    }
    b.cv.notify_all();
  }
  void FreeStaging(int64_t n) {
    std::lock_guard lock(mu);
    staging_head = (staging_head + n) % std::max<int64_t>(staging_blocks, 1);
    staging_used -= n;
  }
};

namespace {
std::vector<int32_t>& TokensScratch() {
  thread_local std::vector<int32_t> v;
  return v;
}
}  // namespace

void TransferManager::Impl::WorkerLoop() {
  std::unique_lock lock(mu);
  while (true) {
    cv.wait(lock, [&] { return stop || !jobs.empty(); });
    if (jobs.empty()) return;
    FileJob job = std::move(jobs.front());
    jobs.pop_front();
    worker_busy = true;
    lock.unlock();
    if (job.write) {
      RunWrite(job);
    } else {
      RunRead(job);
    }
    FreeStaging(job.staging_count);
    FinishHost(*job.batch);
    lock.lock();
    worker_busy = false;
    cv.notify_all();
  }
}

void TransferManager::Impl::RunWrite(FileJob& job) {
  BatchState& b = *job.batch;
  Status copied = b.event->Synchronize(Clock::now() + std::chrono::hours(1));
  const int64_t block_bytes = staging_layout->block_bytes();
  slot_writes.clear();
  for (const FileItem& it : job.items) {
    slot_writes.push_back(SlotWrite{it.slot, SlotKey{it.key.hi, it.key.lo},
                                    staging.data() + it.staging * block_bytes, block_bytes,
                                    MemoryKind::kPinnedHost});
  }
  std::vector<Status> results;
  if (copied.ok()) {
    results = file->Write(slot_writes);
  }
  int64_t errors = 0;
  for (size_t i = 0; i < job.items.size(); ++i) {
    Status st = !copied.ok()         ? copied.WithContext("copy to file staging")
                : i < results.size() ? results[i]
                                     : Status::Internal("SlabStore::Write: missing result");
    if (!st.ok()) {
      st = st.WithContext(fmt::format("offload of {} block {} to file slot {}",
                                      TierName(job.pool_tier), job.items[i].pool_block,
                                      job.items[i].slot));
      ++errors;
    }
    b.items[i] = std::move(st);
  }
  std::lock_guard lock(mu);
  stats.file_writes += static_cast<int64_t>(job.items.size());
  stats.file_write_errors += errors;
}

void TransferManager::Impl::RunRead(FileJob& job) {
  BatchState& b = *job.batch;
  const int64_t block_bytes = staging_layout->block_bytes();
  slot_reads.clear();
  for (const FileItem& it : job.items) {
    slot_reads.push_back(SlotRead{it.slot, SlotKey{it.key.hi, it.key.lo},
                                  staging.data() + it.staging * block_bytes, block_bytes,
                                  MemoryKind::kPinnedHost});
  }
  std::vector<Status> results = file->Read(slot_reads);
  int64_t errors = 0;
  for (size_t i = 0; i < job.items.size(); ++i) {
    Status st =
        i < results.size() ? results[i] : Status::Internal("SlabStore::Read: missing result");
    if (!st.ok()) {
      st = st.WithContext(fmt::format("onboard of file slot {} to {} block {}", job.items[i].slot,
                                      TierName(job.pool_tier), job.items[i].pool_block));
      ++errors;
    }
    b.items[i] = std::move(st);
  }
  const int pool = static_cast<int>(job.pool_tier);
  {
    std::unique_lock lock(mu);
    stats.file_reads += static_cast<int64_t>(job.items.size());
    stats.file_read_errors += errors;
    ++next_seq;  // a fresh dedup mark
    deps.clear();
    for (const BlockRef& r : job.deps) AddDep(lock, r, kOnboardStream, next_seq);
    Status st = EnqueueWaits(kOnboardStream);
    worker_desc.clear();
    auto& toks = TokensScratch();
    toks.clear();
    for (const FileItem& it : job.items) toks.push_back(it.tokens);
    int64_t bytes = 0;
    Plan(
        staging_view, views[pool], job.items.size(),
        [&](size_t i) { return b.items[i].ok() ? job.items[i].staging : int64_t{-1}; },
        [&](size_t i) { return job.items[i].pool_block; }, toks, worker_desc, &bytes);
    if (st.ok() && !worker_desc.empty()) st = streams[kOnboardStream]->CopyBatch(worker_desc);
    if (st.ok()) st = streams[kOnboardStream]->Record(*b.event);
    b.descriptors = worker_desc.size();
    stats.descriptors += static_cast<int64_t>(worker_desc.size());
    stats.bytes += bytes;
    (*counters)[b.direction].bytes += bytes;
    b.recorded.store(true);
    --unrecorded;
    cv.notify_all();
    if (!st.ok()) {
      for (Status& s : b.items) {
        if (s.ok()) s = st.WithContext("copy from file staging");
      }
    }
  }
  // Staging is freed after this returns: the copy out of it must be over first.
  Status done = b.event->Synchronize(Clock::now() + std::chrono::hours(1));
  if (!done.ok()) {
    for (Status& s : b.items) {
      if (s.ok()) s = done;
    }
  }
}

TransferManager::TransferManager(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
TransferManager::~TransferManager() = default;

StatusOr<std::unique_ptr<TransferManager>> TransferManager::Create(Device& device,
                                                                   BlockPool& primary,
                                                                   BlockPool* host, SlabStore* file,
                                                                   const TransferOptions& options) {
  if (primary.memory() != MemoryKind::kDevice) {
    return Status::InvalidArgument(
        fmt::format("transfer manager: the primary pool must be device memory, not {}",
                    MemoryKindName(primary.memory())));
  }
  if (host != nullptr) {
    if (host->memory() != MemoryKind::kPinnedHost && host->memory() != MemoryKind::kHost) {
      return Status::InvalidArgument(
          fmt::format("transfer manager: the host tier must be pinned-host or host memory, not {}",
                      MemoryKindName(host->memory())));
    }
    if (!tiering::SameBlockShape(primary.layout(), host->layout())) {
      return Status::InvalidArgument(fmt::format(
          "transfer manager: host tier blocks differ from primary blocks: primary {} vs host {}",
          primary.layout().ToString(), host->layout().ToString()));
    }
  }
  auto impl = std::make_unique<Impl>();
  impl->device = &device;
  impl->pools[0] = &primary;
  impl->pools[1] = host;
  impl->file = file;
  impl->options = options;
  for (int i = 0; i < 2; ++i) {
    KVF_ASSIGN_OR_RETURN(impl->streams[i], device.CreateStream());
    KVF_ASSIGN_OR_RETURN(impl->sync_events[i], device.CreateEvent());
    BlockPool* p = impl->pools[i];
    if (p == nullptr) continue;
    for (int32_t r = 0; r < p->num_regions(); ++r) impl->region_ptrs[i].push_back(p->region(r));
    impl->views[i] = tiering::TierView{&p->layout(), impl->region_ptrs[i]};
    impl->state[i].resize(static_cast<size_t>(p->blocks()));
  }
  KVF_ASSIGN_OR_RETURN(impl->compute_event, device.CreateEvent());
  KVF_RETURN_IF_ERROR(impl->SetUpDeviceStaging(options));
  if (file != nullptr) {
    if (options.file_staging_blocks <= 0) {
      return Status::InvalidArgument(
          fmt::format("transfer manager: file_staging_blocks={} must be positive",
                      options.file_staging_blocks));
    }
    KVF_ASSIGN_OR_RETURN(impl->staging_layout,
                         tiering::PackedLayoutLike(primary.layout(), options.file_staging_blocks));
    const int64_t bytes = impl->staging_layout->total_bytes();
    KVF_ASSIGN_OR_RETURN(impl->staging,
                         device.Allocate(MemoryKind::kPinnedHost, static_cast<size_t>(bytes)));
    impl->staging_region[0] = impl->staging.data();
    impl->staging_view = tiering::TierView{&*impl->staging_layout, impl->staging_region};
    impl->staging_blocks = options.file_staging_blocks;
    Impl* raw = impl.get();
    impl->worker = std::thread([raw] { raw->WorkerLoop(); });
  }
  return std::unique_ptr<TransferManager>(new TransferManager(std::move(impl)));
}

StatusOr<TransferBatch> TransferManager::Move(Tier from, Tier to,
                                              std::span<const BlockMove> moves) {
  Impl& m = *impl_;
  if (!has_tier(from) || !has_tier(to)) {
    return Status::InvalidArgument(fmt::format("move {} -> {}: tier {} is not attached",
                                               TierName(from), TierName(to),
                                               TierName(has_tier(from) ? to : from)));
  }
  if (from == to && from != Tier::kPrimary) {
    return Status::InvalidArgument(
        fmt::format("move {} -> {}: only primary -> primary copies stay in a tier", TierName(from),
                    TierName(to)));
  }
  const int64_t tpb = m.pools[0]->shape().tokens_per_block;
  const int64_t nsrc = m.Blocks(from), ndst = m.Blocks(to);
  std::unique_lock lock(m.mu);
  const uint64_t seq = ++m.next_seq;
  for (size_t i = 0; i < moves.size(); ++i) {
    const BlockMove& mv = moves[i];
    if (mv.src < 0 || mv.src >= nsrc || mv.dst < 0 || mv.dst >= ndst) {
      return Status::InvalidArgument(
          fmt::format("move {} -> {} item {}: block {} -> {} outside [0, {}) -> [0, {})",
                      TierName(from), TierName(to), i, mv.src, mv.dst, nsrc, ndst));
    }
    if (mv.tokens < 0 || mv.tokens > tpb) {
      return Status::InvalidArgument(
          fmt::format("move item {}: tokens={} outside [0, {}]", i, mv.tokens, tpb));
    }
    if (to != Tier::kFile) {
      BlockState& d = m.state[static_cast<int>(to)][mv.dst];
      if (d.dst_mark == seq) {
        return Status::InvalidArgument(
            fmt::format("move item {}: {} block {} is the destination of two moves of one batch", i,
                        TierName(to), mv.dst));
      }
      d.dst_mark = seq;
    }
    if (from == to) {
      // Within one tier the copies of a batch are unordered: no block may be read and written.
      BlockState& src = m.state[static_cast<int>(from)][mv.src];
      if (src.dst_mark == seq || m.state[static_cast<int>(to)][mv.dst].src_mark == seq) {
        return Status::InvalidArgument(
            fmt::format("move item {}: {} block {} is both read and written by one batch", i,
                        TierName(from), src.dst_mark == seq ? mv.src : mv.dst));
      }
      src.src_mark = seq;
    }
  }
  const bool file_io = from == Tier::kFile || to == Tier::kFile;
  const int64_t n = static_cast<int64_t>(moves.size());
  if (file_io && n > m.staging_blocks) {
    return Status::InvalidArgument(
        fmt::format("a file batch of {} blocks exceeds the file staging of {} blocks; split it", n,
                    m.staging_blocks));
  }
  std::shared_ptr<BatchState> b = m.AcquireBatch();
  if (!b) return Status::ResourceExhausted("transfer manager: could not create an event");
  // `seq` is this use of the batch state: references made now go stale when it is recycled.
  b->seq = seq;
  b->stream = static_cast<int>(to) > static_cast<int>(from) ? kOffloadStream : kOnboardStream;
  b->recorded.store(false);
  b->dep_mark = 0;
  b->descriptors = 0;
  b->items.assign(moves.size(), Status::Ok());
  b->counters = m.counters;
  b->direction = static_cast<int>(from) * 3 + static_cast<int>(to);
  b->submitted = Clock::now();
  b->observed = false;
  {
    std::lock_guard bl(b->mu);
    b->host_done = !file_io;
  }
  int64_t staging_first = 0;
  if (file_io) {
    m.cv.wait(lock, [&] { return m.staging_used + n <= m.staging_blocks; });
    staging_first = (m.staging_head + m.staging_used) % m.staging_blocks;
    m.staging_used += n;
  }
  const int stream = b->stream;
  const uint64_t mark = seq;
  m.deps.clear();
  std::vector<BlockRef> job_deps;
  // Dependencies and per-block state. Pool sides only; file slots are ordered by the worker.
  for (const BlockMove& mv : moves) {
    if (from != Tier::kFile) {
      BlockState& s = m.state[static_cast<int>(from)][mv.src];
      m.AddDep(lock, s.write, stream, mark);
    }
    if (to != Tier::kFile) {
      BlockState& d = m.state[static_cast<int>(to)][mv.dst];
      if (from == Tier::kFile) {
        for (const BlockRef* r : {&d.write, &d.read[0], &d.read[1]}) {
          if (r->b != nullptr) job_deps.push_back(*r);
        }
      } else {
        m.AddDep(lock, d.write, stream, mark);
        m.AddDep(lock, d.read[0], stream, mark);
        m.AddDep(lock, d.read[1], stream, mark);
      }
    }
  }
  for (const BlockMove& mv : moves) {
    if (from != Tier::kFile) m.state[static_cast<int>(from)][mv.src].read[stream] = {b.get(), seq};
    if (to != Tier::kFile) {
      BlockState& d = m.state[static_cast<int>(to)][mv.dst];
      d.write = {b.get(), seq};
      d.read[0] = d.read[1] = {};  // the write waits for them: waiting for it covers them
    }
  }
  auto& toks = TokensScratch();
  toks.clear();
  for (const BlockMove& mv : moves) toks.push_back(mv.tokens);
  auto staging_of = [&](size_t i) {
    return (staging_first + static_cast<int64_t>(i)) % m.staging_blocks;
  };
  ++m.stats.batches;
  m.stats.blocks += n;
  ++(*m.counters)[b->direction].batches;
  (*m.counters)[b->direction].blocks += n;
  if (from == Tier::kFile) {
    FileJob job;
    job.batch = b;
    job.write = false;
    job.pool_tier = to;
    job.staging_count = n;
    job.deps = std::move(job_deps);
    for (size_t i = 0; i < moves.size(); ++i) {
      job.items.push_back(
          FileItem{moves[i].dst, moves[i].src, staging_of(i), moves[i].tokens, moves[i].key});
    }
    ++m.unrecorded;
    m.jobs.push_back(std::move(job));
    m.cv.notify_all();
    return TransferBatch(std::move(b));
  }
  Status st = m.EnqueueWaits(stream);
  m.desc.clear();
  int64_t bytes = 0;
  const int src_pool = static_cast<int>(from);
  if (to == Tier::kFile) {
    // Staging holds whole blocks: the file always stores the whole block.
    m.Plan(
        m.views[src_pool], m.staging_view, moves.size(), [&](size_t i) { return moves[i].src; },
        staging_of, toks, m.desc, &bytes);
  } else if (!m.Staged(from, to, moves)) {
    m.Plan(
        m.views[src_pool], m.views[static_cast<int>(to)], moves.size(),
        [&](size_t i) { return moves[i].src; }, [&](size_t i) { return moves[i].dst; }, toks,
        m.desc, &bytes);
  }
  size_t ndesc = m.desc.size();
  if (st.ok() && m.Staged(from, to, moves)) {
    auto staged = m.CopyStaged(stream, from, to, moves, toks, &bytes);
    st = staged.status();
    ndesc = staged.ok() ? *staged : 0;
  } else if (st.ok() && !m.desc.empty()) {
    st = m.streams[stream]->CopyBatch(m.desc);
  }
  if (st.ok()) st = m.streams[stream]->Record(*b->event);
  b->recorded.store(true);
  b->descriptors = ndesc;
  m.stats.descriptors += static_cast<int64_t>(ndesc);
  m.stats.bytes += bytes;
  (*m.counters)[b->direction].bytes += bytes;
  if (!st.ok()) {
    for (Status& s : b->items) s = st;
  }
  if (to == Tier::kFile) {
    FileJob job;
    job.batch = b;
    job.write = true;
    job.pool_tier = from;
    job.staging_count = n;
    for (size_t i = 0; i < moves.size(); ++i) {
      job.items.push_back(
          FileItem{moves[i].src, moves[i].dst, staging_of(i), moves[i].tokens, moves[i].key});
    }
    m.jobs.push_back(std::move(job));
    m.cv.notify_all();
  }
  if (!st.ok()) return st;
  return TransferBatch(std::move(b));
}

Status TransferManager::SyncWithCompute(Stream& compute) {
  Impl& m = *impl_;
  std::unique_lock lock(m.mu);
  m.cv.wait(lock, [&] { return m.unrecorded == 0; });
  for (int i = 0; i < 2; ++i) {
    KVF_RETURN_IF_ERROR(m.streams[i]->Record(*m.sync_events[i]));
    KVF_RETURN_IF_ERROR(compute.Wait(*m.sync_events[i]));
  }
  return Status::Ok();
}

Status TransferManager::WaitForCompute(Stream& compute) {
  Impl& m = *impl_;
  std::lock_guard lock(m.mu);
  KVF_RETURN_IF_ERROR(compute.Record(*m.compute_event));
  for (auto& s : m.streams) KVF_RETURN_IF_ERROR(s->Wait(*m.compute_event));
  return Status::Ok();
}

Status TransferManager::Drain(Deadline deadline) {
  Impl& m = *impl_;
  {
    std::unique_lock lock(m.mu);
    if (!m.cv.wait_until(lock, deadline, [&] { return m.jobs.empty() && !m.worker_busy; })) {
      return Status::DeadlineExceeded("transfer manager: file batches still pending");
    }
    for (auto& s : m.streams) KVF_RETURN_IF_ERROR(s->Synchronize(deadline));
  }
  return Status::Ok();
}

Stream& TransferManager::offload_stream() const { return *impl_->streams[kOffloadStream]; }
Stream& TransferManager::onboard_stream() const { return *impl_->streams[kOnboardStream]; }
BlockPool& TransferManager::primary() const { return *impl_->pools[0]; }
BlockPool* TransferManager::host() const { return impl_->pools[1]; }
SlabStore* TransferManager::file() const { return impl_->file; }
bool TransferManager::has_tier(Tier tier) const {
  switch (tier) {
    case Tier::kPrimary:
      return true;
    case Tier::kHost:
      return impl_->pools[1] != nullptr;
    case Tier::kFile:
      return impl_->file != nullptr;
  }
  return false;
}
int64_t TransferManager::tier_blocks(Tier tier) const { return impl_->Blocks(tier); }
int64_t TransferManager::file_staging_blocks() const { return impl_->staging_blocks; }
bool TransferManager::device_staged() const { return impl_->dstaging_blocks > 0; }
int64_t TransferManager::file_staging_free() const {
  std::lock_guard lock(impl_->mu);
  return impl_->staging_blocks - impl_->staging_used;
}
TieringMetrics TransferManager::metrics() const {
  TieringMetrics out;
  for (int d = 0; d < 9; ++d) {
    const internal::TierCopyCounters& c = (*impl_->counters)[d];
    if (c.batches.load() == 0) continue;
    TierCopyMetrics t;
    t.from = std::string(TierName(static_cast<Tier>(d / 3)));
    t.to = std::string(TierName(static_cast<Tier>(d % 3)));
    t.batches = c.batches.load();
    t.blocks = c.blocks.load();
    t.bytes = c.bytes.load();
    t.latency = c.latency.Snapshot();
    out.copies.push_back(std::move(t));
  }
  TransferStats s = stats();
  out.file_writes = s.file_writes;
  out.file_write_errors = s.file_write_errors;
  out.file_reads = s.file_reads;
  out.file_read_errors = s.file_read_errors;
  out.file_jobs_queued = s.file_jobs_queued;
  return out;
}

TransferStats TransferManager::stats() const {
  std::lock_guard lock(impl_->mu);
  TransferStats s = impl_->stats;
  s.file_jobs_queued = static_cast<int64_t>(impl_->jobs.size()) + (impl_->worker_busy ? 1 : 0);
  return s;
}

}  // namespace kvferry
