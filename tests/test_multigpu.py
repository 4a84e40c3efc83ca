"""Stages on two (or more) GPUs: `pytest -m multigpu`, skipped with fewer than 2 CUDA devices.

Checks what only a multi-GPU run can show: both arms byte-identical across devices, logits against
the single-process engine, a SIGKILLed CUDA stage tearing the run down (no process, no GPU memory
held by the run, nothing in /dev/shm), `stages: auto` giving one stage per GPU, and the hand-off
copy staying a small share of the work (at the 8B shape).
"""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import numpy as np
import pytest
import torch

from conftest import Proc, segments, wait_gone
from test_gpu import MODEL, single_process_logits  # the single-process reference, one copy

N_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu, pytest.mark.multigpu,
              pytest.mark.skipif(N_GPUS < 2, reason="needs at least 2 CUDA devices")]

TOKENS, CHUNK = 8192, 1024


def _rig(**over) -> dict:
    rig = dict(model=MODEL, dtype="bfloat16", stages=[{"device": "cuda:0"}, {"device": "cuda:1"}], chunk=CHUNK,
               prompt={"random": {"tokens": TOKENS, "seed": 3}}, dump_residual=True, progress=False, generate=0)
    rig.update(over)
    return rig


def _gpu_pids() -> set[int]:
    """Pids holding memory on any GPU (nvidia-smi sees every process of this container)."""
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"], capture_output=True,
                         text=True, check=True).stdout
    return {int(x) for x in out.split()}


def test_two_gpus_identical_arms_and_reference(tmp_path):
    from strata.head.pipeline import Pipeline
    reports, logits = {}, {}
    for depth in (0, 1):
        with Pipeline(_rig(depth=depth), out=tmp_path / f"d{depth}", console=False) as p:
            res = p.prefill()
            ids = p.plan.ids
        reports[depth], logits[depth] = res.report, res.last_logits
    assert [s["device"] for s in reports[1]["stages"]] == ["cuda:0", "cuda:1"]
    assert reports[0]["residual_md5"] == reports[1]["residual_md5"]
    assert np.array_equal(logits[0], logits[1])
    ref = single_process_logits(ids, CHUNK)
    rel = float(np.linalg.norm(logits[1] - ref) / np.linalg.norm(ref))
    assert rel < 2e-2, rel  # bf16: the stages' arithmetic equals the single process's up to kernel choice
    rep = reports[1]
    assert rep["pinned"] and all(s["pinned"] for s in rep["stages"])
    print(f"2 GPUs: rel {rel:.2e}; tok/s depth 0 {reports[0]['tok_s']:,.0f}, depth 1 {rep['tok_s']:,.0f}")


def test_handoff_copy_share_8b(tmp_path):
    """The hand-off copy is at most 1% of the stages' work at the size the design is for: the 8B shape, a long
    prompt (the smoke model's chunks are a few ms of launches, so any copy is a large share of them)."""
    from strata.head.pipeline import Pipeline
    rig = _rig(model="synthetic:llama-3-8b", chunk=10240, dump_residual=False, depth=1,
               prompt={"random": {"tokens": 122880, "seed": 0}})
    with Pipeline(rig, out=tmp_path / "8b", console=False) as p:
        rep = p.prefill().report
    assert rep["pinned"] and rep["handoff_pinned_bytes"] == 10240 * 4096 * 2  # one boundary, one buffer
    work = sum(s["work_s"] for s in rep["stages"])
    copy = sum(s["copy_s"] for s in rep["stages"])
    print(f"8B on 2 GPUs: copy {copy:.4f} s of work {work:.3f} s ({copy / work:.2%}), {rep['tok_s']:,.0f} tok/s")
    assert copy <= 0.01 * work


def test_auto_stages_one_per_gpu(tmp_path):
    from strata.head.pipeline import Pipeline
    with Pipeline(_rig(stages="auto", dump_residual=False, prompt={"random": {"tokens": 2048, "seed": 0}}),
                  out=tmp_path / "auto", console=False) as p:
        assert [s.device for s in p.plan.stages] == [f"cuda:{i}" for i in range(N_GPUS)]
        rep = p.prefill().report
    assert [s["device"] for s in rep["stages"]] == [f"cuda:{i}" for i in range(N_GPUS)]


