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
store writes both, a load reads the host copy when there is one, else the file slot. Each tier
evicts least recently used blocks that no transfer holds; a block leaves the index when it is in
neither tier.

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

import hashlib
import json
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import kvferry

logger = logging.getLogger("kvferry.vllm_offload")

FORMAT = "kvferry-vllm-offload/1"
IDENTITY_FILE = "identity.json"
SESSION_FILE = "session.json"


# ---------------------------------------------------------------------------------------------
# Options (kv_connector_extra_config keys of this spec; vLLM's own keys pass through)


@dataclass(frozen=True)
class OffloadOptions:
    host_blocks: int = 0  # pinned host tier, in vLLM blocks (0: none)
    file_dir: str = ""  # file tier directory ("" : none); per rank a subdirectory rank<r>
    file_slots: int = 0  # file tier capacity, in vLLM blocks
    file_backend: str = ""  # posix | io_uring | cufile ("": the files.backend knob)
    io_timeout_s: float = 60.0  # worker: longest wait for a job vLLM asks to wait for

    @staticmethod
    def from_extra(extra: Mapping[str, Any]) -> "OffloadOptions":
        known = {"kvferry_host_blocks": ("host_blocks", int),
                 "kvferry_file_dir": ("file_dir", str),
                 "kvferry_file_slots": ("file_slots", int),
                 "kvferry_file_backend": ("file_backend", str),
                 "kvferry_io_timeout_s": ("io_timeout_s", float)}
        values: dict[str, Any] = {}
        for k, v in extra.items():
            if not k.startswith("kvferry_"):
                continue  # vLLM's own keys (spec_name, block_size, ...)
            if k not in known:
                raise ValueError(f"KvferryOffloadingSpec: unknown kv_connector_extra_config key "
                                 f"'{k}' (known: {', '.join(sorted(known))})")
            name, cast = known[k]
            values[name] = cast(v)
        o = OffloadOptions(**values)
        if o.host_blocks < 0 or o.file_slots < 0:
            raise ValueError("KvferryOffloadingSpec: kvferry_host_blocks and kvferry_file_slots "
                             "must be >= 0")
        if bool(o.file_dir) != (o.file_slots > 0):
            raise ValueError("KvferryOffloadingSpec: kvferry_file_dir and kvferry_file_slots go "
                             "together (a file tier needs both)")
        if o.host_blocks == 0 and o.file_slots == 0:
            raise ValueError("KvferryOffloadingSpec: no tier configured (kvferry_host_blocks "
                             "and/or kvferry_file_dir + kvferry_file_slots)")
        return o


# ---------------------------------------------------------------------------------------------
# Identity and keys


def identity_of(config: Any) -> dict[str, Any]:
    """What the bytes of a stored block depend on, from vLLM's OffloadingConfig (the same on the
    scheduler and every worker)."""
    p = config.parallel
    return {
        "format": FORMAT,
        "model": config.model.name,
        "dtype": str(config.model.dtype),
        "groups": [[g.tokens_per_block, list(g.layer_names)] for g in config.groups],
        "tokens_per_hash": config.cache.tokens_per_hash,
        "blocks_per_chunk": config.cache.blocks_per_chunk,
        "worker_kv_bytes_per_block": config.worker_kv_bytes_per_block,
        "kv_cache_layout": config.kv_cache_layout,
        "parallel": {"tp": p.tp_size, "pp": p.pp_size, "pcp": p.pcp_size, "dcp": p.dcp_size,
                     "world_size": p.world_size},
    }


def identity_digest(identity: Mapping[str, Any]) -> bytes:
    return hashlib.blake2b(json.dumps(identity, sort_keys=True).encode(), digest_size=16).digest()


def slot_key(digest: bytes, offload_key: bytes) -> int:
    """kvferry's 128-bit key of one vLLM block: blake2b(identity digest || OffloadKey)."""
    return int.from_bytes(hashlib.blake2b(digest + offload_key, digest_size=16).digest(), "big")


def rank_dir(file_dir: str, rank: int) -> str:
    return os.path.join(file_dir, f"rank{rank}")


