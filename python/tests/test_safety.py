"""What a Python caller can no longer do wrong with kvferry's memory (issue 29, item 5).

Each crash reproduction runs in a child process, so that a segfault fails the test instead of
ending pytest: the child prints what it saw and exits 0 only when kvferry refused the misuse.
"""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import kvferry

HERE = os.path.dirname(os.path.abspath(__file__))


def run_child(body: str, timeout: float = 120.0) -> str:
    """Runs `body` in a fresh interpreter; fails the test unless it exits 0."""
    code = textwrap.dedent(body)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE] + sys.path))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"child exited {proc.returncode}:\n{out}"
    return out


# Large tensors (mmapped by the allocator, unmapped when freed): writing freed memory crashes.
TORCH_TRANSFER = """
    import torch, kvferry
    shape = kvferry.KvShape(layers=2, kv_heads=4, head_dim=128, dtype="fp32",
                            tokens_per_block=16)
    blocks = 64
    dev = kvferry.Device("cpu")
    fabric = kvferry.InProcFabric()
    src = kvferry.Pool.allocate(dev, shape, memory="host", blocks=blocks, layout="per-layer")
    tensors = [torch.zeros(blocks * 16, 4, 128) for _ in range(4)]
    dst = kvferry.Pool.wrap(dev, shape, tensors, layout="per-layer-kv", blocks=blocks)
    ctx = kvferry.ContextSide(dev, src, transport="inproc", fabric=fabric, timeout=10.0)
    ctx.set_instance_addresses([ctx.address])
    gen = kvferry.GenerationSide(dev, dst, transport="inproc", fabric=fabric, timeout=10.0)
    handle = ctx.mark_ready(1, list(range(blocks)), blocks * 16)
    MISUSE
    try:
        gen.fetch(handle, list(range(blocks)))
        print("fetched:", gen.poll(at_least=1, timeout=10.0))
    except kvferry.InvalidArgumentError as e:
        print("refused:", e)
"""


@pytest.mark.parametrize("misuse", [
    "tensors[0].resize_(blocks * 32, 4, 128)",  # grows: the storage's bytes move
    "tensors[0].set_(torch.zeros(8))",          # another storage: the old one was freed
    "tensors[0].untyped_storage().resize_(0)",  # the storage freed in place (FSDP does this)
])
def test_torch_tensor_moved_after_wrap_is_refused_not_written(misuse):
    pytest.importorskip("torch")
    out = run_child(TORCH_TRANSFER.replace("MISUSE", misuse))
    assert "refused:" in out and "resize_() or set_()" in out, out


def test_wrapped_torch_storage_outlives_set_and_del():
    pytest.importorskip("torch")
    # A region view taken before the engine swaps or drops its tensors still reads the bytes:
    # the pool holds the storage, not only the tensor object.
    out = run_child("""
        import gc, torch, kvferry
        shape = kvferry.KvShape(layers=1, kv_heads=4, head_dim=128, dtype="fp32",
                                tokens_per_block=16)
        dev = kvferry.Device("cpu")
        tensors = [torch.full((64 * 16, 4, 128), 7.0) for _ in range(2)]
        pool = kvferry.Pool.wrap(dev, shape, tensors, layout="per-layer-kv", blocks=64)
        view = pool.region(1).view("float32")  # numpy, zero copy
        tensors[1].set_(torch.zeros(1))
        del tensors
        gc.collect()
        junk = [torch.full((64 * 16, 4, 128), 1.0) for _ in range(4)]
        print("intact" if bool((view == 7.0).all()) else "overwritten")
    """)
    assert "intact" in out, out


def test_numpy_array_cannot_be_resized_while_wrapped(cpu, small_shape):
    arrays = [np.zeros((2 * small_shape.tokens_per_block, small_shape.kv_heads,
                        small_shape.head_dim), np.float32) for _ in range(small_shape.layers * 2)]
    pool = kvferry.Pool.wrap(cpu, small_shape, arrays, layout="per-layer-kv", blocks=2)
    with pytest.raises(ValueError, match="resize"):
        arrays[0].resize(1 << 20, refcheck=False)  # would free the memory the pool points at
    pool.close()
    del pool
    arrays[0].resize(1 << 10, refcheck=False)  # the pool gone, the array is the engine's again


def test_read_only_memory_is_refused_at_wrap(cpu, small_shape):
    n = 2 * small_shape.tokens_per_block * small_shape.kv_heads * small_shape.head_dim
    shape3 = (2 * small_shape.tokens_per_block, small_shape.kv_heads, small_shape.head_dim)
    frozen = [np.zeros(shape3, np.float32) for _ in range(small_shape.layers * 2)]
    frozen[3].flags.writeable = False
    with pytest.raises(kvferry.InvalidArgumentError, match="tensor 3 is read-only"):
        kvferry.Pool.wrap(cpu, small_shape, frozen, layout="per-layer-kv", blocks=2)
    # An array over immutable bytes.
    consts = [np.frombuffer(bytes(n * 4), np.float32).reshape(shape3)] * (small_shape.layers * 2)
    with pytest.raises(kvferry.InvalidArgumentError, match="read-only"):
        kvferry.Pool.wrap(cpu, small_shape, consts, layout="per-layer-kv", blocks=2)


def test_read_only_mapping_under_torch_is_refused_at_wrap(cpu, small_shape, tmp_path):
    torch = pytest.importorskip("torch")
    n = 2 * small_shape.tokens_per_block * small_shape.kv_heads * small_shape.head_dim
    path = tmp_path / "kv.bin"
    path.write_bytes(bytes(n * 4 * small_shape.layers * 2))
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that the buffer is not writable
        flat = torch.frombuffer(mm, dtype=torch.float32)
    tensors = [flat[i * n:(i + 1) * n].view(-1, small_shape.kv_heads, small_shape.head_dim)
               for i in range(small_shape.layers * 2)]
    with pytest.raises(kvferry.InvalidArgumentError, match="may not write"):
        kvferry.Pool.wrap(cpu, small_shape, tensors, layout="per-layer-kv", blocks=2)
    del tensors, flat


def test_close_while_another_thread_drains():
    # drain() runs without the GIL; close() used to destroy the manager under it: this loop
    # segfaulted 3 runs of 3 before close waited for the drain (a shared lock, as sides have).
    out = run_child("""
        import sys, threading, kvferry
        shape = kvferry.KvShape(layers=2, kv_heads=2, head_dim=64, dtype="fp32",
                                tokens_per_block=16)
        dev = kvferry.Device("cpu")
        primary = kvferry.Pool.allocate(dev, shape, memory="device", blocks=64)
        host = kvferry.Pool.allocate(dev, shape, memory="pinned", blocks=64)
        sys.setswitchinterval(1e-6)  # hand the GIL over at once: close() meets drain() mid-way
        outcomes = set()
        for _ in range(300):
            tm = kvferry.TransferManager(dev, primary, host)
            tm.offload([(b, b) for b in range(64)])
            def drain():
                try:
                    tm.drain(timeout=30.0)
                    outcomes.add("drained")
                except kvferry.ClosedError:
                    outcomes.add("closed first")
            t = threading.Thread(target=drain)
            t.start()
            tm.close()
            t.join()
            assert tm.closed
        print("survived", sorted(outcomes))
    """)
    assert "survived" in out, out
