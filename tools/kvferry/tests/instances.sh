#!/usr/bin/env bash
# Instances as separate commands (issue 25): `kvferry rendezvous` serves, a context instance and a
# generation instance start as two more commands (the generation one split in two: its ranks 0
# and 1 from separate commands), meet through the rendezvous over UCX, and every request is
# fetched and verified. With --netns, each instance runs in a network namespace of its own
# (veth pair 10.77.0.1 <-> 10.77.0.2, the rendezvous in the context's), in its own IPC and mount
# namespaces too: nothing shared but the network, so peer memory and UCX's shared memory must be
# found unusable and the KV goes over the network (TCP).
# With --link-cut too (one generation command then), the link between the hosts goes down for
# 1.5 s while requests flow, and comes back: a cut shorter than the request deadline costs no
# request (TCP retransmits, UCX keeps its endpoints), and requests go on after it. With
# --long-cut, down 3.5 s against a 2 s deadline and --give-up-ms 20000: the requests in flight
# fail by their deadline, the rest go on once the link is back (no restart).
# With --vanish, the context host vanishes mid-run without a word: its link goes down, every
# process of it is killed (its PID namespaces) and its network namespace deleted, the rendezvous
# with it. The generation instance
# must end on its own within its deadlines (2 s, plus the abort grace and 1 s without progress),
# naming what failed, with every request accounted for.
# With --stop, the context host stops mid-run without a word (every process of it SIGSTOPped: its
# sockets stay open and the kernel keeps acknowledging what fits in their buffers, but nothing is
# read or answered, a half-open peer): the generation instance must end on its own within its
# deadlines as with --vanish; resumed, the context instance must end on its own too.
# With --stale-address, the context instance publishes its ranks' addresses and is killed before
# the generation instance starts: the addresses in the rendezvous name ports nobody listens on.
# Every request must fail within its deadline, naming the context rank and the refused connection.
# With --lossy, the hosts are joined not by a veth pair but by link_emulator.py (this kernel has
# no sch_netem): 1% of packets lost and 50 ms of delay each way, 1% reordered; every request of a
# TP2 -> TP2 run must still be fetched and verified within its deadline.
# With --matrix, a layout matrix across the two hosts: one context and one generation instance
# command per case (a fresh rendezvous each), TP, PP (uneven), attention DP, MLA, duplicated
# heads, block sizes, a dtype conversion and custom strides differing between the sides; every
# generation rank must verify every element of every request.
# With --bench (on this host), both instances run with --bench: the generation instance must print
# a measured row whose raw-transport and copy baselines came from context rank 0 through the
# rendezvous, every request verified.
# Usage: instances.sh KVFERRY [--bench | --netns [--link-cut|--long-cut|--vanish|--stop|
#                                                  --stale-address|--lossy|--matrix]]
#   (exit 77: --netns needs root and `ip netns`)
set -u
kvferry=$1
netns=0; [ "${2:-}" = --netns ] && netns=1
bench=0; [ "${2:-}" = --bench ] && bench=1
cut=0; [ "${3:-}" = --link-cut ] && cut=1
[ "${3:-}" = --long-cut ] && cut=2
[ "${3:-}" = --vanish ] && cut=3
[ "${3:-}" = --stop ] && cut=4
stale=0; [ "${3:-}" = --stale-address ] && stale=1
lossy=0; [ "${3:-}" = --lossy ] && lossy=1
matrix=0; [ "${3:-}" = --matrix ] && matrix=1
((((cut || stale || lossy || matrix)) && !netns)) &&
  { echo "FAIL: --link-cut, --long-cut, --vanish, --stop, --stale-address, --lossy and --matrix need --netns"; exit 1; }
