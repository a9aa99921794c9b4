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


def test_ids_and_moves_as_arrays(cpu, small_shape):
    torch = pytest.importorskip("torch")
    primary = kvferry.Pool.allocate(cpu, small_shape, memory="device", blocks=6)
    host = kvferry.Pool.allocate(cpu, small_shape, memory="pinned", blocks=6)
    p, h = pool_array(primary), pool_array(host)
    p[...] = np.random.default_rng(7).standard_normal(p.shape, dtype=np.float32)
    before = p.copy()
    with kvferry.TransferManager(cpu, primary, host) as tm:
        # N x 2 (numpy int64, int32, a strided view) and N x 3 (torch) arrays, as tuples do.
        tm.offload(np.array([[0, 3], [1, 4]], dtype=np.int64)).wait(timeout=10.0)
        tm.offload(np.array([[9, 5, 9], [2, 0, 9]], dtype=np.int32)[:, :2][1:]).wait(timeout=10.0)
        np.testing.assert_array_equal(h[[3, 4, 0]], before[[0, 1, 2]])
        p[...] = 0
        tm.onboard(torch.tensor([[3, 5, 2]], dtype=torch.int64)).wait(timeout=10.0)
        np.testing.assert_array_equal(p[5][..., :2, :], before[0][..., :2, :])
        assert not p[5][..., 2:, :].any()
        for bad in (np.zeros((2, 4), dtype=np.int64), np.zeros((2, 2), dtype=np.float32),
                    np.zeros(4, dtype=np.int64)):
            with pytest.raises(kvferry.InvalidArgumentError):
                tm.offload(bad)
    shape = kvferry.KvShape(layers=1, kv_heads=1, head_dim=4, dtype="fp16", tokens_per_block=4)
    small = kvferry.Pool.allocate(cpu, shape, memory="device", blocks=8)
    tm = kvferry.TransferManager(cpu, small)
    with kvferry.BlockManager(tm, model_id="arrays") as bm:
        a = bm.add_sequence(1, np.arange(8, dtype=np.int32))
        assert isinstance(a["blocks"], np.ndarray) and a["blocks"].dtype == np.int64
        assert len(a["blocks"]) == 2 and a["ready"]
        bm.append_tokens(1, torch.arange(8, 12))
        np.testing.assert_array_equal(bm.blocks(1)[:2], a["blocks"])
        assert len(bm.blocks(1)) == 3
        bm.remove_sequence(1)
        # The same prompt as a list, a numpy int64 array and a torch tensor: one prefix.
        b = bm.add_sequence(2, list(range(8)))
        assert b["reused_tokens"] == 8
        assert small.block_extents(b["blocks"]) == small.block_extents(list(b["blocks"]))
        with pytest.raises(kvferry.InvalidArgumentError, match="prompt"):
            bm.add_sequence(3, np.zeros((2, 2), dtype=np.int32))
        with pytest.raises(kvferry.InvalidArgumentError, match="prompt"):
            bm.add_sequence(3, np.zeros(4, dtype=np.float64))
        with pytest.raises(kvferry.InvalidArgumentError, match="out of range"):
            bm.add_sequence(3, np.array([2**40], dtype=np.int64))
        with pytest.raises(kvferry.InvalidArgumentError, match="not an int"):
            bm.add_sequence(3, [1, "x"])
    tm.close()


def _conversation(c: int) -> list[int]:
    return [c * 100 + i for i in range(8)]  # two blocks of 4 tokens


def _fill(tm, pool_arr: np.ndarray, blocks, c: int) -> None:
    # The blocks may be the source of an eviction's offload still queued: as an engine's compute
    # stream would (sync_with_compute), wait for the copies before writing them.
    tm.drain(timeout=10.0)
    for j, b in enumerate(blocks):
        pool_arr[b] = c * 10 + j


def _expect(pool_arr: np.ndarray, blocks, c: int) -> None:
    for j, b in enumerate(blocks):
        assert (pool_arr[b] == c * 10 + j).all(), f"conversation {c} block {j}"


def test_file_tier_survives_a_restart(cpu, small_shape, tmp_path):
    """Blocks evicted to the file tier are served again by a new store, manager and pools on the
    same directory: found as prefix hits, onboarded (wait_ready), bytes intact."""
    def tiers(store):
        primary = kvferry.Pool.allocate(cpu, small_shape, memory="device", blocks=2)
        host = kvferry.Pool.allocate(cpu, small_shape, memory="pinned", blocks=2)
        return primary, kvferry.TransferManager(cpu, primary, host, file=store)

    probe = kvferry.Pool.allocate(cpu, small_shape, memory="device", blocks=1)
    with kvferry.SlabStore(str(tmp_path), probe.block_bytes, 8, slots_per_file=4) as store:
        assert store.capacity == 8 and store.free_slots == 8 and store.recovered == []
        assert store.backend["name"] in ("posix", "io_uring")
        primary, tm = tiers(store)
    p = pool_array(primary)
    with tm, kvferry.BlockManager(tm, model_id="restart") as bm:
        for c in range(1, 5):  # conversations 2 and 3 end up in the file tier
            a = bm.add_sequence(c, _conversation(c))
            _fill(tm, p, a["blocks"], c)
            bm.remove_sequence(c)
        tm.drain(timeout=10.0)
        bm.poll()
        in_files = bm.stats["cached"][2]
        assert in_files >= 4  # the background watermark may demote more
    # The old manager is gone: the directory lock is free again.
    with kvferry.SlabStore(str(tmp_path), probe.block_bytes, 8, slots_per_file=4) as store:
        assert len(store.recovered) == in_files
        primary, tm = tiers(store)
    p = pool_array(primary)
    with tm, kvferry.BlockManager(tm, model_id="restart") as bm:
        assert bm.stats["recovered"] == in_files
        for c in (2, 3):
            a = bm.add_sequence(10 + c, np.array(_conversation(c), dtype=np.int64))
            assert a["hits"][2] == 2
            r = bm.wait_ready(10 + c, timeout=10.0)
            assert r["ready"] and r["reused_tokens"] == 8 and r["misses"] == []
            assert bm.poll_ready(10 + c)["ready"]
            _expect(p, a["blocks"], c)
            bm.remove_sequence(10 + c)
        with pytest.raises(kvferry.NotFoundError):
            bm.poll_ready(77)


