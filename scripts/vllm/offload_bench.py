"""Benchmarks of kvferry as vLLM's offloading backend (issue 24, item 5). Two modes:

  worker   KvferryOffloadingWorker alone (no vLLM needed: torch and the kvferry module), on the
           tensors vLLM's offloading worker hands it on CUDA: one int8 [blocks, page_bytes] view
           per layer over vLLM's layer-compact KV buffer (LBHNC/LBNHC: each layer's blocks
           contiguous), or one [blocks, layers * page_bytes] view of the block-outermost (packed)
           buffer. Times store jobs (vLLM blocks -> pinned host tier) and load jobs (host ->
           other vLLM blocks), submit to finish, against one torch copy (one cudaMemcpy) of the
           same bytes between a device buffer and pinned host memory, measured in the same run,
           interleaved rep by rep; checks the loaded bytes. Block ids in order, and shuffled (a
           job of scattered blocks). Prints the ratio, and how long the submit calls took (what
           vLLM's step pays); --json for a machine-readable result.

  trace    Replays a multi-turn trace with a shared system prompt against the real vLLM (the CPU
           build here): SESSIONS conversations of TURNS turns, each turn's prompt the whole
           conversation so far (system prompt, earlier prompts, the engine's own greedy replies)
           plus a new user message; a round is one turn of every session, submitted together
           (vLLM runs MAX_SEQS at a time). vLLM's KV cache holds far fewer blocks than the
           conversations, so a session's history is evicted before its next turn. Engines, each
           its own process, both alive, rounds interleaved (a then c, then c then a, ...):
             (a) none     no offloading
             (c) kvferry  KvferryOffloadingConnector, host HOST_BLOCKS blocks + FILE_SLOTS slots
           Reports prompt tokens computed, hit rate, TTFT p50/p99, throughput (prompt + generated
           tokens per second of generate time, and per CPU second of the engine's process: on a
           machine shared with other jobs wall time also counts waiting for a core, CPU time
           does not); outputs of (c) must equal (a)'s.
           (b), vLLM's own CPU offloading, does not run on vLLM's CPU build (offload_check.py).

    python offload_bench.py worker [--device cuda] [--json PATH]       (torch + kvferry only)
    python offload_bench.py trace MODEL_DIR WORK_DIR [--json PATH]     (in the vLLM venv)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

# ---- worker -------------------------------------------------------------------------------------


def kv_views(torch, device: str, layout: str, layers: int, blocks: int, page: int):
    """vLLM's canonical views (its offloading worker.py): per layer [blocks, page] int8 over one
    layer-compact buffer, or one [blocks, layers * page] view of a block-outermost buffer."""
    raw = torch.randint(-128, 128, (layers * blocks * page,), dtype=torch.int8, device=device)
    if layout == "compact":
        return [raw[i * blocks * page:(i + 1) * blocks * page].view(blocks, page)
                for i in range(layers)]
    return [raw.view(blocks, layers * page)]


def sync(torch, device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_job(worker, job_id: int, submit) -> tuple[float, float]:
    """(seconds from submit to finished, seconds the submit call took: what vLLM's step pays)."""
    t0 = time.perf_counter()
    submit()
    t1 = time.perf_counter()
    worker.wait([job_id])
    done = worker.get_finished()
    dt = time.perf_counter() - t0
    if [(j, ok) for j, ok, _, _ in done] != [(job_id, True)]:
        raise SystemExit(f"offload_bench: job {job_id} finished as {done}")
    return dt, t1 - t0


def copy_once(torch, device: str, dst, src) -> float:
    sync(torch, device)
    t0 = time.perf_counter()
    dst.copy_(src, non_blocking=True)
    sync(torch, device)
    return time.perf_counter() - t0


def bench_worker(a) -> dict:
    import numpy as np
    import torch

    from kvferry.integrations.offload_manager import FORMAT, KvferrySpecEntries, OffloadOptions
    from kvferry.integrations.offload_worker import KvferryOffloadingWorker

    dev = a.device
    elem = {"bf16": 2, "fp16": 2, "fp32": 4}[a.dtype]
    page = 2 * a.block_size * a.kv_heads * a.head_dim * elem  # K and V of one layer's block
    n = a.tokens // a.block_size
    gpu_blocks = 2 * n + 16
    block_bytes = a.layers * page
    pinned = dev.startswith("cuda")
    # The same bytes as one contiguous buffer on each side, for the single-copy baseline.
    flat_dev = torch.randint(-128, 128, (n * block_bytes,), dtype=torch.int8, device=dev)
    flat_host = torch.empty(n * block_bytes, dtype=torch.int8, pin_memory=pinned)
    rows = []
    for layout in a.layouts.split(","):
        views = kv_views(torch, dev, layout, a.layers, gpu_blocks, page)
        opts = OffloadOptions(host_blocks=n)
        w = KvferryOffloadingWorker(views, a.block_size, opts, {"format": FORMAT, "bench": 1},
                                    rank=0, engine_id="bench")
        host = KvferrySpecEntries(list(range(n)), [-1] * n, list(range(n)))
        for order in ("in-order", "shuffled"):
            rng = np.random.default_rng(7)
            ids = np.arange(gpu_blocks)
            if order == "shuffled":
                rng.shuffle(ids)
            src, dst = ids[:n], ids[n:2 * n]
            st, ld, cd2h, ch2d, sub = [], [], [], [], []
            job = 0
            for _ in range(a.reps + 1):  # the first rep warms up (not counted)
                sync(torch, dev)
                job += 1
                t, ts = run_job(w, job, lambda: w.submit_store(job, src, host))
                st.append(t)
                cd2h.append(copy_once(torch, dev, flat_host, flat_dev))
                job += 1
                t, tl = run_job(w, job, lambda: w.submit_load(job, host, dst))
                ld.append(t)
                ch2d.append(copy_once(torch, dev, flat_dev, flat_host))
                sub += [ts, tl]
            sync(torch, dev)
            s_src, s_dst = torch.as_tensor(src, device=dev), torch.as_tensor(dst, device=dev)
            same = all(bool(torch.equal(v.index_select(0, s_src), v.index_select(0, s_dst)))
                       for v in views)
            p50 = lambda xs: statistics.median(xs[1:])  # noqa: E731
            gb = n * block_bytes / 1e9
            row = {"layout": layout, "order": order, "blocks": n, "bytes": n * block_bytes,
                   "store_s": p50(st), "load_s": p50(ld), "copy_d2h_s": p50(cd2h),
                   "copy_h2d_s": p50(ch2d), "verified": same,
                   "submit_p50_us": statistics.median(sub[2:]) * 1e6,
                   "submit_max_us": max(sub[2:]) * 1e6}
            row.update(store_gbps=gb / row["store_s"], load_gbps=gb / row["load_s"],
                       copy_d2h_gbps=gb / row["copy_d2h_s"], copy_h2d_gbps=gb / row["copy_h2d_s"])
            row.update(store_ratio=row["store_gbps"] / row["copy_d2h_gbps"],
                       load_ratio=row["load_gbps"] / row["copy_h2d_gbps"])
            rows.append(row)
        w.shutdown()
        del views
    return {"mode": "worker", "device": dev,
            "gpu": torch.cuda.get_device_name() if pinned else "cpu",
            "shape": {"layers": a.layers, "kv_heads": a.kv_heads, "head_dim": a.head_dim,
                      "dtype": a.dtype, "block_size": a.block_size, "page_bytes": page,
                      "tokens": a.tokens},
            "reps": a.reps, "rows": rows}


def print_worker(r: dict) -> None:
    s = r["shape"]
    print(f"offload_bench worker on {r['gpu']} ({r['device']}): {s['layers']} layers x "
          f"{s['kv_heads']} KV heads x {s['head_dim']} {s['dtype']}, block {s['block_size']} "
          f"tokens ({s['page_bytes']} B per layer page), jobs of {s['tokens']} tokens; "
          f"median of {r['reps']} reps; baseline: one torch copy of the same bytes, same run")
    print(f"{'layout':8} {'order':>8} {'MiB':>6} {'store GB/s':>10} {'copy d2h':>9} "
          f"{'ratio':>6} {'load GB/s':>10} {'copy h2d':>9} {'ratio':>6} "
          f"{'submit us p50/max':>17}  verified")
    for x in r["rows"]:
        print(f"{x['layout']:8} {x['order']:>8} {x['bytes'] / 2**20:6.0f} "
              f"{x['store_gbps']:10.1f} {x['copy_d2h_gbps']:9.1f} {x['store_ratio']:6.2f} "
              f"{x['load_gbps']:10.1f} {x['copy_h2d_gbps']:9.1f} {x['load_ratio']:6.2f} "
              f"{x['submit_p50_us']:8.0f}/{x['submit_max_us']:<8.0f}  "
              f"{'yes' if x['verified'] else 'NO'}")


# ---- trace --------------------------------------------------------------------------------------

BLOCK = 32
SESSIONS, TURNS, MAX_SEQS = 16, 6, 4
SYSTEM, FIRST_USER, USER, MAX_TOKENS = 64, 96, 40, 16
GPU_BLOCKS = 40  # vLLM's KV cache: 1280 tokens; the conversations reach 16 x 15 blocks
HOST_BLOCKS, FILE_SLOTS = 16, 256


def user_messages() -> list[list[list[int]]]:
    """[session][turn] -> the user message's tokens (the system prompt is sessions' common
    start, the first user message a per-session document)."""
    rng = random.Random(24)
    tok = lambda k: [rng.randrange(10, 2000) for _ in range(k)]  # noqa: E731
    system = tok(SYSTEM)
    return [[system + tok(FIRST_USER)] + [tok(USER) for _ in range(TURNS - 1)]
            for _ in range(SESSIONS)]


def engine_kv(mode: str, files: str) -> dict | None:
    if mode == "none":
        return None
    from offload_check import kvferry_kv

    return kvferry_kv(files, HOST_BLOCKS, FILE_SLOTS)


def serve(model: str, mode: str, files: str, log: str, conn) -> None:
    """One engine in its own process: answers each round's prompts sent over `conn`."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    from offload_check import engine_env

    engine_env()
    from vllm import LLM, SamplingParams

    kw = dict(model=model, skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
              block_size=BLOCK, max_model_len=512, max_num_batched_tokens=512,
              max_num_seqs=MAX_SEQS, seed=0, num_gpu_blocks_override=GPU_BLOCKS,
              disable_log_stats=False)
    kv = engine_kv(mode, files)
    if kv is not None:
        kw["kv_transfer_config"] = kv
    t0 = time.perf_counter()
    llm = LLM(**kw)
    conn.send({"startup_s": time.perf_counter() - t0})
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                        detokenize=False)
    while True:
        prompts = conn.recv()
        if prompts is None:
            break
        t0, c0 = time.perf_counter(), time.process_time()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        conn.send({"wall_s": wall, "cpu_s": cpu, "outputs": [list(o.outputs[0].token_ids) for o in outs],
                   "cached": [o.num_cached_tokens or 0 for o in outs],
                   "ttft": [o.metrics.first_token_latency if o.metrics else None for o in outs]})
    stats = {}
    if kv is not None:
        core = llm.llm_engine.engine_core.engine_core.scheduler.connector
        stats = dict(vars(core.connector_scheduler.manager.core.stats))
    conn.send({"manager": stats})
    conn.close()
    os._exit(0)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def bench_trace(a) -> dict:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    files = os.path.join(a.work, "files")
    os.makedirs(files, exist_ok=True)
    modes = ("none", "kvferry")
    procs, conns = {}, {}
    for m in modes:
        parent, child = ctx.Pipe()
        procs[m] = ctx.Process(target=serve, args=(a.model, m, files,
                                                    os.path.join(a.work, f"{m}.log"), child))
        procs[m].start()
        conns[m] = parent
    res = {m: {"startup_s": conns[m].recv()["startup_s"], "rounds": []} for m in modes}
    msgs = user_messages()
    history = {m: [[] for _ in range(SESSIONS)] for m in modes}  # conversation so far
    t_start = time.perf_counter()
    for turn in range(TURNS):
        order = modes if turn % 2 == 0 else modes[::-1]  # interleaved: neither always goes first
        for m in order:
            prompts = [history[m][s] + msgs[s][turn] for s in range(SESSIONS)]
            conns[m].send(prompts)
            r = conns[m].recv()
            r["prompt_tokens"] = [len(p) for p in prompts]
            res[m]["rounds"].append(r)
            for s in range(SESSIONS):
                history[m][s] = prompts[s] + r["outputs"][s]
    for m in modes:
        conns[m].send(None)
        res[m]["manager"] = conns[m].recv()["manager"]
        procs[m].join(60)
    out = {"mode": "trace", "sessions": SESSIONS, "turns": TURNS, "max_seqs": MAX_SEQS,
           "block": BLOCK, "gpu_blocks": GPU_BLOCKS, "host_blocks": HOST_BLOCKS,
           "file_slots": FILE_SLOTS, "max_tokens": MAX_TOKENS, "wall_s":
           time.perf_counter() - t_start, "engines": {}}
    for m in modes:
        rounds = res[m]["rounds"]
        prompt = sum(sum(r["prompt_tokens"]) for r in rounds)
        computed = sum(p - c for r in rounds for p, c in zip(r["prompt_tokens"], r["cached"]))
        ttft = [t for r in rounds for t in r["ttft"] if t is not None]
        later = [t for r in rounds[1:] for t in r["ttft"] if t is not None]
        gen_s = sum(r["wall_s"] for r in rounds)
        cpu_s = sum(r["cpu_s"] for r in rounds)
        generated = sum(len(o) for r in rounds for o in r["outputs"])
        out["engines"][m] = {
            "startup_s": res[m]["startup_s"], "prompt_tokens": prompt, "computed": computed,
            "hit_rate": 1 - computed / prompt, "ttft_p50_s": pct(ttft, 0.5),
            "ttft_p99_s": pct(ttft, 0.99), "ttft_p50_later_s": pct(later, 0.5),
            "ttft_p99_later_s": pct(later, 0.99), "generate_s": gen_s,
            "tokens_per_s": (prompt + generated) / gen_s, "requests_per_s": len(ttft) / gen_s,
            "cpu_s": cpu_s, "tokens_per_cpu_s": (prompt + generated) / cpu_s,
            "round_wall_s": [r["wall_s"] for r in rounds],
            "round_cpu_s": [r["cpu_s"] for r in rounds], "manager": res[m]["manager"],
            "outputs": [r["outputs"] for r in rounds]}
    base = out["engines"]["none"]["outputs"]
    got = out["engines"]["kvferry"]["outputs"]
    out["identical"] = sum(g == b for rg, rb in zip(got, base) for g, b in zip(rg, rb))
    out["requests"] = SESSIONS * TURNS
    return out


def print_trace(r: dict) -> None:
    print(f"offload_bench trace: {r['sessions']} sessions x {r['turns']} turns (shared system "
          f"prompt {SYSTEM} tokens, first message {FIRST_USER}, then {USER} per turn, "
          f"{r['max_tokens']} generated), {r['max_seqs']} sequences at a time; vLLM KV cache "
          f"{r['gpu_blocks']} blocks of {r['block']}; kvferry host {r['host_blocks']} blocks + "
          f"{r['file_slots']} file slots; rounds interleaved; {r['wall_s']:.1f} s")
    print(f"{'engine':8} {'computed':>9} {'hit rate':>9} {'TTFT p50':>9} {'p99':>9} "
          f"{'p50 t>1':>9} {'p99 t>1':>9} {'tok/s':>8} {'req/s':>6} {'tok/CPU-s':>9}")
    for m, e in r["engines"].items():
        print(f"{m:8} {e['computed']:9d} {e['hit_rate']:9.3f} {e['ttft_p50_s'] * 1e3:7.1f}ms "
              f"{e['ttft_p99_s'] * 1e3:7.1f}ms {e['ttft_p50_later_s'] * 1e3:7.1f}ms "
              f"{e['ttft_p99_later_s'] * 1e3:7.1f}ms {e['tokens_per_s']:8.0f} "
              f"{e['requests_per_s']:6.1f} {e['tokens_per_cpu_s']:9.0f}")
    k = r["engines"]["kvferry"]["manager"]
    if k:
        print(f"kvferry: {k['stored']} blocks stored; loaded {k['loaded_host']} from host, "
              f"{k['loaded_file']} from files ({k['promoted']} promoted)")
    print(f"outputs identical to no offloading: {r['identical']}/{r['requests']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    w = sub.add_parser("worker", help="KvferryOffloadingWorker against one copy (no vLLM)")
    w.add_argument("--device", default="cuda")
    w.add_argument("--layers", type=int, default=32)  # Llama-3-8B
    w.add_argument("--kv-heads", type=int, default=8)
    w.add_argument("--head-dim", type=int, default=128)
    w.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    w.add_argument("--block-size", type=int, default=16)
    w.add_argument("--tokens", type=int, default=4096, help="tokens per store/load job")
    w.add_argument("--layouts", default="compact,packed")
    w.add_argument("--reps", type=int, default=5)
    w.add_argument("--json", metavar="PATH", help="also write the result as JSON to PATH")
    t = sub.add_parser("trace", help="multi-turn trace against vLLM: none vs kvferry")
    t.add_argument("model")
    t.add_argument("work")
    t.add_argument("--json", metavar="PATH", help="also write the result as JSON to PATH")
    a = ap.parse_args()
    if a.mode == "worker":
        r = bench_worker(a)
        print_worker(r)
        ok = all(x["verified"] for x in r["rows"])
    else:
        r = bench_trace(a)
        print_trace(r)
        for e in r["engines"].values():
            e.pop("outputs")
        ok = r["identical"] == r["requests"]
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