tmp=$(mktemp -d)
pids=()
# The generation rank's summary, "generation rank 0: S requests, F failed, V verified" (requests
# never started count as failed), into $failed and $verified; false without one.
tally() {
  local line
  line=$(grep -o "generation rank 0: [0-9]* requests, [0-9]* failed, [0-9]* verified" "$1")
  failed=$(sed -n 's/.* \([0-9]*\) failed.*/\1/p' <<<"$line")
  verified=$(sed -n 's/.* \([0-9]*\) verified.*/\1/p' <<<"$line")
  [ -n "$line" ]
}
emulator=
cleanup() {
  [ -n "$emulator" ] && kill -TERM "$emulator" 2>/dev/null && wait "$emulator"
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done
  for p in "${pids[@]}"; do timeout 10 tail --pid="$p" -f /dev/null || kill -KILL "$p" 2>/dev/null; done
  if ((netns)); then ip netns del "$ns_a" 2>/dev/null; ip netns del "$ns_b" 2>/dev/null; fi
  rm -rf "$tmp"
}
trap cleanup EXIT
n=12; ((lossy)) && n=48  # over the lossy link: enough packets that some are lost
shape=(--layers 4 --kv-heads 4 --head-dim 16 --tokens-per-block 8 --ctx-tp 2 --gen-tp 2
       --gen-layout per-layer --requests $n --concurrency 2 --prompt-tokens 20,37 --timeout-ms 20000
       --transport ucx)
run_a=() run_b=() bind=127.0.0.1:0
if ((netns)); then
  if [ "$(id -u)" != 0 ] || ! command -v ip >/dev/null || ! command -v unshare >/dev/null; then
    echo "SKIP: network namespaces need root, ip and unshare"; exit 77
  fi
  ns_a=kvf-a-$$ ns_b=kvf-b-$$
  ip netns add "$ns_a" && ip netns add "$ns_b" || { echo "SKIP: ip netns add failed"; exit 77; }
fi
if ((lossy)); then
  [ -c /dev/net/tun ] || { echo "SKIP: no /dev/net/tun"; exit 77; }
  python3 "$(dirname "$0")/link_emulator.py" "$ns_a" 10.77.0.1 "$ns_b" 10.77.0.2 --delay-ms 50 \
    --loss 0.01 --reorder 0.01 --ready-file "$tmp/link.ready" >"$tmp/link.out" 2>&1 &
  emulator=$!
  for _ in $(seq 1 100); do [ -f "$tmp/link.ready" ] && break; sleep 0.05; done
  [ -f "$tmp/link.ready" ] || { echo "FAIL: the link emulator did not start"; cat "$tmp/link.out"; exit 1; }
elif ((netns)); then
  ip link add "va-$$" netns "$ns_a" type veth peer name "vb-$$" netns "$ns_b" || {
    echo "SKIP: no veth pairs here"; exit 77; }
  ip -n "$ns_a" addr add 10.77.0.1/24 dev "va-$$" && ip -n "$ns_a" link set "va-$$" up
  ip -n "$ns_b" addr add 10.77.0.2/24 dev "vb-$$" && ip -n "$ns_b" link set "vb-$$" up
  ip -n "$ns_a" link set lo up && ip -n "$ns_b" link set lo up
  # The kernel marks a veth running (operstate UP) up to a second after both ends are up; UCX
  # lists only running interfaces when a transport starts, so a rank that started before that
  # saw no way to the other host ("tcp/lo - local loopback remote non-loopback").
  for _ in $(seq 1 100); do
    ip -n "$ns_a" -o link show "va-$$" | grep -q "state UP" &&
      ip -n "$ns_b" -o link show "vb-$$" | grep -q "state UP" && break
    sleep 0.05
  done
fi
if ((netns)); then
  # Each "host": its network namespace, and IPC, mount and PID namespaces of its own.
  run_a=(ip netns exec "$ns_a" unshare --ipc --mount --pid --fork --kill-child --mount-proc)
  run_b=(ip netns exec "$ns_b" unshare --ipc --mount --pid --fork --kill-child --mount-proc)
  bind=10.77.0.1:0
