"""KV offloading with the real vLLM on the CPU: kvferry's host + file tier against no offloading and
vLLM's own CPU offloading, then restarts on the same file tier.

Run by scripts/test-vllm in the vLLM venv (scripts/vllm-env). The orchestrator (no --mode) starts
each engine as its own process (a restart is a new process: the file tier's lock and page cache
go with the old one) and judges what each writes:

  none        no connector
  vllm-cpu    vLLM's OffloadingConnector with its CPUOffloadingSpec (skipped, and said so, where
              vLLM refuses it: its worker needs a CUDA-alike or XPU platform, so not on vllm-cpu)
  kvferry     KvferryOffloadingConnector: kvferry host tier + file tier in WORK_DIR/files
  restart     a new kvferry engine on the same files, after one slot was altered while no engine
              ran (recovery at open must drop it) and with another altered after the engine opened
              its files (its read fails the checksum, vLLM recomputes the block): its first pass
              must hit the files, outputs identical

The workload: DOCS documents of DOC_BLOCKS blocks, each asked QUESTIONS times (a question is a
short suffix), one request at a time, in rounds over the documents; vLLM's KV cache holds
GPU_BLOCKS blocks, far less than the documents, so a document's second question finds its prefix
only in an offloaded tier. Greedy outputs of every engine must equal `none`'s; each engine reports
prompt tokens computed (prompt - cached), its hit rate and TTFT (median per question round).

    python offload_check.py MODEL_DIR WORK_DIR
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

BLOCK = 32
DOCS, DOC_BLOCKS, QUESTIONS = 6, 6, 2
GPU_BLOCKS = 24  # vLLM's KV cache: 768 tokens; the documents take 6 x 6 = 36 blocks
MAX_TOKENS = 8
HOST_BLOCKS, FILE_SLOTS = 8, 64  # kvferry: the host tier alone does not hold the documents


def workload() -> list[list[int]]:
    rng = random.Random(11)
    tok = lambda n: [rng.randrange(10, 2000) for _ in range(n)]  # noqa: E731
    docs = [tok(DOC_BLOCKS * BLOCK) for _ in range(DOCS)]
    out = []
    for q in range(QUESTIONS):
        for d in docs:
            out.append(d + tok(20 + 3 * q))
    return out


def engine_env() -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")


def kv_config(mode: str, files: str) -> dict | None:
    if mode == "none":
        return None
    if mode == "vllm-cpu":
        block_bytes = 4 * 2 * 2 * BLOCK * 64 * 4  # layers x K,V x heads x tokens x dim x fp32
        return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"cpu_bytes_to_use": HOST_BLOCKS * block_bytes}}
    return kvferry_kv(files, HOST_BLOCKS, FILE_SLOTS)


def kvferry_kv(files: str, host_blocks: int, file_slots: int) -> dict:
    """vLLM's kv_transfer_config for kvferry's offloading connector (host tier + file tier)."""
    return {"kv_connector": "KvferryOffloadingConnector",
            "kv_connector_module_path": "kvferry.integrations.vllm_offload",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"kvferry_host_blocks": host_blocks,
                                          "kvferry_file_dir": files,
                                          "kvferry_file_slots": file_slots}}


def corrupt_slot(files: str, slot: int) -> None:
    """Flips one payload byte of `slot` in rank 0's slab files (slots_per_file: the store's
    default, read from the file size)."""
    d = os.path.join(files, "rank0")
    payload = 4 * 2 * 2 * BLOCK * 64 * 4
    slot_bytes = 4096 + -(-payload // 4096) * 4096
    slabs = sorted(f for f in os.listdir(d) if f.startswith("kvferry-slab-"))
    per_file = os.path.getsize(os.path.join(d, slabs[0])) // slot_bytes
    path = os.path.join(d, slabs[slot // per_file])
    with open(path, "r+b") as f:
        f.seek((slot % per_file) * slot_bytes + 4096 + 1000)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x5A]))
        f.flush()
        os.fsync(f.fileno())


def engine_objects(llm):
    """(scheduler-side connector, worker-side connector) of an in-process engine."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    core = llm.llm_engine.engine_core.engine_core
    return core.scheduler.connector, get_kv_transfer_group()


