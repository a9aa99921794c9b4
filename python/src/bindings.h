// Shared pieces of the kvferry Python bindings (nanobind).
//
// Errors. A non-OK Status becomes a C++ StatusError, which the translator registered in
// errors.cc raises as the matching kvferry.errors class (kvferry.Error carries .code and
// .message). Use of a closed object raises kvferry.ClosedError.
//
// Ownership. Every Python object that owns a C++ resource holds it through a shared_ptr "core";
// objects that depend on others (a pool on its device, a side on its pool) hold the others'
// cores, so close() on one object releases its own reference and the resource is freed when the
// last user is gone: closing in any order never frees memory still in use. Cores that hold
// Python objects (wrapped arrays) are only ever released with the GIL held.
//
// Wrapped memory. Pool.wrap keeps the memory under each tensor, not only the tensor object, which
// the engine may point elsewhere: a torch tensor's storage (set_() or del leave it alive), every
// numpy array of a base chain under a weak reference (numpy refuses to resize such an array, even
// with refcheck=False). resize_() growing a torch tensor moves its bytes within the storage we
// hold, which we cannot prevent: PoolCore::CheckWrapped refuses such a pool before every call that
// starts a copy (its data_ptr differs from the wrapped address).
//
// Threads and the GIL. Calls that wait (poll, wait, synchronize, drain, close) release the GIL.
// Those of a side and of a TransferManager run under a shared lock that close() takes
// exclusively, so closing from one thread while another thread polls or drains waits for that
// call instead of pulling the object from under it. Calls that keep the GIL hold a copy of the
// core while they use it.
#pragma once

#include <nanobind/nanobind.h>

#include <chrono>
#include <memory>
#include <optional>
#include <shared_mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kvferry/device.h"
#include "kvferry/metrics.h"
#include "kvferry/pool.h"
#include "kvferry/rendezvous.h"
#include "kvferry/status.h"

namespace kvferry::py {

namespace nb = nanobind;

// A non-OK Status on its way to Python.
class StatusError : public std::exception {
 public:
  explicit StatusError(Status s) : status_(std::move(s)), what_(status_.ToString()) {}
  const Status& status() const { return status_; }
  const char* what() const noexcept override { return what_.c_str(); }

 private:
  Status status_;
  std::string what_;
};

// Use of an object after close().
class ClosedError : public std::exception {
 public:
  explicit ClosedError(std::string what) : what_(std::move(what) + " is closed") {}
  const char* what() const noexcept override { return what_.c_str(); }

