#!/bin/sh
# Starts a kvferry command with --metrics-port 0, waits for the endpoint that stderr names after
# WHO ("kvferry: WHO at http://..."), scrapes it while the command runs and checks the text.
# Usage: scrape_metrics.sh KVFERRY WHO ARGS...
set -eu
exe=$1; who=$2; shift 2
out=$(mktemp -d)
trap 'kill $pid 2>/dev/null || true; rm -rf "$out"' EXIT
"$exe" "$@" >"$out/stdout" 2>"$out/stderr" &
pid=$!
python3 - "$out/stderr" "$who" <<'PY'
import re, sys, time, urllib.request
path, who = sys.argv[1], sys.argv[2]
deadline = time.time() + 60
url = None
while url is None and time.time() < deadline:
    m = re.search(re.escape(who) + r" at (http://\S+)", open(path).read())
    url = m.group(1) if m else None
    time.sleep(0.05)
assert url, "no endpoint named on stderr: " + open(path).read()
text = ""
while time.time() < deadline:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    if re.search(r'^kvferry_requests_total\{[^}]*state="complete"\} [1-9]', text, re.M):
        break
    time.sleep(0.1)
assert re.search(r'^kvferry_requests_total\{[^}]*state="complete"\} [1-9]', text, re.M), text
assert "# TYPE kvferry_chunk_latency_seconds histogram" in text, text
for line in text.splitlines():
    if not line.startswith("#"):
        assert re.fullmatch(r'[a-z_]+(\{[^}]*\})? [-+0-9.eInf]+', line), line
print("scraped", url, len(text), "bytes")
PY
wait $pid
echo PASS
