"""Pools wrapping the engine's own arrays (numpy, torch) through DLPack, zero copy."""

from __future__ import annotations

import numpy as np
import pytest

import kvferry
from conftest import pool_array

SECRET = b"wrap-test-secret"


def kv_arrays(shape, blocks, heads=None, fill=None, seed=0):
    """Per (layer, kv) arrays [blocks * T, H, D] (vLLM/SGLang NHD K and V tensors)."""
    rng = np.random.default_rng(seed)
    heads = heads or shape.kv_heads
    out = []
    for _ in range(shape.layers * 2):
        a = np.zeros((blocks * shape.tokens_per_block, heads, shape.head_dim), np.float32)
        if fill is None:
            a[...] = rng.standard_normal(a.shape, dtype=np.float32)
        out.append(a)
    return out


def test_wrap_numpy_is_zero_copy(cpu, small_shape):
    arrays = kv_arrays(small_shape, 3)
    pool = kvferry.Pool.wrap(cpu, small_shape, arrays, layout="per-layer-kv", blocks=3)
    assert pool.num_regions == small_shape.layers * 2
    view = pool.region(5).view(np.float32)
    arrays[5][0, 0, 0] = 123.0
    assert view[0] == 123.0  # the pool's region is the array's memory
    pool.close()
    del view


def test_transfer_from_wrapped_numpy_into_wrapped_numpy(cpu, small_shape):
    fabric = kvferry.InProcFabric()
    src = kv_arrays(small_shape, 4, seed=1)
    dst = kv_arrays(small_shape, 4, fill=0)
    sp = kvferry.Pool.wrap(cpu, small_shape, src, layout="per-layer-kv", blocks=4)
    dp = kvferry.Pool.wrap(cpu, small_shape, dst, layout="per-layer-kv", blocks=4)
    with kvferry.ContextSide(cpu, sp, transport="inproc", fabric=fabric,
                             instance_secret=SECRET) as ctx, \
            kvferry.GenerationSide(cpu, dp, transport="inproc", fabric=fabric) as gen:
        ctx.set_instance_addresses([ctx.address])
        gen.fetch(ctx.mark_ready(1, [1, 2], 7), [3, 0])
        (st,) = gen.poll(at_least=1, timeout=10.0)
        assert st.ok, st
    t = small_shape.tokens_per_block
    for s, d in zip(src, dst):
        np.testing.assert_array_equal(d[3 * t:4 * t], s[1 * t:2 * t])
        np.testing.assert_array_equal(d[0:3], s[2 * t:2 * t + 3])  # 7 tokens: 4 + 3
        assert not d[3:t].any()


def test_wrap_torch_tensors():
    torch = pytest.importorskip("torch")
    shape = kvferry.KvShape(layers=2, kv_heads=2, head_dim=8, dtype="bf16", tokens_per_block=4)
    tensors = [torch.zeros(2, 8, 2, 8, dtype=torch.bfloat16) for _ in range(4)]
    with kvferry.Device("cpu") as dev:
        pool = kvferry.Pool.wrap(dev, shape, tensors, layout="per-layer-kv", blocks=4)
        tensors[3].fill_(2.0)
        assert torch.from_dlpack(pool.region(3)).view(torch.bfloat16).eq(2.0).all()
        pool.close()


def test_wrap_bad_input_names_the_problem(cpu, small_shape):
    good = kv_arrays(small_shape, 2)
    with pytest.raises(kvferry.InvalidArgumentError, match="fp32"):
        kvferry.Pool.wrap(cpu, small_shape, [a.astype(np.float16) for a in good],
                          layout="per-layer-kv", blocks=2)
    with pytest.raises(kvferry.InvalidArgumentError, match="contiguous"):
        kvferry.Pool.wrap(cpu, small_shape, [a.transpose(1, 0, 2) for a in good],
                          layout="per-layer-kv", blocks=2)
    with pytest.raises(kvferry.InvalidArgumentError):
        kvferry.Pool.wrap(cpu, small_shape, good[:3], layout="per-layer-kv", blocks=2)
    with pytest.raises(kvferry.InvalidArgumentError):
        kvferry.Pool.wrap(cpu, small_shape, good, layout="per-layer-kv", blocks=5)  # too small
    with pytest.raises(kvferry.InvalidArgumentError, match="DLPack"):
        kvferry.Pool.wrap(cpu, small_shape, [[1, 2, 3]] * 8, layout="per-layer-kv", blocks=2)
    with pytest.raises(kvferry.InvalidArgumentError, match="layout"):
        kvferry.Pool.wrap(cpu, small_shape, good, layout="zigzag", blocks=2)
