"""The real-model example end to end (examples/llama_disagg.py), small: a context process and a
generation process over UCX must produce the same tokens as one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import kvferry

pytest.importorskip("torch")
pytest.importorskip("transformers")

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "llama_disagg.py")
SMALL = ["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--vocab", "300",
         "--max-len", "64", "--tokens-per-block", "8", "--prompt-lengths", "13,40,3",
         "--new-tokens", "6", "--json", "--timeout", "60"]


def run(extra):
    proc = subprocess.run([sys.executable, EXAMPLE, *SMALL, *extra], capture_output=True,
                          text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.mark.model
@pytest.mark.skipif("ucx" not in kvferry.transports(), reason="built without UCX")
def test_llama_disaggregated_tp1_to_tp2_identical_tokens():
    r = run(["--gen-tp", "2"])
    assert r["identical_tokens"] and r["context_ok"] and r["generation_ok"]
    assert r["transfer_bytes"] > 0 and r["times_s"]["transfer"] > 0


@pytest.mark.model
@pytest.mark.gpu
def test_llama_disaggregated_on_gpu():
    r = run(["--device", "cuda", "--gen-tp", "1"])
    assert r["identical_tokens"]
