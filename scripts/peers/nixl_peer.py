#!/usr/bin/env python3
# NIXL as a cross-host benchmark peer: the work of kvferry's cross-host benchmark (one request =
# `--blocks-per-request` blocks of `--block-bytes`, 128 x 4 MiB = one Llama-3-8B request of 4096
# tokens, `--concurrency` requests in flight, `--warmup` untimed requests first) moved by NIXL's
# UCX backend between two processes that may sit in different hosts or network namespaces. Not
# run by CI; a harness starts the target, waits for its READY line, then starts the initiator
# (both typically under `ip netns exec`). scripts/compare-nixl does the same work for processes
# of one host over multiprocessing; this is its two-process form (helpers copied, not imported;
# what it shares with mooncake_peer.py is in peer_common.py).
#
#   target:    nixl_peer.py --role target --bind IP --port PORT [common options]
#   initiator: nixl_peer.py --role initiator --peer IP:PORT --bind IP [common options]
#
# - Side channel: one small TCP connection between the two given IPs (the initiator binds its
#   end to --bind). The initiator sends its parameters and agent metadata; the target checks the
#   parameters match its own and answers with its agent metadata and the address of its
#   registered pool, which the initiator loads (add_remote_agent). The target does not load the
#   initiator's metadata: WRITEs and their notifications work without it (tried: NIXL 1.5.1
#   delivers the notifications all the same), and loading it would only have the target open
#   UCX endpoints of its own. At the end the initiator says "done" and the target answers with
#   its verification result.
# - Transport: UCX_TLS=tcp,self and UCX_NET_DEVICES=<the interface holding --bind> are put into
#   the environment before NIXL (and its bundled UCX) loads, unless the caller set them.
#   UCX_TLS: two processes of one host, even in different network namespaces (`ip netns exec`
#   changes neither the IPC nor the mount namespace), are seen by UCX as one node, and it would
#   move the bytes by shared memory instead of the network that stands for the link between two
#   hosts (tried: with UCX_TLS=all the puts between two veth namespaces went by cma, process to
#   process memory copies); tcp leaves only the socket path ("self": UCX's own loopback lane).
#   UCX_NET_DEVICES: UCX otherwise spreads lanes over every up interface it finds (tried: with
#   `all`, a 127.0.0.1 run also put lanes on eth0), so traffic would leave the two given IPs;
#   held to --bind's interface it stays there. UCX lists only operationally-up interfaces, so a
#   veth must be UP/LOWER_UP on both ends before either side starts.
# - Memory: both sides allocate blocks_per_request * concurrency blocks (numpy, CPU memory,
#   "DRAM" descriptors), page them in and register them before timing. The initiator fills slot
#   s block b with a pattern keyed on (s, b) before timing; request r (warm-up requests counted
#   first) uses slot r % concurrency on both sides, so every request of a slot carries that
#   slot's data, and a slot is never reused while a request on it is in flight.
# - Transfers: one WRITE per request, one descriptor per block, descriptor lists prepared before
#   timing (as compare-nixl: NIXL's best case); initialize_xfer + transfer per request inside the
#   clock, completion by polling check_xfer_state. Each request carries a notification; the
#   target waits for the notifications of every request before it verifies its slots.
# - Output: the target prints READY (flushed) once it listens and is registered; the initiator
#   prints exactly one JSON line (the end of run_initiator), also when the target's verification
#   failed (then verified is false and it exits 1). Library noise goes to stderr: fd 1 is pointed
#   at stderr, the result lines go to the saved original stdout.
# - Every wait has a deadline (--timeout, 120 s overall); a faulthandler watchdog ends the
#   process if a NIXL call itself blocks past it. NIXL processes crash at interpreter exit after
#   their work is done (tried: SIGSEGV, rc 139, on both roles with sys.exit), so both roles end
#   with os._exit(rc) after flushing.
import fcntl
import importlib.metadata
import os
import socket
import struct
import sys
import time

sys.dont_write_bytecode = True  # importing peer_common leaves no __pycache__ in the tree
from peer_common import (FILL, connect_target, fill_block, finish_initiator,  # noqa: E402
                         log, params, parse_args, pattern_base, pattern_key, peer_gone,
                         recv_msg, run_main, send_msg, serve_target)

