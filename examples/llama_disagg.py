"""A real model, served disaggregated: prefill in one process, decode in another, the KV cache
moved between them by kvferry, and the tokens checked against the same model in one process.

The model is a small Llama (Hugging Face ``transformers``) built from a config with seeded random
weights: nothing is downloaded. Its KV cache is a ``transformers`` StaticCache whose per-layer K
and V tensors are torch tensors ``[B, S, H, D]`` (the vLLM/SGLang "NHD" order: token-major, heads
inside), seen by the model as ``[B, H, S, D]`` through a transpose, and wrapped by a kvferry pool
(``Pool.wrap``, layout 'per-layer-kv', zero copy). Batch row b's tokens are the pool blocks
``b * S / T ... (b + 1) * S / T - 1``, so a request's blocks are its row of the cache: kvferry
moves the model's own tensors, with no copy into a pool of its own. (transformers' default
allocation, ``[B, H, S, D]`` contiguous, is HND over the whole row: a custom layout kvferry can
wrap for tiering but not transfer, since handles name the layout rather than carry strides.)

    context process:    prefill each prompt (batch 1, its own row) -> first token,
                        ContextSide.mark_ready(blocks) -> handle (bytes), published with the
                        first token on the rendezvous (the router's part)
    generation process: GenerationSide.fetch(handle, blocks) for every prompt, poll until all
                        complete, then greedy-decode from the fetched cache
    this process:       the same model, prefill and decode in one process (the reference);
                        compares the tokens, prints prefill / transfer / decode times

With ``--gen-tp 2`` the generation instance has two ranks (two GenerationSides, each its own
transport endpoint and its own pool holding half the KV heads); kvferry splits every request
between them. A single process decodes here, so after the transfer it joins the halves into the
model's cache with one copy per layer (timed separately as "join").

Run: ``python examples/llama_disagg.py [--device cpu|cuda] [--gen-tp 1|2] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time

import torch

import kvferry

# ---- the model ------------------------------------------------------------------------------


def model_config(args):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 2,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.max_len,
        tie_word_embeddings=False,
    )


def build_model(args):
    from transformers import LlamaForCausalLM

    torch.manual_seed(args.seed)
    cfg = model_config(args)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg).to(args.device).eval()
    return model


def prompts(args):
    """Prompts of different lengths (seeded token ids)."""
    g = torch.Generator().manual_seed(args.seed + 1)
    lengths = [int(x) for x in args.prompt_lengths.split(",")]
    return [torch.randint(0, args.vocab, (n,), generator=g).tolist() for n in lengths]


def kv_shape(args, kv_heads=None):
    return kvferry.KvShape(layers=args.layers, kv_heads=kv_heads or args.kv_heads,
                           head_dim=args.hidden // args.heads, dtype="fp32",
                           tokens_per_block=args.tokens_per_block)


# ---- the KV cache: kvferry pool memory as the model's StaticCache tensors --------------------


class KvMemory:
    """The model's KV cache memory on one rank: per layer a K and a V torch tensor [B, S, H, D]
    (vLLM/SGLang's NHD order), allocated by torch and wrapped by one kvferry pool, zero copy.

    kvferry sees them as the 'per-layer-kv' layout (one region per (layer, kv),
    [block][token][head][dim]) with B * S / T blocks: block b * S / T + j holds tokens
    j * T .. (j + 1) * T - 1 of batch row b."""

    def __init__(self, dev, args, batch, rank=0, tp=1):
        shape = kv_shape(args)
        parallel = kvferry.ParallelConfig(tp=tp)
        self.batch, self.seq = batch, args.max_len
        self.tpb = args.tokens_per_block
        assert self.seq % self.tpb == 0
        self.blocks_per_row = self.seq // self.tpb
        heads = kvferry.slice_of(shape, parallel, rank).head_count
        dims = (batch, self.seq, heads, shape.head_dim)
        self.k = [torch.zeros(dims, dtype=torch.float32, device=args.device)
                  for _ in range(args.layers)]
        self.v = [torch.zeros(dims, dtype=torch.float32, device=args.device)
                  for _ in range(args.layers)]
        tensors = [t for layer in range(args.layers) for t in (self.k[layer], self.v[layer])]
        self.pool = kvferry.Pool.wrap(dev, shape, tensors, parallel, rank=rank,
                                      layout="per-layer-kv", blocks=batch * self.blocks_per_row)
        assert self.pool.wrapped

    def blocks(self, row, tokens):
        n = -(-tokens // self.tpb)
        return [row * self.blocks_per_row + i for i in range(n)]

    def close(self):
        self.pool.close()
        self.k, self.v = [], []


def cache_for_row(model, mem_k, mem_v, row, seen_tokens):
    """A StaticCache whose layers are row `row` of the given per-layer K/V tensors."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=mem_k[0].shape[1])
    for layer, lc in enumerate(cache.layers):
        k = mem_k[layer][row:row + 1].transpose(1, 2)  # [1, H, S, D] view, no copy
        v = mem_v[layer][row:row + 1].transpose(1, 2)
        lc.device = k.device
        lc.batch_size, lc.num_heads = 1, k.shape[1]
        lc.k_head_dim = lc.v_head_dim = k.shape[-1]
        lc.keys, lc.values = k, v
        lc.cumulative_length = torch.tensor(seen_tokens, dtype=torch.long, device=k.device)
        lc.is_initialized = True
    return cache


@torch.no_grad()
def prefill(model, cache, prompt, device):
    ids = torch.tensor([prompt], device=device)
    logits = model(input_ids=ids, cache=cache, use_cache=True).logits
    return int(logits[0, -1].argmax())


@torch.no_grad()
def decode(model, cache, first_token, steps, device):
    out = [first_token]
    for _ in range(steps - 1):
        ids = torch.tensor([[out[-1]]], device=device)
        logits = model(input_ids=ids, cache=cache, use_cache=True).logits
        out.append(int(logits[0, -1].argmax()))
    return out


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ---- the processes --------------------------------------------------------------------------


def context_process(args, rv_address, rv_key, results):
    torch.set_num_threads(1)
    model = build_model(args)
    ps = prompts(args)
    rv = kvferry.Rendezvous(rv_address, rv_key)
    secret = kvferry.random_key()
    rv.publish_instance_secret("ctx", 1, secret)  # what the other context ranks would fetch
    with kvferry.Device(args.kv_device) as dev:
        mem = KvMemory(dev, args, len(ps))
        ctx = kvferry.ContextSide(dev, mem.pool, transport=args.transport,
                                  instance_secret=secret, timeout=args.timeout)
        rv.publish_rank_address("ctx", 1, 0, ctx.address)
        ctx.set_instance_addresses(rv.gather_rank_addresses("ctx", 1, 1, timeout=args.timeout))
        requests = []
        t0 = time.perf_counter()
        for row, prompt in enumerate(ps):
            cache = cache_for_row(model, mem.k, mem.v, row, 0)
            first = prefill(model, cache, prompt, args.device)
            sync(args.device)
            rid = 1000 + row
            handle = ctx.mark_ready(rid, mem.blocks(row, len(prompt)), len(prompt))
            # The router's part: the handle, and what decode needs besides the cache.
            rv.publish_handle(rid, handle)
            rv.put(f"request/{rid}", json.dumps({"row": row, "first": first,
                                                  "tokens": len(prompt)}).encode())
            requests.append(rid)
        prefill_s = time.perf_counter() - t0
        rv.put("requests", json.dumps(requests).encode())
        done = []
        while len(done) < len(ps):
            got = ctx.poll(at_least=len(ps) - len(done), timeout=args.timeout)
            if not got:
                break
            done += got
        results.put({"who": "context", "prefill_s": prefill_s,
                     "ok": len(done) == len(ps) and all(s.ok for s in done),
                     "statuses": [repr(s) for s in done if not s.ok]})
        ctx.close()
        mem.close()


def generation_process(args, rv_address, rv_key, results):
    torch.set_num_threads(1)
    model = build_model(args)
    ps = prompts(args)
    rv = kvferry.Rendezvous(rv_address, rv_key)
    with kvferry.Device(args.kv_device) as dev:
        # One pool and side per generation rank; with one rank the pool is the model's cache.
        ranks = [KvMemory(dev, args, len(ps), rank=r, tp=args.gen_tp)
                 for r in range(args.gen_tp)]
        sides = [kvferry.GenerationSide(dev, m.pool, transport=args.transport, instance_id=2,
                                        timeout=args.timeout) for m in ranks]
        ids = json.loads(rv.get("requests", timeout=args.timeout * 4))
        requests = []
        for rid in ids:
            req = json.loads(rv.get(f"request/{rid}", timeout=args.timeout))
            req["handle"] = rv.fetch_handle(rid, timeout=args.timeout)
            requests.append(req)
        t0 = time.perf_counter()
        for req in requests:
            for m, side in zip(ranks, sides):
                side.fetch(req["handle"], m.blocks(req["row"], req["tokens"]))
        statuses = []
        for side in sides:
            got = []
            while len(got) < len(requests):
                more = side.poll(at_least=len(requests) - len(got), timeout=args.timeout)
                if not more:
                    break
                got += more
            statuses += got
        transfer_s = time.perf_counter() - t0
        failed = [repr(s) for s in statuses if not s.ok]
        if failed or len(statuses) != len(requests) * len(sides):
            results.put({"who": "generation", "ok": False, "statuses": failed})
            return
        nbytes = sum(s.bytes for s in statuses)
        slowest = max(statuses, key=lambda s: s.seconds)

        join_s = 0.0
        if len(ranks) == 1:
            k, v = ranks[0].k, ranks[0].v
        else:  # one decoding process needs every head: join the ranks' halves (one copy)
            t1 = time.perf_counter()
            k = [torch.cat([m.k[l] for m in ranks], dim=2) for l in range(args.layers)]
            v = [torch.cat([m.v[l] for m in ranks], dim=2) for l in range(args.layers)]
            sync(args.device)
            join_s = time.perf_counter() - t1

        t2 = time.perf_counter()
        tokens = []
        for req in requests:
            cache = cache_for_row(model, k, v, req["row"], req["tokens"])
            tokens.append(decode(model, cache, req["first"], args.new_tokens, args.device))
        sync(args.device)
        decode_s = time.perf_counter() - t2
        results.put({"who": "generation", "ok": True, "tokens": tokens, "transfer_s": transfer_s,
                     "join_s": join_s, "decode_s": decode_s, "bytes": nbytes,
                     "slowest_request_s": slowest.seconds,
                     "slowest_timeline": max(
                         (kvferry.metrics.slowest(side) for side in sides),
                         key=lambda t: t["end"] if t else -1),
                     "metrics": kvferry.metrics.snapshot(
                         {f"gen{r}": side for r, side in enumerate(sides)})})
        for s in sides:
            s.close()
        for m in ranks:
            m.close()


def reference(args):
    """The same model, prefill and decode in this process, same cache geometry."""
    torch.set_num_threads(1)
    model = build_model(args)
    ps = prompts(args)
    with kvferry.Device(args.kv_device) as dev:
        mem = KvMemory(dev, args, len(ps))
        t0 = time.perf_counter()
        firsts = []
        for row, prompt in enumerate(ps):
            firsts.append(prefill(model, cache_for_row(model, mem.k, mem.v, row, 0), prompt,
                                  args.device))
        sync(args.device)
        prefill_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        tokens = [decode(model, cache_for_row(model, mem.k, mem.v, row, len(p)), firsts[row],
                         args.new_tokens, args.device) for row, p in enumerate(ps)]
        sync(args.device)
        decode_s = time.perf_counter() - t1
        mem.close()
    # Hugging Face's own generate() (DynamicCache) on the same prompts, for information.
    hf = []
    with torch.no_grad():
        for p in ps:
            out = model.generate(torch.tensor([p], device=args.device), do_sample=False,
                                 max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                 pad_token_id=0)
            hf.append(out[0, len(p):].tolist())
    return {"tokens": tokens, "prefill_s": prefill_s, "decode_s": decode_s, "hf_generate": hf}


def bench_baseline(args, lengths):
    """`kvferry bench transfer` on the same shape, layout, split and transport with as many
    requests of the mean prompt length, in this run (the same-run baseline of the transfer)."""
    import subprocess

    if not args.bench or not os.path.exists(args.bench):
        return None
    mean = max(1, round(sum(lengths) / len(lengths)))
    cmd = [args.bench, "bench", "transfer", "--layers", str(args.layers),
           "--kv-heads", str(args.kv_heads), "--head-dim", str(args.hidden // args.heads),
           "--tokens-per-block", str(args.tokens_per_block), "--dtype", "fp32",
           "--ctx-layout", "per-layer-kv", "--gen-layout", "per-layer-kv", "--gen-tp", str(args.gen_tp),
           "--requests", str(len(lengths)), "--concurrency", str(len(lengths)),
           "--sweep", str(mean), "--transport", args.transport,
           "--device", "cuda" if args.device.startswith("cuda") else "cpu",
           "--no-verify", "--json"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout * 4)
        row = json.loads(out.stdout)["rows"][-1]  # one document (docs/output.md)
    except (subprocess.SubprocessError, ValueError, IndexError, KeyError) as e:
        return {"error": f"{' '.join(cmd)}: {e}"}
    return {"command": " ".join(cmd), "bytes": row.get("bytes"), "seconds": row.get("seconds"),
            "gbps": row.get("gbps"), "p50_ms": row.get("p50_ms")}


def jsonable(x):
    """Strict JSON: +Inf histogram bounds become the string "+Inf"."""
    if isinstance(x, float) and x == float("inf"):
        return "+Inf"
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", help="torch device: cpu or cuda[:N]")
    ap.add_argument("--transport", default="ucx", help="kvferry transport between the processes")
    ap.add_argument("--gen-tp", type=int, default=1, choices=[1, 2],
                    help="generation ranks, each holding kv_heads / gen_tp heads")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1000)
    ap.add_argument("--max-len", type=int, default=128, help="cache tokens per sequence (S)")
    ap.add_argument("--tokens-per-block", type=int, default=16)
    ap.add_argument("--prompt-lengths", default="37,5,64,100,17")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds, every wait")
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    default_bench = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "build",
                                 "kvferry")
    ap.add_argument("--bench", default=default_bench,
                    help="kvferry binary for the same-run `bench transfer` baseline ('' = none)")
    args = ap.parse_args(argv)
    args.kv_device = "cpu" if args.device == "cpu" else (
        args.device if ":" in args.device else "cuda:0")
    lengths = [int(x) for x in args.prompt_lengths.split(",")]
    if max(lengths) + args.new_tokens > args.max_len:
        ap.error(f"prompt {max(lengths)} + {args.new_tokens} new tokens > --max-len {args.max_len}")
    return args


