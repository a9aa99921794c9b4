"""The rendezvous from Python: a server, clients, addresses, secrets and handles."""

from __future__ import annotations

import pytest

import kvferry


def test_rendezvous_exchanges_what_instances_need():
    key = kvferry.random_key()
    assert isinstance(key, bytes) and len(key) == 16 and key != kvferry.random_key()
    with kvferry.RendezvousServer(key=key) as server:
        assert server.address.startswith("127.0.0.1:")
        with kvferry.Rendezvous(server.address, key) as a, \
                kvferry.Rendezvous(server.address, key) as b:
            a.put("k", b"value")
            assert b.get("k", timeout=5.0) == b"value"
            b.erase("k")
            assert server.accepted == 2  # one kept connection per client, whatever the calls
            with pytest.raises(kvferry.DeadlineExceededError):
                a.get("k", timeout=0.2)
            for rank in range(2):
                a.publish_rank_address("ctx-0", 7, rank, f"addr-{rank}")
            assert b.gather_rank_addresses("ctx-0", 7, 2, timeout=5.0) == ["addr-0", "addr-1"]
            with pytest.raises(kvferry.Error, match="7|8"):
                b.gather_rank_addresses("ctx-0", 8, 2, timeout=1.0)  # stale instance id
            # A wait that ended at its deadline may drop its connection (its reply could still be
            # on the way) and the client's next call reconnects: on a loaded machine one of the
            # two waits above did (3 accepted). One call each, then calls reuse the connection.
            a.put("k2", b"v")
            assert b.get("k2", timeout=5.0) == b"v"
            accepted = server.accepted
            assert accepted <= 4
            secret = kvferry.random_key()
            a.publish_instance_secret("ctx-0", 7, secret)
            assert b.fetch_instance_secret("ctx-0", 7, timeout=5.0) == secret
            a.publish_handle(42, b"\x01handle")
            assert b.fetch_handle(42, timeout=5.0) == b"\x01handle"
            assert server.accepted == accepted
        wrong = kvferry.Rendezvous(server.address, kvferry.random_key())
        with pytest.raises(kvferry.InvalidArgumentError):
            wrong.get("k", timeout=2.0)
        assert server.refused >= 1
    with pytest.raises(kvferry.InvalidArgumentError, match="16"):
        kvferry.RendezvousServer(key=b"short")
