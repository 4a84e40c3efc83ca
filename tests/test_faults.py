"""Fault injection: a stage that raises, SIGKILL of the first / a middle / the last stage, SIGKILL,
SIGINT and SIGTERM of the head, a stage that hangs (the watchdog) or never gets ready (the ready
deadline); shared-memory ownership (sweep, early unlink, room check) and the private ipc dir.

Each fault: non-zero exit (or PipelineError) within 10 s of the fault, an error naming the stage
(index, device, pid, chunk, signal or exception), no process of the run left, no segment of the
run left in /dev/shm (the `guard` fixture checks both after every test), and the next run on the
machine starts and succeeds (`run_ok`).
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from conftest import (SHM, Proc, launch, log_time, make_rig, run_ok, segments, stage_pids, wait_gone)

EXIT_WITHIN = 10.0   # seconds from the fault to the head's exit, and to every stage gone
SLOW = dict(delay_s=0.12)  # every chunk takes a while: faults land mid-prefill, not after it


def _pipeline(tmp: Path, rig: dict, guard, name="run"):
    from strata.head.pipeline import Pipeline
    p = Pipeline(rig, out=tmp / name, console=False)
    guard.run_ids.add(p.run_id)
    return p


def _prefill_fails(p, guard, stage: int) -> tuple[str, float, float]:
    """Start and prefill `p`, which must fail; returns the error, when close() returned (every stage
    joined, everything released) and when `stage` logged its injected failure."""
    from strata.head.pipeline import PipelineError
    with pytest.raises(PipelineError) as ei:
        with p:
            p.start()
            guard.track_pipeline(p)
            p.prefill()
    t_exit = time.time()
    t_fault = log_time(p.out, stage, "injected failure")
    assert t_fault is not None
    return str(ei.value), t_exit, t_fault


def _stage_gone_within(procs, t_fault: float):
    left = wait_gone(procs, max(0.0, t_fault + EXIT_WITHIN - time.time()))
    assert not left, f"still alive {EXIT_WITHIN}s after the fault: {left}"


# -- a stage fails ----------------------------------------------------------------------------------
def test_stage_raises_on_chunk_launcher(tmp_path, guard):
    """`python launcher.py --set debug...`: stage 1 raises on chunk 3."""
    run = guard.track_launch(launch(tmp_path, make_rig(2, debug=dict(SLOW)),
                                    "debug.fail_stage=1", "debug.fail_chunk=3", "debug.fail_mode=raise"))
    rc = run.wait(90)
    t_exit = time.time()
    assert rc == 1, run.stderr
    t_fault = log_time(run.out, 1, "injected failure")
    assert t_fault is not None and t_exit - t_fault < EXIT_WITHIN
    pids = stage_pids(run.out)
    line = run.error_line()
    assert line.startswith(f"error: stage 1 (cpu, pid {pids[1]}, chunk 3) failed: StageFailed: "
                           "injected failure at chunk 3"), line
    assert run.stderr.strip().splitlines()[-1] == line  # the last thing said is the error
    log1 = (run.out / "stage-1.log").read_text()
    assert "Traceback" in log1 and "StageFailed" in log1  # the traceback is in the stage's log
    _stage_gone_within([Proc(p) for p in pids.values()], t_fault)
    assert segments(owner_pid=run.pid) == []
    run_ok(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("victim", [0, 1], ids=["first", "last"])
def test_stage_sigkill_at_chunk(tmp_path, guard, victim):
    """The stage SIGKILLs itself on chunk 2 (debug.fail_mode=kill): no message, no cleanup.
    (The middle stage of three is killed from outside in the next test.)"""
    p = _pipeline(tmp_path, make_rig(2, debug=dict(SLOW, fail_stage=victim, fail_chunk=2, fail_mode="kill")), guard)
    err, t_exit, t_fault = _prefill_fails(p, guard, victim)
    assert t_exit - t_fault < EXIT_WITHIN
    pid = p.stages[victim].pid
    assert err == f"stage {victim} (cpu, pid {pid}, chunk 2) killed by SIGKILL"
    _stage_gone_within([Proc(s.pid) for s in p.stages], t_fault)
    assert segments(run_id=p.run_id) == []
    run_ok(tmp_path)


@pytest.mark.parametrize("mode", ["raise", "kill"])
def test_stage_fails_during_decode(tmp_path, guard, mode):
    """The continuation runs through the pipeline one token at a time: after a complete prefill the
    last stage fails on the first decode step (each step is one chunk, index 0)."""
    rig = make_rig(2, generate=4, debug=dict(fail_stage=1, fail_phase="decode", fail_chunk=0, fail_mode=mode))
    p = _pipeline(tmp_path, rig, guard)
    err, t_exit, t_fault = _prefill_fails(p, guard, 1)
    assert t_exit - t_fault < EXIT_WITHIN
    pid = p.stages[1].pid
    want = {"raise": f"stage 1 (cpu, pid {pid}, chunk 0) failed: StageFailed: injected failure at chunk 0",
            "kill": f"stage 1 (cpu, pid {pid}, chunk 0) killed by SIGKILL"}[mode]
    assert err == want
    _stage_gone_within([Proc(s.pid) for s in p.stages], t_fault)
    assert segments(run_id=p.run_id) == []


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["raise", "kill", "hang"])
def test_stage_fails_on_a_decode_step_that_came_by_bell(tmp_path, guard, mode):
    """With decode doorbells (strata/comm/bells.py, forced on these CPU stages) the notes of steps after the first
    never touch a socket: a stage failing on one (step 2) still fails the run naming it, within the same
    bound, and leaves nothing; a stage that hangs on it trips the stall watchdog."""
    over = dict(stall_timeout_s=3.0) if mode == "hang" else {}
    rig = make_rig(2, generate=6, debug=dict(fail_stage=1, fail_phase="decode", fail_chunk=2, fail_mode=mode),
                   kernels={"decode_bells": True}, **over)
    p = _pipeline(tmp_path, rig, guard)
    err, t_exit, t_fault = _prefill_fails(p, guard, 1)
    assert p._buffers.bells is not None
    pid = p.stages[1].pid
    want = {"raise": f"stage 1 (cpu, pid {pid}, chunk 2) failed: StageFailed: injected failure at chunk 2",
            "kill": f"stage 1 (cpu, pid {pid}, chunk 2) killed by SIGKILL",
            "hang": "no progress for 3s"}[mode]
    assert err.startswith(want), err
    assert t_exit - t_fault < EXIT_WITHIN
    _stage_gone_within([Proc(s.pid) for s in p.stages], t_fault)
    assert segments(run_id=p.run_id) == []


@pytest.mark.slow
def test_middle_stage_killed_from_outside(tmp_path, guard):
    """The test SIGKILLs the middle stage once the head sees it start chunk 3. Its neighbours are
    left waiting on it (stage 0 for 'taken', stage 2 for input): the head's teardown ends them."""
    from strata.head.pipeline import PipelineError
    p = _pipeline(tmp_path, make_rig(3, debug=dict(delay_s=0.2)), guard)
    killed: dict = {}

    def killer():
        deadline = time.monotonic() + 60
        while p.stages[1].chunk < 3 and time.monotonic() < deadline:
            time.sleep(0.005)
        killed["t"] = time.time()
        os.kill(p.stages[1].pid, signal.SIGKILL)

    with pytest.raises(PipelineError) as ei:
        with p:
            p.start()
            guard.track_pipeline(p)
            th = threading.Thread(target=killer, daemon=True)
            th.start()
            p.prefill()
    t_exit = time.time()
    th.join(5)
    assert t_exit - killed["t"] < EXIT_WITHIN
    m = re.fullmatch(rf"stage 1 \(cpu, pid {p.stages[1].pid}, chunk (\d+)\) killed by SIGKILL", str(ei.value))
    assert m and int(m[1]) in (3, 4), str(ei.value)  # 3, or 4 if it moved on before the signal landed
    _stage_gone_within([Proc(s.pid) for s in p.stages], killed["t"])
    assert segments(run_id=p.run_id) == []
    run_ok(tmp_path)


