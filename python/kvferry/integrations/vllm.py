"""kvferry as a vLLM v1 KV connector: disaggregated prefill (producer) and decode (consumer).

Load it with vLLM's standard configuration (docs/vllm.md)::

    --kv-transfer-config '{"kv_connector": "KvferryConnector",
                           "kv_connector_module_path": "kvferry.integrations.vllm",
                           "kv_role": "kv_producer",      # or kv_consumer, kv_both
                           "kv_connector_extra_config": {"rendezvous": "127.0.0.1:7000",
                                                         "rendezvous_key": "<32 hex digits>"}}'

How a request moves, and why it is shaped this way:

* Producer scheduler. A request that carries ``kv_transfer_params={"do_remote_decode": True}``
  is tracked; in the step whose forward pass completes its prompt, ``build_connector_meta``
  hands (request, block ids, prompt tokens) to the workers. ``request_finished`` returns
  ``delay_free=True`` and a small *ticket* ({instance, request id, prompt tokens, blocks}) as the
  request's ``kv_transfer_params``: the scheduler never waits for a worker round trip, because the
  ticket names a rendezvous key, not the handle itself.
* Producer worker. ``wait_for_save`` (after the step's forward, when the KV is in the blocks)
  calls ``ContextSide.mark_ready`` and publishes the handle under the ticket's key. The
  ContextSide leases the blocks until the decode side fetched them, failed, or the *hold
  deadline* (``hold_timeout_s``, default 480 s like NIXL's) passed; then ``get_finished`` reports
  the request as sent and vLLM frees the blocks.
  With ``layer_wise``, the blocks are leased and the handle published before that forward
  (``begin_layer_wise``) and each layer is marked ready from ``save_kv_layer`` as its attention
  has run (CPU KV caches).
* Consumer scheduler. ``get_num_new_matched_tokens`` claims the ticket's prompt tokens beyond the
  local prefix-cache hit, loaded asynchronously; ``update_state_after_alloc`` records the local
  blocks (the hit blocks are passed as ``reused_blocks`` and do not move).
* Consumer worker. ``start_load_kv`` looks the handle up (a few ms at most) and starts
  ``GenerationSide.fetch``, which only posts; a handle not published yet is waited for on a small
  thread pool, so the engine step never blocks on it. ``get_transfer_results`` polls the side:
  a complete fetch is a finished receive, a failed one a finished *and* failed receive, which
  vLLM answers with its ``kv_load_failure_policy`` (``recompute``: prefill again locally;
  ``fail``: the request ends with an error). Nothing hangs: every wait has a deadline
  (``transfer_timeout_s``).

Identity. The instance id of each side is a hash of vLLM's ``engine_id``, which every rank of an
instance shares by construction; a vLLM request id (a string, unique inside its instance) becomes
kvferry's u64 id by a 64-bit hash of (producer engine id, request id). Two live requests collide
with probability about n^2 / 2^65 (n live requests on one decode instance): 1e-10 for n = 10^5.
A collision is detected, not silent: the second ``mark_ready``/``fetch`` of an id is refused and
that request fails (recomputed), nothing else is disturbed.

The instance secret (keys the handles' access tokens) comes from ``instance_secret`` (32 hex
digits) or is drawn by producer rank 0 and published to the other ranks through the rendezvous.

Layouts. ``register_kv_caches`` wraps vLLM's own tensors zero-copy. The layout is read from each
tensor's shape and strides: the CPU backend's ``[blocks, heads, block_size, 2*head_size]`` pages
(K rows then V rows: kvferry's ``vllm-cpu``), and ``[2, blocks, block_size, heads, head_size]``
with NHD or HND strides (``per-layer``, ``per-layer-hnd``). Anything else is refused by name.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

import kvferry

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger("kvferry.vllm")

TICKET = "kvferry"  # the kv_transfer_params key that carries a ticket
_FINISHED_OK = ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED")


_LIVE: "weakref.WeakSet[KvferryConnector]" = weakref.WeakSet()


class Overhead:
    """What the connector costs vLLM's engine thread: the time of each hook vLLM calls (its
    Python and the kvferry calls it makes, which `library_*` counts on their own), per process,
    as wall time and as the engine thread's CPU time (`*_cpu_ns`: what a loaded machine does not
    inflate; the wall time also counts the thread waiting for a core or the GIL). The fetch
    threads' rendezvous lookups and fetches run beside the step and are not counted.

    A hook call that carried no request's work (an empty metadata, a poll that found nothing
    finished) is counted apart, as an idle call: vLLM calls the step hooks on every step, so their
    cost is per step, not per request, and an engine steps without work as often as its driver
    asks (vLLM's loop every millisecond while sends are held, a test's loop as it pleases). The
    connector's overhead per request is (work hooks - their library calls) / requests; idle
    calls are reported as a count and a cost per step."""

    def __init__(self) -> None:
        # hook -> [calls, ns, cpu ns, idle calls, idle ns, idle cpu ns]
        self.hooks: dict[str, list[int]] = {}
        self.library_ns = 0  # kvferry calls made from work hooks (mark_ready, poll, put, cancel)
        self.library_cpu_ns = 0
        self.idle_library_ns = 0  # ... and from idle ones (a poll that found nothing)
        self.idle_library_cpu_ns = 0
        self.requests = 0  # requests the worker saw end (sent or received)
        # P/D requests the scheduler saw (a ticket returned, a load scheduled): the count where no
        # worker shares the process (TP > 1 runs the workers in processes of their own).
        self.scheduler_requests = 0
        self.lib_ns = 0  # running totals of every library call, split when the hook returns
        self.lib_cpu_ns = 0

    def hook(self, name: str, ns: int, cpu_ns: int, idle: bool, lib_ns: int,
             lib_cpu_ns: int) -> None:
        h = self.hooks.setdefault(name, [0, 0, 0, 0, 0, 0])
        i = 3 if idle else 0
        h[i] += 1
        h[i + 1] += ns
        h[i + 2] += cpu_ns
        if idle:
            self.idle_library_ns += lib_ns
            self.idle_library_cpu_ns += lib_cpu_ns
        else:
            self.library_ns += lib_ns
            self.library_cpu_ns += lib_cpu_ns

    def snapshot(self) -> dict[str, Any]:
        work = [sum(h[k] for h in self.hooks.values()) for k in (1, 2)]
        idle = [sum(h[k] for h in self.hooks.values()) for k in (4, 5)]
        per = max(self.requests or self.scheduler_requests, 1)
        # Steps seen, and those without connector work: calls of the scheduler's
        # build_connector_meta or the worker's get_transfer_results (each once a step; a process
        # with the scheduler only calls the first, one with a worker only the second).
        step_hooks = [self.hooks.get(k, [0] * 6)
                      for k in ("build_connector_meta", "get_transfer_results")]
        steps = max(h[0] + h[3] for h in step_hooks)
        idle_steps = max(h[3] for h in step_hooks)
        return {"hooks": {k: {"calls": h[0], "ns": h[1], "cpu_ns": h[2], "idle_calls": h[3],
                              "idle_ns": h[4], "idle_cpu_ns": h[5]}
                          for k, h in self.hooks.items()},
                "hook_ns": work[0], "library_ns": self.library_ns,
                "hook_cpu_ns": work[1], "library_cpu_ns": self.library_cpu_ns,
                "idle_hook_ns": idle[0], "idle_hook_cpu_ns": idle[1],
                "idle_library_cpu_ns": self.idle_library_cpu_ns,
                "requests": self.requests or self.scheduler_requests, "steps": steps,
                "idle_steps": idle_steps,
                "connector_ns_per_request": (work[0] - self.library_ns) / per,
                "library_ns_per_request": self.library_ns / per,
                "connector_cpu_ns_per_request": (work[1] - self.library_cpu_ns) / per,
                "library_cpu_ns_per_request": self.library_cpu_ns / per,
                # what the idle hook calls cost a step without work, connector and library
                "idle_cpu_ns_per_step": idle[1] / max(idle_steps, 1)}

    def reset(self) -> None:
        self.__init__()


OVERHEAD = Overhead()


def _timed(idle):
    """Counts a hook's time in OVERHEAD (six clock reads, ~2 us), as idle when
    `idle(connector, args, result)` says the call carried no request's work."""

    def wrap(fn):
        name = fn.__name__

        def hook(self, *args, **kwargs):
            o = OVERHEAD
            lib, lib_cpu = o.lib_ns, o.lib_cpu_ns
            t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
            result = None
            try:
                result = fn(self, *args, **kwargs)
                return result
            finally:
                ns, cpu = time.perf_counter_ns() - t0, time.thread_time_ns() - c0
                o.hook(name, ns, cpu, idle(self, args, result), o.lib_ns - lib,
                       o.lib_cpu_ns - lib_cpu)

        hook.__name__ = name
        hook.__doc__ = fn.__doc__
        return hook

    return wrap