def run_engine(model: str, mode: str, files: str, out_path: str, tp: int = 1) -> None:
    engine_env()
    from vllm import LLM, SamplingParams

    kv = kv_config("kvferry" if mode == "restart" else mode, files)
    kw = dict(model=model, skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
              block_size=BLOCK, max_model_len=512, max_num_batched_tokens=512, seed=0,
              num_gpu_blocks_override=GPU_BLOCKS, disable_log_stats=False,
              tensor_parallel_size=tp)
    if kv is not None:
        kw["kv_transfer_config"] = kv
    result: dict = {"mode": mode}
    t0 = time.perf_counter()
    try:
        llm = LLM(**kw)
    except Exception as e:  # noqa: BLE001 - reported, judged by the orchestrator
        result["error"] = f"{type(e).__name__}: {e}"
        with open(out_path, "w") as f:
            json.dump(result, f)
        return
    result["startup_s"] = time.perf_counter() - t0
    manager = worker = None
    if mode in ("kvferry", "restart") and tp == 1:
        sched, wconn = engine_objects(llm)
        manager = sched.connector_scheduler.manager.core
        worker = wconn.connector_worker.worker.core
        result["recovered"] = manager.stats.recovered
        if mode == "restart" and tp == 1:
            # A slot altered after the files were opened: found at read, recomputed by vLLM.
            recovered = json.load(open(os.path.join(files, "rank0", "session.json")))["recovered"]
            result["corrupted_open"] = int(recovered[-1][0])
            corrupt_slot(files, result["corrupted_open"])
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                        detokenize=False)
    outputs, computed, cached, ttft = [], [], [], []
    for p in workload():  # one request at a time: the cache state each sees is deterministic
        (o,) = llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)
        outputs.append(list(o.outputs[0].token_ids))
        c = o.num_cached_tokens or 0
        cached.append(c)
        computed.append(len(p) - c)
        ttft.append(o.metrics.first_token_latency if o.metrics is not None else None)
    result.update(outputs=outputs, computed=computed, cached=cached, ttft=ttft)
    if kv is not None:
        # Let the last stores finish before the engine goes (a restart should find them): the
        # scheduler keeps stepping while its connector has jobs in flight.
        sched = llm.llm_engine.engine_core.engine_core.scheduler.connector
        deadline = time.monotonic() + 60
        while sched.has_pending_push_work() and time.monotonic() < deadline:
            llm.llm_engine.step()
            time.sleep(0.01)
        result["jobs_left"] = int(sched.has_pending_push_work())
    if manager is not None:
        result["manager"] = vars(manager.stats)
        result["worker"] = {"load_failures": worker.load_failures,
                            "store_failures": worker.store_failures,
                            "file_refused": worker.file_refused,
                            "metrics_file_reads": worker.tm.stats.get("file_reads"),
                            "metrics_file_writes": worker.tm.stats.get("file_writes")}
        worker.shutdown()  # drains and closes the file tier (the next engine locks it)
    with open(out_path, "w") as f:
        json.dump(result, f)
    os._exit(0)  # vLLM's teardown is not needed (and slow) in a throwaway process


def vllm_cpu_offload_runs() -> bool:
    """Whether vLLM's own CPU offloading runs on this platform (its CPUOffloadingSpec.get_worker
    requires a CUDA-alike or XPU platform)."""
    engine_env()
    from vllm.platforms import current_platform

    return current_platform.is_cuda_alike() or current_platform.is_xpu()


def spawn(model: str, mode: str, work: str, tp: int = 1) -> dict:
    out = os.path.join(work, f"{mode}.json")
    log = os.path.join(work, f"{mode}.log")
    t0 = time.perf_counter()
    env = dict(os.environ)
    if tp > 1:  # vLLM's CPU workers: one core each (one NUMA node here)
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(r % os.cpu_count()) for r in range(tp))
    with open(log, "w") as lf:
        rc = subprocess.call([sys.executable, __file__, model, work, "--mode", mode,
                              "--tp", str(tp)], stdout=lf, stderr=subprocess.STDOUT,
                             timeout=480, env=env)
    if not os.path.exists(out):
        raise SystemExit(f"offload_check: {mode} engine wrote no result (rc {rc}); log {log}")
    r = json.load(open(out))
    r["wall_s"] = time.perf_counter() - t0
    return r


