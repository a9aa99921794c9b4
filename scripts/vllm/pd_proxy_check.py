"""pd_proxy.py's routing against two stub upstreams (no vLLM): the prefill gets max_tokens=1 and
do_remote_decode, the decode gets the request as sent plus the prefill's kv_transfer_params, the
client gets the decode's answer. Prints one PASS/FAIL line; exit 1 on failure."""

import json
import os
import sys
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pd_proxy  # noqa: E402

seen = []


def stub(name):
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append((name, body))
            params = {"kvferry": {"request_id": "r1"}} if name == "prefill" else None
            data = json.dumps({"choices": [{"text": name}], "kv_transfer_params": params}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_port}"


def main() -> int:
    handler = pd_proxy.make_handler(stub("prefill"), stub("decode"), 10.0)
    handler.log_message = lambda *args: None
    proxy = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    req = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 8}
    r = urllib.request.urlopen(urllib.request.Request(
        f"http://127.0.0.1:{proxy.server_port}/v1/completions", json.dumps(req).encode(),
        {"Content-Type": "application/json"}), timeout=10)
    answer = json.load(r)
    ok = (answer["choices"][0]["text"] == "decode" and len(seen) == 2
          and seen[0] == ("prefill", dict(req, max_tokens=1,
                                           kv_transfer_params={"do_remote_decode": True}))
          and seen[1] == ("decode", dict(req, kv_transfer_params={"kvferry": {"request_id": "r1"}})))
    print(f"{'PASS' if ok else 'FAIL'}  pd_proxy: client -> prefill (max_tokens=1) -> decode "
          f"with the prefill's kv_transfer_params", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
