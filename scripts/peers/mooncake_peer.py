#!/usr/bin/env python3
# Mooncake Transfer Engine as a cross-host benchmark peer: the work of kvferry's cross-host
# benchmark (one request = `--blocks-per-request` blocks of `--block-bytes`, 128 x 4 MiB = one
# Llama-3-8B request of 4096 tokens, `--concurrency` requests in flight, `--warmup` untimed
# requests first) moved by Mooncake's TCP transport between two processes that may sit in
# different hosts or network namespaces. Not run by CI; a harness starts the target, waits for
# its READY line, then starts the initiator (both typically under `ip netns exec`). The same
# contract as scripts/peers/nixl_peer.py (side-channel framing and data pattern follow it; what
# the two share is in scripts/peers/peer_common.py).
#
# Mooncake comes from PyPI into a throw-away venv. The plain `mooncake-transfer-engine` wheel
# links libcudart.so.12 and libcuda.so.1 and cannot even be imported on a machine without a CUDA
# driver; its `-non-cuda` build is the same engine without CUDA:
#   python3 -m venv ~/.cache/kvferry/mooncake-venv
#   ~/.cache/kvferry/mooncake-venv/bin/pip install \
#       mooncake-transfer-engine-non-cuda==0.3.13.post1 numpy
#   PY=~/.cache/kvferry/mooncake-venv/bin/python
#   target:    $PY scripts/peers/mooncake_peer.py --role target --bind IP --port PORT [common]
#   initiator: $PY scripts/peers/mooncake_peer.py --role initiator --peer IP:PORT --bind IP [common]
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
import importlib.metadata
import os
import sys
import time

sys.dont_write_bytecode = True  # importing peer_common leaves no __pycache__ in the tree
from peer_common import (FILL, connect_target, fill_block, finish_initiator,  # noqa: E402
                         log, params, parse_args, pattern_base, pattern_key, peer_gone,
                         recv_msg, run_main, send_msg, serve_target)

MAGIC = "kvferry-mooncake-peer/1"
DISTS = ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine",
         "mooncake-transfer-engine-cuda13")
API = "batch_transfer_async_write + get_batch_transfer_status"


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


# ---- the data (side channel frames carry no binary blob: blobs=False) -------------------------

class Pattern:
    """Request r's block b on slot s, uint64-wise: words 1..n-2 hold base ^ key(s, b) (unique per
    slot, block and offset, written once before timing); word 0 holds stamp(r, b) and word n-1
    its complement (written per request)."""

    def __init__(self, np, block_bytes, blocks):
        self.np = np
        self.base = pattern_base(np, block_bytes)
        self.blocks = np.arange(blocks, dtype=np.uint64)

    def stamps(self, r):
        """stamp(r, b) of every block b: (r + 1) in the high half, b in the low half."""
        return self.blocks | self.np.uint64((r + 1) << 32)

    def fill(self, slot, s):
        """slot: (blocks, words) view; the keyed part of every block (ends stamped later)."""
        for b in range(slot.shape[0]):
            fill_block(self.np, self.base, slot[b], s, b)

    def stamp(self, slot, r):
        st = self.stamps(r)
        slot[:, 0] = st
        slot[:, -1] = ~st

    def bad_blocks(self, slot, s, r):
        """Blocks of slot s that differ from request r's (r None: from the initial fill)."""
        np = self.np
        if r is None:
            return [b for b in range(slot.shape[0]) if not (slot[b] == FILL).all()]
        st, want, bad = self.stamps(r), np.empty_like(self.base), []
        for b in range(slot.shape[0]):
            np.bitwise_xor(self.base, pattern_key(np, s, b), out=want)
            v = slot[b]
            if not (v[0] == st[b] and v[-1] == ~st[b]
                    and np.array_equal(v[1:-1], want[1:-1])):
                bad.append(b)
        return bad


def make_pool(np, a, te):
    """The registered pool as a (concurrency, blocks_per_request, words) uint64 array."""
    pool = np.empty((a.concurrency, a.blocks_per_request, a.block_bytes // 8), dtype=np.uint64)
    pool.fill(FILL)  # paged in
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

    def answer(hello, _):
        return ({"magic": MAGIC, "session": session, "base": pool.ctypes.data,
                 "nbytes": pool.nbytes, "version": mooncake_version()}, None)

    def verify(done):
        # The engine served the WRITEs on its own threads; this one waited for the end.
        total = a.warmup + a.requests
        if done.get("requests") != total:
            raise RuntimeError(f"initiator ran {done.get('requests')} requests, expected {total}")
        pat = Pattern(np, a.block_bytes, a.blocks_per_request)
        return [(s, b) for s in range(a.concurrency)
                for b in pat.bad_blocks(pool[s], s, last_request(s, total, a.concurrency))], {}

    note = f"target: session {session}, pool {pool.nbytes} bytes at {pool.ctypes.data:#x}"
    return serve_target(a, out_fd, dl, MAGIC, answer, verify, note=note)


def run_initiator(a, out_fd, dl):
    import numpy as np
    te, session = start_engine(a.bind)
    pool = make_pool(np, a, te)
    pat = Pattern(np, a.block_bytes, a.blocks_per_request)
    for s in range(a.concurrency):
        pat.fill(pool[s], s)

    sock, host = connect_target(a, dl)
    send_msg(sock, {"magic": MAGIC, "session": session, "params": params(a)})
    info, _ = recv_msg(sock, dl, "the target's session")
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
            peer_gone(sock, dl)
        return times

    run(0, a.warmup)  # untimed; the timed requests start once these ended
    timed = run(a.warmup, a.requests)
    knobs = "".join(f", {k}={v}" for k, v in sorted(os.environ.items())
                    if k.startswith("MC_") and k not in ("MC_FORCE_TCP", "MC_LOG_LEVEL"))
    detail = (f"mooncake {mooncake_version()}, protocol tcp, {API}, P2PHANDSHAKE, "
              f"MC_FORCE_TCP=1{knobs}")
    return finish_initiator(a, out_fd, sock, dl, "mooncake-tcp", timed, detail)


def main():
    a = parse_args("Mooncake Transfer Engine (TCP) cross-host benchmark peer", 16,
                   "a multiple of 8, at least 16")
    # The watchdog: a Mooncake call that blocks. os._exit at the end: engine threads (listeners,
    # io loop) must not hold the process at exit.
    run_main(a, "mooncake-peer", 5, run_target, run_initiator)


if __name__ == "__main__":
    main()
