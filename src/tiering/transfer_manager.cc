// TransferManager: see include/kvferry/tiering.h for the contract.
#include <fmt/format.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>

#include "base/log.h"
#include "base/thread_annotations.h"
#include "kvferry/config.h"
#include "kvferry/slab_store.h"
#include "kvferry/tiering.h"
#include "metrics/atomic_histogram.h"
#include "tiering/copy_plan.h"
#include "tiering/transfer_manager_impl.h"

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

bool TransferBatch::Query() const {
  if (!s_) return true;
  {
    MutexLock lock(s_->mu);
    if (!s_->host_done) return false;
  }
  if (!s_->event->Query()) return false;
  s_->ObserveDone();
  return true;
}

Status TransferBatch::Wait(Deadline deadline) const {
  if (!s_) return Status::Ok();
  {
    MutexLock lock(s_->mu);
    if (!lock.WaitUntil(s_->cv, deadline, [&]() REQUIRES(s_->mu) { return s_->host_done; })) {
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

namespace internal::tm {
std::vector<int32_t>& TokensScratch() {
  thread_local std::vector<int32_t> v;
  return v;
}
}  // namespace internal::tm

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
  if (primary.block_scales() != nullptr) {
    return Status::InvalidArgument(
        "transfer manager: the primary pool has per-block scales, which the tiers do not move "
        "yet (an onboarded block would come back without its scales)");
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
    MutexLock lock(impl->mu);
    impl->state[i].resize(static_cast<size_t>(p->blocks()));
    impl->marks[i].resize(static_cast<size_t>(p->blocks()));
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
  Impl* raw = impl.get();
  impl->submitter = std::thread([raw] { raw->SubmitLoop(); });
  return std::unique_ptr<TransferManager>(new TransferManager(std::move(impl)));
}

// Moves `moves` from one tier to another as one batch: checked, ordered after the batches it
// depends on, then queued on a copy stream (and, for the file tier, to the I/O thread).
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
  bool wake = false;
  std::shared_ptr<BatchState> b;
  {
    MutexLock lock(m.mu);
    const uint64_t seq = ++m.next_seq;
    KVF_RETURN_IF_ERROR(m.CheckMoves(from, to, moves, seq));
    b = m.StartBatch(from, to, moves.size(), seq);
    if (!b) return Status::ResourceExhausted("transfer manager: could not create an event");
    const bool file_io = from == Tier::kFile || to == Tier::kFile;
    SubmitJob job;
    job.batch = b;
    job.from = from;
    job.to = to;
    job.staging_first = file_io ? m.ReserveStaging(lock, static_cast<int64_t>(moves.size())) : 0;
    if (!m.spare_moves.empty()) {
      job.moves = std::move(m.spare_moves.back());
      m.spare_moves.pop_back();
    }
    job.moves.assign(moves.begin(), moves.end());
    m.submits.push_back(std::move(job));
    wake = m.WakeSubmitter();
  }
  // Outside the mutex: the submit thread wakes to a free lock instead of waiting for ours.
  if (wake) m.submit_cv.notify_one();
  return TransferBatch(std::move(b));
}

void TransferManager::Plug() {
  MutexLock lock(impl_->mu);
  ++impl_->plugs;
}

void TransferManager::Unplug() {
  Impl& m = *impl_;
  bool wake = false;
  {
    MutexLock lock(m.mu);
    --m.plugs;
    wake = m.WakeSubmitter();
  }
  if (wake) m.submit_cv.notify_one();
}

// The submit thread's part of a Move, in Move order: ordering after earlier batches (which may
// wait for a file onboard's copy to be queued), then either the file read handed to the I/O
// thread (returns false) or, for the copies, the batches to wait for in `submit_waits` (returns
// true: the caller queues the copies without the lock, then calls FinishSubmit).
bool TransferManager::Impl::StartSubmit(MutexLock& lock, SubmitJob& job) {
  std::vector<BlockRef> read_deps =
      OrderAfterEarlierBatches(lock, job.from, job.to, job.moves, *job.batch);
  if (job.from == Tier::kFile) {
    QueueFileRead(job.batch, job.to, job.moves, job.staging_first, std::move(read_deps));
    return false;
  }
  submit_waits.assign(deps.begin(), deps.end());
  return true;
}

// After the copies are queued: the batch is recorded; a write goes to the I/O thread (also one
// whose copy failed: it skips the write and frees its staging in ring order), anything else is
// done on the host side.
void TransferManager::Impl::FinishSubmit(SubmitJob& job, int64_t bytes) {
  BatchState& b = *job.batch;
  b.recorded.store(true);
  stats.descriptors += static_cast<int64_t>(b.descriptors);
  stats.bytes += bytes;
  (*counters)[b.direction].bytes += bytes;
  if (job.to == Tier::kFile) {
    QueueFileWrite(job.batch, job.from, job.moves, job.staging_first);
  } else {
    FinishHost(b);
  }
}

void TransferManager::Impl::SubmitLoop() {
  MutexLock lock(mu);
  while (true) {
    submitter_waiting = true;
    lock.Wait(submit_cv, [&]() REQUIRES(mu) { return SubmitterMayRun(); });
    submitter_waiting = false;
    if (submits.empty()) return;
    SubmitJob job = std::move(submits.front());
    submits.pop_front();
    if (submits.empty()) kicked = false;
    submitter_busy = true;
    if (StartSubmit(lock, job)) {
      lock.Unlock();
      int64_t bytes = 0;
      // A failure is in the batch's items.
      (void)EnqueueCopies(*job.batch, job.from, job.to, job.moves, job.staging_first, submit_waits,
                          &bytes);
      lock.Lock();
      FinishSubmit(job, bytes);
    }
    job.moves.clear();
    spare_moves.push_back(std::move(job.moves));
    submitter_busy = false;
    cv.notify_all();
  }
}

// Every item in range, no destination written twice, no block both read and written within one
// tier (the copies of a batch are unordered), a file batch within the staging.
Status TransferManager::Impl::CheckMoves(Tier from, Tier to, std::span<const BlockMove> moves,
                                         uint64_t seq) {
  const int64_t tpb = pools[0]->shape().tokens_per_block;
  const int64_t nsrc = Blocks(from), ndst = Blocks(to);
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
      BlockMarks& d = marks[static_cast<int>(to)][mv.dst];
      if (d.dst == seq) {
        return Status::InvalidArgument(
            fmt::format("move item {}: {} block {} is the destination of two moves of one batch", i,
                        TierName(to), mv.dst));
      }
      d.dst = seq;
    }
    if (from == to) {
      BlockMarks& src = marks[static_cast<int>(from)][mv.src];
      if (src.dst == seq || marks[static_cast<int>(to)][mv.dst].src == seq) {
        return Status::InvalidArgument(
            fmt::format("move item {}: {} block {} is both read and written by one batch", i,
                        TierName(from), src.dst == seq ? mv.src : mv.dst));
      }
      src.src = seq;
    }
  }
  const bool file_io = from == Tier::kFile || to == Tier::kFile;
  if (file_io && static_cast<int64_t>(moves.size()) > staging_blocks) {
    return Status::InvalidArgument(
        fmt::format("a file batch of {} blocks exceeds the file staging of {} blocks; split it",
                    moves.size(), staging_blocks));
  }
  return Status::Ok();
}

