#!/usr/bin/env bash
# Runs a command that must be refused: a non-zero exit code, stderr matching REGEX (grep -E), and
# (with --no-ranks) no rank process started (no rendezvous directory appears in a fresh TMPDIR).
# Usage: expect_fail.sh [--no-ranks] REGEX COMMAND ARGS...
set -u
no_ranks=0
[ "$1" = --no-ranks ] && { no_ranks=1; shift; }
regex=$1
shift
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
TMPDIR="$tmp" "$@" >"$tmp.out" 2>"$tmp.err"
rc=$?
echo "exit code $rc; stderr:"
cat "$tmp.err"
fail=0
[ "$rc" != 0 ] || { echo "FAIL: exit code 0"; fail=1; }
grep -Eq -- "$regex" "$tmp.err" || { echo "FAIL: stderr does not match: $regex"; fail=1; }
if [ "$no_ranks" = 1 ] && [ -n "$(ls -A "$tmp")" ]; then
  echo "FAIL: ranks were started: $(ls "$tmp")"
  fail=1
fi
rm -f "$tmp.out" "$tmp.err"
[ "$fail" = 0 ] && echo PASS
