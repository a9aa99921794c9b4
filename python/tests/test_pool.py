"""Pools: allocation, zero-copy region views, lifetimes."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import kvferry
from conftest import pool_array


def test_allocate_block_major(cpu, small_shape):
    pool = kvferry.Pool.allocate(cpu, small_shape, blocks=6)
    assert pool.blocks == 6 and pool.num_regions == 1
    assert pool.dims == [6, 4, 2, 4, 4, 8]
    assert pool.block_bytes == 4 * 2 * 4 * 4 * 8 * 4
    assert pool.region_bytes == 6 * pool.block_bytes
    assert "block-major" in pool.layout
    # Consecutive blocks of a block-major pool coalesce into one extent.
    assert pool.block_extents([1, 2, 3]) == [(0, pool.block_bytes, 3 * pool.block_bytes)]


def test_region_view_is_zero_copy(cpu, small_shape):
    pool = kvferry.Pool.allocate(cpu, small_shape, layout="per-layer", memory="host", blocks=3)
    assert pool.num_regions == 4
    a = pool.region(2)
    b = pool.region(2)
    a[:] = 7
    assert int(b[0]) == 7 and int(b[-1]) == 7  # same memory
    v = pool_array(pool, 2)
    v[1, 0, 1, 2, 3, :] = np.arange(8, dtype=np.float32)
    assert pool_array(pool, 2)[1, 0, 1, 2, 3, 5] == 5.0


def test_view_outlives_closed_pool_and_device(small_shape):
    dev = kvferry.Device("cpu")
    pool = kvferry.Pool.allocate(dev, small_shape, blocks=2)
    view = pool.region(0)
    view[:] = 3
    pool.close()
    dev.close()
    with pytest.raises(kvferry.ClosedError):
        pool.region(0)
    gc.collect()
    assert int(view.sum()) == 3 * view.size  # memory still valid: the view holds it


def test_with_block_closes(cpu, small_shape):
    with kvferry.Pool.allocate(cpu, small_shape, blocks=2) as pool:
        assert not pool.closed
    assert pool.closed
    with pytest.raises(kvferry.ClosedError):
        pool.blocks


def test_bad_pool_arguments(cpu, small_shape):
    with pytest.raises(kvferry.InvalidArgumentError, match="blocks"):
        kvferry.Pool.allocate(cpu, small_shape, blocks=0)
    with pytest.raises(kvferry.InvalidArgumentError, match="layout"):
        kvferry.Pool.allocate(cpu, small_shape, layout="diagonal", blocks=2)
    with pytest.raises(kvferry.InvalidArgumentError, match="memory"):
        kvferry.Pool.allocate(cpu, small_shape, memory="flash", blocks=2)
    with pytest.raises(kvferry.InvalidArgumentError):
        kvferry.Pool.allocate(cpu, small_shape, kvferry.ParallelConfig(tp=2), rank=5, blocks=2)
    pool = kvferry.Pool.allocate(cpu, small_shape, blocks=2)
    with pytest.raises(kvferry.InvalidArgumentError, match="region"):
        pool.region(1)
    with pytest.raises(kvferry.InvalidArgumentError):
        pool.block_extents([2])
    with pytest.raises(TypeError):
        kvferry.Pool.allocate("cpu", small_shape, blocks=2)
