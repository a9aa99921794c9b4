// The context and generation sides, their statuses, and the in-process fabric (tests).
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <array>
#include <cmath>
#include <cstring>
#include <map>
#include <mutex>

#include "bindings.h"
#include "ids.h"
#include "kvferry/inproc_transport.h"
#include "kvferry/prometheus.h"
#include "kvferry/transceiver.h"
#include "kvferry/transport.h"

namespace kvferry::py {

namespace {

// Transports that share one fabric reach each other by address, in this process.
struct PyFabric {
  std::shared_ptr<InProcFabric> fabric = InProcFabric::Create();
};

// A TransferStatus with its reason split into code and message.
struct PyStatus {
  uint64_t request_id = 0;
  TransferState state = TransferState::kInit;
  std::string code = "OK";
  std::string message;
  int64_t bytes = 0;
  double seconds = 0;
};

PyStatus ToPy(const TransferStatus& s) {
  return PyStatus{s.request_id,
                  s.state,
                  std::string(StatusCodeName(s.reason.code())),
                  std::string(s.reason.message()),
                  s.bytes,
                  s.seconds};
}

std::vector<PyStatus> ToPy(const std::vector<TransferStatus>& v) {
  std::vector<PyStatus> out;
  out.reserve(v.size());
  for (const TransferStatus& s : v) out.push_back(ToPy(s));
  return out;
}

nb::dict StatsDict(const TransceiverStats& s) {
  nb::dict d;
  d["requests_ended"] = s.requests_ended;
  d["busy_cpu_seconds"] = s.busy_cpu_seconds;
  d["live_requests"] = s.live_requests;
  d["staging_slots_in_use"] = s.staging_slots_in_use;
  d["thread_cpu_seconds"] = s.thread_cpu_seconds;
  return d;
}

using Secret = std::array<uint8_t, 16>;

// A secret given by the caller: exactly 16 bytes, not all zero.
Secret SecretFrom(const nb::bytes& b) {
  Secret s{};
  if (b.size() != s.size()) {
    ThrowInvalid("instance_secret has " + std::to_string(b.size()) + " bytes; exactly " +
                 std::to_string(s.size()) +
                 " are needed, the same on every context rank (kvferry.random_key() on one rank, "
                 "or leave it out and give rendezvous=)");
  }
  std::memcpy(s.data(), b.c_str(), s.size());
  if (s == Secret{}) {
    ThrowInvalid(
        "instance_secret is all zero: anyone could forge handles with it; use "
        "kvferry.random_key()");
  }
  return s;
}

// The context instance's secret: the caller's; or, with a rendezvous, rank 0 makes one and
// publishes it under `instance` and the other ranks wait for it; or, for an instance of one rank,
// a new one (ContextSide.instance_secret shows it).
Secret ContextSecret(const std::optional<nb::bytes>& given, PyRendezvous* rendezvous,
                     const std::string& instance, uint64_t instance_id, double timeout,
                     const BlockPool& pool) {
  if (given.has_value() && rendezvous != nullptr) {
    ThrowInvalid(
        "give instance_secret or rendezvous, not both (with a rendezvous, rank 0 makes "
        "the secret and the other ranks fetch it)");
  }
  if (given.has_value()) return SecretFrom(*given);
  const int32_t ranks = pool.spec().parallel.world_size();
  if (rendezvous == nullptr) {
    if (ranks > 1) {
      ThrowInvalid("a context instance of " + std::to_string(ranks) +
                   " ranks needs one secret on every rank: give rendezvous= (rank 0 makes it and "
                   "publishes it, the others fetch it) or the same instance_secret= on every "
                   "rank (kvferry.random_key() on one of them)");
    }
    return NewInstanceSecret();
  }
  if (instance_id == 0) {
    ThrowInvalid(
        "rendezvous= needs instance_id: the same on every rank of the instance and new "
        "each time it starts, so a rank never takes an earlier run's secret");
  }
  std::shared_ptr<Rendezvous> rv = rendezvous->get();
  const Deadline d = DeadlineAfter(timeout);
  nb::gil_scoped_release nogil;
  if (pool.spec().rank == 0) {
    const Secret s = NewInstanceSecret();
    Check(PublishInstanceSecret(*rv, instance, instance_id, s, d));
    return s;
  }
  return Take(FetchInstanceSecret(*rv, instance, instance_id, d));
}

// kv_scales (None: none) per kv_scales_per ("tensor": one per layer and K/V, as vLLM's k_scale and
// v_scale; "head": one per layer, K/V and head), [layer][kv][head] order; checked by the side.
// "block" takes no values: the scales live in the pool (Pool.allocate(block_scales=True),
// Pool.attach_block_scales).
KvScales MakeScales(const std::optional<std::vector<float>>& values, const std::string& per) {
  KvScales s;
  if (per == "block") {
    if (values.has_value()) {
      ThrowInvalid(
          "kv_scales_per 'block' takes no kv_scales: per-block scales live in the pool "
          "(Pool.allocate(block_scales=True) or Pool.attach_block_scales)");
    }
    s.granularity = ScaleGranularity::kBlock;
    return s;
  }
  if (!values.has_value()) return s;
  if (per == "tensor") {
    s.granularity = ScaleGranularity::kTensor;
  } else if (per == "head") {
    s.granularity = ScaleGranularity::kHead;
  } else {
    ThrowInvalid("kv_scales_per must be 'tensor', 'head' or 'block', not '" + per + "'");
  }
  s.values = *values;
  return s;
}

TransceiverOptions MakeOptions(const std::string& transport, double timeout, int64_t chunk_bytes,
                               int64_t staging_chunks, int64_t direct_min_bytes,
                               uint64_t instance_id, KvScales kv_scales) {
  TransceiverOptions o;
  o.kv_scales = std::move(kv_scales);
  o.transport = transport;
  if (!(timeout >= 0)) ThrowInvalid("timeout must be >= 0 seconds (0: knob transfer.timeout_ms)");
  o.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout * 1000.0));
  if (timeout > 0 && o.timeout.count() == 0) o.timeout = std::chrono::milliseconds(1);
  o.chunk_bytes = chunk_bytes;
  o.staging_chunks = staging_chunks;
  o.direct_min_bytes = direct_min_bytes;
  o.instance_id = instance_id;
  return o;
}

