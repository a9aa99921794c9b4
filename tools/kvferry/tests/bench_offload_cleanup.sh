#!/usr/bin/env bash
# A bench offload that fails part-way leaves none of the slab files it created (and keeps what
# was there before). The failure: with one slot per file, the second slab file's name is taken
# by a directory, so the file tier cannot open it after it created the first.
# Usage: bench_offload_cleanup.sh KVFERRY DIR (DIR: on a disk, for O_DIRECT; created and removed)
set -u
kvferry=$1 dir=$2
rm -rf "$dir" && mkdir -p "$dir/kvferry-slab-00001.kvf"
trap 'rm -rf "$dir"' EXIT
"$kvferry" --set files.slots_per_file=1 bench offload --device cpu --tier file --dir "$dir" \
  --model 8b --layout block-major --total-bytes 8388608 --iters 1 --json >/dev/null
rc=$?
left=$(ls "$dir")
echo "exit code $rc; left in the directory: $left"
[ "$rc" != 0 ] || { echo "FAIL: the bench did not fail"; exit 1; }
[ "$left" = kvferry-slab-00001.kvf ] || { echo "FAIL: slab files left behind"; exit 1; }
echo PASS
