"""Filling context pools from one global KV array and checking generation pools against it."""

from __future__ import annotations

import numpy as np

import kvferry
from conftest import pool_array


def global_kv(shape: kvferry.KvShape, nblocks: int, seed: int) -> np.ndarray:
    """A (blk, L, kv, H, t, d) float32 array: the request's whole cache, every rank's share."""
    rng = np.random.default_rng(seed)
    dims = (nblocks, shape.layers, shape.kv_factor, shape.kv_heads, shape.tokens_per_block,
            shape.head_dim)
    return rng.standard_normal(dims, dtype=np.float32)


def _share(pool: kvferry.Pool, g: np.ndarray) -> np.ndarray:
    s = pool.slice
    return g[:, s.layer_begin:s.layer_begin + s.layer_count, :,
             s.head_begin:s.head_begin + s.head_count]


def fill(pool: kvferry.Pool, blocks: list[int], g: np.ndarray) -> None:
    """Writes this rank's share of `g` into `blocks` (block-major pools)."""
    pool_array(pool)[blocks] = _share(pool, g)


def check(pool: kvferry.Pool, blocks: list[int], g: np.ndarray, prompt_tokens: int) -> None:
    """Asserts that `blocks` hold this rank's share of `g` for the first prompt_tokens tokens."""
    got = pool_array(pool)[blocks]
    want = _share(pool, g)
    tpb = g.shape[4]
    for i in range(len(blocks)):
        n = min(tpb, prompt_tokens - i * tpb)
        np.testing.assert_array_equal(got[i, :, :, :, :n], want[i, :, :, :, :n])
