"""Split-K attention for one query row over a KV cache whose length lives on the device (CUDA graphs).

A decode step's attention reads the whole cache for a handful of query rows. One program per key/value
head (what flash and the memory-efficient kernels launch for one row) leaves most of the GPU idle past a
few thousand positions, and a graph cannot pass a new key count each step. Here the keys are cut into
`splits` ranges, one program per (kv head, range); each reads only the positions below the length it loads
from the device, and a second kernel merges the ranges by their log-sum-exp (flash-decoding). The grid
depends on the cache buffer only, so one captured graph serves every length up to it.
"""
from __future__ import annotations

import math
import os

import torch

from strata.kernels.attention import Q8_0, cache_width
from strata.config import Q8_ATTENTION

try:
    import triton
    import triton.language as tl

    from strata.quant.gemv import int8_groups_store
except ImportError:  # CPU-only installs: the callers keep their torch path
    triton = None

BLOCK_N = 64       # keys per tile
KEYS_PER_SPLIT = 128  # at least this many keys per range: fewer ranges for short caches
# the int8 arm's inline PTX runs on CUDA only; the interpreter (CPU tests) takes its integer-op emulation
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def available() -> bool:
    return triton is not None


def n_splits(keys: int, target: int = 128) -> int:
    """Ranges for a cache of `keys` positions: enough programs to fill the GPU at long lengths (an 8B layer over
    122,880 positions, one H200, bench/splitk.py: 130 us with 128 ranges against 144 us with 64)."""
    return max(1, min(target, keys // KEYS_PER_SPLIT))


if triton is not None:
    @triton.jit
    def _q8_rows(x_ptr, xs_ptr, off, live, dims, blocks, BLOCK: tl.constexpr, HD: tl.constexpr):
        # BLOCK q8_0 rows at byte offsets off (BLOCK, 1) -> (BLOCK, HD) float32: the values in one load of
        # contiguous bytes, each block's scale once, broadcast over its 32 values (faster than loading the values
        # as (BLOCK, HD / 32, 32), or a scale beside each value: bench/splitk.py, 2026-12-03)
        x = tl.load(x_ptr + off + dims[None, :], mask=live[:, None], other=0).to(tl.float32)
        d = tl.load(xs_ptr + (off + HD) // 2 + blocks[None, :], mask=live[:, None], other=0.0).to(tl.float32)
        return tl.reshape(tl.reshape(x, (BLOCK, HD // 32, 32)) * d[:, :, None], (BLOCK, HD))

    @triton.jit
    def _round_half_away(v):
        return (v + tl.where(v >= 0, 0.5, -0.5)).to(tl.int32)  # truncation toward zero of v +- 1/2

    @triton.jit
    def _int8_rows(x, LO: tl.constexpr):
        """x (R, 32) float32 -> its int8 rounding per row, q8_0's way: q = round(x * 127 / amax) (half away from
        zero; an all-zero row: q = 0), the row's float32 scale amax / 127 (R,), and with LO the rounding's residual
        as int8 too: lo = round((x * 127 / amax - q) * 254) (|lo| <= 127), so that q * 254 + lo is x * 254 * 127 /
        amax to 1/2 (a 15-bit query; its scale amax / 127 / 254). Without LO, lo is q (unused)."""
        amax = tl.max(tl.abs(x), 1)
        inv = 127.0 / tl.where(amax > 0, amax, 1.0)
        v = x * inv[:, None]
        q = _round_half_away(v)
        if LO:
            lo = _round_half_away((v - q.to(tl.float32)) * 254.0)
        else:
            lo = q
        return q.to(tl.int8), lo.to(tl.int8), amax / 127.0

    @triton.jit
    def _widen_f16(x, d, PTX: tl.constexpr):
        """int8 values x times their float16 scales d (same shape) -> float16, rounded once: the bits of
        strata.kernels.attention.from_q8_0(..., float16) (the int8 * float16 product is exact in float32), with no int-to-float
        conversion. Each byte, its sign bit flipped (x + 128, 0..255), becomes the low byte of a float16 whose high
        byte is 0x64: 1024 + (x + 128), exact (1024's ulp is 1); minus 1152 gives x, exact; times d rounds once.
        On CUDA one asm block does 4 values: the xor on the packed word, 2 byte permutes (prmt) build the two
        words of 2 float16 each, then a packed subtract and a packed multiply per word (7 instructions and the
        constant's mov for 4 values, against cvt.s16.s8, cvt.rn.f32.s16, a multiply and a cvt.rn.bf16.f32 per value
        in the widening arm's sm_90 PTX). Under the interpreter, the same bits by integer ops and a bitcast.
        Not marked pure: marked pure, Triton moved V's layout conversion (to the P @ V operand) ahead of it and
        gathered each asm's 4 bytes from shared memory one at a time (64 ld.shared.b8 a tile a thread); unmarked,
        it widens in the load's layout and the float16 tile is transposed by ldmatrix.trans."""
        if PTX:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 a, c; xor.b32 a, $2, 0x80808080; mov.b32 c, 0x64806480; "
                "prmt.b32 $0, a, 0x64646464, 0x5150; prmt.b32 $1, a, 0x64646464, 0x5352; "
                "sub.f16x2 $0, $0, c; sub.f16x2 $1, $1, c; mul.rn.f16x2 $0, $0, $3; mul.rn.f16x2 $1, $1, $4; }",
                "=r,=r,r,r,r", [x, d], dtype=tl.float16, is_pure=False, pack=4)
        else:
            u = (x.to(tl.uint8, bitcast=True).to(tl.uint16) ^ 0x80) | 0x6400
            return (u.to(tl.float16, bitcast=True) - 1152.0).to(tl.float16) * d

    @triton.jit
    def _q8_rows_f16(x_ptr, xs_ptr, off, live, dims, blocks, BLOCK: tl.constexpr, HD: tl.constexpr,
                     PTX: tl.constexpr):
        # BLOCK q8_0 rows at byte offsets off (BLOCK, 1) -> (BLOCK, HD) float16 by _widen_f16: the values in one
        # load of contiguous bytes as _q8_rows loads them, each block's scale broadcast over its 32 values
        x = tl.load(x_ptr + off + dims[None, :], mask=live[:, None], other=0)
        d = tl.load(xs_ptr + (off + HD) // 2 + blocks[None, :], mask=live[:, None], other=0.0)
        d = tl.reshape(tl.broadcast_to(d[:, :, None], (BLOCK, HD // 32, 32)), (BLOCK, HD))
        return _widen_f16(x, d, PTX)

    @triton.jit
    def _partial(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, len_ptr, m_ptr, l_ptr, acc_ptr,
                 sk_h, sk_s, sv_h, sv_s, span, scale, window, ring, slot_ptr, sk_slot, sv_slot,
                 G: tl.constexpr, GP: tl.constexpr, HD: tl.constexpr, BLOCK: tl.constexpr,
                 PREC: tl.constexpr, Q8: tl.constexpr, INT8: tl.constexpr, PTX: tl.constexpr,
                 ROWS: tl.constexpr = False):
        # ROWS: row program_id(2) of a decode batch (each row its own sequence): its query rows, partial results
        # and key count (len_ptr[row]) after the rows before it, its keys and values in slot slot_ptr[row] of the
        # caches (sk_slot, sv_slot apart; bytes with Q8)
        # INT8: 0 (a q8_0 cache widened), 1 (kernels.q8_attention int8) or 2 (int8x2), with Q8 only
        # Q8: a q8_0 cache (strata.kernels.attention.to_q8_0): k_ptr / v_ptr its bytes as int8, ks_ptr / vs_ptr the same
        # bytes as float16 (strides in bytes); a row is HD int8 values then HD / 32 float16 scales, widened as
        # strata.kernels.attention.from_q8_0 widens it (float32 product, rounded once). Rows start at multiples of HD / 16
        # bytes (HD * 17 / 16 wide; the caller checks), which lets the values load in vectors of HD / 16 bytes.
        # INT8 1 (with Q8; kernels.q8_attention int8): no widening of K. The query rows are rounded to int8 per 32
        # dims once here (q8_0's way, as llama.cpp rounds q to q8_1 for its quantized-cache kernels), and each
        # 32-dim group g scores on the int8 tensor cores: int8 q_g . int8 k_g -> int32, exact, times q_scale[row, g]
        # (the softmax scale folded in) * k_scale[n, g], summed over the HD / 32 groups in float32. V is widened
        # to float16 with its scale by _widen_f16 (PTX: inline asm, else its interpreted emulation), and P @ V is
        # one float16 dot over all HD dims into float32. Scaling V per value (one packed multiply per 2 values, in
        # the asm) rather than P per key and group (P_g = P * v_scale[:, g], a dot and an accumulator per group)
        # keeps one dot of K = BLOCK with N = HD and one accumulator instead of HD / 32 dots with N = 32 and as many
        # accumulators and P conversions; the widened values are then from_q8_0(v, float16)'s bits exactly.
        # (float16's range: a V value beyond +-65,504 would be inf here, where the widening arm's bf16 holds it;
        # the q8_0 scale itself is a float16, and Llama-family values sit far inside that.)
        # INT8 2 (int8x2): the query's rounding residual as a second int8 row per group (_int8_rows' lo), its dot
        # accumulated onto 254 times the first's in int32 (|254 * 520,192 + 520,192| < 2**31): ~15 bits of q for one
        # more int8 mma and one integer multiply per score and group (measured error: tests/test_kv_q8.py).
        h = tl.program_id(0)
        s = tl.program_id(1)
        n_split = tl.num_programs(1)
        if ROWS:
            r = tl.program_id(2)
            n_kv = tl.num_programs(0)
            n_keys = tl.load(len_ptr + r).to(tl.int32)
            slot = tl.load(slot_ptr + r).to(tl.int64)
            k_ptr += slot * sk_slot
            v_ptr += slot * sv_slot
            if Q8:
                ks_ptr += slot * sk_slot // 2
                vs_ptr += slot * sv_slot // 2
            q_ptr += r * (n_kv * G * HD)
            m_ptr += r * (n_kv * n_split * GP)
            l_ptr += r * (n_kv * n_split * GP)
            acc_ptr += r * (n_kv * n_split * GP * HD)
        else:
            n_keys = tl.load(len_ptr).to(tl.int32)
        # positions [n_keys - window, n_keys) (window 2**30: all), position p in row p % ring; the ranges split
        # that span (offsets from `first`)
        first = tl.maximum(n_keys - window, 0)
        lo = s * span
        hi = tl.minimum(lo + span, n_keys - first)
        rows = tl.arange(0, GP)
        dims = tl.arange(0, HD)
        dt = q_ptr.dtype.element_ty  # scores from the query's dtype (exact bf16 products), sums in float32
        if Q8:
            blocks = tl.arange(0, HD // 32)
        if Q8 and INT8:
            t32 = tl.arange(0, 32)
            q8s = ()  # per 32-dim group: the rows' int8 values (GP, 32), and their scales times `scale` (GP,)
            qlos = ()  # (INT8 2: the residuals)
            qds = ()
            for g in tl.static_range(HD // 32):
                qg = tl.load(q_ptr + (h * G + rows)[:, None] * HD + g * 32 + t32[None, :], mask=(rows < G)[:, None],
                             other=0.0).to(tl.float32)
                qi, qlo, qd = _int8_rows(qg, INT8 == 2)
                q8s = q8s + (qi,)
                qlos = qlos + (qlo,)
                qds = qds + (qd * scale / 254.0 if INT8 == 2 else qd * scale,)
        else:
            q = tl.load(q_ptr + (h * G + rows)[:, None] * HD + dims[None, :], mask=(rows < G)[:, None], other=0.0)
        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, HD], tl.float32)
        for start in range(lo, hi, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            live = cols < hi
            rows_k = (first + cols) % ring  # the identity for a cache that is not a ring (ring >= n_keys)
            if Q8 and INT8:
                ko = tl.multiple_of(h * sk_h + rows_k * sk_s, HD // 16)
                vo = tl.multiple_of(h * sv_h + rows_k * sv_s, HD // 16)[:, None]
                sc = tl.zeros([GP, BLOCK], tl.float32)
                for g in tl.static_range(HD // 32):
                    kg = tl.load(k_ptr + ko[:, None] + g * 32 + t32[None, :], mask=live[:, None], other=0)
                    kd = tl.load(ks_ptr + (ko + HD) // 2 + g, mask=live, other=0.0).to(tl.float32)
                    # |q_g . k_g| <= 32 * 127 * 128 < 2**24: exact in int32 and in its float32 (int8x2's
                    # 255 times that, exact in int32, rounds once to float32)
                    sg = tl.dot(q8s[g], tl.trans(kg), out_dtype=tl.int32)              # (GP, BLOCK) int32
                    if INT8 == 2:
                        sg = tl.dot(qlos[g], tl.trans(kg), sg * 254, out_dtype=tl.int32)  # (Triton 3.6 checks acc against it)
                    sc += sg.to(tl.float32) * (qds[g][:, None] * kd[None, :])
                v = _q8_rows_f16(v_ptr, vs_ptr, vo, live, dims, blocks, BLOCK, HD, PTX)  # (BLOCK, HD) float16
            else:
                if Q8:
                    ko = tl.multiple_of(h * sk_h + rows_k * sk_s, HD // 16)[:, None]
                    vo = tl.multiple_of(h * sv_h + rows_k * sv_s, HD // 16)[:, None]
                    k = _q8_rows(k_ptr, ks_ptr, ko, live, dims, blocks, BLOCK, HD)
                    v = _q8_rows(v_ptr, vs_ptr, vo, live, dims, blocks, BLOCK, HD)
                    v = v.to(dt)  # the widened value in the compute dtype, as the eager path's from_cache gives it
                else:
                    k = tl.load(k_ptr + h * sk_h + rows_k[:, None] * sk_s + dims[None, :], mask=live[:, None],
                                other=0.0)
                    v = tl.load(v_ptr + h * sv_h + rows_k[:, None] * sv_s + dims[None, :], mask=live[:, None],
                                other=0.0)
                sc = tl.dot(q, tl.trans(k.to(dt)), input_precision=PREC) * scale        # (GP, BLOCK)
            sc = tl.where(live[None, :], sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(sc - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if Q8 and INT8:
                # probabilities (0..1) in float16 beside V's float16 values, float32 sums
                acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v)
            else:
                # probabilities stay float32 (tf32 on the tensor cores, 3 bits more than bf16): memory-bound anyway
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=PREC)
            m_i = m_new
        base = (h * n_split + s) * GP + rows
        real = rows < G  # the padding rows are never read back
        tl.store(m_ptr + base, m_i, mask=real)
        tl.store(l_ptr + base, l_i, mask=real)
        tl.store(acc_ptr + base[:, None] * HD + dims[None, :], acc, mask=real[:, None])

    @triton.jit
    def _merge(m_ptr, l_ptr, acc_ptr, o_ptr, sink_ptr, n_split, q_ptr, s_ptr,
               G: tl.constexpr, GP: tl.constexpr, HD: tl.constexpr, SP: tl.constexpr, SINKS: tl.constexpr,
               ROWS: tl.constexpr = False, INT8: tl.constexpr = False):
        # one program per (kv head, query row): its ranges' partial results weighed by their log-sum-exp; SINKS:
        # the query head's sink logit joins the denominator (with no value), gpt-oss's attention. ROWS: batch row
        # program_id(2)'s, as _partial's. INT8 (one row): the output as rounded also goes to quantize_x's bytes
        # (q_ptr, s_ptr: its HD / 32 groups of the row's nkv * G * HD), for the o-projection's dp4a product
        h = tl.program_id(0)
        r = tl.program_id(1)
        if ROWS:
            b = tl.program_id(2)
            n_kv = tl.num_programs(0)
            m_ptr += b * (n_kv * n_split * GP)
            l_ptr += b * (n_kv * n_split * GP)
            acc_ptr += b * (n_kv * n_split * GP * HD)
            o_ptr += b * (n_kv * G * HD)
        sp = tl.arange(0, SP)
        dims = tl.arange(0, HD)
        ok = sp < n_split
        base = (h * n_split + sp) * GP + r
        m = tl.load(m_ptr + base, mask=ok, other=float("-inf"))
        l = tl.load(l_ptr + base, mask=ok, other=0.0)
        m_all = tl.max(m, 0)  # finite: the first range always holds the first live position
        if SINKS:
            sink = tl.load(sink_ptr + h * G + r).to(tl.float32)
            m_all = tl.maximum(m_all, sink)
        w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_all))
        a = tl.load(acc_ptr + base[:, None] * HD + dims[None, :], mask=ok[:, None], other=0.0)
        den = tl.sum(w * l, 0)
        if SINKS:
            den += tl.exp(sink - m_all)
        out = tl.sum(w[:, None] * a, 0) / den
        y = out.to(o_ptr.dtype.element_ty)
        tl.store(o_ptr + (h * G + r) * HD + dims, y)
        if INT8:
            g = ((h * G + r) * (HD // 32) + tl.arange(0, HD // 32))[:, None]
            int8_groups_store(tl.reshape(y.to(tl.float32), (HD // 32, 32)), g, tl.arange(0, 32)[None, :], g >= 0,
                              q_ptr, s_ptr, tl.num_programs(0) * G * (HD // 32))


class SplitKAttention:
    """Buffers and launches for one cache shape: call(q, k, v, n_keys) -> out, all on one device.

    q: (nkv, g, hd) query rows grouped by their kv head; k, v: (nkv, S, hd) views of the cache (last dim
    contiguous, any dtype Triton loads; a q8_0 cache's uint8 rows of hd * 17 / 16 bytes); n_keys: a device int
    tensor (1,), the live positions (< S read).
    The partial results live in buffers made once here, so the launches can be captured in a graph.
    q8: how a q8_0 cache is read (the rig's kernels.q8_attention): "widen" (each tile widened to the compute dtype,
    float products) or "int8" (the query rounded to int8 per 32 dims, scores on int8 tensor cores, V widened to
    float16 by byte permutes; 4e-3 to 2e-2 relative error of the output, tests/test_kv_q8.py), or "int8x2" (the same
    with the query's rounding residual as a second int8 dot, ~15 bits of q: ~3e-4)."""

    def __init__(self, nkv: int, g: int, hd: int, keys: int, device, splits: int | None = None, num_warps: int = 4,
                 q8: str = "widen", block: int = BLOCK_N, num_stages: int | None = None, rows: int = 0,
                 scratch: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
        """block (keys a tile) and num_stages (Triton's software pipelining; None: its default): launch settings
        bench/splitk.py sweeps; the decode graphs take the defaults. rows > 0: for `rows`' decode batches of that
        many sequences (strata.decode.batch_graphs), each row its own slot and key count (no single-row call then).
        scratch: flat float32 (m, l, acc) tensors the partial results live in (views of their first elements), shared
        by instances whose launches run one after another; None: buffers of its own."""
        if triton is None:
            raise RuntimeError("split-K decode attention needs Triton")
        if hd & (hd - 1):
            raise ValueError(f"head dim {hd} is not a power of two")
        if q8 not in Q8_ATTENTION:
            raise ValueError(f"q8={q8!r}: one of {', '.join(Q8_ATTENTION)}")
        self.nkv, self.g, self.hd, self.num_warps, self.q8 = nkv, g, hd, num_warps, q8
        self.block, self.stages = block, ({} if num_stages is None else {"num_stages": num_stages})
        self.gp = max(16, 1 << (g - 1).bit_length())  # tl.dot wants >= 16 rows; the padding rows are zeros
        self.splits = splits or n_splits(keys)
        self.span = block * math.ceil(keys / self.splits / block)
        self.splits = math.ceil(keys / self.span)
        self.rows = rows
        shape = (nkv, self.splits, self.gp) if not rows else (rows, nkv, self.splits, self.gp)
        if scratch is not None:
            n = math.prod(shape)
            if scratch[0].numel() < n or scratch[1].numel() < n or scratch[2].numel() < n * hd:
                raise ValueError(f"split-K scratch of {scratch[0].numel()} partial rows holds no {shape}")
            self.m, self.l = scratch[0][:n].view(shape), scratch[1][:n].view(shape)
            self.acc = scratch[2][:n * hd].view(*shape, hd)
        else:
            self.m = torch.empty(shape, dtype=torch.float32, device=device)
            self.l = torch.empty(shape, dtype=torch.float32, device=device)
            self.acc = torch.empty(*shape, hd, dtype=torch.float32, device=device)

    def rows_call(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_keys: torch.Tensor, slots: torch.Tensor,
                  scale: float | None = None, window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """A decode batch's attention in two launches: q (R, nkv, g, hd), row t its sequence's query; k, v every
        slot's caches (slots, nkv, S, width) (strata.models.model.Transformer.slot_caches); n_keys, slots (R,) device
        tensors: row t reads the first n_keys[t] positions of slot slots[t] (a window layer: its last `window`,
        position p in row p % S). -> (R, nkv, g, hd). R is the `rows` this instance was made for."""
        nkv, g, hd, R = self.nkv, self.g, self.hd, self.rows
        q8 = k.dtype == Q8_0
        width = cache_width(hd, k.dtype)
        if (not R or q.shape != (R, nkv, g, hd) or k.dim() != 4 or k.shape[1] != nkv or k.shape[3] != width
                or v.shape != k.shape or n_keys.numel() != R or slots.numel() != R):
            raise ValueError(f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit {R} rows "
                             f"of ({nkv}, {g}, {hd})")
        if k.stride(3) != 1 or v.stride(3) != 1:
            raise ValueError("keys and values need a contiguous last dimension")
        if q8 and any(t.stride(i) % (hd // 16) or t.storage_offset() % (hd // 16) for t in (k, v) for i in (0, 1, 2)):
            raise ValueError(f"a q8_0 cache needs rows at multiples of {hd // 16} bytes (the kernel's vector loads)")
        q = q.contiguous()
        out = torch.empty_like(q)
        ks, vs = (k.view(torch.float16), v.view(torch.float16)) if q8 else (k, v)
        if q8:
            k, v = k.view(torch.int8), v.view(torch.int8)
        _partial[(nkv, self.splits, R)](q, k, v, ks, vs, n_keys, self.m, self.l, self.acc,
                                        k.stride(1), k.stride(2), v.stride(1), v.stride(2), self.span,
                                        1.0 / math.sqrt(hd) if scale is None else scale,
                                        window if window > 0 else 1 << 30, k.shape[2], slots, k.stride(0), v.stride(0),
                                        G=g, GP=self.gp, HD=hd, BLOCK=self.block,
                                        PREC="ieee" if q.dtype == torch.float32 else "tf32", Q8=q8,
                                        INT8=Q8_ATTENTION.index(self.q8) if q8 else 0, PTX=not INTERPRET, ROWS=True,
                                        num_warps=self.num_warps, **self.stages)
        _merge[(nkv, g, R)](self.m, self.l, self.acc, out, self.m if sinks is None else sinks, self.splits, self.m,
                            self.m, G=g, GP=self.gp, HD=hd, SP=max(2, 1 << (self.splits - 1).bit_length()),
                            SINKS=sinks is not None, ROWS=True)
        return out

    def probe(self, cache_dtype: torch.dtype, dtype: torch.dtype = torch.bfloat16) -> None:
        """One launch over a small zero cache of cache_dtype: builds this arm's kernels now (raises if Triton
        cannot), so a caller can choose another arm before a CUDA graph captures the launch."""
        width = cache_width(self.hd, cache_dtype)
        dev = self.m.device
        q = torch.zeros(self.nkv, self.g, self.hd, dtype=dtype, device=dev)
        kv = torch.zeros(self.nkv, 64, width, dtype=cache_dtype, device=dev)
        self(q, kv, kv.clone(), torch.tensor([64], device=dev))

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_keys: torch.Tensor,
                 out: torch.Tensor | None = None, scale: float | None = None, window: int = 0,
                 sinks: torch.Tensor | None = None,
                 xq: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """window > 0: a sliding-window layer, k and v its whole ring (position p in row p % S); the instance
        was made for keys = min(bucket, window). scale: of q.k (None: hd ** -0.5). sinks (nkv * g,): a logit
        per query head in the softmax's denominator (gpt-oss). xq: (q int8 (1, nkv * g * hd), s float32 (1, that
        / 32)) buffers the merge fills with quantize_x's rounding of the output (the o-projection's dp4a input,
        without its launch)."""
        nkv, g, hd = self.nkv, self.g, self.hd
        q8 = k.dtype == Q8_0  # rows of hd values then hd / 32 scales
        width = cache_width(hd, k.dtype)  # (a head dim not of whole q8_0 blocks raises here)
        if q.shape != (nkv, g, hd) or k.shape[0] != nkv or k.shape[2] != width or v.shape != k.shape:
            raise ValueError(f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit "
                             f"({nkv}, {g}, {hd})")
        if k.stride(2) != 1 or v.stride(2) != 1:
            raise ValueError("keys and values need a contiguous last dimension")
        if q8 and any(t.stride(i) % (hd // 16) or t.storage_offset() % (hd // 16) for t in (k, v) for i in (0, 1)):
            raise ValueError(f"a q8_0 cache needs rows at multiples of {hd // 16} bytes (the kernel's vector loads)")
        if xq is not None and (hd % 32 or xq[0].shape != (1, nkv * g * hd) or xq[1].shape != (1, nkv * g * hd // 32)
                               or xq[0].dtype != torch.int8 or xq[1].dtype != torch.float32):
            raise ValueError(f"xq buffers {tuple(xq[0].shape)}, {tuple(xq[1].shape)} are not quantize_x's of "
                             f"(1, {nkv * g * hd}) in whole heads (head dim {hd})")
        q = q.contiguous()
        out = torch.empty_like(q) if out is None else out
        ks, vs = (k.view(torch.float16), v.view(torch.float16)) if q8 else (k, v)
        if q8:
            k, v = k.view(torch.int8), v.view(torch.int8)
        _partial[(nkv, self.splits)](q, k, v, ks, vs, n_keys, self.m, self.l, self.acc,
                                     k.stride(0), k.stride(1), v.stride(0), v.stride(1), self.span,
                                     1.0 / math.sqrt(hd) if scale is None else scale, window if window > 0 else 1 << 30,
                                     k.shape[1], n_keys, 0, 0,
                                     G=g, GP=self.gp, HD=hd, BLOCK=self.block,
                                     PREC="ieee" if q.dtype == torch.float32 else "tf32", Q8=q8,
                                     INT8=Q8_ATTENTION.index(self.q8) if q8 else 0, PTX=not INTERPRET,
                                     num_warps=self.num_warps, **self.stages)
        qb, sb = (self.m, self.m) if xq is None else xq
        _merge[(nkv, g)](self.m, self.l, self.acc, out, self.m if sinks is None else sinks, self.splits, qb, sb, G=g,
                         GP=self.gp, HD=hd, SP=max(2, 1 << (self.splits - 1).bit_length()), SINKS=sinks is not None,
                         INT8=xq is not None)
        return out
