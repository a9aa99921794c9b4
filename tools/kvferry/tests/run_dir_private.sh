#!/usr/bin/env bash
# The run directory of a multi-process selftest holds the rendezvous group key (config.json):
# it must be 0700 and config.json 0600 while the run goes on (they were 0755 and 0644).
# Usage: run_dir_private.sh KVFERRY
set -u
kvferry=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
TMPDIR="$tmp" "$kvferry" selftest --transport ucx --layers 2 --kv-heads 2 --head-dim 16 \
  --tokens-per-block 8 --requests 1000000 --concurrency 2 --timeout-ms 2000 --prompt-tokens 16 \
  >"$tmp.out" 2>&1 &
parent=$!
conf=
for _ in $(seq 1 400); do
  conf=$(ls "$tmp"/kvferry-*/config.json 2>/dev/null | head -1)
  [ -n "$conf" ] && break
  sleep 0.05
done
fail=0
if [ -z "$conf" ]; then
  echo "FAIL: no run directory with a config.json appeared"
  fail=1
else
  dir_mode=$(stat -c %a "$(dirname "$conf")") conf_mode=$(stat -c %a "$conf")
  echo "run directory $(dirname "$conf"): mode $dir_mode; config.json: mode $conf_mode"
  [ "$dir_mode" = 700 ] || { echo "FAIL: the run directory is not 0700"; fail=1; }
  [ "$conf_mode" = 600 ] || { echo "FAIL: config.json is not 0600"; fail=1; }
fi
kill -TERM "$parent"
wait "$parent"
rm -f "$tmp.out"
[ "$fail" = 0 ] && echo PASS
