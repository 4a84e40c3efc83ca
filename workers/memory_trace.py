"""Where a CUDA process's allocated bytes came from: the allocator's history grouped by the first Strata frame that
allocated each live block (file:line function), largest first. For `debug.memory_trace` and bench/load_memory.py,
when what a stage holds differs from what it reports or the planner counted."""
from __future__ import annotations

import collections

import torch

_MARKS = ("/strata/", "/workers/", "/bench/")


def start() -> None:
    torch.cuda.memory._record_memory_history(max_entries=200_000)


def _where(frames) -> str:
    for f in frames:
        name = f.get("filename", "")
        for mark in _MARKS:
            if mark in name:
                return f"{mark.strip('/')}/{name.split(mark)[-1]}:{f.get('line')} {f.get('name')}"
    return "(no Strata frame)"


def summary(top: int = 12, stop: bool = True) -> list[str]:
    """One line per allocating site of the live blocks ("1.234 GiB in N blocks  strata/models/model.py:520 setup_cache")."""
    by, count = collections.Counter(), collections.Counter()
    for seg in torch.cuda.memory._snapshot()["segments"]:
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                k = _where(b.get("frames", []))
                by[k] += b["size"]
                count[k] += 1
    if stop:
        torch.cuda.memory._record_memory_history(enabled=None)
    return [f"{n / 2**30:.3f} GiB in {count[k]:5d} blocks  {k}" for k, n in by.most_common(top)]