def main(argv=None):
    args = parse(argv)
    ctx_mp = mp.get_context("spawn")
    results = ctx_mp.Queue()
    # The router: a rendezvous server carries addresses, the secret and handles between the
    # instances (TCP on loopback here; across hosts the same).
    rv_key = kvferry.random_key()
    server = kvferry.RendezvousServer("127.0.0.1", 0, rv_key)
    procs = [ctx_mp.Process(target=context_process, args=(args, server.address, rv_key, results)),
             ctx_mp.Process(target=generation_process,
                            args=(args, server.address, rv_key, results))]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in procs:
            r = results.get(timeout=args.timeout * 4)
            got[r["who"]] = r
    finally:
        for p in procs:
            p.join(timeout=args.timeout)
            if p.is_alive():
                p.kill()
        server.close()
    # The reference runs after the two processes, so that its times are not shared with them.
    ref = reference(args)
    ctx, gen = got.get("context", {}), got.get("generation", {})
    baseline = bench_baseline(args, [len(p) for p in prompts(args)])
    identical = gen.get("ok") and gen["tokens"] == ref["tokens"]
    report = {
        "model": {"layers": args.layers, "hidden": args.hidden, "heads": args.heads,
                  "kv_heads": args.kv_heads, "vocab": args.vocab, "dtype": "fp32",
                  "seed": args.seed},
        "device": args.device, "transport": args.transport, "gen_tp": args.gen_tp,
        "kv_layout": "per-layer-kv: the model's K and V torch tensors [B, S, H, D] per layer, "
                     "wrapped (zero copy); one block = tokens_per_block tokens of one row",
        "tokens_per_block": args.tokens_per_block,
        "prompt_lengths": [len(p) for p in prompts(args)], "new_tokens": args.new_tokens,
        "identical_tokens": bool(identical),
        "hf_generate_agrees": ref["hf_generate"] == ref["tokens"],
        "context_ok": ctx.get("ok", False), "generation_ok": gen.get("ok", False),
        "times_s": {"prefill": ctx.get("prefill_s"), "transfer": gen.get("transfer_s"),
                    "join": gen.get("join_s"), "decode": gen.get("decode_s"),
                    "reference_prefill": ref["prefill_s"], "reference_decode": ref["decode_s"]},
        "transfer_bytes": gen.get("bytes"),
        "slowest_request_s": gen.get("slowest_request_s"),
        "slowest_timeline": gen.get("slowest_timeline"),
        "generation_metrics": gen.get("metrics"),
        "bench_transfer_baseline": baseline,
        "kvferry_version": kvferry.version(),
    }
    if not identical:
        report["errors"] = ctx.get("statuses", []) + gen.get("statuses", [])
        report["tokens"] = {"disaggregated": gen.get("tokens"), "reference": ref["tokens"]}
    if args.json:
        print(json.dumps(jsonable(report), indent=2, allow_nan=False))
    else:
        t = report["times_s"]
        print(f"model: Llama {args.layers} layers, {args.heads} heads ({args.kv_heads} KV), "
              f"hidden {args.hidden}, random weights (seed {args.seed}), {args.device}")
        print(f"prompts {report['prompt_lengths']} tokens, {args.new_tokens} new tokens each, "
              f"greedy; generation TP {args.gen_tp}, transport {args.transport}")
        print(f"prefill (context process)      {t['prefill'] * 1e3:8.1f} ms   "
              f"(one process: {t['reference_prefill'] * 1e3:.1f} ms)")
        if gen.get("ok"):
            gbps = report["transfer_bytes"] / t["transfer"] / 1e9
            print(f"transfer (kvferry, all prompts) {t['transfer'] * 1e3:7.1f} ms   "
                  f"{report['transfer_bytes']} bytes, {gbps:.2f} GB/s, slowest request "
                  f"{report['slowest_request_s'] * 1e3:.1f} ms")
            if report["slowest_timeline"]:
                print("  slowest: " + kvferry.metrics.format_timeline(report["slowest_timeline"]))
            if baseline and "seconds" in baseline:
                print(f"  same run, kvferry bench transfer (same shape, layout, split, "
                      f"transport; {baseline['bytes']} bytes): {baseline['seconds'] * 1e3:.1f} ms,"
                      f" {baseline['gbps']:.2f} GB/s")
            if args.gen_tp > 1:
                print(f"join of the TP halves (copy)   {t['join'] * 1e3:8.1f} ms")
            print(f"decode (generation process)    {t['decode'] * 1e3:8.1f} ms   "
                  f"(one process: {t['reference_decode'] * 1e3:.1f} ms)")
        print("tokens identical to one-process generation:", "yes" if identical else "NO")
        print("(Hugging Face generate() with its DynamicCache agrees:",
              "yes)" if report["hf_generate_agrees"] else "no: different kernels' rounding)")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
