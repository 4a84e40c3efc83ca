"""Kernel checks under Triton's interpreter, which must be switched on before triton is imported: a test module's
checks run in a subprocess with TRITON_INTERPRET=1 (`interpreted`), each reporting ok or its traceback
(`run_checks`, on the subprocess's side), and every test asserts its own check (tests/test_quant_gemv.py,
tests/test_quant_rows.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_checks(checks) -> None:
    """Each check in turn (in the interpreted process): one RESULTS line, name -> "ok" or its traceback."""
    results = {}
    for fn in checks:
        try:
            fn()
            results[fn.__name__] = "ok"
        except Exception:
            results[fn.__name__] = traceback.format_exc()
    print("RESULTS " + json.dumps(results))


def interpreted(code: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """Python `code` in a subprocess under the interpreter, the repository and tests/ importable."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join((str(REPO), str(REPO / "tests"))),
               OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def module_results(module: str, timeout: int = 600) -> dict:
    """`module`'s _run_checks (its CHECKS through run_checks), interpreted -> name -> "ok" or the traceback."""
    p = interpreted(f"import {module} as t; t._run_checks()", timeout)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert p.returncode == 0 and lines, p.stderr[-4000:]
    return json.loads(lines[-1][len("RESULTS "):])