def _never(*_: Any) -> bool:
    return False


class _Library:
    """`with _LIBRARY:` around a kvferry call made from a hook counts its time as the library's."""

    def __enter__(self) -> None:
        self.t0, self.c0 = time.perf_counter_ns(), time.thread_time_ns()

    def __exit__(self, *exc: Any) -> None:
        OVERHEAD.lib_ns += time.perf_counter_ns() - self.t0
        OVERHEAD.lib_cpu_ns += time.thread_time_ns() - self.c0


_LIBRARY = _Library()  # hooks run on the engine thread, one at a time

# How long the engine thread looks up a request's handle before leaving the wait to a fetch thread
# (one round trip when it is there; the rendezvous holds the lookup at most ~3 ms otherwise).
_INLINE_LOOKUP_S = 0.005
_ERASE_PERIOD_S = 0.5  # ended requests' handle keys are erased together, this often at most
# What a producer leaves under the handle key of a request that ended without being fetched (hold
# deadline, abort, failure), for hold_timeout_s more: a decode side that comes late fails at once,
# naming why, instead of waiting transfer_timeout_s for a handle that will not come.
_RELEASED = b"kvferry-vllm:released"


def live_connectors() -> list["KvferryConnector"]:
    """This process's worker-side connectors (tests and benchmarks with in-process engines read
    their transfer records and set test options through these)."""
    return [c for c in _LIVE if c._worker is not None]


def request_id_u64(instance: str, request_id: str) -> int:
    """kvferry's u64 id of vLLM request `request_id` of producer instance `instance`."""
    h = hashlib.blake2b(f"{instance}\0{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little")


def instance_id_u64(engine_id: str) -> int:
    """The kvferry instance id of a vLLM engine (nonzero: 0 would mean 'draw one at random')."""
    h = hashlib.blake2b(f"kvferry-instance\0{engine_id}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") or 1


def handle_key(instance: str, request_id: str) -> str:
    return f"kvferry/vllm/{instance}/handle/{request_id}"


