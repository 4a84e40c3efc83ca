"""Dense one-row products of the decode graphs: a Triton matrix-vector kernel or cuBLAS, whichever is faster.

A decode step reads every weight once for one row of x, so it is bound by memory bandwidth; cuBLAS's one-row
kernels read an 8B model's matrices at ~3.7 TB/s on an H200 (BENCHMARKS.md), against ~4.8 TB/s of HBM. The
Triton kernel here streams BLOCK_N rows per program once, x from L2, float32 accumulation. Which is faster
depends on the shape and the GPU, so `matvec` times cuBLAS and a few launch shapes of the kernel once per
(rows, cols, dtype, device), on first use outside a graph capture (the graphs' warm-up replay), and keeps the
fastest. Env STRATA_DECODE_GEMV: "auto" (that choice), "cublas" or "triton" (the A/B).
"""
from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

from .cuda_timing import median_ms

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

MODE = os.environ.get("STRATA_DECODE_GEMV", "auto")
if MODE not in ("auto", "cublas", "triton"):
    raise ValueError(f"STRATA_DECODE_GEMV={MODE!r}: use auto, cublas or triton")
# (BLOCK_N rows per program, BLOCK_K columns per step, warps): the candidates timed per shape
CONFIGS = ((4, 512, 4), (8, 512, 4), (8, 1024, 8), (16, 256, 4))
REPS = 15
log = logging.getLogger("strata.decode_gemv")
_choice: dict[tuple, tuple | None] = {}  # (rows, cols, dtype, device) -> config, or None for cuBLAS

if triton is not None:
    @triton.jit
    def _gemv(x_ptr, w_ptr, b_ptr, y_ptr, K, stride_w, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.arange(0, BLOCK_K)
        wp = w_ptr + rows[:, None].to(tl.int64) * stride_w + cols[None, :]
        acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
        for k in range(0, K, BLOCK_K):  # the callers guarantee K % BLOCK_K == 0 and rows % BLOCK_N == 0: no masks
            x = tl.load(x_ptr + k + cols).to(tl.float32)
            w = tl.load(wp + k, eviction_policy="evict_first").to(tl.float32)  # read once: keep x in L2, not w
            acc += w * x[None, :]
        y = tl.sum(acc, 1)
        if HAS_BIAS:
            y += tl.load(b_ptr + rows).to(tl.float32)
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty))


def _fits(cfg: tuple, n: int, k: int) -> bool:
    return n % cfg[0] == 0 and k % cfg[1] == 0


def _launch(cfg: tuple, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, y: torch.Tensor) -> None:
    bn, bk, warps = cfg
    _gemv[(w.shape[0] // bn,)](x, w, b if b is not None else w, y, w.shape[1], w.stride(0), HAS_BIAS=b is not None,
                              BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)


def _time(fn, flush: torch.Tensor) -> float:
    return median_ms(fn, REPS, flush)


def _pick(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> tuple | None:
    n, k = w.shape
    cands = [c for c in CONFIGS if _fits(c, n, k)]
    if MODE == "cublas" or not cands:
        return None
    if MODE == "triton":
        return cands[0]
    y = torch.empty(n, dtype=x.dtype, device=x.device)
    flush = torch.empty(64 << 20, dtype=torch.int32, device=x.device)  # 256 MiB: more than any L2
    best, best_ms = None, _time(lambda: F.linear(x, w, b), flush)
    cublas_ms = best_ms
    for c in cands:
        ms = _time(lambda c=c: _launch(c, x, w, b, y), flush)
        if ms < best_ms:
            best, best_ms = c, ms
    log.info("decode GEMV %dx%d: %s (%.1f us; cuBLAS %.1f us)", n, k, best or "cuBLAS", best_ms * 1e3, cublas_ms * 1e3)
    return best


def describe() -> str:
    """The choices made so far, for the stage's log: "6144x4096 Triton (4, 512, 4), 4096x14336 cuBLAS"."""
    return ", ".join(f"{n}x{k} " + (f"Triton {c}" if c else "cuBLAS") for (n, k, _, _), c in _choice.items())


def matvec(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., cols) holding ONE row, w (rows, cols) -> x @ w.T + b, shaped (..., rows), in x's dtype."""
    n, k = w.shape
    if (triton is None or not x.is_cuda or x.numel() != k or x.dtype != w.dtype or w.stride(1) != 1
            or (b is not None and not b.is_contiguous())):
        return F.linear(x, w, b)
    key = (n, k, w.dtype, x.device)
    if key not in _choice:
        if torch.cuda.is_current_stream_capturing():  # never time inside a capture: cuBLAS for this one
            return F.linear(x, w, b)
        _choice[key] = _pick(x.reshape(k).contiguous(), w, b)
    cfg = _choice[key]
    if cfg is None:
        return F.linear(x, w, b)
    y = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    _launch(cfg, x.contiguous(), w, b, y)
    return y
