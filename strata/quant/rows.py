"""Resident K-quant products of a decode batch's rows on int8 tensor cores (kernels.gemv_rows: "mma").

strata.quant.gemv's dp4a kernels take at most MAX_M (4) rows of x a launch: a batch of 16 rows reads every weight
4 times, and its per-row dp4a products grow with the rows on the CUDA cores. Here one launch takes up to ROWS_MAX
rows. A program dequantizes a [BLOCK_N weight rows, 32] tile of one sub-block to int8 (Q4_K / Q5_K: the 4- or 5-bit
values; Q6_K: the 6-bit values - 32), multiplies it by the rows' int8 x of that group (`quantize_x`'s rounding, the
dp4a kernels' own) with tl.dot into int32 (tensor cores), and applies the scales in float32:
  Q4_K / Q5_K: x_s * (d * sc * (q . xq) - dmin * m * sum(xq)) per sub-block of 32;
  Q6_K: x_s * d * (sc_0 * (q . xq) over the group's first 16 + sc_1 * over its last 16).
This is llama.cpp's MMQ arrangement. The integer dot products are the dp4a kernels'; only the float32 sums' order
differs. SPLIT programs share a row's blocks where a launch has few tiles (partial rows, then gemv's _sum_splits).
arith "float" (kernels.gemv_rows: "mma-float") takes x as it is instead (bf16 on a GPU): a program dequantizes two
sub-blocks at a time in float32 into one (BLOCK_N, 64) tile of x's dtype and tl.dot accumulates in float32, with no
int8 rounding of x and no epilogue per sub-block. Runs on CUDA, or on the CPU under Triton's interpreter
(TRITON_INTERPRET=1).
"""
from __future__ import annotations

import contextlib
import logging

import torch

from . import qtype_of
from .gemv import MAX_M, MAX_PARTS, SUM_COLS, GemvKernels, check_xq, checked_parts, quantize_x, triton, type_runs

if triton is not None:
    import triton.language as tl

    from .gemv import _f16, _k4_scale_min, _split_range, _sum_splits, _tile_at

log = logging.getLogger("strata.quant")
ROWS_MAX = 64     # x rows a launch (a tile dim: 16, 32 or 64); more take several launches
BLOCK_N = 32      # weight rows a program (int8)
FLOAT_BLOCK_N, FLOAT_STAGES = 64, 4  # arith float's tile and pipeline stages: on an H100 at 16 rows the fastest of
                                     # bench/rows_sweep.py's 19 (8B step's products 14.6 ms summed; 32 rows and
                                     # Triton's default stages: 20.4)
TARGET_TILES = 512  # programs a launch should reach (about 4 waves of an H100 / H200's 132 SMs) before it splits K
MIN_SPLIT_BLOCKS = 4  # a split program's least blocks
TYPES = ("Q4_K", "Q5_K", "Q6_K")
ARITHS = ("int8", "float")
ARITH = "int8"    # quant_matmul_rows' default arithmetic
ARMS = {"mma": "int8", "mma-float": "float"}  # kernels.gemv_rows arm -> arith


def takes(kernels: GemvKernels | None, m: int, qtypes) -> bool:
    """Whether `quant_matmul_rows` computes m rows against matrices of these types for this holder: its rows arm is
    one of ARMS, there are more rows than one dp4a launch takes, and every type has a kernel here."""
    return (triton is not None and kernels is not None and kernels.rows in ARMS and m > MAX_M
            and all(qtype_of(q).name in TYPES for q in qtypes))