fi
# A rendezvous server on the context host; its address into $addr.
start_rendezvous() {
  "${run_a[@]}" "$kvferry" rendezvous --bind "$bind" --key-file "$tmp/key" >"$tmp/rv.out" 2>&1 &
  pids+=($!)
  addr=
  for _ in $(seq 1 200); do
    addr=$(sed -n 's/^kvferry rendezvous: serving on \([^ ]*\) .*/\1/p' "$tmp/rv.out")
    [ -n "$addr" ] && break
    sleep 0.05
  done
  [ -n "$addr" ] || { echo "FAIL: the rendezvous did not start"; cat "$tmp/rv.out"; exit 1; }
  echo "rendezvous at $addr"
}
if ((bench)); then
  start_rendezvous
  common=(--rendezvous "$addr" --rendezvous-key-file "$tmp/key" --layers 4 --kv-heads 4
          --head-dim 16 --tokens-per-block 8 --requests 6 --concurrency 2 --prompt-tokens 64
          --transport ucx --timeout-ms 20000 --bench --warmup 1)
  "$kvferry" instance --role context "${common[@]}" >"$tmp/ctx.out" 2>&1 &
  ctx=$!
  "$kvferry" instance --role generation "${common[@]}" --json >"$tmp/gen.json" 2>"$tmp/gen.err" &
  gen=$!
  fail=0
  for p in ctx gen; do
    timeout 120 tail --pid="${!p}" -f /dev/null
    wait "${!p}" || { echo "FAIL: the $p instance failed"; fail=1; }
  done
  python3 - "$tmp/gen.json" <<'EOF' || fail=1
import json, sys
doc = json.load(open(sys.argv[1]))
rows = [r for r in doc["rows"] if r.get("role") == "summary"]
if not doc["ok"] or len(rows) != 1:
    sys.exit(f"FAIL: no passing measured row: ok {doc['ok']}, error {doc.get('error')}")
r = rows[0]
print(f"measured: {r['gbps']:.2f} GB/s, raw {r['baseline_gbps']:.2f} ({r['baseline']}), "
      f"copy {r['copy_gbps']:.2f}, {r['verified']} of {r['requests']} verified")
if not (r["gbps"] > 0 and r["baseline_gbps"] > 0 and r["copy_gbps"] > 0 and r["verified_all"]
        and r["verified"] == r["requests"] == 6 and r["warmup"] == 1):
    sys.exit("FAIL: the row lacks a measurement, a baseline or a verified request")
EOF
  ((fail)) && { echo "== ctx"; cat "$tmp/ctx.out"; echo "== gen"; cat "$tmp/gen.json" "$tmp/gen.err"; }
  ((fail == 0)) && echo PASS
  exit "$fail"
