#!/usr/bin/env python3
# Mooncake Transfer Engine as a cross-host benchmark peer: the work of kvferry's cross-host
# benchmark (one request = `--blocks-per-request` blocks of `--block-bytes`, 128 x 4 MiB = one
# Llama-3-8B request of 4096 tokens, `--concurrency` requests in flight, `--warmup` untimed
# requests first) moved by Mooncake's TCP transport between two processes that may sit in
# different hosts or network namespaces. Not run by CI; a harness starts the target, waits for
# its READY line, then starts the initiator (both typically under `ip netns exec`). The same
# contract as scripts/peers/nixl.py (side-channel framing and data pattern follow it).
#
# Mooncake comes from PyPI into a throw-away venv. The plain `mooncake-transfer-engine` wheel
# links libcudart.so.12 and libcuda.so.1 and cannot even be imported on a machine without a CUDA
# driver; its `-non-cuda` build is the same engine without CUDA:
#   python3 -m venv ~/.cache/kvferry/mooncake-venv
#   ~/.cache/kvferry/mooncake-venv/bin/pip install \
#       mooncake-transfer-engine-non-cuda==0.3.13.post1 numpy
#   PY=~/.cache/kvferry/mooncake-venv/bin/python
#   target:    $PY scripts/peers/mooncake.py --role target --bind IP --port PORT [common options]
#   initiator: $PY scripts/peers/mooncake.py --role initiator --peer IP:PORT --bind IP [common]
#   common:    --block-bytes 4194304 --blocks-per-request 128 --requests 8 --warmup 1
#              --concurrency 2 --timeout 120
#
# - Engine: TransferEngine.initialize(--bind, "P2PHANDSHAKE", "tcp", "") on both sides: no etcd
#   or metadata server; a peer's "session id" is "IP:RPC_PORT" (the engine's handshake listener,
#   get_rpc_port()), and the initiator fetches the target's segment (its registered buffers and
#   TCP data port) from it on the first transfer. The protocol argument of initialize() only
#   picks the Python binding's allocator: which transport is installed is decided by topology
#   discovery (RDMA when an HCA is found), so MC_FORCE_TCP=1 is put into the environment before
#   the engine starts to hold it to TCP. MC_LOG_LEVEL defaults to WARNING here (the engine logs
#   a line per completed batch at INFO). Any other MC_* variable the caller sets passes through
#   (e.g. MC_TCP_ENABLE_CONNECTION_POOL=1; it is named in the result's detail when set).
# - Addresses: the engine is given --bind as its host name, so the target's session id and data
#   endpoint carry --bind and the initiator connects only to the target's --bind. (Mooncake binds
#   its own listeners, handshake and data, to all addresses (0.0.0.0, ::) on random ports in
#   15000-17000; it has no option for that in P2P mode. Its outgoing connections do not bind a
#   source address: within a namespace holding one address that is --bind.)
# - Side channel: one small TCP connection between the two given IPs (the initiator binds its end
#   to --bind). The initiator sends its parameters; the target checks they match its own and
#   answers with its session id, the address and length of its registered pool. At the end the
#   initiator says "done" and the target answers with its verification result.
# - Memory: both sides allocate blocks_per_request * concurrency blocks (numpy, CPU memory), page
#   them in and register them (register_memory) before timing. Request r (warm-up requests
#   counted first) uses slot r % concurrency on both sides, and a slot is never reused while a
#   request on it is in flight. The initiator fills slot s block b with a pattern keyed on (s, b)
#   before timing; just before posting request r it stamps the first and last 8 bytes of each of
#   the slot's blocks with (r, b) (two strided numpy stores, inside the clock, microseconds), so
#   the bytes differ per (request, block) and the target can tell which request last wrote each
#   block, and that the whole block (both ends, and the keyed middle) arrived.
# - Transfers: one WRITE per request, one descriptor per block, descriptor lists prepared before
#   timing: batch_transfer_async_write (one batch per request; the fastest API the Python binding
#   has: batched, asynchronous, several batches in flight), completion by
#   get_batch_transfer_status([batch]) on the oldest request in flight. That call blocks (it
#   spins, GIL released) until the batch completes or fails, or after MC_TRANSFER_TIMEOUT
#   (30 s) + 1 ns per byte. A request's time is its post to the return of that wait; a request
#   that finished before an older one is seen when the older one is. The engine's TCP transport
#   (wire protocol v2) completes a WRITE only once the target acknowledged the data applied to
#   its memory, so a completed request is in the target's pool. (The per-block alternative,
#   transfer_submit_write + transfer_check_status polled with sleeps, spins nowhere but was no
#   faster here.)
# - What the TCP transport does (0.3.13.post1, seen with ss and /proc): every descriptor is sent
#   as a header plus 64 KiB socket writes (MC_TCP_SLICE_SIZE) over 4 long-lived TCP connections
#   per peer pair ("lanes", MC_TCP_LANES_PER_PEER), all driven by one asio thread per process;
#   the target reads straight into the registered pool. With the initiator's spinning waiter
#   that is three busy threads, which a 2-core machine feels.
# - Output: the target prints READY (flushed) once it listens and is registered; the initiator
#   prints exactly one JSON line (see the end of run_initiator). Library noise is sent to stderr
#   (fd 1 is pointed at stderr; the result lines go to the saved original stdout).
# - Every wait has a deadline (--timeout, 120 s overall); a faulthandler watchdog ends the process
#   5 s past it if a Mooncake call itself blocks. A dead target fails the transfers at once
#   (connection reset); a hung one is noticed by the engine's 30 s transfer timeout or the
#   watchdog. Both roles end with os._exit(rc) after flushing, so that no engine thread can hold
#   the process at interpreter exit.
import argparse
import faulthandler
import importlib.metadata
import json
import os
import select
import socket
import struct
import sys
import time

