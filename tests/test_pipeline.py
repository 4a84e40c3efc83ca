"""The pipeline runtime against the single-process engine, and the depth semantics from event records."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from strata.config import ConfigError, from_dict
from strata.models.model import Transformer
from strata.head.pipeline import Pipeline, PipelineError
from strata.comm.shm import SHM_DIR
from strata.weights.checkpoint import model_args, slice_tensors

ROOT = Path(__file__).resolve().parents[1]


def cpu_stages(n):
    return [{"device": "cpu", "threads": 1} for _ in range(n)]


def run(cfg: dict, out):
    with Pipeline(cfg, out=out, console=False) as p:
        res = p.prefill()
        run_id = p.run_id
        pids = [s.pid for s in p.stages]
    # nothing of the run is left: processes and shared memory
    assert not [n for n in os.listdir(SHM_DIR) if run_id in n]
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
    return res


def reference(model: str, ids: np.ndarray, chunk: int):
    """The single-process engine, one slice, same chunking, one thread like the stages."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        args = model_args(model)
        t = Transformer(args)
        t.load_weights(slice_tensors(model, args, 0, args.n_layers), "cpu", torch.float32)
        t.setup_cache(ids.size)
        x = torch.from_numpy(ids.astype(np.int64)).view(1, -1)
        hs = [t(x[:, p:p + chunk], p) for p in range(0, ids.size, chunk)]
        h = torch.cat(hs, dim=1)
        return h[0].numpy(), t.logits(h[0, -1]).numpy()
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def smollm2_ids():
    pytest.importorskip("gguf")
    from strata.weights.checkpoint import smollm2_path
    try:
        smollm2_path()
    except Exception as e:  # noqa: BLE001
        pytest.skip(str(e))
    rng = np.random.default_rng(7)
    return rng.integers(0, 49152, size=300).astype(np.int32)


@pytest.mark.slow
@pytest.mark.parametrize("n_stages", [2, 3])
def test_smollm2_stages_bit_exact_and_depth_arms_identical(tmp_path, smollm2_ids, n_stages):
    ids_file = tmp_path / "ids.npy"
    np.save(ids_file, smollm2_ids)
    ref_h, ref_logits = reference("smollm2", smollm2_ids, 64)
    md5 = {}
    for depth in (0, 1):
        cfg = dict(model="smollm2", stages=cpu_stages(n_stages), chunk=64, depth=depth,
                   prompt={"ids_file": str(ids_file)}, dump_residual=True, progress=False)
        res = run(cfg, tmp_path / f"d{depth}")
        resid = np.load(tmp_path / f"d{depth}" / "residual.npy")
        assert np.array_equal(resid, ref_h), f"depth {depth}: residual differs from the single-process engine"
        assert np.array_equal(res.last_logits, ref_logits)
        md5[depth] = res.report["residual_md5"]
        assert len(res.report["stages"]) == n_stages
    assert md5[0] == md5[1]


def _events(report):
    """{(stage, chunk): (start, end)} from the stages' own records."""
    return {(i, k): (a, b) for i, ev in enumerate(report["events"]) for k, a, b, _ in ev}


@pytest.mark.slow
@pytest.mark.parametrize("depth", [0, 1])
def test_ordering_from_event_records(tmp_path, depth):
    cfg = dict(model="synthetic:smoke", stages=cpu_stages(3), chunk=64, depth=depth,
               prompt={"random": {"tokens": 384, "seed": 1}}, progress=False,
               debug={"delay_s": 0.05, "delay_step_s": 0.03})
    rep = run(cfg, tmp_path / "o").report
    ev = _events(rep)
    n_chunks = rep["chunks"]
    # every stage's record holds every chunk once (a phase start learnt late once wiped chunk 0's)
    for i, st_ev in enumerate(rep["events"]):
        assert [e[0] for e in st_ev] == list(range(n_chunks)), i
        assert rep["stages"][i]["chunks"] == n_chunks
    overlaps = 0
    for i in range(2):
        for k in range(n_chunks - 1):
            start_next_here = ev[(i, k + 1)][0]
            end_below = ev[(i + 1, k)][1]
            if depth == 1:
                # stage i works on chunk k+1 while stage i+1 works on chunk k
                assert start_next_here < end_below, (i, k)
            else:
                # the old join: chunk k must be through the whole rest of the pipeline first
                last_end = ev[(2, k)][1]
                assert start_next_here > last_end, (i, k)
            overlaps += start_next_here < end_below
    assert (overlaps > 0) == (depth == 1)