fi
if ((matrix)); then
  base=(--layers 4 --head-dim 16 --tokens-per-block 8 --requests 6 --concurrency 2
        --prompt-tokens 20,37,9 --timeout-ms 20000 --transport ucx)
  cases=(
    "tp2 -> tp1 pp2, per-layer-hnd|--ctx-tp 2 --gen-pp 2 --gen-layout per-layer-hnd"
    "uneven pp3 -> tp4, vllm-nhd|--ctx-pp 3 --ctx-pp-layers 1,2,1 --gen-tp 4 --gen-layout vllm-nhd"
    "mla tp2 dp2 -> tp2, layer-wise|--mla --ctx-tp 2 --ctx-dp 2 --gen-tp 2 --layer-wise"
    "duplicated heads tp1 -> tp4|--kv-heads 2 --gen-tp 4 --ctx-layout flashinfer-hnd"
    "tp4 -> tp2 per-layer-kv, blocks 16 -> 8|--ctx-tp 4 --gen-tp 2 --gen-layout per-layer-kv --ctx-tokens-per-block 16"
    "bf16 -> fp8, tp2 -> tp1, vllm-hnd -> vllm-nhd|--ctx-tp 2 --ctx-layout vllm-hnd --gen-layout vllm-nhd --gen-dtype fp8"
    "custom strides both sides, tp2 -> pp2|--ctx-tp 2 --ctx-layout custom:one:block,kv,layer,token,head,dim:pad=40 --gen-pp 2 --gen-layout custom:per-layer:head,block,kv,token,dim"
  )
  fail=0
  for c in "${cases[@]}"; do
    name=${c%%|*}
    read -r -a extra <<<"${c#*|}"
    [[ " ${extra[*]} " == *" --kv-heads "* ]] || extra+=(--kv-heads 4)
    start_rendezvous
    common=(--rendezvous "$addr" --rendezvous-key-file "$tmp/key" "${base[@]}" "${extra[@]}")
    "${run_a[@]}" "$kvferry" instance --role context "${common[@]}" >"$tmp/ctx.out" 2>&1 &
    ctx=$!
    "${run_b[@]}" "$kvferry" instance --role generation "${common[@]}" >"$tmp/gen.out" 2>&1 &
    gen=$!
    ok=1
    for p in ctx gen; do
      timeout 120 tail --pid="${!p}" -f /dev/null
      wait "${!p}" || ok=0
    done
    # The rendezvous: unshare's parent ignores SIGTERM; killed, it takes its child (--kill-child).
    kill -KILL "${pids[-1]}" 2>/dev/null; wait "${pids[-1]}" 2>/dev/null
    ranks=$(grep -c "generation rank [0-9]*: 6 requests, 0 failed, 6 verified" "$tmp/gen.out")
    world=$(sed -n 's/.*generation instance, ranks \([0-9,-]*\) here.*/\1/p' "$tmp/gen.out" |
            tr ',' '\n' | grep -c .)
    if ((ok && ranks > 0 && ranks == world)) && ! grep -q "peer-memory" "$tmp/gen.out"; then
      echo "PASS  $name: $ranks generation ranks verified 6 of 6"
    else
      echo "FAIL  $name ($ranks of $world generation ranks verified)"
      echo "== ctx"; cat "$tmp/ctx.out"; echo "== gen"; cat "$tmp/gen.out"
      fail=1
    fi
  done
  ((fail == 0)) && echo PASS
  exit "$fail"
fi
start_rendezvous
common=(--rendezvous "$addr" --rendezvous-key-file "$tmp/key")
if ((stale)); then
  shape=(--layers 4 --kv-heads 4 --head-dim 16 --tokens-per-block 8 --ctx-tp 2 --gen-tp 2
         --requests 12 --concurrency 2 --prompt-tokens 20,37 --transport ucx --timeout-ms 2000)
  "${run_a[@]}" "$kvferry" instance --role context "${common[@]}" "${shape[@]}" --progress \
    >"$tmp/ctx.out" 2>&1 &
  ctx=$!
  pids+=($ctx)
  # Its ranks publish their addresses as they start; a second of progress lines means they run.
  for _ in $(seq 1 200); do grep -q "requests done per" "$tmp/ctx.out" && break; sleep 0.05; done
  grep -q "requests done per" "$tmp/ctx.out" || { echo "FAIL: the context instance did not start"; cat "$tmp/ctx.out"; exit 1; }
  kill -KILL "$ctx"; wait "$ctx" 2>/dev/null  # its PID namespace with it (unshare --kill-child)
  started=$(date +%s%N)
  "${run_b[@]}" "$kvferry" instance --role generation "${common[@]}" "${shape[@]}" >"$tmp/gen.out" 2>&1 &
  gen=$!
  pids+=($gen)
  timeout 60 tail --pid="$gen" -f /dev/null
  wait "$gen"; rc=$?
  ended_ms=$((($(date +%s%N) - started) / 1000000))
  echo "== gen (exit $rc, ${ended_ms} ms)"; cat "$tmp/gen.out"
  fail=0
  ((rc != 0)) || { echo "FAIL: the generation instance reported success without its peer"; fail=1; }
  # Start-up, then the 2 s deadline and the abort grace, with room for a loaded machine.
  ((ended_ms <= 20000)) || { echo "FAIL: the generation instance took ${ended_ms} ms to end"; fail=1; }
  tally "$tmp/gen.out"; got=$?
  if ((got != 0 || failed != 12 || verified != 0)); then
    echo "FAIL: generation rank 0 should fail its 12 requests (${failed:-?} failed, ${verified:-?} verified)"
    fail=1
  fi
  for r in 0 1; do
    grep -qE "generation rank $r: .*context rank [01]: .*(unreachable|refused)" "$tmp/gen.out" ||
      { echo "FAIL: generation rank $r's error does not name the context rank and the refusal"; fail=1; }
  done
  ((fail == 0)) && echo PASS
  exit "$fail"
