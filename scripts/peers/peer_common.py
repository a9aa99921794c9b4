# What the cross-host benchmark peers nixl_peer.py and mooncake_peer.py (this folder) do alike:
# the command line, the side channel (its framing, the initiator's connect, the target's serve
# loop), the keyed data pattern, the deadline and watchdog, and the initiator's JSON line. Each
# peer's header tells the contract; a peer imports this from its own folder (sys.path[0]).
import argparse
import faulthandler
import json
import os
import select
import socket
import struct
import sys
import time

FILL = 0xA5A5A5A5A5A5A5A5  # a pool before any request (written to page it in)
TAG = "peer"  # the prefix of log lines, set by run_main


def log(msg):
    sys.stderr.write(f"{TAG}: {msg}\n")
    sys.stderr.flush()


class Deadline:
    def __init__(self, seconds):
        self.end = time.monotonic() + seconds

    def left(self, what):
        s = self.end - time.monotonic()
        if s <= 0:
            raise TimeoutError(f"timed out waiting for {what}")
        return s


# ---- command line and main ----------------------------------------------------------------------

def parse_args(description, min_block_bytes, block_bytes_rule):
    """The peers' common options; --block-bytes must be a multiple of 8 and >= min_block_bytes
    (block_bytes_rule says so in the error)."""
    ap = argparse.ArgumentParser(description=description)
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
    if a.block_bytes < min_block_bytes or a.block_bytes % 8:
        ap.error(f"--block-bytes must be {block_bytes_rule}")
    if a.blocks_per_request < 1 or a.requests < 1 or a.warmup < 0 or a.concurrency < 1:
        ap.error("--blocks-per-request, --requests, --concurrency >= 1, --warmup >= 0")
    return a


def run_main(a, tag, watchdog_slack, run_target, run_initiator, prepare=None):
    """Runs the role (prepare() first, if given) and ends the process with os._exit(rc): the
    result lines go to the original stdout (out_fd), anything else (the library's noise) to
    stderr; a faulthandler watchdog ends the process watchdog_slack seconds past --timeout if a
    library call itself blocks."""
    global TAG
    TAG = tag
    sys.stdout.flush()
    out_fd = os.dup(1)
    os.dup2(2, 1)
    dl = Deadline(a.timeout)
    faulthandler.dump_traceback_later(a.timeout + watchdog_slack, exit=True)
    rc = 1
    try:
        if prepare is not None:
            prepare()
        rc = (run_target if a.role == "target" else run_initiator)(a, out_fd, dl)
    except Exception as e:
        log(f"{a.role} failed: {type(e).__name__}: {e}")
        rc = 1
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(rc)


# ---- side channel: frames of a JSON header and, with blobs, a binary blob -----------------------
# Without blobs (blob None): >I header length + JSON. With blobs: >II header and blob lengths +
# JSON + blob. Both ends of one peer use the same framing; `blobs` says which.

def send_msg(sock, obj, blob=None):
    head = json.dumps(obj).encode()
    if blob is None:
        sock.sendall(struct.pack(">I", len(head)) + head)
    else:
        sock.sendall(struct.pack(">II", len(head), len(blob)) + head + blob)


def no_blob(blobs):
    """send_msg's blob for a frame that carries none."""
    return b"" if blobs else None


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


def recv_msg(sock, dl, what, blobs=False):
    """One frame: (obj, blob), blob b"" without blobs."""
    if blobs:
        hl, bl = struct.unpack(">II", recv_exact(sock, 8, dl, what))
    else:
        (hl,), bl = struct.unpack(">I", recv_exact(sock, 4, dl, what)), 0
    if hl > 1 << 20 or bl > 1 << 30:
        raise ConnectionError(f"malformed side-channel frame while waiting for {what}")
    obj = json.loads(recv_exact(sock, hl, dl, what))
    blob = recv_exact(sock, bl, dl, what) if bl else b""
    if obj.get("error"):
        raise RuntimeError(f"peer failed: {obj['error']}")
    return obj, blob


def params(a):
    return {"block_bytes": a.block_bytes, "blocks_per_request": a.blocks_per_request,
            "requests": a.requests, "warmup": a.warmup, "concurrency": a.concurrency}


