"""Shared helpers for the fault, bad-input and fuzz tests: a tiny rig, the launcher as a
subprocess, and a leak guard that fails a test leaving a process or a /dev/shm segment behind.

Nothing here needs psutil: processes are looked up in /proc (a zombie counts as gone: it holds
no memory and no device, and a SIGKILLed head's orphans may be reaped late by the container's
init), and identified by pid *and* start time so a reused pid is never mistaken for ours.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
PYTHON = sys.executable


from strata.head.leftovers import _SEG, SHM, Proc, log_time, ready_count, segments, stage_pids, wait_gone  # noqa: E402,F401


# -- CI: nothing it must run is skipped for want of an install --------------------------------------
# The server's acceptance tests (and others) skip where their modules or the SmolLM2 wheel are missing, as a box
# without them should; in CI (`.ci/run` sets STRATA_CI=1) a broken install would turn them into silent skips and a
# green run, so there the session stops first, naming what is missing.
CI_MODULES = ("openai", "httpx", "transformers", "accelerate", "triton", "sentencepiece", "gguf", "llguidance")


def pytest_sessionstart(session):
    if os.environ.get("STRATA_CI") != "1":
        return
    import importlib
    missing = []
    for name in CI_MODULES:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - any failure to import is a broken install here
            missing.append(f"{name} ({type(e).__name__}: {e})")
    try:
        from strata.weights.checkpoint import smollm2_path
        smollm2_path()
    except Exception as e:  # noqa: BLE001
        missing.append(str(e))
    if missing:
        raise pytest.UsageError("STRATA_CI=1: the tests would skip for want of " + "; ".join(missing))


# -- rigs and the launcher -----------------------------------------------------------------------
def chained_prefill(slices, ids, chunk: int):
    """Chunked prefill through chained Transformer slices in one process: the last slice's residual (1, T, dim)."""
    import torch
    out = []
    for pos in range(0, ids.shape[1], chunk):
        x = ids[:, pos:pos + chunk]
        for s in slices:
            x = s(x, pos)
        out.append(x)
    return torch.cat(out, dim=1)


def make_rig(n_stages: int = 2, tokens: int = 512, chunk: int = 64, **over) -> dict:
    """A tiny rig: synthetic:smoke (8 layers, dim 128), CPU stages with one thread, random prompt."""
    rig = {"model": "synthetic:smoke", "dtype": "float32",
           "stages": [{"device": "cpu", "threads": 1} for _ in range(n_stages)],
           "chunk": chunk, "prompt": {"random": {"tokens": tokens, "seed": 0}},
           "generate": 0, "progress": False}
    rig.update(over)
    return rig


def write_rig(path: Path, rig: dict | str) -> Path:
    path.write_text(rig if isinstance(rig, str) else yaml.safe_dump(rig))
    return path


