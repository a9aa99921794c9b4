"""Context and generation sides over the in-process transport (and UCX between two processes)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import kvferry
import kv_check
from conftest import pool_array

SECRET = b"0123456789abcdef"


class Instances:
    """A context and a generation instance in this process, joined by one fabric."""

    def __init__(self, dev, shape, ctx_tp=1, gen_tp=1, blocks=8, timeout=5.0):
        self.fabric = kvferry.InProcFabric()
        self.shape = shape
        self.ctx_pools = [
            kvferry.Pool.allocate(dev, shape, kvferry.ParallelConfig(tp=ctx_tp), rank=r,
                                  memory="host", blocks=blocks) for r in range(ctx_tp)]
        self.gen_pools = [
            kvferry.Pool.allocate(dev, shape, kvferry.ParallelConfig(tp=gen_tp), rank=r,
                                  memory="host", blocks=blocks) for r in range(gen_tp)]
        self.ctx = [kvferry.ContextSide(dev, p, transport="inproc", fabric=self.fabric,
                                        instance_secret=SECRET, timeout=timeout)
                    for p in self.ctx_pools]
        addresses = [c.address for c in self.ctx]
        for c in self.ctx:
            c.set_instance_addresses(addresses)
        self.gen = [kvferry.GenerationSide(dev, p, transport="inproc", fabric=self.fabric,
                                           instance_id=7, timeout=timeout)
                    for p in self.gen_pools]

    def close(self):
        for s in self.gen + self.ctx + self.gen_pools + self.ctx_pools:
            s.close()


@pytest.mark.parametrize("ctx_tp,gen_tp", [(1, 1), (2, 1), (1, 2), (2, 4)])
def test_transfer_moves_every_byte(cpu, small_shape, ctx_tp, gen_tp):
    inst = Instances(cpu, small_shape, ctx_tp, gen_tp)
    prompt_tokens = 3 * small_shape.tokens_per_block - 1  # a partial last block
    g = kv_check.global_kv(small_shape, 3, seed=ctx_tp * 10 + gen_tp)
    ctx_blocks, gen_blocks = [5, 1, 6], [0, 7, 2]
    for p in inst.ctx_pools:
        kv_check.fill(p, ctx_blocks, g)
    handles = [c.mark_ready(42, ctx_blocks, prompt_tokens) for c in inst.ctx]
    assert isinstance(handles[0], bytes) and all(h == handles[0] for h in handles)
    for s in inst.gen:
        s.fetch(handles[0], gen_blocks)
    received = 0
    for s in inst.gen + inst.ctx:
        (st,) = s.poll(at_least=1, timeout=10.0)
        assert st.request_id == 42
        assert st.state == kvferry.TransferState.COMPLETE, st
        assert st.ok and st.terminal and st.code == "OK"
        received += st.bytes if s in inst.gen else 0
    assert received > 0
    with pytest.raises(kvferry.NotFoundError):  # reported once, then forgotten
        inst.gen[0].query(42)
    for p in inst.gen_pools:
        kv_check.check(p, gen_blocks, g, prompt_tokens)
    assert all(s.stats["requests_ended"] == 1 for s in inst.gen + inst.ctx)
    inst.close()


def test_many_requests_poll_at_least(cpu, small_shape):
    inst = Instances(cpu, small_shape, blocks=16)
    for rid in range(8):
        h = inst.ctx[0].mark_ready(rid, [2 * rid, 2 * rid + 1], 5)
        inst.gen[0].fetch(h, [15 - 2 * rid, 14 - 2 * rid])
    done = []
    deadline = time.monotonic() + 10
    while len(done) < 8 and time.monotonic() < deadline:
        done += inst.gen[0].poll(at_least=8 - len(done), timeout=5.0)
    assert sorted(s.request_id for s in done) == list(range(8))
    assert all(s.ok for s in done)
    inst.close()


def test_poll_waits_without_the_gil(cpu, small_shape):
    inst = Instances(cpu, small_shape)
    result = {}

    def poller():
        result["statuses"] = inst.gen[0].poll(at_least=1, timeout=1.0)
        result["end"] = time.monotonic()

    t = threading.Thread(target=poller)
    t.start()
    time.sleep(0.05)
    spin_end = time.monotonic() + 0.2
    while time.monotonic() < spin_end:  # pure Python work: needs the GIL
        pass
    main_done = time.monotonic()
    t.join()
    assert result["statuses"] == []  # nothing was pending: the poll ran to its timeout
    assert main_done < result["end"], "the main thread ran only after the poll returned"
    inst.close()


def test_close_while_another_thread_polls(cpu, small_shape):
    inst = Instances(cpu, small_shape)
    gen = inst.gen[0]
    out = []
    t = threading.Thread(target=lambda: out.append(gen.poll(at_least=1, timeout=0.5)))
    t.start()
    time.sleep(0.05)
    gen.close()  # waits for the poll in flight
    t.join()
    assert out == [[]]
    assert gen.closed
    with pytest.raises(kvferry.ClosedError):
        gen.poll()
    with pytest.raises(kvferry.ClosedError):
        gen.fetch(b"x", [0])
    inst.close()


def test_cancel_and_query(cpu, small_shape):
    inst = Instances(cpu, small_shape)
    inst.ctx[0].mark_ready(9, [0], 4)
    assert inst.ctx[0].query(9).state in (kvferry.TransferState.INIT,
                                          kvferry.TransferState.IN_PROGRESS)
    inst.ctx[0].cancel(9)
    (st,) = inst.ctx[0].poll(at_least=1, timeout=5.0)
    assert st.state == kvferry.TransferState.CANCELLED and not st.ok
    assert st.code == "CANCELLED"
    with pytest.raises(kvferry.NotFoundError):
        inst.ctx[0].query(12345)
    inst.close()


def test_bad_handles_and_arguments(cpu, small_shape):
    inst = Instances(cpu, small_shape)
    gen = inst.gen[0]
    with pytest.raises(TypeError):
        gen.fetch("not bytes", [0])
    with pytest.raises(kvferry.InvalidArgumentError):
        gen.fetch(b"\x00garbage", [0])
    h = inst.ctx[0].mark_ready(1, [0, 1], 8)
    with pytest.raises(kvferry.InvalidArgumentError, match="block"):
        gen.fetch(h, [0])  # too few destination blocks
    forged = bytearray(h)
    forged[-1] ^= 0xFF
    with pytest.raises(kvferry.DataLossError, match="checksum"):
        gen.fetch(bytes(forged), [0, 1])
    with pytest.raises(kvferry.InvalidArgumentError, match="timeout"):
        gen.poll(at_least=1, timeout=-1)
    with pytest.raises(kvferry.InvalidArgumentError, match="inproc"):
        kvferry.GenerationSide(cpu, inst.gen_pools[0], transport="inproc")
    with pytest.raises(kvferry.InvalidArgumentError, match="instance_secret"):
        kvferry.ContextSide(cpu, inst.ctx_pools[0], transport="inproc", fabric=inst.fabric,
                            instance_secret=bytes(17))
    inst.close()


def test_dead_context_ends_the_request(cpu, small_shape):
    inst = Instances(cpu, small_shape, timeout=3.0)
    h = inst.ctx[0].mark_ready(5, [0, 1], 8)
    inst.fabric.kill(inst.ctx[0].address)
    inst.gen[0].fetch(h, [2, 3])  # returns at once: the failure comes through poll
    (st,) = inst.gen[0].poll(at_least=1, timeout=10.0)
    assert st.state == kvferry.TransferState.ERROR and not st.ok
    assert st.code == "UNAVAILABLE" and "context rank 0" in st.message, st
    inst.close()


def test_sides_keep_pool_alive_after_pool_close(small_shape):
    dev = kvferry.Device("cpu")
    inst = Instances(dev, small_shape)
    g = kv_check.global_kv(small_shape, 1, seed=3)
    kv_check.fill(inst.ctx_pools[0], [0], g)
    for p in inst.ctx_pools + inst.gen_pools:
        p.close()  # the sides still hold them
    dev.close()
    h = inst.ctx[0].mark_ready(1, [0], 4)
    inst.gen[0].fetch(h, [3])
    (st,) = inst.gen[0].poll(at_least=1, timeout=10.0)
    assert st.ok
    inst.close()


@pytest.mark.skipif("ucx" not in kvferry.transports(), reason="built without UCX")
def test_ucx_between_two_processes(cpu, small_shape):
    pool = kvferry.Pool.allocate(cpu, small_shape, memory="host", blocks=4)
    g = kv_check.global_kv(small_shape, 2, seed=11)
    kv_check.fill(pool, [1, 3], g)
    with kvferry.ContextSide(cpu, pool, transport="ucx", instance_secret=SECRET,
                             timeout=20.0) as ctx:
        ctx.set_instance_addresses([ctx.address])
        handle = ctx.mark_ready(77, [1, 3], 7)
        peer = os.path.join(os.path.dirname(__file__), "ucx_peer.py")
        proc = subprocess.run([sys.executable, peer, handle.hex()], capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "verified" in proc.stdout
        (st,) = ctx.poll(at_least=1, timeout=20.0)
        assert st.ok, st


@pytest.mark.skipif("nixl" not in kvferry.transports(), reason="built without NIXL")
def test_nixl_between_two_processes():
    # Both ranks in child processes, with UCX_MODULES='^ib*': a process whose NIXL UCX loaded its
    # InfiniBand module crashes at exit in that module's libnl-route (NIXL's own Python binding
    # alone does too; docs/nixl.md), which would take pytest down with it.
    env = dict(os.environ, UCX_MODULES="^ib*")
    pair = os.path.join(os.path.dirname(__file__), "nixl_pair.py")
    proc = subprocess.run([sys.executable, pair], capture_output=True, text=True, timeout=120,
                          env=env)
    if proc.returncode == 77:
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "verified" in proc.stdout


def test_layer_wise_marks_and_events(cpu, small_shape):
    inst = Instances(cpu, small_shape)
    ctx, gen = inst.ctx[0], inst.gen[0]
    g = kv_check.global_kv(small_shape, 2, seed=21)
    kv_check.fill(inst.ctx_pools[0], [0, 1], g)
    h = ctx.begin_layer_wise(3, [0, 1], 8)
    gen.fetch(h, [4, 5])
    ctx.mark_layers_ready(3, 2)  # 2 of 4 layers
    assert gen.poll(at_least=1, timeout=0.2) == []  # the rest is not ready
    stream = cpu.create_stream()
    event = cpu.create_event()
    stream.record(event)
    ctx.mark_layer_ready_on(3, small_shape.layers - 1, event)
    (st,) = gen.poll(at_least=1, timeout=10.0)
    assert st.ok, st
    kv_check.check(inst.gen_pools[0], [4, 5], g, 8)
    with kvferry.Device("cpu") as other:
        foreign = other.create_event()
        h2 = ctx.begin_layer_wise(4, [2], 4)
        assert h2
        with pytest.raises(kvferry.InvalidArgumentError, match="another Device"):
            ctx.mark_layer_ready_on(4, 0, foreign)
    stream.close()
    inst.close()


def test_custom_layouts_transfer(cpu, small_shape):
    """Custom strides on both sides (K/V outside the layers with padded blocks; tokens outside
    heads, the generation's blocks padded otherwise): the strides travel in the handle and the
    FETCH, every element lands where the generation pool's strides say."""
    layouts = ("custom:one:block,kv,layer,head,token,dim:pad=24",
               "custom:one:block,layer,kv,token,head,dim:pad=8")
    ctx_tp, gen_tp = 2, 1
    fabric = kvferry.InProcFabric()
    ctx_pools = [kvferry.Pool.allocate(cpu, small_shape, kvferry.ParallelConfig(tp=ctx_tp),
                                       rank=r, layout=layouts[0], memory="host", blocks=8)
                 for r in range(ctx_tp)]
    gen_pools = [kvferry.Pool.allocate(cpu, small_shape, kvferry.ParallelConfig(tp=gen_tp),
                                       rank=r, layout=layouts[1], memory="host", blocks=8)
                 for r in range(gen_tp)]
    # (blk, L, kv, h, t, d) = (8, 4, 2, 2, 4, 8) per context rank, [block][kv][layer][head][token]
    # [dim] with 24 elements after each block.
    assert tuple(ctx_pools[0].strides) == (2 * 4 * 2 * 4 * 8 + 24, 2 * 4 * 8, 4 * 2 * 4 * 8,
                                           4 * 8, 8, 1)
    ctx = [kvferry.ContextSide(cpu, p, transport="inproc", fabric=fabric, instance_secret=SECRET)
           for p in ctx_pools]
    for c in ctx:
        c.set_instance_addresses([c.address for c in ctx])
    gen = [kvferry.GenerationSide(cpu, p, transport="inproc", fabric=fabric, instance_id=9)
           for p in gen_pools]
    prompt_tokens = 3 * small_shape.tokens_per_block - 2
    g = kv_check.global_kv(small_shape, 3, seed=5)
    ctx_blocks, gen_blocks = [4, 0, 6], [1, 7, 3]
    for p in ctx_pools:
        kv_check.fill(p, ctx_blocks, g)
    handle = [c.mark_ready(5, ctx_blocks, prompt_tokens) for c in ctx][0]
    for s in gen:
        s.fetch(handle, gen_blocks)
    for s in gen + ctx:
        (st,) = s.poll(at_least=1, timeout=10.0)
        assert st.state == kvferry.TransferState.COMPLETE, st
    for p in gen_pools:
        kv_check.check(p, gen_blocks, g, prompt_tokens)
    with pytest.raises(kvferry.InvalidArgumentError, match="axis 'token' is missing"):
        kvferry.Pool.allocate(cpu, small_shape, layout="custom:one:block,layer,kv,head,dim",
                              memory="host", blocks=8)
    for s in gen + ctx + gen_pools + ctx_pools:
        s.close()


def test_kv_scales_requantize_every_element(cpu, small_shape):
    """KV scales (a stored q stands for q * scale): context per tensor ([layer][kv], as vLLM's
    k_scale/v_scale), generation per head; the same dtype on both sides, so only the scales
    convert. Every element arrives as numpy's float32 value * src_scale / dst_scale."""
    L, kv, H = small_shape.layers, small_shape.kv_factor, small_shape.kv_heads
    ctx_scales = [0.5 + 0.25 * i for i in range(L * kv)]
    gen_scales = [0.125 + 0.0625 * i for i in range(L * kv * H)]
    fabric = kvferry.InProcFabric()
    ctx_pool = kvferry.Pool.allocate(cpu, small_shape, memory="host", blocks=8)
    gen_pools = [kvferry.Pool.allocate(cpu, small_shape, kvferry.ParallelConfig(tp=2), rank=r,
                                       memory="host", blocks=8) for r in range(2)]
    ctx = kvferry.ContextSide(cpu, ctx_pool, transport="inproc", fabric=fabric,
                              instance_secret=SECRET, kv_scales=ctx_scales)
    ctx.set_instance_addresses([ctx.address])
    gen = [kvferry.GenerationSide(cpu, p, transport="inproc", fabric=fabric, instance_id=9,
                                  kv_scales=gen_scales, kv_scales_per="head") for p in gen_pools]
    prompt_tokens = 3 * small_shape.tokens_per_block - 1
    g = kv_check.global_kv(small_shape, 3, seed=11)
    ctx_blocks, gen_blocks = [2, 5, 0], [6, 1, 3]
    kv_check.fill(ctx_pool, ctx_blocks, g)
    handle = ctx.mark_ready(3, ctx_blocks, prompt_tokens)
    for s in gen:
        s.fetch(handle, gen_blocks)
    for s in gen + [ctx]:
        (st,) = s.poll(at_least=1, timeout=10.0)
        assert st.state == kvferry.TransferState.COMPLETE, st
    src = np.array(ctx_scales, dtype=np.float32).reshape(1, L, kv, 1, 1, 1)
    dst = np.array(gen_scales, dtype=np.float32).reshape(1, L, kv, H, 1, 1)
    want = (g * src) / dst  # float32, each step rounded to nearest even
    assert not np.array_equal(want, g)
    for p in gen_pools:
        kv_check.check(p, gen_blocks, want, prompt_tokens)
    with pytest.raises(kvferry.InvalidArgumentError, match="kv scales per tensor: 3 values"):
        kvferry.GenerationSide(cpu, gen_pools[0], transport="inproc", fabric=fabric,
                               kv_scales=[1.0, 2.0, 3.0])
    with pytest.raises(kvferry.InvalidArgumentError, match="kv_scales_per"):
        kvferry.GenerationSide(cpu, gen_pools[0], transport="inproc", fabric=fabric,
                               kv_scales=ctx_scales, kv_scales_per="block")
    for s in gen + [ctx] + gen_pools + [ctx_pool]:
        s.close()


def test_per_block_scales_quantize_travel_and_dequantize(cpu):
    """Per-block scales (kv_scales_per="block", kept in the fp8 pool): fp32 -> fp8 computes each
    (block, layer, K/V, head) group's scale, largest |value| / 448, and its codes are torch's
    e4m3 of value / scale; fp8 -> fp32 back reads them, every element q * scale."""
    torch = pytest.importorskip("torch")
    f32 = kvferry.KvShape(layers=2, kv_heads=2, head_dim=16, dtype="fp32", tokens_per_block=4)
    fp8 = kvferry.KvShape(layers=2, kv_heads=2, head_dim=16, dtype="fp8", tokens_per_block=4)
    fabric = kvferry.InProcFabric()
    src = kvferry.Pool.allocate(cpu, f32, memory="host", blocks=8)
    q = kvferry.Pool.allocate(cpu, fp8, memory="host", blocks=8, block_scales=True)
    back = kvferry.Pool.allocate(cpu, f32, memory="host", blocks=8)
    assert src.block_scales is None and q.block_scale_count == 8 * 2 * 2 * 2
    g = kv_check.global_kv(f32, 3, seed=21)
    g *= np.array([0.01, 3.0, 200.0], dtype=np.float32).reshape(3, 1, 1, 1, 1, 1)
    kv_check.fill(src, [5, 1, 2], g)

    def move(ctx_pool, gen_pool, rid, ctx_blocks, gen_blocks, ctx_per, gen_per):
        ctx = kvferry.ContextSide(cpu, ctx_pool, transport="inproc", fabric=fabric,
                                  instance_secret=SECRET, kv_scales_per=ctx_per)
        ctx.set_instance_addresses([ctx.address])
        gen = kvferry.GenerationSide(cpu, gen_pool, transport="inproc", fabric=fabric,
                                     instance_id=9, kv_scales_per=gen_per)
        gen.fetch(ctx.mark_ready(rid, ctx_blocks, 12), gen_blocks)
        for s in (gen, ctx):
            (st,) = s.poll(at_least=1, timeout=10.0)
            assert st.state == kvferry.TransferState.COMPLETE, st
            s.close()

    move(src, q, 1, [5, 1, 2], [0, 6, 3], "tensor", "block")
    scales = q.block_scales.view(np.float32)
    codes = torch.from_numpy(q.region(0)).view(torch.float8_e4m3fn)
    per_block = q.block_bytes
    for i, b in enumerate([0, 6, 3]):
        block = codes[b * per_block:(b + 1) * per_block].reshape(2, 2, 2, 4, 16)
        for layer in range(2):
            for kv in range(2):
                for h in range(2):
                    x = g[i, layer, kv, h]
                    s = np.float32(np.abs(x).max()) / np.float32(448.0)
                    assert scales[q.block_scale_index(b, layer, kv, h)] == s
                    want = (torch.from_numpy(x) / torch.tensor(s)).to(torch.float8_e4m3fn)
                    got = block[layer, kv, h]
                    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (b, layer)

    move(q, back, 2, [0, 6, 3], [7, 4, 0], "block", "tensor")
    out = pool_array(back)
    for i, b in enumerate([0, 6, 3]):
        block = codes[b * per_block:(b + 1) * per_block].reshape(2, 2, 2, 4, 16)
        for layer in range(2):
            for kv in range(2):
                for h in range(2):
                    s = torch.tensor(scales[q.block_scale_index(b, layer, kv, h)])
                    want = (block[layer, kv, h].float() * s).numpy()
                    np.testing.assert_array_equal(out[[7, 4, 0][i], layer, kv, h], want)
    for p in (src, q, back):
        p.close()


def test_block_scales_attach_and_refusals(cpu):
    """A wrapped fp8 pool takes the engine's scale tensor zero copy; scales are refused on a pool
    that is not fp8 and as kv_scales values."""
    fp8 = kvferry.KvShape(layers=2, kv_heads=2, head_dim=16, dtype="fp8", tokens_per_block=4)
    pages = np.zeros((8, 2 * 2 * 2 * 4 * 16), dtype=np.uint8)
    pool = kvferry.Pool.wrap(cpu, fp8, pages, layout="block-major", blocks=8)
    assert pool.block_scales is None
    with pytest.raises(kvferry.InvalidArgumentError, match="float32"):
        pool.attach_block_scales(np.zeros(64, dtype=np.float64))
    with pytest.raises(kvferry.InvalidArgumentError, match="contiguous"):
        pool.attach_block_scales(np.zeros((pool.block_scale_count, 2), dtype=np.float32)[:, 0])
    engine_scales = np.zeros(pool.block_scale_count, dtype=np.float32)
    pool.attach_block_scales(engine_scales)
    view = pool.block_scales.view(np.float32)
    view[pool.block_scale_index(3, 1, 0, 1)] = 0.25
    assert engine_scales[pool.block_scale_index(3, 1, 0, 1)] == 0.25  # the engine's memory
    with pytest.raises(kvferry.InvalidArgumentError, match="already"):
        pool.attach_block_scales(np.zeros(pool.block_scale_count, dtype=np.float32))
    f32 = kvferry.KvShape(layers=2, kv_heads=2, head_dim=16, dtype="fp32", tokens_per_block=4)
    with pytest.raises(kvferry.InvalidArgumentError, match="fp8"):
        kvferry.Pool.allocate(cpu, f32, memory="host", blocks=8, block_scales=True)
    with pytest.raises(kvferry.InvalidArgumentError, match="takes no kv_scales"):
        kvferry.GenerationSide(cpu, pool, transport="inproc", fabric=kvferry.InProcFabric(),
                               kv_scales=[1.0] * 4, kv_scales_per="block")
    pool.close()
