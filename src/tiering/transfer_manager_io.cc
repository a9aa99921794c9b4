// TransferManager, the file I/O thread: it runs the queued file writes (after their copy into
// staging) and reads (then queues the staging -> pool copy behind what it must wait for).
#include <fmt/format.h>

#include "tiering/transfer_manager_impl.h"

namespace kvferry {

void TransferManager::Impl::WorkerLoop() {
  MutexLock lock(mu);
  while (true) {
    lock.Wait(cv, [&]() REQUIRES(mu) { return stop || !jobs.empty(); });
    if (jobs.empty()) return;
    FileJob job = std::move(jobs.front());
    jobs.pop_front();
    worker_busy = true;
    lock.Unlock();
    if (job.write) {
      RunWrite(job);
    } else {
      RunRead(job);
    }
    FreeStaging(job.staging_count);
    FinishHost(*job.batch);
    lock.Lock();
    worker_busy = false;
    cv.notify_all();
  }
}

// The one file-I/O step of both directions: a SlabStore batch over the job's staging blocks
// (skipped when `before` failed: each item then fails with it), each item's status named by its
// block and slot. Returns the items that failed.
int64_t TransferManager::Impl::RunFileIo(FileJob& job, const Status& before) {
  BatchState& b = *job.batch;
  const int64_t block_bytes = staging_layout->block_bytes();
  auto fill = [&](auto& out) {
    out.clear();
    for (const FileItem& it : job.items) {
      out.push_back({it.slot, SlotKey{it.key.hi, it.key.lo},
                     staging.data() + it.staging * block_bytes, block_bytes,
                     MemoryKind::kPinnedHost});
    }
  };
  std::vector<Status> results;
  if (before.ok() && job.write) {
    fill(slot_writes);
    results = file->Write(slot_writes);
  } else if (before.ok()) {
    fill(slot_reads);
    results = file->Read(slot_reads);
  }
  int64_t errors = 0;
  for (size_t i = 0; i < job.items.size(); ++i) {
    const FileItem& it = job.items[i];
    Status st = !before.ok()         ? before
                : i < results.size() ? results[i]
                                     : Status::Internal(fmt::format("SlabStore::{}: missing result",
                                                                    job.write ? "Write" : "Read"));
    if (!st.ok()) {
      st = st.WithContext(job.write ? fmt::format("offload of {} block {} to file slot {}",
                                                  TierName(job.pool_tier), it.pool_block, it.slot)
                                    : fmt::format("onboard of file slot {} to {} block {}", it.slot,
                                                  TierName(job.pool_tier), it.pool_block));
      ++errors;
    }
    b.items[i] = std::move(st);
  }
  return errors;
}

void TransferManager::Impl::RunWrite(FileJob& job) {
  BatchState& b = *job.batch;
  // Items already failed: the copy into staging was not queued (the submit thread said why).
  Status copied = !b.items.empty() && !b.items[0].ok()
                      ? b.items[0]
                      : b.event->Synchronize(Clock::now() + std::chrono::hours(1));
  if (!copied.ok()) copied = copied.WithContext("copy to file staging");
  const int64_t errors = RunFileIo(job, copied);
  MutexLock lock(mu);
  stats.file_writes += static_cast<int64_t>(job.items.size());
  stats.file_write_errors += errors;
}

void TransferManager::Impl::RunRead(FileJob& job) {
  BatchState& b = *job.batch;
  const int64_t errors = RunFileIo(job, Status::Ok());
  const int pool = static_cast<int>(job.pool_tier);
  {
    MutexLock lock(mu);
    stats.file_reads += static_cast<int64_t>(job.items.size());
    stats.file_read_errors += errors;
    ++next_seq;  // a fresh dedup mark
    worker_deps.clear();
    const uint64_t mark = next_seq;
    for (const BlockRef& r : job.deps) AddDep(lock, r, kOnboardStream, mark, worker_deps);
    std::lock_guard<std::mutex> streamed(stream_mu[kOnboardStream]);
    Status st = EnqueueWaits(kOnboardStream, worker_deps);
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

}  // namespace kvferry