def check_identity(directory: str, identity: Mapping[str, Any]) -> str | None:
    """None when `directory` may be used for `identity` (no identity file yet, or the same);
    else why not, naming the fields that differ."""
    path = os.path.join(directory, IDENTITY_FILE)
    try:
        with open(path) as f:
            found = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        return f"{path} unreadable ({e})"
    if found == identity:
        return None
    differ = sorted(k for k in set(found) | set(identity) if found.get(k) != identity.get(k))
    return (f"{path} was written for another model/layout: {', '.join(differ)} differ "
            f"(found {json.dumps({k: found.get(k) for k in differ})}, "
            f"this engine {json.dumps({k: identity.get(k) for k in differ})})")


def _write_json(path: str, obj: Any) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------
# Scheduler side: the manager


def _vllm_base():
    # Imported lazily so the manager's logic can be unit-tested without vLLM (python/tests).
    try:
        from vllm.v1.kv_offload import base
        return base
    except ImportError:
        return None


class KvferrySpecEntries:
    """The LoadStoreSpec of a kvferry job: per block (in vLLM's order) its host block (-1: none),
    its file slot (-1: none) and its 128-bit key. A store writes every tier named; a load reads
    the host block when there is one, else the slot."""

    def __init__(self, host: list[int], slots: list[int], keys: list[int]):
        self.host = np.asarray(host, dtype=np.int64)
        self.slots = np.asarray(slots, dtype=np.int64)
        self.keys = keys

    def __len__(self) -> int:
        return len(self.keys)

    def __repr__(self) -> str:
        return f"KvferrySpecEntries(host={self.host.tolist()}, slots={self.slots.tolist()})"


@dataclass
class _Entry:
    okey: bytes | None  # vLLM's OffloadKey (None for a block recovered from files)
    host: int = -1
    slot: int = -1
    ready: bool = False  # stored (loadable)
    refs: int = 0  # loads in flight
    bad: bool = False  # a load of it failed: forgotten once no load holds it


@dataclass
class ManagerStats:
    lookups: int = 0
    hits_host: int = 0  # lookups that hit a block with a host copy
    hits_file: int = 0  # ... with only a file slot
    hits_recovered: int = 0  # ... of a block recovered from files at start
    stored: int = 0
    loaded_host: int = 0
    loaded_file: int = 0
    evicted_host: int = 0
    evicted_file: int = 0
    store_skipped: int = 0  # no tier had room
    discarded: int = 0  # blocks whose load failed (forgotten: stored again when recomputed)
    recovered: int = 0
    file_refused: str = ""  # why the file tier is off, if configured and off


