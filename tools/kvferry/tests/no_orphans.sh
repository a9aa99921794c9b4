#!/usr/bin/env bash
# Kills the parent or one rank of a running `kvferry selftest` and checks that, within the request
# deadline + 5 s, no process of the run and no temporary file is left.
# Usage: no_orphans.sh KVFERRY parent|rank SIGNAL
# The run's processes are found by a marker in their environment (TMPDIR, a fresh directory that
# also holds the run's rendezvous directory), so tests running beside this one don't count.
set -u
kvferry=$1 victim=$2 sig=$3
timeout_ms=2000
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# Pids of live (not zombie) processes whose environment carries the marker, the parent included.
run_pids() {
  local p
  for p in /proc/[0-9]*; do
    [ "${p#/proc/}" = "$$" ] && continue
    grep -qzx "TMPDIR=$tmp" "$p/environ" 2>/dev/null || continue
    [ "$(awk '{print $3}' "$p/stat" 2>/dev/null)" = Z ] && continue
    echo "${p#/proc/}"
  done
}

# (--default-signal: a shell starts background commands with SIGINT ignored.)
env --default-signal=INT TMPDIR="$tmp" "$kvferry" selftest --transport ucx --ctx-tp 2 --layers 2 --kv-heads 2 \
  --head-dim 16 --tokens-per-block 8 --prompt-tokens 16 --requests 1000000 --concurrency 2 \
  --timeout-ms $timeout_ms >"$tmp.out" 2>&1 &
parent=$!
# Wait for the three ranks (and the clean-up process) to run and requests to flow.
for _ in $(seq 200); do
  [ "$(run_pids | wc -l)" -ge 5 ] && break
  sleep 0.05
done
sleep 1
ranks=$(pgrep -f -- "--cluster-config $tmp/")
echo "run: parent $parent, ranks $(echo $ranks), all: $(echo $(run_pids))"
[ -n "$ranks" ] || { echo "FAIL: no rank started"; cat "$tmp.out"; exit 1; }
start=$(date +%s.%N)
if [ "$victim" = parent ]; then
  kill -s "$sig" "$parent"
else
  victim_pid=$(echo "$ranks" | head -1)  # context rank 0: ranks start in order
  kill -s "$sig" "$victim_pid"
fi
limit=$(echo "$timeout_ms / 1000 + 5" | bc)
# A stopped rank is not dead: the generation rank gives up after a request deadline (+ the
# context side's abort grace, 1 s, + 1 s) without progress; then the other context rank gets one
# more deadline + 3 s to end its requests (run_watch.h); + 8 s for a loaded machine.
[ "$sig" = STOP ] && limit=$(echo "2 * $timeout_ms / 1000 + 1 + 1 + 3 + 8" | bc)
while :; do
  left=$(run_pids)
  files=$(find "$tmp" -mindepth 1 2>/dev/null)
  [ -z "$left" ] && [ -z "$files" ] && break
  if [ "$(echo "$(date +%s.%N) - $start > $limit" | bc)" = 1 ]; then
    echo "FAIL: after ${limit} s, processes left: $(echo $left); files left: $(echo "$files" | head -3)"
    ps -o pid,ppid,pgid,stat,cmd -p "$(echo $left | tr ' ' ,)" 2>/dev/null
    kill -9 $left 2>/dev/null
    cat "$tmp.out"
    rm -f "$tmp.out"
    exit 1
  fi
  sleep 0.05
done
wait "$parent"
rc=$?
took=$(echo "$(date +%s.%N) - $start" | bc)
echo "nothing left after ${took} s (limit ${limit} s); parent exit code $rc"
tail -n 5 "$tmp.out"
if [ "$victim" = rank ]; then
  # The run ends, failed, with a summary that names the killed rank's process and how it ended.
  [ "$rc" != 0 ] || { echo "FAIL: run passed"; exit 1; }
  if [ "$sig" = STOP ]; then
    want="error: context rank 0: no result (its process, pid $victim_pid: killed at the run deadline)"
  else
    want="error: context rank 0: no result (its process, pid $victim_pid: killed by signal 9"
  fi
  grep -qF "$want" "$tmp.out" || { echo "FAIL: the killed rank is not named: $want"; exit 1; }
fi
rm -f "$tmp.out"
echo PASS
