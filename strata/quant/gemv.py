"""Fused dequantize + matrix-vector product on GGUF blocks (Triton): decode reads each weight once, as stored.

`quant_matmul(x, blocks, qtype, cols)` is x (M, cols) @ W.T for W the (rows, cols) matrix whose GGUF
blocks `blocks` (uint8, rows x bytes) hold, for the few rows of a decode step (M <= MAX_M per launch;
more rows take several launches). float32 accumulation; the result in x's dtype (or `out`'s).
`quant_matmul_parts` multiplies one x by several matrices of equal width (q/k/v, gate/up) into one
output, one launch per run of parts of the same type. Which kernel a type takes is the caller's `GemvKernels`
(the rig's kernels.gemv_*; the defaults without one). No host sync and no data-dependent allocation:
CUDA-graph capturable once the per-device tables exist (any call before capture makes them).
Runs on CUDA, or on the CPU under Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported).

IQ3_S has two kernels (GemvKernels.iq3s, the rig's kernels.gemv_iq3s): "dp4a" quantizes x
once per call to int8 with a float32 scale per 32 values (`quantize_x`) and takes per 4 weights one
packed-byte grid lookup, the 4 signs applied on the packed word, and a 4-way int8 dot (PTX dp4a) into
int32, scaled per 32 weights in float32. Its variants differ in the grid table (`iq3_s_words`):
"dp4a-table" folds the signs into a 16x larger table (no sign arithmetic, 32 KiB), "dp4a-u16" (the default,
the fastest measured) packs an entry in 4 nibbles (1 KiB: fewer L1 lines per warp's gather, 4 more integer ops), "dp4a-smem" gathers
from the 2 KiB grid staged in shared memory (tl.gather: 4 stores, 2 barriers, then 8 shared loads per
sub-block instead of 8 L1 gathers that each touch ~14 cache lines). "float" is the earlier
kernel with float x and bfloat16 grid rows (exact to float32 accumulation). int8 x costs ~5e-3 relative
error of the product (measured on random blocks, tests/test_quant_gemv.py).
"""
from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass

import torch

from strata.config import IQ3S_KERNELS, KQUANT_KERNELS, MXFP4_KERNELS, Q8_0_KERNELS, ROWS_KERNELS, KernelSpec
from strata.quant import LEGACY_FLAGS, block_size, qtype_of, type_size

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch without triton: supports() is False everywhere
    triton = None

MAX_M = 4  # x rows per launch (the decode path's DECODE_T); the weights are read once for all of them
MAX_PARTS = 3  # matrices per launch (q, k, v)
MIN_SPLIT_STEPS = 5  # a split-K program's least loop steps (Config.split is cut to that)
SUM_COLS = 1024  # _sum_splits' outputs a program
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_IQ3S_TABLE = {"dp4a": 0, "dp4a-table": 1, "dp4a-u16": 2, "dp4a-smem": 3}  # the dp4a kernel's TABLE: which grid table
# IQ3_S (GemvKernels.iq3s): dp4a-u16 was the fastest on an H200 (70B gate/up, M=1: 137 us,
# 1,475 GB/s; dp4a 177, dp4a-table 215, dp4a-smem 240, float 679: bench/pick_iq3s.py, BENCHMARKS.md)
XQ_GROUP = 32  # x values per int8 scale
# Q4_K/Q5_K (GemvKernels.kquant): "words" (each block read in int32 words, _k45_words_gemv, float x),
# "dp4a" (the default: the same loads, int8 x from `quantize_x` and dp4a products, as Q6_K's dp4a and llama.cpp's
# q8_1 x: ~5e-3 relative error) or "bytes" (_k45_gemv: a byte a lane and the scales byte by byte). On an H200 at
# 8B shapes, one layer's four Q4_K launches in a graph: 202 us (bytes), 143 (words, one block a step), 97.8 (dp4a,
# 4 blocks a step side by side); 8B Q4_K_M decode on one GPU after 2,048 tokens 151.9 (words, one block a step)
# -> 241.0 tok/s (BENCHMARKS.md seventh round).
KQUANTS = KQUANT_KERNELS
# Q6_K (GemvKernels.q6k): "bytes" (_q6_k_gemv, a byte a lane), "words"
# (_q6_k_words: int32 words, two blocks a step, float x, exact to float32 accumulation like bytes) or "dp4a"
# (_q6_k_words with int8 x from `quantize_x` and a dp4a per 4 weights: ~5e-3 relative error, as IQ3_S's; the
# default). words and dp4a need an even number of blocks a row and 4-byte aligned blocks, else bytes runs.
# On an H200 at 8B shapes (M=1, BENCHMARKS.md): ffn_down 4096x14336 91.2 / 62.4 / 51.5 us (bytes / words /
# dp4a), the head 426.8 / 407.8 / 303.5 us; 8B Q4_K_M decode on one GPU 125.6 / 152.2 / 158.9 tok/s.
Q6K_KERNELS = KQUANT_KERNELS
log = logging.getLogger("strata.quant")


@dataclass
class GemvKernels:
    """Which kernel each resident decode product takes: IQ3_S's, Q4_K/Q5_K's, Q6_K's, Q8_0's and the MXFP4 experts',
    and a batch's rows (the rig's kernels.gemv_iq3s / gemv_kquant / gemv_q6k / gemv_q8_0 / gemv_mxfp4 / gemv_rows;
    KernelSpec's defaults). A model holds one for all its matrices (Transformer.gemv). Mutable on purpose: where a
    dp4a kernel fails (a Triton that cannot build the inline PTX), it falls back on this object, IQ3_S and MXFP4 to
    their float kernels, the K-quants to the word kernel on float x and Q8_0 to its byte kernel, for this holder's
    later calls; another holder, or a call without one, is not affected."""
    iq3s: str = KernelSpec.gemv_iq3s
    kquant: str = KernelSpec.gemv_kquant
    q6k: str = KernelSpec.gemv_q6k
    q8_0: str = KernelSpec.gemv_q8_0
    mxfp4: str = KernelSpec.gemv_mxfp4
    rows: str = KernelSpec.gemv_rows  # a batch of rows.MIN_ROWS or more: strata.quant.rows' ("mma-float"), or these

    def __post_init__(self):
        for name, v, choices in (("iq3s", self.iq3s, IQ3S_KERNELS), ("kquant", self.kquant, KQUANTS),
                                 ("q6k", self.q6k, Q6K_KERNELS), ("q8_0", self.q8_0, Q8_0_KERNELS),
                                 ("mxfp4", self.mxfp4, MXFP4_KERNELS), ("rows", self.rows, ROWS_KERNELS)):
            if v not in choices:
                raise ValueError(f"GemvKernels.{name}={v!r}: one of {', '.join(choices)}")

    def choose(self, spec: KernelSpec) -> None:
        """Take the rig's choices again (a fallback made earlier is forgotten)."""
        self.iq3s, self.kquant, self.q6k, self.q8_0 = spec.gemv_iq3s, spec.gemv_kquant, spec.gemv_q6k, spec.gemv_q8_0
        self.mxfp4, self.rows = spec.gemv_mxfp4, spec.gemv_rows
        self.__post_init__()


@dataclass(frozen=True)
class Config:
    """Launch shape: BLOCK_N output rows per program, up to SB quant blocks of a row per loop step
    (the largest count <= SB that divides the row's blocks)."""
    block_n: int
    sb: int
    num_warps: int = 4
    split: int = 1  # word kernels' dense launches: programs a row's blocks are cut among (split-K), partial sums
                    # then added in a fixed order by a second launch (`_sum_splits`: the same bits every run)


# Defaults per type (bench/gemv.py --sweep times the others on the GPU). Q4_K and Q6_K from its sweep at 8B
# shapes (H200, BENCHMARKS.md): Q6_K's smaller matrices went 1.3-1.8x faster with 4 rows a program and 8 warps;
# the rest are untuned guesses
CONFIGS: dict[str, Config] = {"IQ3_S": Config(8, 2), "Q8_0": Config(8, 4), "Q4_K": Config(8, 1),
                               "Q5_K": Config(8, 1), "Q6_K": Config(4, 2, 8), "Q4_0": Config(8, 4),
                               "Q4_1": Config(8, 4), "Q5_0": Config(8, 4), "Q5_1": Config(8, 4)}
# ... and for launches of at least BIG_ROWS rows (gate and up, the head): 32 rows a program, 2 blocks a step
# (8B gate/up: Q4_K 84 -> 61 us, Q6_K 146 -> 108 us; the head 311 -> 220 and 524 -> 428 us)
BIG_ROWS = 16384
BIG_CONFIGS: dict[str, Config] = {"Q4_K": Config(32, 2, 4), "Q6_K": Config(32, 2, 4)}
# (their Q4_K and Q5_K entries: the byte-wise kernel, kquant bytes)
# the dp4a IQ3_S kernel: a [block_n rows, 8 * sb sub-blocks] tile, sb the largest power of two <= sb that
# divides the row's blocks, block_n raised to give each thread an element when sb is smaller
DP4A_CONFIG = Config(4, 4, 4)
# _k45_words_gemv (kquant words and dp4a): a [block_n rows, sb blocks, 4, 8] tile (sb a power of two <= sb that
# divides the row's blocks); KQ_BIG for launches of at least BIG_ROWS rows. From bench/gemv.py --sweep on an H200
# at 8B shapes (graph-timed, M=1, dp4a): q/k/v 16.1 us, wo ~14, gate/up 46.8, ffn_down 4096x14336 ~31-37, head
# 159.1 (a tile of one block a step, the earlier kernel: 21.4, -, 46.3, 56.0, 159.7)
KQ_WORDS = Config(8, 4, 8, split=4)
KQ_BIG = Config(16, 4, 8)
# _q6_k_words (q6k words and dp4a): a [block_n rows, sb block pairs, 32] tile (sb a power of two <= sb
# that divides the row's pairs); per kernel, the first for launches under BIG_ROWS rows, the second for the
# others (bench/gemv.py --q6k words,dp4a --sweep on an H200 at 8B shapes; dp4a re-swept with graph-timed launches,
# which the host's launch time no longer blurs: ffn_down 4096x14336 52.0 -> 37.3 us, wo 19.5 -> 15.3, head 223.9
# -> 203.0). dp4a's first re-swept at 32B/27B shapes (bench/gemv.py --preset qwen3-32b / gemma-3-27b --types
# Q6_K --m 1 --sweep, H200, 2026-12-04), the smaller launches' (16, 4, 8) -> (8, 2, 4): ffn_down 5120x25600 99.3
# -> 74.2 us, 5376x21504 85.9 -> 69.3, wo 5120x8192 38.1 -> 31.6 (at 8B shapes the best and the old were within
# the sweep's noise, ~5 %)
# _q8_0_dp4a: a [block_n rows, sb blocks, 8 words] tile, for launches under BIG_ROWS rows (bench/gemv.py --preset
# gpt-oss-20b --types Q8_0 --sweep, H200, 2026-12-04: q/k/v 5120x2880 22.5 us with the byte kernel -> 18.6, wo
# 2880x4096 25.0 -> 22.5); the big ones (its head, 201,088 rows: 301 us against dp4a's best 324) keep the byte kernel
Q8_0_DP4A = Config(4, 8, 2)
# Split-K (bench/gemv.py --splits 1,2,3,4,6,8, H200, 2026-12-04) for the smaller launches' long rows only (at least
# MIN_SPLIT_STEPS steps a split): ffn_down Q6_K 5376x21504 68.9 -> 61.6 us and 5120x25600 73.3 -> 69.9 at 4 splits,
# Q4_K 49.5 -> 46.5 and 54.2 -> 51.1; shorter rows (wo 5120x8192, 8 steps) went 30.8 -> 35.3, the big launches
# within 2 %
Q6K_WORDS_CONFIGS = {"words": (Config(4, 4, 8), Config(16, 1, 4)),
                     "dp4a": (Config(8, 2, 4, split=4), Config(16, 2, 4))}


def supports(qtype) -> bool:
    """Whether the fused kernel takes this block type (and Triton is importable)."""
    try:
        name = qtype_of(qtype).name
    except ValueError:
        return False
    return triton is not None and name in CONFIGS


def available(device) -> bool:
    """Whether the kernels can run on `device`: CUDA with Triton, or any device under the interpreter."""
    if triton is None:
        return False
    return torch.device(device).type == "cuda" or INTERPRET


