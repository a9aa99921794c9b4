"""Shared fixtures: a CPU device, small shapes, helpers to view pools as 6-D arrays."""

from __future__ import annotations

import numpy as np
import pytest

import kvferry

HAS_GPU = any(name.startswith("cuda") for name in kvferry.list_devices())


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="no CUDA GPU on this machine")
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip_gpu)


@pytest.fixture
def cpu():
    with kvferry.Device("cpu") as dev:
        yield dev


@pytest.fixture
def small_shape():
    # fp32 so that numpy can view elements directly.
    return kvferry.KvShape(layers=4, kv_heads=4, head_dim=8, dtype="fp32", tokens_per_block=4)


def pool_array(pool: kvferry.Pool, region: int = 0) -> np.ndarray:
    """Region `region` of a host pool as a (blk, L, kv, h, t, d) float32 array (zero copy).

    For per-layer pools each region holds one layer: the layer axis has size 1.
    """
    raw = pool.region(region).view(np.float32)
    dims = list(pool.dims)
    strides = [s * 4 for s in pool.strides]
    if pool.num_regions > 1:
        dims[1] = 1
    return np.lib.stride_tricks.as_strided(raw, shape=dims, strides=strides)
