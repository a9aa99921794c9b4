"""Metrics of kvferry objects as a snapshot (dicts) and as Prometheus text, with a small HTTP
endpoint.

Sources are the objects an engine already holds: ContextSide and GenerationSide (requests by
terminal state, bytes, errors by code and a fetch/mark-ready-to-terminal latency histogram, as
their ``poll`` reported them, plus live requests, staging slots in use and progress-thread CPU),
TransferManager (batches, blocks, bytes, file I/O) and BlockManager (cached blocks per tier,
hits, offloads, drops). Each source is given a name, which becomes the ``source`` label.

Why our own text renderer rather than ``prometheus_client`` or prometheus-cpp: the exposition
format is a few lines of text, the numbers come from objects the engine passes in (no global
registry to keep in sync), and the package stays free of extra dependencies. An engine that
already runs ``prometheus_client`` can serve :func:`prometheus_text` from its own handler.
"""

from __future__ import annotations

import http.server
import math
import threading
from typing import Any, Mapping

from . import _kvferry

_TIERS = ("primary", "host", "file")


def snapshot(sources: Mapping[str, Any]) -> dict[str, dict]:
    """{name: metrics} for each source (sides, transfer managers, block managers)."""
    out: dict[str, dict] = {}
    for name, obj in sources.items():
        if isinstance(obj, (_kvferry.ContextSide, _kvferry.GenerationSide)):
            m = obj.metrics()
            m["kind"] = "context" if isinstance(obj, _kvferry.ContextSide) else "generation"
            if not obj.closed:
                m["stats"] = obj.stats
            out[name] = m
        elif isinstance(obj, _kvferry.TransferManager):
            out[name] = {"kind": "transfer_manager", "stats": obj.stats}
        elif isinstance(obj, _kvferry.BlockManager):
            out[name] = {"kind": "block_manager", "stats": obj.stats}
        else:
            raise TypeError(f"metrics source {name!r}: {type(obj).__name__} has no kvferry metrics")
    return out


def _labels(**kv: Any) -> str:
    parts = []
    for k, v in kv.items():
        text = str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        parts.append(f'{k}="{text}"')
    return "{" + ",".join(parts) + "}"


def _num(v: float) -> str:
    if isinstance(v, float) and math.isinf(v):
        return "+Inf"
    return repr(v) if isinstance(v, float) else str(v)


class _Writer:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.declared: set[str] = set()

    def metric(self, name: str, kind: str, doc: str, value: float, **labels: Any) -> None:
        if name not in self.declared:
            self.declared.add(name)
            self.lines.append(f"# HELP {name} {doc}")
            self.lines.append(f"# TYPE {name} {kind}")
        self.lines.append(f"{name}{_labels(**labels)} {_num(value)}")


def prometheus_text(sources: Mapping[str, Any]) -> str:
    """The sources' metrics in the Prometheus text exposition format (version 0.0.4)."""
    w = _Writer()
    snap = snapshot(sources)
    # Families are written together: a histogram's samples must not be interleaved.
    for name, m in snap.items():
        if m["kind"] in ("context", "generation"):
            side = dict(source=name, side=m["kind"])
            for state, n in m["requests"].items():
                w.metric("kvferry_requests_total", "counter",
                         "Requests that ended, by terminal state (as poll reported them).", n,
                         **side, state=state)
    for name, m in snap.items():
        if m["kind"] in ("context", "generation"):
            side = dict(source=name, side=m["kind"])
            w.metric("kvferry_transfer_bytes_total", "counter",
                     "Payload bytes of ended requests, sent or received by this rank.", m["bytes"],
                     **side)
            for code, n in m["errors"].items():
                w.metric("kvferry_request_errors_total", "counter",
                         "Requests that ended with an error, by status code.", n, **side,
                         code=code)
            st = m.get("stats")
            if st:
                w.metric("kvferry_live_requests", "gauge",
                         "Requests not yet terminal (their blocks are leased).",
                         st["live_requests"], **side)
                w.metric("kvferry_staging_slots_in_use", "gauge",
                         "Staging slots held by chunks in flight.", st["staging_slots_in_use"],
                         **side)
                w.metric("kvferry_progress_busy_cpu_seconds_total", "counter",
                         "Progress-thread CPU time in iterations that did work.",
                         st["busy_cpu_seconds"], **side)
    for name, m in snap.items():
        if m["kind"] in ("context", "generation"):
            side = dict(source=name, side=m["kind"])
            lat = m["latency_seconds"]
            hname = "kvferry_request_latency_seconds"
            if hname not in w.declared:
                w.declared.add(hname)
                w.lines.append(f"# HELP {hname} From mark_ready (context) or fetch "
                               "(generation) to the terminal state, per request.")
                w.lines.append(f"# TYPE {hname} histogram")
            for le, cum in lat["buckets"]:
                w.lines.append(f"{hname}_bucket{_labels(**side, le=_num(float(le)))} {cum}")
            w.lines.append(f"{hname}_sum{_labels(**side)} {_num(float(lat['sum']))}")
            w.lines.append(f"{hname}_count{_labels(**side)} {lat['count']}")
    for name, m in snap.items():
        if m["kind"] == "transfer_manager":
            st = m["stats"]
            for key in ("batches", "blocks", "descriptors", "bytes", "file_writes",
                        "file_write_errors", "file_reads", "file_read_errors"):
                w.metric(f"kvferry_tier_{key}_total", "counter",
                         f"Tier copies: {key.replace('_', ' ')} (TransferManager).", st[key],
                         source=name)
        elif m["kind"] == "block_manager":
            st = m["stats"]
            for i, tier in enumerate(_TIERS):
                w.metric("kvferry_cached_blocks", "gauge", "Keyed blocks held, per tier.",
                         st["cached"][i], source=name, tier=tier)
                w.metric("kvferry_prefix_hits_total", "counter", "Prefix blocks found, per tier.",
                         st["hits"][i], source=name, tier=tier)
                w.metric("kvferry_dropped_blocks_total", "counter",
                         "Cached blocks dropped, per tier.", st["dropped"][i], source=name,
                         tier=tier)
            for key in ("lookups", "offloaded", "demoted", "onboarded", "partial_copies",
                        "write_failures", "corrupt_reads"):
                w.metric(f"kvferry_blocks_{key}_total", "counter",
                         f"BlockManager: {key.replace('_', ' ')}.", st[key], source=name)
            w.metric("kvferry_free_blocks", "gauge", "Free blocks, primary pool.",
                     st["free_primary"], source=name, tier="primary")
            w.metric("kvferry_free_blocks", "gauge", "Free blocks, host pool.", st["free_host"],
                     source=name, tier="host")
    return "\n".join(w.lines) + "\n"


class MetricsServer:
    """Serves :func:`prometheus_text` of `sources` at ``http://HOST:PORT/metrics`` from a daemon
    thread (port 0 picks a free one: see ``.port``). Loopback by default. Close it (or use it as a
    context manager) to stop."""

    def __init__(self, sources: Mapping[str, Any], port: int = 0, host: str = "127.0.0.1"):
        self._sources = sources

        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                if self.path.split("?")[0] not in ("/metrics", "/"):
                    self.send_error(404)
                    return
                try:
                    body = prometheus_text(outer._sources).encode()
                except Exception as e:  # noqa: BLE001 - report, don't kill the server
                    self.send_error(500, str(e))
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self._httpd = http.server.ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True,
                                        name="kvferry-metrics")
        self._thread.start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> "MetricsServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