def test_second_prefill_reports_its_own_timing(tmp_path):
    """Two prefills on one pipeline: same arithmetic, and the second report waits for the stages'
    fresh records instead of finding the first prefill's (which once made stage 0's stale)."""
    # no continuation: the report is built right after the prefill, with nothing received in between
    cfg = dict(model="synthetic:smoke", stages=cpu_stages(2), chunk=64, generate=0, dump_residual=True,
               prompt={"random": {"tokens": 256, "seed": 4}}, progress=False)
    with Pipeline(cfg, out=tmp_path / "o", console=False) as p:
        a = p.prefill()
        first = [st.stats["prefill"].events for st in p.stages]
        b = p.prefill()
        second = [st.stats["prefill"].events for st in p.stages]
    with pytest.raises(PipelineError, match=r"^this pipeline is closed \(its stages have stopped\): make a new"):
        p.prefill()
    assert a.report["residual_md5"] == b.report["residual_md5"] and a.perplexity == b.perplexity
    for i, (ea, eb) in enumerate(zip(first, second)):
        assert len(eb) == b.report["chunks"], i
        assert min(e[1] for e in eb) > max(e[3] for e in ea), f"stage {i}: the second report holds old records"


def test_depth_2_refused_before_anything_starts(tmp_path):
    with pytest.raises(ConfigError, match="depth 2 refused"):
        from_dict({"model": "synthetic:smoke", "depth": 2, "prompt": {"random": {"tokens": 10}}})
    rig = tmp_path / "rig.yaml"
    rig.write_text("model: synthetic:smoke\nprompt: {random: {tokens: 100}}\nstages: [cpu, cpu]\n")
    env = dict(os.environ, STRATA_PF_DEPTH="2")
    r = subprocess.run([sys.executable, str(ROOT / "launcher.py"), "--config", str(rig), "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 2
    assert r.stderr.startswith("error: depth 2 refused")
    assert not (tmp_path / "o").exists()  # nothing started, nothing written


def test_report_contract_and_timeline(tmp_path):
    rig = tmp_path / "rig.yaml"
    rig.write_text("model: synthetic:smoke\nstages: [{device: cpu, threads: 1}, {device: cpu, threads: 1}]\n"
                   "chunk: 100\nprompt: {random: {tokens: 450, seed: 3}}\ngenerate: 3\ndump_residual: true\n")
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, str(ROOT / "launcher.py"), "--config", str(rig), "--out", str(out),
                        "--set", "timing=true", "--set", "depth=0"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    import json
    rep = json.loads((out / "report.json").read_text())
    for key in ("tokens", "seconds", "tok_s", "depth", "chunk", "stages", "busy", "handoff_pinned_bytes",
                "residual_md5"):
        assert key in rep, key
    assert rep["tokens"] == 450 and rep["depth"] == 0 and rep["chunk"] == 100 and rep["chunks"] == 5
    for s in rep["stages"]:
        for key in ("index", "device", "layers", "wall_s", "work_s", "handoff_wait_s", "input_wait_s"):
            assert key in s
    assert [s["layers"] for s in rep["stages"]][0][0] == 0
    assert rep["stages"][-1]["layers"][1] == 8
    assert set(rep["busy"]) >= {"one", "two", "three_plus"}
    assert abs(sum(rep["busy"].values()) - 1) < 1e-6
    assert rep["handoff_pinned_bytes"] == 100 * 128 * 4  # one buffer: chunk x hidden x float32
    assert len(rep["continuation_ids"]) == 3
    _assert_timeline_draws_both_stages(out / "timeline.png", rep)
    # timing=true: the console shows the per-stage table and the busy histogram; without it they are
    # left out (report.json has the figures either way)
    assert "handoff s" in r.stdout and "busy: one" in r.stdout, r.stdout
    from strata.head.report import format_table
    quiet = format_table({**rep, "timing": False})
    assert "handoff s" not in quiet and "busy:" not in quiet and "tok/s" in quiet
    assert (out / "stage-0.log").is_file() and (out / "stage-1.log").is_file()


def _assert_timeline_draws_both_stages(png: Path, rep: dict) -> None:
    """Read the PNG back: its size is the figure's (12 in x (0.8 + 0.6 n) in at 110 dpi), and chunk 0's
    colour (tab20's first) appears in two separate horizontal bands: one bar per stage."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.image as mpimg
    import matplotlib.pyplot as plt
    img = mpimg.imread(png)
    n = len(rep["stages"])
    assert img.shape[:2] == (round((0.8 + 0.6 * n) * 110), 12 * 110), img.shape
    color = np.array(plt.get_cmap("tab20")(0)[:3])
    rows = np.flatnonzero((np.abs(img[:, :, :3] - color) < 0.02).all(axis=2).sum(axis=1) > 3)
    bands = 1 + int((np.diff(rows) > 1).sum()) if rows.size else 0
    assert bands == n, (bands, rows)


def test_every_rig_field_is_parsed():
    """from_dict reaches every field of RigConfig: each one, given its default, comes back unchanged (`dtype: auto`
    comes back resolved, as the stages say)."""
    from dataclasses import asdict, fields
    from strata.config import RigConfig, auto_dtype
    base = {"model": "synthetic:smoke", "prompt": {"random": {"tokens": 10}}}
    for f in fields(RigConfig):
        default = getattr(RigConfig(), f.name)
        if f.name in ("prompt", "debug", "kernels"):  # the sub-configs, given as mappings
            raw = {k: v for k, v in asdict(default).items() if v is not None}
        else:
            raw = default
        cfg = from_dict({**base, f.name: raw}, env={})
        want = auto_dtype(cfg.stages) if f.name == "dtype" else default
        assert getattr(cfg, f.name) == want, f.name
    cfg = from_dict({**base, "attention": "flash", "weights": "resident", "kv_dtype": "float8_e4m3fn"}, env={})
    assert (cfg.attention, cfg.weights, cfg.kv_dtype) == ("flash", "resident", "float8_e4m3fn")


@pytest.mark.parametrize("raw,env,expect", [
    ({"attention": "flsh"}, {}, "attention: 'flsh' is not one of auto, flash, cudnn-split"),
    ({}, {"STRATA_CUDA_ATTENTION": "flsh"}, "STRATA_CUDA_ATTENTION='flsh': expected one of auto, flash, cudnn-split"),
    ({"weights": "int4"}, {}, "weights: 'int4' is not one of auto, resident, dequantized"),
    ({"kv_dtype": "float8"}, {}, "kv_dtype: 'float8' is not one of auto, bfloat16, float16, float8_e4m3fn, q8_0"),
], ids=["attention", "env-attention", "weights", "kv_dtype"])
def test_numerics_keys_refused(raw, env, expect):
    with pytest.raises(ConfigError) as e:
        from_dict({"model": "synthetic:smoke", **raw}, env=env)
    assert str(e.value) == expect


def test_attention_from_environment():
    cfg = from_dict({"model": "synthetic:smoke", "attention": "flash"}, env={"STRATA_CUDA_ATTENTION": "cudnn-split"})
    assert cfg.attention == "cudnn-split"


def test_depth_and_timing_from_environment():
    cfg = from_dict({"model": "synthetic:smoke", "prompt": {"random": {"tokens": 10}}},
                    env={"STRATA_PF_DEPTH": "0", "STRATA_PREFILL_TIMING": "1"})
    assert cfg.depth == 0 and cfg.timing


def test_console_script_is_the_launcher():
    """pyproject's `strata` command resolves to the launcher's main: same arguments, same checks."""
    import importlib
    import tomllib
    target = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["strata"]
    module, func = target.split(":")
    import launcher
    assert getattr(importlib.import_module(module), func) is launcher.main
    with pytest.raises(SystemExit) as e:
        launcher.main(["--help"])
    assert e.value.code == 0


@pytest.mark.slow
@pytest.mark.parametrize("max_seqs", [1, 2])
def test_score_rows_are_the_single_process_head_rows(tmp_path, monkeypatch, max_seqs):
    """Pipeline.score: each target's log-probability and the top tokens from the last stage's head rows in the
    prefill itself (one pass, chunks cut so a chunk's rows fit its result note), against one process's rows;
    the same ids' perplexity from them; a later start reuses the cached prefix and scores only its tail. The same
    with max_seqs 2: Pipeline's calls run the one request loop on the caller's thread, one sequence alone, at
    every max_seqs (its slot 0's live KV reused as with one slot)."""
    import strata.comm.messages as M
    monkeypatch.setattr(M, "SCORED_BYTES", 4 * (1 + 2 * 5) * 24)  # 24 rows a result: 64-token chunks cut in 3
    model = "synthetic:smoke"
    ids = np.random.default_rng(3).integers(0, model_args(model).vocab_size, size=150).astype(np.int32)
    h, _ = reference(model, ids, 64)
    args = model_args(model)
    t = Transformer(args)
    t.load_weights(slice_tensors(model, args, 0, args.n_layers), "cpu", torch.float32)
    want = torch.log_softmax(t.logits(torch.from_numpy(h[:-1])), dim=-1)  # row i predicts ids[i + 1]
    want_lp = want.gather(1, torch.from_numpy(ids[1:].astype(np.int64))[:, None])[:, 0].numpy()
    cfg = {"model": model, "stages": cpu_stages(2), "chunk": 64, "progress": False, "dtype": "float32",
           "prompt": {"random": {"tokens": 150, "seed": 0}}, "max_seqs": max_seqs}
    with Pipeline(cfg, out=tmp_path / "o", console=False) as p:
        ppl = p.prefill(ids).perplexity  # the CLI's figure; the score below recomputes every position
        lp, top_ids, top_lp = p.score(ids, 1, 5)
        assert lp.shape == (149,) and top_ids.shape == (149, 5) and top_lp.shape == (149, 5)
        assert np.abs(lp - want_lp).max() < 1e-4, np.abs(lp - want_lp).max()
        v, i = want.topk(5, dim=1)
        assert (top_ids == i.numpy()).mean() > 0.99 and np.abs(top_lp - v.numpy()).max() < 1e-4
        assert abs(float(np.exp(-lp.mean())) - ppl) < 1e-4 * ppl
        tail, _, _ = p.score(ids, 140, 0)  # the stages hold these ids: only positions 139.. are computed
        assert tail.shape == (10,) and np.abs(tail - lp[139:]).max() < 1e-5
        with pytest.raises(ConfigError, match="top must be in 0..20"):
            p.score(ids, 1, 21)
