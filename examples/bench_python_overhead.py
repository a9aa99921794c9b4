"""What Python adds to a transfer: fetch-and-wait of one request from Python against the same
loop in C++ (kvferry._kvferry._fetch_wait_loop), same sides, same process, same run.

Each iteration: the context side marks a request ready (outside the timing), then the timed part
is GenerationSide.fetch(handle, blocks) followed by poll(at_least=1) until the request completes.
Rounds alternate C++ and Python to share the machine's noise. Transport: inproc (so the number is
the binding's cost, not the network's). Prints medians and the difference; --json for machines.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import kvferry
from kvferry import _kvferry


def python_loop(ctx, gen, ctx_blocks, gen_blocks, tokens, iterations, first_id, timeout):
    out = []
    for i in range(iterations):
        rid = first_id + i
        handle = ctx.mark_ready(rid, ctx_blocks, tokens)
        t0 = time.perf_counter()
        gen.fetch(handle, gen_blocks)
        st = []
        while not st:
            st = gen.poll(at_least=1, timeout=timeout)
        t1 = time.perf_counter()
        if not st[0].ok:
            raise RuntimeError(f"request {rid}: {st[0]}")
        ctx.poll(at_least=1, timeout=timeout)
        out.append(t1 - t0)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--iterations", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shape", choices=["llama3-8b", "tiny"], default="llama3-8b",
                    help="tiny (2 layers, 1 head of 64, 64 KiB per 128 tokens) shows the "
                         "binding's cost without milliseconds of memcpy noise around it")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    if args.shape == "tiny":
        shape = kvferry.KvShape(layers=2, kv_heads=1, head_dim=64, dtype="bf16",
                                tokens_per_block=32)
    else:
        shape = kvferry.KvShape(layers=32, kv_heads=8, head_dim=128, dtype="bf16",
                                tokens_per_block=32)
    nblocks = -(-args.tokens // shape.tokens_per_block)
    with kvferry.Device("cpu") as dev:
        fabric = kvferry.InProcFabric()
        src = kvferry.Pool.allocate(dev, shape, memory="host", blocks=nblocks)
        dst = kvferry.Pool.allocate(dev, shape, memory="host", blocks=nblocks)
        for p in (src, dst):  # touch the pages once
            for r in range(p.num_regions):
                p.region(r)[:] = 1
        with kvferry.ContextSide(dev, src, transport="inproc", fabric=fabric,
                                 instance_secret=b"overhead-bench!!") as ctx, \
                kvferry.GenerationSide(dev, dst, transport="inproc", fabric=fabric) as gen:
            ctx.set_instance_addresses([ctx.address])
            blocks = list(range(nblocks))
            cpp, py = [], []
            rid = 1
            # Warm-up of both paths.
            _kvferry._fetch_wait_loop(ctx, gen, blocks, blocks, args.tokens, 10, rid, 10.0)
            rid += 10
            python_loop(ctx, gen, blocks, blocks, args.tokens, 10, rid, 10.0)
            rid += 10
            for _ in range(args.rounds):
                cpp += _kvferry._fetch_wait_loop(ctx, gen, blocks, blocks, args.tokens,
                                                 args.iterations, rid, 10.0)
                rid += args.iterations
                py += python_loop(ctx, gen, blocks, blocks, args.tokens, args.iterations, rid,
                                  10.0)
                rid += args.iterations
    med_c, med_p = statistics.median(cpp), statistics.median(py)
    result = {
        "bench": "python_overhead", "transport": "inproc", "device": "cpu",
        "shape": args.shape, "tokens": args.tokens,
        "bytes_per_request": args.tokens * shape.bytes_per_token,
        "requests_each": len(cpp),
        "cpp_median_us": med_c * 1e6, "python_median_us": med_p * 1e6,
        "python_overhead_us": (med_p - med_c) * 1e6,
        "cpp_p90_us": sorted(cpp)[int(0.9 * len(cpp))] * 1e6,
        "python_p90_us": sorted(py)[int(0.9 * len(py))] * 1e6,
        "target_us": 20.0,
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"fetch-and-wait of a {args.tokens}-token request ({result['bytes_per_request']} "
              f"bytes, inproc, {len(cpp)} requests each)")
        print(f"  C++ loop (baseline) median {result['cpp_median_us']:8.1f} us   p90 "
              f"{result['cpp_p90_us']:8.1f} us")
        print(f"  Python loop         median {result['python_median_us']:8.1f} us   p90 "
              f"{result['python_p90_us']:8.1f} us")
        print(f"  Python overhead     {result['python_overhead_us']:+.1f} us (target: within 20)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
