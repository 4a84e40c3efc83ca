"""Resident K-quant products of a decode batch's rows on tensor cores (kernels.gemv_rows: "mma-float").

strata.quant.gemv's dp4a kernels take at most MAX_M (4) rows of x a launch: a batch of 16 rows reads every weight
4 times, and its per-row dp4a products grow with the rows on the CUDA cores. Here one launch takes MIN_ROWS to
ROWS_MAX rows, and x as it is (bf16 on a GPU): a program dequantizes two 32-weight runs of a block at a time in
float32 (Q4_K / Q5_K: d * sc * q - dmin * m; Q6_K: d * sc * (q - 32)), joins them into one (BLOCK_N, 64) tile in
x's dtype and multiplies it by the rows' 64 values of x with tl.dot into a float32 accumulator: no int8 rounding of
x and no epilogue per sub-block. SPLIT programs share a row's blocks where a launch has few tiles (partial rows, then
gemv's _sum_splits). Runs on CUDA, or on the CPU under Triton's interpreter (TRITON_INTERPRET=1).

An int8 arm (llama.cpp's MMQ arrangement: int8 weights times quantize_x's x, int32 sums, float epilogues) was
measured beside this one and removed: on an H100 at 16 rows the 8B step's products took 8.75 ms on it against 6.43
here, and its logits sat further from the float32 model's (bench/rows_sweep.py, bench/decode_rows.py; BENCHMARKS.md,
2026-12-05).
"""
from __future__ import annotations

import contextlib
import logging

import torch

from strata.quant import qtype_of
from strata.quant.gemv import MAX_M, MAX_PARTS, SUM_COLS, GemvKernels, checked_parts, triton, type_runs

if triton is not None:
    import triton.language as tl

    from strata.quant.gemv import _f16, _k4_scale_min, _split_range, _sum_splits, _tile_at

log = logging.getLogger("strata.quant")
ROWS_MAX = 64     # x rows a launch (a tile dim: 16, 32 or 64); more take several launches
MIN_ROWS = MAX_M  # batches of this many rows or more come here: a tile of 16 rows costs about what 4 do, and on an
                  # H100 the 8B's graph step took 8.09 ms for 16 rows here against 8.64 for 4 rows on dp4a
BLOCK_N, STAGES = 64, 4  # weight rows a program, and its pipeline stages: on an H100 at 16 rows the fastest of
                         # bench/rows_sweep.py's configurations (the 8B step's products 6.43 ms in a CUDA graph;
                         # 32 rows: 10.9)
TARGET_TILES = 512  # programs a launch should reach (about 4 waves of an H100 / H200's 132 SMs) before it splits K
MIN_SPLIT_BLOCKS = 4  # a split program's least blocks
TYPES = ("Q4_K", "Q5_K", "Q6_K")
ARM = "mma-float"  # the kernels.gemv_rows value that takes these kernels


def takes(kernels: GemvKernels | None, m: int, qtypes) -> bool:
    """Whether `quant_matmul_rows` computes m rows against matrices of these types for this holder: its rows arm is
    ARM, there are at least MIN_ROWS rows, and every type has a kernel here. Such products read x as it is: no
    caller rounds it to int8 for them."""
    return (triton is not None and kernels is not None and kernels.rows == ARM and m >= MIN_ROWS
            and all(qtype_of(q).name in TYPES for q in qtypes))