def test_sigkill_of_a_cuda_stage(tmp_path):
    """The second GPU's stage is SIGKILLed from outside mid-prefill: the run fails naming it within
    5 s, and no process of the run, no GPU memory of its pids and no segment of it is left."""
    from strata.errors import PipelineError
    from strata.head.pipeline import Pipeline
    rig = _rig(dump_residual=False, prompt={"random": {"tokens": 65536, "seed": 0}}, chunk=512,
               debug={"delay_s": 0.05})
    killed: dict = {}
    p = Pipeline(rig, out=tmp_path / "kill", console=False)
    p.start()
    pids = [s.pid for s in p.stages]
    assert set(pids) <= _gpu_pids()  # both stages hold GPU memory now

    def killer():
        time.sleep(1.0)  # let chunks flow through both GPUs first
        killed["t"] = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
    threading.Thread(target=killer, daemon=True).start()
    with pytest.raises(PipelineError) as ei:
        p.prefill()
    failed_after = time.monotonic() - killed["t"]
    run_id = p.run_id
    p.close()
    assert "stage 1 (cuda:1" in str(ei.value) and "SIGKILL" in str(ei.value)
    assert failed_after <= 5.0, failed_after
    assert not wait_gone([Proc(x) for x in pids], 5.0)
    assert not set(pids) & _gpu_pids()
    assert segments(run_id=run_id) == []


def test_decode_launch_ahead_gives_the_host_launched_tokens(tmp_path):
    """Decode steps queued ahead behind a GPU-side wait on each stage's bell (strata/comm/stream_wait.py, on by default
    with a GPU per stage) give the tokens of steps the host launches (kernels.decode_ahead: false), bit for bit:
    greedy, an answer stopped mid-way (its queued steps released), sampled, the same prompt again on the reused
    KV, and a prompt that continues the answer."""
    from strata.head.pipeline import Pipeline
    from strata.text.sampling import SamplingParams
    ids = np.random.default_rng(21).integers(0, 512, size=700).astype(np.int32)
    runs = {}
    for ahead in ("auto", False):
        out = tmp_path / f"ahead-{ahead}"
        rig = _rig(dump_residual=False, max_context=2048, prompt={"random": {"tokens": ids.size, "seed": 3}},
                   kernels={"decode_ahead": ahead})
        with Pipeline(rig, out=out, console=False) as p:
            greedy = p.generate(ids, SamplingParams(max_tokens=40))
            told = []
            stopped = p.generate(ids, SamplingParams(max_tokens=40), on_token=lambda t: told.append(t) or len(told) < 5)
            sampled = p.generate(ids, SamplingParams(max_tokens=24, temperature=0.9, top_k=40, seed=3))
            again = p.generate(ids, SamplingParams(max_tokens=40))
            follow = p.generate(np.concatenate([ids, np.array(greedy.continuation_ids[:4], dtype=np.int32)]),
                                SamplingParams(max_tokens=8))
        for i in (0, 1):
            log = (out / f"stage-{i}.log").read_text()
            assert ("decode launch-ahead: on" in log) == (ahead == "auto"), log[-2000:]
        assert stopped.continuation_ids == greedy.continuation_ids[:5] and stopped.finish_reason == "stop"
        assert again.reused_tokens == ids.size - 1 and len(again.continuation_ids) == 40
        assert again.report["decode_bell_steps"] == 40 - 2
        # (the reused KV's last row came from a one-row prefill, rounded unlike the 700-row one: `again` may part
        # from `greedy` on a GPU; it must not part from the other arm's `again`)
        runs[ahead] = [r.continuation_ids for r in (greedy, sampled, again, follow)]
    assert len(runs["auto"][0]) == 40 and runs["auto"] == runs["0"]