def serve_target(a, out_fd, dl, magic, answer, verify, blobs=False, note=None):
    """The target's side channel: listens on --bind:--port, logs note, prints READY, takes one
    initiator, checks its hello (magic, parameters), sends answer(hello, blob) (an (obj, blob)
    pair for send_msg), waits for its "done" and answers with the result of verify(done): a list
    of the (slot, block) that differ and a dict of fields added to the result. An error goes to
    the initiator as {"error": ...} and is raised."""
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsock.bind((a.bind, a.port))
    lsock.listen(1)
    if note:
        log(note)
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
        hello, blob = recv_msg(sock, dl, "the initiator's hello", blobs)
        if hello.get("magic") != magic:
            raise RuntimeError(f"unexpected hello {hello!r}")
        if hello["params"] != params(a):
            raise RuntimeError(f"parameters differ: initiator {hello['params']}, "
                               f"target {params(a)}")
        send_msg(sock, *answer(hello, blob))
        done, _ = recv_msg(sock, dl, "the initiator's done", blobs)
        if done.get("op") != "done":
            raise RuntimeError(f"unexpected message {done!r}")
        bad, extra = verify(done)
        verified = not bad
        why = "" if verified else f"{len(bad)} blocks differ, first (slot, block) {bad[:4]}"
        if not verified:
            log(f"verification failed: {why}")
        send_msg(sock, {"op": "result", "verified": verified, "why": why, **extra},
                 no_blob(blobs))
        # Let the initiator read the answer (and close) before this end goes.
        sock.settimeout(min(5.0, max(0.1, dl.end - time.monotonic())))
        try:
            sock.recv(1)
        except OSError:
            pass
    except Exception as e:
        try:
            send_msg(sock, {"error": f"target: {e}"}, no_blob(blobs))
        except OSError:
            pass
        raise
    finally:
        sock.close()
    return 0


def connect_target(a, dl):
    """The initiator's side channel to --peer, its end bound to --bind; (socket, peer host)."""
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
    return sock, host


def peer_gone(sock, dl, blobs=False):
    """Raises if the side channel says something (EOF or an error) mid-run."""
    r, _, _ = select.select([sock], [], [], 0)
    if r:
        try:
            recv_msg(sock, dl, "-", blobs)
        except Exception as e:
            raise RuntimeError(f"target went away mid-run: {e}") from None
        raise RuntimeError("unexpected side-channel message mid-run")


def finish_initiator(a, out_fd, sock, dl, name, timed, detail, blobs=False):
    """Says "done", takes the target's verification and prints the one JSON line (timed: the
    timed requests' (t0, t1) in request order); the exit code: 1 when verification failed."""
    send_msg(sock, {"op": "done", "requests": a.warmup + a.requests}, no_blob(blobs))
    res, _ = recv_msg(sock, dl, "the target's verification", blobs)
    sock.close()
    if res.get("op") != "result":
        raise RuntimeError(f"unexpected answer {res!r}")

    req_bytes = a.block_bytes * a.blocks_per_request
    wall = max(t1 for _, t1 in timed) - min(t0 for t0, _ in timed)
    doc = {"name": name, "bytes_per_request": req_bytes, "requests": a.requests,
           "request_s": [t1 - t0 for t0, t1 in timed], "wall_s": wall,
           "gbps": a.requests * req_bytes / wall / 1e9, "verified": bool(res["verified"]),
           "detail": detail}
    os.write(out_fd, (json.dumps(doc) + "\n").encode())
    if not res["verified"]:
        log(f"target's verification failed: {res.get('why')}")
        return 1
    return 0


# ---- the data: slot s block b, uint64-wise, holds base ^ key(s, b) ------------------------------
# (unique per slot, block and offset; mooncake_peer.py stamps the two end words per request)

def pattern_base(np, block_bytes):
    n = block_bytes // 8
    return np.arange(1, n + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)


def pattern_key(np, s, b):
    x = (s << 32 | b) * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB
    return np.uint64(x & 0xFFFFFFFFFFFFFFFF)


def fill_block(np, base, out, s, b):
    np.bitwise_xor(base, pattern_key(np, s, b), out=out)
