"""Metrics: snapshots of sides and managers, Prometheus text, the HTTP endpoint."""

from __future__ import annotations

import re
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


def test_side_metrics_count_what_poll_reported(cpu, small_shape):
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
    ctx.close()
    gen.close()


def test_prometheus_text_and_endpoint(cpu, small_shape):
    ctx, gen, _ = transfer_some(cpu, small_shape, kvferry.InProcFabric())
    primary = kvferry.Pool.allocate(cpu, small_shape, blocks=4)
    tm = kvferry.TransferManager(cpu, primary)
    bm = kvferry.BlockManager(tm)
    bm.add_sequence(1, list(range(8)))
    sources = {"ctx0": ctx, "gen0": gen, "tiers": tm, "cache": bm}
    text = metrics.prometheus_text(sources)
    assert 'kvferry_requests_total{source="gen0",side="generation",state="complete"} 3' in text
    assert 'kvferry_requests_total{source="ctx0",side="context",state="cancelled"} 1' in text
    assert 'kvferry_request_errors_total{source="ctx0",side="context",code="CANCELLED"} 1' in text
    assert re.search(r'kvferry_request_latency_seconds_bucket\{source="gen0",side="generation",'
                     r'le="\+Inf"\} 3', text)
    assert 'kvferry_cached_blocks{source="cache",tier="primary"} 2' in text
    assert "# TYPE kvferry_request_latency_seconds histogram" in text
    # Every sample line parses as: name{labels} value
    for line in text.splitlines():
        if not line.startswith("#"):
            assert re.fullmatch(r'[a-z_]+(\{[^}]*\})? [-+0-9.eInf]+', line), line
    with metrics.MetricsServer(sources) as server:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as r:
            body = r.read().decode()
            assert r.headers["Content-Type"].startswith("text/plain")
        assert "kvferry_transfer_bytes_total" in body
    with pytest.raises(TypeError):
        metrics.snapshot({"x": object()})
    bm.close()
    tm.close()
    ctx.close()
    gen.close()