if triton is not None:
    @triton.jit
    def _part(pid, p0, p1, a0, a1, a2, n0, n1, n2):
        """Which matrix program `pid` works on: (blocks pointer, its rows, its first output column, local pid)."""
        if pid < p0:
            ptr, n, col, local = a0, n0, n0 * 0, pid
        elif pid < p1:
            ptr, n, col, local = a1, n1, n0, pid - p0
        else:
            ptr, n, col, local = a2, n2, n0 + n1, pid - p1
        return ptr, n, col, local

    @triton.jit
    def _rows_at(pid, p0, p1, a0, a1, a2, n0, n1, n2, BLOCK_N: tl.constexpr):
        """Program `pid`'s tile: (blocks pointer, the matrix's rows, its first output column, the tile's BLOCK_N
        row indices, which of them exist)."""
        ptr, n, col, local = _part(pid, p0, p1, a0, a1, a2, n0, n1, n2)
        rows = local * BLOCK_N + tl.arange(0, BLOCK_N)
        return ptr, n, col, rows, rows < n

    @triton.jit
    def _rows(p0, p1, a0, a1, a2, n0, n1, n2, BLOCK_N: tl.constexpr):
        return _rows_at(tl.program_id(0), p0, p1, a0, a1, a2, n0, n1, n2, BLOCK_N)

    @triton.jit
    def _expert(ids_ptr, estride, xstep, p0, a0, n0, x_ptr, xq_ptr, xs_ptr, out_ptr):
        """Experts mode: the program's slot (p0 programs each) reads expert ids[slot]'s blocks (a0 + its byte
        offset), x row slot (xstep = cols) or row 0 (xstep = 0), and writes output columns slot * n0 on.
        Returns (pid within the slot, the blocks pointer, x, xq, xs, out)."""
        slot = tl.program_id(0) // p0
        e = tl.load(ids_ptr + slot).to(tl.int64)
        return (tl.program_id(0) - slot * p0, a0 + e * estride, x_ptr + slot * xstep,
                xq_ptr + slot * (xstep // 4), xs_ptr + slot * (xstep // 32), out_ptr + slot * n0)

    @triton.jit
    def _tile_at(pid, p0, p1, a0, a1, a2, n0, n1, n2, nb, size, BLOCK_N: tl.constexpr):
        """_rows_at, with each row's first block (`size` bytes a block, nb blocks a row) in place of the blocks
        pointer: rows past the matrix read its last row, so the loads stay in bounds unmasked (not stored)."""
        ptr, n, col, rows, live = _rows_at(pid, p0, p1, a0, a1, a2, n0, n1, n2, BLOCK_N)
        return ptr + tl.minimum(rows, n - 1).to(tl.int64)[:, None] * (nb * size), col, rows, live

    @triton.jit
    def _tile(p0, p1, a0, a1, a2, n0, n1, n2, nb, size, BLOCK_N: tl.constexpr):
        return _tile_at(tl.program_id(0), p0, p1, a0, a1, a2, n0, n1, n2, nb, size, BLOCK_N)

    @triton.jit
    def _zeros4(BLOCK_N: tl.constexpr, W: tl.constexpr):
        """The four x rows' float32 accumulators, (BLOCK_N, W) each (those past M stay unused)."""
        return (tl.zeros((BLOCK_N, W), tl.float32), tl.zeros((BLOCK_N, W), tl.float32),
                tl.zeros((BLOCK_N, W), tl.float32), tl.zeros((BLOCK_N, W), tl.float32))

    @triton.jit
    def _acc4(acc, xr, xo, scale, w0, w1, w2, w3):
        """acc += scale * (the 4 weights of each entry . x at columns xo + 0..3), x row pointer xr."""
        x0 = tl.load(xr + xo).to(tl.float32)
        x1 = tl.load(xr + xo + 1).to(tl.float32)
        x2 = tl.load(xr + xo + 2).to(tl.float32)
        x3 = tl.load(xr + xo + 3).to(tl.float32)
        return acc + scale * (w0 * x0 + w1 * x1 + w2 * x2 + w3 * x3)

    @triton.jit
    def _acc1(acc, xr, xo, scale, w):
        """acc += scale * w * x at columns xo, x row pointer xr."""
        return acc + scale * (w * tl.load(xr + xo).to(tl.float32))

    @triton.jit
    def _acc1_rows(acc0, acc1, acc2, acc3, x_ptr, cols, xo, scale, w, M: tl.constexpr):
        """_acc1 for each of the first M rows of x (rows `cols` apart)."""
        acc0 = _acc1(acc0, x_ptr, xo, scale, w)
        if M > 1:
            acc1 = _acc1(acc1, x_ptr + cols, xo, scale, w)
        if M > 2:
            acc2 = _acc1(acc2, x_ptr + 2 * cols, xo, scale, w)
        if M > 3:
            acc3 = _acc1(acc3, x_ptr + 3 * cols, xo, scale, w)
        return acc0, acc1, acc2, acc3

    @triton.jit
    def _store(out_ptr, acc, m, out_stride, cols_out, live):
        tl.store(out_ptr + m * out_stride + cols_out, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=live)

    @triton.jit
    def _store_rows(out_ptr, acc0, acc1, acc2, acc3, M: tl.constexpr, out_stride, cols_out, live):
        """The first M of the four x rows' accumulators, each summed over its tile's columns."""
        _store(out_ptr, acc0, 0, out_stride, cols_out, live)
        if M > 1:
            _store(out_ptr, acc1, 1, out_stride, cols_out, live)
        if M > 2:
            _store(out_ptr, acc2, 2, out_stride, cols_out, live)
        if M > 3:
            _store(out_ptr, acc3, 3, out_stride, cols_out, live)

    @triton.jit
    def _f16(ptr):
        """The little-endian fp16 at byte pointer ptr (2-byte aligned only), as float32."""
        h = tl.load(ptr).to(tl.int32) | (tl.load(ptr + 1).to(tl.int32) << 8)
        return h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _iq3_s_gemv(x_ptr, out_ptr, grid_ptr, a0, a1, a2, n0, n1, n2, p0, p1, nb, cols, out_stride,
                    M: tl.constexpr, BLOCK_N: tl.constexpr, SB: tl.constexpr):
        """IQ3_S: per 4 weights (one grid entry) a byte of index, a high bit and a nibble of signs, which
        pick 4 signed bfloat16 values (`grid_ptr`, iq.signed_bf16_grid); a 4-bit scale per 32
        weights times the block's fp16 d, applied after the 4-weight dot. Tile: [BLOCK_N rows, 64 entries],
        SB blocks per loop step."""
        row_base, col, rows, live = _tile(p0, p1, a0, a1, a2, n0, n1, n2, nb, 110, BLOCK_N)
        e = tl.arange(0, 64)[None, :]  # grid entry within the block
        acc0, acc1, acc2, acc3 = _zeros4(BLOCK_N, 64)
        for k in range(0, nb, SB):
            for s in tl.static_range(SB):
                b = k + s
                base = row_base + b * 110
                d = _f16(base)  # (BLOCK_N, 1)
                qs = tl.load(base + 2 + e).to(tl.int32)
                qh = tl.load(base + 66 + e // 8).to(tl.int32)
                sg = tl.load(base + 74 + e // 2).to(tl.int32)
                sc = tl.load(base + 106 + e // 16).to(tl.int32)
                idx = ((qs | (((qh >> (e % 8)) & 1) << 8)) << 4) | ((sg >> ((e % 2) * 4)) & 15)
                lo = tl.load(grid_ptr + 2 * idx)  # values 0, 1 as bfloat16 pairs, 2, 3 in the next word
                hi = tl.load(grid_ptr + 2 * idx + 1)
                w0 = (lo << 16).to(tl.float32, bitcast=True)
                w1 = (lo & -65536).to(tl.float32, bitcast=True)
                w2 = (hi << 16).to(tl.float32, bitcast=True)
                w3 = (hi & -65536).to(tl.float32, bitcast=True)
                odd = 1 + 2 * ((sc >> ((e // 8) % 2 * 4)) & 15)  # 1..31 as float32 without a conversion:
                db = d * ((odd | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0)  # 2^23 + odd, minus 2^23
                xo = b * 256 + e * 4
                acc0 = _acc4(acc0, x_ptr, xo, db, w0, w1, w2, w3)
                if M > 1:
                    acc1 = _acc4(acc1, x_ptr + cols, xo, db, w0, w1, w2, w3)
                if M > 2:
                    acc2 = _acc4(acc2, x_ptr + 2 * cols, xo, db, w0, w1, w2, w3)
                if M > 3:
                    acc3 = _acc4(acc3, x_ptr + 3 * cols, xo, db, w0, w1, w2, w3)
        _store_rows(out_ptr, acc0, acc1, acc2, acc3, M, out_stride, col + rows, live)

    @triton.jit
    def _q8_0_gemv(x_ptr, out_ptr, grid_ptr, a0, a1, a2, n0, n1, n2, p0, p1, nb, cols, out_stride,
                   M: tl.constexpr, BLOCK_N: tl.constexpr, SB: tl.constexpr):
        """Q8_0: 32 int8 weights times the block's fp16 d, applied after their dot with x. Tile: [BLOCK_N
        rows, 32 weights], SB blocks per loop step."""
        row_base, col, rows, live = _tile(p0, p1, a0, a1, a2, n0, n1, n2, nb, 34, BLOCK_N)
        j = tl.arange(0, 32)[None, :]
        acc0, acc1, acc2, acc3 = _zeros4(BLOCK_N, 32)
        for k in range(0, nb, SB):
            for s in tl.static_range(SB):
                b = k + s
                base = row_base + b * 34
                d = _f16(base)  # (BLOCK_N, 1)
                q = tl.load(base + 2 + j).to(tl.int8, bitcast=True).to(tl.float32)
                xo = b * 32 + j
                acc0, acc1, acc2, acc3 = _acc1_rows(acc0, acc1, acc2, acc3, x_ptr, cols, xo, d, q, M)
        _store_rows(out_ptr, acc0, acc1, acc2, acc3, M, out_stride, col + rows, live)

    @triton.jit
    def _q8_0_dp4a(xq_ptr, xs_ptr, out_ptr, a0, a1, a2, n0, n1, n2, p0, p1, nb, cols, out_stride,
                   M: tl.constexpr, BLOCK_N: tl.constexpr, SB: tl.constexpr, PTX: tl.constexpr, TAIL: tl.constexpr):
        """Q8_0 on int8 x (`quantize_x`: a block of 32 weights is one of x's groups), llama.cpp's q8_0 x q8_1
        product: per block 8 dp4a of weight words by x words, the int32 sum times the block's d and x's scale.
        A step loads a [BLOCK_N rows, SB blocks, 8 words] tile; a 34-byte block is only 2-byte aligned, so each
        word is two int16 loads (weights 4w..4w+3 at halfwords 17b + 1 + 2w and + 2). TAIL: SB need not divide
        the row's blocks (2,880 columns are 90): a step past the row's end reads its last block, weighed 0."""
        row_base, col, rows, live = _tile(p0, p1, a0, a1, a2, n0, n1, n2, nb, 34, BLOCK_N)
        hrow = row_base.to(tl.pointer_type(tl.int16))  # (BLOCK_N, 1)
        kb = tl.arange(0, SB)[None, :]  # (1, SB)
        w = tl.arange(0, 8)[None, None, :]  # (1, 1, 8)
        acc0 = tl.zeros((BLOCK_N, SB), tl.float32)
        acc1 = tl.zeros((BLOCK_N, SB), tl.float32)
        acc2 = tl.zeros((BLOCK_N, SB), tl.float32)
        acc3 = tl.zeros((BLOCK_N, SB), tl.float32)
        for k in range(0, nb, SB):
            b = k + kb
            if TAIL:
                b = tl.minimum(b, nb - 1)
            hb = hrow + b * 17  # (BLOCK_N, SB): the blocks' d
            d = tl.load(hb).to(tl.float16, bitcast=True).to(tl.float32)
            if TAIL:
                d = tl.where(k + kb < nb, d, 0.0)
            lo = tl.load(hb[:, :, None] + 1 + 2 * w).to(tl.int32) & 0xFFFF
            q = lo | (tl.load(hb[:, :, None] + 2 + 2 * w).to(tl.int32) << 16)  # (BLOCK_N, SB, 8)
            xi = (w // 2) * (cols // 16) + 2 * b[:, :, None] + w % 2  # x's words of group b in quantize_x's planes
            acc0 += _q8_0_idot(xq_ptr, xs_ptr, xi, b, q, d, PTX)
            if M > 1:
                acc1 += _q8_0_idot(xq_ptr + cols // 4, xs_ptr + cols // 32, xi, b, q, d, PTX)
            if M > 2:
                acc2 += _q8_0_idot(xq_ptr + cols // 2, xs_ptr + cols // 16, xi, b, q, d, PTX)
            if M > 3:
                acc3 += _q8_0_idot(xq_ptr + 3 * (cols // 4), xs_ptr + 3 * (cols // 32), xi, b, q, d, PTX)
        _store_rows(out_ptr, acc0, acc1, acc2, acc3, M, out_stride, col + rows, live)

    @triton.jit
    def _q8_0_idot(xq_ptr, xs_ptr, xi, g, q, d, PTX: tl.constexpr):
        """d * x's scale * the int32 dot of a block's 8 weight words with x's (one row of x)."""
        return tl.sum(_dp4a(q, tl.load(xq_ptr + xi), 0, PTX), 2).to(tl.float32) * (d * tl.load(xs_ptr + g))

    @triton.jit
    def _legacy_gemv(x_ptr, out_ptr, grid_ptr, a0, a1, a2, n0, n1, n2, p0, p1, nb, cols, out_stride, M: tl.constexpr,
                     BLOCK_N: tl.constexpr, SB: tl.constexpr, MIN: tl.constexpr, FIVE: tl.constexpr):
        """Q4_0, Q4_1 (MIN), Q5_0 (FIVE), Q5_1: fp16 d, [fp16 m], [32 fifth bits], 16 bytes whose low nibbles
        are weights 0..15 and high ones 16..31; d * (q - 8 or 16), or d * q + m. Tile: [BLOCK_N rows, 32
        weights], SB blocks per loop step."""
        qh_at: tl.constexpr = 2 + 2 * MIN
        qs_at: tl.constexpr = qh_at + 4 * FIVE
        row_base, col, rows, live = _tile(p0, p1, a0, a1, a2, n0, n1, n2, nb, qs_at + 16, BLOCK_N)
        j = tl.arange(0, 32)[None, :]
        acc0, acc1, acc2, acc3 = _zeros4(BLOCK_N, 32)
        for k in range(0, nb, SB):
            for s in tl.static_range(SB):
                b = k + s
                base = row_base + b * (qs_at + 16)
                q = (tl.load(base + qs_at + j % 16).to(tl.int32) >> (4 * (j // 16))) & 15
                if FIVE:
                    q = q | (((tl.load(base + qh_at + j // 8).to(tl.int32) >> (j % 8)) & 1) << 4)
                if MIN:
                    scale, w = 1.0, _f16(base) * q.to(tl.float32) + _f16(base + 2)  # the weight itself
                else:
                    scale, w = _f16(base), (q - 8 - 8 * FIVE).to(tl.float32)
                xo = b * 32 + j
                acc0, acc1, acc2, acc3 = _acc1_rows(acc0, acc1, acc2, acc3, x_ptr, cols, xo, scale, w, M)
        _store_rows(out_ptr, acc0, acc1, acc2, acc3, M, out_stride, col + rows, live)

    @triton.jit
    def _k4_scale_min(sp, j: tl.constexpr):
        """Q4_K's 6-bit scale and min of sub-block j from the 12 packed bytes at sp: (BLOCK_N, 1) each."""
        if j < 4:
            sc = tl.load(sp + j).to(tl.int32) & 63
            m = tl.load(sp + j + 4).to(tl.int32) & 63
        else:
            hi = tl.load(sp + j + 4).to(tl.int32)
            sc = (hi & 15) | ((tl.load(sp + j - 4).to(tl.int32) >> 6) << 4)
            m = (hi >> 4) | ((tl.load(sp + j).to(tl.int32) >> 6) << 4)
        return sc.to(tl.float32), m.to(tl.float32)

    @triton.jit
    def _acc_k4(acc, xr, xo, dl, ml, ql, dh, mh, qh):
        """acc += (dl * ql - ml) . x[xo] + (dh * qh - mh) . x[xo + 32], the scales applied after the products."""
        xl = tl.load(xr + xo).to(tl.float32)
        xh = tl.load(xr + xo + 32).to(tl.float32)
        return acc + dl * (ql * xl) - ml * xl + dh * (qh * xh) - mh * xh

    @triton.jit
    def _k45_gemv(x_ptr, out_ptr, grid_ptr, a0, a1, a2, n0, n1, n2, p0, p1, nb, cols, out_stride,
                  M: tl.constexpr, BLOCK_N: tl.constexpr, SB: tl.constexpr, FIVE: tl.constexpr):
        """Q4_K (FIVE False) and Q5_K: fp16 d and dmin, 8 sub-blocks of 32 with 6-bit scale and min, then Q5_K's
        32 bytes of fifth bits (weight 32g + i: bit g of byte i), then 4-bit weights: byte i of quarter p holds
        weight 64p + i (low nibble, sub-block 2p) and 64p + 32 + i (high, 2p + 1). Tile: [BLOCK_N rows, 32
        bytes], a block's 4 quarters unrolled, SB blocks per loop step."""
        if FIVE:
            size, qs_at = 176, 48
        else:
            size, qs_at = 144, 16
        row_base, col, rows, live = _tile(p0, p1, a0, a1, a2, n0, n1, n2, nb, size, BLOCK_N)
        i = tl.arange(0, 32)[None, :]
        acc0, acc1, acc2, acc3 = _zeros4(BLOCK_N, 32)
        for k in range(0, nb, SB):
            for s in tl.static_range(SB):
                b = k + s
                base = row_base + b * size
                d = _f16(base)
                dmin = _f16(base + 2)
                if FIVE:
                    fifth = tl.load(base + 16 + i).to(tl.int32)
                for p in tl.static_range(4):
                    q = tl.load(base + qs_at + 32 * p + i).to(tl.int32)
                    ql, qh = q & 15, q >> 4
                    if FIVE:
                        ql = ql | (((fifth >> (2 * p)) & 1) << 4)
                        qh = qh | (((fifth >> (2 * p + 1)) & 1) << 4)
                    scl, mnl = _k4_scale_min(base + 4, 2 * p)
                    sch, mnh = _k4_scale_min(base + 4, 2 * p + 1)
                    dl, ml, dh, mh = d * scl, dmin * mnl, d * sch, dmin * mnh
                    xo = b * 256 + 64 * p + i
                    qlf, qhf = ql.to(tl.float32), qh.to(tl.float32)
                    acc0 = _acc_k4(acc0, x_ptr, xo, dl, ml, qlf, dh, mh, qhf)
                    if M > 1:
                        acc1 = _acc_k4(acc1, x_ptr + cols, xo, dl, ml, qlf, dh, mh, qhf)
                    if M > 2:
                        acc2 = _acc_k4(acc2, x_ptr + 2 * cols, xo, dl, ml, qlf, dh, mh, qhf)
                    if M > 3:
                        acc3 = _acc_k4(acc3, x_ptr + 3 * cols, xo, dl, ml, qlf, dh, mh, qhf)
        _store_rows(out_ptr, acc0, acc1, acc2, acc3, M, out_stride, col + rows, live)

    @triton.jit
    def _k4_words_scales(w0, w1, w2, j):
        """Q4_K/Q5_K's 6-bit scale and min of sub-block j (an int tensor) from the 12 scale bytes as 3 int32
        words: j < 4: low 6 bits of bytes j and j + 4; else bytes j + 4's nibbles with bytes j - 4's and j's
        top 2 bits above them."""
        sh = 8 * (j & 3)
        b0, b1, b2 = (w0 >> sh) & 255, (w1 >> sh) & 255, (w2 >> sh) & 255
        sc = tl.where(j < 4, b0 & 63, (b2 & 15) | ((b0 >> 6) << 4))
        mn = tl.where(j < 4, b1 & 63, (b2 >> 4) | ((b1 >> 6) << 4))
        return sc.to(tl.float32), mn.to(tl.float32)

    @triton.jit
    def _acc_k4_words(acc, xr, xo, q, fifth, p, dl, ml, dh, mh, FIVE: tl.constexpr):
        """acc += dl * (low nibbles . x) - ml * sum(x) + dh * (high nibbles . x[+32]) - mh * sum(x[+32]): the 4
        bytes of each word, weights xo + t (low) and xo + 32 + t (high)."""
        dot_lo = tl.zeros(acc.shape, tl.float32)
        dot_hi = tl.zeros(acc.shape, tl.float32)
        sum_lo = tl.zeros(xo.shape, tl.float32)
        sum_hi = tl.zeros(xo.shape, tl.float32)
        for t in tl.static_range(4):
            byte = (q >> (8 * t)) & 255
            lo, hi = byte & 15, byte >> 4
            if FIVE:  # bit 2p (low sub-block) and 2p + 1 (high) of fifth-bit byte 4w + t
                lo = lo | (((fifth >> (8 * t + 2 * p)) & 1) << 4)
                hi = hi | (((fifth >> (8 * t + 2 * p + 1)) & 1) << 4)
            xl = tl.load(xr + xo + t).to(tl.float32)
            xh = tl.load(xr + xo + 32 + t).to(tl.float32)
            dot_lo += lo.to(tl.float32) * xl
            dot_hi += hi.to(tl.float32) * xh
            sum_lo += xl
            sum_hi += xh
        return acc + dl * dot_lo - ml * sum_lo + dh * dot_hi - mh * sum_hi

    @triton.jit
    def _k45_words_gemv(x_ptr, xq_ptr, xs_ptr, out_ptr, a0, a1, a2, n0, n1, n2, p0, p1, nb, cols, out_stride,
                        ids_ptr, estride, xstep, sstride,
                        M: tl.constexpr, BLOCK_N: tl.constexpr, SB: tl.constexpr, FIVE: tl.constexpr,
                        DP4A: tl.constexpr, PTX: tl.constexpr, EXPERTS: tl.constexpr, TAIL: tl.constexpr = False,
                        SPLIT: tl.constexpr = 1):
        """Q4_K and Q5_K (the layout of _k45_gemv) read in int32 words, SB blocks of a row side by side: a step
        loads a [BLOCK_N rows, SB blocks, 4 quarters, 8 words] tile of quantized bytes at once (word w of quarter
        p: weights 64p + 4w + t in its low nibbles, 64p + 32 + 4w + t in its high ones), so a row's short loop
        has all its loads in flight; each block's header as 4 words (d and dmin, then the 12 scale bytes),
        Q5_K's 32 fifth-bit bytes as 8 words. SB a power of two dividing the row's blocks; blocks 4-byte aligned
        (the caller checks). DP4A: int8 x (`quantize_x`: xq_ptr as int32 words, xs_ptr its scales; a sub-block
        of 32 weights is one of x's groups) and per word two dp4a (its low and high nibbles as 4 bytes each)
        plus one per x word for the min's sum of x, llama.cpp's q8_1 product; else float x (x_ptr) and float32
        products per weight. EXPERTS: one matrix a slot of p0 programs, the expert ids[slot] of a stack
        (`_expert`; M = 1). TAIL: SB need not divide the row's blocks (an odd count: 5,376 columns are 21): a
        step past the row's end reads its last block again (no masked loads, which would split the vectors)
        and weighs it 0. SPLIT: program_id(1) takes its share of a row's steps and stores its partial sums
        sstride elements further (float32; `_sum_splits` adds them): a short launch of long rows otherwise waits on
        one program's sequential loads."""
        if FIVE:
            size, qs_at = 176, 48
        else:
            size, qs_at = 144, 16
        pid = tl.program_id(0)
        if EXPERTS:
            pid, a0, x_ptr, xq_ptr, xs_ptr, out_ptr = _expert(ids_ptr, estride, xstep, p0, a0, n0, x_ptr, xq_ptr,
                                                              xs_ptr, out_ptr)
        row_base, col, rows, live = _tile_at(pid, p0, p1, a0, a1, a2, n0, n1, n2, nb, size, BLOCK_N)
        wbase = row_base.to(tl.pointer_type(tl.int32))[:, :, None, None]  # (BLOCK_N, 1, 1, 1)
        kb = tl.arange(0, SB)[None, :, None, None]
        p = tl.arange(0, 4)[None, None, :, None]
        w = tl.arange(0, 8)[None, None, None, :]
        acc0 = tl.zeros((BLOCK_N, SB, 4, 8), tl.float32)
        acc1 = tl.zeros((BLOCK_N, SB, 4, 8), tl.float32)
        acc2 = tl.zeros((BLOCK_N, SB, 4, 8), tl.float32)
        acc3 = tl.zeros((BLOCK_N, SB, 4, 8), tl.float32)
        k0, k1 = _split_range(tl.cdiv(nb, SB) * SB, SB, SPLIT)
        for k in range(k0, k1, SB):
            b = k + kb  # (1, SB, 1, 1)
            if TAIL:
                b = tl.minimum(b, nb - 1)
            base = wbase + b * (size // 4)
            q = tl.load(base + qs_at // 4 + 8 * p + w)  # (BLOCK_N, SB, 4, 8)
            h0 = tl.load(base)
            d = (h0 & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            dmin = ((h0 >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            w0, w1, w2 = tl.load(base + 1), tl.load(base + 2), tl.load(base + 3)
            scl, mnl = _k4_words_scales(w0, w1, w2, 2 * p)
            sch, mnh = _k4_words_scales(w0, w1, w2, 2 * p + 1)
            if TAIL:  # a repeated last block weighs 0
                d = tl.where(k + kb < nb, d, 0.0)
                dmin = tl.where(k + kb < nb, dmin, 0.0)
            dl, ml, dh, mh = d * scl, dmin * mnl, d * sch, dmin * mnh  # (BLOCK_N, SB, 4, 1)
            fifth = q
            if FIVE:
                fifth = tl.load(base + 4 + w)  # (BLOCK_N, SB, 1, 8): byte 4w + t holds weight 32g + 4w + t's bit g
            if DP4A:
                lo = q & 0x0F0F0F0F  # 4 weights of sub-block 2p as 4 bytes
                hi = (q >> 4) & 0x0F0F0F0F  # and of sub-block 2p + 1
                if FIVE:
                    lo = lo | (((fifth >> (2 * p)) & 0x01010101) << 4)
                    hi = hi | (((fifth >> (2 * p + 1)) & 0x01010101) << 4)
                g = b * 8 + 2 * p  # x's group of the low sub-block (1, SB, 4, 1); the high one's: g + 1
                xi = (w // 2) * (cols // 16) + 2 * g + w % 2  # their int32 word in quantize_x's planes
                acc0 += _k4_idot(xq_ptr, xs_ptr, xi, g, lo, hi, dl, ml, dh, mh, PTX)
                if M > 1:
                    acc1 += _k4_idot(xq_ptr + cols // 4, xs_ptr + cols // 32, xi, g, lo, hi, dl, ml, dh, mh, PTX)
                if M > 2:
                    acc2 += _k4_idot(xq_ptr + cols // 2, xs_ptr + cols // 16, xi, g, lo, hi, dl, ml, dh, mh, PTX)
                if M > 3:
                    acc3 += _k4_idot(xq_ptr + 3 * (cols // 4), xs_ptr + 3 * (cols // 32), xi, g, lo, hi,
                                     dl, ml, dh, mh, PTX)
            else:
                xo = b * 256 + 64 * p + 4 * w  # (1, SB, 4, 8)
                acc0 = _acc_k4_words(acc0, x_ptr, xo, q, fifth, p, dl, ml, dh, mh, FIVE)
                if M > 1:
                    acc1 = _acc_k4_words(acc1, x_ptr + cols, xo, q, fifth, p, dl, ml, dh, mh, FIVE)
                if M > 2:
                    acc2 = _acc_k4_words(acc2, x_ptr + 2 * cols, xo, q, fifth, p, dl, ml, dh, mh, FIVE)
                if M > 3:
                    acc3 = _acc_k4_words(acc3, x_ptr + 3 * cols, xo, q, fifth, p, dl, ml, dh, mh, FIVE)
        if SPLIT > 1:
            out_ptr += tl.program_id(1) * sstride
        _store_rows(out_ptr, tl.sum(tl.sum(acc0, 3), 2), tl.sum(tl.sum(acc1, 3), 2), tl.sum(tl.sum(acc2, 3), 2),
                    tl.sum(tl.sum(acc3, 3), 2), M, out_stride, col + rows, live)

    @triton.jit
    def _q6_k_gemv(x_ptr, out_ptr, grid_ptr, a0, a1, a2, n0, n1, n2, p0, p1, nb, cols, out_stride,
                   M: tl.constexpr, BLOCK_N: tl.constexpr, SB: tl.constexpr):
        """Q6_K (Q4_K_M files keep the head and some ffn_down / attn_v in it): 128 bytes of low nibbles, 64 of
        2-bit high parts, 16 int8 scales (one per 16 weights), fp16 d last. Weight 128h + 32j + i (half h,
        group j of 32, lane i): low 4 bits from byte 64h + 32 * (j % 2) + i (its low nibble for j < 2, high
        for j >= 2), high 2 bits from byte 128 + 32h + i at bit 2j, minus 32. Tile: [BLOCK_N rows, 32 lanes],
        a block's 8 groups unrolled, SB blocks per loop step."""
        row_base, col, rows, live = _tile(p0, p1, a0, a1, a2, n0, n1, n2, nb, 210, BLOCK_N)
        i = tl.arange(0, 32)[None, :]
        acc0, acc1, acc2, acc3 = _zeros4(BLOCK_N, 32)
        for k in range(0, nb, SB):
            for s in tl.static_range(SB):
                b = k + s
                base = row_base + b * 210
                d = _f16(base + 208)
                for h in tl.static_range(2):
                    even = tl.load(base + 64 * h + i).to(tl.int32)  # groups 0 (low nibbles) and 2 (high)
                    odd = tl.load(base + 64 * h + 32 + i).to(tl.int32)  # groups 1 and 3
                    hi2 = tl.load(base + 128 + 32 * h + i).to(tl.int32)
                    for j in tl.static_range(4):
                        if j % 2 == 0:
                            lo = even
                        else:
                            lo = odd
                        if j < 2:
                            lo = lo & 15
                        else:
                            lo = lo >> 4
                        q = ((lo | (((hi2 >> (2 * j)) & 3) << 4)) - 32).to(tl.float32)
                        sc = tl.load(base + 192 + 8 * h + 2 * j + i // 16).to(tl.int8, bitcast=True).to(tl.float32)
                        xo = b * 256 + 128 * h + 32 * j + i
                        acc0, acc1, acc2, acc3 = _acc1_rows(acc0, acc1, acc2, acc3, x_ptr, cols, xo, d * sc, q, M)
        _store_rows(out_ptr, acc0, acc1, acc2, acc3, M, out_stride, col + rows, live)

    @triton.jit
    def int8_groups_store(x, g, t, live, q_ptr, s_ptr, groups):
        """x (G, 32) float32, groups g (G, 1) of one row, lanes t (1, 32) -> that row's int8 q = round(x * 127 /
        amax) (half away from zero) and float32 scale amax / 127 per group (q = 0, scale 0 for an all-zero group);
        q's row is 4 planes of 8-byte words, word p of group g at plane p, word g (`quantize_x`). q_ptr, s_ptr:
        the row's. The decode step's norms and gated products call it too, so x's rounding costs no launch."""
        amax = tl.max(tl.abs(x), axis=1)
        inv = 127.0 / tl.where(amax > 0, amax, 1.0)  # an all-zero group: q = 0
        v = x * inv[:, None]
        q = (v + tl.where(v >= 0, 0.5, -0.5)).to(tl.int32)  # truncation toward zero of v +- 1/2
        tl.store(q_ptr + (t // 8) * (groups * 8) + g * 8 + t % 8, q.to(tl.int8), mask=live)
        tl.store(s_ptr + g, (amax / 127.0)[:, None], mask=g < groups)

    @triton.jit
    def _quantize_x_kernel(x_ptr, q_ptr, s_ptr, cols, groups, G: tl.constexpr):
        """x row program_id(1), groups of 32 from G * program_id(0) -> `int8_groups_store`."""
        m = tl.program_id(1)
        g = (tl.program_id(0) * G + tl.arange(0, G))[:, None]
        t = tl.arange(0, 32)[None, :]
        live = g < groups
        x = tl.load(x_ptr + m.to(tl.int64) * cols + g * 32 + t, mask=live, other=0.0).to(tl.float32)
        int8_groups_store(x, g, t, live, q_ptr + m.to(tl.int64) * cols, s_ptr + m.to(tl.int64) * groups, groups)

    @triton.jit
    def _dp4a(a, b, c, PTX: tl.constexpr):
        """c + the dot of a's and b's 4 signed bytes: one PTX dp4a on CUDA; shifts and multiplies (the same
        int32 result) under the interpreter, which cannot run inline assembly."""
        if PTX:
            return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                             dtype=tl.int32, is_pure=True, pack=1)
        else:
            s = c
            for i in tl.static_range(4):
                s += ((a << (24 - 8 * i)) >> 24) * ((b << (24 - 8 * i)) >> 24)  # sign-extended byte i
            return s

    @triton.jit
    def _bit8(v, pos: tl.constexpr):
        """Bit `pos` of v moved to bit 8 (value 0 or 256)."""
        if pos <= 8:
            return (v << (8 - pos)) & 256
        else:
            return (v >> (pos - 8)) & 256

    @triton.jit
    def _sign4(g, nib):
        """Packed bytes g with byte t negated (int8) where bit t of nib is set: (g ^ 0xFF) + 1 per byte,
        and no byte carries into the next as long as g's bytes are nonzero (the grid's are 1..15)."""
        lsb = (nib * 0x204081) & 0x01010101  # bit t of nib -> bit 0 of byte t
        return (g ^ (lsb * 255)) + lsb

    @triton.jit
    def _iq3_s_word(grid_ptr, idx, nib, TABLE: tl.constexpr):
        """One grid entry's 4 weights as packed int8 (weight t in byte t): idx its 9-bit grid index, nib
        its 4 sign bits."""
        if TABLE == 1:  # signs folded in: row idx << 4 | nib
            w = tl.load(grid_ptr + ((idx << 4) | nib))
        else:
            if TABLE == 2:  # 4 nibbles in a uint16 (a 1 KiB table, 8 cache lines): spread to bytes
                e = tl.load(grid_ptr + idx).to(tl.int32)
                e = (e | (e << 8)) & 0x00FF00FF
                g = (e | (e << 4)) & 0x0F0F0F0F
            else:
                g = tl.load(grid_ptr + idx)  # 4 unsigned bytes, each odd in 1..15
            w = _sign4(g, nib)
        return w

    @triton.jit
    def _iq3_s_words8(grid_ptr, g512, qs_p, sg_p, qh, TABLE: tl.constexpr, N: tl.constexpr):
        """A sub-block's 8 entries as packed signed int8 words: qs_p/sg_p its pointers to 4 halfwords of
        index bytes and 2 of sign bits, qh its 8 high index bits. TABLE 3: one tl.gather for all 8 from
        `g512`, the 512-word grid held as a tensor (Triton stages it in shared memory for the gather:
        no L1 line per lane), N the tile's elements times 8."""
        h0 = tl.load(qs_p).to(tl.int32)
        h1 = tl.load(qs_p + 1).to(tl.int32)
        h2 = tl.load(qs_p + 2).to(tl.int32)
        h3 = tl.load(qs_p + 3).to(tl.int32)
        sa = tl.load(sg_p).to(tl.int32)
        sb = tl.load(sg_p + 1).to(tl.int32)
        i0, i1 = (h0 & 255) | _bit8(qh, 0), (h0 >> 8) | _bit8(qh, 1)
        i2, i3 = (h1 & 255) | _bit8(qh, 2), (h1 >> 8) | _bit8(qh, 3)
        i4, i5 = (h2 & 255) | _bit8(qh, 4), (h2 >> 8) | _bit8(qh, 5)
        i6, i7 = (h3 & 255) | _bit8(qh, 6), (h3 >> 8) | _bit8(qh, 7)
        n0, n1, n2, n3 = sa & 15, (sa >> 4) & 15, (sa >> 8) & 15, sa >> 12
        n4, n5, n6, n7 = sb & 15, (sb >> 4) & 15, (sb >> 8) & 15, sb >> 12
        if TABLE == 3:
            idx = tl.join(tl.join(tl.join(i0, i1), tl.join(i2, i3)), tl.join(tl.join(i4, i5), tl.join(i6, i7)))
            g = tl.reshape(tl.gather(g512, tl.reshape(idx, (N,)), 0), idx.shape)  # [..., c, b, a]: entry 4a + 2b + c
            lo, hi = tl.split(g)
            g01, g23 = tl.split(lo)
            g45, g67 = tl.split(hi)
            g0, g1 = tl.split(g01)
            g2, g3 = tl.split(g23)
            g4, g5 = tl.split(g45)
            g6, g7 = tl.split(g67)
            return (_sign4(g0, n0), _sign4(g1, n1), _sign4(g2, n2), _sign4(g3, n3),
                    _sign4(g4, n4), _sign4(g5, n5), _sign4(g6, n6), _sign4(g7, n7))
        else:
            return (_iq3_s_word(grid_ptr, i0, n0, TABLE), _iq3_s_word(grid_ptr, i1, n1, TABLE),
                    _iq3_s_word(grid_ptr, i2, n2, TABLE), _iq3_s_word(grid_ptr, i3, n3, TABLE),
                    _iq3_s_word(grid_ptr, i4, n4, TABLE), _iq3_s_word(grid_ptr, i5, n5, TABLE),
                    _iq3_s_word(grid_ptr, i6, n6, TABLE), _iq3_s_word(grid_ptr, i7, n7, TABLE))

    @triton.jit
    def _dot8(xq, plane, w0, w1, w2, w3, w4, w5, w6, w7, PTX: tl.constexpr):
        """int32 dot of 8 packed words with a group's 32 int8 x: int64 words xq, xq + plane, ... (the
        planes of `quantize_x`, so that neighbouring lanes read neighbouring words)."""
        x = tl.load(xq)
        s = _dp4a(w1, (x >> 32).to(tl.int32), _dp4a(w0, x.to(tl.int32), 0, PTX), PTX)
        x = tl.load(xq + plane)
        s = _dp4a(w3, (x >> 32).to(tl.int32), _dp4a(w2, x.to(tl.int32), s, PTX), PTX)
        x = tl.load(xq + 2 * plane)
        s = _dp4a(w5, (x >> 32).to(tl.int32), _dp4a(w4, x.to(tl.int32), s, PTX), PTX)
        x = tl.load(xq + 3 * plane)
        return _dp4a(w7, (x >> 32).to(tl.int32), _dp4a(w6, x.to(tl.int32), s, PTX), PTX)

    @triton.jit
    def _iq3_s_dp4a(xq_ptr, xs_ptr, out_ptr, grid_ptr, a0, a1, a2, n0, n1, n2, p0, p1, nb, cols, out_stride,
                    M: tl.constexpr, BLOCK_N: tl.constexpr, SB: tl.constexpr, TABLE: tl.constexpr,
                    PTX: tl.constexpr):
        """IQ3_S with int8 x (`quantize_x`: xq_ptr its int64 words, xs_ptr its float32 scale per 32): an
        element of the [BLOCK_N rows, 8 * SB] tile is one sub-block of 32 weights (8 grid entries, unrolled)
        of one of SB blocks per loop step, so a warp's lanes read neighbouring sub-blocks of a row (few cache
        lines per load); its int32 dot with x is scaled by d * (1 + 2 * scale) * x's scale in float32.
        Blocks are read as uint16 (110-byte blocks are 2-byte aligned): halfword 0 d, 1..32 qs, 33..36 qh,
        37..52 signs, 53..54 scales."""
        ptr, n, col, rows, live = _rows(p0, p1, a0, a1, a2, n0, n1, n2, BLOCK_N)
        c = tl.arange(0, 8 * SB)[None, :]
        j = c % 8  # sub-block of block c // 8 of the step
        base = ptr + tl.minimum(rows, n - 1).to(tl.int64)[:, None] * (nb * 55) + (c // 8) * 55  # loads unmasked
        qs_p = base + 1 + 4 * j  # its 4 halfwords of grid index bytes
        sg_p = base + 37 + 2 * j  # its 2 halfwords of sign bits
        qh_p = base + 33 + j // 2  # its byte of high index bits, at bit qh_shift
        sc_p = base + 53 + j // 4  # its scale nibble, at bit sc_shift
        qh_shift = 8 * (j % 2)
        sc_shift = 4 * (j % 4)
        xo = c  # its x group within the step (word p in plane p)
        acc0, acc1, acc2, acc3 = _zeros4(BLOCK_N, 8 * SB)
        xrow = cols // 8  # int64 words per x row
        srow = cols // 32  # scales per x row
        if TABLE == 3:
            g512 = tl.load(grid_ptr + tl.arange(0, 512))
        else:
            g512 = 0
        for k in range(0, nb, SB):
            kb = k * 55
            d = tl.load(base + kb).to(tl.int16, bitcast=True).to(tl.float16, bitcast=True).to(tl.float32)
            qh = tl.load(qh_p + kb).to(tl.int32) >> qh_shift  # bit i: entry i's
            sc = (tl.load(sc_p + kb).to(tl.int32) >> sc_shift) & 15
            db = d * (1 + 2 * sc).to(tl.float32)
            xq = xq_ptr + k * 8 + xo
            w0, w1, w2, w3, w4, w5, w6, w7 = _iq3_s_words8(grid_ptr, g512, qs_p + kb, sg_p + kb, qh, TABLE,
                                                           BLOCK_N * SB * 64)
            s0 = _dot8(xq, srow, w0, w1, w2, w3, w4, w5, w6, w7, PTX)
            if M > 1:
                s1 = _dot8(xq + xrow, srow, w0, w1, w2, w3, w4, w5, w6, w7, PTX)
            if M > 2:
                s2 = _dot8(xq + 2 * xrow, srow, w0, w1, w2, w3, w4, w5, w6, w7, PTX)
            if M > 3:
                s3 = _dot8(xq + 3 * xrow, srow, w0, w1, w2, w3, w4, w5, w6, w7, PTX)
            xs = xs_ptr + k * 8 + c
            acc0 += s0.to(tl.float32) * (db * tl.load(xs))
            if M > 1:
                acc1 += s1.to(tl.float32) * (db * tl.load(xs + srow))
            if M > 2:
                acc2 += s2.to(tl.float32) * (db * tl.load(xs + 2 * srow))
            if M > 3:
                acc3 += s3.to(tl.float32) * (db * tl.load(xs + 3 * srow))
        _store_rows(out_ptr, acc0, acc1, acc2, acc3, M, out_stride, col + rows, live)

    @triton.jit
    def _w32(wp, word, ODD: tl.constexpr):
        """The little-endian int32 at byte 4 * word from int32 pointer wp, or (ODD) at byte 4 * word + 2: the
        high half of that word and the low half of the next (both aligned loads)."""
        if ODD:
            return ((tl.load(wp + word) >> 16) & 0xFFFF) | (tl.load(wp + word + 1) << 16)
        else:
            return tl.load(wp + word)

    @triton.jit
    def _q6_k_fdot(xr, xo, wl0, wl1, wl2, wl3, wh0, wh1, wh2, wh3):
        """(low-group dot, high-group dot): weights wl at x columns xo + c, wh at xo + 64 + c, x row pointer xr."""
        lo = (wl0 * tl.load(xr + xo).to(tl.float32) + wl1 * tl.load(xr + xo + 1).to(tl.float32)
              + wl2 * tl.load(xr + xo + 2).to(tl.float32) + wl3 * tl.load(xr + xo + 3).to(tl.float32))
        hi = (wh0 * tl.load(xr + xo + 64).to(tl.float32) + wh1 * tl.load(xr + xo + 65).to(tl.float32)
              + wh2 * tl.load(xr + xo + 66).to(tl.float32) + wh3 * tl.load(xr + xo + 67).to(tl.float32))
        return lo, hi

    @triton.jit
    def _q6_k_byte(ql, qh, c: tl.constexpr, nib: tl.constexpr, jo):
        """Byte c of the ql word's low (nib 0) or high (4) nibbles with its 2 high bits from the qh word (bit
        8c + 2j, j = jo + nib / 2,
        so bit 8c + 2jo + nib), minus 32, as float32 (exact: 2^23 + v as float bits, less 2^23 + 32)."""
        v = ((ql >> (8 * c + nib)) & 15) | (((qh >> (8 * c + 2 * jo + nib)) & 3) << 4)
        return (v | 0x4B000000).to(tl.float32, bitcast=True) - 8388640.0

    @triton.jit
    def _q6_k_idot(xw, xsr, xi, g, qlo, qhi, sc_lo, sc_hi, PTX: tl.constexpr):
        """One x row (int32 words xw, float32 scales xsr): x's scale times the int32 dot of 4 signed weights
        with x's 4 int8 values, times the weights' int8 scale, for the low group (g) and the high one (g + 2)."""
        il = _dp4a(qlo, tl.load(xw + xi), 0, PTX) * sc_lo
        ih = _dp4a(qhi, tl.load(xw + xi + 4), 0, PTX) * sc_hi
        return il.to(tl.float32) * tl.load(xsr + g) + ih.to(tl.float32) * tl.load(xsr + g + 2)

    @triton.jit
    def _k4_idot(xw, xsr, xi, g, lo, hi, dl, ml, dh, mh, PTX: tl.constexpr):
        """One x row (int32 words xw, float32 scales xsr) against a word's 4 low-sub-block weights `lo` (x group
        g) and 4 high ones `hi` (group g + 1), each sub-block's d * scale and dmin * min applied:
        x_s * (dl * (lo . xq) - ml * sum(xq)), and the same for hi."""
        xl = tl.load(xw + xi)
        xh = tl.load(xw + xi + 2)
        il = _dp4a(lo, xl, 0, PTX).to(tl.float32)
        ih = _dp4a(hi, xh, 0, PTX).to(tl.float32)
        ones = tl.full(xl.shape, 0x01010101, tl.int32)
        sl = _dp4a(xl, ones, 0, PTX).to(tl.float32)
        sh = _dp4a(xh, ones, 0, PTX).to(tl.float32)
        return tl.load(xsr + g) * (dl * il - ml * sl) + tl.load(xsr + g + 1) * (dh * ih - mh * sh)

    @triton.jit
    def _w32r(wp, word, odd):
        """_w32 with a run-time ODD (a tensor): a block whose parity varies by row."""
        lo = tl.load(wp + word)
        hi = tl.load(wp + word + 1)
        return tl.where(odd, ((lo >> 16) & 0xFFFF) | (hi << 16), lo)

    @triton.jit
    def _q6_k_block(acc0, acc1, acc2, acc3, ql, qh, sc_lo, sc_hi, d, b, t, x_ptr, xq_ptr, xs_ptr, cols,
                    M: tl.constexpr, DP4A: tl.constexpr, PTX: tl.constexpr):
        """One block's products added to the M accumulators: its lane words (ql, qh, the two scales, d) at
        block column index b (1, SB, 1) of x."""
        h = t // 16
        jo = (t // 8) % 2
        u = t % 8
        if DP4A:
            xrow = cols // 4  # int32 words of int8 x per row
            srow = cols // 32
            qlo = ((ql & 0x0F0F0F0F) | (((qh >> (2 * jo)) & 0x03030303) << 4)) ^ 0x20202020
            qhi = (((ql >> 4) & 0x0F0F0F0F) | (((qh >> (2 * jo + 4)) & 0x03030303) << 4)) ^ 0x20202020
            # 6-bit v ^ 32 is v - 32 in 6 bits: copy its sign (bit 5) to bits 6 and 7 of each byte
            qlo = qlo | ((qlo & 0x20202020) * 6)
            qhi = qhi | ((qhi & 0x20202020) * 6)
            g = b * 8 + 4 * h + jo  # x's group of the low weights (the high ones: g + 2)
            xi = (u // 2) * (cols // 16) + 2 * g + u % 2  # their int32 word in quantize_x's planes
            acc0 += d * _q6_k_idot(xq_ptr, xs_ptr, xi, g, qlo, qhi, sc_lo, sc_hi, PTX)
            if M > 1:
                acc1 += d * _q6_k_idot(xq_ptr + xrow, xs_ptr + srow, xi, g, qlo, qhi, sc_lo, sc_hi, PTX)
            if M > 2:
                acc2 += d * _q6_k_idot(xq_ptr + 2 * xrow, xs_ptr + 2 * srow, xi, g, qlo, qhi, sc_lo, sc_hi, PTX)
            if M > 3:
                acc3 += d * _q6_k_idot(xq_ptr + 3 * xrow, xs_ptr + 3 * srow, xi, g, qlo, qhi, sc_lo, sc_hi, PTX)
        else:
            wl0, wl1 = _q6_k_byte(ql, qh, 0, 0, jo), _q6_k_byte(ql, qh, 1, 0, jo)
            wl2, wl3 = _q6_k_byte(ql, qh, 2, 0, jo), _q6_k_byte(ql, qh, 3, 0, jo)
            wh0, wh1 = _q6_k_byte(ql, qh, 0, 4, jo), _q6_k_byte(ql, qh, 1, 4, jo)
            wh2, wh3 = _q6_k_byte(ql, qh, 2, 4, jo), _q6_k_byte(ql, qh, 3, 4, jo)
            dl, dh = d * sc_lo.to(tl.float32), d * sc_hi.to(tl.float32)
            xo = b * 256 + 128 * h + 32 * jo + 4 * u
            lo, hi = _q6_k_fdot(x_ptr, xo, wl0, wl1, wl2, wl3, wh0, wh1, wh2, wh3)
            acc0 += dl * lo + dh * hi
            if M > 1:
                lo, hi = _q6_k_fdot(x_ptr + cols, xo, wl0, wl1, wl2, wl3, wh0, wh1, wh2, wh3)
                acc1 += dl * lo + dh * hi
            if M > 2:
                lo, hi = _q6_k_fdot(x_ptr + 2 * cols, xo, wl0, wl1, wl2, wl3, wh0, wh1, wh2, wh3)
                acc2 += dl * lo + dh * hi
            if M > 3:
                lo, hi = _q6_k_fdot(x_ptr + 3 * cols, xo, wl0, wl1, wl2, wl3, wh0, wh1, wh2, wh3)
                acc3 += dl * lo + dh * hi
        return acc0, acc1, acc2, acc3

    @triton.jit
    def _q6_k_words(x_ptr, xq_ptr, xs_ptr, out_ptr, a0, a1, a2, n0, n1, n2, p0, p1, nb, cols, out_stride,
                    ids_ptr, estride, xstep, sstride,
                    M: tl.constexpr, BLOCK_N: tl.constexpr, SB: tl.constexpr, DP4A: tl.constexpr,
                    PTX: tl.constexpr, EXPERTS: tl.constexpr, PAIRS: tl.constexpr = True, SPLIT: tl.constexpr = 1):
        """Q6_K (the layout of _q6_k_gemv) read in int32 words. PAIRS (an even block count a row): two blocks
        (420 bytes, 105 words) at a time, the even block's words aligned, the odd one's 2 bytes into a word (each
        of its words from two aligned loads); tile [BLOCK_N rows, SB block pairs, 32 lanes]. Else (an odd count,
        e.g. 768 or 5,376 columns: 3 or 21 blocks) one block at a time, its parity read per row (a row starts 2
        bytes into a word every other row); tile [BLOCK_N rows, SB blocks, 32 lanes], the blocks past the row's
        end read its last one and weighed 0. Lane t takes ql word t (bytes 4t..4t+3: half h = t // 16, group
        jo = t // 8 % 2 in its low nibbles and jo + 2 in its high ones, lane u = t % 8, weights 128h + 32j + 4u +
        c), the qh word 8h + u (2 bits per weight at 2j), the scale bytes 8h + 2j + u // 4 and d. DP4A: int8 x
        (`quantize_x`: xq_ptr, xs_ptr) and a dp4a per 4 weights (the weights made signed bytes), else float x
        (x_ptr) and float32 products. Needs 4-byte aligned matrices of an even block count (the caller checks).
        EXPERTS, SPLIT: as _k45_words_gemv's."""
        pid = tl.program_id(0)
        if EXPERTS:
            pid, a0, x_ptr, xq_ptr, xs_ptr, out_ptr = _expert(ids_ptr, estride, xstep, p0, a0, n0, x_ptr, xq_ptr,
                                                              xs_ptr, out_ptr)
        ptr, n, col, rows, live = _rows_at(pid, p0, p1, a0, a1, a2, n0, n1, n2, BLOCK_N)
        row = tl.minimum(rows, n - 1).to(tl.int64)[:, None, None]
        wp = ptr.to(tl.pointer_type(tl.int32))
        kp = tl.arange(0, SB)[None, :, None]
        t = tl.arange(0, 32)[None, None, :]
        h = t // 16
        jo = (t // 8) % 2
        u = t % 8
        sh = 24 - 8 * (2 * jo + u // 4)  # the scale's byte moved to the top (then >> 24, sign-extended)
        acc0 = tl.zeros((BLOCK_N, SB, 32), tl.float32)
        acc1 = tl.zeros((BLOCK_N, SB, 32), tl.float32)
        acc2 = tl.zeros((BLOCK_N, SB, 32), tl.float32)
        acc3 = tl.zeros((BLOCK_N, SB, 32), tl.float32)
        if PAIRS:
            wrow = wp + row * (nb // 2 * 105)
            k0, k1 = _split_range(nb // 2, SB, SPLIT)
            for k in range(k0, k1, SB):
                pw = wrow + (k + kp) * 105  # (BLOCK_N, SB, 1): the pair's first word
                for e in tl.static_range(2):
                    bw = pw + 52 * e
                    ql = _w32(bw, t, e)
                    qh = _w32(bw, 32 + 8 * h + u, e)
                    sc_lo = (_w32(bw, 48 + 2 * h, e) << sh) >> 24  # scale of group jo (low nibbles)
                    sc_hi = (_w32(bw, 49 + 2 * h, e) << sh) >> 24  # of group jo + 2
                    d = ((tl.load(pw + 52 + 52 * e) >> (16 * e)) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
                    acc0, acc1, acc2, acc3 = _q6_k_block(acc0, acc1, acc2, acc3, ql, qh, sc_lo, sc_hi,
                                                         d.to(tl.float32), 2 * (k + kp) + e, t, x_ptr, xq_ptr,
                                                         xs_ptr, cols, M, DP4A, PTX)
        else:
            k0, k1 = _split_range(tl.cdiv(nb, SB) * SB, SB, SPLIT)
            for k in range(k0, k1, SB):
                b = tl.minimum(k + kp, nb - 1)  # (1, SB, 1); past the end: the last block again, weighed 0
                gb = row * nb + b                # the block's index from the matrix's start
                bw = wp + gb * 52 + gb // 2      # byte 210 gb = word 52 gb + gb // 2, plus 2 when gb is odd
                odd = (gb % 2) == 1
                ql = _w32r(bw, t, odd)
                qh = _w32r(bw, 32 + 8 * h + u, odd)
                sc_lo = (_w32r(bw, 48 + 2 * h, odd) << sh) >> 24
                sc_hi = (_w32r(bw, 49 + 2 * h, odd) << sh) >> 24
                d = ((tl.load(bw + 52) >> (16 * odd.to(tl.int32))) & 0xFFFF).to(tl.int16).to(tl.float16,
                                                                                           bitcast=True)
                d = tl.where(k + kp < nb, d.to(tl.float32), 0.0)
                acc0, acc1, acc2, acc3 = _q6_k_block(acc0, acc1, acc2, acc3, ql, qh, sc_lo, sc_hi, d, b, t,
                                                     x_ptr, xq_ptr, xs_ptr, cols, M, DP4A, PTX)
        if SPLIT > 1:
            out_ptr += tl.program_id(1) * sstride
        _store_rows(out_ptr, tl.sum(acc0, 2), tl.sum(acc1, 2), tl.sum(acc2, 2), tl.sum(acc3, 2), M, out_stride,
                    col + rows, live)

    @triton.jit
    def _split_range(n, SB: tl.constexpr, SPLIT: tl.constexpr):
        """The loop steps [k0, k1) of split program_id(1) over n (a multiple of SB): whole steps of SB each."""
        if SPLIT == 1:
            return n * 0, n  # (a tensor: the helper's two returns must be of one kind)
        else:
            per = tl.cdiv(n, SPLIT * SB) * SB
            k0 = tl.program_id(1) * per
            return k0, tl.minimum(k0 + per, n)

    @triton.jit
    def _sum_splits(part_ptr, out_ptr, n, part_stride, out_stride, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
        """out row program_id(0) = the sum of its SPLIT float32 partial rows (part_stride apart), split 0 first."""
        m = tl.program_id(0)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        live = c < n
        acc = tl.load(part_ptr + m * n + c, mask=live, other=0.0)
        for s in tl.static_range(1, SPLIT):
            acc += tl.load(part_ptr + s * part_stride + m * n + c, mask=live, other=0.0)
        tl.store(out_ptr + m * out_stride + c, acc.to(out_ptr.dtype.element_ty), mask=live)

    # type -> (kernel, the constexprs that pick the type within its family)
    _KERNELS = {"IQ3_S": (_iq3_s_gemv, {}), "Q8_0": (_q8_0_gemv, {}), "Q6_K": (_q6_k_gemv, {}),
                "Q4_K": (_k45_words_gemv, {"FIVE": False}), "Q5_K": (_k45_words_gemv, {"FIVE": True}),
                **{q: (_legacy_gemv, flags) for q, flags in LEGACY_FLAGS.items()}}


_IQ3S_WORDS: dict[tuple[torch.device, int], torch.Tensor] = {}


def iq3_s_words(device, table: int = 0) -> torch.Tensor:
    """The IQ3_S grid for the dp4a kernel (its TABLE): 0, (512,) int32 words of 4 bytes (value t in byte t);
    1, (512 * 16,) int32 rows `entry << 4 | sign nibble`, value t negated (int8) where bit t is set;
    2, (512,) uint16 of 4 nibbles (value t in bits 4t..4t+3). Per device, made by the first call (outside
    any graph capture)."""
    device = torch.device(device)
    key = (device, table)
    if key not in _IQ3S_WORDS:
        from strata.quant.iq import _tables
        g = _tables(device)["IQ3_S_grid"].to(torch.int32)  # (512, 4), odd values 1..15
        if table == 2:
            words = (g << torch.arange(0, 16, 4, device=device, dtype=torch.int32)).sum(dim=1, dtype=torch.int32)
            t = words.view(torch.int16).reshape(-1, 2)[:, 0].contiguous().view(torch.uint16)  # little-endian low half
        else:
            if table == 1:
                bits = (torch.arange(16, device=device)[:, None] >> torch.arange(4, device=device)) & 1
                g = (g[:, None, :] * (1 - 2 * bits)[None]).reshape(-1, 4)
            t = g.to(torch.int8).contiguous().view(torch.int32).reshape(-1)  # little-endian: value t in byte t
        _IQ3S_WORDS[key] = t
    return _IQ3S_WORDS[key]


def quantize_x(x: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, cols) float -> (q int8 (M, cols), s float32 (M, cols / 32)): per group of 32 values
    s = amax / 127 and q = round(x / s) (half away from zero), so x ~ q * s within s / 2. One launch.
    q's rows are interleaved for the kernel: (4, groups, 8) bytes, byte 8p + b of group g at [p, g, b]
    (`int8_x` undoes it)."""
    if x.dim() != 2 or x.shape[1] % XQ_GROUP:
        raise ValueError(f"quantize_x takes (M, cols) with cols a multiple of {XQ_GROUP}, got {tuple(x.shape)}")
    m, cols = x.shape
    groups = cols // XQ_GROUP
    if out is None:
        out = (torch.empty((m, cols), dtype=torch.int8, device=x.device),
               torch.empty((m, groups), dtype=torch.float32, device=x.device))
    q, s = out
    x = x.contiguous()
    g = 32  # groups per program
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        _quantize_x_kernel[(triton.cdiv(groups, g), m)](x, q, s, cols, groups, G=g)
    return q, s


def int8_x(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """`quantize_x`'s (q, s) back to x's order and float64: (M, cols) of q * s."""
    m, cols = q.shape
    g = cols // XQ_GROUP
    q = q.reshape(m, 4, g, 8).permute(0, 2, 1, 3).reshape(m, g, XQ_GROUP)
    return (q.double() * s.double()[:, :, None]).reshape(m, cols)


def _grid(name: str, device: torch.device) -> torch.Tensor:
    if name == "IQ3_S":
        from strata.quant.iq import _tables
        return _tables(device)["IQ3_S_bf16"]
    return _dummy(device)


_DUMMIES: dict[torch.device, torch.Tensor] = {}


def _dummy(device: torch.device) -> torch.Tensor:
    """A table pointer for kernels that have none (made once per device, outside any graph capture)."""
    if device not in _DUMMIES:
        _DUMMIES[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return _DUMMIES[device]


def _launch(x: torch.Tensor, mats: list[torch.Tensor], name: str, cols: int, out: torch.Tensor, col0: int,
            config: Config | None, kernels: GemvKernels, xq: tuple[torch.Tensor, torch.Tensor] | None = None,
            table: int = 0) -> None:
    """out[:, col0 : col0 + sum(rows)] = x @ concat(mats).T for up to MAX_PARTS same-type matrices
    (IQ3_S with xq, x's `quantize_x`: the dp4a kernel, `table` its grid table, iq3_s_words; the K-quants: the
    kernel `kernels` names)."""
    rows = [m.shape[0] for m in mats] + [0] * (MAX_PARTS - len(mats))
    big = sum(rows) >= BIG_ROWS
    nb = cols // block_size(name)
    aligned = not any(m.data_ptr() % 4 for m in mats)
    q6k, kquant = kernels.q6k, kernels.kquant
    if name == "Q6_K" and q6k != "bytes" and aligned and not any(m.shape[0] * nb % 2 for m in mats):
        cfg = config or Q6K_WORDS_CONFIGS[q6k][big]
        return _launch_words(_q6_k_words, x, mats, rows, nb, cols, out, col0, cfg, _q6_k_sb(nb, cfg, 1),
                             q6k == "dp4a", xq, PAIRS=nb % 2 == 0)
    if name in ("Q4_K", "Q5_K"):
        if kquant != "bytes" and aligned:
            cfg = config or (KQ_BIG if big else KQ_WORDS)
            sb, tail = _k45_sb(nb, cfg)
            return _launch_words(_k45_words_gemv, x, mats, rows, nb, cols, out, col0, cfg, sb, kquant == "dp4a", xq,
                                 TAIL=tail, **_KERNELS[name][1])
    if name == "Q8_0" and xq is not None and not big and not any(m.data_ptr() % 2 for m in mats):  # int16 loads
        cfg = config or Q8_0_DP4A
        sb = min(cfg.sb, triton.next_power_of_2(nb))
        progs = [triton.cdiv(r, cfg.block_n) for r in rows]
        ptrs = mats + [mats[0]] * (MAX_PARTS - len(mats))
        q, s = xq
        dst = out[:, col0:]
        with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
            for r0 in range(0, x.shape[0], MAX_M):
                _q8_0_dp4a[(sum(progs),)](q[r0:].view(torch.int32), s[r0:], dst[r0:], *ptrs, *rows, progs[0],
                                         progs[0] + progs[1], nb, cols, out.stride(0),
                                         M=min(MAX_M, x.shape[0] - r0), BLOCK_N=cfg.block_n, SB=sb,
                                         PTX=not INTERPRET, TAIL=nb % sb != 0, num_warps=cfg.num_warps)
        return
    cfg = config or (BIG_CONFIGS.get(name) if big else None) or CONFIGS[name]
    if xq is not None and name == "IQ3_S":  # the dp4a IQ3_S kernel: blocks as int16, x as int8 in int64 words
        cfg = config or DP4A_CONFIG
        ptrs = [m.view(torch.uint16) for m in mats]
        ptrs += [ptrs[0]] * (MAX_PARTS - len(mats))
        sb = next(k for k in (16, 8, 4, 2, 1) if k <= cfg.sb and nb % k == 0)  # a power of two: 8 * sb wide tiles
        bn = max(cfg.block_n, 32 * cfg.num_warps // (8 * sb))  # at least an element per thread
        progs = [triton.cdiv(r, bn) for r in rows]
        q, s = xq
        dst = out[:, col0:]
        with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
            for r0 in range(0, x.shape[0], MAX_M):
                mr = min(MAX_M, x.shape[0] - r0)
                _iq3_s_dp4a[(sum(progs),)](q[r0:].view(torch.int64), s[r0:], dst[r0:], iq3_s_words(x.device, table % 3),
                                           *ptrs, *rows, progs[0], progs[0] + progs[1], nb, cols, out.stride(0),
                                           M=mr, BLOCK_N=bn, SB=sb, TABLE=table, PTX=not INTERPRET,
                                           num_warps=cfg.num_warps)
        return
    ptrs = mats + [mats[0]] * (MAX_PARTS - len(mats))
    progs = [triton.cdiv(r, cfg.block_n) for r in rows]
    sb = next(k for k in range(cfg.sb, 0, -1) if nb % k == 0)  # whole steps: the kernels mask no load
    dst = out[:, col0:]
    kernel, family = _KERNELS[name]
    if name in ("Q4_K", "Q5_K"):
        kernel = _k45_gemv  # the byte-wise loads: the A/B arm, or blocks not 4-byte aligned
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        for r0 in range(0, x.shape[0], MAX_M):  # the weights are read once per MAX_M rows of x
            xs = x[r0:r0 + MAX_M]
            kernel[(sum(progs),)](xs, dst[r0:], _grid(name, x.device), *ptrs, *rows, progs[0], progs[0] + progs[1],
                                  nb, cols, out.stride(0), M=xs.shape[0], BLOCK_N=cfg.block_n, SB=sb,
                                  num_warps=cfg.num_warps, **family)


def _k45_sb(nb: int, cfg: Config) -> tuple[int, bool]:
    """_k45_words_gemv's (SB, TAIL): the largest power of two <= cfg.sb dividing the row's blocks (a tile dim),
    or, where only 1 divides (an odd count), cfg.sb's blocks a step with the tail weighed 0: one block a step
    left 5,376-column rows (21 blocks) with a quarter of the loads in flight (Gemma-3-27B's q/k/v/gate/up)."""
    sb = next(k for k in (16, 8, 4, 2, 1) if k <= cfg.sb and nb % k == 0)
    if sb == 1 and cfg.sb > 1:
        return min(cfg.sb, triton.next_power_of_2(nb)), True
    return sb, False


def _q6_k_sb(nb: int, cfg: Config, odd_per_pair: int = 2) -> int:
    """_q6_k_words' SB: block pairs a step dividing the row's (an even count), else single blocks a step
    (odd_per_pair for each of cfg's pairs, at most the row's rounded up to a power of two: the tail's loads are
    weighed 0). Dense launches take 1: Gemma-3-27B's head (262,208 x 5,376, 21 blocks) 929 -> 574 us with 2 blocks
    a step instead of 4 (bench/gemv.py --sweep, H200); the experts' shapes keep 2 (bench/experts_sweep.py)."""
    if nb % 2 == 0:
        return next(k for k in (8, 4, 2, 1) if k <= cfg.sb and (nb // 2) % k == 0)
    return min(odd_per_pair * cfg.sb, triton.next_power_of_2(nb))


def _launch_words(kernel, x, mats, rows, nb, cols, out, col0, cfg: Config, sb: int, dp4a: bool, xq, **family) -> None:
    """A K-quant word kernel (_q6_k_words, _k45_words_gemv), once per MAX_M rows of x: with dp4a on x's int8
    rounding (xq, `quantize_x`'s, made here if None), else on float x."""
    if dp4a and xq is None:
        xq = quantize_x(x)
    ptrs = mats + [mats[0]] * (MAX_PARTS - len(mats))
    progs = [triton.cdiv(r, cfg.block_n) for r in rows]
    dst = out[:, col0:]
    total = sum(rows)
    steps = triton.cdiv(nb // 2 if family.get("PAIRS") else nb, sb)  # a row's loop steps
    split = min(cfg.split, steps // MIN_SPLIT_STEPS) if cfg.split > 1 else 1
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        for r0 in range(0, x.shape[0], MAX_M):
            xs = x[r0:r0 + MAX_M]
            m = xs.shape[0]
            xqp, xsp = (xq[0][r0:].view(torch.int32), xq[1][r0:]) if dp4a else (_dummy(x.device), x)
            if split > 1:  # float32 partial rows (split, m, total), then their fixed-order sum into dst
                part = torch.empty((split, m, total), dtype=torch.float32, device=x.device)
                kernel[(sum(progs), split)](xs, xqp, xsp, part, *ptrs, *rows, progs[0], progs[0] + progs[1], nb,
                                            cols, total, xqp, 0, 0, m * total, M=m, BLOCK_N=cfg.block_n, SB=sb,
                                            DP4A=dp4a, PTX=not INTERPRET, num_warps=cfg.num_warps, EXPERTS=False,
                                            SPLIT=split, **family)
                _sum_splits[(m, triton.cdiv(total, SUM_COLS))](part, dst[r0:], total, m * total, out.stride(0),
                                                               SPLIT=split, BLOCK=SUM_COLS)
                continue
            kernel[(sum(progs),)](xs, xqp, xsp, dst[r0:], *ptrs, *rows, progs[0], progs[0] + progs[1], nb, cols,
                                  out.stride(0), xqp, 0, 0, 0, M=m, BLOCK_N=cfg.block_n, SB=sb, DP4A=dp4a,
                                  PTX=not INTERPRET, num_warps=cfg.num_warps, EXPERTS=False, **family)


def wants_int8_x(qtypes, kernels: GemvKernels | None = None) -> bool:
    """Whether quant_matmul_parts rounds x to int8 (`quantize_x`) for parts of these types: a caller that has
    the rounding already (a decode norm wrote it) passes it as xq and saves the launch."""
    names = [qtype_of(q).name for q in qtypes]
    kernels = GemvKernels() if kernels is None else kernels
    return ((kernels.iq3s != "float" and "IQ3_S" in names) or (kernels.q6k == "dp4a" and "Q6_K" in names)
            or (kernels.kquant == "dp4a" and ("Q4_K" in names or "Q5_K" in names))
            or (kernels.q8_0 == "dp4a" and "Q8_0" in names))


def quant_matmul_parts(x: torch.Tensor, parts: list[tuple[torch.Tensor, str]], cols: int,
                       out: torch.Tensor | None = None, config: Config | None = None,
                       kernels: GemvKernels | None = None,
                       xq: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x (M, cols) times each matrix (blocks, qtype) of `parts`, side by side: (M, sum of their rows).

    Consecutive parts of one type share a launch (up to MAX_PARTS). `out`: a contiguous (M, total rows)
    tensor to write into (any float dtype, e.g. float32 logits); default a new one in x's dtype. `kernels`: the
    holder's choices, where a failed dp4a kernel's fallback is kept (None: the defaults, for this call only).
    xq: x's `quantize_x` rounding when the caller has it (the dp4a kernels read it instead of making it)."""
    names, out = checked_parts(x, parts, cols, out)
    x = x.contiguous()
    kernels = GemvKernels() if kernels is None else kernels
    mode = kernels.iq3s
    if not wants_int8_x([q for _, q in parts], kernels):
        xq = None
    elif xq is None:  # x as int8 for the dp4a kernels, once for all the parts
        xq = quantize_x(x)
    else:
        check_xq(x, xq, cols)
    col = 0
    for i, j in type_runs(names):
        mats = [b for b, _ in parts[i:j]]
        if names[i] == "IQ3_S" and xq is not None:
            try:
                _launch(x, mats, names[i], cols, out, col, config, kernels, xq, table=_IQ3S_TABLE[mode])
            except Exception as e:  # e.g. a Triton that cannot build the inline PTX: the float kernel still works
                if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                    raise
                log.warning("IQ3_S %s kernel failed (%s: %s); using the float kernel", mode, type(e).__name__, e)
                kernels.iq3s = "float"
                _launch(x, mats, names[i], cols, out, col, config, kernels)
        elif names[i] in ("Q6_K", "Q4_K", "Q5_K", "Q8_0"):
            _launch_k(x, mats, names[i], cols, out, col, config, xq, kernels)
        else:
            _launch(x, mats, names[i], cols, out, col, config, kernels)
        col += sum(m.shape[0] for m in mats)
    return out


def checked_parts(x: torch.Tensor, parts: list[tuple[torch.Tensor, str]], cols: int,
                  out: torch.Tensor | None = None) -> tuple[list[str], torch.Tensor]:
    """quant_matmul_parts' (and strata.quant.rows') checks of x, the parts' blocks and out -> (each part's type
    name, out: the given one, or a new (M, total rows) in x's dtype)."""
    if triton is None:
        raise RuntimeError("strata.quant.gemv needs triton")
    if x.dim() != 2 or x.shape[1] != cols:
        raise ValueError(f"x must be (M, {cols}), got {tuple(x.shape)}")
    names = [qtype_of(q).name for _, q in parts]
    for name in names:
        if name not in CONFIGS:
            raise ValueError(f"no fused matrix-vector kernel for {name} (have: {', '.join(CONFIGS)})")
        if cols % block_size(name):
            raise ValueError(f"{name}: {cols} columns is not a multiple of its block of {block_size(name)}")
    for (m, _), name in zip(parts, names):
        bs, ts = block_size(name), type_size(name)
        if m.dtype != torch.uint8 or m.dim() != 2 or m.shape[1] != cols // bs * ts or not m.is_contiguous():
            raise ValueError(f"{name}: blocks must be contiguous uint8 (rows, {cols // bs * ts}), got {m.dtype} {tuple(m.shape)}")
    total = sum(b.shape[0] for b, _ in parts)
    if out is None:
        out = torch.empty((x.shape[0], total), device=x.device, dtype=x.dtype)
    elif tuple(out.shape) != (x.shape[0], total) or out.stride(1) != 1:
        raise ValueError(f"out must be a row-major ({x.shape[0]}, {total}), got {tuple(out.shape)}")
    return names, out


def check_xq(x: torch.Tensor, xq: tuple[torch.Tensor, torch.Tensor], cols: int) -> None:
    """xq must be quantize_x's rounding of x (M, cols)."""
    if tuple(xq[0].shape) != tuple(x.shape) or tuple(xq[1].shape) != (x.shape[0], cols // XQ_GROUP):
        raise ValueError(f"xq must be quantize_x's of x {tuple(x.shape)}, got {tuple(xq[0].shape)}, "
                         f"{tuple(xq[1].shape)}")


def type_runs(names: list[str]) -> list[tuple[int, int]]:
    """The parts [i, j) that share a launch: consecutive parts of one type, at most MAX_PARTS."""
    runs, i = [], 0
    while i < len(names):
        j = i + 1
        while j < len(names) and j - i < MAX_PARTS and names[j] == names[i]:
            j += 1
        runs.append((i, j))
        i = j
    return runs


def _launch_k(x, mats, name, cols, out, col, config, xq, kernels: GemvKernels) -> None:
    """A K-quant or Q8_0 launch; where its dp4a kernel fails (e.g. a Triton that cannot build the inline PTX), the
    word kernel on float x (Q8_0: the byte kernel) from then on for this `kernels` holder, as IQ3_S falls back to
    its float kernel."""
    if {"Q6_K": kernels.q6k, "Q8_0": kernels.q8_0}.get(name, kernels.kquant) != "dp4a":
        return _launch(x, mats, name, cols, out, col, config, kernels)
    try:
        _launch(x, mats, name, cols, out, col, config, kernels, xq)
    except Exception as e:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise
        log.warning("%s dp4a kernel failed (%s: %s); using the %s kernel on float x", name, type(e).__name__, e,
                    "byte" if name == "Q8_0" else "word")
        if name == "Q6_K":
            kernels.q6k = "words"
        elif name == "Q8_0":
            kernels.q8_0 = "bytes"
        else:
            kernels.kquant = "words"
        _launch(x, mats, name, cols, out, col, config, kernels)


def quant_matmul(x: torch.Tensor, blocks: torch.Tensor, qtype, cols: int, out: torch.Tensor | None = None,
                 config: Config | None = None, kernels: GemvKernels | None = None,
                 xq: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x (M, cols) @ W.T -> (M, rows) for W's GGUF `blocks` uint8 (rows, bytes per row); float32 accumulation."""
    return quant_matmul_parts(x, [(blocks, qtype)], cols, out, config, kernels, xq)


# -- experts: the chosen matrices of a stack, read in place -------------------------------------------------------
def experts_ok(qtype, cols: int, rows: int = 2) -> bool:
    """Whether quant_matmul_experts takes a stack of this type and matrix shape: the K-quant word kernels' (whose
    experts start on 4-byte words: Q6_K's 210-byte blocks need an even count a matrix) or MXFP4's."""
    try:
        name = qtype_of(qtype).name
    except ValueError:
        return False
    if name == "MXFP4":
        return triton is not None and cols % 32 == 0
    nb = cols // block_size(name) if name in CONFIGS else 0
    return triton is not None and name in ("Q4_K", "Q5_K", "Q6_K") and nb > 0 and cols % block_size(name) == 0 \
        and rows * nb * type_size(name) % 4 == 0


def experts_int8(qtype, kernels: GemvKernels | None = None, split: bool = False) -> bool:
    """Whether quant_matmul_experts reads x rounded to int8 for this stack (a dp4a kernel: then the caller may
    pass the rounding as xq, made by the launch before it)."""
    name = qtype_of(qtype).name
    kernels = GemvKernels() if kernels is None else kernels
    if name == "MXFP4":
        return split and kernels.mxfp4 == "dp4a"
    return (kernels.q6k if name == "Q6_K" else kernels.kquant) == "dp4a"


def quant_matmul_experts(x: torch.Tensor, stack: torch.Tensor, ids: torch.Tensor, qtype, cols: int,
                         kernels: GemvKernels | None = None, xq: tuple[torch.Tensor, torch.Tensor] | None = None,
                         split: bool = False) -> torch.Tensor:
    """Slot j: expert ids[j]'s matrix of the stack (E, rows, bytes a row) times x's row j, or x's one row for
    every slot (x (1, cols): gate/up of a token's experts) -> (n, rows), n = ids' length, in x's dtype. One
    launch; the ids are read on the device, so it captures in a CUDA graph and reads only the chosen experts.
    `kernels`: dp4a (int8 x) where its K-quant says so, else the word kernel on float x (None: the defaults).
    xq: x's `quantize_x` rounding where the caller has it (a dp4a kernel reads it instead of making it; see
    `experts_int8`). MXFP4 only: split, the stack is in strata.quant.mxfp4's split layout (the dp4a kernel reads
    only that one)."""
    name = qtype_of(qtype).name
    if name == "MXFP4":
        return mxfp4_experts(x, stack, ids, cols, kernels, xq, split)
    E, rows, rb = stack.shape
    if not experts_ok(name, cols, rows):
        raise ValueError(f"no experts kernel for {name} at {rows} x {cols}")
    n = ids.numel()
    bs, ts = block_size(name), type_size(name)
    if stack.dtype != torch.uint8 or rb != cols // bs * ts or not stack.is_contiguous() or stack.data_ptr() % 4:
        raise ValueError(f"{name}: a contiguous, 4-byte aligned uint8 (E, rows, {cols // bs * ts}) stack, got "
                         f"{stack.dtype} {tuple(stack.shape)}")
    if x.dim() != 2 or x.shape[1] != cols or x.shape[0] not in (1, n):
        raise ValueError(f"x must be (1 or {n}, {cols}), got {tuple(x.shape)}")
    x = x.contiguous()
    nb = cols // bs
    kernels = GemvKernels() if kernels is None else kernels
    if name == "Q6_K":
        kernel, family, dp4a = _q6_k_words, {"PAIRS": nb % 2 == 0}, kernels.q6k == "dp4a"
        cfg = EXPERTS_CONFIGS[name]
        sb = _q6_k_sb(nb, cfg)
    else:
        kernel, family, dp4a = _k45_words_gemv, _KERNELS[name][1], kernels.kquant == "dp4a"
        cfg = EXPERTS_CONFIGS[name]
        sb, tail = _k45_sb(nb, cfg)
        family = {**family, "TAIL": tail}
    out = torch.empty((n, rows), device=x.device, dtype=x.dtype)
    per = triton.cdiv(rows, cfg.block_n)
    if dp4a:
        if xq is not None and (tuple(xq[0].shape) != tuple(x.shape) or tuple(xq[1].shape) != (x.shape[0], cols // 32)):
            raise ValueError(f"xq must be quantize_x's of x {tuple(x.shape)}, got {tuple(xq[0].shape)}, "
                             f"{tuple(xq[1].shape)}")
        q, s = quantize_x(x) if xq is None else xq
        xqp, xsp = q.view(torch.int32), s
    else:
        xqp, xsp = _dummy(x.device), x
    ids = ids.reshape(-1)
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        kernel[(n * per,)](x, xqp, xsp, out, stack, stack, stack, rows, 0, 0, per, per, nb, cols, out.stride(0),
                           ids, rows * rb, 0 if x.shape[0] == 1 else cols, 0, M=1, BLOCK_N=cfg.block_n, SB=sb,
                           DP4A=dp4a, PTX=not INTERPRET, num_warps=cfg.num_warps, EXPERTS=True, **family)
    return out


if triton is not None:
    @triton.jit
    def _mxfp4_experts(x_ptr, out_ptr, stack_ptr, ids_ptr, estride, xstep, rows, nb, per,
                       BLOCK_N: tl.constexpr, SB: tl.constexpr, SPLIT: tl.constexpr = False):
        """MXFP4 experts (gpt-oss): slot pid // per multiplies expert ids[slot]'s matrix by x's row slot (xstep =
        cols) or row 0 (xstep = 0). Tile [BLOCK_N rows, SB blocks, 16 bytes]; a block is the e8m0 byte then 16
        bytes of nibble pairs, byte i holding values i (low nibble) and i + 16 (high) (strata.quant.into's
        _mxfp4_into: the same values); blocks past the row's end read its last one, weighed 0. SPLIT: the stack in
        strata.quant.mxfp4's split layout (byte i of a block's nibbles holds values 2i and 2i + 1; the exponent
        bytes after the expert's nibbles). Float x, float32 products (kernels.gemv_mxfp4: float)."""
        pid = tl.program_id(0)
        slot = pid // per
        e = tl.load(ids_ptr + slot).to(tl.int64)
        x = x_ptr + slot * xstep
        r = (pid - slot * per) * BLOCK_N + tl.arange(0, BLOCK_N)
        live = r < rows
        row = tl.minimum(r, rows - 1).to(tl.int64)[:, None, None]
        kb = tl.arange(0, SB)[None, :, None]
        j = tl.arange(0, 16)[None, None, :]
        if SPLIT:
            nib = stack_ptr + e * estride + row * (nb * 16)
            exp = stack_ptr + e * estride + rows * nb * 16 + row * nb
            xlo, xhi = 2 * j, 2 * j + 1  # the columns within the block of a byte's low and high nibbles
        else:
            nib = stack_ptr + e * estride + row * (nb * 17) + 1
            exp = stack_ptr + e * estride + row * (nb * 17)
            xlo, xhi = j, j + 16
        acc = tl.zeros((BLOCK_N, SB, 16), tl.float32)
        for k in range(0, nb, SB):
            b = tl.minimum(k + kb, nb - 1)  # (1, SB, 1)
            if SPLIT:
                ex = tl.load(exp + b).to(tl.int32)
                q = tl.load(nib + b * 16 + j).to(tl.int32)
            else:
                ex = tl.load(exp + b * 17).to(tl.int32)
                q = tl.load(nib + b * 17 + j).to(tl.int32)
            d = tl.where(ex < 2, 0x00200000 << ex, (ex - 1) << 23).to(tl.float32, bitcast=True)
            d = tl.where(k + kb < nb, d, 0.0)
            acc += d * (_fp4(q & 15) * tl.load(x + b * 32 + xlo).to(tl.float32)
                        + _fp4(q >> 4) * tl.load(x + b * 32 + xhi).to(tl.float32))
        tl.store(out_ptr + slot * rows + r, tl.sum(tl.sum(acc, 2), 1).to(out_ptr.dtype.element_ty), mask=live)

    @triton.jit
    def _fp4(q):
        """An e2m1 nibble (sign, 2 exponent bits, 1 mantissa bit) as float32, twice its value (0, 1, 2, 3, 4, 6,
        8, 12; the block's scale carries the half), built as float bits: no int-to-float conversion, which runs
        at a quarter of the integer rate."""
        e = (q >> 1) & 3
        m = q & 1
        bits = tl.where(e == 0, m * 0x3F800000, ((e + 127) << 23) | (m << 22)) | ((q & 8) << 28)
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _prmt(a, b, c, PTX: tl.constexpr):
        """PTX prmt.b32 (its default mode): byte i of the result is byte c[4i..4i+2] of the 8 bytes b:a, or, where
        bit 4i + 3 of c is set, that byte's sign bit copied to all 8 bits. One instruction on CUDA; shifts and
        selects (the same bits) under the interpreter."""
        if PTX:
            return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                             is_pure=True, pack=1)
        else:
            r = c * 0
            for i in tl.static_range(4):
                s = (c >> (4 * i)) & 15
                k = s & 7
                byte = (tl.where(k < 4, a, b) >> (8 * (k & 3))) & 255
                byte = tl.where(s >= 8, tl.where(byte >= 128, 255, 0), byte)
                r = r | (byte << (8 * i))
            return r

    @triton.jit
    def _mxfp4_dot8(q, x_lo, x_hi, PTX: tl.constexpr):
        """The int32 dot of a split-layout nibble word q (values 8w..8w+7 of a block: 4 in each half) with x's two
        int8 words of those columns, the values doubled (e2m1 x 2: 0, 1, 2, 3, 4, 6, 8, 12, signed).

        Each half's 4 nibbles are the selectors of a byte permute of the table of magnitudes (its 8 bytes in two
        words): where a nibble's sign bit is set, prmt copies the sign of the byte it picks instead (0: every
        magnitude is positive), so the permute of q gives the positive values and 0 for the negative ones, and the
        permute of q with the sign bits flipped their magnitudes and 0 for the positive ones; the dot is then one
        dp4a with each less the other's. 4 permutes, 4 dp4a, a xor, 2 shifts and a subtraction for 8 values."""
        t0 = tl.full(q.shape, 0x03020100, tl.int32)  # magnitudes 0, 1, 2, 3 (nibbles 0..3)
        t1 = tl.full(q.shape, 0x0C080604, tl.int32)  # 4, 6, 8, 12 (nibbles 4..7)
        qn = q ^ -0x77777778  # q ^ 0x88888888: the sign bits flipped
        pos = _dp4a(_prmt(t0, t1, q >> 16, PTX), x_hi, _dp4a(_prmt(t0, t1, q, PTX), x_lo, 0, PTX), PTX)
        neg = _dp4a(_prmt(t0, t1, qn >> 16, PTX), x_hi, _dp4a(_prmt(t0, t1, qn, PTX), x_lo, 0, PTX), PTX)
        return pos - neg

    @triton.jit
    def _mxfp4_dp4a(xq_ptr, xs_ptr, out_ptr, stack_ptr, ids_ptr, estride, xrow, rows, nb, per,
                    BLOCK_N: tl.constexpr, SB: tl.constexpr, PTX: tl.constexpr, TAIL: tl.constexpr):
        """MXFP4 experts on int8 x (kernels.gemv_mxfp4: dp4a), llama.cpp's mmvq way: slot pid // per multiplies
        expert ids[slot]'s matrix of a split-layout stack (strata.quant.mxfp4) by x's row slot (xrow 1) or row 0
        (xrow 0), x as `quantize_x` left it (xq_ptr its int64 words: plane w of group b holds columns 8w..8w+7 of
        block b, the columns of the block's nibble word w; xs_ptr the float32 scale per 32). A step loads a
        [BLOCK_N rows, SB blocks, 4 words] tile of nibbles (a block's 16 bytes one aligned load) and the blocks'
        exponent bytes; per block the int32 dot of its 4 words (`_mxfp4_dot8`) times its scale (e8m0 halved: the
        values are doubled) times x's, summed in float32. TAIL: SB need not divide the row's blocks (2,880
        columns are 90): a step past the row's end reads its last block again, weighed 0."""
        pid = tl.program_id(0)
        slot = pid // per
        e = tl.load(ids_ptr + slot).to(tl.int64)
        xq = xq_ptr + slot * xrow * (nb * 4)  # nb * 4 int64 words a row of x
        xs = xs_ptr + slot * xrow * nb
        r = (pid - slot * per) * BLOCK_N + tl.arange(0, BLOCK_N)
        live = r < rows
        row = tl.minimum(r, rows - 1).to(tl.int64)[:, None]  # (BLOCK_N, 1); rows past the matrix: its last, not stored
        slab = stack_ptr + e * estride
        nib = (slab + row[:, :, None] * (nb * 16)).to(tl.pointer_type(tl.int32))  # (BLOCK_N, 1, 1)
        exp = slab + rows * nb * 16 + row * nb  # (BLOCK_N, 1): the slab's exponent bytes follow its nibbles
        kb = tl.arange(0, SB)[None, :]  # (1, SB)
        w = tl.arange(0, 4)[None, None, :]  # (1, 1, 4)
        acc = tl.zeros((BLOCK_N, SB), tl.float32)
        for k in range(0, nb, SB):
            b = k + kb
            if TAIL:
                b = tl.minimum(b, nb - 1)
            q = tl.load(nib + b[:, :, None] * 4 + w)  # (BLOCK_N, SB, 4)
            ex = tl.load(exp + b).to(tl.int32)  # (BLOCK_N, SB)
            xw = tl.load(xq + w * nb + b[:, :, None])  # (1, SB, 4) int64: columns 8w..8w+7 of block b
            dot = tl.sum(_mxfp4_dot8(q, xw.to(tl.int32), (xw >> 32).to(tl.int32), PTX), 2)  # (BLOCK_N, SB)
            d = tl.where(ex < 2, 0x00200000 << ex, (ex - 1) << 23).to(tl.float32, bitcast=True)
            if TAIL:
                d = tl.where(k + kb < nb, d, 0.0)
            # |dot| <= 32 * 12 * 127 < 2^22: its float32 by the bits of 1.5 * 2^23 + dot, less 1.5 * 2^23 (exact, and
            # no int-to-float conversion, a quarter-rate instruction)
            f = (dot + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0
            acc += f * (d * tl.load(xs + b))
        tl.store(out_ptr + slot * rows + r, tl.sum(acc, 1).to(out_ptr.dtype.element_ty), mask=live)


# experts launches (quant_matmul_experts), from bench/experts_sweep.py on an H200 (graph-timed): gpt-oss-20b's
# MXFP4 gate/up (4 of 32 experts, 5760 x 2880) 101.1 -> 80.9 us at 32 rows a program (every shape 340-440 GB/s:
# the value decode, not the loads, bounds it); Qwen3-30B-A3B's Q6_K down (8 of 128, 2048 x 768) 12.4 -> 10.6 us,
# Q4_K gate/up (1536 x 2048) 12.9 -> 11.1 us
MXFP4_EXPERTS = Config(32, 4, 4)
# _mxfp4_dp4a (kernels.gemv_mxfp4: dp4a): a [block_n rows, sb blocks, 4 words] tile, sb a power of two (a tail past
# the row's blocks weighed 0). bench/experts_sweep.py --mxfp4-dp4a on an H200 (L2 flushed, xq given) at gpt-oss-20b's
# shapes: 8 rows x 16 blocks on 4 warps was the best of 36 for both, gate/up (5760 x 2880, x 1 row) 24.3 us and down
# (2880 x 2880, 4 rows) 14.2 us, against 67.6 / 49.6 for the float kernel on the file's layout
MXFP4_DP4A = Config(8, 16, 4)
EXPERTS_CONFIGS = {"Q4_K": Config(16, 2, 4), "Q5_K": Config(16, 2, 4), "Q6_K": Config(16, 1, 4)}


def experts_int8_x(qtype, split: bool, kernels: GemvKernels | None = None) -> bool:
    """Whether quant_matmul_experts reads x rounded to int8 (`quantize_x`) for a stack of this type and layout: a
    caller that has the rounding (a decode norm wrote it) passes it as xq and saves the launch. MXFP4 only (the
    K-quants' experts make their own)."""
    kernels = GemvKernels() if kernels is None else kernels
    return qtype_of(qtype).name == "MXFP4" and split and kernels.mxfp4 == "dp4a"


def mxfp4_experts(x: torch.Tensor, stack: torch.Tensor, ids: torch.Tensor, cols: int,
                  kernels: GemvKernels | None = None, xq: tuple[torch.Tensor, torch.Tensor] | None = None,
                  split: bool = False) -> torch.Tensor:
    """quant_matmul_experts for MXFP4 stacks (E, rows, cols / 32 * 17): (n, rows) in x's dtype, one launch (two
    where the dp4a kernel rounds x itself). split: the stack in strata.quant.mxfp4's split layout; then `kernels`
    picks the dp4a kernel (int8 x: xq, or `quantize_x` here) or the float one, and a dp4a kernel that fails leaves
    the float one on that holder. The file's layout: the float kernel."""
    from strata.quant.mxfp4 import split_ok
    E, rows, rb = stack.shape
    n = ids.numel()
    if cols % 32 or rb != cols // 32 * 17 or stack.dtype != torch.uint8 or not stack.is_contiguous():
        raise ValueError(f"MXFP4: a contiguous uint8 (E, rows, {cols // 32 * 17}) stack, got {tuple(stack.shape)}")
    if split and not split_ok(rows, cols):
        raise ValueError(f"MXFP4: no split layout for {rows} x {cols} matrices (strata.quant.mxfp4.split_ok)")
    if x.dim() != 2 or x.shape[1] != cols or x.shape[0] not in (1, n):
        raise ValueError(f"x must be (1 or {n}, {cols}), got {tuple(x.shape)}")
    x = x.contiguous()
    kernels = GemvKernels() if kernels is None else kernels
    out = torch.empty((n, rows), device=x.device, dtype=x.dtype)
    ids = ids.reshape(-1)
    nb = cols // 32
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        if split and kernels.mxfp4 == "dp4a":
            if xq is None:
                xq = quantize_x(x)
            elif tuple(xq[0].shape) != tuple(x.shape) or tuple(xq[1].shape) != (x.shape[0], nb):
                raise ValueError(f"xq must be quantize_x's of x {tuple(x.shape)}, got {tuple(xq[0].shape)}, "
                                 f"{tuple(xq[1].shape)}")
            cfg = MXFP4_DP4A
            sb = min(cfg.sb, triton.next_power_of_2(nb))
            per = triton.cdiv(rows, cfg.block_n)
            try:
                _mxfp4_dp4a[(n * per,)](xq[0].view(torch.int64), xq[1], out, stack, ids, rows * rb,
                                        0 if x.shape[0] == 1 else 1, rows, nb, per, BLOCK_N=cfg.block_n, SB=sb,
                                        PTX=not INTERPRET, TAIL=nb % sb != 0, num_warps=cfg.num_warps)
                return out
            except Exception as e:  # e.g. a Triton that cannot build the inline PTX: the float kernel still works
                if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                    raise
                log.warning("MXFP4 dp4a experts kernel failed (%s: %s); using the float kernel", type(e).__name__, e)
                kernels.mxfp4 = "float"
        cfg = MXFP4_EXPERTS
        sb = min(cfg.sb, triton.next_power_of_2(nb))  # the tail's blocks weighed 0
        per = triton.cdiv(rows, cfg.block_n)
        _mxfp4_experts[(n * per,)](x, out, stack, ids, rows * rb, 0 if x.shape[0] == 1 else cols, rows, nb, per,
                                   BLOCK_N=cfg.block_n, SB=sb, SPLIT=split, num_warps=cfg.num_warps)
    return out
