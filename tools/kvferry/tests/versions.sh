#!/usr/bin/env bash
# Mixed versions across separate commands (issue 25 item 4): a rolling upgrade, one instance on
# the previous wire version (transfer.wire_version=10, which behaves as a version-10 build) and
# the other on the current one, both ways round: every request fetched and verified. Then a
# context instance two versions apart (13, pretending a build that speaks 12..13): the
# generation instance's requests fail at once, naming the peer and both versions, well within
# their deadline. Transport puts (peer memory off): the path where versions 10 and 11 behave
# differently. Usage: versions.sh KVFERRY
set -u
kvferry=$1
tmp=$(mktemp -d)
rv=
cleanup() { [ -n "$rv" ] && kill -TERM "$rv" 2>/dev/null; rm -rf "$tmp"; }
trap cleanup EXIT
export KVFERRY_TRANSFER_PEER_MEMORY=off
n=8
shape=(--layers 4 --kv-heads 4 --head-dim 16 --tokens-per-block 8 --ctx-tp 2 --gen-tp 1
       --gen-layout per-layer --requests $n --concurrency 2 --prompt-tokens 20,37 --transport ucx)
fail=0
# run NAME CTX_VERSION GEN_VERSION DEADLINE_MS: a fresh rendezvous, then both instances.
run() {
  local name=$1
  "$kvferry" rendezvous --bind 127.0.0.1:0 --key-file "$tmp/key.$name" >"$tmp/rv.$name" 2>&1 &
  rv=$!
  local addr=
  for _ in $(seq 1 200); do
    addr=$(sed -n 's/^kvferry rendezvous: serving on \([^ ]*\) .*/\1/p' "$tmp/rv.$name")
    [ -n "$addr" ] && break
    sleep 0.05
  done
  [ -n "$addr" ] || { echo "FAIL: the rendezvous did not start"; fail=1; return; }
  local common=(--rendezvous "$addr" --rendezvous-key-file "$tmp/key.$name" --timeout-ms "$4")
  KVFERRY_TRANSFER_WIRE_VERSION=$2 timeout 120 "$kvferry" instance --role context "${common[@]}" \
    "${shape[@]}" >"$tmp/ctx.$name" 2>&1 &
  local ctx=$!
  local start=$(date +%s%N)
  KVFERRY_TRANSFER_WIRE_VERSION=$3 timeout 120 "$kvferry" instance --role generation \
    "${common[@]}" "${shape[@]}" >"$tmp/gen.$name" 2>&1
  gen_rc=$?
  gen_ms=$((($(date +%s%N) - start) / 1000000))
  wait "$ctx"; ctx_rc=$?
  kill -TERM "$rv" 2>/dev/null; wait "$rv" 2>/dev/null; rv=
  echo "== $name: context (version $2) exit $ctx_rc, generation (version $3) exit $gen_rc, ${gen_ms} ms"
  grep -v "requests done per" "$tmp/gen.$name" | tail -5
}
for v in "10 11" "11 10"; do
  set -- $v
  run "ctx$1_gen$2" "$1" "$2" 5000
  if ((ctx_rc != 0 || gen_rc != 0)) ||
     ! grep -q "generation rank 0: $n requests, 0 failed, $n verified" "$tmp/gen.ctx$1_gen$2"; then
    echo "FAIL: context version $1 with generation version $2 did not verify $n requests"
    cat "$tmp/ctx.ctx$1_gen$2"; fail=1
  fi
done
run ctx13_gen11 13 11 4000
((gen_rc != 0)) || { echo "FAIL: a generation instance two versions apart reported success"; fail=1; }
grep -q "speaks wire versions 12..13; this rank speaks 10..11" "$tmp/gen.ctx13_gen11" || {
  echo "FAIL: the generation instance did not name the versions"; cat "$tmp/gen.ctx13_gen11"; fail=1; }
# Requests fail at first contact, by the refusal, not by their 4 s deadline. (How long the command
# runs depends on the context instance, whose own requests wait out their deadlines: 7-13 s here.)
if grep -qiE "timed.out|no answer" "$tmp/gen.ctx13_gen11"; then
  echo "FAIL: a request ended by its deadline, not by the refusal"; fail=1
fi
((gen_ms < 60000)) || { echo "FAIL: the generation instance took ${gen_ms} ms to end"; fail=1; }
((fail == 0)) && echo PASS
exit "$fail"
