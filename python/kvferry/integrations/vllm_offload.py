"""kvferry as vLLM's KV offloading backend: a host tier and a file tier that survives restarts.

vLLM's ``OffloadingConnector`` keeps its scheduler and worker logic and asks a pluggable
*offloading spec* for two things: a manager (scheduler side: which blocks are stored where,
``lookup``/``prepare_store``/``prepare_load``/``complete_*``, eviction, events) and a worker (worker
side: asynchronous block copies between vLLM's KV tensors and the offloaded medium, reported by
``get_finished``). ``KvferryOffloadingSpec`` is such a spec, loaded without patching vLLM::

    kv_transfer_config = {
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "KvferryOffloadingSpec",
            "spec_module_path": "kvferry.integrations.vllm_offload",
            "kvferry_host_blocks": 256, "kvferry_file_dir": "/var/kv", "kvferry_file_slots": 4096}}

``KvferryOffloadingConnector`` (same module, ``kv_connector_module_path``) is vLLM's connector plus
one method: it reports blocks whose load failed (a slot that fails its checksum) to vLLM, which
then recomputes them (``kv_load_failure_policy="recompute"``). Under the plain connector a failed
load fails the job, which vLLM's worker does not accept (it stops): nothing wrong is loaded either
way.

Tiers. The file tier (a ``kvferry.SlabStore``) keeps every stored block (write-through) while it
has room; the host tier (a pinned ``kvferry.Pool``) keeps the recently stored or loaded ones. A
store writes both, a load reads the host copy when there is one, else the file slot, and then
copies a block it read from files into the host tier too (promotion, when the host tier has a free
block or a least recently used one no transfer holds). Each tier evicts least recently used blocks
that no transfer holds; a block leaves the index when it is in neither tier.

Keys. vLLM names a block by its ``OffloadKey`` (its prefix block hash, a hash chain over the
tokens and extra keys of the block and every block before it, plus the KV group index). kvferry's
file slots carry a 128-bit key: ``blake2b(identity digest || OffloadKey, 16 bytes)``, where the
identity digest hashes what the bytes depend on (model, dtype, block and hash sizes, bytes per
block, layers, parallel layout, kvferry format version). The key is written into the slot header
and checked on every read (a slot reused for another block reads as an error, not as data).

Restart. ``kvferry_file_dir`` holds, per worker rank, ``rank<r>/`` with the slab files, an
``identity.json`` (the identity above, readable) and ``session.json`` (the slots this run found
intact at open, written by the worker for its scheduler). A new engine on the same directory
opens the store (``recover="verify"``: every slot's header and payload checksum is read at open,
so a corrupted slot is dropped before the index exists), and the manager indexes the recovered
slots by their keys: vLLM's lookups of the same prefixes hit them. A directory whose
``identity.json`` differs (another model, dtype, block size or layout) is refused by name and left
untouched: the engine runs without the file tier. vLLM's block hashes must be stable across
restarts: the default (sha256) hash with vLLM's fixed seed is; ``xxhash`` without
``PYTHONHASHSEED`` draws a random seed per start, so nothing would be found again.
"""

from __future__ import annotations

import logging

from .offload_manager import (  # noqa: F401 - the backend's names, importable from here
    FORMAT,
    IDENTITY_FILE,
    SESSION_FILE,
    KvferryOffloadingManager,
    KvferrySpecEntries,
    ManagerStats,
    OffloadOptions,
    check_identity,
    identity_digest,
    identity_of,
    rank_dir,
    read_sessions,
    slot_key,
)
from .offload_worker import KvferryOffloadingWorker  # noqa: F401

logger = logging.getLogger("kvferry.vllm_offload")


def _vllm_base():
    # Imported lazily so that the manager and worker work without vLLM (tests, benchmarks).
    try:
        from vllm.v1.kv_offload import base
        return base
    except ImportError:
        return None


# ---------------------------------------------------------------------------------------------
# The vLLM classes (defined only when vLLM imports)

_base = _vllm_base()

