#!/usr/bin/env python3
# NIXL as a cross-host benchmark peer: the work of kvferry's cross-host benchmark (one request =
# `--blocks-per-request` blocks of `--block-bytes`, 128 x 4 MiB = one Llama-3-8B request of 4096
# tokens, `--concurrency` requests in flight, `--warmup` untimed requests first) moved by NIXL's
# UCX backend between two processes that may sit in different hosts or network namespaces. Not
# run by CI; a harness starts the target, waits for its READY line, then starts the initiator
# (both typically under `ip netns exec`). scripts/compare-nixl does the same work for processes
# of one host over multiprocessing; this is its two-process form (helpers copied, not imported).
#
#   target:    nixl.py --role target --bind IP --port PORT [common options]
#   initiator: nixl.py --role initiator --peer IP:PORT --bind IP [common options]
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
import argparse
import faulthandler
import fcntl
import importlib.metadata
import json
import os
import select
import socket
import struct
import sys
import time

MAGIC = "kvferry-nixl-peer/1"
NOTIF_PREFIX = b"kvf-nixl r"
SIOCGIFADDR = 0x8915


def log(msg):
    sys.stderr.write(f"nixl-peer: {msg}\n")
    sys.stderr.flush()


class Deadline:
    def __init__(self, seconds):
        self.end = time.monotonic() + seconds

    def left(self, what):
        s = self.end - time.monotonic()
        if s <= 0:
            raise TimeoutError(f"timed out waiting for {what}")
        return s


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


# ---- side channel: frames of a JSON header and an optional binary blob ------------------------

def send_msg(sock, obj, blob=b""):
    head = json.dumps(obj).encode()
    sock.sendall(struct.pack(">II", len(head), len(blob)) + head + blob)


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
    hl, bl = struct.unpack(">II", recv_exact(sock, 8, dl, what))
    if hl > 1 << 20 or bl > 1 << 30:
        raise ConnectionError(f"malformed side-channel frame while waiting for {what}")
    obj = json.loads(recv_exact(sock, hl, dl, what))
    blob = recv_exact(sock, bl, dl, what) if bl else b""
    if obj.get("error"):
        raise RuntimeError(f"peer failed: {obj['error']}")
    return obj, blob


# ---- the data -----------------------------------------------------------------------------------

def params(a):
    return {"block_bytes": a.block_bytes, "blocks_per_request": a.blocks_per_request,
            "requests": a.requests, "warmup": a.warmup, "concurrency": a.concurrency}


class Pattern:
    """Slot s block b holds base ^ key(s, b), uint64-wise: unique per (slot, block) and offset."""

    def __init__(self, np, block_bytes):
        self.np = np
        n = block_bytes // 8
        self.base = np.arange(1, n + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)

    def key(self, s, b):
        x = (s << 32 | b) * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB
        return self.np.uint64(x & 0xFFFFFFFFFFFFFFFF)

    def fill(self, view, s, b):
        self.np.bitwise_xor(self.base, self.key(s, b), out=view)

    def check(self, view, s, b):
        return bool(self.np.array_equal(view, self.base ^ self.key(s, b)))


