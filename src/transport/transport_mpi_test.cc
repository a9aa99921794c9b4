// Runs the conformance suite over MPI: start it as two ranks,
//   mpirun --allow-run-as-root --oversubscribe -np 2 transport_mpi_test
// Rank r is side r. Peer death is skipped: a dead rank makes mpirun abort the job.
#include <gtest/gtest.h>
// The C API only: keep the MPI C++ bindings (and their link dependency) out.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include "transport/transport_conformance.h"

namespace kvferry::testing {
namespace {

using std::chrono::milliseconds;

class MpiSide final : public Side, public Harness {
 public:
  explicit MpiSide(std::unique_ptr<Transport> t) : t_(std::move(t)) {
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  }
  int index() const override { return rank_; }
  Transport& transport() override { return *t_; }
  PeerId other() const override { return other_; }
  bool CanDie() const override { return false; }
  void Die() override {}

  void Sync() override {
    MPI_Request req;
    MPI_Ibarrier(MPI_COMM_WORLD, &req);
    const Deadline deadline = DeadlineIn(milliseconds(30000));
    for (;;) {
      int done = 0;
      MPI_Test(&req, &done, MPI_STATUS_IGNORE);
      if (done) return;
      if (Clock::now() > deadline) {
        ADD_FAILURE() << "rank " << rank_ << ": Sync timed out";
        MPI_Abort(MPI_COMM_WORLD, 3);  // an abandoned barrier would hang the job
      }
      t_->Progress();
    }
  }

  void Run(const std::function<void(Side&)>& body) override {
    auto p = t_->Connect(std::to_string(1 - rank_), DeadlineIn(milliseconds(1000)));
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    if (rank_ == 0) {
      other_ = *p;
      const std::byte hi[] = {std::byte{'h'}, std::byte{'i'}};
      ASSERT_TRUE(t_->SendControl(other_, hi).ok());
    } else {
      const Deadline deadline = DeadlineIn(milliseconds(10000));
      while (Clock::now() < deadline && other_ == kAnyPeer) {
        if (auto m = t_->PollControl()) other_ = m->from;
      }
      ASSERT_NE(other_, kAnyPeer) << "first control message never arrived";
    }
    body(*this);
    Sync();
  }

 private:
  std::unique_ptr<Transport> t_;
  int rank_ = 0;
  PeerId other_ = kAnyPeer;
};

}  // namespace

std::vector<std::string> HarnessNames() { return {"mpi"}; }

std::unique_ptr<Harness> MakeHarness(const std::string& name) {
  TransportOptions o;
  o.name = name;
  auto t = CreateTransport(o);
  if (!t.ok()) {
    ADD_FAILURE() << t.status().ToString();
    return nullptr;
  }
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (size != 2) {
    ADD_FAILURE() << "run under mpirun -np 2 (world size is " << size << ")";
    return nullptr;
  }
  return std::make_unique<MpiSide>(std::move(t).value());
}

}  // namespace kvferry::testing
