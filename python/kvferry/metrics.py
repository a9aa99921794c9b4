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

import socket
import socketserver
import threading
import time
from typing import Any, Mapping

from . import _kvferry

_SIDES = (_kvferry.ContextSide, _kvferry.GenerationSide)
_MAX_HEAD_BYTES = 8192


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
    context manager) to stop.

    Each connection has a thread of its own, at most `max_connections` at once (a connection
    beyond them is closed at once, counted in ``.refused``), and `timeout` seconds in all to send
    its request head (at most 8 KiB) and take the reply: silent or slow peers neither delay a
    scrape nor pile up threads."""

    def __init__(self, sources: Mapping[str, Any], port: int = 0, host: str = "127.0.0.1",
                 max_connections: int = 16, timeout: float = 2.0):
        self._sources = sources
        self._timeout = timeout
        self._slots = threading.BoundedSemaphore(max_connections)
        self.refused = 0
        outer = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self):
                outer._serve(self.request)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True
            request_queue_size = 128

            def process_request(self, request, client_address):
                if not outer._slots.acquire(blocking=False):
                    outer.refused += 1
                    self.shutdown_request(request)
                    return
                try:
                    super().process_request(request, client_address)
                except BaseException:
                    outer._slots.release()
                    raise

            def process_request_thread(self, request, client_address):
                try:
                    super().process_request_thread(request, client_address)
                finally:
                    outer._slots.release()

        self._server = Server((host, port), Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="kvferry-metrics")
        self._thread.start()

    def _serve(self, sock: socket.socket) -> None:
        deadline = time.monotonic() + self._timeout
        head = b""
        try:
            while b"\r\n\r\n" not in head and len(head) < _MAX_HEAD_BYTES:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                sock.settimeout(left)
                chunk = sock.recv(_MAX_HEAD_BYTES - len(head))
                if not chunk:
                    return
                head += chunk
            words = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
            status, body = "200 OK", b""
            if words[0] != "GET" or len(words) < 2:
                status, body = "405 Method Not Allowed", b"GET only\n"
            elif words[1].split("?")[0] not in ("/metrics", "/"):
                status, body = "404 Not Found", b"try /metrics\n"
            else:
                try:
                    body = prometheus_text(self._sources).encode()
                except Exception as e:  # noqa: BLE001 - report, don't kill the server
                    status, body = "500 Internal Server Error", f"{e}\n".encode()
            sock.settimeout(max(deadline - time.monotonic(), 0.001))  # sendall: in all
            sock.sendall(f"HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4; "
                         f"charset=utf-8\r\nContent-Length: {len(body)}\r\n"
                         f"Connection: close\r\n\r\n".encode() + body)
        except OSError:
            return

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> "MetricsServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
