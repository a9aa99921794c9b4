"""Generation rank in its own process for test_ucx_between_two_processes (and the NIXL pair):
fetches the handle given as hex on the command line into blocks [2, 0] over the transport named
second (default ucx) and checks the bytes."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import kvferry  # noqa: E402
import kv_check  # noqa: E402


def main() -> int:
    transport = sys.argv[2] if len(sys.argv) > 2 else "ucx"
    shape = kvferry.KvShape(layers=4, kv_heads=4, head_dim=8, dtype="fp32", tokens_per_block=4)
    with kvferry.Device("cpu") as dev, \
            kvferry.Pool.allocate(dev, shape, memory="host", blocks=4) as pool, \
            kvferry.GenerationSide(dev, pool, transport=transport, instance_id=3,
                                   timeout=20.0) as gen:
        gen.fetch(bytes.fromhex(sys.argv[1]), [2, 0])
        (st,) = gen.poll(at_least=1, timeout=20.0)
        if not st.ok:
            print("failed:", st)
            return 1
        kv_check.check(pool, [2, 0], kv_check.global_kv(shape, 2, seed=11), 7)
        print("verified", st.bytes, "bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
