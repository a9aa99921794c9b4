"""Module-level API: version, devices, knobs, the KV model types, errors."""

from __future__ import annotations

import pytest

import kvferry


def test_version_and_features():
    assert kvferry.__version__ == kvferry.version()
    names = {f["name"] for f in kvferry.build_features()}
    assert {"cuda", "ucx", "mpi"} <= names
    assert kvferry.list_devices()[0] == "cpu"
    assert kvferry.transports()[0] == "inproc"


def test_device_info_and_close():
    dev = kvferry.Device("cpu")
    assert dev.info["platform"] == "cpu"
    assert dev.platform == "cpu"
    dev.close()
    assert dev.closed
    with pytest.raises(kvferry.ClosedError):
        dev.info
    dev.close()  # closing twice is fine


def test_unknown_device_is_an_error():
    with pytest.raises(kvferry.Error) as e:
        kvferry.Device("tpu:3")
    assert e.value.code in ("INVALID_ARGUMENT", "UNAVAILABLE", "NOT_FOUND")
    assert "tpu:3" in e.value.message


def test_knobs_get_set_reset():
    knobs = {k["name"]: k for k in kvferry.knobs()}
    assert "transfer.timeout_ms" in knobs
    default = kvferry.get_knob("transfer.timeout_ms")
    assert isinstance(default, int)
    kvferry.set_knob("transfer.timeout_ms", 4321)
    assert kvferry.get_knob("transfer.timeout_ms") == 4321
    assert {k["name"]: k for k in kvferry.knobs()}["transfer.timeout_ms"]["source"] == "set"
    kvferry.reset_knob("transfer.timeout_ms")
    assert kvferry.get_knob("transfer.timeout_ms") == default


def test_knob_errors_name_the_problem():
    with pytest.raises(kvferry.NotFoundError, match="no.such"):
        kvferry.get_knob("no.such")
    with pytest.raises(kvferry.InvalidArgumentError) as e:
        kvferry.set_knob("transfer.timeout_ms", -5)
    assert e.value.code == "INVALID_ARGUMENT"
    assert "transfer.timeout_ms" in str(e.value)
    with pytest.raises(kvferry.InvalidArgumentError):
        kvferry.set_knob("transfer.timeout_ms", 1.5)


def test_kv_shape_and_parallel_config():
    s = kvferry.KvShape(layers=32, kv_heads=8, head_dim=128, dtype="bf16")
    assert s.bytes_per_token == 131072  # Llama-3-8B
    assert s.dtype == "bf16" and s.tokens_per_block == 32
    with pytest.raises(kvferry.InvalidArgumentError, match="dtype|fp7"):
        kvferry.KvShape(layers=2, kv_heads=2, head_dim=8, dtype="fp7")
    p = kvferry.ParallelConfig(tp=2, pp=2)
    assert p.world_size == 4
    sl = kvferry.slice_of(s, p, 3)
    assert (sl.tp_rank, sl.pp_rank) == (1, 1)
    assert (sl.head_begin, sl.head_count) == (4, 4)
    assert (sl.layer_begin, sl.layer_count) == (16, 16)
    with pytest.raises(kvferry.InvalidArgumentError):
        kvferry.slice_of(s, kvferry.ParallelConfig(tp=3), 0)


def test_error_hierarchy():
    assert issubclass(kvferry.InvalidArgumentError, ValueError)
    assert issubclass(kvferry.DeadlineExceededError, TimeoutError)
    assert issubclass(kvferry.ClosedError, kvferry.Error)
    e = kvferry.errors.error_for("DATA_LOSS", "slot 3 checksum")
    assert isinstance(e, kvferry.DataLossError) and e.code == "DATA_LOSS"
    assert str(e) == "DATA_LOSS: slot 3 checksum"


def test_type_stubs_ship_with_the_package():
    import os

    pkg = os.path.dirname(kvferry.__file__)
    assert os.path.exists(os.path.join(pkg, "py.typed"))
    stub = open(os.path.join(pkg, "_kvferry.pyi")).read()
    for name in ("class ContextSide", "class GenerationSide", "def fetch(", "def poll(",
                 "class Pool", "def allocate("):
        assert name in stub, name
