"""The context instance's secret (issue 29): never all zero, exactly 16 bytes, one per instance.

It keys the access token of every handle the instance makes; with the old all-zero default any
process could mint a handle for another instance's request.
"""

from __future__ import annotations

import threading

import pytest

import kvferry
import kv_check


def pools(dev, shape, tp=1, blocks=4):
    return [kvferry.Pool.allocate(dev, shape, kvferry.ParallelConfig(tp=tp), rank=r,
                                  memory="host", blocks=blocks) for r in range(tp)]


def test_default_secret_is_generated_and_shown(cpu, small_shape):
    fabric = kvferry.InProcFabric()
    (pool,) = pools(cpu, small_shape)
    with kvferry.ContextSide(cpu, pool, transport="inproc", fabric=fabric) as a, \
            kvferry.ContextSide(cpu, pool, transport="inproc", fabric=fabric) as b:
        assert len(a.instance_secret) == 16 and a.instance_secret != bytes(16)
        assert a.instance_secret != b.instance_secret  # a new one per instance


def test_given_secret_is_used_and_checked(cpu, small_shape):
    fabric = kvferry.InProcFabric()
    (pool,) = pools(cpu, small_shape)
    secret = kvferry.random_key()
    with kvferry.ContextSide(cpu, pool, transport="inproc", fabric=fabric,
                             instance_secret=secret) as ctx:
        assert ctx.instance_secret == secret
    # Short secrets used to be padded with zeros; now every length but 16 is refused.
    for bad in (b"", b"short", bytes(15), bytes(17)):
        with pytest.raises(kvferry.InvalidArgumentError, match="exactly 16"):
            kvferry.ContextSide(cpu, pool, transport="inproc", fabric=fabric,
                                instance_secret=bad)
    with pytest.raises(kvferry.InvalidArgumentError, match="all zero"):
        kvferry.ContextSide(cpu, pool, transport="inproc", fabric=fabric,
                            instance_secret=bytes(16))
    with pytest.raises(kvferry.InvalidArgumentError, match="exactly 16"):
        kvferry.GenerationSide(cpu, pool, transport="inproc", fabric=fabric,
                               instance_secret=b"short")


def test_several_ranks_need_one_shared_secret(cpu, small_shape):
    fabric = kvferry.InProcFabric()
    p0, _ = pools(cpu, small_shape, tp=2)
    with pytest.raises(kvferry.InvalidArgumentError, match="rendezvous="):
        kvferry.ContextSide(cpu, p0, transport="inproc", fabric=fabric)


def test_ranks_share_the_secret_through_the_rendezvous(cpu, small_shape):
    key = kvferry.random_key()
    fabric = kvferry.InProcFabric()
    ctx_pools = pools(cpu, small_shape, tp=2)
    (gen_pool,) = pools(cpu, small_shape)
    with kvferry.RendezvousServer(key=key) as server, \
            kvferry.Rendezvous(server.address, key) as rv:
        with pytest.raises(kvferry.InvalidArgumentError, match="instance_id"):
            kvferry.ContextSide(cpu, ctx_pools[0], transport="inproc", fabric=fabric,
                                rendezvous=rv)
        with pytest.raises(kvferry.InvalidArgumentError, match="not both"):
            kvferry.ContextSide(cpu, ctx_pools[0], transport="inproc", fabric=fabric,
                                rendezvous=rv, instance_id=5, instance_secret=key)
        # Rank 1 starts first and waits for rank 0's secret.
        sides = [None, None]

        def start(rank):
            sides[rank] = kvferry.ContextSide(cpu, ctx_pools[rank], transport="inproc",
                                              fabric=fabric, rendezvous=rv, instance="ctx-a",
                                              instance_id=5, rendezvous_timeout=10.0)

        t = threading.Thread(target=start, args=(1,))
        t.start()
        start(0)
        t.join(timeout=20.0)
        ctx = sides
        assert ctx[1] is not None, "rank 1 did not start"
        assert ctx[0].instance_secret == ctx[1].instance_secret != bytes(16)
        assert rv.fetch_instance_secret("ctx-a", 5) == ctx[0].instance_secret
        addresses = [c.address for c in ctx]
        for c in ctx:
            c.set_instance_addresses(addresses)
        g = kv_check.global_kv(small_shape, 2, seed=4)
        for p in ctx_pools:
            kv_check.fill(p, [0, 1], g)
        handles = [c.mark_ready(9, [0, 1], 8) for c in ctx]
        assert handles[0] == handles[1]  # same secret, same token
        with kvferry.GenerationSide(cpu, gen_pool, transport="inproc", fabric=fabric,
                                    instance_id=2) as gen:
            gen.fetch(handles[0], [2, 3])
            (st,) = gen.poll(at_least=1, timeout=10.0)
            assert st.ok, st
        kv_check.check(gen_pool, [2, 3], g, 8)
        for c in ctx:
            c.close()
        # A rank that finds no secret in time says so.
        with pytest.raises(kvferry.DeadlineExceededError):
            kvferry.ContextSide(cpu, ctx_pools[1], transport="inproc", fabric=fabric,
                                rendezvous=rv, instance="ctx-b", instance_id=6,
                                rendezvous_timeout=0.2)