# This file is named mooncake.py: run as a script, its own folder is sys.path[0] and
# `import mooncake` would find this file instead of the package. Drop that entry.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

MAGIC = "kvferry-mooncake-peer/1"
DISTS = ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine",
         "mooncake-transfer-engine-cuda13")
API = "batch_transfer_async_write + get_batch_transfer_status"


def log(msg):
    sys.stderr.write(f"mooncake-peer: {msg}\n")
    sys.stderr.flush()


class Deadline:
    def __init__(self, seconds):
        self.end = time.monotonic() + seconds

    def left(self, what):
        s = self.end - time.monotonic()
        if s <= 0:
            raise TimeoutError(f"timed out waiting for {what}")
        return s


# ---- the engine -------------------------------------------------------------------------------

def mooncake_version():
    for dist in DISTS:
        try:
            return f"{importlib.metadata.version(dist)} ({dist})"
        except importlib.metadata.PackageNotFoundError:
            pass
    return "?"


def start_engine(bind):
    """A TransferEngine on TCP, P2P handshake metadata, host name --bind; (engine, session id)."""
    os.environ["MC_FORCE_TCP"] = "1"  # read by the engine at initialize(), see the header
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    from mooncake.engine import TransferEngine
    te = TransferEngine()
    if te.initialize(bind, "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError(f"TransferEngine.initialize({bind!r}, P2PHANDSHAKE, tcp) failed")
    return te, f"{bind}:{te.get_rpc_port()}"


# ---- side channel: frames of a JSON header (as nixl.py, without the binary part) --------------

def send_msg(sock, obj):
    head = json.dumps(obj).encode()
    sock.sendall(struct.pack(">I", len(head)) + head)


def recv_exact(sock, n, dl, what):
    buf = bytearray()
    while len(buf) < n:
        sock.settimeout(dl.left(what))
        try:
            chunk = sock.recv(n - len(buf))
        except socket.timeout:
            raise TimeoutError(f"timed out waiting for {what}") from None
        if not chunk:
            raise ConnectionError(f"peer closed the side channel while waiting for {what}")
        buf += chunk
    return bytes(buf)


def recv_msg(sock, dl, what):
    (hl,) = struct.unpack(">I", recv_exact(sock, 4, dl, what))
    if hl > 1 << 20:
        raise ConnectionError(f"malformed side-channel frame while waiting for {what}")
    obj = json.loads(recv_exact(sock, hl, dl, what))
    if obj.get("error"):
        raise RuntimeError(f"peer failed: {obj['error']}")
    return obj


# ---- the data ---------------------------------------------------------------------------------

def params(a):
    return {"block_bytes": a.block_bytes, "blocks_per_request": a.blocks_per_request,
            "requests": a.requests, "warmup": a.warmup, "concurrency": a.concurrency}


class Pattern:
    """Request r's block b on slot s, uint64-wise: words 1..n-2 hold base ^ key(s, b) (unique per
    slot, block and offset, written once before timing); word 0 holds stamp(r, b) and word n-1
    its complement (written per request)."""

    FILL = 0xA5A5A5A5A5A5A5A5  # the target's pool before any request

    def __init__(self, np, block_bytes, blocks):
        self.np = np
        n = block_bytes // 8
        self.base = np.arange(1, n + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        self.blocks = np.arange(blocks, dtype=np.uint64)

    def key(self, s, b):
        x = (s << 32 | b) * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB
        return self.np.uint64(x & 0xFFFFFFFFFFFFFFFF)

    def stamps(self, r):
        """stamp(r, b) of every block b: (r + 1) in the high half, b in the low half."""
        return self.blocks | self.np.uint64((r + 1) << 32)

    def fill(self, slot, s):
        """slot: (blocks, words) view; the keyed part of every block (ends stamped later)."""
        for b in range(slot.shape[0]):
            self.np.bitwise_xor(self.base, self.key(s, b), out=slot[b])

    def stamp(self, slot, r):
        st = self.stamps(r)
        slot[:, 0] = st
        slot[:, -1] = ~st

    def bad_blocks(self, slot, s, r):
        """Blocks of slot s that differ from request r's (r None: from the initial fill)."""
        np = self.np
        if r is None:
            return [b for b in range(slot.shape[0]) if not (slot[b] == self.FILL).all()]
        st, want, bad = self.stamps(r), np.empty_like(self.base), []
        for b in range(slot.shape[0]):
            np.bitwise_xor(self.base, self.key(s, b), out=want)
            v = slot[b]
            if not (v[0] == st[b] and v[-1] == ~st[b]
                    and np.array_equal(v[1:-1], want[1:-1])):
                bad.append(b)
        return bad


def make_pool(np, a, te):
    """The registered pool as a (concurrency, blocks_per_request, words) uint64 array."""
    pool = np.empty((a.concurrency, a.blocks_per_request, a.block_bytes // 8), dtype=np.uint64)
    pool.fill(Pattern.FILL)  # paged in
    if te.register_memory(pool.ctypes.data, pool.nbytes) != 0:
        raise RuntimeError(f"register_memory of {pool.nbytes} bytes failed")
    return pool


def last_request(s, total, conc):
    """The last request (of 0..total-1) that used slot s, or None."""
    return None if s >= total else s + conc * ((total - 1 - s) // conc)


# ---- roles ------------------------------------------------------------------------------------

def run_target(a, out_fd, dl):
    import numpy as np
    te, session = start_engine(a.bind)
    pool = make_pool(np, a, te)
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsock.bind((a.bind, a.port))
    lsock.listen(1)
    log(f"target: session {session}, pool {pool.nbytes} bytes at {pool.ctypes.data:#x}")
    os.write(out_fd, b"READY\n")
    lsock.settimeout(dl.left("the initiator to connect"))
    try:
        sock, addr = lsock.accept()
    except socket.timeout:
        raise TimeoutError("timed out waiting for the initiator to connect") from None
    lsock.close()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    log(f"initiator connected from {addr[0]}:{addr[1]}")
    try:
        hello = recv_msg(sock, dl, "the initiator's hello")
        if hello.get("magic") != MAGIC:
            raise RuntimeError(f"unexpected hello {hello!r}")
        if hello["params"] != params(a):
            raise RuntimeError(f"parameters differ: initiator {hello['params']}, "
                               f"target {params(a)}")
        send_msg(sock, {"magic": MAGIC, "session": session, "base": pool.ctypes.data,
                        "nbytes": pool.nbytes, "version": mooncake_version()})
        # The engine serves the WRITEs on its own threads; this one waits for the end.
        done = recv_msg(sock, dl, "the initiator's done")
        if done.get("op") != "done":
            raise RuntimeError(f"unexpected message {done!r}")
        total = a.warmup + a.requests
        if done.get("requests") != total:
            raise RuntimeError(f"initiator ran {done.get('requests')} requests, expected {total}")
        pat = Pattern(np, a.block_bytes, a.blocks_per_request)
        bad = [(s, b) for s in range(a.concurrency)
               for b in pat.bad_blocks(pool[s], s, last_request(s, total, a.concurrency))]
        verified = not bad
        why = "" if verified else f"{len(bad)} blocks differ, first (slot, block) {bad[:4]}"
        if not verified:
            log(f"verification failed: {why}")
        send_msg(sock, {"op": "result", "verified": verified, "why": why})
        # Let the initiator read the answer (and close) before this end goes.
        sock.settimeout(min(5.0, max(0.1, dl.end - time.monotonic())))
        try:
            sock.recv(1)
        except OSError:
            pass
    except Exception as e:
        try:
            send_msg(sock, {"error": f"target: {e}"})
        except OSError:
            pass
        raise
    finally:
        sock.close()
    return 0


def run_initiator(a, out_fd, dl):
    import numpy as np
    te, session = start_engine(a.bind)
    pool = make_pool(np, a, te)
    pat = Pattern(np, a.block_bytes, a.blocks_per_request)
    for s in range(a.concurrency):
        pat.fill(pool[s], s)

    host, port = a.peer.rsplit(":", 1)
    sock = None
    while sock is None:  # the target may still be starting: retry until the deadline
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.bind((a.bind, 0))
        s.settimeout(min(5.0, dl.left(f"the target at {a.peer}")))
        try:
            s.connect((host, int(port)))
            sock = s
        except OSError as e:
            s.close()
            dl.left(f"the target at {a.peer} ({e})")
            time.sleep(0.2)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    send_msg(sock, {"magic": MAGIC, "session": session, "params": params(a)})
    info = recv_msg(sock, dl, "the target's session")
    if info.get("magic") != MAGIC:
        raise RuntimeError(f"unexpected answer {info!r}")
    if info["nbytes"] != pool.nbytes:
        raise RuntimeError(f"target pool has {info['nbytes']} bytes, expected {pool.nbytes}")
    peer = info["session"]
    if peer.rsplit(":", 1)[0] != host:
        raise RuntimeError(f"target's session {peer} is not on {host}")
    log(f"initiator: session {session}, target session {peer} ({info['version']})")

    # Descriptor lists per slot, one descriptor per block, built before timing.
    slot_bytes = a.block_bytes * a.blocks_per_request
    lens = [a.block_bytes] * a.blocks_per_request
    lists = []
    for s in range(a.concurrency):
        lists.append(([pool.ctypes.data + s * slot_bytes + b * a.block_bytes
                       for b in range(a.blocks_per_request)],
                      [info["base"] + s * slot_bytes + b * a.block_bytes
                       for b in range(a.blocks_per_request)]))

    def peer_gone():  # the side channel says something (EOF or an error) mid-run
        r, _, _ = select.select([sock], [], [], 0)
        if r:
            try:
                recv_msg(sock, dl, "-")
            except Exception as e:
                raise RuntimeError(f"target went away mid-run: {e}") from None
            raise RuntimeError("unexpected side-channel message mid-run")

    def run(first, count):
        """Requests first..first+count-1, `concurrency` in flight; [(t0, t1)] per request.
        With at most `concurrency` in flight and completions taken oldest first, request r's
        slot (r % concurrency) was last used by r - concurrency, which has completed."""
        times, inflight, nxt = [], [], first
        while nxt < first + count or inflight:
            while nxt < first + count and len(inflight) < a.concurrency:
                s = nxt % a.concurrency
                srcs, dsts = lists[s]
                t0 = time.perf_counter()
                pat.stamp(pool[s], nxt)
                batch = te.batch_transfer_async_write(peer, srcs, dsts, lens)
                if batch == 0:
                    raise RuntimeError(f"batch_transfer_async_write of request {nxt} failed")
                inflight.append((nxt, t0, batch))
                nxt += 1
            r, t0, batch = inflight.pop(0)
            if te.get_batch_transfer_status([batch]) != 0:
                raise RuntimeError(f"request {r} failed or timed out")
            times.append((t0, time.perf_counter()))
            dl.left(f"transfers (request {r} done, next {nxt})")
            peer_gone()
        return times

    run(0, a.warmup)  # untimed; the timed requests start once these ended
    timed = run(a.warmup, a.requests)
    send_msg(sock, {"op": "done", "requests": a.warmup + a.requests})
    res = recv_msg(sock, dl, "the target's verification")
    sock.close()
    if res.get("op") != "result":
        raise RuntimeError(f"unexpected answer {res!r}")

    req_bytes = a.block_bytes * a.blocks_per_request
    wall = max(t1 for _, t1 in timed) - min(t0 for t0, _ in timed)
    knobs = "".join(f", {k}={v}" for k, v in sorted(os.environ.items())
                    if k.startswith("MC_") and k not in ("MC_FORCE_TCP", "MC_LOG_LEVEL"))
    detail = (f"mooncake {mooncake_version()}, protocol tcp, {API}, P2PHANDSHAKE, "
              f"MC_FORCE_TCP=1{knobs}")
    doc = {"name": "mooncake-tcp", "bytes_per_request": req_bytes, "requests": a.requests,
           "request_s": [t1 - t0 for t0, t1 in timed], "wall_s": wall,
           "gbps": a.requests * req_bytes / wall / 1e9, "verified": bool(res["verified"]),
           "detail": detail}
    os.write(out_fd, (json.dumps(doc) + "\n").encode())
    if not res["verified"]:
        log(f"target's verification failed: {res.get('why')}")
        return 1
    return 0


def main():
    ap = argparse.ArgumentParser(description="Mooncake Transfer Engine (TCP) cross-host "
                                             "benchmark peer")
    ap.add_argument("--role", choices=["target", "initiator"], required=True)
    ap.add_argument("--bind", required=True, help="this side's IPv4 address")
    ap.add_argument("--port", type=int, help="target: side-channel port")
    ap.add_argument("--peer", help="initiator: the target's side channel, IP:PORT")
    ap.add_argument("--block-bytes", type=int, default=4194304)
    ap.add_argument("--blocks-per-request", type=int, default=128)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=120.0, help="overall deadline, seconds")
    a = ap.parse_args()
    if a.role == "target" and a.port is None:
        ap.error("--role target needs --port")
    if a.role == "initiator" and (not a.peer or ":" not in a.peer):
        ap.error("--role initiator needs --peer IP:PORT")
    if a.block_bytes < 16 or a.block_bytes % 8:
        ap.error("--block-bytes must be a multiple of 8, at least 16")
    if a.blocks_per_request < 1 or a.requests < 1 or a.warmup < 0 or a.concurrency < 1:
        ap.error("--blocks-per-request, --requests, --concurrency >= 1, --warmup >= 0")

    # The result lines go to the original stdout; anything else (the engine's logs) to stderr.
    sys.stdout.flush()
    out_fd = os.dup(1)
    os.dup2(2, 1)
    dl = Deadline(a.timeout)
    faulthandler.dump_traceback_later(a.timeout + 5, exit=True)  # a Mooncake call that blocks
    rc = 1
    try:
        rc = (run_target if a.role == "target" else run_initiator)(a, out_fd, dl)
    except Exception as e:
        log(f"{a.role} failed: {type(e).__name__}: {e}")
        rc = 1
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(rc)  # engine threads (listeners, io loop) must not hold the process at exit


if __name__ == "__main__":
    main()
