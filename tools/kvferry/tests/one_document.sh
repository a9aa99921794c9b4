#!/bin/sh
# Runs a kvferry command with --json, then with --csv, and checks stdout: --json must be ONE JSON
# document (python3 -m json.tool accepts it) with the docs/output.md fields; --csv a header and at
# least one row of the same width. Usage: one_document.sh KVFERRY ARGS...
set -eu
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
"$@" --json >"$out/doc.json" 2>"$out/err" || true
python3 -m json.tool "$out/doc.json" >/dev/null || { echo "FAIL: not one JSON document"; cat "$out/doc.json" "$out/err"; exit 1; }
python3 - "$out/doc.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for k in ("schema", "command", "versions", "config", "rows", "summary", "ok", "error"):
    assert k in d, f"missing {k}"
assert d["schema"] == "kvferry-output/1", d["schema"]
assert d["versions"]["kvferry"], d["versions"]
assert isinstance(d["config"], dict) and d["config"], "config must echo the configuration"
assert isinstance(d["rows"], list) and isinstance(d["summary"], dict)
assert d["rows"] or d["summary"], "no result"
assert d["ok"] is True, d["error"]
PY
"$@" --csv >"$out/doc.csv" 2>"$out/err" || true
python3 - "$out/doc.csv" <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
assert len(rows) >= 2, f"csv needs a header and a row: {rows}"
assert all(len(r) == len(rows[0]) for r in rows), "ragged csv"
PY
echo PASS