// A recycled batch state set up for this use (`seq`), counted in the stats; null when no event
// could be made.
std::shared_ptr<BatchState> TransferManager::Impl::StartBatch(Tier from, Tier to, size_t n,
                                                              uint64_t seq) {
  std::shared_ptr<BatchState> b = AcquireBatch();
  if (!b) return nullptr;
  // `seq` is this use of the batch state: references made now go stale when it is recycled.
  b->seq = seq;
  b->stream = static_cast<int>(to) > static_cast<int>(from) ? kOffloadStream : kOnboardStream;
  b->recorded.store(false);
  b->dep_mark = 0;
  b->descriptors = 0;
  b->items.assign(n, Status::Ok());
  b->counters = counters;
  b->direction = static_cast<int>(from) * 3 + static_cast<int>(to);
  b->submitted = Clock::now();
  b->observed = false;
  {
    MutexLock bl(b->mu);
    b->host_done = false;  // until the submit thread (or, for file batches, the I/O thread) is done
  }
  ++stats.batches;
  stats.blocks += static_cast<int64_t>(n);
  ++(*counters)[b->direction].batches;
  (*counters)[b->direction].blocks += static_cast<int64_t>(n);
  return b;
}

// The first of `n` consecutive staging blocks, waiting (lock released) until they are free.
int64_t TransferManager::Impl::ReserveStaging(MutexLock& lock, int64_t n) {
  if (staging_used + n > staging_blocks) KickSubmitter();  // plugged jobs may hold it
  lock.Wait(cv, [&]() REQUIRES(mu) { return staging_used + n <= staging_blocks; });
  const int64_t first = (staging_head + staging_used) % staging_blocks;
  staging_used += n;
  return first;
}