fi
if ((cut)); then
  # Long enough to span the cut (about 1,000 requests a second here), a deadline well past it
  # and past TCP's retransmission backoff after it (the next retransmission up to 3 s after the
  # cut began).
  requests=6000 down=1.5 deadline=(--timeout-ms 8000)
  ((cut == 2)) && down=3.5 deadline=(--timeout-ms 2000 --give-up-ms 20000)
  ((cut >= 3)) && deadline=(--timeout-ms 2000)
  shape=(--layers 4 --kv-heads 4 --head-dim 16 --tokens-per-block 8 --requests $requests
         --concurrency 2 --prompt-tokens 20,37 --transport ucx "${deadline[@]}")
  "${run_a[@]}" "$kvferry" instance --role context "${common[@]}" "${shape[@]}" >"$tmp/ctx.out" 2>&1 &
  ctx=$!
  pids+=($ctx)
  "${run_b[@]}" "$kvferry" instance --role generation "${common[@]}" "${shape[@]}" --progress \
    >"$tmp/gen.out" 2>&1 &
  gen=$!
  pids+=($gen)
  done_now() { sed -n 's/.*requests done per generation rank: \([0-9]*\).*/\1/p' "$tmp/gen.out" | tail -1; }
  for _ in $(seq 1 600); do [ -n "$(done_now)" ] && break; sleep 0.05; done
  at_cut=$(done_now)
  if ((cut >= 3)); then
    if ((cut == 3)); then
      # Silently, as a host that loses power: the link goes first, so no reset or FIN of its
      # dying sockets reaches the generation host; then every process of it (the context's and
      # the rendezvous's PID namespaces) and its network namespace.
      ip -n "$ns_b" link set "vb-$$" down
      kill -KILL "$ctx" "${pids[0]}"
      ip netns del "$ns_a"
      what=vanished
    else
      # Every process of the host stopped where it stands: connections stay up, nothing answers.
      stopped=$(ip netns pids "$ns_a")
      # shellcheck disable=SC2086
      kill -STOP $stopped
      what=stopped
    fi
    vanished=$(date +%s%N)
    echo "context host $what after ${at_cut:-no} requests of $requests"
    timeout 60 tail --pid="$gen" -f /dev/null
    wait "$gen"; rc=$?
    ended_ms=$((($(date +%s%N) - vanished) / 1000000))
    echo "== gen (exit $rc, ${ended_ms} ms after the host $what)"; grep -v "requests done per" "$tmp/gen.out"
    fail=0
    if ((cut == 4)); then
      # shellcheck disable=SC2086
      kill -CONT $stopped
      resumed=$(date +%s%N)
      timeout 60 tail --pid="$ctx" -f /dev/null
      wait "$ctx"; crc=$?
      ctx_ms=$((($(date +%s%N) - resumed) / 1000000))
      echo "== ctx (exit $crc, ${ctx_ms} ms after it resumed)"; grep -v "requests done per" "$tmp/ctx.out"
      # Its requests' deadlines passed while it was stopped: it ends within its own give-up time.
      ((ctx_ms <= 30000)) || { echo "FAIL: the resumed context instance took ${ctx_ms} ms to end"; fail=1; }
    fi
    if [ -z "$at_cut" ] || ((at_cut >= requests)); then
      echo "FAIL: the host did not vanish inside the run"; fail=1
    fi
    ((rc != 0)) || { echo "FAIL: the generation instance reported success without its peer"; fail=1; }
    # 2 s deadline, the abort grace and 1 s without progress, with room for a loaded machine.
    ((ended_ms <= 15000)) || { echo "FAIL: the generation instance took ${ended_ms} ms to end"; fail=1; }
    tally "$tmp/gen.out"; got=$?
    echo "host $what: ${failed:-?} failed, ${verified:-?} verified of $requests"
    if ((got != 0 || failed + verified != requests)); then
      echo "FAIL: the generation rank did not account for its $requests requests"; fail=1
    fi
    grep -qiE "deadline|gave up|unreachable|not delivered|lost|closed" "$tmp/gen.out" ||
      { echo "FAIL: no error says what failed"; fail=1; }
    ((fail == 0)) && echo PASS
    exit "$fail"
  fi
  ip -n "$ns_b" link set "vb-$$" down
  sleep "$down"
  ip -n "$ns_b" link set "vb-$$" up
  echo "link down for $down s after ${at_cut:-no} requests of $requests"
  fail=0
  for p in ctx gen; do
    timeout 120 tail --pid="${!p}" -f /dev/null
    wait "${!p}"; rc=$?
    echo "== $p (exit $rc)"; grep -v "requests done per" "$tmp/$p.out"
    ((rc == 0 || cut == 2)) || fail=1
  done
  if [ -z "$at_cut" ] || ((at_cut >= requests)); then
    echo "FAIL: the cut did not fall inside the run (${at_cut:-no} requests done at the cut)"; fail=1
  fi
  tally "$tmp/gen.out"; got=$?
  echo "cut $down s: ${failed:-?} failed, ${verified:-?} verified of $requests"
  if ((got != 0 || failed + verified != requests)); then
    echo "FAIL: the generation rank did not account for every request"; fail=1
  elif ((cut == 1 && failed != 0)); then
    echo "FAIL: a cut shorter than the deadline cost requests"; fail=1
  elif ((cut == 2 && (failed < 1 || failed > 8))); then
    # Those in flight (2) end by the deadline, and at most a few started during the cut; all the
    # others must go through once the link is back.
    echo "FAIL: a cut longer than the deadline should fail the requests in flight, 1-8, not $failed"
    fail=1
  fi
  ((fail == 0)) && echo PASS
  exit "$fail"