def nixl_environment() -> None:
    """Before this process first creates a NIXL transport: NIXL's UCX must leave its InfiniBand
    modules out (UCX_MODULES='^ib*'), or the process dies with SIGSEGV at exit in their
    libnl-route (NIXL's wheel, not kvferry: docs/nixl.md). Unset, it is set here (NIXL's UCX reads
    it when the transport loads it); set to something that does not exclude them, it is refused:
    the crash would come at exit, long after the cause."""
    mods = os.environ.get("UCX_MODULES")
    if mods is None:
        os.environ["UCX_MODULES"] = "^ib*"
        logger.info("kvferry: transport nixl: UCX_MODULES='^ib*' set in this process (NIXL's "
                    "UCX InfiniBand modules crash the process at exit: docs/nixl.md)")
    elif not (mods.startswith("^") and "ib*" in mods[1:].replace(" ", "").split(",")):
        raise ValueError(f"KvferryConnector: transport nixl needs UCX_MODULES='^ib*' (or unset) "
                         f"in the vLLM instance's environment, found {mods!r}: NIXL's UCX "
                         f"InfiniBand modules crash the process at exit (docs/nixl.md)")


@dataclass
class Options:
    """kv_connector_extra_config keys (docs/vllm.md)."""

    rendezvous: str = ""  # host:port of the kvferry rendezvous server
    rendezvous_key: bytes = b""  # 16 bytes (32 hex digits)
    rendezvous_serve: bool = False  # producer rank 0 hosts the server at `rendezvous`
    transport: str = "ucx"
    hold_timeout_s: float = 480.0  # producer: blocks held at most this long for the decode side
    transfer_timeout_s: float = 60.0  # consumer: rendezvous lookup + fetch, each request
    instance_secret: bytes = b""  # 16 bytes; empty: drawn by producer rank 0 and published
    fetch_threads: int = 4
    # Producer: each layer's KV may leave as soon as its attention has run in the step that
    # completes the prompt (ContextSide.begin_layer_wise before the forward, mark_layers_ready
    # from save_kv_layer), the handle published before the forward. CPU KV caches only.
    layer_wise: bool = False
    # Test only: "reverse-blocks" fetches into the local blocks in reverse order, so a request of
    # more than one block gets its KV in the wrong places (the outputs must change).
    test_corrupt: str = ""

    @staticmethod
    def parse(extra: dict[str, Any] | None) -> "Options":
        extra = dict(extra or {})
        o = Options()
        known = set(o.__dataclass_fields__)
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"KvferryConnector: unknown kv_connector_extra_config keys {unknown}; "
                             f"known: {sorted(known)}")
        for k, v in extra.items():
            if k in ("rendezvous_key", "instance_secret"):
                v = bytes.fromhex(v) if isinstance(v, str) else bytes(v)
                if len(v) != 16:
                    raise ValueError(f"KvferryConnector: {k} must be 16 bytes (32 hex digits), "
                                     f"got {len(v)}")
            elif k in ("hold_timeout_s", "transfer_timeout_s"):
                v = float(v)
            elif k == "fetch_threads":
                v = int(v)
            elif k in ("rendezvous_serve", "layer_wise"):
                v = bool(v)
            setattr(o, k, v)
        if not o.rendezvous or not o.rendezvous_key:
            raise ValueError("KvferryConnector needs kv_connector_extra_config 'rendezvous' "
                             "(host:port) and 'rendezvous_key' (32 hex digits)")
        if o.transport not in kvferry.transports():
            raise ValueError(f"KvferryConnector: transport={o.transport!r} is not compiled into "
                             f"this kvferry; it has {kvferry.transports()}")
        if o.test_corrupt not in ("", "reverse-blocks"):
            raise ValueError(f"KvferryConnector: test_corrupt={o.test_corrupt!r}; "
                             "expected '' or 'reverse-blocks'")
        return o


# ---- scheduler -> worker metadata ---------------------------------------------------------------


@dataclass
class SendReq:
    request_id: str
    blocks: list[int]
    prompt_tokens: int


@dataclass
class RecvReq:
    request_id: str
    ticket: dict[str, Any]
    blocks: list[int]  # local blocks for the ticket's blocks, in order
    reused_blocks: int  # leading blocks already held locally (prefix-cache hit): not moved


@dataclass
class KvferryMetadata(KVConnectorMetadata):
    sends: list[SendReq] = field(default_factory=list)  # prompt complete this step: mark ready
    send_finished: list[str] = field(default_factory=list)  # scheduler finished them (delay free)
    cancels: list[str] = field(default_factory=list)  # aborted after mark_ready
    recvs: list[RecvReq] = field(default_factory=list)

    def empty(self, sends: bool = False) -> bool:
        """Nothing for the workers (with sends=True: nothing of the producer's)."""
        return (not self.sends and not self.send_finished and not self.cancels
                and (sends or not self.recvs))


# ---- the connector ------------------------------------------------------------------------------


