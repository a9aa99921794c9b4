#!/usr/bin/env bash
# A rank process (the hidden --rank-of-cluster) given a config it can't use ends with exit code 2
# and one line naming the file and what is wrong, never an abort (SIGABRT, exit 134) or a rank
# number it does not have.
# Usage: bad_rank_config.sh KVFERRY
set -u
kvferry=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail=0
# check NAME REGEX WHO CONFIG_TEXT
check() {
  local name=$1 regex=$2 who=$3
  printf '%s' "$4" >"$tmp/$name.json"
  "$kvferry" --rank-of-cluster "$who" --cluster-config "$tmp/$name.json" >"$tmp/out" 2>"$tmp/err"
  local rc=$?
  echo "$name: exit code $rc: $(head -c 300 "$tmp/err")"
  [ "$rc" = 2 ] || { echo "FAIL: $name: exit code $rc, expected 2"; fail=1; }
  grep -Eq -- "$regex" "$tmp/err" || { echo "FAIL: $name: stderr does not match: $regex"; fail=1; }
}
check truncated "cluster config .*truncated.json: INVALID_ARGUMENT: malformed: .*parse error" ctx:0 '{"shape": [8, 8'
check wrong_type "cluster config .*wrong_type.json: INVALID_ARGUMENT: malformed: .*type" ctx:0 '{"shape": "big"}'
check not_json "cluster config .*not_json.json: INVALID_ARGUMENT: malformed" gen:0 'hello'
# Well-formed, but values the command line refuses: the same refusal.
good='{"shape":[2,2,16,2,2,8],"ctx":{"tp":1,"pp":1,"stage_layers":[],"dp_size":1,"dp_rank":0},
"gen":{"tp":1,"pp":1,"stage_layers":[],"dp_size":1,"dp_rank":0},"ctx_layout":"block-major","gen_layout":"block-major",
"requests":2,"prompt_tokens":[16],"concurrency":1,"transport":"inproc","device":"cpu",
"layer_wise":false,"shared_prefix_blocks":0,"crash_ctx_rank":-1,"fault":"","verify":true,
"baseline":false,"timeout_ms":1000,"dir":"'"$tmp"'"}'
check too_many_ranks "cluster config .*: INVALID_ARGUMENT: --ctx-tp 65536 must be in" ctx:0 \
  "${good/\"tp\":1,/\"tp\":65536,}"
check bad_rank "--rank-of-cluster 'ctx:7': expected mpi, ctx:N \\(N < 1\\) or gen:N \\(N < 1\\)" ctx:7 "$good"
check bad_rank_text "--rank-of-cluster 'gen:x'" gen:x "$good"
[ "$fail" = 0 ] && echo PASS
