"""Soak: N runs, each killing a random stage at a random chunk (SIGKILL), outside CI.

For every run it checks what a user would: the head exits non-zero naming the stage (index,
device, pid, chunk, signal); no process of the run is left; no /dev/shm segment and no ipc
directory of the run is left; and how long it took from the kill to the head being done.

    python bench/soak.py                       # 100 runs through `python launcher.py`
    python bench/soak.py --runs 20 --api       # in-process head, the stage killed from outside
    python bench/soak.py --stages 4 --tokens 1024 --chunk 64 --delay 0.05 --seed 7

Two ways to kill: by default each run is a `python launcher.py ... --set debug.fail_mode=kill`
subprocess (the stage SIGKILLs itself at the chosen chunk: exact chunk, real command line);
with --api the head is this process (strata.Pipeline) and a thread SIGKILLs the stage's pid as
soon as the head sees it start the chosen chunk (an outside kill, wherever the stage happens to be).

Prints a line per run and a summary: clean exits, orphans, leaked segments, leaked ipc dirs,
the longest (and median) time from the kill to the exit. Exit status 0 iff every run was clean.
"""
from __future__ import annotations

import argparse
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


from strata.head.leftovers import Proc, log_time, segments, stage_pids  # noqa: E402


def _leftovers(owner_pid: int | None, run_id: str | None, stage_pids) -> tuple[list, list, list]:
    """(live stage pids, /dev/shm segments, ipc dirs) of a run that should have left nothing."""
    orphans = [p for p in stage_pids if Proc(p).alive()]
    segs = segments(owner_pid) if owner_pid is not None else segments(run_id=run_id)
    dirs = [d.name for d in Path(tempfile.gettempdir()).glob(f"strata-ipc-{owner_pid}-*")] if owner_pid else []
    return orphans, segs, dirs


def rig(a) -> dict:
    return {"model": a.model, "stages": [{"device": "cpu", "threads": 1} for _ in range(a.stages)],
            "chunk": a.chunk, "prompt": {"random": {"tokens": a.tokens, "seed": 0}}, "generate": 0,
            "perplexity": True, "progress": False, "debug": {"delay_s": a.delay}}


