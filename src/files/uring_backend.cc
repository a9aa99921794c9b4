// The io_uring backend: a whole batch goes into one ring (up to queue_depth in flight), one
// submit per refill, completions reaped with the batch deadline. Short transfers are resubmitted
// for the rest; -EINTR/-EAGAIN are retried. On the deadline, everything in flight is cancelled
// and reaped before returning, so the kernel never holds a caller's buffer after Write/Read
// returns. Rings are pooled: concurrent batches each take their own ring.
#include <liburing.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <mutex>

#include "base/log.h"
#include "files/posix_io.h"
#include "kvferry/file_backend.h"

namespace kvferry {
namespace {

using files_internal::CheckIo;
using files_internal::ErrnoStatus;
using files_internal::PosixFile;

constexpr uint64_t kCancelTag = ~uint64_t{0};
constexpr size_t kMaxIov = 16;

// Move-less owner of one ring.
class Ring {
 public:
  Ring() = default;
  ~Ring() {
    if (ok_) io_uring_queue_exit(&ring_);
  }
  Ring(const Ring&) = delete;
  Ring& operator=(const Ring&) = delete;
  Status Init(unsigned entries) {
    int rc = io_uring_queue_init(entries, &ring_, 0);
    if (rc < 0) {
      return Status::Unavailable(
          fmt::format("io_uring_queue_init({}): {}", entries, strerror(-rc)));
    }
    ok_ = true;
    return Status::Ok();
  }
  io_uring* get() { return &ring_; }

 private:
  io_uring ring_{};
  bool ok_ = false;
};

struct ItemState {
  int64_t total = 0;
  int64_t done = 0;
  std::array<iovec, kMaxIov> iov;
  int niov = 0;
  bool in_flight = false;
  bool finished = false;
};

class UringFileBackend : public FileBackend {
 public:
  explicit UringFileBackend(FileBackendCaps caps) : caps_(std::move(caps)) {}

  const FileBackendCaps& caps() const override { return caps_; }

  StatusOr<std::unique_ptr<BackendFile>> Open(const std::string& path, int64_t size) override {
    KVF_ASSIGN_OR_RETURN(std::unique_ptr<PosixFile> f,
                         files_internal::OpenPosixFile(path, size, caps_.direct_io));
    return std::unique_ptr<BackendFile>(std::move(f));
  }

  std::vector<Status> Write(std::span<const FileIo> ios, Deadline deadline) override {
    return Run(true, ios, deadline);
  }
  std::vector<Status> Read(std::span<const FileIo> ios, Deadline deadline) override {
    return Run(false, ios, deadline);
  }

 private:
  StatusOr<std::unique_ptr<Ring>> TakeRing() {
    {
      std::lock_guard<std::mutex> l(mu_);
      if (!rings_.empty()) {
        auto r = std::move(rings_.back());
        rings_.pop_back();
        return r;
      }
    }
    auto r = std::make_unique<Ring>();
    KVF_RETURN_IF_ERROR(r->Init(static_cast<unsigned>(caps_.max_in_flight)));
    return r;
  }
  void GiveRing(std::unique_ptr<Ring> r) {
    std::lock_guard<std::mutex> l(mu_);
    rings_.push_back(std::move(r));
  }

  std::vector<Status> Run(bool write, std::span<const FileIo> ios, Deadline deadline);

  const FileBackendCaps caps_;
  std::mutex mu_;
  std::vector<std::unique_ptr<Ring>> rings_;  // guarded by mu_
};

// Points st.iov at the part of the segments not yet transferred.
void BuildIov(const FileIo& io, ItemState& st) {
  int64_t skip = st.done;
  st.niov = 0;
  for (const IoSegment& s : io.segments) {
    if (skip >= s.bytes) {
      skip -= s.bytes;
      continue;
    }
    st.iov[st.niov].iov_base = static_cast<char*>(s.data) + skip;
    st.iov[st.niov].iov_len = static_cast<size_t>(s.bytes - skip);
    skip = 0;
    ++st.niov;
  }
}

// One Write or Read call: admits the items, keeps up to max_in_flight of them in the ring,
// resubmits short transfers, and past the deadline cancels what is in flight and waits until the
// kernel holds none of the caller's buffers.
class UringRun {
 public:
  enum class End { kDone, kDeadline, kRingBroken };

  UringRun(const FileBackendCaps& caps, bool write, std::span<const FileIo> ios)
      : caps_(caps),
        write_(write),
        op_(write ? "write" : "read"),
        ios_(ios),
        out_(ios.size()),
        items_(ios.size()) {}