class KvferryOffloadingManager:
    """Index of offloaded blocks by key: which host block and/or file slot holds each, LRU
    eviction per tier, vLLM's events. Runs on the scheduler's thread (vLLM calls it serially).

    It implements vLLM's OffloadingManager interface (``KvferryOffloadingSpec.get_manager``
    wraps it in a subclass of vLLM's base class) and needs nothing of vLLM itself, so its logic
    is tested without vLLM (python/tests/test_vllm_offload.py)."""

    def __init__(self, digest: bytes, host_blocks: int, file_slots: int,
                 recovered: Iterable[tuple[int, int]] = (), enable_events: bool = False):
        self._digest = digest
        self._host_blocks = host_blocks
        self._file_slots = file_slots
        self._entries: dict[int, _Entry] = {}
        self._host_lru: OrderedDict[int, None] = OrderedDict()
        self._file_lru: OrderedDict[int, None] = OrderedDict()
        self._free_host = list(range(host_blocks - 1, -1, -1))
        used = set()
        for slot, key in recovered:
            if 0 <= slot < file_slots and slot not in used and key not in self._entries:
                used.add(slot)
                self._entries[key] = _Entry(okey=None, slot=slot, ready=True)
                self._file_lru[key] = None
        self._free_slots = [s for s in range(file_slots - 1, -1, -1) if s not in used]
        self._key_cache: dict[bytes, int] = {}
        self._recovered_keys = set(self._entries)
        self.stats = ManagerStats(recovered=len(self._entries))
        self.events: list[tuple[list[bytes], str, bool]] | None = [] if enable_events else None

    # -- keys
    def key_of(self, okey: bytes) -> int:
        k = self._key_cache.get(okey)
        if k is None:
            if len(self._key_cache) > 1 << 20:
                self._key_cache.clear()
            k = self._key_cache[okey] = slot_key(self._digest, okey)
        return k

    # -- vLLM's OffloadingManager calls
    def lookup(self, okey: bytes) -> str:
        """'hit', 'pending' (being stored) or 'miss'."""
        self.stats.lookups += 1
        k = self.key_of(okey)
        e = self._entries.get(k)
        if e is None or e.bad:
            return "miss"
        if not e.ready:
            return "pending"
        if e.okey is None:
            e.okey = okey
        if e.host >= 0:
            self.stats.hits_host += 1
        else:
            self.stats.hits_file += 1
        if k in self._recovered_keys:
            self.stats.hits_recovered += 1
            self._recovered_keys.discard(k)
        return "hit"

    def source(self, okey: bytes) -> str:
        e = self._entries.get(self.key_of(okey))
        return "host" if e is not None and e.host >= 0 else "disk"

    def prepare_load(self, okeys: Collection[bytes]) -> KvferrySpecEntries:
        host, slots, keys = [], [], []
        for okey in okeys:
            k = self.key_of(okey)
            e = self._entries[k]
            assert e.ready, "prepare_load of a block not stored"
            e.refs += 1
            self._touch(k, e)
            host.append(e.host)
            slots.append(e.slot if e.host < 0 else -1)
            keys.append(k)
            if e.host >= 0:
                self.stats.loaded_host += 1
            else:
                self.stats.loaded_file += 1
        return KvferrySpecEntries(host, slots, keys)

    def touch(self, okeys: Collection[bytes]) -> None:
        for okey in okeys:
            k = self.key_of(okey)
            e = self._entries.get(k)
            if e is not None:
                self._touch(k, e)

    def complete_load(self, okeys: Collection[bytes]) -> None:
        for okey in okeys:
            k = self.key_of(okey)
            e = self._entries.get(k)
            if e is not None and e.refs > 0:
                e.refs -= 1
                if e.bad and e.refs == 0:
                    self._forget(k, e)

    def discard(self, keys: Iterable[int]) -> None:
        """Forgets blocks (by 128-bit key) whose load failed: a slot that failed its checks is
        never offered again; the block, recomputed by vLLM, is stored anew."""
        for k in keys:
            e = self._entries.get(k)
            if e is None or e.bad:
                continue
            self.stats.discarded += 1
            e.bad = True
            if e.refs == 0:
                self._forget(k, e)

    def prepare_store(self, okeys: Collection[bytes]
                      ) -> tuple[list[bytes], KvferrySpecEntries, list[bytes]]:
        """(keys to store, where, keys evicted from every tier). Keys already stored or being
        stored are left out; a key no tier has room for is left out (counted)."""
        protected = {self.key_of(o) for o in okeys}
        to_store: list[bytes] = []
        host, slots, keys = [], [], []
        evicted: list[bytes] = []
        for okey in okeys:
            k = self.key_of(okey)
            e = self._entries.get(k)
            if e is not None:
                if e.okey is None:
                    e.okey = okey
                continue
            h = self._take_host(protected, evicted) if self._host_blocks else -1
            s = self._take_slot(protected, evicted) if self._file_slots else -1
            if h < 0 and s < 0:
                self.stats.store_skipped += 1
                continue
            self._entries[k] = _Entry(okey=okey, host=h, slot=s)
            if h >= 0:
                self._host_lru[k] = None
            if s >= 0:
                self._file_lru[k] = None
            to_store.append(okey)
            host.append(h)
            slots.append(s)
            keys.append(k)
        return to_store, KvferrySpecEntries(host, slots, keys), evicted

    def complete_store(self, okeys: Collection[bytes], success: bool = True) -> None:
        stored_host, stored_file = [], []
        for okey in okeys:
            k = self.key_of(okey)
            e = self._entries.get(k)
            if e is None or e.ready:
                continue
            if success:
                e.ready = True
                self.stats.stored += 1
                if e.host >= 0:
                    stored_host.append(okey)
                if e.slot >= 0:
                    stored_file.append(okey)
            else:
                self._drop(k, e)
        if self.events is not None:
            if stored_host:
                self.events.append((stored_host, "host", False))
            if stored_file:
                self.events.append((stored_file, "file", False))

    def reset(self) -> None:
        self._entries.clear()
        self._host_lru.clear()
        self._file_lru.clear()
        self._recovered_keys.clear()
        self._free_host = list(range(self._host_blocks - 1, -1, -1))
        self._free_slots = list(range(self._file_slots - 1, -1, -1))

    def take_events(self) -> list[tuple[list[bytes], str, bool]]:
        if not self.events:
            return []
        out, self.events = self.events, []
        return out

    def where(self, okey: bytes) -> tuple[int, int] | None:
        """(host block, file slot) of a block, -1 where none; None when not stored."""
        e = self._entries.get(self.key_of(okey))
        return None if e is None else (e.host, e.slot)

    # -- internals
    def _touch(self, k: int, e: _Entry) -> None:
        if e.host >= 0:
            self._host_lru.move_to_end(k)
        if e.slot >= 0:
            self._file_lru.move_to_end(k)

    def _evictable(self, k: int, protected: set[int]) -> bool:
        e = self._entries[k]
        return e.ready and e.refs == 0 and k not in protected

    def _take_host(self, protected: set[int], evicted: list[bytes]) -> int:
        if self._free_host:
            return self._free_host.pop()
        for k in self._host_lru:
            if self._evictable(k, protected):
                e = self._entries[k]
                h, e.host = e.host, -1
                del self._host_lru[k]
                self.stats.evicted_host += 1
                self._removed(k, e, "host", evicted)
                return h
        return -1

    def _take_slot(self, protected: set[int], evicted: list[bytes]) -> int:
        if self._free_slots:
            return self._free_slots.pop()
        for k in self._file_lru:
            if self._evictable(k, protected):
                e = self._entries[k]
                s, e.slot = e.slot, -1
                del self._file_lru[k]
                self.stats.evicted_file += 1
                self._removed(k, e, "file", evicted)
                return s
        return -1

    def _removed(self, k: int, e: _Entry, tier: str, evicted: list[bytes]) -> None:
        if self.events is not None and e.okey is not None:
            self.events.append(([e.okey], tier, True))
        if e.host < 0 and e.slot < 0:
            del self._entries[k]
            self._recovered_keys.discard(k)
            if e.okey is not None:
                evicted.append(e.okey)

    def _forget(self, k: int, e: _Entry) -> None:
        if self.events is not None and e.okey is not None:
            for tier, held in (("host", e.host), ("file", e.slot)):
                if held >= 0:
                    self.events.append(([e.okey], tier, True))
        self._recovered_keys.discard(k)
        self._drop(k, e)

    def _drop(self, k: int, e: _Entry) -> None:
        if e.host >= 0:
            self._host_lru.pop(k, None)
            self._free_host.append(e.host)
        if e.slot >= 0:
            self._file_lru.pop(k, None)
            self._free_slots.append(e.slot)
        del self._entries[k]