if _base is not None:
    from vllm.v1.kv_offload.base import (
        LoadStoreSpec,
        LookupResult,
        Medium,
        OffloadingEvent,
        OffloadingManager,
        OffloadingSpec,
        OffloadingWorker,
        PrepareStoreOutput,
        RequestOffloadingContext,
        TransferResult,
    )
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    class KvferryLoadStoreSpec(LoadStoreSpec, KvferrySpecEntries):
        def __init__(self, entries: KvferrySpecEntries):
            KvferrySpecEntries.__init__(self, entries.host.tolist(), entries.slots.tolist(),
                                        entries.keys, entries.promote.tolist())

    _LOOKUP = {"hit": LookupResult.HIT, "pending": LookupResult.HIT_PENDING,
               "miss": LookupResult.MISS}
    _MEDIUM = {"host": Medium.CPU, "file": Medium.STORAGE}

    class _Manager(OffloadingManager):
        def __init__(self, core: KvferryOffloadingManager):
            self.core = core

        def lookup(self, key, req_context):
            return _LOOKUP[self.core.lookup(bytes(key))]

        def get_load_source(self, key, req_context):
            return (CacheHitSource.HOST if self.core.source(bytes(key)) == "host"
                    else CacheHitSource.DISK)

        def prepare_load(self, keys, req_context):
            return KvferryLoadStoreSpec(self.core.prepare_load([bytes(k) for k in keys]))

        def touch(self, keys, req_context):
            self.core.touch([bytes(k) for k in keys])

        def complete_load(self, keys, req_context):
            self.core.complete_load([bytes(k) for k in keys])

        def prepare_store(self, keys, req_context):
            keys = list(keys)
            raw = {bytes(k): k for k in keys}
            to_store, where, evicted = self.core.prepare_store(list(raw))
            return PrepareStoreOutput(keys_to_store=[raw[k] for k in to_store],
                                      store_spec=KvferryLoadStoreSpec(where),
                                      evicted_keys=list(evicted))

        def complete_store(self, keys, req_context, success=True):
            self.core.complete_store([bytes(k) for k in keys], success)

        def on_new_request(self, req_context):
            return RequestOffloadingContext()

        def take_events(self):
            for keys, tier, removed in self.core.take_events():
                yield OffloadingEvent(keys=keys, medium=_MEDIUM[tier], removed=removed)

        def reset_cache(self):
            self.core.reset()

    class _Worker(OffloadingWorker):
        def __init__(self, core: KvferryOffloadingWorker):
            self.core = core

        def submit_store(self, job_id, src_spec, dst_spec):
            return self.core.submit_store(job_id, src_spec.block_ids, dst_spec)

        def submit_load(self, job_id, src_spec, dst_spec):
            return self.core.submit_load(job_id, src_spec, dst_spec.block_ids)

        def get_finished(self):
            return [TransferResult(job_id=j, success=ok, transfer_size=n, transfer_time=t)
                    for j, ok, n, t in self.core.get_finished()]

        def wait(self, job_ids):
            self.core.wait(job_ids)

        def shutdown(self):
            self.core.shutdown()

    class KvferryOffloadingSpec(OffloadingSpec):
        """vLLM offloading spec: kvferry host tier and/or file tier (see the module docstring)."""

        def __init__(self, config):
            super().__init__(config)
            self.options = OffloadOptions.from_extra(self.extra_config)
            if len(config.groups) != 1:
                raise ValueError(f"KvferryOffloadingSpec: {len(config.groups)} KV cache groups; "
                                 "one is supported")
            if config.cache.blocks_per_chunk != 1:
                raise ValueError("KvferryOffloadingSpec: offloaded blocks are vLLM's blocks "
                                 "(blocks_per_chunk 1); leave block_size/blocks_per_chunk unset")
            self.identity = identity_of(config)
            self.digest = identity_digest(self.identity)
            self.report_load_errors = False  # set by KvferryOffloadingConnector
            self._manager: _Manager | None = None
            self._worker: _Worker | None = None

        def get_manager(self):
            if self._manager is None:
                o, c = self.options, self.config
                recovered, why = [], ""
                if o.file_slots:
                    recovered, why = read_sessions(o.file_dir, c.parallel.world_size,
                                                   self.identity, c.engine_id)
                    if why:
                        logger.error("kvferry offload: file tier off: %s", why)
                core = KvferryOffloadingManager(
                    self.digest, o.host_blocks, 0 if why else o.file_slots, recovered,
                    enable_events=self.kv_events_config.enable_kv_cache_events,
                    promote=o.promote)
                core.stats.file_refused = why
                self._manager = _Manager(core)
            return self._manager

        def get_worker(self, kv_caches):
            if self._worker is None:
                if len(kv_caches.group_data_refs) != 1:
                    raise ValueError("KvferryOffloadingSpec: one KV cache group is supported")
                tensors = [t.tensor for t in kv_caches.tensors]
                c = self.config
                self._worker = _Worker(KvferryOffloadingWorker(
                    tensors, c.groups[0].tokens_per_block, self.options, self.identity,
                    c.parallel.rank, c.engine_id, self.report_load_errors))
            return self._worker

    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )

    class KvferryOffloadingConnector(OffloadingConnector):
        """vLLM's OffloadingConnector that also reports the vLLM blocks whose load failed (a
        slot failing its checks), so that vLLM recomputes them (kv_load_failure_policy
        'recompute') instead of stopping, and on its scheduler side tells the manager which keys
        failed (forgotten, so the next request stores the recomputed block instead of failing
        again)."""

        def __init__(self, vllm_config, role, kv_cache_config):
            extra = vllm_config.kv_transfer_config.kv_connector_extra_config
            extra.setdefault("spec_name", "KvferryOffloadingSpec")
            extra.setdefault("spec_module_path", __name__)
            super().__init__(vllm_config, role, kv_cache_config)
            self._loading: dict[int, int] = {}  # scheduler: vLLM block id -> key being loaded
            if self.connector_worker is not None:
                self.connector_worker.spec.report_load_errors = True

        def build_connector_meta(self, scheduler_output):
            meta = super().build_connector_meta(scheduler_output)
            # Which key each vLLM block is being loaded from: a block reported invalid names it.
            for job in getattr(meta, "load_jobs", {}).values():
                if isinstance(job.src_spec, KvferrySpecEntries):
                    for b, k in zip(job.dst_spec.block_ids.tolist(), job.src_spec.keys):
                        self._loading[b] = k
            return meta

        def update_connector_output(self, connector_output):
            super().update_connector_output(connector_output)
            bad = getattr(connector_output, "invalid_block_ids", None)
            if bad and self.connector_scheduler is not None:
                keys = [self._loading.pop(b) for b in bad if b in self._loading]
                manager = self.connector_scheduler.manager
                if isinstance(manager, _Manager):
                    manager.core.discard(keys)

        def get_block_ids_with_load_errors(self) -> set[int]:
            w = self.connector_worker
            if w is None or w.worker is None or not isinstance(w.worker, _Worker):
                return set()
            return w.worker.core.take_failed_blocks()