if triton is not None:
    @triton.jit
    def _x_tile(xq_ptr, g, cols, r):
        """x's int8 values of group g for rows r (R,): (32, R), from quantize_x's planes (byte 8p + b of group g at
        [p, g, b] of a row)."""
        jj = tl.arange(0, 32)[:, None]
        return tl.load(xq_ptr + r[None, :] * cols + (jj // 8) * (cols // 4) + g * 8 + jj % 8)

    @triton.jit
    def _store_tile(out_ptr, acc, m, M, out_stride, cols_out, live):
        tl.store(out_ptr + m[None, :] * out_stride + cols_out[:, None], acc.to(out_ptr.dtype.element_ty),
                 mask=live[:, None] & (m[None, :] < M))

    @triton.jit
    def _k45_rows(xq_ptr, xs_ptr, out_ptr, a0, a1, a2, n0, n1, n2, p0, p1, nb, cols, out_stride, part_stride, M,
                  R: tl.constexpr, BLOCK_N: tl.constexpr, FIVE: tl.constexpr, SPLIT: tl.constexpr):
        """Q4_K (FIVE False) and Q5_K, gemv's _k45_gemv layout: per block fp16 d and dmin, 12 bytes of 6-bit scales
        and mins, Q5_K's 32 fifth-bit bytes, then 128 bytes whose quarter p holds sub-block 2p in its low nibbles and
        2p + 1 in its high ones. Rows past M read row M - 1 (not stored)."""
        if FIVE:
            size, qs_at = 176, 48
        else:
            size, qs_at = 144, 16
        row_base, col, rows, live = _tile_at(tl.program_id(0), p0, p1, a0, a1, a2, n0, n1, n2, nb, size, BLOCK_N)
        j = tl.arange(0, 32)[None, :]
        m = tl.arange(0, R)
        r = tl.minimum(m, M - 1)
        groups = cols // 32
        acc = tl.zeros((BLOCK_N, R), tl.float32)
        k0, k1 = _split_range(nb, 1, SPLIT)
        for b in range(k0, k1):
            base = row_base + b * size
            d = _f16(base)
            dmin = _f16(base + 2)
            if FIVE:
                fifth = tl.load(base + 16 + j).to(tl.int32)
            for p in tl.static_range(4):
                q = tl.load(base + qs_at + 32 * p + j).to(tl.int32)  # (BLOCK_N, 32)
                for h in tl.static_range(2):
                    w = (q >> (4 * h)) & 15
                    if FIVE:
                        w = w | (((fifth >> (2 * p + h)) & 1) << 4)
                    g = b * 8 + 2 * p + h
                    xt = _x_tile(xq_ptr, g, cols, r)
                    dot = tl.dot(w.to(tl.int8), xt, out_dtype=tl.int32).to(tl.float32)  # (BLOCK_N, R)
                    xsum = tl.sum(xt.to(tl.int32), axis=0).to(tl.float32)[None, :]
                    xs = tl.load(xs_ptr + r * groups + g)[None, :]
                    sc, mn = _k4_scale_min(base + 4, 2 * p + h)
                    acc += xs * ((d * sc) * dot - (dmin * mn) * xsum)
        _store_tile(out_ptr + tl.program_id(1) * part_stride, acc, m, M, out_stride, col + rows, live)

    @triton.jit
    def _q6_k_rows(xq_ptr, xs_ptr, out_ptr, a0, a1, a2, n0, n1, n2, p0, p1, nb, cols, out_stride, part_stride, M,
                   R: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr):
        """Q6_K: per block 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales (one per 16 weights),
        fp16 d. Weight 128n + 32t + l (t = 0..3, l < 32) is the low (t < 2) or high nibble of byte 64n + 32(t % 2) + l
        with bits 2t of byte 128 + 32n + l above it, minus 32; its scale is byte 192 + 8n + 2t + l // 16."""
        row_base, col, rows, live = _tile_at(tl.program_id(0), p0, p1, a0, a1, a2, n0, n1, n2, nb, 210, BLOCK_N)
        j = tl.arange(0, 32)[None, :]
        m = tl.arange(0, R)
        r = tl.minimum(m, M - 1)
        groups = cols // 32
        acc = tl.zeros((BLOCK_N, R), tl.float32)
        k0, k1 = _split_range(nb, 1, SPLIT)
        for b in range(k0, k1):
            base = row_base + b * 210
            d = _f16(base + 208)
            for n in tl.static_range(2):
                qh = tl.load(base + 128 + 32 * n + j).to(tl.int32)
                for half in tl.static_range(2):
                    ql = tl.load(base + 64 * n + 32 * half + j).to(tl.int32)
                    for high in tl.static_range(2):
                        t = half + 2 * high
                        w = (((ql >> (4 * high)) & 15) | (((qh >> (2 * t)) & 3) << 4)) - 32
                        g = b * 8 + 4 * n + t
                        xt = _x_tile(xq_ptr, g, cols, r)
                        first = tl.dot(tl.where(j < 16, w, 0).to(tl.int8), xt, out_dtype=tl.int32).to(tl.float32)
                        last = tl.dot(tl.where(j < 16, 0, w).to(tl.int8), xt, out_dtype=tl.int32).to(tl.float32)
                        s0 = tl.load(base + 192 + 8 * n + 2 * t).to(tl.int8, bitcast=True).to(tl.float32)
                        s1 = tl.load(base + 193 + 8 * n + 2 * t).to(tl.int8, bitcast=True).to(tl.float32)
                        xs = tl.load(xs_ptr + r * groups + g)[None, :]
                        acc += xs * (d * (s0 * first + s1 * last))
        _store_tile(out_ptr + tl.program_id(1) * part_stride, acc, m, M, out_stride, col + rows, live)

    @triton.jit
    def _x_pairs(x_ptr, r, cols, STRIDE: tl.constexpr):
        """x's offsets (64, R) for a dot index kk = 2l + h over two of a block's 32-weight runs STRIDE apart: weight
        STRIDE * h + l (tl.join of the two runs' tiles puts run h's l at kk)."""
        i = tl.arange(0, 64)
        return x_ptr + r[None, :] * cols + ((i % 2) * STRIDE + i // 2)[:, None]

    @triton.jit
    def _less(v, off: tl.constexpr, MAGIC: tl.constexpr):
        """float32(v) - off for int32 v in [0, 2^23): by a conversion, or (MAGIC) by v's bits under 2^23's exponent,
        which is 2^23 + v exactly, then a subtraction (a logic op and an add, where a conversion is slower)."""
        if MAGIC:
            return (v | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + off)
        else:
            return v.to(tl.float32) - off

    @triton.jit
    def _dot_runs(acc, w0, w1, xp, xr, at, STRIDE: tl.constexpr, BLOCK_N: tl.constexpr, PAIR: tl.constexpr):
        """acc plus two dequantized 32-weight runs (BLOCK_N, 32) times x at `at` and at + STRIDE: one dot of 64 (the
        runs joined, x by _x_pairs' offsets xp) or (PAIR False) two of 32 (xr: x's offsets (32, R))."""
        if PAIR:
            xt = tl.load(xp + at)
            return tl.dot(tl.reshape(tl.join(w0, w1), (BLOCK_N, 64)).to(xt.dtype), xt, acc)
        else:
            x0 = tl.load(xr + at)
            acc = tl.dot(w0.to(x0.dtype), x0, acc)
            return tl.dot(w1.to(x0.dtype), tl.load(xr + at + STRIDE), acc)

    @triton.jit
    def _k45_rows_f(x_ptr, out_ptr, a0, a1, a2, n0, n1, n2, p0, p1, nb, cols, out_stride, part_stride, M,
                    R: tl.constexpr, BLOCK_N: tl.constexpr, FIVE: tl.constexpr, SPLIT: tl.constexpr,
                    MAGIC: tl.constexpr, PAIR: tl.constexpr):
        """_k45_rows with x as it is (bfloat16 on a GPU): each quarter's two sub-blocks are dequantized in float32
        (d * sc * q - dmin * m), joined into one (BLOCK_N, 64) tile in x's dtype and multiplied by x's 64 values
        with tl.dot into the float32 accumulator (tensor cores; no int8 x and no per-sub-block epilogue)."""
        if FIVE:
            size, qs_at = 176, 48
        else:
            size, qs_at = 144, 16
        row_base, col, rows, live = _tile_at(tl.program_id(0), p0, p1, a0, a1, a2, n0, n1, n2, nb, size, BLOCK_N)
        j = tl.arange(0, 32)[None, :]
        m = tl.arange(0, R)
        r = tl.minimum(m, M - 1)
        xp = _x_pairs(x_ptr, r, cols, 32)
        xr = x_ptr + r[None, :] * cols + tl.arange(0, 32)[:, None]
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
                acc = _dot_runs(acc, (d * s0) * _less(lo, 0.0, MAGIC) - dmin * m0,
                                (d * s1) * _less(hi, 0.0, MAGIC) - dmin * m1, xp, xr, b * 256 + 64 * p, 32,
                                BLOCK_N, PAIR)
        _store_tile(out_ptr + tl.program_id(1) * part_stride, acc, m, M, out_stride, col + rows, live)

    @triton.jit
    def _q6_run(base, d, ql, qh, j, n: tl.constexpr, t: tl.constexpr, MAGIC: tl.constexpr):
        """Q6_K's run t of 32 weights in half n of a block, dequantized: d * its 16-weight scale * (q - 32)."""
        q = _less((ql & 15) | (((qh >> (2 * t)) & 3) << 4), 32.0, MAGIC)
        s0 = tl.load(base + 192 + 8 * n + 2 * t).to(tl.int8, bitcast=True).to(tl.float32)
        s1 = tl.load(base + 193 + 8 * n + 2 * t).to(tl.int8, bitcast=True).to(tl.float32)
        return (d * tl.where(j < 16, s0, s1)) * q

    @triton.jit
    def _q6_k_rows_f(x_ptr, out_ptr, a0, a1, a2, n0, n1, n2, p0, p1, nb, cols, out_stride, part_stride, M,
                     R: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, MAGIC: tl.constexpr,
                     PAIR: tl.constexpr):
        """_q6_k_rows with x as it is: the low- and high-nibble runs of each 32 bytes (weights 128n + 32 half + l and
        that + 64) dequantized in float32 (d * scale * (q - 32)), joined and multiplied by x with tl.dot."""
        row_base, col, rows, live = _tile_at(tl.program_id(0), p0, p1, a0, a1, a2, n0, n1, n2, nb, 210, BLOCK_N)
        j = tl.arange(0, 32)[None, :]
        m = tl.arange(0, R)
        r = tl.minimum(m, M - 1)
        xp = _x_pairs(x_ptr, r, cols, 64)
        xr = x_ptr + r[None, :] * cols + tl.arange(0, 32)[:, None]
        acc = tl.zeros((BLOCK_N, R), tl.float32)
        k0, k1 = _split_range(nb, 1, SPLIT)
        for b in range(k0, k1):
            base = row_base + b * 210
            d = _f16(base + 208)
            for n in tl.static_range(2):
                qh = tl.load(base + 128 + 32 * n + j).to(tl.int32)
                for half in tl.static_range(2):
                    ql = tl.load(base + 64 * n + 32 * half + j).to(tl.int32)
                    acc = _dot_runs(acc, _q6_run(base, d, ql, qh, j, n, half, MAGIC),
                                    _q6_run(base, d, ql >> 4, qh, j, n, half + 2, MAGIC), xp, xr,
                                    b * 256 + 128 * n + 32 * half, 64, BLOCK_N, PAIR)
        _store_tile(out_ptr + tl.program_id(1) * part_stride, acc, m, M, out_stride, col + rows, live)

    _KERNELS = {"Q4_K": (_k45_rows, {"FIVE": False}), "Q5_K": (_k45_rows, {"FIVE": True}), "Q6_K": (_q6_k_rows, {})}
    _FLOAT_KERNELS = {"Q4_K": (_k45_rows_f, {"FIVE": False}), "Q5_K": (_k45_rows_f, {"FIVE": True}),
                      "Q6_K": (_q6_k_rows_f, {})}


def product(kernels: GemvKernels | None, x: torch.Tensor, parts: list[tuple[torch.Tensor, str]], cols: int,
            out: torch.Tensor | None = None, xq: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor | None:
    """quant_matmul_rows where `takes` holds, else None (the caller's dp4a launches). Where the kernel fails to build
    (a Triton or GPU without int8 mma), this holder's kernels.rows falls back to dp4a, with a warning, as the dp4a
    kernels fall back to their float ones; inside a graph capture the failure is raised (a warm-up run comes first)."""
    if not takes(kernels, x.shape[0], [q for _, q in parts]):
        return None
    try:
        arith = ARMS[kernels.rows]
        return quant_matmul_rows(x, parts, cols, out=out, xq=xq if arith == "int8" else None, arith=arith)
    except Exception as e:  # noqa: BLE001 (Triton's compile errors have no common public base)
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise
        log.warning("gemv_rows mma failed (%s: %s); using the dp4a kernels", type(e).__name__,
                    str(e).splitlines()[0][:200] if str(e) else "")
        kernels.rows = "dp4a"
        return None


def split_for(tiles: int, nb: int) -> int:
    """Programs a row's blocks are cut among: enough to reach TARGET_TILES, each at least MIN_SPLIT_BLOCKS blocks."""
    return max(1, min(triton.cdiv(TARGET_TILES, tiles), nb // MIN_SPLIT_BLOCKS))


def quant_matmul_rows(x: torch.Tensor, parts: list[tuple[torch.Tensor, str]], cols: int,
                      out: torch.Tensor | None = None, xq: tuple[torch.Tensor, torch.Tensor] | None = None,
                      split: int | None = None, arith: str = ARITH, block_n: int | None = None, warps: int = 4,
                      stages: int | None = None, magic: bool = False, pair: bool = True) -> torch.Tensor:
    """x (M, cols) times each matrix (blocks, qtype) of `parts` side by side, as gemv.quant_matmul_parts, on tensor
    cores (Q4_K, Q5_K, Q6_K). arith "int8": x's quantize_x rounding (xq where the caller has it) and int8 products;
    "float": x as it is against weights dequantized to its dtype. split: programs a row's blocks are cut among
    (None: split_for's); block_n, warps, stages: the launch's tile and Triton options; magic, pair (float only): the
    nibbles to float32 by their bits rather than a conversion, and two runs of 32 in one dot (bench/rows_sweep.py)."""
    names = [qtype_of(q).name for _, q in parts]
    if triton is None or any(n not in TYPES for n in names):
        raise ValueError(f"quant_matmul_rows takes {', '.join(TYPES)}, got {', '.join(names)}")
    if arith not in ARITHS:
        raise ValueError(f"quant_matmul_rows arith is one of {', '.join(ARITHS)}, got {arith!r}")
    if arith == "int8" and (magic or not pair):
        raise ValueError("quant_matmul_rows: magic and pair are arith float's")
    names, out = checked_parts(x, parts, cols, out)
    x = x.contiguous()
    if arith == "int8":
        if xq is None:
            xq = quantize_x(x)
        check_xq(x, xq, cols)
        xs = xq
    else:
        xs = (x,)
    nb = cols // 256
    if block_n is None:
        block_n, stages = (BLOCK_N, stages) if arith == "int8" else (FLOAT_BLOCK_N, stages or FLOAT_STAGES)
    opts = {"num_warps": warps} | ({} if stages is None else {"num_stages": stages})
    if arith == "float":
        opts |= {"MAGIC": magic, "PAIR": pair}
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        col = 0
        for i, k in type_runs(names):
            mats = [w for w, _ in parts[i:k]]
            _launch(xs, mats, names[i], nb, cols, out[:, col:], split, arith, block_n, opts)
            col += sum(w.shape[0] for w in mats)
    return out


def _launch(xs, mats, name: str, nb: int, cols: int, dst: torch.Tensor, split: int | None, arith: str,
            block_n: int, opts: dict) -> None:
    rows = [w.shape[0] for w in mats] + [0] * (MAX_PARTS - len(mats))
    progs = [triton.cdiv(n, block_n) for n in rows]
    ptrs = mats + [mats[0]] * (MAX_PARTS - len(mats))
    kernel, family = (_KERNELS if arith == "int8" else _FLOAT_KERNELS)[name]
    total, tiles = sum(rows), sum(progs)
    sp = split_for(tiles, nb) if split is None else max(1, min(split, nb))
    m_all = xs[0].shape[0]
    for r0 in range(0, m_all, ROWS_MAX):
        mr = min(ROWS_MAX, m_all - r0)
        rr = max(16, triton.next_power_of_2(mr))
        target, stride, part_stride = dst[r0:], dst.stride(0), 0
        if sp > 1:  # float32 partial rows (split, mr, total), then their fixed-order sum into dst
            target = torch.empty((sp, mr, total), dtype=torch.float32, device=dst.device)
            stride, part_stride = total, mr * total
        kernel[(tiles, sp)](*(t[r0:] for t in xs), target, *ptrs, *rows, progs[0], progs[0] + progs[1], nb, cols,
                            stride, part_stride, mr, R=rr, BLOCK_N=block_n, SPLIT=sp, **opts, **family)
        if sp > 1:
            _sum_splits[(mr, triton.cdiv(total, SUM_COLS))](target, dst[r0:], total, part_stride, dst.stride(0),
                                                           SPLIT=sp, BLOCK=SUM_COLS)
