"""The small router of vLLM's disaggregation examples, for `vllm serve` P/D with any KV connector.

    client -> proxy -> prefill (max_tokens=1, kv_transfer_params={"do_remote_decode": true})
                    -> decode  (the request as sent, kv_transfer_params = the prefill's answer)

OpenAI-compatible `POST /v1/completions` and `/v1/chat/completions`; the decode instance's
answer goes back to the client, streamed as it comes when the request says `"stream": true` (the
prefill request is never streamed). Standard library only.

    python pd_proxy.py --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000
"""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ROUTES = ("/v1/completions", "/v1/chat/completions")


def post(url: str, body: dict, timeout: float) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def make_handler(prefill: str, decode: str, timeout: float):
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            if self.path not in ROUTES:
                return self.reply(404, {"error": f"{self.path}: only {ROUTES}"})
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            first = dict(body, max_tokens=1, stream=False,
                         kv_transfer_params={"do_remote_decode": True})
            for key in ("max_completion_tokens", "stream_options"):
                first.pop(key, None)
            code, out = post(prefill + self.path, first, timeout)
            if code != 200:
                return self.reply(code, {"error": "prefill failed", "prefill": out})
            second = dict(body, kv_transfer_params=out.get("kv_transfer_params"))
            if body.get("stream"):
                return self.relay(decode + self.path, second)
            code, out = post(decode + self.path, second, timeout)
            self.reply(code, out)

        def relay(self, url: str, body: dict) -> None:
            """The decode instance's event stream, line by line as it comes (the connection
            closes at its end: HTTP/1.0, no length)."""
            req = urllib.request.Request(url, json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
            try:
                upstream = urllib.request.urlopen(req, timeout=timeout)
            except urllib.error.HTTPError as e:
                return self.reply(e.code, json.loads(e.read() or b"{}"))
            with upstream:
                self.send_response(upstream.status)
                self.send_header("Content-Type",
                                 upstream.headers.get("Content-Type", "text/event-stream"))
                self.send_header("Cache-Control", "no-cache")
                self.end_headers()
                for line in upstream:
                    self.wfile.write(line)
                    self.wfile.flush()

        def reply(self, code: int, obj: dict) -> None:
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefill", required=True, help="base URL of the prefill instance")
    ap.add_argument("--decode", required=True, help="base URL of the decode instance")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--timeout", type=float, default=600.0, help="per upstream request, seconds")
    a = ap.parse_args()
    server = ThreadingHTTPServer((a.host, a.port),
                                 make_handler(a.prefill.rstrip("/"), a.decode.rstrip("/"), a.timeout))
    print(f"pd_proxy: http://{a.host}:{a.port} -> prefill {a.prefill}, decode {a.decode}",
          flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
