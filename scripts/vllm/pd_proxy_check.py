"""pd_proxy.py's routing against two stub upstreams (no vLLM): the prefill gets max_tokens=1 and
do_remote_decode, the decode gets the request as sent plus the prefill's kv_transfer_params, the
client gets the decode's answer; a streamed request reaches the client event by event (the stub
sends its second event only once the client holds the first: behind a proxy that buffered, it
waits 5 s in vain and the case fails). Prints one PASS/FAIL line per case; exit 1 on failure."""

import json
import os
import sys
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pd_proxy  # noqa: E402

seen = []
first_event_read = threading.Event()
gate_opened = []  # whether the client held the first event before the stub sent the second


def stub(name):
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append((name, body))
            if body.get("stream"):
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for i, text in enumerate(("de", "code")):
                    if i == 1:
                        gate_opened.append(first_event_read.wait(5))
                    chunk = {"choices": [{"text": text, "token_ids": [i]}]}
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    self.wfile.flush()
                self.wfile.write(b"data: [DONE]\n\n")
                return
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
          and seen[0] == ("prefill", dict(req, max_tokens=1, stream=False,
                                           kv_transfer_params={"do_remote_decode": True}))
          and seen[1] == ("decode", dict(req, kv_transfer_params={"kvferry": {"request_id": "r1"}})))
    print(f"{'PASS' if ok else 'FAIL'}  pd_proxy: client -> prefill (max_tokens=1) -> decode "
          f"with the prefill's kv_transfer_params", flush=True)

    seen.clear()
    streamed = dict(req, stream=True, stream_options={"include_usage": True})
    r = urllib.request.urlopen(urllib.request.Request(
        f"http://127.0.0.1:{proxy.server_port}/v1/completions", json.dumps(streamed).encode(),
        {"Content-Type": "application/json"}), timeout=10)
    events = []
    for line in r:
        if not line.startswith(b"data: "):
            continue
        events.append(line[6:].strip())
        first_event_read.set()
    texts = [json.loads(e)["choices"][0]["text"] for e in events if e != b"[DONE]"]
    ok2 = (gate_opened == [True] and r.headers["Content-Type"] == "text/event-stream"
           and texts == ["de", "code"]
           and events[-1] == b"[DONE]" and len(seen) == 2
           and seen[0] == ("prefill", dict(req, max_tokens=1, stream=False,
                                           kv_transfer_params={"do_remote_decode": True}))
           and seen[1] == ("decode", dict(streamed,
                                          kv_transfer_params={"kvferry": {"request_id": "r1"}})))
    print(f"{'PASS' if ok2 else 'FAIL'}  pd_proxy: a streamed request: the prefill not streamed, "
          f"the decode's events relayed one by one ({len(events)} events)", flush=True)
    return 0 if ok and ok2 else 1


if __name__ == "__main__":
    sys.exit(main())