def read_sessions(file_dir: str, world_size: int, identity: Mapping[str, Any],
                  engine_id: str) -> tuple[list[tuple[int, int]], str]:
    """The scheduler's view of the file tier its workers opened: (recovered (slot, key) pairs
    held by every rank, why the tier is off or ""). Workers open before the scheduler starts."""
    common: set[tuple[int, int]] | None = None
    for r in range(world_size):
        d = rank_dir(file_dir, r)
        why = check_identity(d, identity)
        if why is not None:
            return [], why
        try:
            with open(os.path.join(d, SESSION_FILE)) as f:
                session = json.load(f)
        except (OSError, ValueError) as e:
            return [], f"rank {r} did not open its file tier ({e})"
        if session.get("engine_id") != engine_id:
            return [], (f"rank {r} did not open its file tier in this run "
                        f"(session of engine {session.get('engine_id')!r})")
        pairs = {(int(s), int(k, 16)) for s, k in session.get("recovered", [])}
        common = pairs if common is None else common & pairs
    return sorted(common or ()), ""


# ---------------------------------------------------------------------------------------------
# Worker side


@dataclass
class _Job:
    load: bool
    batches: list[tuple[Any, np.ndarray]] = field(default_factory=list)  # (batch, gpu ids)
    start: float = 0.0
    bytes: int = 0


