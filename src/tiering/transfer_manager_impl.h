// TransferManager's private state, shared by transfer_manager.cc (the public calls, Move and its
// steps) and transfer_manager_io.cc (the submit thread and the file I/O thread). Private to
// src/tiering. The mutex `mu` guards the ordering state, the staging ring and the queues; the
// caller's thread, the submit thread and the I/O thread take it. Checked by clang -Wthread-safety
// (GUARDED_BY / REQUIRES).
#pragma once

#include <array>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "base/thread_annotations.h"
#include "kvferry/slab_store.h"
#include "kvferry/tiering.h"
#include "metrics/atomic_histogram.h"
#include "tiering/copy_plan.h"

namespace kvferry {
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
  Mutex mu;
  std::condition_variable cv;
  bool host_done GUARDED_BY(mu) = false;  // the host-side part (file I/O) is over
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

namespace tm {

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
};

// Per block of the primary and host pools, the marks Move's checks use. Apart from BlockState:
// the caller's thread writes these, the submit thread the ordering state; sharing cache lines,
// every check of a batch of 60 blocks missed in the caller's cache (on the H200 VM, part of the
// engine-visible stall).
struct BlockMarks {
  uint64_t dst = 0;  // seq of the last batch that wrote it: catches duplicate destinations
  uint64_t src = 0;  // seq of the last batch that read it: catches a block read and written
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

// A checked batch for the submit thread: it orders the batch after earlier ones, plans and
// queues its copies (or hands it to the I/O thread), in Move order.
struct SubmitJob {
  std::shared_ptr<BatchState> batch;
  Tier from = Tier::kPrimary, to = Tier::kPrimary;
  std::vector<BlockMove> moves;
  int64_t staging_first = 0;
};

// A reused per-thread buffer of token counts (planning).
std::vector<int32_t>& TokensScratch();

}  // namespace tm
}  // namespace internal

