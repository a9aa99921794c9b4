"""kvferry's vLLM offloading backend without vLLM: the manager's index, eviction and recovery, and
the worker moving blocks between torch tensors shaped as vLLM's canonical KV pages
([blocks, page_bytes] int8 per layer) and the host / file tiers, across a restart."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

import kvferry
from kvferry.integrations import offload_worker
from kvferry.integrations import vllm_offload as vo

torch = pytest.importorskip("torch")

DIGEST = vo.identity_digest({"model": "m"})


def ok(i: int) -> bytes:
    return i.to_bytes(32, "big") + (0).to_bytes(4, "big")  # an OffloadKey: hash + group 0


def stored(m: vo.KvferryOffloadingManager, keys):
    to_store, where, evicted = m.prepare_store(keys)
    m.complete_store(to_store)
    return to_store, where, evicted


def test_store_lookup_load_and_host_lru():
    m = vo.KvferryOffloadingManager(DIGEST, host_blocks=2, file_slots=0, enable_events=True)
    to_store, where, evicted = m.prepare_store([ok(1), ok(2)])
    assert to_store == [ok(1), ok(2)] and where.host.tolist() == [0, 1] and evicted == []
    assert where.slots.tolist() == [-1, -1]
    assert where.keys == [vo.slot_key(DIGEST, ok(1)), vo.slot_key(DIGEST, ok(2))]
    assert m.lookup(ok(1)) == "pending"  # stored only at complete_store
    m.complete_store([ok(1), ok(2)])
    assert m.lookup(ok(1)) == "hit" and m.lookup(ok(3)) == "miss"
    assert m.prepare_store([ok(1)])[0] == []  # already stored
    m.touch([ok(1)])  # ok(2) is now the least recently used
    _, where, evicted = stored(m, [ok(3)])
    assert evicted == [ok(2)] and where.host.tolist() == [1] and m.lookup(ok(2)) == "miss"
    # A block being loaded is not evicted; nothing evictable: the store is skipped.
    spec = m.prepare_load([ok(1), ok(3)])
    assert spec.host.tolist() == [0, 1]
    assert m.prepare_store([ok(4)])[0] == [] and m.stats.store_skipped == 1
    m.complete_load([ok(1), ok(3)])
    assert stored(m, [ok(4)])[2] == [ok(1)]
    kinds = [(tier, removed) for _, tier, removed in m.take_events()]
    assert ("host", False) in kinds and ("host", True) in kinds
    assert m.take_events() == []


def test_file_tier_keeps_blocks_the_host_tier_evicts():
    m = vo.KvferryOffloadingManager(DIGEST, host_blocks=1, file_slots=3)
    _, where, _ = stored(m, [ok(1)])
    assert where.host.tolist() == [0] and where.slots.tolist() == [0]
    _, where, evicted = stored(m, [ok(2)])
    assert evicted == [] and m.where(ok(1)) == (-1, 0)  # host copy gone, slot kept
    assert m.lookup(ok(1)) == "hit" and m.source(ok(1)) == "disk" and m.source(ok(2)) == "host"
    load = m.prepare_load([ok(1), ok(2)])
    assert load.host.tolist() == [-1, 0] and load.slots.tolist() == [0, -1]
    m.complete_load([ok(1), ok(2)])
    stored(m, [ok(3)])
    _, _, evicted = stored(m, [ok(4)])  # file tier full: its LRU block (1) leaves every tier
    assert evicted == [ok(1)] and m.lookup(ok(1)) == "miss"
    # A failed store frees what it took.
    to_store, where, _ = m.prepare_store([ok(5)])
    m.complete_store(to_store, success=False)
    assert m.lookup(ok(5)) == "miss" and m.stats.evicted_file == 2


def test_loads_from_files_promote_into_the_host_tier():
    m = vo.KvferryOffloadingManager(DIGEST, host_blocks=1, file_slots=3, enable_events=True)
    stored(m, [ok(1)])
    stored(m, [ok(2)])  # the host block goes to 2; 1 keeps its slot only
    assert m.where(ok(1)) == (-1, 0) and m.where(ok(2)) == (0, 1)
    m.take_events()
    # Loading 1 from its slot takes the host tier's LRU block (2's, not held) for a copy.
    a = m.prepare_load([ok(1)])
    assert a.host.tolist() == [-1] and a.slots.tolist() == [0] and a.promote.tolist() == [0]
    assert m.where(ok(2)) == (-1, 1) and m.where(ok(1)) == (0, 0)
    # Until the promoting load completes the copy is not there: lookups and loads use the slot.
    assert m.source(ok(1)) == "disk"
    b = m.prepare_load([ok(1)])  # a second load meanwhile: from the slot, no second promotion
    assert b.host.tolist() == [-1] and b.slots.tolist() == [0] and b.promote.tolist() == [-1]
    m.complete_load([ok(1)])
    assert m.source(ok(1)) == "disk" and m.stats.promoted == 0  # one load still holds it
    m.complete_load([ok(1)])
    assert m.source(ok(1)) == "host" and m.stats.promoted == 1
    assert m.take_events() == [([ok(2)], "host", True), ([ok(1)], "host", False)]
    c = m.prepare_load([ok(1)])
    assert c.host.tolist() == [0] and c.slots.tolist() == [-1] and c.promote.tolist() == [-1]
    # The only host block is held by that load: loading 2 from files promotes nothing.
    d = m.prepare_load([ok(2)])
    assert d.promote.tolist() == [-1] and m.where(ok(1)) == (0, 0)
    m.complete_load([ok(1)])
    m.complete_load([ok(2)])
    # Nor does a load take the host copy of a block it loads itself.
    e = m.prepare_load([ok(1), ok(2)])
    assert e.host.tolist() == [0, -1] and e.promote.tolist() == [-1, -1]
    m.complete_load([ok(1), ok(2)])
    # A promoting load that fails: the block is forgotten with the host block it took.
    f = m.prepare_load([ok(2)])
    assert f.promote.tolist() == [0] and m.where(ok(1)) == (-1, 0)
    m.take_events()
    m.complete_load([ok(2)])
    m.discard([f.keys[0]])  # the connector reports the failed block right after
    assert m.where(ok(2)) is None and m.stats.discarded == 1
    assert ([ok(2)], "file", True) in m.take_events()
    _, where, _ = stored(m, [ok(3)])  # the host block and slot are free again
    assert where.host.tolist() == [0] and where.slots.tolist() == [1]
    # No host tier, or promotion off (kvferry_promote): nothing is promoted.
    n = vo.KvferryOffloadingManager(DIGEST, host_blocks=0, file_slots=2)
    stored(n, [ok(1)])
    assert n.prepare_load([ok(1)]).promote.tolist() == [-1]
    off = vo.OffloadOptions.from_extra({"kvferry_host_blocks": 1, "kvferry_promote": "false"})
    n = vo.KvferryOffloadingManager(DIGEST, host_blocks=1, file_slots=2, promote=off.promote)
    stored(n, [ok(1)])
    stored(n, [ok(2)])
    assert n.prepare_load([ok(1)]).promote.tolist() == [-1] and n.where(ok(2)) == (0, 1)
    with pytest.raises(ValueError, match="not a boolean"):
        vo.OffloadOptions.from_extra({"kvferry_host_blocks": 1, "kvferry_promote": "maybe"})


def test_recovered_slots_are_hits_and_keep_their_slots():
    keys = [vo.slot_key(DIGEST, ok(i)) for i in range(3)]
    m = vo.KvferryOffloadingManager(DIGEST, host_blocks=0, file_slots=4,
                                    recovered=[(2, keys[0]), (0, keys[1])])
    assert m.stats.recovered == 2
    assert m.lookup(ok(0)) == "hit" and m.lookup(ok(1)) == "hit" and m.lookup(ok(2)) == "miss"
    assert m.stats.hits_recovered == 2 and m.where(ok(0)) == (-1, 2)
    _, where, _ = stored(m, [ok(2), ok(3)])
    assert sorted(where.slots.tolist()) == [1, 3]  # the free ones
    # Another identity gives other keys: nothing of the files is found.
    other = vo.KvferryOffloadingManager(vo.identity_digest({"model": "x"}), 0, 4,
                                        recovered=[(2, keys[0])])
    assert other.lookup(ok(0)) == "miss"


def test_a_block_whose_load_failed_is_forgotten():
    m = vo.KvferryOffloadingManager(DIGEST, host_blocks=0, file_slots=2, enable_events=True)
    stored(m, [ok(1), ok(2)])
    spec = m.prepare_load([ok(1)])
    m.discard([spec.keys[0]])  # reported while its load still holds it
    assert m.lookup(ok(1)) == "miss" and m.where(ok(1)) == (-1, 0)
    m.complete_load([ok(1)])
    assert m.where(ok(1)) is None and m.stats.discarded == 1
    assert ([ok(1)], "file", True) in m.take_events()
    _, where, evicted = stored(m, [ok(1)])  # recomputed, stored again in the freed slot
    assert where.slots.tolist() == [0] and evicted == [] and m.lookup(ok(1)) == "hit"
    m.discard([vo.slot_key(DIGEST, ok(2))])  # not held: forgotten at once
    assert m.where(ok(2)) is None


def test_options_and_identity(tmp_path):
    o = vo.OffloadOptions.from_extra({"spec_name": "x", "kvferry_host_blocks": "8"})
    assert o.host_blocks == 8 and o.file_slots == 0
    with pytest.raises(ValueError, match="kvferry_hosts"):
        vo.OffloadOptions.from_extra({"kvferry_hosts": 1})
    with pytest.raises(ValueError, match="go together"):
        vo.OffloadOptions.from_extra({"kvferry_file_dir": str(tmp_path)})
    with pytest.raises(ValueError, match="no tier"):
        vo.OffloadOptions.from_extra({})
    ident = {"format": vo.FORMAT, "model": "a", "dtype": "float32"}
    assert vo.check_identity(str(tmp_path), ident) is None
    (tmp_path / vo.IDENTITY_FILE).write_text(json.dumps(ident))
    assert vo.check_identity(str(tmp_path), ident) is None
    why = vo.check_identity(str(tmp_path), dict(ident, dtype="bfloat16"))
    assert "dtype differ" in why and "bfloat16" in why


# -- the worker, on torch tensors shaped as vLLM's canonical pages

LAYERS, BLOCKS, TPB, PAGE = 3, 8, 4, 4 * 2 * 16  # page: tokens x (K, V) x 16 bytes


def kv_tensors(seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(-128, 127, (BLOCKS, PAGE), dtype=torch.int8, generator=g)
            for _ in range(LAYERS)]


def finish(w: vo.KvferryOffloadingWorker, job_id: int):
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        for j, success, nbytes, _ in w.get_finished():
            assert j == job_id
            return success, nbytes
        time.sleep(0.005)
    raise AssertionError(f"job {job_id} did not finish")


def open_tier(tmp_path, tensors, identity, engine="e1", host=2, slots=6):
    o = vo.OffloadOptions(host_blocks=host, file_dir=str(tmp_path), file_slots=slots)
    w = vo.KvferryOffloadingWorker(tensors, TPB, o, identity, rank=0, engine_id=engine,
                                   report_load_errors=True)
    recovered, why = vo.read_sessions(str(tmp_path), 1, identity, engine)
    m = vo.KvferryOffloadingManager(vo.identity_digest(identity), host, 0 if why else slots,
                                    recovered)
    return w, m, why


def test_worker_round_trip_restart_and_corruption(tmp_path):
    ident = {"format": vo.FORMAT, "model": "tiny", "dtype": "int8"}
    kv = kv_tensors(1)
    want = [t.clone() for t in kv]
    w, m, why = open_tier(tmp_path, kv, ident)
    assert why == "" and m.stats.recovered == 0 and w.store is not None
    keys = [ok(i) for i in range(4)]
    to_store, where, _ = m.prepare_store(keys)  # host holds the first 2, the file tier all 4
    assert w.submit_store(1, np.array([0, 1, 2, 3], dtype=np.int32), where)
    success, nbytes = finish(w, 1)
    assert success and nbytes == 6 * LAYERS * PAGE
    m.complete_store(to_store)
    for t in kv:
        t.zero_()
    assert where.host.tolist() == [0, 1, -1, -1] and where.slots.tolist() == [0, 1, 2, 3]
    spec = m.prepare_load(keys)  # blocks 0, 1 from the host tier, 2, 3 from files
    assert spec.host.tolist() == [0, 1, -1, -1] and spec.slots.tolist() == [-1, -1, 2, 3]
    w.submit_load(2, spec, np.array([4, 5, 6, 7]))
    assert finish(w, 2)[0]
    m.complete_load(keys)
    for t, ref in zip(kv, want):
        assert torch.equal(t[4:8], ref[0:4])
    w.shutdown()

    # Restart: a new worker and manager on the same directory find the four blocks in files.
    kv2 = [torch.zeros_like(t) for t in kv]
    w, m, why = open_tier(tmp_path, kv2, ident, engine="e2")
    assert why == "" and m.stats.recovered == 4
    assert all(m.lookup(k) == "hit" for k in keys) and m.stats.hits_recovered == 4
    spec = m.prepare_load(keys)  # all from files; the first two also promoted into the host tier
    assert spec.slots.tolist() == [0, 1, 2, 3] and spec.promote.tolist() == [0, 1, -1, -1]
    w.submit_load(1, spec, np.array([0, 1, 2, 3]))
    success, nbytes = finish(w, 1)
    assert success and nbytes == 4 * LAYERS * PAGE and w.take_failed_blocks() == set()
    m.complete_load(keys)
    for t, ref in zip(kv2, want):
        assert torch.equal(t[0:4], ref[0:4])
    # The promoted copies are the blocks' bytes: loaded from the host tier into blocks 6, 7.
    spec = m.prepare_load(keys[:2])
    assert spec.host.tolist() == [0, 1] and m.stats.promoted == 2
    w.submit_load(3, spec, np.array([6, 7]))
    assert finish(w, 3)[0]
    m.complete_load(keys[:2])
    for t, ref in zip(kv2, want):
        assert torch.equal(t[6:8], ref[0:2])
    # A slot altered while the store is open: its load fails, its block is reported and left
    # as it was (the checksum is checked before any byte reaches the pool); the host block its
    # promotion took is forgotten with it.
    slab = tmp_path / "rank0" / "kvferry-slab-00000.kvf"
    slot_bytes = 4096 + -(-w.block_bytes // 4096) * 4096
    with open(slab, "r+b") as f:
        f.seek(3 * slot_bytes + 4096 + 10)  # slot 3's payload
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
    for t in kv2:
        t[5].fill_(7)
    spec = m.prepare_load([ok(3)])
    assert spec.promote.tolist() == [0]  # the host tier's LRU block (ok(0)'s)
    w.submit_load(2, spec, np.array([5]))
    assert finish(w, 2)[0]  # report_load_errors: success, the block named instead
    assert w.take_failed_blocks() == {5} and w.load_failures == 1 and w.promote_failures == 0
    assert all(bool((t[5] == 7).all()) for t in kv2)
    m.complete_load([ok(3)])
    m.discard(spec.keys)  # what KvferryOffloadingConnector does with the reported block
    assert m.where(ok(3)) is None and m.where(ok(0)) == (-1, 0)
    w.shutdown()

    # Restart after the corruption: recovery verifies every slot, the bad one is not offered.
    w, m, why = open_tier(tmp_path, [torch.zeros_like(t) for t in kv], ident, engine="e3")
    assert m.stats.recovered == 3 and m.lookup(ok(3)) == "miss" and m.lookup(ok(0)) == "hit"
    w.shutdown()

    # Another model's engine: the directory is refused by name and left untouched.
    before = {p.name: p.read_bytes() for p in (tmp_path / "rank0").iterdir()}
    other = dict(ident, model="another")
    w, m, why = open_tier(tmp_path, [torch.zeros_like(t) for t in kv], other, engine="e4")
    assert w.store is None and "model differ" in w.file_refused and "model differ" in why
    assert m.lookup(ok(0)) == "miss"
    w.shutdown()
    assert {p.name: p.read_bytes() for p in (tmp_path / "rank0").iterdir()} == before


def test_unusable_directory_leaves_the_engine_serving(tmp_path):
    """A directory that cannot be opened (a file in its place, a read-only one, locked by another
    engine) turns the file tier off with the reason; the host tier still works."""
    ident = {"format": vo.FORMAT, "model": "tiny"}
    (tmp_path / "rank0").write_text("not a directory")
    w, m, why = open_tier(tmp_path, kv_tensors(2), ident)
    assert w.store is None and w.file_refused and why  # no session of this engine
    _, where, _ = stored(m, [ok(1)])
    assert where.host.tolist() == [0] and where.slots.tolist() == [-1]
    w.shutdown()
    (tmp_path / "rank0").unlink()
    first, _, _ = open_tier(tmp_path, kv_tensors(2), ident, engine="a")
    second, m2, why2 = open_tier(tmp_path, kv_tensors(3), ident, engine="b")
    assert first.store is not None and second.store is None and "rank0" in second.file_refused
    assert "engine 'a'" in why2 and m2.where(ok(1)) is None  # b reads a's session: refused
    second.shutdown()
    first.shutdown()



def test_jobs_larger_than_the_file_staging_go_in_several_batches(tmp_path):
    """A vLLM job may name more blocks than the TransferManager's file staging holds (a long
    prompt): the worker splits its file part, and the job finishes when every part has."""
    n = offload_worker.FILE_STAGING_BLOCKS + 8
    g = torch.Generator().manual_seed(5)
    kv = [torch.randint(-128, 127, (2 * n, PAGE), dtype=torch.int8, generator=g)
          for _ in range(LAYERS)]
    want = [t[:n].clone() for t in kv]
    ident = {"format": vo.FORMAT, "model": "long"}
    w, m, _ = open_tier(tmp_path, kv, ident, host=0, slots=n)
    keys = [ok(i) for i in range(n)]
    to_store, where, _ = m.prepare_store(keys)
    assert len(to_store) == n
    w.submit_store(1, np.arange(n), where)
    assert finish(w, 1) == (True, n * LAYERS * PAGE)
    m.complete_store(to_store)
    assert len(w.jobs) == 0 and w.store_failures == 0
    w.submit_load(2, m.prepare_load(keys), np.arange(n, 2 * n))
    assert finish(w, 2) == (True, n * LAYERS * PAGE)
    for t, ref in zip(kv, want):
        assert torch.equal(t[n:], ref)
    w.shutdown()


@pytest.mark.gpu
def test_cuda_worker_orders_jobs_after_the_engines_stream(tmp_path):
    """CUDA tensors as vLLM's offloading worker hands them over (per-layer [blocks, page] int8
    views of one layer-compact buffer): a store submitted while the engine's stream is still
    writing the blocks copies what the stream wrote, through the pinned host tier and the file
    tier; a load brings the bytes back into other blocks."""
    raw = torch.zeros(LAYERS * BLOCKS * PAGE, dtype=torch.int8, device="cuda")
    kv = [raw[i * BLOCKS * PAGE:(i + 1) * BLOCKS * PAGE].view(BLOCKS, PAGE) for i in range(LAYERS)]
    w, m, why = open_tier(tmp_path, kv, {"format": vo.FORMAT, "model": "cuda"}, host=2, slots=4)
    assert why == "" and w.device.info["platform"] == "cuda"
    torch.cuda._sleep(50_000_000)  # the engine's stream is busy ...
    for t in kv:
        t[0:4].fill_(5)  # ... then writes blocks 0-3, the ones stored next
    keys = [ok(i) for i in range(4)]
    to_store, where, _ = m.prepare_store(keys)
    w.submit_store(1, np.arange(4), where)
    assert finish(w, 1)[0]
    m.complete_store(to_store)
    torch.cuda.synchronize()
    for t in kv:
        t[0:4].zero_()
    spec = m.prepare_load(keys)  # two from host, two from files
    assert spec.host.tolist() == [0, 1, -1, -1]
    w.submit_load(2, spec, np.array([4, 5, 6, 7]))
    assert finish(w, 2)[0] and w.take_failed_blocks() == set()
    torch.cuda.synchronize()
    for t in kv:
        assert bool((t[4:8] == 5).all()) and bool((t[0:4] == 0).all())
    w.shutdown()