std::unique_ptr<Transport> MakeInProc(const std::optional<PyFabric*>& fabric,
                                      const std::string& transport, const DeviceCore& dev) {
  if (transport != "inproc") {
    if (fabric.has_value() && *fabric != nullptr)
      ThrowInvalid("a fabric is only for transport='inproc'");
    return nullptr;
  }
  if (!fabric.has_value() || *fabric == nullptr) {
    ThrowInvalid("transport='inproc' needs fabric=kvferry.InProcFabric() shared by both sides");
  }
  TransportOptions t;
  t.name = "inproc";
  t.fabric = (*fabric)->fabric;
  t.device_memory_is_host = !dev.is_cuda();
  return Take(CreateTransport(t));
}

std::span<const std::byte> Bytes(const nb::bytes& b) {
  return {reinterpret_cast<const std::byte*>(b.c_str()), b.size()};
}

// One side with its device and pool. See bindings.h for the locking and GIL rules.
template <typename Side>
class PySide {
 public:
  PySide(const char* name, std::shared_ptr<DeviceCore> dev, std::shared_ptr<PoolCore> pool,
         std::unique_ptr<Side> side, Secret secret = {})
      : name_(name),
        dev_(std::move(dev)),
        pool_(std::move(pool)),
        side_(std::move(side)),
        secret_(secret) {}
  ~PySide() { close(); }

  // Before a call that starts copies: the pool's wrapped tensors have not moved (with the GIL).
  void CheckPool() const {
    if (pool_) pool_->CheckWrapped();
  }
  const Secret& secret() const { return secret_; }

  // Runs f(side) without the GIL, under the shared lock.
  template <typename F>
  auto Run(F&& f) {
    nb::gil_scoped_release nogil;
    std::shared_lock lock(mu_);
    if (!side_) throw ClosedError(name_);
    return f(*side_);
  }

  // Runs f(side) under the shared lock, the GIL as the caller has it (held: f must not wait).
  template <typename F>
  auto Locked(F&& f) {
    std::shared_lock lock(mu_);
    if (!side_) throw ClosedError(name_);
    return f(*side_);
  }