def make_pool(np, a, agent):
    nbytes = a.block_bytes * a.blocks_per_request * a.concurrency
    pool = np.empty(nbytes // 8, dtype=np.uint64)
    pool.fill(0xA5A5A5A5A5A5A5A5)  # paged in
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
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsock.bind((a.bind, a.port))
    lsock.listen(1)
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
        hello, md = recv_msg(sock, dl, "the initiator's hello")
        if hello.get("magic") != MAGIC:
            raise RuntimeError(f"unexpected hello {hello!r}")
        if hello["params"] != params(a):
            raise RuntimeError(f"parameters differ: initiator {hello['params']}, "
                               f"target {params(a)}")
        del md  # the initiator's agent metadata: not needed for its WRITEs (see the header)
        send_msg(sock, {"magic": MAGIC, "name": agent.name, "base": pool.ctypes.data,
                        "nbytes": pool.nbytes}, agent.get_agent_metadata())
        done, _ = recv_msg(sock, dl, "the initiator's done")
        if done.get("op") != "done":
            raise RuntimeError(f"unexpected message {done!r}")
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
        pat = Pattern(np, a.block_bytes)
        for s in range(a.concurrency):
            written = s < total  # some request used this slot
            for b in range(a.blocks_per_request):
                v = block_view(pool, a, s, b)
                ok = pat.check(v, s, b) if written else bool((v == 0xA5A5A5A5A5A5A5A5).all())
                if not ok:
                    bad.append((s, b))
        verified = not bad
        why = "" if verified else (f"{len(bad)} blocks differ, first (slot, block) {bad[:4]}")
        if not verified:
            log(f"verification failed: {why}")
        send_msg(sock, {"op": "result", "verified": verified, "why": why,
                        "notifs": len(got)})
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
    nixl_agent, nixl_agent_config = nixl_api()
    agent = nixl_agent(f"kvf-nixl-initiator-{os.getpid()}",
                       nixl_agent_config(backends=["UCX"]))
    pool = make_pool(np, a, agent)
    pat = Pattern(np, a.block_bytes)
    for s in range(a.concurrency):
        for b in range(a.blocks_per_request):
            pat.fill(block_view(pool, a, s, b), s, b)

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
    send_msg(sock, {"magic": MAGIC, "name": agent.name, "params": params(a)},
             agent.get_agent_metadata())
    info, md = recv_msg(sock, dl, "the target's metadata")
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

    def peer_gone():  # the side channel says something (EOF or an error) mid-run
        r, _, _ = select.select([sock], [], [], 0)
        if r:
            try:
                recv_msg(sock, dl, "-")
            except Exception as e:
                raise RuntimeError(f"target went away mid-run: {e}") from None
            raise RuntimeError("unexpected side-channel message mid-run")

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
                peer_gone()
        return sorted(times)

    run(0, a.warmup)  # untimed; the timed requests start once these ended
    timed = run(a.warmup, a.requests)
    send_msg(sock, {"op": "done", "requests": a.warmup + a.requests})
    res, _ = recv_msg(sock, dl, "the target's verification")
    sock.close()
    if res.get("op") != "result":
        raise RuntimeError(f"unexpected answer {res!r}")

    req_bytes = a.block_bytes * a.blocks_per_request
    wall = max(t1 for _, _, t1 in timed) - min(t0 for _, t0, _ in timed)
    detail = (f"nixl {nixl_version()}, UCX backend, UCX_TLS={os.environ.get('UCX_TLS')}, "
              f"UCX_NET_DEVICES={os.environ.get('UCX_NET_DEVICES')}")
    doc = {"name": "nixl", "bytes_per_request": req_bytes, "requests": a.requests,
           "request_s": [t1 - t0 for _, t0, t1 in timed], "wall_s": wall,
           "gbps": a.requests * req_bytes / wall / 1e9, "verified": bool(res["verified"]),
           "detail": detail}
    os.write(out_fd, (json.dumps(doc) + "\n").encode())
    if not res["verified"]:
        log(f"target's verification failed: {res.get('why')}")
        return 1
    return 0


def main():
    ap = argparse.ArgumentParser(description="NIXL (UCX over TCP) cross-host benchmark peer")
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
    if a.block_bytes <= 0 or a.block_bytes % 8:
        ap.error("--block-bytes must be a positive multiple of 8")
    if a.blocks_per_request < 1 or a.requests < 1 or a.warmup < 0 or a.concurrency < 1:
        ap.error("--blocks-per-request, --requests, --concurrency >= 1, --warmup >= 0")

    # The result lines go to the original stdout; anything else (NIXL, UCX) to stderr.
    sys.stdout.flush()
    out_fd = os.dup(1)
    os.dup2(2, 1)
    dl = Deadline(a.timeout)
    faulthandler.dump_traceback_later(a.timeout + 15, exit=True)  # a NIXL call that blocks
    rc = 1
    try:
        set_ucx_env(a.bind)
        log(f"{a.role}: UCX_TLS={os.environ['UCX_TLS']} "
            f"UCX_NET_DEVICES={os.environ['UCX_NET_DEVICES']}")
        rc = (run_target if a.role == "target" else run_initiator)(a, out_fd, dl)
    except Exception as e:
        log(f"{a.role} failed: {type(e).__name__}: {e}")
        rc = 1
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(rc)  # NIXL may crash in interpreter teardown once its work is done


if __name__ == "__main__":
    main()
