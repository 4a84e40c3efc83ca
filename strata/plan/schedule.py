"""Chunk schedules and the pipeline-time model that judges them.

A chunk of T tokens at position p costs, per layer, linear 2*P*T plus attention
4*nh*hd*T*(p + T/2) FLOPs: later chunks of the same size cost more (attention grows with the
prefix), so with fixed chunks the last chunk's trip across the remaining stages (the tail)
is the longest. Dynamic chunking shrinks each next chunk so its cost matches the first's.
"""
from __future__ import annotations

import math

from strata.models.args import ModelArgs


def chunk_flops(args: ModelArgs, pos: int, n: int) -> tuple[float, float]:
    """(linear, attention) FLOPs of one layer on a chunk of n rows at position pos."""
    return 2.0 * args.layer_active_params() * n, 4.0 * args.n_heads * args.head_dim * n * (pos + n / 2)


def chunk_cost(args: ModelArgs, pos: int, n: int) -> float:
    """Total FLOPs of one layer on a chunk (what dynamic chunks equalise)."""
    return sum(chunk_flops(args, pos, n))


def chunk_schedule(tokens: int, chunk: int, dynamic: bool, args: ModelArgs) -> list[tuple[int, int]]:
    """(pos, length) of each chunk; dynamic chunks never exceed `chunk` (the buffers' size)."""
    if not dynamic:
        return [(p, min(chunk, tokens - p)) for p in range(0, tokens, chunk)]
    lin = 2 * args.layer_active_params()
    att = 4 * args.n_heads * args.head_dim
    budget = chunk_cost(args, 0, min(chunk, tokens))
    out, p = [], 0
    while p < tokens:
        # largest t with cost(p, t) <= budget: (att/2) t^2 + (lin + att p) t - budget = 0
        a, b = att / 2, lin + att * p
        t = int((-b + math.sqrt(b * b + 4 * a * budget)) / (2 * a))
        t = (t // 64) * 64 if t >= 64 else max(1, t)  # multiples of 64 keep kernels efficient
        t = min(t, chunk, tokens - p)
        out.append((p, t))
        p += t
    return out


def cut_at(schedule, at: int) -> list[tuple[int, int]]:
    """`schedule`'s chunks with the one holding position `at` inside it cut there (at: a chunk end from now on)."""
    return [part for p, m in schedule
            for part in (((p, at - p), (at, p + m - at)) if p < at < p + m else ((p, m),))]


def kept_state_cut(tokens: int, block: int) -> int:
    """Where the prefill of a `tokens`-token prompt of a model with kept states (linear-attention or window layers:
    strata.kvcache.prefix_cache.stateful) cuts its schedule: the last block boundary before the last token, so a later
    prompt sharing those blocks restores the states there (KvRounds.keep_states, strata/head/kv_rounds.py)."""
    return (tokens - 1) // block * block


def pipeline_time(chunk_times: list[list[float]], depth: int) -> float:
    """Makespan of chunks through stages: chunk_times[k][i] is stage i's work on chunk k.

    depth 1: stage i starts chunk k once it has finished chunk k-1, chunk k has left stage i-1,
    and stage i+1 has taken chunk k-1 (one buffer). depth 0: one chunk in the pipeline at a time.
    """
    if depth == 0:
        return sum(sum(row) for row in chunk_times)
    n = len(chunk_times[0])
    started = [0.0] * n   # when each stage started (took) its previous chunk
    handed = [0.0] * n    # when each stage handed its previous chunk off (and became free)
    for row in chunk_times:
        s_row, h_row = [0.0] * n, [0.0] * n
        for i in range(n):
            s_row[i] = max(h_row[i - 1] if i else 0.0, handed[i])
            done = s_row[i] + row[i]
            # reap: the chunk this stage handed off before must have been taken below
            h_row[i] = max(done, started[i + 1]) if i + 1 < n else done
        started, handed = s_row, h_row
    return handed[-1]


def predicted_speedup(args: ModelArgs, tokens: int, chunk: int, dynamic: bool, n_stages: int) -> float:
    """Depth 1 over depth 0 for balanced stages, from the cost model alone."""
    rows = [[chunk_cost(args, p, t) / n_stages] * n_stages
            for p, t in chunk_schedule(tokens, chunk, dynamic, args)]
    return pipeline_time(rows, 0) / pipeline_time(rows, 1)
