"""The Python-overhead benchmark runs and reports its same-run C++ baseline."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "bench_python_overhead.py")


def test_bench_reports_python_and_cpp_loops():
    proc = subprocess.run([sys.executable, BENCH, "--shape", "tiny", "--iterations", "20",
                           "--rounds", "2", "--json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    assert r["requests_each"] == 40
    assert r["cpp_median_us"] > 0 and r["python_median_us"] > 0
    assert r["python_overhead_us"] == pytest.approx(r["python_median_us"] - r["cpp_median_us"])
