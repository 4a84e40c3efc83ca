"""Dynamic chunking: the schedule, the pipeline-time model, and md5 identity across depths."""
import numpy as np
import pytest

from strata.models.args import PRESETS
from strata.head.pipeline import Pipeline
from strata.plan.schedule import chunk_cost, chunk_schedule, pipeline_time, predicted_speedup


def test_dynamic_schedule_invariants():
    args = PRESETS["llama-3-70b"]
    fixed = chunk_schedule(122880, 10240, False, args)
    dyn = chunk_schedule(122880, 10240, True, args)
    assert [t for _, t in fixed] == [10240] * 12
    for sched in (fixed, dyn):
        assert sched[0][0] == 0 and sum(t for _, t in sched) == 122880
        assert all(p2 == p + t for (p, t), (p2, _) in zip(sched, sched[1:]))  # contiguous
    sizes = [t for _, t in dyn]
    assert sizes[0] == 10240 and max(sizes) == 10240  # buffers sized for the first, largest chunk
    assert sizes == sorted(sizes, reverse=True)
    budget = chunk_cost(args, 0, 10240)
    assert all(chunk_cost(args, p, t) <= budget * 1.0001 for p, t in dyn)
    assert all(t % 64 == 0 for t in sizes[:-1])


def test_pipeline_model_reproduces_measured_arithmetic():
    args = PRESETS["llama-3-70b"]
    # the speed-ups the cost model gives for a 70B shape at 122,880 tokens in chunks of 10,240 (fixed)
    for n, want in ((2, 1.77), (4, 2.88), (8, 4.20)):
        assert abs(predicted_speedup(args, 122880, 10240, False, n) - want) < 0.1
    # dynamic chunks shrink the tail: higher predicted speed-up at every stage count
    for n in (2, 4, 8):
        assert predicted_speedup(args, 122880, 10240, True, n) > predicted_speedup(args, 122880, 10240, False, n) + 0.1


def test_pipeline_model_balanced_equal_chunks():
    # N balanced stages, C equal chunks: N*C / (C+N-1)
    rows = [[1.0] * 4 for _ in range(12)]
    assert pipeline_time(rows, 0) / pipeline_time(rows, 1) == pytest.approx(4 * 12 / 15)


def test_depth_arms_identical_with_dynamic_chunks(tmp_path):
    md5, scheds = {}, {}
    for depth in (0, 1):
        cfg = dict(model="synthetic:smoke", stages=[{"device": "cpu", "threads": 1}] * 2, chunk=512,
                   dynamic_chunks=True, depth=depth, prompt={"random": {"tokens": 3000, "seed": 2}},
                   dump_residual=True, progress=False)
        with Pipeline(cfg, out=tmp_path / f"d{depth}", console=False) as p:
            rep = p.prefill().report
        md5[depth], scheds[depth] = rep["residual_md5"], rep["schedule"]
        assert len({t for _, t in rep["schedule"]}) > 1  # the chunks really vary
        assert rep["handoff_pinned_bytes"] == 512 * 128 * 4  # one buffer, sized for the largest chunk
    assert scheds[0] == scheds[1]
    assert md5[0] == md5[1]
    full = np.load(tmp_path / "d1" / "residual.npy")
    assert full.shape == (3000, 128) and np.isfinite(full).all()
