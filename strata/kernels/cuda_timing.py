"""Median time of one queued GPU call by CUDA events: what the benchmarks measure."""
from __future__ import annotations

import torch


def median_ms(fn, reps: int, flush: torch.Tensor | None = None) -> float:
    """Median milliseconds of fn() on the current stream. flush: a buffer zeroed before each rep (bigger than
    L2, so the call meets its inputs cold, as a decode step meets its weights). A spin kernel before the start
    event keeps the GPU busy while the host launches fn, so the time is the kernel's, not its launch's."""
    times = []
    for _ in range(reps):
        if flush is not None:
            flush.zero_()
        torch.cuda._sleep(100_000)  # ~50 us at ~2 GHz: longer than any launch
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return sorted(times)[len(times) // 2]
