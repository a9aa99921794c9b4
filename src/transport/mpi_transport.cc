// The MPI transport: MPI_Isend/MPI_Imrecv on a duplicate of MPI_COMM_WORLD for data, and a second
// duplicate for control messages (MPI_Iprobe + MPI_Recv from any source), so every data tag in
// [0, MPI_TAG_UB] is usable. PeerId = world rank; LocalAddress() = the rank as decimal text.
//
// Creating (MPI_Comm_dup) and destroying (MPI_Comm_free) are collective over MPI_COMM_WORLD:
// every rank creates its MpiTransports in the same order.
//
// Receives are matched by MPI_Improbe + MPI_Imrecv during Progress(), in posting order.
//
// MPI is initialized here (MPI_THREAD_MULTIPLE requested, SERIALIZED accepted) unless the program
// did it, and then finalized at process exit. Communicators get MPI_ERRORS_RETURN so a truncated
// receive is an error, not an abort. MPI has no peer-failure detection: a dead rank normally
// makes mpirun abort the job, so ops never fail with kUnavailable here.
// The C API only: keep the MPI C++ bindings (and their link dependency) out.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <cstdlib>
#include <deque>
#include <list>
#include <string>
#include <unordered_map>

#include "base/log.h"
#include "kvferry/config.h"
#include "kvferry/transport.h"

namespace kvferry {
namespace {

Status FromMpi(int rc, std::string_view what) {
  if (rc == MPI_SUCCESS) return Status::Ok();
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  int cls = MPI_ERR_UNKNOWN;
  MPI_Error_class(rc, &cls);
  std::string msg = std::string(what) + ": " + std::string(text, len);
  if (cls == MPI_ERR_TRUNCATE) {
    return Status::InvalidArgument(msg + " (message larger than receive buffer)");
  }
  if (cls == MPI_ERR_TAG || cls == MPI_ERR_RANK || cls == MPI_ERR_COUNT || cls == MPI_ERR_ARG) {
    return Status::InvalidArgument(msg);
  }
  return Status::Internal(msg);
}

struct OpState {
  MPI_Request request = MPI_REQUEST_NULL;
  bool is_recv = false;
  bool done = false;
  Status status;
  size_t bytes = 0;
  std::vector<std::byte> payload;  // control sends own their bytes
  // Receives not yet matched (request == MPI_REQUEST_NULL, see MatchReceives).
  int source = MPI_ANY_SOURCE;
  int tag = 0;
  void* buf = nullptr;
  size_t capacity = 0;
};

class MpiOp final : public TransportOp {
 public:
  explicit MpiOp(std::shared_ptr<OpState> s) : s_(std::move(s)) {}
  bool Done() const override { return s_->done; }
  Status status() const override { return s_->status; }
  size_t bytes() const override { return s_->bytes; }
  OpState& state() const { return *s_; }

 private:
  std::shared_ptr<OpState> s_;
};

void FinalizeAtExit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

class MpiTransport final : public Transport {
 public:
  static StatusOr<std::unique_ptr<Transport>> Create(const TransportOptions& options) {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
      int finalized = 0;
      MPI_Finalized(&finalized);
      if (finalized) return Status::Unavailable("mpi transport: MPI was already finalized");
      int provided = 0;
      KVF_RETURN_IF_ERROR(FromMpi(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided),
                                  "MPI_Init_thread"));
      std::atexit(&FinalizeAtExit);
      if (provided < MPI_THREAD_SERIALIZED) {
        Log(LogLevel::kWarn, "mpi: thread level {} < SERIALIZED; drive MPI from one thread only",
            provided);
      }
    }
    std::unique_ptr<MpiTransport> t(new MpiTransport());
    KVF_RETURN_IF_ERROR(FromMpi(MPI_Comm_dup(MPI_COMM_WORLD, &t->data_), "MPI_Comm_dup"));
    KVF_RETURN_IF_ERROR(FromMpi(MPI_Comm_dup(MPI_COMM_WORLD, &t->ctrl_), "MPI_Comm_dup"));
    MPI_Comm_set_errhandler(t->data_, MPI_ERRORS_RETURN);
    MPI_Comm_set_errhandler(t->ctrl_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(t->data_, &t->rank_);
    MPI_Comm_size(t->data_, &t->size_);
    int* tag_ub = nullptr;
    int flag = 0;
    MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &tag_ub, &flag);
    t->tag_ub_ = (flag && tag_ub) ? static_cast<uint64_t>(*tag_ub) : 32767;
    int bits = 0;
    while (bits < 62 && (uint64_t{1} << (bits + 1)) - 1 <= t->tag_ub_) ++bits;
    t->caps_.name = "mpi";
    t->caps_.tag_bits = bits;
    t->caps_.device_memory = options.device_memory_is_host;
    t->caps_.one_sided = false;
    t->caps_.max_control_bytes = size_t{1} << 20;
    return std::unique_ptr<Transport>(std::move(t));
  }

