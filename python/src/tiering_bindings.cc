// The tiered cache: TransferManager (copies between tiers on its own streams) and BlockManager
// (prefix reuse, eviction with offload, onboarding).
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <mutex>
#include <shared_mutex>
#include <utility>

#include "bindings.h"
#include "ids.h"
#include "kvferry/block_manager.h"
#include "kvferry/prometheus.h"
#include "kvferry/slab_store.h"
#include "kvferry/tiering.h"

namespace kvferry::py {

namespace {

// A slab store (the file tier). Closing the Python object drops its reference; the store (and its
// directory lock) goes with the last TransferManager that uses it.
struct StoreCore {
  std::unique_ptr<SlabStore> store;
  std::string dir;
};

class PySlabStore {
 public:
  explicit PySlabStore(std::shared_ptr<StoreCore> core) : core_(std::move(core)) {}
  const std::shared_ptr<StoreCore>& core() const {
    if (!core_) throw ClosedError("SlabStore");
    return core_;
  }
  void close() { core_.reset(); }
  bool closed() const { return core_ == nullptr; }

 private:
  std::shared_ptr<StoreCore> core_;
};

struct ManagerCore {
  std::shared_ptr<DeviceCore> device;
  std::shared_ptr<PoolCore> primary, host;
  std::shared_ptr<StoreCore> file;
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

// The BlockManager serves one thread at a time. Every call holds mu_ while it uses it: calls that
// keep the GIL take it at once when it is free (the common case, no GIL round trip), and release
// the GIL while they wait for it; wait_ready holds it without the GIL. A thread holding mu_ never
// waits for the GIL (wait_ready lets mu_ go first), so the two locks cannot deadlock.
class PyBlockManager {
 public:
  PyBlockManager(std::shared_ptr<ManagerCore> m, std::unique_ptr<BlockManager> b)
      : manager_(std::move(m)), blocks_(std::move(b)) {}
  // With the GIL held.
  std::unique_lock<std::mutex> Lock() const {
    std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
    if (!lock.owns_lock()) {
      nb::gil_scoped_release nogil;
      lock.lock();
    }
    return lock;
  }
  // Under Lock() (or mu_ held without the GIL).
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
  std::mutex& mu() const { return mu_; }
  void close() {
    std::unique_lock<std::mutex> lock = Lock();
    blocks_.reset();
    std::shared_ptr<ManagerCore> m = std::move(manager_);
    lock.unlock();
    // m (whose pools may hold Python objects) goes with the GIL held.
  }
  bool closed() const {
    std::unique_lock<std::mutex> lock = Lock();
    return blocks_ == nullptr;
  }