  void close() {
    {
      nb::gil_scoped_release nogil;
      std::unique_lock lock(mu_);
      side_.reset();  // stops the progress thread; waits for calls in flight first
    }
    pool_.reset();
    dev_.reset();
  }
  bool closed() {
    std::shared_lock lock(mu_);
    return side_ == nullptr;
  }
  const DeviceCore* device_core() const { return dev_.get(); }

 private:
  const char* name_;
  std::shared_ptr<DeviceCore> dev_;
  std::shared_ptr<PoolCore> pool_;
  std::shared_mutex mu_;
  std::unique_ptr<Side> side_;
  const Secret secret_;  // ContextSide only
};

using PyContext = PySide<ContextSide>;
using PyGeneration = PySide<GenerationSide>;

template <typename Side>
void CommonMethods(nb::class_<PySide<Side>>& c) {
  using P = PySide<Side>;
  c.def_prop_ro(
       "address", [](P& s) { return s.Run([](Side& x) { return x.address(); }); },
       "This rank's transport address.")
      .def(
          "poll",
          [](P& s, size_t at_least, double timeout) {
            Deadline d = DeadlineAfter(timeout);
            auto poll = [&](Side& x) { return x.Poll(at_least, d); };
            // A poll that does not wait (vLLM's connector polls every step) keeps the GIL:
            // releasing it hands it to any other thread that wants it, and the engine thread
            // then waits for it back (131 us a poll beside one busy Python thread, 0.15 us kept).
            return ToPy(timeout > 0 ? s.Run(poll) : s.Locked(poll));
          },
          nb::arg("at_least") = 0, nb::arg("timeout") = 0.0,
          "Terminal statuses not reported before; waits (without the GIL) until at least "
          "`at_least` are available or `timeout` seconds pass (timeout 0: returns at once, "
          "keeping the GIL).")
      .def(
          "query",
          [](P& s, uint64_t id) { return ToPy(Take(s.Run([&](Side& x) { return x.Query(id); }))); },
          nb::arg("request_id"), "The request's current status; NotFoundError if unknown.")
      .def(
          "cancel", [](P& s, uint64_t id) { Check(s.Run([&](Side& x) { return x.Cancel(id); })); },
          nb::arg("request_id"), "Cancels the request (it ends CANCELLED, reported by poll).")
      .def_prop_ro(
          "stats", [](P& s) { return StatsDict(s.Run([](Side& x) { return x.stats(); })); },
          "requests_ended, busy_cpu_seconds (progress-thread CPU in iterations with work), "
          "thread_cpu_seconds (all of it), live_requests, staging_slots_in_use.")
      .def(
          "metrics", [](P& s) { return MetricsDict(s.Run([](Side& x) { return x.metrics(); })); },
          "The side's metrics snapshot (kvferry/metrics.h): requests started and ended by state, "
          "errors by code, bytes, chunks, staging and queue depth, progress CPU, and latency "
          "histograms of requests and chunks (cumulative buckets).")
      .def(
          "timelines",
          [](P& s) {
            nb::list out;
            for (const RequestTimeline& t : s.Run([](Side& x) { return x.timelines(); }))
              out.append(TimelineDict(t));
            return out;
          },
          "Timelines of recently ended requests (the last 256, then the slowest): seconds after "
          "`created` of fetch, first_byte, last_byte and end (-1: never).")
      .def(
          "_metrics_source",
          [](P& s, std::string name) {
            return MetricsSource{std::move(name), s.Run([](Side& x) { return x.metrics(); })};
          },
          nb::arg("name"))
      .def_prop_ro("closed", &P::closed)
      .def("close", &P::close,
           "Stops the side (requests still moving end); waits for calls in other threads.")
      .def("__enter__", [](nb::handle self) { return self; })
      .def("__exit__", [](P& s, nb::args) { s.close(); });
}

}  // namespace

