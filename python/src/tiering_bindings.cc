// The tiered cache: TransferManager (copies between tiers on its own streams) and BlockManager
// (prefix reuse, eviction with offload, onboarding).
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <mutex>
#include <shared_mutex>

#include "bindings.h"
#include "kvferry/block_manager.h"
#include "kvferry/prometheus.h"
#include "kvferry/tiering.h"

namespace kvferry::py {

namespace {

struct ManagerCore {
  std::shared_ptr<DeviceCore> device;
  std::shared_ptr<PoolCore> primary, host;
  std::unique_ptr<TransferManager> manager;
  ~ManagerCore() {
    // Queued copies finish before the pools can go (the manager's streams drain on destruction).
    manager.reset();
  }
  // Before queuing copies: neither pool's wrapped tensors moved (with the GIL).
  void CheckPools() const {
    primary->CheckWrapped();
    if (host) host->CheckWrapped();
  }
};

// The manager's calls that wait (drain) run without the GIL under a shared lock, which close()
// takes exclusively: close waits for them (bindings.h). Calls that keep the GIL hold a copy of
// the core, so close() leaves the manager to the last of them.
class PyTransferManager {
 public:
  explicit PyTransferManager(std::shared_ptr<ManagerCore> core) : core_(std::move(core)) {}
  // A reference for the caller's whole call (with the GIL).
  std::shared_ptr<ManagerCore> core() const {
    std::shared_lock lock(mu_);
    if (!core_) throw ClosedError("TransferManager");
    return core_;
  }
  // Runs f(manager) without the GIL, under the shared lock.
  template <typename F>
  auto Run(F&& f) {
    nb::gil_scoped_release nogil;
    std::shared_lock lock(mu_);
    if (!core_) throw ClosedError("TransferManager");
    return f(*core_->manager);
  }
  void close() {
    std::shared_ptr<ManagerCore> c;
    {
      nb::gil_scoped_release nogil;
      std::unique_lock lock(mu_);  // waits for calls running without the GIL
      c = std::move(core_);
      if (c && c.use_count() == 1) c->manager.reset();  // drains the streams
    }
    // c (whose pools may hold Python objects) goes with the GIL held.
  }
  bool closed() const {
    std::shared_lock lock(mu_);
    return core_ == nullptr;
  }

 private:
  mutable std::shared_mutex mu_;
  std::shared_ptr<ManagerCore> core_;
};

struct PyBatch {
  TransferBatch batch;
  std::shared_ptr<ManagerCore> keep;  // the pools stay alive while a batch may be copying
};

class PyBlockManager {
 public:
  PyBlockManager(std::shared_ptr<ManagerCore> m, std::unique_ptr<BlockManager> b)
      : manager_(std::move(m)), blocks_(std::move(b)) {}
  BlockManager& get() const {
    if (!blocks_) throw ClosedError("BlockManager");
    return *blocks_;
  }
  // For calls that may offload or onboard: the pools' wrapped tensors have not moved.
  BlockManager& copying() const {
    BlockManager& b = get();
    manager_->CheckPools();
    return b;
  }
  void close() {
    blocks_.reset();
    manager_.reset();
  }
  bool closed() const { return blocks_ == nullptr; }

