#!/usr/bin/env bash
# Kills the parent or one rank of a running kvferry command and checks that, within the request
# deadline + 5 s, no process of the run and no temporary file is left.
# Usage: no_orphans.sh KVFERRY selftest|bench-transfer|soak|demo parent|rank|gen-rank SIGNAL
#   rank: context rank 0; gen-rank: generation rank 0.
#   selftest, bench-transfer: ranks are processes (UCX) beside the parent and a janitor;
#   soak (UCX workers in one process), demo (tiering with a file tier in a temp dir): the parent
#   (and the demo's janitor) only, so the victim is the parent.
# The run's processes are found by a marker in their environment (TMPDIR, a fresh directory that
# also holds the run's rendezvous directory and temp files), so tests running beside this one
# don't count.
set -u
kvferry=$1 command=$2 victim=$3 sig=$4
timeout_ms=2000
# On a loaded machine (CI runs two tests at once on 2 cores; a shared machine, or a sanitizer
# build, runs loads of 20-40) the waits below are scaled by the run queue per core (load average /
# cores, 1 to 4), as the fault matrix and the soak scale theirs: unscaled, these cases failed now
# and then at loads of 15-25 and passed alone (the start wait, 10 s, and the wind-down limit,
# deadline + 5 s, are wall-clock bounds on work that a loaded scheduler stretches).
scale=$(awk -v cores="$(nproc)" '{s = $1 / cores; if (s < 1) s = 1; if (s > 4) s = 4; print s}' /proc/loadavg)
# Arithmetic on fractional seconds by awk (bc is not on every machine: the GPU image lacks it).
calc() { awk "BEGIN { printf \"%.3f\", ($1) }"; }
holds() { [ "$(awk "BEGIN { print (($1) ? 1 : 0) }")" = 1 ]; }
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

shape=(--transport ucx --ctx-tp 2 --layers 2 --kv-heads 2 --head-dim 16 --tokens-per-block 8
  --requests 1000000 --concurrency 2 --timeout-ms $timeout_ms)
processes=5  # parent, janitor, three ranks
case "$command" in
  selftest) args=(selftest "${shape[@]}" --prompt-tokens 16) ;;
  bench-transfer) args=(bench transfer "${shape[@]}" --sweep 16) ;;
  soak) args=(soak --transport ucx --duration-s 600 --timeout-ms $timeout_ms); processes=1 ;;
  demo)
    args=(demo tiering --device cpu --rounds 200 --conversations 1000 --primary-blocks 64 --host-blocks 32
      --file-slots 256)
    processes=2  # parent, janitor of the file tier's temp dir
    ;;
  *) echo "FAIL: unknown command $command"; exit 1 ;;
esac
# (--default-signal: a shell starts background commands with SIGINT ignored.)
env --default-signal=INT TMPDIR="$tmp" "$kvferry" "${args[@]}" >"$tmp.out" 2>&1 &
parent=$!
# Wait for the processes (ranks and the clean-up process) to run and work to flow.
start_by=$(calc "$(date +%s.%N) + 10 * $scale")
while holds "$(date +%s.%N) < $start_by"; do
  [ "$(run_pids | wc -l)" -ge $processes ] && break
  sleep 0.05
done
sleep 1
ranks=$(pgrep -f -- "--cluster-config $tmp/")
echo "run: $command, parent $parent, ranks $(echo $ranks), all: $(echo $(run_pids))"
[ "$processes" = 1 ] || [ -n "$ranks" ] || [ "$command" = demo ] ||
  { echo "FAIL: no rank started"; cat "$tmp.out"; exit 1; }
[ "$(run_pids | wc -l)" -ge $processes ] ||
  { echo "FAIL: fewer than $processes processes: $(echo $(run_pids))"; cat "$tmp.out"; exit 1; }
if [ "$command" = demo ]; then
  # The file tier's slab files are in the temp dir when the demo dies.
  [ -n "$(find "$tmp" -type f 2>/dev/null | head -1)" ] ||
    { echo "FAIL: the demo wrote no file under TMPDIR"; cat "$tmp.out"; exit 1; }
fi
start=$(date +%s.%N)
if [ "$victim" = parent ]; then
  kill -s "$sig" "$parent"
elif [ "$victim" = gen-rank ]; then
  victim_pid=$(pgrep -f -- "--rank-of-cluster gen:0 --cluster-config $tmp/" | head -1)
  victim_name="generation rank 0"
  kill -s "$sig" "$victim_pid"
else
  victim_pid=$(echo "$ranks" | head -1)  # context rank 0: ranks start in order
  victim_name="context rank 0"
  kill -s "$sig" "$victim_pid"
fi
limit=$(calc "($timeout_ms / 1000 + 5) * $scale")
# A stopped rank is not dead: the ranks waiting on it give up after a request deadline (+ the
# context side's abort grace, 1 s, + 1 s) without progress (requests that end by their deadline
# are not progress); then the others get one more deadline + 3 s to end their requests
# (run_watch.h); + 8 s for a loaded machine.
[ "$sig" = STOP ] && limit=$(calc "(2 * $timeout_ms / 1000 + 1 + 1 + 3 + 8) * $scale")
while :; do
  left=$(run_pids)
  files=$(find "$tmp" -mindepth 1 2>/dev/null)
  [ -z "$left" ] && [ -z "$files" ] && break
  if holds "$(date +%s.%N) - $start > $limit"; then
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
took=$(calc "$(date +%s.%N) - $start")
echo "nothing left after ${took} s (limit ${limit} s, load scale $scale); parent exit code $rc"
tail -n 5 "$tmp.out"
if [ "$victim" != parent ]; then
  # The run ends, failed, with a summary that names the killed rank's process and how it ended.
  [ "$rc" != 0 ] || { echo "FAIL: run passed"; exit 1; }
  if [ "$sig" = STOP ]; then
    want="error: $victim_name: no result (its process, pid $victim_pid: killed at the run deadline)"
  else
    want="error: $victim_name: no result (its process, pid $victim_pid: killed by signal 9"
  fi
  grep -qF "$want" "$tmp.out" ||
    { echo "FAIL: the killed rank is not named: $want"; echo "--- the run's output:"; cat "$tmp.out"; exit 1; }
fi
rm -f "$tmp.out"
echo PASS