class KvferryConnector(KVConnectorBase_V1):
    """A vLLM v1 KV connector on kvferry (module docstring)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None):
        super().__init__(vllm_config, role, kv_cache_config)
        kt = vllm_config.kv_transfer_config
        self._options = Options.parse(kt.kv_connector_extra_config)
        self._engine_id = str(kt.engine_id)
        self._is_producer = kt.kv_role in ("kv_producer", "kv_both")
        self._is_consumer = kt.kv_role in ("kv_consumer", "kv_both")
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler: _Scheduler | None = _Scheduler(vllm_config, self._engine_id,
                                                            self._is_producer, self._is_consumer)
            self._worker: _Worker | None = None
        else:
            self._scheduler = None
            self._worker = _Worker(vllm_config, self._engine_id, self._options,
                                   self._is_producer, self._is_consumer)
            _LIVE.add(self)

    # -- scheduler side
    @_timed(_never)
    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    @_timed(_never)
    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    @_timed(lambda c, a, meta: meta is not None and meta.empty())
    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    @_timed(_never)
    def request_finished(self, request: "Request",
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, block_ids)

    @_timed(lambda c, a, r: not a[0].finished_sending)
    def update_connector_output(self, connector_output: Any) -> None:
        self._scheduler.update_connector_output(connector_output)

    def has_pending_push_work(self) -> bool:
        # Keeps the engine stepping while finished prefills hold blocks, so that they are freed
        # when the decode side is done (or at the hold deadline), not at the next request.
        return self._scheduler is not None and self._scheduler.has_pending_sends()

    def bind_kv_cache_manager(self, kv_cache_manager: "KVCacheManager") -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._scheduler.kv_cache_manager = kv_cache_manager

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: "VllmConfig") -> str | None:
        return None  # any layout register_kv_caches recognises

    # -- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        # Before the step's forward (vLLM 0.32 calls start_load_kv after it when no load of the
        # step is synchronous): with layer_wise, the prompts this forward completes begin here.
        super().bind_connector_metadata(connector_metadata)
        if (self._worker is not None and self._worker.o.layer_wise
                and getattr(connector_metadata, "sends", None)):
            self._begin_sends(connector_metadata)

    @_timed(_never)
    def _begin_sends(self, meta: KvferryMetadata) -> None:
        self._worker.begin_sends(meta)

    @_timed(lambda c, a, r: not c.has_connector_metadata() or
            not c._get_connector_metadata().recvs)
    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        self._worker.start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are whole requests, finished before the request is scheduled

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: "AttentionMetadata", **kwargs: Any) -> None:
        # Zero copy: the blocks are sent from vLLM's own cache, once the step is done or, with
        # layer_wise, layer by layer. Most steps send nothing: no call, no timing.
        if self._worker is not None and self._worker.layer_sends:
            self._save_layer(layer_name)

    @_timed(_never)
    def _save_layer(self, layer_name: str) -> None:
        self._worker.layer_ready(layer_name)

    @_timed(lambda c, a, r: not c.has_connector_metadata() or
            c._get_connector_metadata().empty(sends=True))
    def wait_for_save(self) -> None:
        if self.has_connector_metadata():
            self._worker.wait_for_save(self._get_connector_metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending, r.finished_recving

    @_timed(lambda c, a, r: r is not None and not (
            r.finished_sending or r.finished_recving or r.failed_recving))
    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self._worker.transfer_results()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()

    # -- for tests and benchmarks (in-process engines): per-request transfer records
    def transfer_records(self) -> list[dict[str, Any]]:
        return list(self._worker.records) if self._worker is not None else []


class _Scheduler:
    def __init__(self, vllm_config: "VllmConfig", engine_id: str, producer: bool,
                 consumer: bool):
        self.block_size = vllm_config.cache_config.block_size
        self.engine_id = engine_id
        self.producer = producer
        self.consumer = consumer
        self.kv_cache_manager: KVCacheManager | None = None
        self._producing: dict[str, Request] = {}  # do_remote_decode, prompt not complete yet
        self._marked: set[str] = set()  # handed to the workers for mark_ready
        self._holding: set[str] = set()  # finished, blocks held until the workers report sent
        self._meta = KvferryMetadata()

    def has_pending_sends(self) -> bool:
        return bool(self._holding)

    def update_connector_output(self, connector_output: Any) -> None:
        self._holding.difference_update(connector_output.finished_sending or ())

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        ticket = params.get(TICKET) if params else None
        if not self.consumer or not ticket or params.get("_kvferry_loaded"):
            return 0, False
        remote = min(int(ticket["prompt_tokens"]), request.num_prompt_tokens)
        count = remote - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params:
            return
        if (self.producer and params.get("do_remote_decode")
                and request.request_id not in self._marked):
            self._producing.setdefault(request.request_id, request)
        ticket = params.get(TICKET)
        if not self.consumer or not ticket or params.get("_kvferry_loaded"):
            return
        params["_kvferry_loaded"] = True  # one load per request, even if preempted later
        if num_external_tokens <= 0:
            return  # all of it was a local prefix hit: the producer frees at its hold deadline
        group = blocks.blocks[0]
        want = math.ceil(min(int(ticket["prompt_tokens"]), request.num_prompt_tokens) /
                         self.block_size)
        ids = [b.block_id for b in group][:want]
        reused = sum(1 for b in group[:want] if b.block_hash is not None and not b.is_null)
        self._meta.recvs.append(RecvReq(request.request_id, dict(ticket), ids, reused))
        OVERHEAD.scheduler_requests += 1

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KvferryMetadata:
        meta, self._meta = self._meta, KvferryMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for req_id, req in list(self._producing.items()):
            n = scheduled.get(req_id)
            if n is None or req.num_computed_tokens + n < req.num_prompt_tokens:
                continue
            # This step's forward completes the prompt: the workers mark it ready after it.
            ids = self.kv_cache_manager.get_block_ids(req_id)[0]
            want = math.ceil(req.num_prompt_tokens / self.block_size)
            meta.sends.append(SendReq(req_id, list(ids[:want]), req.num_prompt_tokens))
            del self._producing[req_id]
            self._marked.add(req_id)
        return meta

    def request_finished(self, request: "Request",
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        self._producing.pop(req_id, None)
        if req_id not in self._marked:
            return False, None  # never marked ready (not a P/D request, or aborted before)
        self._marked.discard(req_id)
        if request.status.name not in _FINISHED_OK:
            # Aborted after mark_ready: the workers cancel it and report it sent once the side
            # is done with the blocks (a fetch may be reading them).
            self._meta.cancels.append(req_id)
            self._meta.send_finished.append(req_id)
            self._holding.add(req_id)
            return True, None
        self._meta.send_finished.append(req_id)
        self._holding.add(req_id)
        OVERHEAD.scheduler_requests += 1
        ticket = {
            "instance": self.engine_id,
            "request_id": req_id,
            "prompt_tokens": request.num_prompt_tokens,
            "blocks": math.ceil(request.num_prompt_tokens / self.block_size),
        }
        return True, {TICKET: ticket}


class _Worker:
    def __init__(self, vllm_config: "VllmConfig", engine_id: str, options: Options,
                 producer: bool, consumer: bool):
        from vllm.distributed.parallel_state import (get_pp_group,
                                                     get_tensor_model_parallel_rank,
                                                     get_tensor_model_parallel_world_size)

        self.vllm_config = vllm_config
        self.engine_id = engine_id
        self.instance_id = instance_id_u64(engine_id)
        self.o = options
        self.producer = producer
        self.consumer = consumer
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        pp = get_pp_group()
        self.pp_rank, self.pp_size = pp.rank_in_group, pp.world_size
        # kvferry's rank numbering is vLLM's: pp_rank * tp + tp_rank (TP fastest).
        self.rank = self.pp_rank * self.tp_size + self.tp_rank
        self.world_size = self.pp_size * self.tp_size
        self.server = None
        if options.rendezvous_serve and producer and self.rank == 0:
            host, port = options.rendezvous.rsplit(":", 1)
            self.server = kvferry.RendezvousServer(host, int(port), options.rendezvous_key)
        self.rv = kvferry.Rendezvous(options.rendezvous, options.rendezvous_key)
        self.device = None  # the KV tensors' device, from register_kv_caches
        self.pool = None
        self.block_size = vllm_config.cache_config.block_size
        self.whole_blocks = False  # move whole blocks (the token order inside is the kernel's)
        self.layer_index: dict[str, int] = {}  # layer name -> this rank's local layer
        # layer_wise: (u64 id, vLLM id) of the requests begun before this step's forward
        self.layer_sends: list[tuple[int, str]] = []
        self.layer_marks = 0  # (request, layer) pairs marked ready from save_kv_layer
        self.ctx = None
        self.gen = None
        self.lock = threading.Lock()
        self.sending: dict[int, str] = {}  # u64 -> vLLM request id (producer)
        self.send_terminal: set[str] = set()  # side done with the blocks
        self.send_finished: set[str] = set()  # scheduler returned delay_free for them
        self.receiving: dict[int, str] = {}  # u64 -> vLLM request id (consumer)
        self.recv_failed: set[str] = set()  # failed before the fetch started (lookup, refusal)
        self.records: list[dict[str, Any]] = []  # per finished transfer, for tests/benchmarks
        # Handle keys this rank published (producer rank 0) whose requests ended: erased in
        # batches. The writer erases, once its side is done with the request, so the keys go
        # whatever the number of decode ranks that read them.
        self.erase_keys: list[tuple[str, bool]] = []  # (key, fetched), guarded by erase_cv
        self.tombstones: list[tuple[float, str]] = []  # (erase at, key): eraser thread only
        self.erase_cv = threading.Condition()
        self.closing = False
        self.eraser = None
        if producer and self.rank == 0:
            self.eraser = threading.Thread(target=self._erase_loop, name="kvferry-erase",
                                           daemon=True)
            self.eraser.start()
        self.fetchers = ThreadPoolExecutor(max_workers=max(1, options.fetch_threads),
                                           thread_name_prefix="kvferry-fetch")

    # -- registration
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        mc = self.vllm_config.model_config
        names = sorted(kv_caches, key=extract_layer_index)
        tensors = [kv_caches[n] for n in names]
        self.layer_index = {n: i for i, n in enumerate(names)}
        if len({t.data_ptr() for t in tensors}) != len(tensors):
            raise ValueError("KvferryConnector: layers share KV tensors (KV sharing across "
                             "layers) is not supported")
        heads = mc.get_total_num_kv_heads()
        local_heads = mc.get_num_kv_heads(self.vllm_config.parallel_config)
        head_dim = mc.get_head_size()
        bs = self.vllm_config.cache_config.block_size
        dtype = _kvferry_dtype(tensors[0].dtype, self.vllm_config.cache_config.cache_dtype)
        layout, strides, blocks = _detect_layout(tensors[0], local_heads, bs, head_dim)
        t0 = tensors[0]
        if self.o.layer_wise and t0.device.type != "cpu" and self.producer:
            raise ValueError("KvferryConnector: layer_wise needs CPU KV caches (on a GPU each "
                             "layer would need an event on the engine's stream: not built)")
        self.device = kvferry.Device("cpu" if t0.device.type == "cpu"
                                     else f"cuda:{t0.device.index or 0}")
        stages = self._stage_layers([extract_layer_index(n) for n in names])
        shape = kvferry.KvShape(layers=sum(stages), kv_heads=heads, head_dim=head_dim,
                                dtype=dtype, tokens_per_block=bs)
        parallel = kvferry.ParallelConfig(tp=self.tp_size, pp=self.pp_size, stage_layers=stages)
        self.pool = kvferry.Pool.wrap(self.device, shape, tensors, parallel=parallel,
                                      rank=self.rank, blocks=blocks, byte_strides=strides,
                                      split="per-layer")
        self.whole_blocks = layout == "vllm-cpu"
        # A named layout with these very strides (with one local head several coincide, e.g.
        # vllm-cpu and flashinfer) places every element alike: any of them transfers correctly.
        if self.pool.layout.split()[0] == "custom":
            raise ValueError(f"KvferryConnector: vLLM's KV cache {tuple(tensors[0].shape)} "
                             f"strides {tensors[0].stride()} read as {layout} gives kvferry "
                             f"layout '{self.pool.layout}', not a named one: refused")
        instance = f"vllm-{self.engine_id}"
        if self.o.transport == "nixl":
            nixl_environment()
        common = dict(transport=self.o.transport, instance_id=self.instance_id,
                      kv_scales=self._kv_scales(names))
        if self.producer:
            secret = self._instance_secret(instance)
            self.ctx = kvferry.ContextSide(self.device, self.pool, timeout=self.o.hold_timeout_s,
                                           instance_secret=secret, **common)
            self.rv.publish_rank_address(instance, self.instance_id, self.rank,
                                         self.ctx.address, timeout=60.0)
            self.ctx.set_instance_addresses(
                self.rv.gather_rank_addresses(instance, self.instance_id, self.world_size,
                                              timeout=120.0))
        if self.consumer:
            # The generation side's own secret keys nothing it checks; a real one all the same.
            self.gen = kvferry.GenerationSide(self.device, self.pool,
                                              timeout=self.o.transfer_timeout_s,
                                              instance_secret=kvferry.random_key(), **common)
        logger.info("kvferry: rank %d/%d (tp %d/%d, pp %d/%d) of %s wraps layers %s as %s (%s), "
                    "%s%s", self.rank, self.world_size, self.tp_rank, self.tp_size, self.pp_rank,
                    self.pp_size, self.engine_id,
                    f"{extract_layer_index(names[0])}-{extract_layer_index(names[-1])}", layout,
                    self.pool.layout,
                    "producer " if self.producer else "", "consumer" if self.consumer else "")

    def _stage_layers(self, local: list[int]) -> list[int]:
        """Layers of each PP stage (vLLM's split, get_pp_indices), after checking that this rank
        holds exactly its stage's layers, one KV cache each (a model whose KV layers are not its
        hidden layers, such as a hybrid, is refused by name)."""
        from vllm.distributed.utils import get_pp_indices

        total = self.vllm_config.model_config.get_total_num_hidden_layers()
        bounds = [get_pp_indices(total, r, self.pp_size) for r in range(self.pp_size)]
        begin, end = bounds[self.pp_rank]
        if local != list(range(begin, end)):
            raise ValueError(f"KvferryConnector: rank {self.rank} (pp rank {self.pp_rank} of "
                             f"{self.pp_size}) has KV caches of layers {local}, not its stage's "
                             f"layers {begin}-{end - 1} of {total}: refused (every hidden layer "
                             f"must have one KV cache of its own)")
        return [e - b for b, e in bounds]

    def _kv_scales(self, names: list[str]) -> list[float] | None:
        """The layers' k_scale and v_scale ([layer][kv], kvferry's scales per tensor) when any is
        not 1: a quantized cache whose stored q stands for q * scale. The other side converts each
        element where its scales or dtype differ (docs/conversion.md). Scales computed later
        (calculate_kv_scales, on the first forward) are not seen here."""
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

        layers = get_layers_from_vllm_config(self.vllm_config, AttentionLayerBase, names)
        scales: list[float] = []
        for n in names:
            layer = layers.get(n)
            scales += [float(getattr(layer, "_k_scale_float", 1.0)),
                       float(getattr(layer, "_v_scale_float", 1.0))]
        if not any(s != 1.0 for s in scales):
            return None
        if self.pp_size > 1:
            # kvferry's scales are the whole instance's, published in rank 0's handle; a PP rank
            # knows its own stage's only.
            raise ValueError(f"KvferryConnector: KV cache scales other than 1 (k_scale/v_scale of "
                             f"a quantized cache) with pipeline_parallel_size={self.pp_size} are "
                             f"not supported yet")
        return scales

    def _instance_secret(self, instance: str) -> bytes:
        if self.o.instance_secret:
            return self.o.instance_secret
        if self.rank == 0:
            secret = kvferry.random_key()
            self.rv.publish_instance_secret(instance, self.instance_id, secret, timeout=60.0)
            return secret
        return self.rv.fetch_instance_secret(instance, self.instance_id, timeout=120.0)

    # -- producer
    def _publish(self, s: SendReq, begin) -> int | None:
        """Leases `s`'s blocks (`begin`: mark_ready, or begin_layer_wise) and publishes the
        handle (rank 0); its u64 id, or None when that failed (the request is then over here)."""
        rid = request_id_u64(self.engine_id, s.request_id)
        tokens = s.prompt_tokens
        if self.whole_blocks:
            tokens = len(s.blocks) * self.block_size
        leased = False
        try:
            with _LIBRARY:
                handle = begin(rid, s.blocks, tokens)
            leased = True
            if self.rank == 0:
                with _LIBRARY:
                    self.rv.put(handle_key(self.engine_id, s.request_id), handle, timeout=10.0)
            with self.lock:
                self.sending[rid] = s.request_id
            return rid
        except kvferry.errors.Error as e:
            # The decode side's lookup times out and recomputes; the lease ends here, and vLLM
            # frees the blocks with the next results.
            logger.error("kvferry: request %s not published: %s", s.request_id, e)
            if leased:
                self._cancel(rid)
            with self.lock:
                self.send_terminal.add(s.request_id)
            return None

    def begin_sends(self, meta: KvferryMetadata) -> None:
        """layer_wise, before the forward that completes the prompts of meta.sends."""
        if self.ctx is None:
            return
        for s in meta.sends:
            rid = self._publish(s, self.ctx.begin_layer_wise)
            if rid is not None:
                self.layer_sends.append((rid, s.request_id))

    def _cancel(self, rid: int) -> None:
        """Ends request `rid` on this side (and its lease) unless it already ended."""
        try:
            with _LIBRARY:
                self.ctx.cancel(rid)
        except kvferry.errors.Error:
            pass  # already terminal

    def _mark_layers(self, n: int, what: str) -> int:
        """The first `n` local layers of every request begun layer-wise this step are ready;
        how many requests took it (one that already ended, by deadline or cancel, does not)."""
        marked = 0
        for rid, req_id in self.layer_sends:
            try:
                with _LIBRARY:
                    self.ctx.mark_layers_ready(rid, n)
                marked += 1
            except kvferry.errors.Error as e:
                logger.warning("kvferry: request %s, %s: %s", req_id, what, e)
        return marked

    def layer_ready(self, layer_name: str) -> None:
        """layer_wise: `layer_name`'s attention ran (its KV is in the blocks, CPU tensors)."""
        self.layer_marks += self._mark_layers(self.layer_index[layer_name] + 1, layer_name)

    def wait_for_save(self, meta: KvferryMetadata) -> None:
        if self.ctx is None:
            return
        # layer_wise: every layer ran; whichever save_kv_layer did not mark (none, normally), now.
        self._mark_layers(len(self.layer_index), "all layers")
        self.layer_sends = []
        if not self.o.layer_wise:
            for s in meta.sends:
                self._publish(s, self.ctx.mark_ready)
        for req_id in meta.cancels:
            self._cancel(request_id_u64(self.engine_id, req_id))
        with self.lock:
            self.send_finished.update(meta.send_finished)

    # -- consumer
    def start_load_kv(self, meta: KvferryMetadata) -> None:
        for r in meta.recvs:
            blocks = list(r.blocks)
            if self.o.test_corrupt == "reverse-blocks":
                blocks.reverse()
            rid = request_id_u64(r.ticket["instance"], r.ticket["request_id"])
            with self.lock:
                self.receiving[rid] = r.request_id
            # The producer published the handle when its prefill step ended, before the ticket
            # reached us: one lookup and the fetch (which only posts) right here. Handing every
            # request to a fetch thread cost the engine thread a thread wake-up and the GIL
            # hand-over, 0.8 ms a request on the 2-core machine (docs/vllm.md).
            key = handle_key(r.ticket["instance"], r.ticket["request_id"])
            try:
                with _LIBRARY:
                    handle = self.rv.get(key, timeout=_INLINE_LOOKUP_S)
            except kvferry.errors.Error:
                # Not published yet (a router that sent the request here early), or the
                # rendezvous is slow: a fetch thread waits for it.
                self.fetchers.submit(self._fetch, r, rid, blocks)
                continue
            with _LIBRARY:
                self._fetch(r, rid, blocks, handle)

    def _erase_loop(self) -> None:
        """Producer rank 0: erases the handle keys it published once their requests ended,
        gathering what ends within _ERASE_PERIOD_S; a request that ended unfetched leaves
        _RELEASED under its key for hold_timeout_s first. Until close."""
        while True:
            with self.erase_cv:
                due = self.tombstones[0][0] - time.monotonic() if self.tombstones else None
                self.erase_cv.wait_for(lambda: self.erase_keys or self.closing, timeout=due)
                if self.closing:
                    return
            if self.erase_keys:
                time.sleep(_ERASE_PERIOD_S)
            with self.erase_cv:
                ended, self.erase_keys = self.erase_keys, []
            now = time.monotonic()
            gone = [key for key, fetched in ended if fetched]
            while self.tombstones and self.tombstones[0][0] <= now:
                gone.append(self.tombstones.pop(0)[1])
            self._erase(gone)
            for key, fetched in ended:
                if not fetched:
                    try:
                        self.rv.put(key, _RELEASED, timeout=10.0)
                        self.tombstones.append((now + self.o.hold_timeout_s, key))
                    except kvferry.errors.Error as e:
                        logger.warning("kvferry: releasing %s: %s", key, e)

    def _erase(self, keys: list[str]) -> None:
        for key in keys:
            try:
                self.rv.erase(key, timeout=10.0)
            except kvferry.errors.Error as e:
                logger.warning("kvferry: erasing %s: %s", key, e)

    def _fetch(self, r: RecvReq, rid: int, blocks: list[int], handle: bytes | None = None) -> None:
        """Fetches `r` into `blocks` (on the engine thread with the handle looked up, or on a
        fetch thread that waits for it)."""
        key = handle_key(r.ticket["instance"], r.ticket["request_id"])
        try:
            if handle is None:
                handle = self.rv.get(key, timeout=self.o.transfer_timeout_s)
            if handle == _RELEASED:
                raise RuntimeError("the producer released the request before this fetch (its "
                                   "hold deadline passed, or it was aborted or failed there)")
            self.gen.fetch(handle, blocks, reused_blocks=r.reused_blocks)
        except Exception as e:  # noqa: BLE001 - every failure fails this request, nothing else
            logger.error("kvferry: fetch of %s (producer %s request %s) failed: %s", r.request_id,
                         r.ticket["instance"], r.ticket["request_id"], e)
            with self.lock:
                self.receiving.pop(rid, None)
                self.recv_failed.add(r.request_id)
            return

    # -- both
    def transfer_results(self) -> KVConnectorTransferResults:
        out = KVConnectorTransferResults()
        if self.ctx is not None:
            sent = []
            if self.sending:  # nothing in flight: no call (most steps of a serving instance)
                with _LIBRARY:
                    sent = self.ctx.poll(0, 0.0)
            for st in sent:
                with self.lock:
                    req_id = self.sending.pop(st.request_id, None)
                    if req_id is not None:
                        self.send_terminal.add(req_id)
                if req_id is not None and not st.ok:
                    logger.warning("kvferry: send of %s ended %s", req_id, st)
                if req_id is not None and self.eraser is not None:
                    with self.erase_cv:  # the eraser wakes once per batch
                        if not self.erase_keys:
                            self.erase_cv.notify()
                        self.erase_keys.append((handle_key(self.engine_id, req_id), st.ok))
            with self.lock:
                done = self.send_terminal & self.send_finished
                self.send_terminal -= done
                self.send_finished -= done
            out.finished_sending = done
            OVERHEAD.requests += len(done)
        if self.gen is not None and (self.receiving or self.recv_failed):
            now = time.time()
            with _LIBRARY:
                received = self.gen.poll(0, 0.0) if self.receiving else []
            for st in received:
                with self.lock:
                    req_id = self.receiving.pop(st.request_id, None)
                if req_id is None:
                    continue
                out.finished_recving.add(req_id)
                OVERHEAD.requests += 1
                self.records.append({"request_id": req_id, "ok": st.ok, "bytes": st.bytes,
                                     "seconds": st.seconds, "at": now})
                if not st.ok:
                    logger.error("kvferry: fetch of %s failed: %s", req_id, st)
                    out.failed_recving.add(req_id)
            with self.lock:
                failed, self.recv_failed = self.recv_failed, set()
            for req_id in failed:
                self.records.append({"request_id": req_id, "ok": False, "bytes": 0,
                                     "seconds": None, "at": now})
            out.finished_recving |= failed
            out.failed_recving |= failed
        return out

    def close(self) -> None:
        self.fetchers.shutdown(wait=False, cancel_futures=True)
        with self.erase_cv:
            self.closing = True
            self.erase_cv.notify()
        if self.eraser is not None:
            self.eraser.join(timeout=30.0)
        with self.erase_cv:
            keys = [key for key, _ in self.erase_keys] + [key for _, key in self.tombstones]
            self.erase_keys, self.tombstones = [], []
        try:
            self._erase(keys)  # best effort at shutdown
        except Exception:  # noqa: BLE001
            pass
        for obj in (self.gen, self.ctx, self.rv, self.server):
            if obj is not None:
                obj.close()


