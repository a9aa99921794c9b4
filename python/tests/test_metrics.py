"""Metrics: snapshots of sides and managers, Prometheus text, the HTTP endpoint."""

from __future__ import annotations

import re
import socket
import threading
import time
import urllib.request

import pytest

import kvferry
from kvferry import metrics

SECRET = b"metrics-secret!!"


def transfer_some(cpu, shape, fabric, n_ok=3):
    src = kvferry.Pool.allocate(cpu, shape, memory="host", blocks=8)
    dst = kvferry.Pool.allocate(cpu, shape, memory="host", blocks=8)
    ctx = kvferry.ContextSide(cpu, src, transport="inproc", fabric=fabric,
                              instance_secret=SECRET, timeout=5.0)
    ctx.set_instance_addresses([ctx.address])
    gen = kvferry.GenerationSide(cpu, dst, transport="inproc", fabric=fabric, timeout=5.0)
    for rid in range(n_ok):
        gen.fetch(ctx.mark_ready(rid, [rid], 4), [rid])
    got = []
    while len(got) < n_ok:
        got += gen.poll(at_least=n_ok - len(got), timeout=10.0)
    ctx_got = []
    while len(ctx_got) < n_ok:
        ctx_got += ctx.poll(at_least=n_ok - len(ctx_got), timeout=10.0)
    ctx.mark_ready(99, [7], 4)
    ctx.cancel(99)
    ctx.poll(at_least=1, timeout=10.0)
    return ctx, gen, got


def test_side_metrics_come_from_the_library(cpu, small_shape):
    ctx, gen, got = transfer_some(cpu, small_shape, kvferry.InProcFabric())
    g = gen.metrics()
    assert g["requests"]["complete"] == 3 and g["requests"]["error"] == 0
    assert g["bytes"] == sum(s.bytes for s in got) > 0
    lat = g["latency_seconds"]
    assert lat["count"] == 3 and lat["buckets"][-1][1] == 3
    counts = [c for _, c in lat["buckets"]]
    assert counts == sorted(counts)  # cumulative
    c = ctx.metrics()
    assert c["requests"]["complete"] == 3 and c["requests"]["cancelled"] == 1
    assert c["errors"] == {"CANCELLED": 1}
    assert g["requests_started"] == 3 and g["live_requests"] == 0
    assert g["kind"] == "generation" and g["transport"] == "inproc"
    assert g["chunks"] >= 3 and g["chunk_bytes"] == g["bytes"]
    assert g["chunk_latency_seconds"]["count"] == g["chunks"]
    assert g["staging_slots_in_use"] == 0 and g["staging_slots"] > 0
    # Timelines: one per request, the steps in order; the slowest is among them.
    t = gen.timelines()
    assert [x["request_id"] for x in t] == [0, 1, 2]
    for x in t:
        assert x["state"] == "complete" and x["code"] == "OK" and x["chunks"] >= 1
        assert 0 <= x["fetch"] <= x["first_byte"] <= x["last_byte"] <= x["end"]
    assert metrics.slowest(gen) in t
    assert "first byte +" in metrics.format_timeline(t[0])
    ct = ctx.timelines()
    assert ct[-1]["request_id"] == 99 and ct[-1]["state"] == "cancelled"
    assert ct[-1]["first_byte"] == -1
    ctx.close()
    gen.close()
    with pytest.raises(kvferry.ClosedError):
        gen.metrics()