// Collects in `deps` the batches this one must wait for (pool sides only; file slots are ordered
// by the I/O thread) and records it as the last writer / a reader of its blocks. For a file read,
// whose copy the I/O thread queues later, returns the references that copy must wait for instead.
std::vector<BlockRef> TransferManager::Impl::OrderAfterEarlierBatches(
    MutexLock& lock, Tier from, Tier to, std::span<const BlockMove> moves, BatchState& b) {
  const int stream = b.stream;
  const uint64_t mark = b.seq;
  deps.clear();
  std::vector<BlockRef> read_deps;
  for (const BlockMove& mv : moves) {
    if (from != Tier::kFile)
      AddDep(lock, state[static_cast<int>(from)][mv.src].write, stream, mark, deps);
    if (to == Tier::kFile) continue;
    BlockState& d = state[static_cast<int>(to)][mv.dst];
    for (const BlockRef* r : {&d.write, &d.read[0], &d.read[1]}) {
      if (from != Tier::kFile) {
        AddDep(lock, *r, stream, mark, deps);
      } else if (r->b != nullptr) {
        read_deps.push_back(*r);
      }
    }
  }
  for (const BlockMove& mv : moves) {
    if (from != Tier::kFile) state[static_cast<int>(from)][mv.src].read[stream] = {&b, b.seq};
    if (to != Tier::kFile) {
      BlockState& d = state[static_cast<int>(to)][mv.dst];
      d.write = {&b, b.seq};
      d.read[0] = d.read[1] = {};  // the write waits for them: waiting for it covers them
    }
  }
  return read_deps;
}

// A file read goes to the I/O thread, which queues the staging -> pool copy after the read.
TransferBatch TransferManager::Impl::QueueFileRead(std::shared_ptr<BatchState> b, Tier to,
                                                   std::span<const BlockMove> moves,
                                                   int64_t staging_first,
                                                   std::vector<BlockRef> deps) {
  FileJob job;
  job.batch = b;
  job.write = false;
  job.pool_tier = to;
  job.staging_count = static_cast<int64_t>(moves.size());
  job.deps = std::move(deps);
  for (size_t i = 0; i < moves.size(); ++i) {
    job.items.push_back(FileItem{moves[i].dst, moves[i].src, StagingSlot(staging_first, i),
                                 moves[i].tokens, moves[i].key});
  }
  ++unrecorded;
  jobs.push_back(std::move(job));
  cv.notify_all();
  return TransferBatch(std::move(b));
}

// The waits, the copies (planned here: direct, through device staging, or into file staging) and
// the batch's event, on its stream. A failure fails every item.
Status TransferManager::Impl::EnqueueCopies(BatchState& b, Tier from, Tier to,
                                            std::span<const BlockMove> moves, int64_t staging_first,
                                            std::span<BatchState* const> waits, int64_t* bytes) {
  auto& toks = TokensScratch();
  toks.clear();
  for (const BlockMove& mv : moves) toks.push_back(mv.tokens);
  std::vector<CopyDesc>& desc = submit_desc;
  desc.clear();
  const bool staged = Staged(from, to, moves);
  if (to == Tier::kFile) {  // staging holds whole blocks: the file always stores the whole block
    Plan(
        views[static_cast<int>(from)], staging_view, moves.size(),
        [&](size_t i) { return moves[i].src; },
        [&](size_t i) { return StagingSlot(staging_first, i); }, toks, desc, bytes);
  }
  size_t ndesc = desc.size();
  Status st;
  {
    std::lock_guard<std::mutex> streamed(stream_mu[b.stream]);
    st = EnqueueWaits(b.stream, waits);
    if (st.ok() && to == Tier::kFile) {  // into file staging, planned above
      if (!desc.empty()) st = streams[b.stream]->CopyBatch(desc);
    } else if (st.ok()) {
      auto copied = staged ? CopyStaged(b.stream, from, to, moves, toks, desc, bytes)
                           : CopyDirect(b.stream, from, to, moves, toks, desc, bytes);
      st = copied.status();
      ndesc = copied.ok() ? *copied : 0;
    }
    if (st.ok()) st = streams[b.stream]->Record(*b.event);
  }
  b.descriptors = ndesc;
  if (!st.ok()) {
    for (Status& item : b.items) item = st;
  }
  return st;
}

