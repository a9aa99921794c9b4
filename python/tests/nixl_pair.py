"""A context rank over --transport nixl in this process and a generation rank (ucx_peer.py) in
another: the handle goes over the command line, the generation rank checks every byte. Exit 77
when NIXL is not usable here. Run by test_nixl_between_two_processes in a child process (see
there why)."""

import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))

import kvferry  # noqa: E402
import kv_check  # noqa: E402


def main() -> int:
    shape = kvferry.KvShape(layers=4, kv_heads=4, head_dim=8, dtype="fp32", tokens_per_block=4)
    with kvferry.Device("cpu") as dev, \
            kvferry.Pool.allocate(dev, shape, memory="host", blocks=4) as pool:
        kv_check.fill(pool, [1, 3], kv_check.global_kv(shape, 2, seed=11))
        try:
            ctx = kvferry.ContextSide(dev, pool, transport="nixl", instance_secret=b"s" * 16,
                                      timeout=20.0)
        except kvferry.UnavailableError as e:
            print("NIXL unavailable:", e)
            return 77
        with ctx:
            ctx.set_instance_addresses([ctx.address])
            handle = ctx.mark_ready(77, [1, 3], 7)
            peer = os.path.join(os.path.dirname(__file__), "ucx_peer.py")
            proc = subprocess.run([sys.executable, peer, handle.hex(), "nixl"],
                                  capture_output=True, text=True, timeout=60)
            print(proc.stdout + proc.stderr)
            if proc.returncode != 0:
                return 1
            (st,) = ctx.poll(at_least=1, timeout=20.0)
            print("context side:", st)
            return 0 if st.ok else 1


if __name__ == "__main__":
    sys.exit(main())