  // Checks every item (errors go to its result); false when none needs the ring.
  bool Admit() {
    queue_.reserve(ios_.size());
    for (size_t i = 0; i < ios_.size(); ++i) {
      out_[i] = CheckIo(caps_, ios_[i]);
      if (out_[i].ok() && ios_[i].segments.size() > kMaxIov) {
        out_[i] = Status::InvalidArgument(
            fmt::format("{} segments in one I/O; at most {}", ios_[i].segments.size(), kMaxIov));
      }
      items_[i].total = out_[i].ok() ? files_internal::IoBytes(ios_[i]) : 0;
      if (items_[i].total == 0) {
        items_[i].finished = true;
        continue;
      }
      queue_.push_back(i);
    }
    return !queue_.empty();
  }

  void FailQueued(const Status& st) {
    for (size_t i : queue_) out_[i] = st;
  }

  // Submits and reaps until every item finished, the deadline passed or the ring broke (then
  // every unfinished item carries the ring's error and nothing prepared can be trusted to run).
  End Pump(io_uring* r, Deadline deadline) {
    while (true) {
      Refill(r);
      if (in_flight_ == 0) return End::kDone;
      int rc = io_uring_submit(r);
      if (rc < 0 && rc != -EINTR && rc != -EAGAIN && rc != -EBUSY) {
        FailUnfinished(Status::Internal(fmt::format("io_uring_submit: {}", strerror(-rc))));
        return End::kRingBroken;
      }
      auto left = std::chrono::duration_cast<std::chrono::nanoseconds>(deadline - Clock::now());
      if (left.count() <= 0) return End::kDeadline;
      __kernel_timespec ts;
      ts.tv_sec = left.count() / 1000000000;
      ts.tv_nsec = left.count() % 1000000000;
      io_uring_cqe* cqe = nullptr;
      rc = io_uring_wait_cqe_timeout(r, &cqe, &ts);
      if (rc == -EINTR) continue;
      if (rc < 0) return End::kDeadline;  // -ETIME, or a failed wait: cancel and drain
      ReapReady(r);
    }
  }

  // Cancels what is in flight and waits (unbounded, but cancelled or finishing file I/O ends
  // promptly) for it; false when the ring could not be drained (the caller must leak it rather
  // than free memory the kernel may still write).
  bool CancelAndDrain(io_uring* r) {
    int cancels = 0;
    for (size_t i = 0; i < items_.size(); ++i) {
      if (!items_[i].in_flight) continue;
      io_uring_sqe* sqe = io_uring_get_sqe(r);
      if (sqe == nullptr) {
        io_uring_submit(r);
        sqe = io_uring_get_sqe(r);
      }
      io_uring_prep_cancel64(sqe, i, 0);
      io_uring_sqe_set_data64(sqe, kCancelTag);
      ++cancels;
    }
    io_uring_submit(r);
    while (in_flight_ > 0 || cancels > 0) {
      io_uring_cqe* cqe = nullptr;
      int rc = io_uring_wait_cqe(r, &cqe);
      if (rc == -EINTR) continue;
      if (rc < 0) {
        Log(LogLevel::kError, "io_uring: can't drain after deadline: {}", strerror(-rc));
        return false;
      }
      const uint64_t tag = io_uring_cqe_get_data64(cqe);
      if (tag == kCancelTag) {
        --cancels;
      } else {
        // A cancelled item completes with -ECANCELED (an error, recorded as the deadline by
        // FailAtDeadline); one that finished anyway keeps its result.
        if (cqe->res != -ECANCELED) (void)Complete(tag, cqe->res);
        if (items_[tag].in_flight) {
          items_[tag].in_flight = false;
          --in_flight_;
        }
      }
      io_uring_cqe_seen(r, cqe);
    }
    return true;
  }

  void FailAtDeadline() {
    for (size_t i = 0; i < items_.size(); ++i) {
      if (items_[i].finished) continue;
      out_[i] = Status::DeadlineExceeded(fmt::format(
          "{} of {} at offset {} did not finish before the deadline ({} of {} bytes done)", op_,
          ios_[i].file->path(), ios_[i].offset, items_[i].done, items_[i].total));
    }
  }

  std::vector<Status> TakeResults() { return std::move(out_); }

 private:
  // Retries first, then new items, up to the depth.
  void Refill(io_uring* r) {
    while (in_flight_ < caps_.max_in_flight && (!resubmit_.empty() || next_ < queue_.size())) {
      size_t i;
      if (!resubmit_.empty()) {
        i = resubmit_.back();
        resubmit_.pop_back();
      } else {
        i = queue_[next_++];
      }
      Prep(r, i);
    }
  }

