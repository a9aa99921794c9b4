// The transport conformance suite (transport_conformance_test.cc) is written as one body that
// runs on two sides at once. A Harness runs it: in one process with two transports driven by two
// threads (inproc, ucx: transport_test.cc), or as two MPI ranks (transport_mpi_test.cc). The
// harness connects side 0 to side 1 and side 1 learns side 0's PeerId from a first control
// message, so every test also checks that receivers connect back.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kvferry/transport.h"

namespace kvferry::testing {

class Side {
 public:
  virtual ~Side() = default;
  virtual int index() const = 0;  // 0 or 1
  virtual Transport& transport() = 0;
  virtual PeerId other() const = 0;
  // A barrier with the other side that keeps this side's transport progressing.
  virtual void Sync() = 0;
  // Whether Die() is supported; Die() makes this side's transport die (destroyed or killed).
  virtual bool CanDie() const = 0;
  virtual void Die() = 0;
};

class Harness {
 public:
  virtual ~Harness() = default;
  // Runs `body` on both sides (or this process's side) and waits for it.
  virtual void Run(const std::function<void(Side&)>& body) = 0;
};

// Provided by the test binary: harness names to instantiate, and a factory.
std::vector<std::string> HarnessNames();
std::unique_ptr<Harness> MakeHarness(const std::string& name);

}  // namespace kvferry::testing