@pytest.mark.slow
def test_stage_hang_trips_watchdog(tmp_path, guard):
    """A stage that stops moving: after stall_timeout_s the head dumps every stage's stacks into
    its log and fails naming where each stage was."""
    p = _pipeline(tmp_path, make_rig(2, stall_timeout_s=2.0,
                                     debug=dict(fail_stage=1, fail_chunk=2, fail_mode="hang")), guard)
    msg, t_exit, t_fault = _prefill_fails(p, guard, 1)
    assert t_exit - t_fault < 2.0 + EXIT_WITHIN
    assert msg.startswith("no progress for 2s (stacks dumped to the stage logs): "), msg
    assert f"stage 1 (cpu, pid {p.stages[1].pid}, chunk 2)" in msg
    log1 = (p.out / "stage-1.log").read_text()
    assert "_injected_failure" in log1 and "File " in log1  # faulthandler's dump shows where it hung
    assert segments(run_id=p.run_id) == []


def test_stage_never_ready_trips_ready_deadline(tmp_path, guard):
    """A stage that hangs while loading: the head's ready wait has a deadline too."""
    from strata.head.pipeline import PipelineError
    p = _pipeline(tmp_path, make_rig(2, ready_timeout_s=4.0,
                                     debug=dict(fail_stage=1, fail_phase="load", fail_mode="hang")), guard)
    t0 = time.monotonic()
    with pytest.raises(PipelineError) as ei:
        with p:
            guard.run_ids.add(p.run_id)
            p.prefill()
    assert time.monotonic() - t0 < 4.0 + EXIT_WITHIN
    msg = str(ei.value)
    assert msg.startswith("stage(s) not ready within 4s: "), msg
    assert f"stage 1 (cpu, pid {p.stages[1].pid}, chunk -1)" in msg
    guard.track_pipeline(p)
    # the segments were never unlinked by the ready path: the teardown removed them
    assert segments(run_id=p.run_id) == []