void BindTransceiver(nb::module_& m) {
  nb::enum_<TransferState>(m, "TransferState")
      .value("INIT", TransferState::kInit)
      .value("IN_PROGRESS", TransferState::kInProgress)
      .value("COMPLETE", TransferState::kComplete)
      .value("ERROR", TransferState::kError)
      .value("TIMED_OUT", TransferState::kTimedOut)
      .value("CANCELLED", TransferState::kCancelled);

  nb::class_<PyStatus>(m, "TransferStatus", "Where one request stands on one rank.")
      .def_ro("request_id", &PyStatus::request_id)
      .def_ro("state", &PyStatus::state)
      .def_ro("code", &PyStatus::code, "Status code of the reason ('OK' unless it failed).")
      .def_ro("message", &PyStatus::message, "Why, for ERROR / TIMED_OUT / CANCELLED.")
      .def_ro("bytes", &PyStatus::bytes, "Payload bytes this rank sent or received.")
      .def_ro("seconds", &PyStatus::seconds, "From mark_ready / fetch to the terminal state.")
      .def_prop_ro("terminal", [](const PyStatus& s) { return IsTerminal(s.state); })
      .def_prop_ro("ok", [](const PyStatus& s) { return s.state == TransferState::kComplete; })
      .def("__repr__", [](const PyStatus& s) {
        std::string r = "<kvferry.TransferStatus " + std::to_string(s.request_id) + " " +
                        std::string(TransferStateName(s.state)) + " " + std::to_string(s.bytes) +
                        " B";
        if (s.code != "OK") r += " " + s.code + ": " + s.message;
        return r + ">";
      });

  nb::class_<PyFabric>(m, "InProcFabric",
                       "Joins sides with transport='inproc' inside one process (tests).")
      .def(nb::init<>())
      .def(
          "kill", [](PyFabric& f, const std::string& a) { Check(f.fabric->Kill(a)); },
          nb::arg("address"), "Makes the transport at `address` die like a crashed peer.");

  m.def("transports", &AvailableTransports, "Transport names compiled in ('inproc' first).");

  nb::class_<PyContext> ctx(m, "ContextSide", "The sending side of one context (prefill) rank.");
  ctx.def(
         "__init__",
         [](PyContext* self, PyDevice& device, PyPool& pool, const std::string& transport,
            double timeout, int64_t chunk_bytes, int64_t staging_chunks, int64_t direct_min_bytes,
            const std::optional<nb::bytes>& secret, uint64_t instance_id,
            std::optional<PyFabric*> fabric, std::optional<PyRendezvous*> rendezvous,
            const std::string& instance, double rendezvous_timeout,
            const std::optional<std::vector<float>>& kv_scales, const std::string& kv_scales_per) {
           std::shared_ptr<DeviceCore> dev = device.core();
           std::shared_ptr<PoolCore> pc = pool.core();
           pc->CheckWrapped();
           TransceiverOptions o =
               MakeOptions(transport, timeout, chunk_bytes, staging_chunks, direct_min_bytes,
                           instance_id, MakeScales(kv_scales, kv_scales_per));
           std::unique_ptr<Transport> t = MakeInProc(fabric, transport, *dev);
           // Last of the checks: with a rendezvous, this waits for rank 0.
           const Secret s = ContextSecret(secret, rendezvous.value_or(nullptr), instance,
                                          instance_id, rendezvous_timeout, *pc->pool);
           o.instance_secret = s;
           std::unique_ptr<ContextSide> side;
           {
             nb::gil_scoped_release nogil;
             auto r = t ? ContextSide::Create(*dev->device, *pc->pool, o, std::move(t))
                        : ContextSide::Create(*dev->device, *pc->pool, o);
             side = Take(std::move(r));
           }
           new (self) PyContext("ContextSide", dev, pc, std::move(side), s);
         },
         nb::arg("device"), nb::arg("pool"), nb::arg("transport") = "ucx", nb::arg("timeout") = 0.0,
         nb::arg("chunk_bytes") = 0, nb::arg("staging_chunks") = 0, nb::arg("direct_min_bytes") = 0,
         nb::arg("instance_secret") = nb::none(), nb::arg("instance_id") = 0,
         nb::arg("fabric") = nb::none(), nb::arg("rendezvous") = nb::none(),
         nb::arg("instance") = "context", nb::arg("rendezvous_timeout") = 60.0,
         nb::arg("kv_scales") = nb::none(), nb::arg("kv_scales_per") = "tensor",
         "kv_scales: the instance's KV scales (a quantized cache stores q for q * scale), "
         "kv_scales_per 'tensor' (one per layer and K/V, [layer][kv]: vLLM's k_scale/v_scale) or "
         "'head' ([layer][kv][head]); None: 1. kv_scales_per 'block' with kv_scales None: one "
         "scale per block, layer, K/V and head, kept in the fp8 pool (Pool.allocate(block_scales="
         "True), Pool.attach_block_scales). Where the sides' scales or dtypes differ the "
         "context side converts each element (docs/conversion.md). "
         "instance_secret: 16 bytes shared by every rank of the context instance and no one else "
         "(it keys the handles' tokens). Left out: with `rendezvous` (and a non-zero "
         "instance_id), rank 0 makes one and publishes it under `instance` and the other ranks "
         "fetch it (waiting up to rendezvous_timeout s); without, an instance of one rank makes "
         "its own. Never all zero; `instance_secret` (the property) shows the one in use.")
      .def_prop_ro(
          "instance_secret",
          [](PyContext& s) { return nb::bytes(s.secret().data(), s.secret().size()); },
          "The instance secret in use (16 bytes): what other ranks of this instance need.")
      .def(
          "set_instance_addresses",
          [](PyContext& s, std::vector<std::string> a) {
            Check(s.Run([&](ContextSide& x) { return x.SetInstanceAddresses(std::move(a)); }));
          },
          nb::arg("addresses"), "Every rank's address of this instance, by rank.")
      .def(
          "mark_ready",
          [](PyContext& s, uint64_t id, nb::handle block_ids, int64_t tokens) {
            s.CheckPool();
            std::vector<int64_t> blocks = Int64Ids(block_ids, "blocks");
            std::vector<std::byte> h =
                Take(s.Run([&](ContextSide& x) { return x.MarkReady(id, blocks, tokens); }));
            return nb::bytes(h.data(), h.size());
          },
          nb::arg("request_id"), nb::arg("blocks"), nb::arg("prompt_tokens"),
          "All layers of the request are in `blocks`; returns the context handle (bytes). The "
          "blocks are leased until poll reports the request terminal.")
      .def(
          "begin_layer_wise",
          [](PyContext& s, uint64_t id, nb::handle block_ids, int64_t tokens) {
            s.CheckPool();
            std::vector<int64_t> blocks = Int64Ids(block_ids, "blocks");
            std::vector<std::byte> h =
                Take(s.Run([&](ContextSide& x) { return x.BeginLayerWise(id, blocks, tokens); }));
            return nb::bytes(h.data(), h.size());
          },
          nb::arg("request_id"), nb::arg("blocks"), nb::arg("prompt_tokens"),
          "As mark_ready, but layers move only once marked ready.")
      .def(
          "mark_layers_ready",
          [](PyContext& s, uint64_t id, int32_t n) {
            Check(s.Run([&](ContextSide& x) { return x.MarkLayersReady(id, n); }));
          },
          nb::arg("request_id"), nb::arg("local_layers"),
          "The first `local_layers` layers of this rank's stage are ready.")
      .def(
          "mark_layer_ready_on",
          [](PyContext& s, uint64_t id, int32_t layer, PyEvent& event) {
            const std::shared_ptr<EventCore>& ec = event.core();
            if (s.closed()) throw ClosedError("ContextSide");
            if (ec->device.get() != s.device_core()) {
              ThrowInvalid("the event belongs to another Device object (" +
                           ec->device->device->info().name +
                           "); create it with the device the side was made with");
            }
            std::shared_ptr<Event> e = ec->event;
            Check(s.Run([&](ContextSide& x) { return x.MarkLayerReadyOn(id, layer, e); }));
          },
          nb::arg("request_id"), nb::arg("local_layer"), nb::arg("event"),
          "Local layer `local_layer` (and those before) is ready once `event` completes.");
  CommonMethods(ctx);

  nb::class_<PyGeneration> gen(m, "GenerationSide",
                               "The receiving side of one generation (decode) rank.");
  gen.def(
         "__init__",
         [](PyGeneration* self, PyDevice& device, PyPool& pool, const std::string& transport,
            double timeout, int64_t chunk_bytes, int64_t staging_chunks, int64_t direct_min_bytes,
            const std::optional<nb::bytes>& secret, uint64_t instance_id,
            std::optional<PyFabric*> fabric, const std::optional<std::vector<float>>& kv_scales,
            const std::string& kv_scales_per) {
           std::shared_ptr<DeviceCore> dev = device.core();
           std::shared_ptr<PoolCore> pc = pool.core();
           pc->CheckWrapped();
           // The generation side holds no secret (a handle carries its token); one given is
           // checked like the context side's, then not used.
           if (secret.has_value()) SecretFrom(*secret);
           TransceiverOptions o =
               MakeOptions(transport, timeout, chunk_bytes, staging_chunks, direct_min_bytes,
                           instance_id, MakeScales(kv_scales, kv_scales_per));
           std::unique_ptr<Transport> t = MakeInProc(fabric, transport, *dev);
           std::unique_ptr<GenerationSide> side;
           {
             nb::gil_scoped_release nogil;
             auto r = t ? GenerationSide::Create(*dev->device, *pc->pool, o, std::move(t))
                        : GenerationSide::Create(*dev->device, *pc->pool, o);
             side = Take(std::move(r));
           }
           new (self) PyGeneration("GenerationSide", dev, pc, std::move(side));
         },
         nb::arg("device"), nb::arg("pool"), nb::arg("transport") = "ucx", nb::arg("timeout") = 0.0,
         nb::arg("chunk_bytes") = 0, nb::arg("staging_chunks") = 0, nb::arg("direct_min_bytes") = 0,
         nb::arg("instance_secret") = nb::none(), nb::arg("instance_id") = 0,
         nb::arg("fabric") = nb::none(), nb::arg("kv_scales") = nb::none(),
         nb::arg("kv_scales_per") = "tensor",
         "kv_scales, kv_scales_per: this instance's KV scales, as ContextSide's. "
         "instance_secret is not needed here (a handle carries its token); one given must still "
         "be 16 bytes, not all zero.")
      .def(
          "fetch",
          [](PyGeneration& s, const nb::bytes& handle, nb::handle block_ids,
             int64_t reused_blocks) {
            s.CheckPool();
            std::vector<int64_t> blocks = Int64Ids(block_ids, "blocks");
            std::span<const std::byte> h = Bytes(handle);
            Check(s.Run([&](GenerationSide& x) { return x.Fetch(h, blocks, reused_blocks); }));
          },
          nb::arg("handle"), nb::arg("blocks"), nb::arg("reused_blocks") = 0,
          "Starts fetching the request named in `handle` (bytes) into `blocks`; the first "
          "`reused_blocks` are already held and not moved. Later failures arrive through poll.");
  CommonMethods(gen);

  m.def(
      "_fetch_wait_loop",
      [](PyContext& ctx, PyGeneration& gen, std::vector<int64_t> ctx_blocks,
         std::vector<int64_t> gen_blocks, int64_t tokens, int iterations, uint64_t first_id,
         double timeout) {
        std::vector<double> out;
        Status failed;
        nb::gil_scoped_release nogil;
        ctx.Locked([&](ContextSide& c) {
          return gen.Locked([&](GenerationSide& g) {
            for (int i = 0; i < iterations && failed.ok(); ++i) {
              const uint64_t id = first_id + static_cast<uint64_t>(i);
              auto h = c.MarkReady(id, ctx_blocks, tokens);
              if (!h.ok()) {
                failed = h.status();
                break;
              }
              const Deadline d = DeadlineAfter(timeout);
              const auto t0 = Clock::now();
              failed = g.Fetch(*h, gen_blocks, 0);
              std::vector<TransferStatus> st;
              while (failed.ok() && st.empty() && Clock::now() < d) st = g.Poll(1, d);
              const auto t1 = Clock::now();
              if (failed.ok() && (st.empty() || st[0].state != TransferState::kComplete)) {
                failed = Status::Internal("request " + std::to_string(id) + " did not complete");
              }
              c.Poll(1, d);
              out.push_back(std::chrono::duration<double>(t1 - t0).count());
            }
            return 0;
          });
        });
        Check(failed);  // StatusError propagates; nanobind translates it with the GIL back
        return out;
      },
      nb::arg("ctx"), nb::arg("gen"), nb::arg("ctx_blocks"), nb::arg("gen_blocks"),
      nb::arg("tokens"), nb::arg("iterations"), nb::arg("first_id"), nb::arg("timeout"),
      "Benchmark helper: the fetch-and-wait loop of examples/bench_python_overhead.py in C++ "
      "(seconds per request), the same-run baseline of the Python loop.");
}

}  // namespace kvferry::py
