"""Start-up: the fast GGUF index against gguf-py, the process clock, and report.json's startup breakdown."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from strata.weights.checkpoint import smollm2_path
from strata.weights.gguf_fast import GGUFIndex, Unhandled
from strata.weights.gguf_files import field_value, open_gguf
from strata.head.report import STARTUP_PARTS, startup_breakdown

ROOT = Path(__file__).resolve().parent.parent


def _same_as_gguf_py(path: Path) -> None:
    ours, ref = GGUFIndex(path), gguf.GGUFReader(path)
    assert list(ours.values) == list(ref.fields)
    for key in ref.fields:
        assert ours.value(key) == field_value(ref, key), key
    assert (ours.alignment, ours.data_offset) == (ref.alignment, ref.data_offset)
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert (a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == (b.tensor_type, b.n_elements, b.n_bytes,
                                                                            b.data_offset), a.name
        assert a.shape.tolist() == b.shape.tolist()
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data.view(np.uint8), b.data.view(np.uint8)), a.name


@pytest.mark.slow
def test_index_matches_gguf_py_on_smollm2():
    """Every metadata value (the tokenizer's ~100k strings included) and every tensor's type, shape, offset
    and bytes, as gguf-py reads them."""
    _same_as_gguf_py(smollm2_path())


def test_index_matches_gguf_py_on_every_value_type(tmp_path):
    w = gguf.GGUFWriter(tmp_path / "t.gguf", "llama")
    w.add_uint8("k.u8", 200)
    w.add_int8("k.i8", -5)
    w.add_uint16("k.u16", 60000)
    w.add_int16("k.i16", -300)
    w.add_uint32("k.u32", 4_000_000_000)
    w.add_int32("k.i32", -70000)
    w.add_uint64("k.u64", 2**60)
    w.add_int64("k.i64", -(2**50))
    w.add_float32("k.f32", 0.1)
    w.add_float64("k.f64", 1e-300)
    w.add_bool("k.bool", True)
    w.add_string("k.str", "héllo \u2603")
    w.add_array("k.strs", ["a", "", "ünï"])
    w.add_array("k.ints", [1, -2, 3])
    w.add_array("k.floats", [0.5, -1.25])
    w.add_array("k.bools", [True, False])
    w.add_array("k.empty", [])
    w.add_tensor("f32", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.add_tensor("f16", np.arange(6, dtype=np.float16).reshape(2, 3))
    w.add_tensor("q8", np.zeros((2, 34), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _same_as_gguf_py(tmp_path / "t.gguf")


def test_arrays_of_arrays_fall_back_to_gguf_py(tmp_path):
    w = gguf.GGUFWriter(tmp_path / "n.gguf", "llama")
    w.add_array("k.nested", [[1, 2], [3]])
    w.add_tensor("f32", np.ones(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(Unhandled):
        GGUFIndex(tmp_path / "n.gguf")
    r = open_gguf(tmp_path / "n.gguf")  # still opens, through gguf-py
    assert isinstance(r, gguf.GGUFReader) and [t.name for t in r.tensors] == ["f32"]


def test_process_start_clock():
    """process_start() is this process's start: a child that sleeps 0.5 s first sees at least that much."""
    code = ("import time; time.sleep(0.5); import sys; sys.path.insert(0, %r); from strata.head.report import "
            "process_start; print(time.perf_counter() - process_start())" % str(ROOT))
    age = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert 0.45 <= age < 30


def test_breakdown_parts_sum_to_total():
    m = dict(process=10.0, imports=11.0, planned=11.5, spawn=11.6, spawned=11.7, ready=12.9, first=13.0)
    s = startup_breakdown(m, tokenizer_s=0.2, stage_load_s=0.8)
    assert s["imports_s"] == pytest.approx(1.0) and s["plan_s"] == pytest.approx(0.3)
    assert s["spawn_s"] == pytest.approx(0.1) and s["ready_wait_s"] == pytest.approx(1.2)
    assert s["other_s"] == pytest.approx(0.2) and s["total_s"] == pytest.approx(3.0)


@pytest.mark.slow
def test_report_has_startup(tmp_path):
    """The launcher's report.json: startup_s and its parts, measured; the console prints one line of it.
    CPU stages are forked from the fork server."""
    rig = tmp_path / "rig.yaml"
    rig.write_text("model: synthetic:smoke\nstages: [{device: cpu, threads: 1}, {device: cpu, threads: 1}]\n"
                   "chunk: 64\nprompt: {random: {tokens: 200, seed: 1}}\ngenerate: 2\nprogress: false\n")
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, str(ROOT / "launcher.py"), "--config", str(rig), "--out", str(out),
                        "--no-timeline"], capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    rep = json.loads((out / "report.json").read_text())
    s = rep["startup"]
    assert rep["startup_s"] == s["total_s"] > 0
    for k in (*STARTUP_PARTS, "stage_load_s"):
        assert s[k] >= 0, (k, s)
    assert s["imports_s"] > 0 and s["ready_wait_s"] > 0
    assert 0 < s["stage_load_s"] <= s["spawn_s"] + s["ready_wait_s"]  # each stage loads after its start
    assert s["stage_load_s"] == max(st["load_s"] for st in rep["stages"])
    assert s["stage_start"] == "forkserver"
    lines = [x for x in r.stdout.splitlines() if x.startswith("startup: ")]
    assert len(lines) == 1 and f"{s['total_s']:.2f}s to the first chunk" in lines[0], r.stdout


def test_index_on_damaged_headers_agrees_or_refuses(tmp_path):
    """Random bytes of a small file's header and metadata changed (some cut short): the index either refuses
    (an exception, which open_gguf turns into a one-line ModelError) or reads exactly what gguf-py reads."""
    import random
    src = tmp_path / "s.gguf"
    w = gguf.GGUFWriter(src, "llama")
    w.add_uint32("k.u32", 7)
    w.add_string("k.s", "abc")
    w.add_array("k.strs", ["a", "bb", "ccc"] * 20)
    w.add_array("k.i", list(range(50)))
    w.add_tensor("t", np.arange(64, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    good, rng, agreed = src.read_bytes(), random.Random(0), 0
    bad = tmp_path / "b.gguf"
    for _ in range(300):
        b = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(0, 700)] = rng.randrange(256)
        if rng.random() < 0.2:
            b = b[:rng.randrange(len(b))]
        bad.write_bytes(bytes(b))
        try:
            ours = GGUFIndex(bad)
        except Exception:  # noqa: BLE001 - refused: fine
            continue
        try:
            ref = gguf.GGUFReader(bad)
        except Exception:  # noqa: BLE001 - gguf-py fails on a tensor past the end; the loader names it
            assert any(t.data is None for t in ours.tensors), "the index read what gguf-py refused"
            continue
        assert list(ours.values) == list(ref.fields)
        assert all(ours.value(k) == field_value(ref, k) for k in ref.fields)
        assert [(t.name, t.data_offset, t.n_bytes) for t in ours.tensors] == \
            [(t.name, t.data_offset, t.n_bytes) for t in ref.tensors]
        agreed += 1
    assert agreed > 10  # the damage left some files readable: the comparison ran
