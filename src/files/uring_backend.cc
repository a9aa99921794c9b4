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

std::vector<Status> UringFileBackend::Run(bool write, std::span<const FileIo> ios,
                                          Deadline deadline) {
  std::vector<Status> out(ios.size());
  std::vector<ItemState> items(ios.size());
  std::vector<size_t> queue;  // items waiting for submission, in order
  queue.reserve(ios.size());
  for (size_t i = 0; i < ios.size(); ++i) {
    out[i] = CheckIo(caps_, ios[i]);
    if (out[i].ok() && ios[i].segments.size() > kMaxIov) {
      out[i] = Status::InvalidArgument(
          fmt::format("{} segments in one I/O; at most {}", ios[i].segments.size(), kMaxIov));
    }
    if (!out[i].ok()) {
      items[i].finished = true;
      continue;
    }
    items[i].total = files_internal::IoBytes(ios[i]);
    if (items[i].total == 0) {
      items[i].finished = true;
      continue;
    }
    queue.push_back(i);
  }
  if (queue.empty()) return out;
  auto ring_or = TakeRing();
  if (!ring_or.ok()) {
    for (size_t i : queue) out[i] = ring_or.status();
    return out;
  }
  std::unique_ptr<Ring> ring = std::move(ring_or).value();
  io_uring* r = ring->get();

  size_t next = 0;  // next index into queue
  std::vector<size_t> resubmit;
  int in_flight = 0;
  const char* op = write ? "write" : "read";

  auto prep = [&](size_t i) {
    io_uring_sqe* sqe = io_uring_get_sqe(r);
    ItemState& st = items[i];
    BuildIov(ios[i], st);
    const int fd = static_cast<const PosixFile*>(ios[i].file)->fd();
    const off_t off = static_cast<off_t>(ios[i].offset + st.done);
    if (write) {
      io_uring_prep_writev(sqe, fd, st.iov.data(), static_cast<unsigned>(st.niov), off);
    } else {
      io_uring_prep_readv(sqe, fd, st.iov.data(), static_cast<unsigned>(st.niov), off);
    }
    io_uring_sqe_set_data64(sqe, i);
    st.in_flight = true;
    ++in_flight;
  };

  // Records a completion; false when the item needs another submission (short transfer, EINTR).
  auto complete = [&](size_t i, int res) {
    ItemState& st = items[i];
    st.in_flight = false;
    --in_flight;
    if (res == -EINTR || res == -EAGAIN) return false;
    if (res < 0) {
      out[i] = ErrnoStatus(-res, op, ios[i].file->path(), ios[i].offset + st.done);
    } else if (res == 0) {
      out[i] =
          write
              ? Status::DataLoss(fmt::format("short write to {} at offset {}: {} of {} bytes",
                                             ios[i].file->path(), ios[i].offset, st.done, st.total))
              : Status::DataLoss(fmt::format("truncated file {}: read {} of {} bytes at "
                                             "offset {}",
                                             ios[i].file->path(), st.done, st.total,
                                             ios[i].offset));
    } else {
      st.done += res;
      if (st.done < st.total) return false;
    }
    st.finished = true;
    return true;
  };

  bool timed_out = false;
  while (true) {
    // Refill: retries first, then new items, up to the depth.
    while (in_flight < caps_.max_in_flight && (!resubmit.empty() || next < queue.size())) {
      size_t i;
      if (!resubmit.empty()) {
        i = resubmit.back();
        resubmit.pop_back();
      } else {
        i = queue[next++];
      }
      prep(i);
    }
    if (in_flight == 0) break;
    int rc = io_uring_submit(r);
    if (rc < 0 && rc != -EINTR && rc != -EAGAIN && rc != -EBUSY) {
      // The ring is broken; nothing prepared can be trusted to run. Fail what is left.
      Status st = Status::Internal(fmt::format("io_uring_submit: {}", strerror(-rc)));
      for (size_t k = 0; k < items.size(); ++k) {
        if (!items[k].finished) out[k] = st;
      }
      return out;  // the ring is dropped, not pooled (exit cancels and waits for its work)
    }
    // Reap at least one completion, or stop at the deadline.
    auto left = std::chrono::duration_cast<std::chrono::nanoseconds>(deadline - Clock::now());
    if (left.count() <= 0) {
      timed_out = true;
      break;
    }
    __kernel_timespec ts;
    ts.tv_sec = left.count() / 1000000000;
    ts.tv_nsec = left.count() % 1000000000;
    io_uring_cqe* cqe = nullptr;
    rc = io_uring_wait_cqe_timeout(r, &cqe, &ts);
    if (rc == -ETIME) {
      timed_out = true;
      break;
    }
    if (rc == -EINTR) continue;
    if (rc < 0) {
      timed_out = true;  // treat like a deadline: cancel and drain below
      break;
    }
    unsigned head;
    unsigned seen = 0;
    io_uring_for_each_cqe(r, head, cqe) {
      ++seen;
      uint64_t tag = io_uring_cqe_get_data64(cqe);
      if (tag == kCancelTag) continue;
      if (!complete(static_cast<size_t>(tag), cqe->res)) resubmit.push_back(tag);
    }
    io_uring_cq_advance(r, seen);
  }

  if (timed_out) {
    // Cancel what is in flight, then wait (unbounded, but cancelled or finishing file I/O ends
    // promptly) until the kernel holds no buffer of ours.
    int cancels = 0;
    for (size_t i = 0; i < items.size(); ++i) {
      if (!items[i].in_flight) continue;
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
    while (in_flight > 0 || cancels > 0) {
      io_uring_cqe* cqe = nullptr;
      int rc = io_uring_wait_cqe(r, &cqe);
      if (rc == -EINTR) continue;
      if (rc < 0) {
        // Can't drain: leak the ring rather than free memory the kernel may still write.
        Log(LogLevel::kError, "io_uring: can't drain after deadline: {}", strerror(-rc));
        (void)ring.release();
        break;
      }
      uint64_t tag = io_uring_cqe_get_data64(cqe);
      if (tag == kCancelTag) {
        --cancels;
      } else {
        // A cancelled item completes with -ECANCELED (an error, recorded below as the deadline);
        // one that finished anyway keeps its result.
        if (cqe->res != -ECANCELED) (void)complete(tag, cqe->res);
        if (items[tag].in_flight) {
          items[tag].in_flight = false;
          --in_flight;
        }
      }
      io_uring_cqe_seen(r, cqe);
    }
    for (size_t i = 0; i < items.size(); ++i) {
      if (!items[i].finished) {
        out[i] = Status::DeadlineExceeded(fmt::format(
            "{} of {} at offset {} did not finish before the deadline ({} of {} bytes done)", op,
            ios[i].file->path(), ios[i].offset, items[i].done, items[i].total));
      }
    }
    if (!ring) return out;
  }
  GiveRing(std::move(ring));
  return out;
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