 private:
  std::string what_;
};

inline void Check(const Status& s) {
  if (!s.ok()) throw StatusError(s);
}
template <typename T>
T Take(StatusOr<T>&& s) {
  if (!s.ok()) throw StatusError(std::move(s).status());
  return std::move(s).value();
}
inline void ThrowInvalid(std::string msg) {
  throw StatusError(Status::InvalidArgument(std::move(msg)));
}

// Seconds (Python float) to a deadline. Negative timeouts are refused: every wait has one.
inline Deadline DeadlineAfter(double seconds) {
  if (!(seconds >= 0)) ThrowInvalid("timeout must be a number of seconds >= 0");
  if (seconds > 1e7) seconds = 1e7;
  return Clock::now() +
         std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

// ---- cores ------------------------------------------------------------------------------------

struct DeviceCore {
  std::unique_ptr<Device> device;
  bool is_cuda() const { return device->info().platform == "cuda"; }
};

// One tensor of a wrapped pool and what keeps its memory (see "Wrapped memory" above).
struct WrappedTensor {
  nb::object object;    // the tensor as given
  nb::object keep;      // its torch storage, or weak references to its numpy arrays
  nb::object data_ptr;  // torch: the tensor's bound data_ptr method, checked before each use
  uintptr_t address = 0;
};

struct PoolCore {
  std::shared_ptr<DeviceCore> device;
  std::optional<BlockPool> pool;
  // The Python objects whose memory the pool wraps (kept alive as long as the pool).
  std::vector<WrappedTensor> wrapped;
  // Raises InvalidArgument when a wrapped torch tensor no longer points at the memory wrapped
  // (resize_() past its storage, set_()): nothing may copy through such a pool. Needs the GIL.
  void CheckWrapped() const;
};

struct EventCore {
  std::shared_ptr<DeviceCore> device;
  std::shared_ptr<Event> event;
  nb::object native;  // the engine's event (wrap_event), kept alive with the wrapper
};

struct StreamCore {
  std::shared_ptr<DeviceCore> device;
  std::unique_ptr<Stream> stream;
  nb::object native;  // the engine's stream (wrap_stream)
};

// The Python-visible wrappers whose cores other bindings need.
class PyDevice {
 public:
  explicit PyDevice(std::shared_ptr<DeviceCore> core) : core_(std::move(core)) {}
  const std::shared_ptr<DeviceCore>& core() const {
    if (!core_) throw ClosedError("Device");
    return core_;
  }
  void close() { core_.reset(); }
  bool closed() const { return core_ == nullptr; }

 private:
  std::shared_ptr<DeviceCore> core_;
};

class PyPool {
 public:
  explicit PyPool(std::shared_ptr<PoolCore> core) : core_(std::move(core)) {}
  const std::shared_ptr<PoolCore>& core() const {
    if (!core_) throw ClosedError("Pool");
    return core_;
  }
  const BlockPool& pool() const { return *core()->pool; }
  void close() { core_.reset(); }
  bool closed() const { return core_ == nullptr; }

 private:
  std::shared_ptr<PoolCore> core_;
};

class PyEvent {
 public:
  explicit PyEvent(std::shared_ptr<EventCore> core) : core_(std::move(core)) {}
  const std::shared_ptr<EventCore>& core() const {
    if (!core_) throw ClosedError("Event");
    return core_;
  }
  void close() { core_.reset(); }

 private:
  std::shared_ptr<EventCore> core_;
};

class PyStream {
 public:
  explicit PyStream(std::shared_ptr<StreamCore> core) : core_(std::move(core)) {}
  const std::shared_ptr<StreamCore>& core() const {
    if (!core_) throw ClosedError("Stream");
    return core_;
  }
  void close() {
    // Destroying a stream drains it: without the GIL, then the core (which holds no Python
    // object) is dropped.
    std::shared_ptr<StreamCore> c = std::move(core_);
    if (c && c.use_count() == 1) {
      nb::gil_scoped_release nogil;
      c->stream.reset();
    }
  }

 private:
  std::shared_ptr<StreamCore> core_;
};

// Registration of each part of the module.
// Metrics snapshots as dicts (metrics_bindings.cc).
nb::dict MetricsDict(const TransceiverMetrics& m);
nb::dict MetricsDict(const TieringMetrics& m);
nb::dict TimelineDict(const RequestTimeline& t);
void BindMetrics(nb::module_& m);
void BindErrors(nb::module_& m);
void BindDevice(nb::module_& m);
void BindPool(nb::module_& m);
void BindTransceiver(nb::module_& m);
void BindTiering(nb::module_& m);
void BindRendezvous(nb::module_& m);

// A rendezvous client (rendezvous_bindings.cc): thread-safe in C++, so calls run without the GIL;
// close waits for none (a call in flight holds its own reference through the shared_ptr).
class PyRendezvous {
 public:
  explicit PyRendezvous(std::shared_ptr<Rendezvous> r) : rv_(std::move(r)) {}
  std::shared_ptr<Rendezvous> get() const {
    if (!rv_) throw ClosedError("Rendezvous");
    return rv_;
  }
  void close() { rv_.reset(); }

 private:
  std::shared_ptr<Rendezvous> rv_;
};

}  // namespace kvferry::py