// Plans and queues a direct batch in slices of moves that double from kFirstDirectSlice, so the
// copies of the first blocks run while the rest are planned: a 1 GiB per-layer batch is 16-32k
// descriptors, whose planning and routing would otherwise all come before the first byte moves
// (docs/tiering.md, "Planning overlapped with the copies").
StatusOr<size_t> TransferManager::Impl::CopyDirect(int stream, Tier from, Tier to,
                                                   std::span<const BlockMove> moves,
                                                   std::span<const int32_t> toks,
                                                   std::vector<CopyDesc>& desc, int64_t* bytes) {
  const tiering::TierView& sv = views[static_cast<int>(from)];
  const tiering::TierView& dv = views[static_cast<int>(to)];
  size_t descs = 0;
  for (size_t at = 0, n = kFirstDirectSlice; at < moves.size(); at += n, n *= 2) {
    n = std::min(n, moves.size() - at);
    desc.clear();
    Plan(
        sv, dv, n, [&](size_t i) { return moves[at + i].src; },
        [&](size_t i) { return moves[at + i].dst; }, toks.subspan(at, n), desc, bytes);
    descs += desc.size();
    if (!desc.empty()) KVF_RETURN_IF_ERROR(streams[stream]->CopyBatch(desc));
  }
  return descs;
}

// A write to the file tier: the I/O thread writes the staged blocks once the copy is done.
void TransferManager::Impl::QueueFileWrite(std::shared_ptr<BatchState> b, Tier from,
                                           std::span<const BlockMove> moves,
                                           int64_t staging_first) {
  FileJob job;
  job.batch = std::move(b);
  job.write = true;
  job.pool_tier = from;
  job.staging_count = static_cast<int64_t>(moves.size());
  for (size_t i = 0; i < moves.size(); ++i) {
    job.items.push_back(FileItem{moves[i].src, moves[i].dst, StagingSlot(staging_first, i),
                                 moves[i].tokens, moves[i].key});
  }
  jobs.push_back(std::move(job));
  cv.notify_all();
}

Status TransferManager::SyncWithCompute(Stream& compute) {
  Impl& m = *impl_;
  MutexLock lock(m.mu);
  m.KickSubmitter();
  lock.Wait(m.cv, [&]() REQUIRES(m.mu) {
    return m.submits.empty() && !m.submitter_busy && m.unrecorded == 0;
  });
  for (int i = 0; i < 2; ++i) {
    KVF_RETURN_IF_ERROR(m.streams[i]->Record(*m.sync_events[i]));
    KVF_RETURN_IF_ERROR(compute.Wait(*m.sync_events[i]));
  }
  return Status::Ok();
}

Status TransferManager::WaitForCompute(Stream& compute) {
  Impl& m = *impl_;
  MutexLock lock(m.mu);
  KVF_RETURN_IF_ERROR(compute.Record(*m.compute_event));
  for (auto& s : m.streams) KVF_RETURN_IF_ERROR(s->Wait(*m.compute_event));
  return Status::Ok();
}

Status TransferManager::Drain(Deadline deadline) {
  Impl& m = *impl_;
  {
    MutexLock lock(m.mu);
    m.KickSubmitter();
    if (!lock.WaitUntil(m.cv, deadline, [&]() REQUIRES(m.mu) {
          return m.submits.empty() && !m.submitter_busy && m.jobs.empty() && !m.worker_busy;
        })) {
      return Status::DeadlineExceeded(
          "transfer manager: batches still being queued or in file I/O");
    }
    for (auto& s : m.streams) KVF_RETURN_IF_ERROR(s->Synchronize(deadline));
  }
  return Status::Ok();
}

Status TransferManager::WaitSubmitted(Deadline deadline) {
  Impl& m = *impl_;
  MutexLock lock(m.mu);
  m.KickSubmitter();
  if (!lock.WaitUntil(m.cv, deadline,
                      [&]() REQUIRES(m.mu) { return m.submits.empty() && !m.submitter_busy; })) {
    return Status::DeadlineExceeded(
        fmt::format("transfer manager: {} batches still waiting for the submit thread",
                    m.submits.size() + (m.submitter_busy ? 1 : 0)));
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
  MutexLock lock(impl_->mu);
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
  MutexLock lock(impl_->mu);
  TransferStats s = impl_->stats;
  s.file_jobs_queued = static_cast<int64_t>(impl_->jobs.size()) + (impl_->worker_busy ? 1 : 0);
  for (const SubmitJob& j : impl_->submits) {
    s.file_jobs_queued += j.from == Tier::kFile || j.to == Tier::kFile;
  }
  s.submits_queued = static_cast<int64_t>(impl_->submits.size()) + (impl_->submitter_busy ? 1 : 0);
  return s;
}

}  // namespace kvferry
