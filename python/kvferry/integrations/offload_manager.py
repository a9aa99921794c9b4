"""kvferry's vLLM offloading backend, scheduler side: options, identity and keys, and the manager
(which host block and file slot hold each offloaded block, LRU eviction per tier, promotion of
file blocks into the host tier on load). Pure Python: needs neither vLLM nor torch, so its logic
is tested without vLLM (python/tests/test_vllm_offload.py). vLLM's classes wrap it in
:mod:`kvferry.integrations.vllm_offload`, whose docstring describes the whole backend."""

from __future__ import annotations

import hashlib
import json
import os
from collections import OrderedDict
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

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
    promote: bool = True  # a load from files also copies the block into the host tier

    @staticmethod
    def from_extra(extra: Mapping[str, Any]) -> "OffloadOptions":
        known = {"kvferry_host_blocks": ("host_blocks", int),
                 "kvferry_file_dir": ("file_dir", str),
                 "kvferry_file_slots": ("file_slots", int),
                 "kvferry_file_backend": ("file_backend", str),
                 "kvferry_io_timeout_s": ("io_timeout_s", float),
                 "kvferry_promote": ("promote", _flag)}
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


def _flag(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if str(v).lower() in ("1", "true", "yes", "on"):
        return True
    if str(v).lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"KvferryOffloadingSpec: kvferry_promote={v!r} is not a boolean")


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


class KvferrySpecEntries:
    """The LoadStoreSpec of a kvferry job: per block (in vLLM's order) its host block (-1: none),
    its file slot (-1: none) and its 128-bit key. A store writes every tier named; a load reads
    the host block when there is one, else the slot, and then copies a block read from its slot
    into the host block `promote` names (-1: none), a promotion into the host tier."""

    def __init__(self, host: list[int], slots: list[int], keys: list[int],
                 promote: list[int] | None = None):
        self.host = np.asarray(host, dtype=np.int64)
        self.slots = np.asarray(slots, dtype=np.int64)
        self.keys = keys
        self.promote = (np.full(len(keys), -1, dtype=np.int64) if promote is None
                        else np.asarray(promote, dtype=np.int64))

    def __len__(self) -> int:
        return len(self.keys)

    def __repr__(self) -> str:
        return (f"KvferrySpecEntries(host={self.host.tolist()}, slots={self.slots.tolist()}, "
                f"promote={self.promote.tolist()})")


@dataclass
class _Entry:
    okey: bytes | None  # vLLM's OffloadKey (None for a block recovered from files)
    host: int = -1
    slot: int = -1
    ready: bool = False  # stored (loadable)
    refs: int = 0  # loads in flight
    bad: bool = False  # a load of it failed: forgotten once no load holds it
    promoting: bool = False  # `host` taken by a load's promotion; its copy not written yet


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
    promoted: int = 0  # blocks loaded from a file slot and copied into the host tier by the load
    store_skipped: int = 0  # no tier had room
    discarded: int = 0  # blocks whose load failed (forgotten: stored again when recomputed)
    recovered: int = 0
    file_refused: str = ""  # why the file tier is off, if configured and off


class KvferryOffloadingManager:
    """Index of offloaded blocks by key: which host block and/or file slot holds each, LRU
    eviction per tier, vLLM's events. Runs on the scheduler's thread (vLLM calls it serially).

    Promotion: a load of a block that only a file slot holds also takes a host block (a free one,
    else the host tier's least recently used block that no load holds and that is not part of the
    same load), and the worker copies the loaded block there after the read. The host copy counts
    once every load holding the block has completed (``complete_load``); until then lookups and
    loads use the slot. A block whose load failed is forgotten with its host copy (``discard``).

    It implements vLLM's OffloadingManager interface (``KvferryOffloadingSpec.get_manager``
    wraps it in a subclass of vLLM's base class) and needs nothing of vLLM itself, so its logic
    is tested without vLLM (python/tests/test_vllm_offload.py)."""

    def __init__(self, digest: bytes, host_blocks: int, file_slots: int,
                 recovered: Iterable[tuple[int, int]] = (), enable_events: bool = False,
                 promote: bool = True):
        self._digest = digest
        self._host_blocks = host_blocks
        self._promote_on_load = promote
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
        if _host_copy(e):
            self.stats.hits_host += 1
        else:
            self.stats.hits_file += 1
        if k in self._recovered_keys:
            self.stats.hits_recovered += 1
            self._recovered_keys.discard(k)
        return "hit"

    def source(self, okey: bytes) -> str:
        e = self._entries.get(self.key_of(okey))
        return "host" if e is not None and _host_copy(e) else "disk"

    def prepare_load(self, okeys: Collection[bytes]) -> KvferrySpecEntries:
        protected = {self.key_of(o) for o in okeys}
        host, slots, keys, promote = [], [], [], []
        for okey in okeys:
            k = self.key_of(okey)
            e = self._entries[k]
            assert e.ready, "prepare_load of a block not stored"
            e.refs += 1
            self._touch(k, e)
            keys.append(k)
            if _host_copy(e):
                self.stats.loaded_host += 1
                host.append(e.host)
                slots.append(-1)
                promote.append(-1)
            else:
                self.stats.loaded_file += 1
                host.append(-1)
                slots.append(e.slot)
                promote.append(self._promote(k, e, protected))
        return KvferrySpecEntries(host, slots, keys, promote)

    def touch(self, okeys: Collection[bytes]) -> None:
        for okey in okeys:
            k = self.key_of(okey)
            e = self._entries.get(k)
            if e is not None:
                self._touch(k, e)

    def complete_load(self, okeys: Collection[bytes]) -> None:
        promoted: list[bytes] = []
        for okey in okeys:
            k = self.key_of(okey)
            e = self._entries.get(k)
            if e is None or e.refs == 0:
                continue
            e.refs -= 1
            if e.refs > 0:
                continue
            if e.bad:
                self._forget(k, e)
            elif e.promoting:  # the promoting load is done (it held a reference until now)
                e.promoting = False
                self.stats.promoted += 1
                promoted.append(e.okey)
        if promoted and self.events is not None:
            self.events.append((promoted, "host", False))

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

    def _promote(self, k: int, e: _Entry, protected: set[int]) -> int:
        """A host block for a copy of file-only block `k` (-1: none, or promotion under way)."""
        if not self._host_blocks or not self._promote_on_load or e.host >= 0:
            return -1
        h = self._take_host(protected, [])  # vLLM reads evicted keys only from prepare_store
        if h < 0:
            return -1
        e.host, e.promoting = h, True
        self._host_lru[k] = None
        return h

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
            for tier, held in (("host", -1 if e.promoting else e.host), ("file", e.slot)):
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


def _host_copy(e: _Entry) -> bool:
    """Whether the host tier holds a written copy of the block."""
    return e.host >= 0 and not e.promoting


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