  void Prep(io_uring* r, size_t i) {
    io_uring_sqe* sqe = io_uring_get_sqe(r);
    ItemState& st = items_[i];
    BuildIov(ios_[i], st);
    const int fd = static_cast<const PosixFile*>(ios_[i].file)->fd();
    const off_t off = static_cast<off_t>(ios_[i].offset + st.done);
    if (write_) {
      io_uring_prep_writev(sqe, fd, st.iov.data(), static_cast<unsigned>(st.niov), off);
    } else {
      io_uring_prep_readv(sqe, fd, st.iov.data(), static_cast<unsigned>(st.niov), off);
    }
    io_uring_sqe_set_data64(sqe, i);
    st.in_flight = true;
    ++in_flight_;
  }

  // Every completion queued now; items that need another submission go to resubmit_.
  void ReapReady(io_uring* r) {
    unsigned head;
    unsigned seen = 0;
    io_uring_cqe* cqe;
    io_uring_for_each_cqe(r, head, cqe) {
      ++seen;
      const uint64_t tag = io_uring_cqe_get_data64(cqe);
      if (tag == kCancelTag) continue;
      if (!Complete(static_cast<size_t>(tag), cqe->res)) resubmit_.push_back(tag);
    }
    io_uring_cq_advance(r, seen);
  }

  // Records a completion; false when the item needs another submission (short transfer, EINTR).
  bool Complete(size_t i, int res) {
    ItemState& st = items_[i];
    st.in_flight = false;
    --in_flight_;
    if (res == -EINTR || res == -EAGAIN) return false;
    if (res < 0) {
      out_[i] = ErrnoStatus(-res, op_, ios_[i].file->path(), ios_[i].offset + st.done);
    } else if (res == 0) {
      out_[i] = write_ ? Status::DataLoss(
                             fmt::format("short write to {} at offset {}: {} of {} bytes",
                                         ios_[i].file->path(), ios_[i].offset, st.done, st.total))
                       : Status::DataLoss(
                             fmt::format("truncated file {}: read {} of {} bytes at offset {}",
                                         ios_[i].file->path(), st.done, st.total, ios_[i].offset));
    } else {
      st.done += res;
      if (st.done < st.total) return false;
    }
    st.finished = true;
    return true;
  }

  void FailUnfinished(const Status& st) {
    for (size_t k = 0; k < items_.size(); ++k) {
      if (!items_[k].finished) out_[k] = st;
    }
  }

  const FileBackendCaps& caps_;
  const bool write_;
  const char* const op_;
  const std::span<const FileIo> ios_;
  std::vector<Status> out_;
  std::vector<ItemState> items_;
  std::vector<size_t> queue_;     // admitted items, in order
  size_t next_ = 0;               // next index into queue_
  std::vector<size_t> resubmit_;  // short transfers and retries
  int in_flight_ = 0;
};

std::vector<Status> UringFileBackend::Run(bool write, std::span<const FileIo> ios,
                                          Deadline deadline) {
  UringRun run(caps_, write, ios);
  if (!run.Admit()) return run.TakeResults();
  auto ring_or = TakeRing();
  if (!ring_or.ok()) {
    run.FailQueued(ring_or.status());
    return run.TakeResults();
  }
  std::unique_ptr<Ring> ring = std::move(ring_or).value();
  switch (run.Pump(ring->get(), deadline)) {
    case UringRun::End::kDone:
      break;
    case UringRun::End::kRingBroken:
      return run.TakeResults();  // the ring is dropped, not pooled (exit cancels and waits)
    case UringRun::End::kDeadline:
      if (!run.CancelAndDrain(ring->get())) {
        (void)ring.release();  // leaked: the kernel may still write into the caller's buffers
        run.FailAtDeadline();
        return run.TakeResults();
      }
      run.FailAtDeadline();
      break;
  }
  GiveRing(std::move(ring));
  return run.TakeResults();
}

}  // namespace

StatusOr<std::unique_ptr<FileBackend>> OpenUringFileBackend(const FileBackendOptions& options) {
  KVF_ASSIGN_OR_RETURN(files_internal::DirProbe probe,
                       files_internal::ProbeDir(options.dir, options.direct_io));
  if (options.direct_io && !probe.direct_io) Log(LogLevel::kWarn, "file tier: {}", probe.note);
  // Probe a ring now: a kernel or sandbox that refuses io_uring makes this backend unavailable.
  Ring test;
  KVF_RETURN_IF_ERROR(test.Init(static_cast<unsigned>(std::max(1, options.queue_depth))));
  FileBackendCaps caps;
  caps.name = "io_uring";
  caps.device_memory = false;
  caps.direct_io = probe.direct_io;
  caps.alignment = probe.direct_io ? 4096 : 1;
  caps.max_in_flight = std::max(1, options.queue_depth);
  caps.note = probe.note;
  return std::unique_ptr<FileBackend>(new UringFileBackend(std::move(caps)));
}

}  // namespace kvferry