def run_launcher(a, k: int, victim: int, chunk: int, tmp: Path) -> dict:
    cfg = tmp / f"rig-{k}.yaml"
    cfg.write_text(yaml.safe_dump(rig(a)))
    out = tmp / f"run-{k}"
    cmd = [sys.executable, str(REPO / "launcher.py"), "--config", str(cfg), "--out", str(out), "--no-timeline",
           "--set", f"debug.fail_stage={victim}", "--set", f"debug.fail_chunk={chunk}",
           "--set", "debug.fail_mode=kill"]
    p = subprocess.Popen(cmd, cwd=str(REPO), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = p.communicate(timeout=a.timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        _, stderr = p.communicate()
    t_exit = time.time()
    pids = stage_pids(out)
    t_kill = log_time(out, victim, "injected failure")
    errs = [ln for ln in stderr.splitlines() if ln.startswith("error:")]
    want = f"error: stage {victim} (cpu, pid {pids.get(victim)}, chunk {chunk}) killed by SIGKILL"
    named = bool(errs) and errs[-1].startswith(want)
    orphans, segs, dirs = _leftovers(p.pid, None, pids.values())  # the head's pid owns segments and ipc dir
    return {"rc": p.returncode, "named": named, "error": errs[-1] if errs else stderr.strip()[-300:],
            "exit_s": (t_exit - t_kill) if t_kill else None, "orphans": orphans, "segments": segs, "dirs": dirs}


def run_api(a, k: int, victim: int, chunk: int, tmp: Path) -> dict:
    from strata.head.pipeline import Pipeline, PipelineError
    p = Pipeline(rig(a), out=tmp / f"run-{k}", console=False)
    fired: dict = {}

    def killer():
        deadline = time.monotonic() + a.timeout
        while p.stages[victim].chunk < chunk and time.monotonic() < deadline and not p.failure:
            time.sleep(0.002)
        if p.failure:
            return
        fired["t"] = time.time()
        os.kill(p.stages[victim].pid, signal.SIGKILL)

    err, rc = "", 0
    try:
        with p:
            p.start()
            th = threading.Thread(target=killer, daemon=True)
            th.start()
            p.prefill()
    except PipelineError as e:
        err, rc = str(e), 1
    t_exit = time.time()
    pids = [s.pid for s in p.stages]
    m = re.fullmatch(rf"stage {victim} \(cpu, pid {p.stages[victim].pid}, chunk (\d+)\) killed by SIGKILL", err)
    named = bool(m) and int(m[1]) >= chunk
    orphans, segs, _ = _leftovers(None, p.run_id, pids)
    dirs = [d.name for d in Path(tempfile.gettempdir()).glob(f"strata-ipc-{os.getpid()}-*")]
    return {"rc": rc, "named": named, "error": err or "run succeeded: the kill came too late",
            "exit_s": (t_exit - fired["t"]) if "t" in fired else None, "orphans": orphans, "segments": segs,
            "dirs": dirs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--delay", type=float, default=0.05, help="debug.delay_s: seconds added to every chunk")
    ap.add_argument("--model", default="synthetic:smoke")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--api", action="store_true", help="in-process head; the stage is killed from outside")
    ap.add_argument("--timeout", type=float, default=120.0, help="per run")
    ap.add_argument("--keep", action="store_true", help="keep the run directories")
    a = ap.parse_args()

    rng = random.Random(a.seed)
    n_chunks = -(-a.tokens // a.chunk)
    tmpdir = tempfile.TemporaryDirectory(prefix="soak-")
    tmp = Path(tmpdir.name)
    results, t0 = [], time.time()
    for k in range(a.runs):
        victim, chunk = rng.randrange(a.stages), rng.randrange(n_chunks)
        t = time.time()
        r = (run_api if a.api else run_launcher)(a, k, victim, chunk, tmp)
        r["clean"] = (r["rc"] != 0 and r["named"] and not r["orphans"] and not r["segments"] and not r["dirs"]
                      and r["exit_s"] is not None)
        results.append(r)
        ex = f"{r['exit_s']:.2f}s" if r["exit_s"] is not None else "?"
        print(f"run {k + 1:3d}/{a.runs}: kill stage {victim} at chunk {chunk:2d}: rc {r['rc']}, exit {ex} "
              f"after the kill, {'clean' if r['clean'] else 'NOT CLEAN: ' + r['error']}"
              f"{', orphans ' + str(r['orphans']) if r['orphans'] else ''}"
              f"{', segments ' + str(r['segments']) if r['segments'] else ''}"
              f"{', ipc dirs ' + str(r['dirs']) if r['dirs'] else ''}  [{time.time() - t:.1f}s]", flush=True)
    if not a.keep:
        tmpdir.cleanup()
    exits = [r["exit_s"] for r in results if r["exit_s"] is not None]
    clean = sum(r["clean"] for r in results)
    print(f"\n{a.runs} runs ({'in-process head, outside SIGKILL' if a.api else 'launcher, debug.fail_mode=kill'}; "
          f"{a.stages} CPU stages, {a.tokens} tokens in chunks of {a.chunk}, delay {a.delay}s/chunk) "
          f"in {time.time() - t0:.0f}s")
    print(f"clean exits:       {clean}/{a.runs}")
    print(f"orphans:           {sum(len(r['orphans']) for r in results)}")
    print(f"leaked segments:   {sum(len(r['segments']) for r in results)}")
    print(f"leaked ipc dirs:   {sum(len(r['dirs']) for r in results)}")
    if exits:
        print(f"time to exit:      longest {max(exits):.2f}s, median {statistics.median(exits):.2f}s "
              f"(from the kill until the head has exited{'' if not a.api else ' / close() returned'})")
    return 0 if clean == a.runs else 1


if __name__ == "__main__":
    sys.exit(main())