fi
"${run_a[@]}" "$kvferry" instance --role context "${common[@]}" "${shape[@]}" >"$tmp/ctx.out" 2>&1 &
ctx=$!
"${run_b[@]}" "$kvferry" instance --role generation --ranks 0 "${common[@]}" "${shape[@]}" \
  >"$tmp/gen0.out" 2>&1 &
gen0=$!
"${run_b[@]}" "$kvferry" instance --role generation --ranks 1 "${common[@]}" "${shape[@]}" \
  >"$tmp/gen1.out" 2>&1 &
gen1=$!
fail=0
for p in ctx gen0 gen1; do
  timeout 120 tail --pid="${!p}" -f /dev/null
  wait "${!p}"; rc=$?
  echo "== $p (exit $rc)"; cat "$tmp/$p.out"
  ((rc == 0)) || fail=1
done
# Every generation rank fetched and verified its requests (each request on both ranks).
for g in gen0 gen1; do
  grep -q "generation rank .: $n requests, 0 failed, $n verified" "$tmp/$g.out" || {
    echo "FAIL: $g did not verify $n requests"; fail=1; }
done
if ((lossy)); then
  kill -TERM "$emulator"; wait "$emulator"; emulator=
  cat "$tmp/link.out"
  dropped=$(sed -n 's/.*dropped \([0-9]*\),.*/\1/p' "$tmp/link.out")
  ((${dropped:-0} > 0)) || { echo "FAIL: the link lost no packet: loss was not tested"; fail=1; }
fi
if ((netns)); then
  # Between hosts nothing maps the other's memory: the KV crossed the network.
  if grep -q "peer-memory" "$tmp/gen0.out" "$tmp/gen1.out" "$tmp/ctx.out"; then
    echo "FAIL: peer memory between network namespaces of separate IPC/PID namespaces"; fail=1
  fi
fi
((fail == 0)) && echo PASS
exit "$fail"