def tp_check(model: str, work: str, files: str, tp: int) -> int:
    """TP > 1: each rank's worker in its own process, its own file directory (rank<r>); the
    scheduler indexes the slots every rank recovered. Outputs must equal no offloading's (same TP)
    and the restart's first pass must be served from the files."""
    os.makedirs(files, exist_ok=True)
    res = {m: spawn(model, m, work, tp) for m in ("none", "kvferry", "restart")}
    failed = 0
    for m, r in res.items():
        if "error" in r:
            print(f"FAIL: {m} TP{tp}: {r['error'][:300]}")
            return 1
    base = res["none"]["outputs"]
    doc_tokens = DOCS * DOC_BLOCKS * BLOCK
    for m in ("kvferry", "restart"):
        same = sum(o == b for o, b in zip(res[m]["outputs"], base))
        ok = same == len(base)
        failed += not ok
        print(f"{'PASS' if ok else 'FAIL'}: {m} TP{tp}: outputs identical ({same}/{len(base)}); "
              f"prompt tokens computed {sum(res[m]['computed'])} (none: "
              f"{sum(res['none']['computed'])})")
    hit = sum(res["restart"]["cached"][:DOCS])
    ok = hit >= 0.9 * doc_tokens and sum(res["kvferry"]["cached"][DOCS:]) >= 0.9 * doc_tokens
    failed += not ok
    print(f"{'PASS' if ok else 'FAIL'}: TP{tp}: second questions cached "
          f"{sum(res['kvferry']['cached'][DOCS:])}, restart's first pass {hit} of {doc_tokens} "
          "document tokens")
    print(f"offload_check TP{tp}: {'all passed' if not failed else f'{failed} FAILED'}")
    return 1 if failed else 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("work")
    ap.add_argument("--mode")
    ap.add_argument("--tp", type=int, default=1,
                    help="tensor_parallel_size of every engine; above 1 the workers are other "
                    "processes: only outputs and vLLM's cached-token counts are checked")
    a = ap.parse_args()
    files = os.path.join(a.work, "files")
    if a.mode:
        run_engine(a.model, a.mode, files, os.path.join(a.work, f"{a.mode}.json"), a.tp)
        return 0
    if a.tp > 1:
        return tp_check(a.model, a.work, files, a.tp)
    os.makedirs(files, exist_ok=True)
    failed = 0

    def check(ok: bool, what: str) -> None:
        nonlocal failed
        failed += not ok
        print(f"{'PASS' if ok else 'FAIL'}: {what}", flush=True)

    res = {}
    for mode in ("none", "vllm-cpu", "kvferry", "restart"):
        if mode == "vllm-cpu" and not vllm_cpu_offload_runs():
            # Measured: its worker raises "CPU Offloading is currently only supported on
            # CUDA-alike and XPU GPUs" after the engine loaded (a wasted start-up).
            res[mode] = {"mode": mode, "error": "vLLM's CPUOffloadingSpec refuses this platform "
                         "(CUDA-alike or XPU only)"}
            continue
        if mode == "restart":
            # Alter one slot (the last one written) while no engine runs: recovery at the next
            # open must drop it.
            res["corrupted_at_rest"] = res["kvferry"]["manager"]["stored"] - 1
            corrupt_slot(files, res["corrupted_at_rest"])
        res[mode] = spawn(a.model, mode, a.work)
    at_rest = res.pop("corrupted_at_rest")

    n = len(workload())
    total = sum(len(p) for p in workload())
    base = res["none"]["outputs"]
    print(f"workload: {DOCS} documents x {DOC_BLOCKS} blocks of {BLOCK} tokens, {QUESTIONS} "
          f"questions each, {n} requests one at a time, {total} prompt tokens; vLLM KV cache "
          f"{GPU_BLOCKS} blocks; kvferry host {HOST_BLOCKS} blocks + file {FILE_SLOTS} slots")
    print(f"{'engine':10} {'computed':>9} {'hit rate':>9} {'TTFT p50 1st round':>19} "
          f"{'TTFT p50 later':>15} {'start s':>8}")
    for mode, r in res.items():
        if "error" in r:
            print(f"{mode:10} not run: {r['error'][:300]}")
            continue
        # vLLM counts a block whose load failed (and was recomputed) as cached: add it back (a
        # lower bound: vLLM recomputes from that block to the end of the request's hit).
        comp = sum(r["computed"]) + BLOCK * r.get("worker", {}).get("load_failures", 0)
        t1 = [t for t in r["ttft"][:DOCS] if t is not None]
        t2 = [t for t in r["ttft"][DOCS:] if t is not None]
        p50 = lambda xs: f"{statistics.median(xs) * 1e3:.1f} ms" if xs else "n/a"  # noqa: E731
        print(f"{mode:10} {comp:9d} {1 - comp / total:9.3f} {p50(t1):>19} {p50(t2):>15} "
              f"{r['startup_s']:8.1f}")
    for mode in ("kvferry", "restart"):
        ms = res[mode].get("manager")
        if ms:
            print(f"{mode}: blocks loaded {ms['loaded_host']} from host, {ms['loaded_file']} from "
                  f"files ({ms['promoted']} of those promoted into the host tier), "
                  f"{ms['stored']} stored")
    for mode in ("vllm-cpu", "kvferry", "restart"):
        r = res[mode]
        if "error" in r:
            check(mode == "vllm-cpu", f"{mode}: engine started ({r['error'][:120]})")
            continue
        same = sum(o == b for o, b in zip(r["outputs"], base))
        check(same == n, f"{mode}: greedy outputs identical to no offloading ({same}/{n})")
    k, rs = res["kvferry"], res["restart"]
    doc_tokens = DOCS * DOC_BLOCKS * BLOCK
    later = slice(DOCS, None)  # the second question of each document
    check(sum(k["cached"][later]) >= 0.9 * doc_tokens,
          f"kvferry: second questions find their documents offloaded "
          f"({sum(k['cached'][later])} of {doc_tokens} document tokens)")
    check(sum(res["none"]["cached"][later]) < sum(k["cached"][later]),
          f"no offloading finds less ({sum(res['none']['cached'][later])} tokens): the "
          "documents do not fit vLLM's own cache")
    if "error" not in res["vllm-cpu"]:
        check(sum(k["computed"]) <= sum(res["vllm-cpu"]["computed"]),
              f"kvferry computes no more prompt tokens than vLLM's CPU offloading "
              f"({sum(k['computed'])} vs {sum(res['vllm-cpu']['computed'])})")
    stored = k["manager"]["stored"]
    check(rs["recovered"] == stored - 1,
          f"restart: {rs['recovered']} slots recovered of {stored} stored (slot {at_rest}, "
          "altered at rest, dropped)")
    first = slice(0, DOCS)  # the restart's first pass: documents only in files
    # vLLM's num_cached_tokens counts blocks whose load failed (recomputed): leave them out.
    hit = sum(rs["cached"][first]) - BLOCK * rs["worker"]["load_failures"]
    check(hit >= 0.9 * doc_tokens and rs["manager"]["hits_recovered"] >= 0.9 * stored,
          f"restart: first pass serves at least {hit} of {doc_tokens} document tokens from "
          f"files ({rs['manager']['hits_recovered']} of {stored} stored blocks hit)")
    check(rs["worker"]["load_failures"] == 1 and rs["manager"]["discarded"] == 1,
          f"restart: slot {rs.get('corrupted_open')}, altered after open, fails its read once "
          f"({rs['worker']['load_failures']} failed block loads, {rs['manager']['discarded']} "
          "discarded), is recomputed, and the next request misses it cleanly (no second failed "
          "read) and stores it again")
    print(f"offload_check: {'all passed' if not failed else f'{failed} FAILED'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