 private:
  std::shared_ptr<ManagerCore> manager_;
  std::unique_ptr<BlockManager> blocks_;
};

std::vector<BlockMove> ParseMoves(nb::handle moves) {
  std::vector<BlockMove> out;
  for (nb::handle item : moves) {
    if (nb::isinstance<nb::tuple>(item) || nb::isinstance<nb::list>(item)) {
      size_t n = nb::len(item);
      if (n < 2 || n > 3) ThrowInvalid("a move is (src, dst) or (src, dst, tokens)");
      BlockMove mv;
      mv.src = nb::cast<int64_t>(item[0]);
      mv.dst = nb::cast<int64_t>(item[1]);
      if (n == 3) mv.tokens = nb::cast<int32_t>(item[2]);
      out.push_back(mv);
    } else {
      ThrowInvalid("a move is a tuple (src, dst) or (src, dst, tokens)");
    }
  }
  return out;
}

nb::object ItemError(const Status& s) {
  if (s.ok()) return nb::none();
  std::string code(StatusCodeName(s.code()));
  return nb::module_::import_("kvferry.errors").attr("error_for")(code, std::string(s.message()));
}

nb::dict TransferStatsDict(const TransferStats& s) {
  nb::dict d;
  d["batches"] = s.batches;
  d["blocks"] = s.blocks;
  d["descriptors"] = s.descriptors;
  d["bytes"] = s.bytes;
  d["file_writes"] = s.file_writes;
  d["file_write_errors"] = s.file_write_errors;
  d["file_reads"] = s.file_reads;
  d["file_read_errors"] = s.file_read_errors;
  return d;
}

nb::tuple Tiers(const int64_t (&v)[kNumTiers]) { return nb::make_tuple(v[0], v[1], v[2]); }

nb::dict BlockStatsDict(const BlockManagerStats& s) {
  nb::dict d;
  d["cached"] = Tiers(s.cached);
  d["free_primary"] = s.free_primary;
  d["free_host"] = s.free_host;
  d["hits"] = Tiers(s.hits);
  d["lookups"] = s.lookups;
  d["offloaded"] = s.offloaded;
  d["demoted"] = s.demoted;
  d["onboarded"] = s.onboarded;
  d["partial_copies"] = s.partial_copies;
  d["dropped"] = Tiers(s.dropped);
  d["write_failures"] = s.write_failures;
  d["corrupt_reads"] = s.corrupt_reads;
  return d;
}

nb::object Key(const BlockKey& k) {
  nb::int_ hi(k.hi), lo(k.lo);
  return hi.attr("__lshift__")(64).attr("__or__")(lo);
}

}  // namespace

void BindTiering(nb::module_& m) {
  nb::enum_<Tier>(m, "Tier")
      .value("PRIMARY", Tier::kPrimary)
      .value("HOST", Tier::kHost)
      .value("FILE", Tier::kFile);

  nb::class_<PyBatch>(m, "TransferBatch", "One queued batch of block copies.")
      .def(
          "query", [](PyBatch& b) { return b.batch.Query(); },
          "True when every copy of the batch has finished.")
      .def(
          "wait",
          [](PyBatch& b, double timeout) {
            Deadline d = DeadlineAfter(timeout);
            Status s;
            {
              nb::gil_scoped_release nogil;
              s = b.batch.Wait(d);
            }
            Check(s);
          },
          nb::arg("timeout"),
          "Waits until the batch finished (DeadlineExceededError at the timeout); raises the "
          "first item error.")
      .def_prop_ro(
          "items",
          [](PyBatch& b) {
            if (!b.batch.Query()) ThrowInvalid("batch not finished: wait() first");
            nb::list out;
            for (const Status& s : b.batch.items()) out.append(ItemError(s));
            return out;
          },
          "Per move: None, or the exception for its error (once finished).")
      .def("__len__", [](PyBatch& b) { return b.batch.size(); })
      .def_prop_ro(
          "descriptors", [](PyBatch& b) { return b.batch.descriptors(); },
          "Copy descriptors after coalescing neighbouring blocks.");

  nb::class_<PyTransferManager>(m, "TransferManager",
                                "Copies blocks between the primary pool (device memory) and a "
                                "host pool on its own offload and onboard streams.")
      .def(
          "__init__",
          [](PyTransferManager* self, PyDevice& device, PyPool& primary, PyPool* host,
             int64_t file_staging_blocks) {
            auto core = std::make_shared<ManagerCore>();
            core->device = device.core();
            core->primary = primary.core();
            if (host) core->host = host->core();
            core->CheckPools();
            TransferOptions o;
            o.file_staging_blocks = file_staging_blocks;
            core->manager = Take(
                TransferManager::Create(*core->device->device, *core->primary->pool,
                                        core->host ? &*core->host->pool : nullptr, nullptr, o));
            new (self) PyTransferManager(std::move(core));
          },
          nb::arg("device"), nb::arg("primary"), nb::arg("host") = nb::none(),
          nb::arg("file_staging_blocks") = 32)
      .def(
          "move",
          [](PyTransferManager& t, Tier from, Tier to, nb::handle moves) {
            std::shared_ptr<ManagerCore> c = t.core();
            c->CheckPools();
            std::vector<BlockMove> mv = ParseMoves(moves);
            return PyBatch{Take(c->manager->Move(from, to, mv)), c};
          },
          nb::arg("from_tier"), nb::arg("to_tier"), nb::arg("moves"),
          "Queues one batch; moves are (src, dst) or (src, dst, tokens) block ids.")
      .def(
          "offload",
          [](PyTransferManager& t, nb::handle moves, Tier to) {
            std::shared_ptr<ManagerCore> c = t.core();
            c->CheckPools();
            std::vector<BlockMove> mv = ParseMoves(moves);
            return PyBatch{Take(c->manager->Offload(to, mv)), c};
          },
          nb::arg("moves"), nb::arg("to_tier") = Tier::kHost)
      .def(
          "onboard",
          [](PyTransferManager& t, nb::handle moves, Tier from) {
            std::shared_ptr<ManagerCore> c = t.core();
            c->CheckPools();
            std::vector<BlockMove> mv = ParseMoves(moves);
            return PyBatch{Take(c->manager->Onboard(from, mv)), c};
          },
          nb::arg("moves"), nb::arg("from_tier") = Tier::kHost)
      .def(
          "drain",
          [](PyTransferManager& t, double timeout) {
            Deadline d = DeadlineAfter(timeout);
            Check(t.Run([&](TransferManager& tm) { return tm.Drain(d); }));
          },
          nb::arg("timeout"),
          "Waits for every queued batch; close() in another thread waits for it.")
      .def(
          "sync_with_compute",
          [](PyTransferManager& t, PyStream& s) {
            Check(t.core()->manager->SyncWithCompute(*s.core()->stream));
          },
          nb::arg("compute"), "Later work on `compute` waits for every copy queued so far.")
      .def(
          "wait_for_compute",
          [](PyTransferManager& t, PyStream& s) {
            Check(t.core()->manager->WaitForCompute(*s.core()->stream));
          },
          nb::arg("compute"), "Later copies wait for the work queued on `compute` so far.")
      .def("tier_blocks",
           [](PyTransferManager& t, Tier tier) { return t.core()->manager->tier_blocks(tier); })
      .def_prop_ro(
          "stats",
          [](PyTransferManager& t) { return TransferStatsDict(t.core()->manager->stats()); })
      .def(
          "metrics", [](PyTransferManager& t) { return MetricsDict(t.core()->manager->metrics()); },
          "Bytes, batches, blocks and copy latency per direction (from, to), file I/O counts.")
      .def(
          "_metrics_source",
          [](PyTransferManager& t, std::string name) {
            return MetricsSource{std::move(name), t.core()->manager->metrics()};
          },
          nb::arg("name"))
      .def_prop_ro("closed", &PyTransferManager::closed)
      .def("close", &PyTransferManager::close)
      .def("__enter__", [](nb::handle self) { return self; })
      .def("__exit__", [](PyTransferManager& t, nb::args) { t.close(); });

  nb::class_<PyBlockManager>(m, "BlockManager",
                             "Prefix reuse, eviction with offload and onboarding over a "
                             "TransferManager. One thread at a time (the GIL serializes calls).")
      .def(
          "__init__",
          [](PyBlockManager* self, PyTransferManager& transfers, const std::string& model_id,
             uint64_t salt, int32_t offload_min_priority, bool partial_reuse) {
            std::shared_ptr<ManagerCore> mc = transfers.core();
            BlockManagerOptions o = BlockManagerOptions::FromConfig();
            const BlockPool& p = *mc->primary->pool;
            o.identity = CacheIdentity{model_id, p.shape(), p.spec().parallel, p.slice(), salt};
            if (offload_min_priority >= 0) o.offload_min_priority = offload_min_priority;
            o.partial_reuse = partial_reuse;
            auto bm = Take(BlockManager::Create(*mc->manager, o));
            new (self) PyBlockManager(std::move(mc), std::move(bm));
          },
          nb::arg("transfers"), nb::arg("model_id") = "", nb::arg("salt") = 0,
          nb::arg("offload_min_priority") = -1, nb::arg("partial_reuse") = true)
      .def(
          "add_sequence",
          [](PyBlockManager& b, uint64_t id, std::vector<int32_t> prompt, int32_t priority) {
            Admission a = Take(b.copying().AddSequence(id, prompt, priority));
            nb::dict d;
            d["blocks"] = a.blocks;
            d["reused_tokens"] = a.reused_tokens;
            d["hits"] = Tiers(a.hits);
            d["partial_tokens"] = a.partial_tokens;
            d["misses"] = a.misses;
            return d;
          },
          nb::arg("id"), nb::arg("prompt"), nb::arg("priority") = kDefaultPriority,
          "Reuses the longest cached prefix and allocates the rest: blocks, reused_tokens, hits "
          "per tier, partial_tokens, misses.")
      .def(
          "append_tokens",
          [](PyBlockManager& b, uint64_t id, std::vector<int32_t> t) {
            Check(b.copying().AppendTokens(id, t));
          },
          nb::arg("id"), nb::arg("tokens"))
      .def(
          "remove_sequence",
          [](PyBlockManager& b, uint64_t id) { Check(b.copying().RemoveSequence(id)); },
          nb::arg("id"))
      .def(
          "blocks", [](PyBlockManager& b, uint64_t id) { return Take(b.get().Blocks(id)); },
          nb::arg("id"))
      .def(
          "drain_events",
          [](PyBlockManager& b) {
            nb::list out;
            for (const KvEvent& e : b.get().DrainEvents()) {
              nb::dict d;
              d["kind"] = std::string(KvEventKindName(e.kind));
              d["key"] = Key(e.key);
              d["from"] = e.from;
              d["to"] = e.to;
              d["reason"] = e.reason;
              out.append(d);
            }
            return out;
          },
          "Cache events since the last drain: kind (stored|moved|removed), key, from, to, reason.")
      .def_prop_ro("stats", [](PyBlockManager& b) { return BlockStatsDict(b.get().stats()); })
      .def(
          "_metrics_source",
          [](PyBlockManager& b, std::string name) {
            return MetricsSource{std::move(name), b.get().stats()};
          },
          nb::arg("name"))
      .def_prop_ro("closed", &PyBlockManager::closed)
      .def("close", &PyBlockManager::close)
      .def("__enter__", [](nb::handle self) { return self; })
      .def("__exit__", [](PyBlockManager& b, nb::args) { b.close(); });
}

}  // namespace kvferry::py