class KvferryOffloadingWorker:
    """Moves blocks between vLLM's KV tensors (wrapped zero-copy) and the host pool / file tier
    through one kvferry TransferManager. submit_* queue batches and return at once; get_finished
    polls them (TransferBatch.query), never waits."""

    def __init__(self, tensors: list[Any], tokens_per_block: int, options: OffloadOptions,
                 identity: Mapping[str, Any], rank: int, engine_id: str,
                 report_load_errors: bool = False):
        import torch

        self.o = options
        self.report_load_errors = report_load_errors
        self.failed_blocks: set[int] = set()  # vLLM block ids whose load failed, not yet reported
        self.load_failures = 0
        self.store_failures = 0
        self.file_refused = ""
        t0 = tensors[0]
        page = int(t0.shape[1])
        if any(int(t.shape[1]) != page or t.shape[0] != t0.shape[0] for t in tensors):
            raise ValueError("KvferryOffloadingSpec: KV tensors of different page sizes "
                             f"{[tuple(t.shape) for t in tensors]} are not supported")
        if page % (2 * tokens_per_block):
            raise ValueError(f"KvferryOffloadingSpec: page of {page} bytes is not a multiple of "
                             f"2 x {tokens_per_block} tokens")
        blocks = int(t0.shape[0])
        self.device = kvferry.Device("cpu" if t0.device.type == "cpu"
                                     else f"cuda:{t0.device.index or 0}")
        # Whole pages move: inside a page kvferry needs no structure, so each layer's page is
        # described as [kv=2][head=1][token][bytes] of int8.
        hd = page // (2 * tokens_per_block)
        self.shape = kvferry.KvShape(layers=len(tensors), kv_heads=1, head_dim=hd, dtype="int8",
                                     tokens_per_block=tokens_per_block)
        wrapped = [t if t.dtype == torch.int8 else t.view(torch.int8) for t in tensors]
        strides = [int(t0.stride(0)), 0, tokens_per_block * hd, 2 * tokens_per_block * hd, hd, 1]
        self.primary = kvferry.Pool.wrap(self.device, self.shape, wrapped, blocks=blocks,
                                         byte_strides=strides, split="per-layer")
        self.block_bytes = self.primary.block_bytes
        self.host = (kvferry.Pool.allocate(self.device, self.shape, memory="pinned",
                                           blocks=options.host_blocks)
                     if options.host_blocks else None)
        self.store = None
        if options.file_slots:
            self.store = self._open_store(identity, rank, engine_id)
        self.tm = kvferry.TransferManager(self.device, self.primary, self.host, file=self.store)
        self.jobs: dict[int, _Job] = {}

    def _open_store(self, identity: Mapping[str, Any], rank: int, engine_id: str):
        d = rank_dir(self.o.file_dir, rank)
        why = check_identity(d, identity) if os.path.isdir(d) else None
        if why is not None:
            self.file_refused = why
            logger.error("kvferry offload: file tier refused, directory left untouched: %s", why)
            return None
        try:
            os.makedirs(d, exist_ok=True)
        except OSError as e:  # a file in its place, a read-only or vanished parent
            self.file_refused = f"{d}: {e}"
            logger.error("kvferry offload: file tier off: %s", self.file_refused)
            return None
        kw: dict[str, Any] = {"recover": "verify"}
        if self.o.file_backend:
            kw["backend"] = self.o.file_backend
        try:
            store = kvferry.SlabStore(d, self.block_bytes, self.o.file_slots, **kw)
        except kvferry.Error as e:
            self.file_refused = f"{d}: {e}"
            logger.error("kvferry offload: file tier off: %s", self.file_refused)
            return None
        recovered = store.recovered
        # The manager (scheduler side) names the slots: hold every free one allocated so that any
        # slot can be written (recovered slots are allocated already).
        while True:
            try:
                store.allocate()
            except kvferry.ResourceExhaustedError:
                break
        try:
            _write_json(os.path.join(d, IDENTITY_FILE), dict(identity))
            _write_json(os.path.join(d, SESSION_FILE), {
                "engine_id": engine_id, "opened": time.time(),
                "recovered": [[r["slot"], format(r["key"], "032x")] for r in recovered
                              if r["bytes"] == self.block_bytes]})
        except OSError as e:  # a full disk, a directory made read-only meanwhile
            store.close()
            self.file_refused = f"{d}: cannot write its session ({e})"
            logger.error("kvferry offload: file tier off: %s", self.file_refused)
            return None
        logger.info("kvferry offload: file tier %s (%s), %d slots, %d recovered", d,
                    store.backend["name"], store.capacity, len(recovered))
        return store

    # -- OffloadingWorker
    def submit_store(self, job_id: int, gpu_ids: np.ndarray, dst: KvferrySpecEntries) -> bool:
        gpu = np.asarray(gpu_ids, dtype=np.int64)
        assert len(gpu) == len(dst), f"store job {job_id}: {len(gpu)} blocks for {len(dst)} keys"
        job = _Job(load=False, start=time.perf_counter())
        hm = dst.host >= 0
        if self.host is not None and hm.any():
            moves = np.stack([gpu[hm], dst.host[hm]], axis=1)
            job.batches.append((self.tm.offload(moves, kvferry.Tier.HOST), gpu[hm]))
        fm = dst.slots >= 0
        if self.store is not None and fm.any():
            idx = np.nonzero(fm)[0]
            moves = np.stack([gpu[fm], dst.slots[fm]], axis=1)
            keys = [dst.keys[i] for i in idx]
            job.batches.append((self.tm.offload(moves, kvferry.Tier.FILE, keys=keys), gpu[fm]))
        job.bytes = sum(len(g) for _, g in job.batches) * self.block_bytes
        self.jobs[job_id] = job
        return True

    def submit_load(self, job_id: int, src: KvferrySpecEntries, gpu_ids: np.ndarray) -> bool:
        gpu = np.asarray(gpu_ids, dtype=np.int64)
        assert len(gpu) == len(src), f"load job {job_id}: {len(gpu)} blocks for {len(src)} keys"
        job = _Job(load=True, start=time.perf_counter())
        hm = src.host >= 0
        if hm.any():
            moves = np.stack([src.host[hm], gpu[hm]], axis=1)
            job.batches.append((self.tm.onboard(moves, kvferry.Tier.HOST), gpu[hm]))
        fm = ~hm
        if fm.any():
            if self.store is None:  # never: the manager names slots only when the tier is on
                self.failed_blocks.update(int(b) for b in gpu[fm])
            else:
                idx = np.nonzero(fm)[0]
                moves = np.stack([src.slots[fm], gpu[fm]], axis=1)
                keys = [src.keys[i] for i in idx]
                job.batches.append((self.tm.onboard(moves, kvferry.Tier.FILE, keys=keys),
                                    gpu[fm]))
        job.bytes = sum(len(g) for _, g in job.batches) * self.block_bytes
        self.jobs[job_id] = job
        return True

    def get_finished(self) -> list[tuple[int, bool, int, float]]:
        """(job id, success, bytes, seconds) of the jobs finished since the last call."""
        out = []
        for job_id, job in list(self.jobs.items()):
            if not all(b.query() for b, _ in job.batches):
                continue
            del self.jobs[job_id]
            ok = self._account(job_id, job)
            out.append((job_id, ok, job.bytes, time.perf_counter() - job.start))
        return out

    def _account(self, job_id: int, job: _Job) -> bool:
        ok = True
        for b, gpu in job.batches:
            for i, err in enumerate(b.items):
                if err is None:
                    continue
                ok = False
                if job.load:
                    self.load_failures += 1
                    self.failed_blocks.add(int(gpu[i]))
                else:
                    self.store_failures += 1
                logger.error("kvferry offload: %s job %d: %s", "load" if job.load else "store",
                             job_id, err)
        if not job.load:
            # A failed store is a later miss or failed load (the slot reads as not written, or
            # fails its checks), never wrong data; vLLM's worker accepts no failed job.
            return True
        return ok or self.report_load_errors

    def wait(self, job_ids: Collection[int]) -> None:
        for job_id in job_ids:
            job = self.jobs.get(job_id)
            if job is None:
                continue
            for b, _ in job.batches:
                try:
                    b.wait(timeout=self.o.io_timeout_s)
                except kvferry.Error as e:  # item errors: reported by get_finished
                    if isinstance(e, kvferry.DeadlineExceededError):
                        raise

    def take_failed_blocks(self) -> set[int]:
        out, self.failed_blocks = self.failed_blocks, set()
        return out

    def shutdown(self) -> None:
        if self.tm.closed:
            return
        try:
            self.tm.drain(timeout=self.o.io_timeout_s)
        finally:
            self.tm.close()
            if self.store is not None:
                self.store.close()


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
                                        entries.keys)

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
                    enable_events=self.kv_events_config.enable_kv_cache_events)
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