def _kvferry_dtype(dtype: torch.dtype, cache_dtype: str = "auto") -> str:
    # vLLM keeps an fp8 cache (kv_cache_dtype "fp8", "fp8_e4m3", "fp8_e5m2") in uint8 tensors.
    if str(cache_dtype).startswith("fp8") and dtype in (torch.uint8, torch.float8_e4m3fn,
                                                       torch.float8_e5m2):
        return "fp8e5m2" if cache_dtype == "fp8_e5m2" else "fp8"
    names = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
             torch.float8_e4m3fn: "fp8", torch.float8_e5m2: "fp8e5m2", torch.int8: "int8"}
    if dtype not in names:
        raise ValueError(f"KvferryConnector: KV cache dtype {dtype} is not supported "
                         f"(supported: {sorted(str(d) for d in names)})")
    return names[dtype]


def _detect_layout(t: torch.Tensor, heads: int, bs: int,
                   d: int) -> tuple[str, list[int], int]:
    """(kvferry layout name, byte strides over (block, layer, kv, head, token, dim), blocks) of
    one layer's KV tensor, or ValueError naming what was not understood."""
    es = t.element_size()
    shape, st = tuple(t.shape), t.stride()
    if t.dim() == 4 and t.device.type != "cpu" and st[3] == 1 and (
            shape[1:] == (heads, bs, 2 * d) or shape[1:] == (bs, heads, 2 * d)):
        # vLLM 0.32's CUDA backends: per layer [blocks, heads, block_size, 2 * head_size] or
        # [blocks, block_size, heads, ...] (flash_attn.py splits the content dim: K, then V),
        # strides in the order of the KV cache layout (LBHNC: head-major, LBNHC: token-major).
        h_st, t_st = (st[1], st[2]) if shape[1] == heads else (st[2], st[1])
        kind = "vllm-hnd" if h_st > t_st or heads == 1 else "vllm-nhd"
        return kind, [st[0] * es, 0, d * es, h_st * es, t_st * es, es], shape[0]
    if t.dim() == 4 and shape[1:] == (heads, bs, 2 * d) and st[3] == 1 and st[2] == 2 * d:
        # CPU backend: each (block, head) page is the block's K half, then its V half
        # (cpu_attn.py: view [blocks, heads, 2 * block_size, head_size], chunk(2, dim=2)). The
        # order of tokens and dims inside a half is the attention kernel's (ISA-dependent, not
        # [token][dim]: measured), so this layout moves whole blocks only (the worker marks
        # whole blocks ready). Heads still split cleanly: a (block, head) page is contiguous.
        return "vllm-cpu", [st[0] * es, 0, bs * d * es, st[1] * es, d * es, es], shape[0]
    if t.dim() == 5 and shape[0] == 2 and shape[2:] == (bs, heads, d) and st[4] == 1:
        # [2, blocks, block_size, heads, head_size] with NHD or HND strides (CUDA backends).
        kind = "per-layer" if st[3] < st[2] or heads == 1 else "per-layer-hnd"
        return kind, [st[1] * es, 0, st[0] * es, st[3] * es, st[2] * es, es], shape[1]
    raise ValueError(
        f"KvferryConnector: vLLM KV cache tensor of shape {shape}, strides {st} "
        f"({heads} local KV heads, block_size {bs}, head_size {d}) is not a layout kvferry "
        "understands (CPU [blocks, heads, block_size, 2*head_size]; CUDA "
        "[blocks, heads, block_size, 2*head_size] HND or NHD strides; "
        "[2, blocks, block_size, heads, head_size] NHD or HND)")
