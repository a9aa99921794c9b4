"""CUDA cases: pools in GPU memory seen by torch through DLPack, transfers between GPU pools.
Skipped where no GPU is present (conftest)."""

from __future__ import annotations

import pytest

import kvferry

pytestmark = pytest.mark.gpu


def test_gpu_pool_region_is_a_torch_cuda_tensor():
    torch = pytest.importorskip("torch")
    with kvferry.Device("cuda:0") as dev:
        shape = kvferry.KvShape(layers=2, kv_heads=2, head_dim=8, dtype="fp16", tokens_per_block=4)
        pool = kvferry.Pool.allocate(dev, shape, memory="device", blocks=4)
        t = torch.from_dlpack(pool.region(0))
        assert t.is_cuda and t.numel() == pool.region_bytes
        t.fill_(3)
        assert int(torch.from_dlpack(pool.region(0))[-1]) == 3
        pool.close()


def test_gpu_transfer_inproc():
    torch = pytest.importorskip("torch")
    with kvferry.Device("cuda:0") as dev:
        shape = kvferry.KvShape(layers=2, kv_heads=4, head_dim=8, dtype="fp32", tokens_per_block=4)
        fabric = kvferry.InProcFabric()
        src = kvferry.Pool.allocate(dev, shape, memory="device", blocks=4)
        dst = kvferry.Pool.allocate(dev, shape, memory="device", blocks=4)
        s = torch.from_dlpack(src.region(0)).view(torch.float32)
        s.copy_(torch.randn(s.numel(), device="cuda"))
        torch.cuda.synchronize()
        with kvferry.ContextSide(dev, src, transport="inproc", fabric=fabric,
                                 instance_secret=b"k" * 16) as ctx, \
                kvferry.GenerationSide(dev, dst, transport="inproc", fabric=fabric) as gen:
            ctx.set_instance_addresses([ctx.address])
            gen.fetch(ctx.mark_ready(1, [0, 1], 8), [2, 3])
            (st,) = gen.poll(at_least=1, timeout=30.0)
            assert st.ok, st
        d = torch.from_dlpack(dst.region(0)).view(torch.float32)
        half = d.numel() // 2
        assert torch.equal(d[half:], s[:half])


def test_gpu_wrap_torch_cuda_tensors_layer_wise_on_a_torch_event():
    torch = pytest.importorskip("torch")
    shape = kvferry.KvShape(layers=2, kv_heads=2, head_dim=8, dtype="fp16", tokens_per_block=4)
    src = [torch.randn(16, 2, 8, dtype=torch.float16, device="cuda") for _ in range(4)]
    dst = [torch.zeros_like(t) for t in src]
    with kvferry.Device("cuda:0") as dev:
        sp = kvferry.Pool.wrap(dev, shape, src, layout="per-layer-kv", blocks=4)
        dp = kvferry.Pool.wrap(dev, shape, dst, layout="per-layer-kv", blocks=4)
        fabric = kvferry.InProcFabric()
        with kvferry.ContextSide(dev, sp, transport="inproc", fabric=fabric,
                                 instance_secret=b"g" * 16) as ctx, \
                kvferry.GenerationSide(dev, dp, transport="inproc", fabric=fabric) as gen:
            ctx.set_instance_addresses([ctx.address])
            gen.fetch(ctx.begin_layer_wise(1, [0, 1], 8), [2, 3])
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream())
            ctx.mark_layer_ready_on(1, shape.layers - 1, dev.wrap_event(event))
            (st,) = gen.poll(at_least=1, timeout=30.0)
            assert st.ok, st
        for s, d in zip(src, dst):
            assert torch.equal(d[8:16], s[0:8])
    with kvferry.Device("cpu") as cpu:
        with pytest.raises(kvferry.InvalidArgumentError, match="cuda"):
            kvferry.Pool.wrap(cpu, shape, src, layout="per-layer-kv", blocks=4)
