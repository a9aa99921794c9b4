#!/usr/bin/env bash
# Killing the parent of a running `selftest --transport mpi` (SIGKILL: no handler runs) leaves no
# process and nothing in /dev/shm (OpenMPI's shared-memory segments: 4 MiB a rank; they were
# left behind) nor in TMPDIR.
# Usage: mpi_shm_cleanup.sh KVFERRY   (run alone: it compares /dev/shm before and after)
set -u
kvferry=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
run_pids() {
  local p
  for p in /proc/[0-9]*; do
    [ "${p#/proc/}" = "$$" ] && continue
    grep -qzx "TMPDIR=$tmp" "$p/environ" 2>/dev/null || continue
    [ "$(awk '{print $3}' "$p/stat" 2>/dev/null)" = Z ] && continue
    echo "${p#/proc/}"
  done
}
before=$(ls -A /dev/shm | sort)
TMPDIR="$tmp" "$kvferry" selftest --transport mpi --layers 2 --kv-heads 2 --head-dim 16 \
  --tokens-per-block 8 --requests 1000000 --concurrency 2 --timeout-ms 2000 --prompt-tokens 16 \
  >"$tmp.out" 2>&1 &
parent=$!
# Running: both ranks have made progress (their progress files exist).
for _ in $(seq 1 600); do
  [ "$(ls "$tmp"/kvferry-*/progress-* 2>/dev/null | wc -l)" -ge 2 ] && break
  sleep 0.05
done
during=$(comm -13 <(echo "$before") <(ls -A /dev/shm | sort))
echo "in /dev/shm while running: $(echo $during)"
kill -KILL "$parent"
wait "$parent" 2>/dev/null
fail=0
for _ in $(seq 1 300); do
  [ -z "$(run_pids)" ] && break
  sleep 0.1
done
[ -z "$(run_pids)" ] || { echo "FAIL: processes left: $(echo $(run_pids))"; kill -9 $(run_pids); fail=1; }
sleep 0.5  # the janitor removes the directories after the ranks are gone
left=$(comm -13 <(echo "$before") <(ls -A /dev/shm | sort))
[ -z "$left" ] || { echo "FAIL: left in /dev/shm: $(echo $left)"; fail=1; }
files=$(find "$tmp" -mindepth 1 2>/dev/null | head -3)
[ -z "$files" ] || { echo "FAIL: left in TMPDIR: $(echo $files)"; fail=1; }
[ "$fail" = 0 ] || { echo "--- the run's output:"; tail -5 "$tmp.out"; }
rm -f "$tmp.out"
[ "$fail" = 0 ] && echo PASS