using internal::BatchState;
using internal::tm::BlockMarks;
using internal::tm::BlockRef;
using internal::tm::BlockState;
using internal::tm::FileItem;
using internal::tm::FileJob;
using internal::tm::kOffloadStream;
using internal::tm::kOnboardStream;
using internal::tm::SubmitJob;
using internal::tm::TokensScratch;

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
  // Device staging of primary <-> host copies (DeviceStaging in tiering.h; device_staging.cc):
  // per copy stream, a buffer of two halves of `dstaging_half` packed blocks each, a pack stream
  // for the device-local leg, and the events that hand the halves between the two streams.
  Buffer dstaging[2];
  std::optional<PoolLayout> dstaging_layout;
  std::byte* dstaging_region[2][1] = {{nullptr}, {nullptr}};
  tiering::TierView dstaging_view[2];
  int64_t dstaging_blocks = 0;              // 0: copies go direct
  int64_t dstaging_half = 0;                // blocks per half (one chunk of a batch)
  std::unique_ptr<Event> stage_start[2];    // the copy stream's work so far (its waits)
  std::unique_ptr<Event> half_ready[2][2];  // a half was filled (gather or link copy)
  std::unique_ptr<Event> half_free[2][2];   // a half was emptied (link copy or scatter)
  // After the events they wait for: destroyed (drained) first.
  std::unique_ptr<Stream> pack_streams[2];

  // Guards what the caller's thread (Move and the other public calls) and the file worker share.
  mutable Mutex mu;
  std::condition_variable cv;  // staging freed, a batch recorded, the worker went idle
  std::vector<BlockState> state[2] GUARDED_BY(mu);
  std::vector<BlockMarks> marks[2] GUARDED_BY(mu);
  std::vector<std::shared_ptr<BatchState>> batches GUARDED_BY(mu);
  size_t batch_cursor GUARDED_BY(mu) = 0;
  uint64_t next_seq GUARDED_BY(mu) = 1;
  int64_t staging_head GUARDED_BY(mu) = 0;  // next to free
  int64_t staging_used GUARDED_BY(mu) = 0;
  int64_t unrecorded GUARDED_BY(mu) = 0;  // file onboards whose staging -> pool copy isn't queued
  std::deque<FileJob> jobs GUARDED_BY(mu);
  bool worker_busy GUARDED_BY(mu) = false;
  bool stop GUARDED_BY(mu) = false;  // the I/O thread: finish the queue, then end
  // Batches checked by Move, waiting for the submit thread (in Move order); `spare_moves` keeps
  // the move vectors of finished jobs so that Move does not allocate.
  std::deque<SubmitJob> submits GUARDED_BY(mu);
  std::vector<std::vector<BlockMove>> spare_moves GUARDED_BY(mu);
  bool submitter_busy GUARDED_BY(mu) = false;
  bool stop_submit GUARDED_BY(mu) = false;  // the submit thread: finish the queue, then end
  // Only the submit thread waits on submit_cv (so a Move wakes nothing else), and only while
  // `submitter_waiting`. While `plugs` > 0 (TransferManager::Plug) it takes no job (the queue
  // fills, one wake-up at the last Unplug), unless `kicked` (a wait that needs the queue to move:
  // until the queue is empty).
  std::condition_variable submit_cv;
  bool submitter_waiting GUARDED_BY(mu) = false;
  int plugs GUARDED_BY(mu) = 0;
  bool kicked GUARDED_BY(mu) = false;
  bool SubmitterMayRun() const REQUIRES(mu) {
    return stop_submit || (!submits.empty() && (plugs == 0 || kicked));
  }
  TransferStats stats GUARDED_BY(mu);
  // Set once at construction; the counters themselves are atomics.
  std::shared_ptr<internal::CopyCounters> counters = std::make_shared<internal::CopyCounters>();
  std::vector<CopyDesc> worker_desc GUARDED_BY(mu);     // reused planning buffer (worker, under mu)
  std::vector<BatchState*> deps GUARDED_BY(mu);         // reused (submit thread)
  std::vector<BatchState*> worker_deps GUARDED_BY(mu);  // reused (I/O thread)
  // The worker's own scratch, used outside mu (during file I/O): only the worker thread touches
  // it, so it has no lock to name.
  std::vector<SlotWrite> slot_writes;
  std::vector<SlotRead> slot_reads;
  // The submit thread's own scratch, used outside mu while it plans and queues copies.
  std::vector<CopyDesc> submit_desc;
  std::vector<BatchState*> submit_waits;
  // Held around each stream's copy submissions (CopyBatch reuses per-stream scratch): the submit
  // thread takes it without mu, the I/O thread under mu (order: mu, then stream_mu).
  std::mutex stream_mu[2];
  std::thread worker;
  std::thread submitter;

  ~Impl() {
    {
      MutexLock lock(mu);
      stop_submit = true;
    }
    submit_cv.notify_all();
    cv.notify_all();
    if (submitter.joinable()) submitter.join();  // before the worker: it may queue file jobs
    {
      MutexLock lock(mu);
      stop = true;
    }
    cv.notify_all();
    if (worker.joinable()) worker.join();
    for (auto& s : streams) {
      if (s) (void)s->Synchronize(Clock::now() + std::chrono::hours(1));
    }
  }

  // After queueing a submit job or unplugging (mu held): true when the submit thread must be
  // woken, by notify_one on submit_cv once mu is released (else it would wake to wait for mu).
  bool WakeSubmitter() const REQUIRES(mu) { return submitter_waiting && SubmitterMayRun(); }
  // Before a wait that needs the queued jobs submitted: runs them whatever the plug.
  void KickSubmitter() REQUIRES(mu) {
    if (submits.empty()) return;
    kicked = true;
    if (submitter_waiting) submit_cv.notify_one();
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

  // A batch state nobody references and whose batch has finished, or a new one. A state whose
  // end was already observed (the BlockManager retires an op only after TransferBatch::Query saw
  // it finish) is taken as it is: no lock and no event query, which on CUDA is a driver call on
  // the caller's thread, under `mu`. Others are checked as before.
  std::shared_ptr<BatchState> AcquireBatch() REQUIRES(mu) {
    for (size_t n = 0; n < batches.size(); ++n) {
      size_t i = (batch_cursor + n) % batches.size();
      auto& b = batches[i];
      if (b.use_count() != 1) continue;
      if (!b->observed.load()) {
        {
          MutexLock lock(b->mu);
          if (!b->host_done) continue;
        }
        if (!b->event->Query()) continue;
        b->ObserveDone();
      }
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
  // `out` is the calling thread's own list: the wait lets the other thread (submit or I/O) run.
  void AddDep(MutexLock& lock, const BlockRef& r, int stream, uint64_t mark,
              std::vector<BatchState*>& out) REQUIRES(mu) {
    if (r.b == nullptr) return;
    lock.Wait(cv, [&]() REQUIRES(mu) { return r.b->seq != r.seq || r.b->recorded.load(); });
    if (r.b->seq != r.seq) return;  // recycled: finished long ago
    if (r.b->stream == stream || r.b->dep_mark == mark) return;
    if (r.b->event->Query()) return;
    r.b->dep_mark = mark;
    out.push_back(r.b);
  }

  Status EnqueueWaits(int stream, std::span<BatchState* const> waits) {
    for (BatchState* d : waits) KVF_RETURN_IF_ERROR(streams[stream]->Wait(*d->event));
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

  // True when a primary <-> host batch goes through device staging (set up at Create): every move
  // copies whole blocks. A batch with partial moves goes direct: on the H200 its link leg is the
  // gather kernel over 16 KiB rows either way, and staged partial rows measured 0.85-0.88 of one
  // contiguous copy against 0.82-0.92 direct (the single-block partial copies of a prefix hit
  // would also pay two legs' latency).
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

  // Device staging (device_staging.cc). CopyStaged queues a staged batch on copy stream
  // `stream` (its waits already enqueued), chunk by chunk through the two halves of that stream's
  // staging, the device-local leg on the stream's pack stream; returns descriptors queued and adds
  // the bytes moved. SetUpDeviceStaging decides at Create whether staging pays and allocates it.
  StatusOr<size_t> CopyStaged(int stream, Tier from, Tier to, std::span<const BlockMove> moves,
                              std::span<const int32_t> toks, std::vector<CopyDesc>& desc,
                              int64_t* bytes);
  // A direct primary <-> host (or primary -> primary) batch on copy stream `stream` (its waits
  // already enqueued), planned and queued in slices of kFirstDirectSlice, then twice as many moves
  // each time; returns descriptors queued and adds the bytes moved (transfer_manager.cc).
  static constexpr size_t kFirstDirectSlice = 16;
  StatusOr<size_t> CopyDirect(int stream, Tier from, Tier to, std::span<const BlockMove> moves,
                              std::span<const int32_t> toks, std::vector<CopyDesc>& desc,
                              int64_t* bytes);
  Status SetUpDeviceStaging(const TransferOptions& o);

  // Move's steps, in order; the caller holds `lock` on mu throughout.
  Status CheckMoves(Tier from, Tier to, std::span<const BlockMove> moves, uint64_t seq)
      REQUIRES(mu);
  std::shared_ptr<BatchState> StartBatch(Tier from, Tier to, size_t n, uint64_t seq) REQUIRES(mu);
  int64_t ReserveStaging(MutexLock& lock, int64_t n) REQUIRES(mu);
  // The submit thread: runs the rest of each Move (below) in order.
  void SubmitLoop();
  bool StartSubmit(MutexLock& lock, SubmitJob& job) REQUIRES(mu);
  void FinishSubmit(SubmitJob& job, int64_t bytes) REQUIRES(mu);
  std::vector<BlockRef> OrderAfterEarlierBatches(MutexLock& lock, Tier from, Tier to,
                                                 std::span<const BlockMove> moves, BatchState& b)
      REQUIRES(mu);
  TransferBatch QueueFileRead(std::shared_ptr<BatchState> b, Tier to,
                              std::span<const BlockMove> moves, int64_t staging_first,
                              std::vector<BlockRef> deps) REQUIRES(mu);
  // Runs without mu (the submit thread's scratch): waits for `waits`, plans and queues the copies
  // and records the batch's event; adds the bytes copied to `bytes`.
  Status EnqueueCopies(BatchState& b, Tier from, Tier to, std::span<const BlockMove> moves,
                       int64_t staging_first, std::span<BatchState* const> waits, int64_t* bytes);
  void QueueFileWrite(std::shared_ptr<BatchState> b, Tier from, std::span<const BlockMove> moves,
                      int64_t staging_first) REQUIRES(mu);
  int64_t StagingSlot(int64_t first, size_t i) const {
    return (first + static_cast<int64_t>(i)) % std::max<int64_t>(staging_blocks, 1);
  }

  void WorkerLoop();
  void RunWrite(FileJob& job);
  int64_t RunFileIo(FileJob& job, const Status& before);
  void RunRead(FileJob& job);
  void FinishHost(BatchState& b) {
    {
      MutexLock lock(b.mu);
      b.host_done = true;
    }
    b.cv.notify_all();
  }
  void FreeStaging(int64_t n) {
    MutexLock lock(mu);
    staging_head = (staging_head + n) % std::max<int64_t>(staging_blocks, 1);
    staging_used -= n;
  }
};

}  // namespace kvferry
