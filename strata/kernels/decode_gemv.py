"""Dense one-row products of the decode graphs: a Triton matrix-vector kernel, or cuBLAS where no launch shape fits.

A decode step reads every weight once for one row of x, so it is bound by memory bandwidth. The Triton kernel
streams BLOCK_N rows per program once, x from L2, float32 accumulation. Over an 8B model's four products, each
over every layer's own weights in one graph (`bench/decode_gemv.py --graph`, H200, BENCHMARKS.md), 4 rows a
program with 2 warps and 1,024 columns a step read the weights at 4.1 TB/s, cuBLAS at 3.8 TB/s.

The launch shape is a fixed rule of the matrix's shape (the first of CONFIGS that fits), never a timing: a
shape's reduction order decides the product's rounding, and a choice timed at load could differ from run to run
(it did: two pipelines of one rig picked different shapes and greedy decoding gave different tokens). `mode`
(the rig's kernels.decode_gemv): "auto" (that rule) or "cublas" (the A/B).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

# (BLOCK_N rows per program, BLOCK_K columns per step, warps), in order of preference; from the sweep of 52
# launch shapes above: (4, 1024, 2) was within 3% of the fastest shape on each of the 8B's matrices; (4, 512, 2)
# and (4, 256, 4) were the fastest with those column steps
CONFIGS = ((4, 1024, 2), (4, 512, 2), (4, 256, 4))
_choice: dict[tuple, tuple | None] = {}  # (rows, cols, mode) -> the launch shape, or None for cuBLAS: for the stage log

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


def describe() -> str:
    """The shapes met so far, for the stage's log: "6144x4096 Triton (4, 1024, 2), 4096x14336 Triton (4, 1024, 2)"."""
    return ", ".join(f"{n}x{k} " + (f"Triton {c}" if c else "cuBLAS") for (n, k, _), c in _choice.items())


def pick(n: int, k: int, mode: str = "auto") -> tuple | None:
    """The launch shape of an n x k matrix, or None (cuBLAS)."""
    if mode not in ("auto", "cublas"):
        raise ValueError(f"decode_gemv mode {mode!r}: auto or cublas")
    if mode == "cublas" or triton is None:
        return None
    return next((c for c in CONFIGS if _fits(c, n, k)), None)


def matvec(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, mode: str = "auto") -> torch.Tensor:
    """x (..., cols) holding ONE row, w (rows, cols) -> x @ w.T + b, shaped (..., rows), in x's dtype; mode: the
    launch rule, or "cublas" (kernels.decode_gemv)."""
    n, k = w.shape
    if (triton is None or not x.is_cuda or x.numel() != k or x.dtype != w.dtype or w.stride(1) != 1
            or (b is not None and not b.is_contiguous())):
        return F.linear(x, w, b)
    cfg = _choice.setdefault((n, k, mode), pick(n, k, mode))
    if cfg is None:
        return F.linear(x, w, b)
    y = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    _launch(cfg, x.contiguous(), w, b, y)
    return y