  ~MpiTransport() override {
    const Deadline deadline =
        DeadlineIn(std::chrono::milliseconds(Config::Global().Int("transport.close_timeout_ms")));
    for (auto& s : unmatched_) {
      s->status = Status::Cancelled("mpi transport destroyed");
      s->done = true;
    }
    unmatched_.clear();
    while (!inflight_.empty() && Clock::now() < deadline) TestAll();
    for (auto& [p, s] : inflight_) {  // sends nobody received: abandon them
      if (s->request != MPI_REQUEST_NULL) MPI_Request_free(&s->request);
      s->status = Status::Cancelled("mpi transport destroyed");
      s->done = true;
    }
    inflight_.clear();
    MPI_Comm_free(&data_);
    MPI_Comm_free(&ctrl_);
  }

  const TransportCaps& caps() const override { return caps_; }
  std::string LocalAddress() const override { return std::to_string(rank_); }

  StatusOr<PeerId> Connect(std::string_view address, Deadline) override {
    int rank = -1;
    bool ok = !address.empty() && address.size() < 10;
    for (char c : address) ok = ok && c >= '0' && c <= '9';
    if (ok) rank = std::stoi(std::string(address));
    if (!ok || rank >= size_) {
      return Status::InvalidArgument("not an mpi rank of this job (size " + std::to_string(size_) +
                                     "): '" + std::string(address) + "'");
    }
    return rank;
  }

  StatusOr<std::unique_ptr<TransportOp>> Send(PeerId peer, uint64_t tag, const void* buf,
                                              size_t bytes, MemoryKind kind) override {
    KVF_RETURN_IF_ERROR(Check(peer, tag, bytes, kind, false));
    auto s = std::make_shared<OpState>();
    s->bytes = bytes;
    KVF_RETURN_IF_ERROR(FromMpi(MPI_Isend(buf, static_cast<int>(bytes), MPI_BYTE, peer,
                                          static_cast<int>(tag), data_, &s->request),
                                "MPI_Isend"));
    return Track(std::move(s));
  }

  StatusOr<std::unique_ptr<TransportOp>> Recv(PeerId peer, uint64_t tag, void* buf, size_t capacity,
                                              MemoryKind kind) override {
    KVF_RETURN_IF_ERROR(Check(peer, tag, capacity, kind, true));
    auto s = std::make_shared<OpState>();
    s->is_recv = true;
    s->source = peer == kAnyPeer ? MPI_ANY_SOURCE : peer;
    s->tag = static_cast<int>(tag);
    s->buf = buf;
    s->capacity = capacity;
    unmatched_.push_back(s);
    MatchReceives();
    return std::unique_ptr<TransportOp>(std::make_unique<MpiOp>(std::move(s)));
  }

  void Cancel(TransportOp& op) override {
    auto* mine = dynamic_cast<MpiOp*>(&op);
    if (mine == nullptr || mine->Done()) return;
    OpState& s = mine->state();
    // Only unmatched receives are cancelled: MPI_Cancel of a send is deprecated and unreliable,
    // and a matched receive is already being filled.
    for (auto it = unmatched_.begin(); it != unmatched_.end(); ++it) {
      if (it->get() != &s) continue;
      s.status = Status::Cancelled("mpi receive cancelled");
      s.done = true;
      unmatched_.erase(it);
      return;
    }
  }

  Status SendControl(PeerId peer, std::span<const std::byte> bytes) override {
    if (bytes.size() > caps_.max_control_bytes) {
      return Status::InvalidArgument("control message of " + std::to_string(bytes.size()) +
                                     " bytes exceeds " + std::to_string(caps_.max_control_bytes));
    }
    if (peer < 0 || peer >= size_) {
      return Status::InvalidArgument("unknown peer " + std::to_string(peer));
    }
    auto s = std::make_shared<OpState>();
    s->payload.assign(bytes.begin(), bytes.end());
    KVF_RETURN_IF_ERROR(FromMpi(MPI_Isend(s->payload.data(), static_cast<int>(s->payload.size()),
                                          MPI_BYTE, peer, 0, ctrl_, &s->request),
                                "MPI_Isend (control)"));
    (void)Track(std::move(s));
    return Status::Ok();
  }

  std::optional<ControlMessage> PollControl() override {
    int flag = 0;
    MPI_Status st;
    if (MPI_Iprobe(MPI_ANY_SOURCE, 0, ctrl_, &flag, &st) != MPI_SUCCESS || !flag) {
      Progress();
      return std::nullopt;
    }
    int count = 0;
    MPI_Get_count(&st, MPI_BYTE, &count);
    ControlMessage m;
    m.from = st.MPI_SOURCE;
    m.bytes.resize(static_cast<size_t>(count));
    const int rc =
        MPI_Recv(m.bytes.data(), count, MPI_BYTE, st.MPI_SOURCE, 0, ctrl_, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) {
      Log(LogLevel::kWarn, "mpi: dropped a control message: {}",
          FromMpi(rc, "MPI_Recv").ToString());
      return std::nullopt;
    }
    return m;
  }

