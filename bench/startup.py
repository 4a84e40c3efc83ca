"""Start-up of the default rig, measured: run the launcher N times, each stopped (SIGTERM) right after its
first chunk has left for stage 0; print each run's breakdown and the medians.

    python bench/startup.py [--runs 3] [--config configs/rig.yaml] [--set KEY=VALUE ...]

Each run is a fresh interpreter that runs launcher.main exactly as `python launcher.py` would, with one
logging handler that catches the pipeline's start-up line and sends the process SIGTERM (the launcher
then stops everything as on Ctrl-C)."""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHILD = r"""
import sys
sys.path.insert(0, {root!r})
import logging, os, signal, json
import launcher
def emit(record):
    if record.getMessage().startswith("startup:"):
        import gc, strata.head.pipeline as sp
        pipes = [o for o in gc.get_objects() if isinstance(o, sp.Pipeline)]
        print("STARTUP " + json.dumps(pipes[0].startup), file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
h = logging.Handler(); h.emit = emit
lg = logging.getLogger("strata.head.pipeline"); lg.addHandler(h); lg.setLevel(logging.INFO)
sys.exit(launcher.main({argv!r}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--config", default=str(ROOT / "configs" / "rig.yaml"))
    ap.add_argument("--set", action="append", default=[], dest="overrides")
    a = ap.parse_args()
    runs = []
    for i in range(a.runs):
        out = tempfile.mkdtemp(prefix="strata-startup-")
        argv = ["--config", a.config, "--out", out, "--no-timeline"] + [x for s in a.overrides for x in ("--set", s)]
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-c", CHILD.format(root=str(ROOT), argv=argv)], cwd=str(ROOT),
                           capture_output=True, text=True, timeout=300)
        wall = time.perf_counter() - t0
        line = [x for x in r.stderr.splitlines() if x.startswith("STARTUP ")]
        if not line:
            sys.exit(f"run {i}: no start-up line (rc {r.returncode}):\n{r.stderr[-3000:]}")
        s = json.loads(line[0][8:])
        runs.append(s)
        print(f"run {i}: " + "  ".join(f"{k} {v:.2f}" for k, v in s.items() if k != "stage_start")
              + f"  stages by {s.get('stage_start')}  (wall to exit {wall:.2f})")
    print("median: " + "  ".join(f"{k} {statistics.median(r[k] for r in runs):.2f}" for k in runs[0]
                                 if k != "stage_start"))


if __name__ == "__main__":
    main()