# -- the head dies or is told to stop ---------------------------------------------------------------
def _launch_and_wait_mid_prefill(tmp_path, guard, name="run"):
    rig = make_rig(2, tokens=1024, chunk=64, debug=dict(delay_s=0.25))  # 16 chunks of >= 0.25 s
    run = guard.track_launch(launch(tmp_path, rig, name=name))
    run.wait_ready(2, timeout=90)
    # once every stage has mapped its buffers the head unlinks them: from then on nothing can leak
    deadline = time.monotonic() + 10
    while segments(owner_pid=run.pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert segments(owner_pid=run.pid) == [], "segments not unlinked after every stage was ready"
    # the last stage has started the prefill: both stages are busy mid-run (16 chunks of >= 0.25 s)
    deadline = time.monotonic() + 30
    while log_time(run.out, 1, "prefill: started") is None:
        assert time.monotonic() < deadline and run.popen.poll() is None, "the prefill never reached stage 1"
        time.sleep(0.02)
    assert run.popen.poll() is None, run.popen.communicate()
    stages = {i: Proc(pid, f"stage {i}") for i, pid in stage_pids(run.out).items()}
    assert len(stages) == 2 and all(s.alive() for s in stages.values())
    return run, stages


@pytest.mark.slow
def test_head_sigkill_stages_exit(tmp_path, guard):
    """SIGKILL of the head: each stage sees its pipe's EOF (PR_SET_PDEATHSIG as a backstop) and exits."""
    pymp_before = set(Path(tempfile.gettempdir()).glob("pymp-*"))
    run, stages = _launch_and_wait_mid_prefill(tmp_path, guard)
    ipc_dirs = list(Path(tempfile.gettempdir()).glob(f"strata-ipc-{run.pid}-*"))
    pymp_new = set(Path(tempfile.gettempdir()).glob("pymp-*")) - pymp_before  # the head's fork server socket dir
    t_kill = time.time()
    os.kill(run.pid, signal.SIGKILL)
    assert run.wait(EXIT_WITHIN) == -signal.SIGKILL
    _stage_gone_within(list(stages.values()), t_kill)
    assert segments(owner_pid=run.pid) == []
    assert len(ipc_dirs) == 1  # the dead head's private ipc dir: the next start removes it
    deadline = time.time() + EXIT_WITHIN  # the fork server exits on its pipe's EOF and takes its directory along
    while any(d.exists() for d in pymp_new) and time.time() < deadline:
        time.sleep(0.05)
    assert pymp_new and not any(d.exists() for d in pymp_new), pymp_new
    run_ok(tmp_path)
    assert not ipc_dirs[0].exists()


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_head_signal_stops_everything(tmp_path, guard, sig):
    """SIGINT / SIGTERM to the head: it joins the chunks in flight, stops every stage, exits 130 / 143
    with an error naming each stage and the chunk it was on."""
    run, stages = _launch_and_wait_mid_prefill(tmp_path, guard)
    t_sig = time.time()
    os.kill(run.pid, sig)
    rc = run.wait(EXIT_WITHIN)
    assert time.time() - t_sig < EXIT_WITHIN
    assert rc == {signal.SIGINT: 130, signal.SIGTERM: 143}[sig], run.stderr
    line = run.error_line()
    verb = "interrupted" if sig == signal.SIGINT else "terminated"
    pat = (rf"error: {verb} by {sig.name}; stopped "
           rf"stage 0 \(cpu, pid {stages[0].pid}, chunk (\d+)\), stage 1 \(cpu, pid {stages[1].pid}, chunk (-?\d+)\)"
           rf" \(logs: .*\)")
    m = re.fullmatch(pat, line)
    assert m, line
    assert -1 <= int(m[2]) <= int(m[1]) < 15  # mid-prefill: stage 0 started a chunk, stage 1 behind it
    assert "Traceback" not in run.stderr
    _stage_gone_within(list(stages.values()), t_sig)
    assert segments(owner_pid=run.pid) == []
    run_ok(tmp_path)


# -- shared memory and the ipc directory ------------------------------------------------------------
def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.mark.slow
def test_shm_sweep_early_unlink_and_private_ipc_dir(tmp_path, guard):
    from strata.comm import shm
    dead = _dead_pid()
    stale = SHM / f"strata-dead{os.getpid():x}-{dead}-b0"        # a crashed head's segment
    alive = SHM / f"strata-live{os.getpid():x}-{os.getpid()}-b0"  # a live head's: must be left alone
    stale.write_bytes(b"\0" * 4096)
    alive.write_bytes(b"\0" * 4096)
    stale_ipc = Path(tempfile.gettempdir()) / f"strata-ipc-{dead}-test"
    stale_ipc.mkdir(mode=0o700)
    try:
        p = _pipeline(tmp_path, make_rig(2, tokens=256, chunk=64, debug=dict(delay_s=0.1)), guard)
        during, running = [], threading.Event()

        def sample():  # /dev/shm as seen while the prefill runs
            while running.is_set():
                during.append(shm.run_segments(p.run_id))
                time.sleep(0.02)
        with p:
            p.start()
            guard.track_pipeline(p)
            assert not stale.exists(), "a start must remove segments whose owner is dead"
            assert alive.exists(), "a start must not touch segments of a live owner"
            assert not stale_ipc.exists(), "a start must remove ipc dirs of dead heads"
            # every stage has mapped its buffers: none is left in /dev/shm, even mid-run
            assert shm.run_segments(p.run_id) == []
            ipc = Path(p.procs.res.ipc_dir)
            assert ipc.stat().st_mode & 0o777 == 0o700
            assert ipc.stat().st_uid == os.getuid()
            assert sorted(x.name for x in ipc.iterdir()) == ["head", "s0", "s1"]
            running.set()
            sampler = threading.Thread(target=sample)
            sampler.start()
            try:
                r = p.prefill()
            finally:
                running.clear()
                sampler.join()
            assert len(during) >= 4 and all(d == [] for d in during)
            assert r.report["tokens"] == 256
        assert not ipc.exists()
    finally:
        for f in (stale, alive):
            f.unlink(missing_ok=True)
        if stale_ipc.exists():
            stale_ipc.rmdir()


def test_shm_room_checked_before_start(tmp_path, guard, monkeypatch, capsys):
    """A full /dev/shm gives SIGBUS later, not an error now: the head checks room first."""
    import shutil as _shutil
    from collections import namedtuple

    import launcher
    from strata.comm import shm
    usage = namedtuple("usage", "total used free")
    real = _shutil.disk_usage
    monkeypatch.setattr(shm.shutil, "disk_usage",
                        lambda p: usage(1 << 30, (1 << 30) - 5000, 5000) if str(p) == str(shm.SHM_DIR) else real(p))
    cfg = tmp_path / "rig.yaml"
    import yaml
    cfg.write_text(yaml.safe_dump(make_rig(2)))
    before = set(segments(owner_pid=os.getpid()))
    rc = launcher.main(["--config", str(cfg), "--out", str(tmp_path / "run"), "--no-timeline"])
    err = capsys.readouterr().err
    assert rc == 1
    assert err.startswith("error: /dev/shm has 5,000 bytes free but the hand-off buffers need "), err
    assert len(err.strip().splitlines()) == 1
    assert not list((tmp_path / "run").glob("stage-*.log"))
    assert set(segments(owner_pid=os.getpid())) == before


@pytest.mark.slow
def test_stage_raises_while_loading(tmp_path, guard):
    """A stage that fails before it is ready: its typed failure ends the head's ready wait."""
    from strata.head.pipeline import PipelineError
    p = _pipeline(tmp_path, make_rig(2, debug=dict(fail_stage=0, fail_phase="load", fail_mode="raise")), guard)
    with pytest.raises(PipelineError) as ei:
        with p:
            p.prefill()
    t_exit = time.time()
    guard.track_pipeline(p)
    t_fault = log_time(p.out, 0, "injected failure")
    assert t_fault is not None and t_exit - t_fault < EXIT_WITHIN
    assert str(ei.value) == (f"stage 0 (cpu, pid {p.stages[0].pid}, chunk -1) failed: StageFailed: "
                             "injected failure while loading")
    assert segments(run_id=p.run_id) == []