  bool Progress() override {
    const bool matched = MatchReceives();
    return TestAll() || matched;
  }

 private:
  MpiTransport() = default;

  Status Check(PeerId peer, uint64_t tag, size_t bytes, MemoryKind kind, bool recv) const {
    if (kind == MemoryKind::kFile) return Status::InvalidArgument("mpi: kFile is not memory");
    if (kind == MemoryKind::kDevice && !caps_.device_memory) {
      return Status::InvalidArgument("mpi: kDevice (GPU) buffers are not supported");
    }
    if ((peer < 0 && !(recv && peer == kAnyPeer)) || peer >= size_) {
      return Status::InvalidArgument("unknown peer " + std::to_string(peer));
    }
    if (tag > tag_ub_) {
      return Status::InvalidArgument("mpi tag " + std::to_string(tag) + " exceeds MPI_TAG_UB " +
                                     std::to_string(tag_ub_));
    }
    if (bytes > static_cast<size_t>(INT32_MAX)) {
      return Status::InvalidArgument("mpi: messages are limited to 2 GiB - 1");
    }
    return Status::Ok();
  }

  // Matches posted receives to arrived messages in posting order (MPI_Improbe), so a message
  // larger than its receive buffer is drained into scratch memory and the receive fails with
  // kInvalidArgument, instead of relying on MPI's truncation handling.
  bool MatchReceives() {
    bool any = false;
    for (auto it = unmatched_.begin(); it != unmatched_.end();) {
      OpState& s = **it;
      int flag = 0;
      MPI_Message msg;
      MPI_Status st;
      int rc = MPI_Improbe(s.source, s.tag, data_, &flag, &msg, &st);
      if (rc == MPI_SUCCESS && !flag) {
        ++it;
        continue;
      }
      int count = 0;
      if (rc == MPI_SUCCESS) MPI_Get_count(&st, MPI_BYTE, &count);
      if (rc != MPI_SUCCESS) {
        s.status = FromMpi(rc, "MPI_Improbe");
        s.done = true;
      } else if (static_cast<size_t>(count) > s.capacity) {
        std::vector<std::byte> scratch(static_cast<size_t>(count));
        MPI_Mrecv(scratch.data(), count, MPI_BYTE, &msg, MPI_STATUS_IGNORE);
        s.status = Status::InvalidArgument("mpi: message of " + std::to_string(count) +
                                           " bytes is larger than the receive buffer (" +
                                           std::to_string(s.capacity) + ")");
        s.done = true;
      } else {
        rc = MPI_Imrecv(s.buf, count, MPI_BYTE, &msg, &s.request);
        if (rc != MPI_SUCCESS) {
          s.status = FromMpi(rc, "MPI_Imrecv");
          s.done = true;
        } else {
          inflight_.emplace(&s, *it);
        }
      }
      any = true;
      it = unmatched_.erase(it);
    }
    return any;
  }

  std::unique_ptr<TransportOp> Track(std::shared_ptr<OpState> s) {
    inflight_.emplace(s.get(), s);
    return std::make_unique<MpiOp>(std::move(s));
  }

  bool TestAll() {
    bool any = false;
    for (auto it = inflight_.begin(); it != inflight_.end();) {
      OpState& s = *it->second;
      int flag = 0;
      MPI_Status st;
      // Errors come back as the return code (MPI_ERRORS_RETURN); st.MPI_ERROR is not set by
      // MPI_Test.
      const int rc = MPI_Test(&s.request, &flag, &st);
      if (rc != MPI_SUCCESS) {
        s.status = FromMpi(rc, s.is_recv ? "mpi receive" : "mpi send");
        flag = 1;
      } else if (flag) {
        int cancelled = 0;
        if (s.is_recv) MPI_Test_cancelled(&st, &cancelled);
        if (cancelled) {
          s.status = Status::Cancelled("mpi receive cancelled");
        } else if (s.is_recv) {
          int count = 0;
          MPI_Get_count(&st, MPI_BYTE, &count);
          s.bytes = static_cast<size_t>(count);
        }
      }
      if (!flag) {
        ++it;
        continue;
      }
      s.done = true;
      any = true;
      it = inflight_.erase(it);
    }
    return any;
  }

  TransportCaps caps_;
  MPI_Comm data_ = MPI_COMM_NULL;
  MPI_Comm ctrl_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 0;
  uint64_t tag_ub_ = 0;
  std::unordered_map<OpState*, std::shared_ptr<OpState>> inflight_;
  std::list<std::shared_ptr<OpState>> unmatched_;  // receives in posting order
};

}  // namespace

StatusOr<std::unique_ptr<Transport>> CreateMpiTransport(const TransportOptions& options) {
  return MpiTransport::Create(options);
}

}  // namespace kvferry
