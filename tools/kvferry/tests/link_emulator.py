#!/usr/bin/env python3
"""A lossy, slow link between two network namespaces, for tests (this kernel has no sch_netem).

Two TUN devices are made here, moved one into each namespace and addressed point to point
(ADDR_A in NS_A, ADDR_B in NS_B); this process forwards every IP packet between them, each
direction on its own: a packet is dropped with probability --loss, held --delay-ms, and with
probability --reorder held --reorder-ms more (so packets sent after it overtake it). The TUN
devices go when this process exits (SIGTERM or SIGINT), which prints what it did:
  link_emulator: forwarded N, dropped D, reordered R
It writes --ready-file once both ends are up.

Usage: link_emulator.py NS_A ADDR_A NS_B ADDR_B [--delay-ms MS] [--loss P] [--reorder P]
                        [--reorder-ms MS] [--seed S] [--mtu BYTES] --ready-file PATH
"""
import argparse
import fcntl
import heapq
import os
import random
import select
import signal
import struct
import subprocess
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000


def open_tun(name):
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def ip(*args):
    subprocess.run(["ip", *args], check=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("ns_a")
    p.add_argument("addr_a")
    p.add_argument("ns_b")
    p.add_argument("addr_b")
    p.add_argument("--delay-ms", type=float, default=0)
    p.add_argument("--loss", type=float, default=0)
    p.add_argument("--reorder", type=float, default=0)
    p.add_argument("--reorder-ms", type=float, default=10)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--mtu", type=int, default=9000)
    p.add_argument("--ready-file", required=True)
    a = p.parse_args()

    rng = random.Random(a.seed)
    names = (f"kvta{os.getpid()}"[:15], f"kvtb{os.getpid()}"[:15])
    fds = (open_tun(names[0]), open_tun(names[1]))
    # A TUN device keeps its file descriptor when it moves to another namespace.
    for name, ns, mine, peer in ((names[0], a.ns_a, a.addr_a, a.addr_b),
                                 (names[1], a.ns_b, a.addr_b, a.addr_a)):
        ip("link", "set", name, "netns", ns)
        ip("-n", ns, "addr", "add", mine, "peer", peer, "dev", name)
        ip("-n", ns, "link", "set", name, "mtu", str(a.mtu), "up")
        ip("-n", ns, "link", "set", "lo", "up")

    stats = {"forwarded": 0, "dropped": 0, "reordered": 0}
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    with open(a.ready_file, "w") as f:
        f.write("ready\n")

    held = []  # (due, sequence, destination fd, packet)
    seq = 0
    while not stop:
        now = time.monotonic()
        while held and held[0][0] <= now:
            _, _, out, pkt = heapq.heappop(held)
            try:
                os.write(out, pkt)
                stats["forwarded"] += 1
            except OSError:  # the far end went down: the packet is lost, as on a wire
                stats["dropped"] += 1
        timeout = max(0.0, held[0][0] - now) if held else 0.05
        try:
            ready, _, _ = select.select(fds, [], [], timeout)
        except InterruptedError:
            continue
        for i, fd in enumerate(fds):
            if fd not in ready:
                continue
            while True:
                try:
                    pkt = os.read(fd, 65536)
                except BlockingIOError:
                    break
                except OSError:
                    break
                if rng.random() < a.loss:
                    stats["dropped"] += 1
                    continue
                due = time.monotonic() + a.delay_ms / 1000
                if a.reorder > 0 and rng.random() < a.reorder:
                    due += a.reorder_ms / 1000
                    stats["reordered"] += 1
                seq += 1
                heapq.heappush(held, (due, seq, fds[1 - i], pkt))
    print(f"link_emulator: forwarded {stats['forwarded']}, dropped {stats['dropped']}, "
          f"reordered {stats['reordered']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