if triton is not None:
    @triton.jit
    def _store_tile(out_ptr, acc, m, M, out_stride, cols_out, live):
        tl.store(out_ptr + m[None, :] * out_stride + cols_out[:, None], acc.to(out_ptr.dtype.element_ty),
                 mask=live[:, None] & (m[None, :] < M))

    @triton.jit
    def _x_pairs(x_ptr, r, cols, STRIDE: tl.constexpr):
        """x's offsets (64, R) for a dot index kk = 2l + h over two of a block's 32-weight runs STRIDE apart: weight
        STRIDE * h + l (tl.join of the two runs' tiles puts run h's l at kk)."""
        i = tl.arange(0, 64)
        return x_ptr + r[None, :] * cols + ((i % 2) * STRIDE + i // 2)[:, None]

    @triton.jit
    def _less(v, off: tl.constexpr):
        """float32(v) - off for int32 v in [0, 2^23), by v's bits under 2^23's exponent (2^23 + v exactly) and one
        subtraction, in place of a conversion (H100, 16 rows: the 8B step's products 6.43 ms against 7.67 with
        the conversion)."""
        return (v | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + off)

    @triton.jit
    def _dot_runs(acc, w0, w1, xp, at, BLOCK_N: tl.constexpr):
        """acc plus two dequantized 32-weight runs (BLOCK_N, 32) times x: one dot of 64, the runs joined and x read
        by _x_pairs' offsets xp from `at` (two dots of 32 measured slower: 7.15 ms against 6.43)."""
        xt = tl.load(xp + at)
        return tl.dot(tl.reshape(tl.join(w0, w1), (BLOCK_N, 64)).to(xt.dtype), xt, acc)

    @triton.jit
    def _k45_rows(x_ptr, out_ptr, a0, a1, a2, n0, n1, n2, p0, p1, nb, cols, out_stride, part_stride, M,
                  R: tl.constexpr, BLOCK_N: tl.constexpr, FIVE: tl.constexpr, SPLIT: tl.constexpr):
        """Q4_K (FIVE False) and Q5_K, gemv's _k45_gemv layout: per block fp16 d and dmin, 12 bytes of 6-bit scales
        and mins, Q5_K's 32 fifth-bit bytes, then 128 bytes whose quarter p holds sub-block 2p in its low nibbles and
        2p + 1 in its high ones. A quarter's two sub-blocks make one dot. Rows past M read row M - 1 (not stored)."""
        if FIVE:
            size, qs_at = 176, 48
        else:
            size, qs_at = 144, 16
        row_base, col, rows, live = _tile_at(tl.program_id(0), p0, p1, a0, a1, a2, n0, n1, n2, nb, size, BLOCK_N)
        j = tl.arange(0, 32)[None, :]
        m = tl.arange(0, R)
        r = tl.minimum(m, M - 1)
        xp = _x_pairs(x_ptr, r, cols, 32)
        acc = tl.zeros((BLOCK_N, R), tl.float32)
        k0, k1 = _split_range(nb, 1, SPLIT)
        for b in range(k0, k1):
            base = row_base + b * size
            d = _f16(base)
            dmin = _f16(base + 2)
            if FIVE:
                fifth = tl.load(base + 16 + j).to(tl.int32)
            for p in tl.static_range(4):
                q = tl.load(base + qs_at + 32 * p + j).to(tl.int32)  # (BLOCK_N, 32): sub-blocks 2p (low), 2p + 1
                lo = q & 15
                hi = q >> 4
                if FIVE:
                    lo = lo | (((fifth >> (2 * p)) & 1) << 4)
                    hi = hi | (((fifth >> (2 * p + 1)) & 1) << 4)
                s0, m0 = _k4_scale_min(base + 4, 2 * p)
                s1, m1 = _k4_scale_min(base + 4, 2 * p + 1)
                acc = _dot_runs(acc, (d * s0) * _less(lo, 0.0) - dmin * m0, (d * s1) * _less(hi, 0.0) - dmin * m1,
                                xp, b * 256 + 64 * p, BLOCK_N)
        _store_tile(out_ptr + tl.program_id(1) * part_stride, acc, m, M, out_stride, col + rows, live)

    @triton.jit
    def _q6_run(base, d, ql, qh, j, n: tl.constexpr, t: tl.constexpr):
        """Q6_K's run t of 32 weights in half n of a block, dequantized: d * its 16-weight scale * (q - 32)."""
        q = _less((ql & 15) | (((qh >> (2 * t)) & 3) << 4), 32.0)
        s0 = tl.load(base + 192 + 8 * n + 2 * t).to(tl.int8, bitcast=True).to(tl.float32)
        s1 = tl.load(base + 193 + 8 * n + 2 * t).to(tl.int8, bitcast=True).to(tl.float32)
        return (d * tl.where(j < 16, s0, s1)) * q

    @triton.jit
    def _q6_k_rows(x_ptr, out_ptr, a0, a1, a2, n0, n1, n2, p0, p1, nb, cols, out_stride, part_stride, M,
                   R: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr):
        """Q6_K: per block 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales (one per 16 weights),
        fp16 d. Weight 128n + 32t + l (t = 0..3, l < 32) is the low (t < 2) or high nibble of byte 64n + 32(t % 2) + l
        with bits 2t of byte 128 + 32n + l above it, minus 32; its scale is byte 192 + 8n + 2t + l // 16. The low-
        and high-nibble runs of each 32 bytes (t and t + 2) make one dot."""
        row_base, col, rows, live = _tile_at(tl.program_id(0), p0, p1, a0, a1, a2, n0, n1, n2, nb, 210, BLOCK_N)
        j = tl.arange(0, 32)[None, :]
        m = tl.arange(0, R)
        r = tl.minimum(m, M - 1)
        xp = _x_pairs(x_ptr, r, cols, 64)
        acc = tl.zeros((BLOCK_N, R), tl.float32)
        k0, k1 = _split_range(nb, 1, SPLIT)
        for b in range(k0, k1):
            base = row_base + b * 210
            d = _f16(base + 208)
            for n in tl.static_range(2):
                qh = tl.load(base + 128 + 32 * n + j).to(tl.int32)
                for half in tl.static_range(2):
                    ql = tl.load(base + 64 * n + 32 * half + j).to(tl.int32)
                    acc = _dot_runs(acc, _q6_run(base, d, ql, qh, j, n, half),
                                    _q6_run(base, d, ql >> 4, qh, j, n, half + 2), xp,
                                    b * 256 + 128 * n + 32 * half, BLOCK_N)
        _store_tile(out_ptr + tl.program_id(1) * part_stride, acc, m, M, out_stride, col + rows, live)

    _KERNELS = {"Q4_K": (_k45_rows, {"FIVE": False}), "Q5_K": (_k45_rows, {"FIVE": True}), "Q6_K": (_q6_k_rows, {})}


def product(kernels: GemvKernels | None, x: torch.Tensor, parts: list[tuple[torch.Tensor, str]], cols: int,
            out: torch.Tensor | None = None) -> torch.Tensor | None:
    """quant_matmul_rows where `takes` holds, else None (the caller's dp4a launches). Where the kernel fails to build
    (a Triton or GPU without bf16 mma), this holder's kernels.rows falls back to dp4a, with a warning, as the dp4a
    kernels fall back to their float ones; inside a graph capture the failure is raised (a warm-up run comes first)."""
    if not takes(kernels, x.shape[0], [q for _, q in parts]):
        return None
    try:
        return quant_matmul_rows(x, parts, cols, out=out)
    except Exception as e:  # noqa: BLE001 (Triton's compile errors have no common public base)
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise
        log.warning("gemv_rows %s failed (%s: %s); using the dp4a kernels", ARM, type(e).__name__,
                    str(e).splitlines()[0][:200] if str(e) else "")
        kernels.rows = "dp4a"
        return None


def split_for(tiles: int, nb: int) -> int:
    """Programs a row's blocks are cut among: enough to reach TARGET_TILES, each at least MIN_SPLIT_BLOCKS blocks."""
    return max(1, min(triton.cdiv(TARGET_TILES, tiles), nb // MIN_SPLIT_BLOCKS))


def quant_matmul_rows(x: torch.Tensor, parts: list[tuple[torch.Tensor, str]], cols: int,
                      out: torch.Tensor | None = None, split: int | None = None, block_n: int = BLOCK_N,
                      warps: int = 4, stages: int | None = STAGES) -> torch.Tensor:
    """x (M, cols) times each matrix (blocks, qtype) of `parts` side by side, as gemv.quant_matmul_parts, on tensor
    cores (Q4_K, Q5_K, Q6_K), x as it is against weights dequantized to its dtype. split: programs a row's blocks
    are cut among (None: split_for's); block_n, warps, stages: the launch's tile and Triton options (None: Triton's
    default stages; bench/rows_sweep.py sweeps them)."""
    names = [qtype_of(q).name for _, q in parts]
    if triton is None or any(n not in TYPES for n in names):
        raise ValueError(f"quant_matmul_rows takes {', '.join(TYPES)}, got {', '.join(names)}")
    names, out = checked_parts(x, parts, cols, out)
    x = x.contiguous()
    nb = cols // 256
    opts = {"num_warps": warps} | ({} if stages is None else {"num_stages": stages})
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        col = 0
        for i, k in type_runs(names):
            mats = [w for w, _ in parts[i:k]]
            _launch(x, mats, names[i], nb, cols, out[:, col:], split, block_n, opts)
            col += sum(w.shape[0] for w in mats)
    return out


def _launch(x, mats, name: str, nb: int, cols: int, dst: torch.Tensor, split: int | None, block_n: int,
            opts: dict) -> None:
    rows = [w.shape[0] for w in mats] + [0] * (MAX_PARTS - len(mats))
    progs = [triton.cdiv(n, block_n) for n in rows]
    ptrs = mats + [mats[0]] * (MAX_PARTS - len(mats))
    kernel, family = _KERNELS[name]
    total, tiles = sum(rows), sum(progs)
    sp = split_for(tiles, nb) if split is None else max(1, min(split, nb))
    m_all = x.shape[0]
    for r0 in range(0, m_all, ROWS_MAX):
        mr = min(ROWS_MAX, m_all - r0)
        rr = max(16, triton.next_power_of_2(mr))
        target, stride, part_stride = dst[r0:], dst.stride(0), 0
        if sp > 1:  # float32 partial rows (split, mr, total), then their fixed-order sum into dst
            target = torch.empty((sp, mr, total), dtype=torch.float32, device=dst.device)
            stride, part_stride = total, mr * total
        kernel[(tiles, sp)](x[r0:], target, *ptrs, *rows, progs[0], progs[0] + progs[1], nb, cols,
                            stride, part_stride, mr, R=rr, BLOCK_N=block_n, SPLIT=sp, **opts, **family)
        if sp > 1:
            _sum_splits[(mr, triton.cdiv(total, SUM_COLS))](target, dst[r0:], total, part_stride, dst.stride(0),
                                                           SPLIT=sp, BLOCK=SUM_COLS)
