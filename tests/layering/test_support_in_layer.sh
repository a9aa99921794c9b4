#!/bin/sh
# Test support lives in src/testing (the testing target), not in the layers' folders: no file of a
# layer's folder includes a testing/ or selftest/ header, except the tests themselves (*_test.cc,
# which sit beside the code they test). A helper shared by several tests (a fixture, a cluster
# harness, a plan executor for tests) or a bench that needs test data belongs in src/testing.
# Usage: test_support_in_layer.sh ROOT DIR... (DIRs relative to ROOT). Prints one "FAIL:" line
# per offending include and exits 1, or "PASS".
root="$1"
shift
bad=0
for d in "$@"; do
  for f in $(find "$root/$d" -type f \( -name '*.h' -o -name '*.cc' -o -name '*.cu' \) \
               ! -name '*_test.cc' | sort); do
    grep -Hn '^#include "\(testing\|selftest\)/' "$f" | while IFS= read -r hit; do
      echo "FAIL: ${hit#"$root"/}: test support in a layer's folder (move it to src/testing)"
    done
    grep -q '^#include "\(testing\|selftest\)/' "$f" && bad=1
  done
done
[ "$bad" -eq 0 ] && echo PASS
exit "$bad"