def test_prometheus_text_and_endpoint(cpu, small_shape):
    ctx, gen, _ = transfer_some(cpu, small_shape, kvferry.InProcFabric())
    primary = kvferry.Pool.allocate(cpu, small_shape, blocks=4)
    tm = kvferry.TransferManager(cpu, primary)
    bm = kvferry.BlockManager(tm)
    bm.add_sequence(1, list(range(8)))
    sources = {"ctx0": ctx, "gen0": gen, "tiers": tm, "cache": bm}
    text = metrics.prometheus_text(sources)
    side = 'side="generation",transport="inproc"'
    assert f'kvferry_requests_total{{source="gen0",{side},state="complete"}} 3' in text
    ctx_side = 'source="ctx0",side="context",transport="inproc"'
    assert f'kvferry_requests_total{{{ctx_side},state="cancelled"}} 1' in text
    assert f'kvferry_request_errors_total{{{ctx_side},code="CANCELLED"}} 1' in text
    assert re.search(r'kvferry_request_latency_seconds_bucket\{source="gen0",side="generation",'
                     r'transport="inproc",le="\+Inf"\} 3', text)
    assert re.search(r'kvferry_chunk_latency_seconds_count\{source="gen0"[^}]*\} [1-9]', text)
    assert 'kvferry_cached_blocks{source="cache",tier="primary"} 2' in text
    assert "# TYPE kvferry_request_latency_seconds histogram" in text
    # Every sample line parses as: name{labels} value
    for line in text.splitlines():
        if not line.startswith("#"):
            assert re.fullmatch(r'[a-z_]+(\{[^}]*\})? [-+0-9.eInf]+', line), line
    # Each family's HELP/TYPE appears once.
    types = [line for line in text.splitlines() if line.startswith("# TYPE ")]
    assert len(types) == len(set(types))
    with metrics.MetricsServer(sources) as server:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as r:
            body = r.read().decode()
            assert r.headers["Content-Type"].startswith("text/plain")
        assert "kvferry_transfer_bytes_total" in body
    with pytest.raises(TypeError):
        metrics.snapshot({"x": object()})
    with pytest.raises(TypeError):
        metrics.prometheus_text({"x": object()})
    # Tier copies per direction.
    gen.close()  # a closed source is left out, not an error
    assert 'source="gen0"' not in metrics.prometheus_text(sources)
    assert "gen0" not in metrics.snapshot(sources)
    bm.close()
    tm.close()
    ctx.close()
    gen.close()


def test_transfer_manager_metrics_per_direction(cpu, small_shape):
    primary = kvferry.Pool.allocate(cpu, small_shape, blocks=8)
    host = kvferry.Pool.allocate(cpu, small_shape, memory="pinned", blocks=8)
    with kvferry.TransferManager(cpu, primary, host) as tm:
        tm.offload([(0, 3), (1, 4)]).wait(10.0)
        tm.onboard([(3, 5)]).wait(10.0)
        m = tm.metrics()
        by = {(c["from"], c["to"]): c for c in m["copies"]}
        assert set(by) == {("primary", "host"), ("host", "primary")}
        assert by[("primary", "host")]["blocks"] == 2 and by[("primary", "host")]["batches"] == 1
        assert by[("primary", "host")]["bytes"] == 2 * by[("host", "primary")]["bytes"] > 0
        assert by[("host", "primary")]["latency_seconds"]["count"] == 1
        text = metrics.prometheus_text({"tiers": tm})
        assert 'kvferry_tier_copy_blocks_total{source="tiers",from="primary",to="host"} 2' in text


def test_metrics_server_bounds_silent_connections():
    """Silent peers neither delay a scrape nor pile up threads: each has `timeout` seconds in
    all, and beyond `max_connections` at once a connection is closed at once."""
    def scrape(port):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")

    threads_before = threading.active_count()
    with metrics.MetricsServer({}, max_connections=16, timeout=1.0) as server:
        silent = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(10)]
        for s in silent:
            s.sendall(b"GET /metrics HTTP/1.1\r\n")  # half a request head
        start = time.monotonic()
        scrape(server.port)
        took = time.monotonic() - start
        print(f"scrape behind 10 silent connections: {took * 1e3:.1f} ms")
        assert took < 0.5
        silent += [socket.create_connection(("127.0.0.1", server.port)) for _ in range(100)]
        time.sleep(0.3)
        assert threading.active_count() <= threads_before + 1 + 16  # serve_forever + the bound
        assert server.refused >= 100 - 16
        time.sleep(1.0)  # the silent ones' time is up: their threads end
        assert threading.active_count() <= threads_before + 1
        scrape(server.port)
        for s in silent:
            s.close()