MAGIC = "kvferry-nixl-peer/1"
NOTIF_PREFIX = b"kvf-nixl r"
SIOCGIFADDR = 0x8915


# ---- environment (before NIXL loads) ----------------------------------------------------------

def iface_of(ip):
    """The name of the interface holding IPv4 address ip (this network namespace), or None."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _, name in socket.if_nameindex():
            try:
                res = fcntl.ioctl(s.fileno(), SIOCGIFADDR,
                                  struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address
            if socket.inet_ntoa(res[20:24]) == ip:
                return name
    finally:
        s.close()
    return None


def set_ucx_env(bind_ip):
    if "UCX_TLS" not in os.environ:
        os.environ["UCX_TLS"] = "tcp,self"
    if "UCX_NET_DEVICES" not in os.environ:
        dev = iface_of(bind_ip)
        if dev is None:
            raise RuntimeError(f"no interface holds --bind {bind_ip} in this network namespace")
        os.environ["UCX_NET_DEVICES"] = dev
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")


def nixl_api():  # as compare-nixl: the meta package `nixl`, or a CUDA variant's own module
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError:
        from nixl_cu13._api import nixl_agent, nixl_agent_config
    return nixl_agent, nixl_agent_config


def nixl_version():
    mod = sys.modules.get("nixl._api")
    mod = getattr(mod, "__name__", "") if mod else ""
    for dist, m in (("nixl-cu13", "nixl_cu13"), ("nixl-cu12", "nixl_cu12"), ("nixl", "nixl")):
        if m in sys.modules or mod.startswith(m):
            try:
                return f"{importlib.metadata.version(dist)} ({dist})"
            except importlib.metadata.PackageNotFoundError:
                pass
    return "?"


# ---- the data (side channel frames carry a binary blob: blobs=True) ---------------------------

def make_pool(np, a, agent):
    nbytes = a.block_bytes * a.blocks_per_request * a.concurrency
    pool = np.empty(nbytes // 8, dtype=np.uint64)
    pool.fill(FILL)  # paged in
    agent.register_memory([(pool.ctypes.data, pool.nbytes, 0, "")], "DRAM")
    return pool


def block_view(pool, a, s, b):
    n = a.block_bytes // 8
    i = (s * a.blocks_per_request + b) * n
    return pool[i:i + n]


# ---- roles --------------------------------------------------------------------------------------

def run_target(a, out_fd, dl):
    import numpy as np
    nixl_agent, nixl_agent_config = nixl_api()
    agent = nixl_agent(f"kvf-nixl-target-{os.getpid()}", nixl_agent_config(backends=["UCX"]))
    pool = make_pool(np, a, agent)

    def answer(hello, md):
        del md  # the initiator's agent metadata: not needed for its WRITEs (see the header)
        return ({"magic": MAGIC, "name": agent.name, "base": pool.ctypes.data,
                 "nbytes": pool.nbytes}, agent.get_agent_metadata())

    def verify(done):
        total = a.warmup + a.requests
        # Every request's notification arrives after its data: wait for all of them.
        want = {NOTIF_PREFIX + str(r).encode() for r in range(total)}
        got = set()
        while True:
            for msgs in agent.get_new_notifs().values():
                for m in msgs:
                    got.add(bytes(m))
            if want <= got:
                break
            dl.left(f"notifications ({len(want & got)} of {total} came)")
            time.sleep(0.001)
        bad = []
        base = pattern_base(np, a.block_bytes)
        for s in range(a.concurrency):
            written = s < total  # some request used this slot
            for b in range(a.blocks_per_request):
                v = block_view(pool, a, s, b)
                ok = (bool(np.array_equal(v, base ^ pattern_key(np, s, b))) if written
                      else bool((v == FILL).all()))
                if not ok:
                    bad.append((s, b))
        return bad, {"notifs": len(got)}

    return serve_target(a, out_fd, dl, MAGIC, answer, verify, blobs=True)


def run_initiator(a, out_fd, dl):
    import numpy as np
    nixl_agent, nixl_agent_config = nixl_api()
    agent = nixl_agent(f"kvf-nixl-initiator-{os.getpid()}",
                       nixl_agent_config(backends=["UCX"]))
    pool = make_pool(np, a, agent)
    base = pattern_base(np, a.block_bytes)
    for s in range(a.concurrency):
        for b in range(a.blocks_per_request):
            fill_block(np, base, block_view(pool, a, s, b), s, b)

    sock, _ = connect_target(a, dl)
    send_msg(sock, {"magic": MAGIC, "name": agent.name, "params": params(a)},
             agent.get_agent_metadata())
    info, md = recv_msg(sock, dl, "the target's metadata", blobs=True)
    if info.get("magic") != MAGIC:
        raise RuntimeError(f"unexpected answer {info!r}")
    remote = agent.add_remote_agent(md)
    if isinstance(remote, bytes):
        remote = remote.decode()
    if info["nbytes"] != pool.nbytes:
        raise RuntimeError(f"target pool has {info['nbytes']} bytes, expected {pool.nbytes}")

    # Descriptor lists per slot, one descriptor per block, built before timing.
    slot_bytes = a.block_bytes * a.blocks_per_request
    idx = np.arange(a.blocks_per_request, dtype=np.uint64) * np.uint64(a.block_bytes)
    sizes = np.full(a.blocks_per_request, a.block_bytes, dtype=np.uint64)
    zeros = np.zeros(a.blocks_per_request, dtype=np.uint64)
    lists = []
    for s in range(a.concurrency):
        lo = np.uint64(pool.ctypes.data + s * slot_bytes) + idx
        ro = np.uint64(info["base"] + s * slot_bytes) + idx
        lists.append((agent.get_xfer_descs(np.stack([lo, sizes, zeros], axis=1), "DRAM"),
                      agent.get_xfer_descs(np.stack([ro, sizes, zeros], axis=1), "DRAM")))

    def run(first, count):
        """Requests first..first+count-1, `concurrency` in flight; [(t0, t1)] per request."""
        times, inflight, busy, nxt = [], [], set(), first
        last_check = time.monotonic()
        while nxt < first + count or inflight:
            while (nxt < first + count and len(inflight) < a.concurrency
                   and nxt % a.concurrency not in busy):
                local, rem = lists[nxt % a.concurrency]
                t0 = time.perf_counter()
                h = agent.initialize_xfer("WRITE", local, rem, remote,
                                          NOTIF_PREFIX + str(nxt).encode())
                if agent.transfer(h) == "ERR":
                    raise RuntimeError(f"NIXL transfer of request {nxt} failed to post")
                inflight.append((nxt, t0, h))
                busy.add(nxt % a.concurrency)
                nxt += 1
            for entry in list(inflight):
                r, t0, h = entry
                st = agent.check_xfer_state(h)
                if st == "ERR":
                    raise RuntimeError(f"NIXL transfer of request {r} failed")
                if st == "DONE":
                    t1 = time.perf_counter()
                    agent.release_xfer_handle(h)
                    times.append((r, t0, t1))
                    inflight.remove(entry)
                    busy.discard(r % a.concurrency)
            now = time.monotonic()
            if now - last_check > 0.05:
                last_check = now
                dl.left(f"transfers ({len(inflight)} in flight, next {nxt})")
                peer_gone(sock, dl, blobs=True)
        return [(t0, t1) for _, t0, t1 in sorted(times)]

    run(0, a.warmup)  # untimed; the timed requests start once these ended
    timed = run(a.warmup, a.requests)
    detail = (f"nixl {nixl_version()}, UCX backend, UCX_TLS={os.environ.get('UCX_TLS')}, "
              f"UCX_NET_DEVICES={os.environ.get('UCX_NET_DEVICES')}")
    return finish_initiator(a, out_fd, sock, dl, "nixl", timed, detail, blobs=True)


def main():
    a = parse_args("NIXL (UCX over TCP) cross-host benchmark peer", 8, "a positive multiple of 8")

    def prepare():
        set_ucx_env(a.bind)
        log(f"{a.role}: UCX_TLS={os.environ['UCX_TLS']} "
            f"UCX_NET_DEVICES={os.environ['UCX_NET_DEVICES']}")

    # The watchdog: a NIXL call that blocks. os._exit at the end: NIXL may crash in interpreter
    # teardown once its work is done.
    run_main(a, "nixl-peer", 15, run_target, run_initiator, prepare)


if __name__ == "__main__":
    main()
