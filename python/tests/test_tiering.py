"""TransferManager and BlockManager from Python."""

from __future__ import annotations

import numpy as np
import pytest

import kvferry
from conftest import pool_array


def test_offload_and_onboard_copy_blocks(cpu, small_shape):
    primary = kvferry.Pool.allocate(cpu, small_shape, memory="device", blocks=6)
    host = kvferry.Pool.allocate(cpu, small_shape, memory="pinned", blocks=6)
    rng = np.random.default_rng(5)
    p, h = pool_array(primary), pool_array(host)
    p[...] = rng.standard_normal(p.shape, dtype=np.float32)
    before = p.copy()
    with kvferry.TransferManager(cpu, primary, host) as tm:
        batch = tm.offload([(0, 3), (1, 4), (5, 0)])
        batch.wait(timeout=10.0)
        assert batch.query() and len(batch) == 3 and batch.items == [None, None, None]
        assert batch.descriptors == 2  # blocks 0, 1 -> 3, 4 coalesce
        np.testing.assert_array_equal(h[[3, 4, 0]], before[[0, 1, 5]])
        p[...] = 0
        tm.onboard([(3, 2), (0, 1, 2)]).wait(timeout=10.0)  # block 1: first 2 tokens only
        np.testing.assert_array_equal(p[2], before[0])
        np.testing.assert_array_equal(p[1][..., :2, :], before[5][..., :2, :])
        assert not p[1][..., 2:, :].any()
        assert tm.stats["blocks"] == 5 and tm.stats["bytes"] > 0
        with pytest.raises(kvferry.InvalidArgumentError):
            tm.offload([(0, 99)])
        with pytest.raises(kvferry.InvalidArgumentError):
            tm.offload([(0,)])
        tm.drain(timeout=10.0)
    with pytest.raises(kvferry.ClosedError):
        tm.offload([(0, 1)])


def test_block_manager_reuses_prefixes_and_offloads(cpu):
    shape = kvferry.KvShape(layers=2, kv_heads=2, head_dim=8, dtype="fp16", tokens_per_block=4)
    primary = kvferry.Pool.allocate(cpu, shape, memory="device", blocks=4)
    host = kvferry.Pool.allocate(cpu, shape, memory="pinned", blocks=8)
    tm = kvferry.TransferManager(cpu, primary, host)
    with kvferry.BlockManager(tm, model_id="test-model") as bm:
        prompt = list(range(12))  # 3 full blocks
        a = bm.add_sequence(1, prompt)
        assert len(a["blocks"]) == 3 and a["reused_tokens"] == 0
        bm.remove_sequence(1)
        b = bm.add_sequence(2, prompt + [99])
        # All three blocks are found again; the watermark may already have moved one of them to
        # the host tier (it keeps the largest recent allocation free, up to half the pool).
        assert sum(b["hits"]) == 3 and b["hits"][0] >= 2 and b["reused_tokens"] == 12
        bm.remove_sequence(2)
        # Another prompt that needs every primary block evicts the cached ones to the host tier.
        bm.add_sequence(3, list(range(100, 116)))
        assert bm.stats["offloaded"] > 0
        kinds = {e["kind"] for e in bm.drain_events()}
        assert {"stored", "moved"} <= kinds
        with pytest.raises(kvferry.ResourceExhaustedError):
            bm.add_sequence(4, list(range(200, 216)))
        with pytest.raises(kvferry.NotFoundError):
            bm.blocks(77)
        bm.remove_sequence(3)
        c = bm.add_sequence(5, prompt)
        assert c["hits"][1] > 0  # onboarded from the host tier
    tm.close()