 private:
  mutable std::mutex mu_;
  std::shared_ptr<ManagerCore> manager_;
  std::unique_ptr<BlockManager> blocks_;
};

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
  d["prefetched"] = s.prefetched;
  d["background_evictions"] = s.background_evictions;
  d["inline_evictions"] = s.inline_evictions;
  d["ops_in_flight"] = s.ops_in_flight;
  d["file_ops_in_flight"] = s.file_ops_in_flight;
  d["deferred_reads"] = s.deferred_reads;
  d["inflight_bytes"] = s.inflight_bytes;
  d["abandoned"] = s.abandoned;
  d["leased_slots"] = s.leased_slots;
  d["recovered"] = s.recovered;
  d["events_dropped"] = s.events_dropped;
  d["submit_ns"] = s.submit_ns;
  return d;
}

nb::object Key(const BlockKey& k) {
  nb::int_ hi(k.hi), lo(k.lo);
  return hi.attr("__lshift__")(64).attr("__or__")(lo);
}

// The inverse of Key: a 128-bit Python int.
BlockKey KeyOf(nb::int_ key) {
  if (nb::cast<bool>(key.attr("__lt__")(0)) || nb::cast<int64_t>(key.attr("bit_length")()) > 128) {
    ThrowInvalid("a block key is an int in [0, 2**128)");
  }
  nb::int_ mask(~uint64_t{0});
  return BlockKey{nb::cast<uint64_t>(key.attr("__rshift__")(64)),
                  nb::cast<uint64_t>(key.attr("__and__")(mask))};
}

// Moves' keys (`keys=`): a sequence of 128-bit ints, one per move, written with file slots and
// checked against them on reads (SlabStore: a slot holding another key reads as kDataLoss).
void AttachKeys(nb::handle keys, std::vector<BlockMove>& moves) {
  if (keys.is_none()) return;
  if (!nb::isinstance<nb::sequence>(keys) || nb::isinstance<nb::str>(keys)) {
    ThrowInvalid("keys: a sequence of ints in [0, 2**128), one per move");
  }
  if (nb::len(keys) != moves.size()) {
    ThrowInvalid("keys: " + std::to_string(nb::len(keys)) + " keys for " +
                 std::to_string(moves.size()) + " moves");
  }
  size_t i = 0;
  for (nb::handle k : keys) {
    nb::int_ v;
    if (!nb::try_cast(k, v))
      ThrowInvalid("keys: " + std::string(nb::repr(k).c_str()) + " is not an int");
    moves[i++].key = KeyOf(v);
  }
}

nb::dict ReadinessDict(const Readiness& r) {
  nb::dict d;
  d["ready"] = r.ready;
  d["reused_tokens"] = r.reused_tokens;
  d["misses"] = r.misses;
  return d;
}

}  // namespace

void BindTiering(nb::module_& m) {
  nb::enum_<Tier>(m, "Tier")
      .value("PRIMARY", Tier::kPrimary)
      .value("HOST", Tier::kHost)
      .value("FILE", Tier::kFile);

  nb::class_<PySlabStore>(m, "SlabStore",
                          "The file tier: fixed-size slots in slab files under one directory, "
                          "each slot's header and payload checksummed (docs/file_format.md). "
                          "Slots left by an earlier store in the same directory (a restart) are "
                          "verified at open and offered again (recovered).")
      .def(
          "__init__",
          [](PySlabStore* self, const std::string& dir, int64_t slot_bytes, int64_t slots,
             std::optional<std::string> backend, std::optional<int64_t> slots_per_file,
             std::optional<bool> direct_io, std::optional<std::string> recover,
             std::optional<double> io_timeout) {
            SlabStoreOptions o = SlabStoreOptionsFromConfig();
            o.dir = dir;
            o.slot_payload_bytes = slot_bytes;
            o.max_slots = slots;
            if (backend) o.backend = *backend;
            if (slots_per_file) o.slots_per_file = *slots_per_file;
            if (direct_io) o.direct_io = *direct_io;
            if (recover) o.recover = *recover;
            if (io_timeout) {
              if (!(*io_timeout > 0)) ThrowInvalid("io_timeout must be > 0 seconds");
              o.io_timeout_ms = static_cast<int64_t>(*io_timeout * 1000.0 + 0.5);
            }
            auto core = std::make_shared<StoreCore>();
            core->dir = dir;
            core->store = Take([&] {
              nb::gil_scoped_release nogil;  // recovery reads every slot of the files found
              return SlabStore::Open(o);
            }());
            new (self) PySlabStore(std::move(core));
          },
          nb::arg("dir"), nb::arg("slot_bytes"), nb::arg("slots"), nb::kw_only(),
          nb::arg("backend") = nb::none(), nb::arg("slots_per_file") = nb::none(),
          nb::arg("direct_io") = nb::none(), nb::arg("recover") = nb::none(),
          nb::arg("io_timeout") = nb::none(),
          "Opens (and locks: one store per directory) the tier in `dir` (it must exist): `slots` "
          "slots of `slot_bytes` payload each (a pool's block_bytes for a TransferManager's file "
          "tier). backend 'posix' | 'io_uring' | 'cufile' (falls back to posix), recover "
          "'verify' | 'headers' | 'none': the files.* knobs by default.")
      .def_prop_ro("dir", [](PySlabStore& f) { return f.core()->dir; })
      .def_prop_ro("capacity", [](PySlabStore& f) { return f.core()->store->capacity(); })
      .def_prop_ro("free_slots", [](PySlabStore& f) { return f.core()->store->free_slots(); })
      .def_prop_ro(
          "backend",
          [](PySlabStore& f) {
            const FileBackendCaps& c = f.core()->store->backend();
            nb::dict d;
            d["name"] = c.name;
            d["direct_io"] = c.direct_io;
            d["device_memory"] = c.device_memory;
            d["note"] = c.note;
            return d;
          },
          "The backend in use: name, direct_io, device_memory, note (why, e.g. a fallback).")
      .def_prop_ro(
          "recovered",
          [](PySlabStore& f) {
            nb::list out;
            for (const RecoveredSlot& r : f.core()->store->Recovered()) {
              nb::dict d;
              d["slot"] = r.slot;
              d["key"] = Key(BlockKey{r.key.hi, r.key.lo});
              d["bytes"] = r.bytes;
              out.append(d);
            }
            return out;
          },
          "Slots found intact at open (slot, key, bytes); a BlockManager over a TransferManager "
          "with this store serves them as prefix hits.")
      .def(
          "allocate", [](PySlabStore& f) { return Take(f.core()->store->Allocate()); },
          "A free slot id (lowest never-used first); ResourceExhaustedError when none is free. "
          "Writes (TransferManager moves to the file tier) need allocated slots.")
      .def(
          "release", [](PySlabStore& f, int64_t slot) { f.core()->store->Release(slot); },
          nb::arg("slot"),
          "Returns a slot to the free list (its contents are forgotten); no I/O of it may run.")
      .def_prop_ro("closed", &PySlabStore::closed)
      .def("close", &PySlabStore::close,
           "Drops this object's reference: the store (and its directory lock) goes with the last "
           "TransferManager using it.")
      .def("__enter__", [](nb::handle self) { return self; })
      .def("__exit__", [](PySlabStore& f, nb::args) { f.close(); });

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
             PySlabStore* file, int64_t file_staging_blocks) {
            auto core = std::make_shared<ManagerCore>();
            core->device = device.core();
            core->primary = primary.core();
            if (host) core->host = host->core();
            if (file) core->file = file->core();
            core->CheckPools();
            TransferOptions o = TransferOptions::FromConfig();
            o.file_staging_blocks = file_staging_blocks;
            core->manager =
                Take(TransferManager::Create(*core->device->device, *core->primary->pool,
                                             core->host ? &*core->host->pool : nullptr,
                                             core->file ? core->file->store.get() : nullptr, o));
            new (self) PyTransferManager(std::move(core));
          },
          nb::arg("device"), nb::arg("primary"), nb::arg("host") = nb::none(),
          nb::arg("file") = nb::none(), nb::arg("file_staging_blocks") = 32,
          "Copies between `primary` (device memory), an optional `host` pool and an optional "
          "file tier (`file`: a SlabStore whose slots hold one primary block each; the manager "
          "keeps it open while it lives).")
      .def(
          "move",
          [](PyTransferManager& t, Tier from, Tier to, nb::handle moves, nb::handle keys) {
            std::shared_ptr<ManagerCore> c = t.core();
            c->CheckPools();
            std::vector<BlockMove> mv = ParseMoves(moves);
            AttachKeys(keys, mv);
            return PyBatch{Take(c->manager->Move(from, to, mv)), c};
          },
          nb::arg("from_tier"), nb::arg("to_tier"), nb::arg("moves"), nb::kw_only(),
          nb::arg("keys") = nb::none(),
          "Queues one batch; moves are (src, dst) or (src, dst, tokens) block ids (slot ids in "
          "the file tier); keys: one 128-bit int per move, written with file slots and checked "
          "on reads (default 0).")
      .def(
          "offload",
          [](PyTransferManager& t, nb::handle moves, Tier to, nb::handle keys) {
            std::shared_ptr<ManagerCore> c = t.core();
            c->CheckPools();
            std::vector<BlockMove> mv = ParseMoves(moves);
            AttachKeys(keys, mv);
            return PyBatch{Take(c->manager->Offload(to, mv)), c};
          },
          nb::arg("moves"), nb::arg("to_tier") = Tier::kHost, nb::kw_only(),
          nb::arg("keys") = nb::none())
      .def(
          "onboard",
          [](PyTransferManager& t, nb::handle moves, Tier from, nb::handle keys) {
            std::shared_ptr<ManagerCore> c = t.core();
            c->CheckPools();
            std::vector<BlockMove> mv = ParseMoves(moves);
            AttachKeys(keys, mv);
            return PyBatch{Take(c->manager->Onboard(from, mv)), c};
          },
          nb::arg("moves"), nb::arg("from_tier") = Tier::kHost, nb::kw_only(),
          nb::arg("keys") = nb::none())
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
          [](PyBlockManager& b, uint64_t id, nb::handle prompt, int32_t priority) {
            std::vector<int32_t> tokens = Int32Ids(prompt, "prompt");
            auto lock = b.Lock();
            Admission a = Take(b.copying().AddSequence(id, tokens, priority));
            nb::dict d;
            d["blocks"] = Int64Array(std::move(a.blocks));
            d["reused_tokens"] = a.reused_tokens;
            d["ready"] = a.ready;
            d["hits"] = Tiers(a.hits);
            d["partial_tokens"] = a.partial_tokens;
            d["misses"] = a.misses;
            return d;
          },
          nb::arg("id"), nb::arg("prompt"), nb::arg("priority") = kDefaultPriority,
          "Reuses the longest cached prefix and allocates the rest. `prompt`: token ids (a list "
          "or a 1-D integer array). Returns blocks (numpy int64), reused_tokens, ready (False "
          "while onboards of reused blocks run: poll_ready/wait_ready), hits per tier, "
          "partial_tokens, misses.")
      .def(
          "append_tokens",
          [](PyBlockManager& b, uint64_t id, nb::handle tokens) {
            std::vector<int32_t> t = Int32Ids(tokens, "tokens");
            auto lock = b.Lock();
            Check(b.copying().AppendTokens(id, t));
          },
          nb::arg("id"), nb::arg("tokens"))
      .def(
          "remove_sequence",
          [](PyBlockManager& b, uint64_t id) {
            auto lock = b.Lock();
            Check(b.copying().RemoveSequence(id));
          },
          nb::arg("id"))
      .def(
          "blocks",
          [](PyBlockManager& b, uint64_t id) {
            auto lock = b.Lock();
            return Int64Array(Take(b.get().Blocks(id)));
          },
          nb::arg("id"), "The sequence's primary blocks (numpy int64), in token order.")
      .def(
          "prefetch",
          [](PyBlockManager& b, nb::handle prompt, int32_t priority) {
            std::vector<int32_t> tokens = Int32Ids(prompt, "prompt");
            auto lock = b.Lock();
            return Take(b.copying().Prefetch(tokens, priority));
          },
          nb::arg("prompt"), nb::arg("priority") = kDefaultPriority,
          "Starts onboarding the cached host and file blocks of the prompt's prefix into free "
          "primary blocks, so that a later add_sequence finds them there. Never waits; returns "
          "the number of blocks whose onboard started.")
      .def(
          "poll_ready",
          [](PyBlockManager& b, uint64_t id) {
            auto lock = b.Lock();
            return ReadinessDict(Take(b.get().PollReady(id)));
          },
          nb::arg("id"),
          "Whether the sequence's onboards finished (never waits): ready, reused_tokens (final "
          "once ready: failed onboards shorten the reuse), misses.")
      .def(
          "wait_ready",
          [](PyBlockManager& b, uint64_t id, double timeout) {
            Deadline d = DeadlineAfter(timeout);
            Readiness r = Take([&] {
              nb::gil_scoped_release nogil;
              std::lock_guard<std::mutex> lock(b.mu());  // let go before the GIL comes back
              return b.get().WaitReady(id, d);
            }());
            return ReadinessDict(r);
          },
          nb::arg("id"), nb::arg("timeout"),
          "Waits up to `timeout` seconds for the sequence's onboards (ready is False when it "
          "passes); as poll_ready.")
      .def(
          "poll",
          [](PyBlockManager& b) {
            auto lock = b.Lock();
            b.get().Poll();
          },
          "Retires finished copies and file I/O and runs the watermarks; never waits. Call it "
          "when idle (e.g. while a forward pass runs).")
      .def(
          "find",
          [](PyBlockManager& b, nb::int_ key) -> nb::object {
            const BlockKey k = KeyOf(key);
            auto lock = b.Lock();
            StatusOr<std::pair<Tier, int64_t>> at = b.get().Find(k);
            if (at.status().code() == StatusCode::kNotFound) return nb::none();
            auto [tier, id] = Take(std::move(at));
            return nb::make_tuple(tier, id);
          },
          nb::arg("key"),
          "Where a block key (an int, as in drain_events) is cached: (Tier, block or slot id), "
          "or None.")
      .def(
          "drain_events",
          [](PyBlockManager& b) {
            nb::list out;
            auto lock = b.Lock();
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
      .def_prop_ro("stats",
                   [](PyBlockManager& b) {
                     auto lock = b.Lock();
                     return BlockStatsDict(b.get().stats());
                   })
      .def(
          "_metrics_source",
          [](PyBlockManager& b, std::string name) {
            auto lock = b.Lock();
            return MetricsSource{std::move(name), b.get().stats()};
          },
          nb::arg("name"))
      .def_prop_ro("closed", &PyBlockManager::closed)
      .def("close", &PyBlockManager::close)
      .def("__enter__", [](nb::handle self) { return self; })
      .def("__exit__", [](PyBlockManager& b, nb::args) { b.close(); });
}

}  // namespace kvferry::py
