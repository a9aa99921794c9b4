"""Metrics of kvferry objects as snapshots (dicts), request timelines, and Prometheus text, with a
small HTTP endpoint.

Sources are the objects an engine already holds: ContextSide and GenerationSide (the C++ snapshot
``kvferry/metrics.h``: requests started and ended by state, errors by code, bytes, chunks, staging
and command-queue depth, progress-thread CPU, request and chunk latency histograms; ``timelines()``
gives each recent request's created / fetch / first byte / last byte / end), TransferManager
(bytes, batches and copy latency per tier direction, file I/O) and BlockManager (cached blocks per
tier, hits, offloads, drops). Each source is given a name, which becomes the ``source`` label.

The text is rendered by the library (``kvferry/prometheus.h``), the same renderer the CLI serves on
``--metrics-port``. Why our own renderer rather than ``prometheus_client`` or prometheus-cpp: the
numbers are snapshots of objects the engine passes in (no global registry to keep in sync), and
the package takes no extra dependency. An engine that already runs ``prometheus_client`` can
serve :func:`prometheus_text` from its own handler.
"""

from __future__ import annotations

import http.server
import threading
from typing import Any, Mapping

from . import _kvferry

_SIDES = (_kvferry.ContextSide, _kvferry.GenerationSide)


def snapshot(sources: Mapping[str, Any]) -> dict[str, dict]:
    """{name: metrics} for each source (sides, transfer managers, block managers). Closed
    objects are left out."""
    out: dict[str, dict] = {}
    for name, obj in sources.items():
        if not isinstance(obj, (*_SIDES, _kvferry.TransferManager, _kvferry.BlockManager)):
            raise TypeError(f"metrics source {name!r}: {type(obj).__name__} has no kvferry metrics")
        if obj.closed:
            continue
        if isinstance(obj, _SIDES):
            m = obj.metrics()
            m["stats"] = obj.stats
        elif isinstance(obj, _kvferry.TransferManager):
            m = obj.metrics()
            m["stats"] = obj.stats
        else:
            m = {"kind": "block_manager", "stats": obj.stats}
        out[name] = m
    return out


def prometheus_text(sources: Mapping[str, Any]) -> str:
    """The sources' metrics in the Prometheus text exposition format (version 0.0.4). Closed
    objects are left out."""
    snap = []
    for name, obj in sources.items():
        if not hasattr(obj, "_metrics_source"):
            raise TypeError(f"metrics source {name!r}: {type(obj).__name__} has no kvferry metrics")
        if not obj.closed:
            snap.append(obj._metrics_source(name))
    return _kvferry._prometheus_text(snap)


def slowest(side: Any) -> dict | None:
    """The timeline of the slowest recent request of a side (None when none ended yet)."""
    t = side.timelines()
    return max(t, key=lambda x: x["end"]) if t else None


def format_timeline(t: Mapping[str, Any]) -> str:
    """One line: 'request 7 complete: fetch +0.010 ms, first byte ..., end +1.2 ms (4 chunks)'."""
    def at(s: float) -> str:
        return "never" if s < 0 else f"+{s * 1e3:.3f} ms"
    return (f"request {t['request_id']} {t['state']}: fetch {at(t['fetch'])}, first byte "
            f"{at(t['first_byte'])}, last byte {at(t['last_byte'])}, end {at(t['end'])} "
            f"({t['chunks']} chunks, {t['bytes'] / 1e6:.2f} MB)")


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