def test_store_is_locked_and_bad_options_refused(cpu, small_shape, tmp_path):
    with kvferry.SlabStore(str(tmp_path), 4096, 4) as store:
        with pytest.raises(kvferry.UnavailableError):
            kvferry.SlabStore(str(tmp_path), 4096, 4)
        primary = kvferry.Pool.allocate(cpu, small_shape, memory="device", blocks=2)
        tm = kvferry.TransferManager(cpu, primary, file=store)
    store.close()
    with pytest.raises(kvferry.ClosedError):
        store.capacity
    # The manager still holds the store (and its lock) until it goes.
    with pytest.raises(kvferry.UnavailableError):
        kvferry.SlabStore(str(tmp_path), 4096, 4)
    tm.close()
    kvferry.SlabStore(str(tmp_path), 4096, 4).close()
    with pytest.raises(kvferry.NotFoundError):
        kvferry.SlabStore(str(tmp_path / "missing"), 4096, 4)
    with pytest.raises(kvferry.InvalidArgumentError):
        kvferry.SlabStore(str(tmp_path), 4096, 4, recover="sometimes")


def test_prefetch_onboards_before_the_sequence_starts(cpu, small_shape):
    primary = kvferry.Pool.allocate(cpu, small_shape, memory="device", blocks=4)
    host = kvferry.Pool.allocate(cpu, small_shape, memory="pinned", blocks=4)
    p = pool_array(primary)
    with kvferry.TransferManager(cpu, primary, host) as tm, \
            kvferry.BlockManager(tm, model_id="prefetch") as bm:
        a = bm.add_sequence(1, _conversation(1))
        _fill(tm, p, a["blocks"], 1)
        bm.remove_sequence(1)
        bm.add_sequence(2, list(range(900, 916)))  # takes every primary block: 1 goes to host
        bm.remove_sequence(2)
        tm.drain(timeout=10.0)
        bm.poll()
        assert bm.stats["cached"][1] >= 2
        assert bm.prefetch(np.array(_conversation(1))) == 2
        tm.drain(timeout=10.0)
        bm.poll()
        b = bm.add_sequence(3, _conversation(1))
        assert b["hits"][0] == 2 and b["reused_tokens"] == 8 and bm.stats["prefetched"] == 2
        _expect(p, b["blocks"], 1)
        key = bm.drain_events()[0]["key"]
        where = bm.find(key)
        assert where is not None and where[0] in (kvferry.Tier.PRIMARY, kvferry.Tier.HOST)
        assert bm.find(12345) is None
        with pytest.raises(kvferry.InvalidArgumentError):
            bm.find(-1)


def test_wrap_raw_byte_pages(cpu, small_shape):
    """An engine that keeps each block as one byte page ([blocks, block_bytes] uint8) wraps it
    with the layout its bytes follow; offload and onboard move the same bytes as a typed pool."""
    typed = kvferry.Pool.allocate(cpu, small_shape, memory="device", blocks=4)
    pages = np.zeros((4, typed.block_bytes), dtype=np.uint8)
    raw = kvferry.Pool.wrap(cpu, small_shape, [pages], layout="block-major", blocks=4)
    assert raw.block_bytes == typed.block_bytes and raw.wrapped
    host = kvferry.Pool.allocate(cpu, small_shape, memory="pinned", blocks=4)
    rng = np.random.default_rng(3)
    pages[...] = rng.integers(0, 256, pages.shape, dtype=np.uint8)
    with kvferry.TransferManager(cpu, raw, host) as tm:
        tm.offload([(2, 0)]).wait(timeout=10.0)
        np.testing.assert_array_equal(host.region(0)[: typed.block_bytes], pages[2])
        want = pages[2].copy()
        pages[...] = 0
        tm.onboard([(0, 1)]).wait(timeout=10.0)
        np.testing.assert_array_equal(pages[1], want)
    with pytest.raises(kvferry.InvalidArgumentError):
        kvferry.Pool.wrap(cpu, small_shape, [np.zeros((4, typed.block_bytes), dtype=np.int16)],
                          layout="block-major", blocks=4)