class Launched:
    """`python launcher.py` as a subprocess, with its run directory."""

    def __init__(self, popen: subprocess.Popen, out: Path):
        self.popen, self.out = popen, out
        self.head = Proc(popen.pid, "head")
        self.stdout = self.stderr = ""

    @property
    def pid(self) -> int:
        return self.popen.pid

    def wait(self, timeout: float) -> int:
        self.stdout, self.stderr = self.popen.communicate(timeout=timeout)
        return self.popen.returncode

    def wait_ready(self, n: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while ready_count(self.out) < n:
            if self.popen.poll() is not None:
                raise AssertionError(f"launcher exited ({self.popen.returncode}) before {n} stages were ready: "
                                     f"{self.popen.stderr.read() if self.popen.stderr else ''}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{n} stages not ready within {timeout}s")
            time.sleep(0.05)

    def error_line(self) -> str:
        lines = [ln for ln in self.stderr.splitlines() if ln.startswith("error:")]
        assert lines, f"no error: line in stderr:\n{self.stderr}"
        return lines[-1]


def launch(tmp: Path, rig: dict | str, *sets: str, name: str = "run", env: dict | None = None,
           args: tuple = ("--no-timeline",)) -> Launched:
    out = tmp / name
    cfg = write_rig(tmp / f"{name}.yaml", rig)
    cmd = [PYTHON, str(REPO / "launcher.py"), "--config", str(cfg), "--out", str(out), *args]
    for s in sets:
        cmd += ["--set", s]
    e = dict(os.environ, PYTHONUNBUFFERED="1")
    e.pop("STRATA_PF_DEPTH", None)
    e.update(env or {})
    p = subprocess.Popen(cmd, cwd=str(REPO), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e)
    return Launched(p, out)


def run_ok(tmp: Path, name: str = "next", n_stages: int = 1, **over) -> dict:
    """The next run on this machine (same devices): starts, succeeds, leaves nothing behind.

    Python API, one stage by default: a stage process costs ~2.5 CPU-seconds of imports, and
    what a fault could leave behind (processes, segments, ipc dirs) blocks one stage as well as two."""
    from strata.head.pipeline import Pipeline
    with Pipeline(make_rig(n_stages, tokens=128, chunk=64, **over), out=tmp / name, console=False) as p:
        result = p.prefill()
        pids = [s.pid for s in p.stages]
        run_id = p.run_id
    assert result.report["tokens"] == 128 and result.perplexity is not None
    assert not wait_gone([Proc(x) for x in pids], 5.0)
    assert segments(run_id=run_id) == []
    return result.report


# -- the leak guard ------------------------------------------------------------------------------
class Guard:
    """What a test started: heads, stage pids, run ids. Checked (and cleaned up) after the test."""

    def __init__(self):
        self.procs: list[Proc] = []
        self.owners: set[int] = set()
        self.run_ids: set[str] = set()
        self.launched: list[Launched] = []

    def track(self, pid: int, what: str = "") -> Proc:
        p = Proc(pid, what)
        self.procs.append(p)
        return p

    def track_launch(self, run: Launched) -> Launched:
        self.launched.append(run)
        self.procs.append(run.head)
        self.owners.add(run.pid)
        return run

    def track_stages(self, out: Path) -> list[Proc]:
        got = [self.track(pid, f"stage {i}") for i, pid in stage_pids(out).items()]
        return got

    def track_pipeline(self, p) -> None:
        self.run_ids.add(p.run_id)
        for s in p.stages:
            if s.pid:
                self.track(s.pid, f"stage {s.index}")


@pytest.fixture
def guard():
    """Fails the test if a process of its runs or a segment of its runs is left over."""
    g = Guard()
    before = set(segments(owner_pid=os.getpid()))
    yield g
    for run in g.launched:  # stage pids of launcher runs, from their logs
        if run.out.is_dir():
            g.track_stages(run.out)
        if run.popen.poll() is None:
            run.popen.kill()
            run.popen.wait(5)
    left = wait_gone(g.procs, 10.0)
    for child in mp.active_children():  # stages of Python-API runs are this process's children
        child.join(5.0)
        if child.is_alive():
            left.append(Proc(child.pid, f"child {child.name}"))
    leaked = [s for s in segments() if _SEG.match(s)["run"] in g.run_ids or int(_SEG.match(s)["pid"]) in g.owners]
    leaked += sorted(set(segments(owner_pid=os.getpid())) - before)
    for p in left:  # clean up so one failure does not poison the next test
        try:
            os.kill(p.pid, signal.SIGKILL)
        except OSError:
            pass
    for s in leaked:
        try:
            (SHM / s).unlink()
        except OSError:
            pass
    assert not left, f"processes of the run left behind: {left}"
    assert not leaked, f"/dev/shm segments of the run left behind: {leaked}"


@pytest.fixture
def tiny_rig() -> dict:
    """A fresh tiny rig dict (see `make_rig`): synthetic:smoke, two 1-thread CPU stages, 512 random tokens."""
    return make_rig()
