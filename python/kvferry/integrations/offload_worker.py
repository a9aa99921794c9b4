"""kvferry's vLLM offloading backend, worker side: moves blocks between vLLM's KV tensors (its
canonical ``[blocks, page_bytes]`` int8 view per layer, wrapped zero-copy) and a kvferry host
pool / file tier. Needs torch and kvferry, not vLLM: the GPU benchmark
(scripts/vllm/offload_bench.py --worker) drives it on CUDA tensors without vLLM installed."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import kvferry

from .offload_manager import (
    IDENTITY_FILE,
    SESSION_FILE,
    KvferrySpecEntries,
    OffloadOptions,
    _write_json,
    rank_dir,
    check_identity,
)

logger = logging.getLogger("kvferry.vllm_offload")

# ---------------------------------------------------------------------------------------------
# Worker side


# Blocks per file batch: the TransferManager's pinned file staging (a larger batch is refused,
# so a job's file blocks go in batches of at most this many).
FILE_STAGING_BLOCKS = 32


@dataclass
class _Job:
    load: bool
    # (batch, vLLM block ids, kind): "copy" moves the job's blocks; "promote" copies blocks a
    # load read from files into the host tier (after the read: the TransferManager orders a
    # read of a primary block after the batch that wrote it).
    batches: list[tuple[Any, np.ndarray, str]] = field(default_factory=list)
    start: float = 0.0
    bytes: int = 0


class KvferryOffloadingWorker:
    """Moves blocks between vLLM's KV tensors (wrapped zero-copy) and the host pool / file tier
    through one kvferry TransferManager. submit_* queue batches and return at once (a file batch
    waits only for pinned staging, FILE_STAGING_BLOCKS blocks, when earlier file batches hold
    it); get_finished polls them (TransferBatch.query), never waits. Not thread-safe: vLLM calls
    it from its worker thread."""

    def __init__(self, tensors: list[Any], tokens_per_block: int, options: OffloadOptions,
                 identity: Mapping[str, Any], rank: int, engine_id: str,
                 report_load_errors: bool = False):
        import torch

        self.o = options
        self.report_load_errors = report_load_errors
        self.failed_blocks: set[int] = set()  # vLLM block ids whose load failed, not yet reported
        self.load_failures = 0
        self.store_failures = 0
        self.promote_failures = 0
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
        self._torch_device = t0.device
        self._cuda = t0.device.type == "cuda"
        self.device = kvferry.Device("cpu" if not self._cuda
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
        self.tm = kvferry.TransferManager(self.device, self.primary, self.host, file=self.store,
                                          file_staging_blocks=FILE_STAGING_BLOCKS)
        if self._cuda:
            # A side stream that waits for vLLM's current stream at each job: kvferry wraps only
            # real streams (not the legacy default stream torch's current stream usually is).
            self._order_stream = torch.cuda.Stream(device=t0.device)
            self._order = self.device.wrap_stream(self._order_stream)
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
        self._after_compute()
        hm = dst.host >= 0
        if self.host is not None and hm.any():
            moves = np.stack([gpu[hm], dst.host[hm]], axis=1)
            job.batches.append((self.tm.offload(moves, kvferry.Tier.HOST), gpu[hm], "copy"))
        fm = dst.slots >= 0
        if self.store is not None and fm.any():
            self._file_batches(job, np.nonzero(fm)[0], gpu, dst.slots, dst.keys, load=False)
        job.bytes = sum(len(g) for _, g, _ in job.batches) * self.block_bytes
        self.jobs[job_id] = job
        return True

    def _after_compute(self) -> None:
        """On CUDA, the job's copies wait for the work vLLM queued so far on its current stream: a
        store reads blocks the last forward may still be writing, a load writes blocks a
        finished request's kernels may still read. (On the CPU the forward has returned.)"""
        if self._cuda:
            import torch

            self._order_stream.wait_stream(torch.cuda.current_stream(self._torch_device))
            self.tm.wait_for_compute(self._order)

    def _file_batches(self, job: _Job, idx: np.ndarray, gpu: np.ndarray, slots: np.ndarray,
                      keys: list[int], load: bool) -> None:
        """The file part of a job: items `idx` in batches the file staging holds."""
        for i in range(0, len(idx), FILE_STAGING_BLOCKS):
            part = idx[i:i + FILE_STAGING_BLOCKS]
            pk = [keys[j] for j in part]
            if load:
                b = self.tm.onboard(np.stack([slots[part], gpu[part]], axis=1),
                                    kvferry.Tier.FILE, keys=pk)
            else:
                b = self.tm.offload(np.stack([gpu[part], slots[part]], axis=1),
                                    kvferry.Tier.FILE, keys=pk)
            job.batches.append((b, gpu[part], "copy"))

    def submit_load(self, job_id: int, src: KvferrySpecEntries, gpu_ids: np.ndarray) -> bool:
        gpu = np.asarray(gpu_ids, dtype=np.int64)
        assert len(gpu) == len(src), f"load job {job_id}: {len(gpu)} blocks for {len(src)} keys"
        job = _Job(load=True, start=time.perf_counter())
        self._after_compute()
        hm = src.host >= 0
        if hm.any():
            moves = np.stack([src.host[hm], gpu[hm]], axis=1)
            job.batches.append((self.tm.onboard(moves, kvferry.Tier.HOST), gpu[hm], "copy"))
        fm = ~hm
        if fm.any():
            if self.store is None:  # never: the manager names slots only when the tier is on
                self.failed_blocks.update(int(b) for b in gpu[fm])
            else:
                self._file_batches(job, np.nonzero(fm)[0], gpu, src.slots, src.keys, load=True)
        job.bytes = sum(len(g) for _, g, _ in job.batches) * self.block_bytes
        # Promotion: blocks read from files are copied on into the host blocks the manager took
        # (after their read, by the manager's ordering); a failed read's copy is never used (the
        # block is reported and the manager forgets it, host copy included).
        pm = (src.promote >= 0) & fm
        if self.host is not None and self.store is not None and pm.any():
            moves = np.stack([gpu[pm], src.promote[pm]], axis=1)
            job.batches.append((self.tm.offload(moves, kvferry.Tier.HOST), gpu[pm], "promote"))
        self.jobs[job_id] = job
        return True

    def get_finished(self) -> list[tuple[int, bool, int, float]]:
        """(job id, success, bytes, seconds) of the jobs finished since the last call."""
        out = []
        for job_id, job in list(self.jobs.items()):
            if not all(b.query() for b, _, _ in job.batches):
                continue
            del self.jobs[job_id]
            ok = self._account(job_id, job)
            out.append((job_id, ok, job.bytes, time.perf_counter() - job.start))
        return out

    def _account(self, job_id: int, job: _Job) -> bool:
        ok = True
        failed: set[int] = set()
        for b, gpu, kind in job.batches:
            for i, err in enumerate(b.items):
                if err is None:
                    continue
                ok = False
                if kind == "promote":
                    # The vLLM block is fine, but the manager will count the host copy: report
                    # the block so that the key is forgotten (and the block recomputed).
                    self.promote_failures += 1
                elif job.load:
                    self.load_failures += 1
                else:
                    self.store_failures += 1
                if job.load:
                    failed.add(int(gpu[i]))
                logger.error("kvferry offload: %s job %d: %s", kind if kind == "promote" else
                             "load" if job.load else "store", job_id, err)
        self.failed_blocks |= failed
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
            for b, _, _ in job.batches:
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
