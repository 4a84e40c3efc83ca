"""Resident prefill's dequantization on CUDA for the usual GGUF types: Q8_0, Q4_K, Q5_K, Q6_K (Q4_K_M and Q5_K_M
files), the legacy Q4_0, Q4_1, Q5_0, Q5_1, MXFP4 (gpt-oss's experts), and IQ3_S through strata.quant.iq's kernel. One Triton kernel per type
reads each block once and writes the compute dtype straight into the layer's scratch. The torch path
(strata.quant.blocks) makes float32 pieces first (~10 integer and float ops over the weights, then a cast), ~15 ms
for a 70B layer of Q4_K on an H200, paid again for every chunk.

Same float32 operations in the same order as blocks.py (floating-point contraction off), then one rounding to
the output dtype, so the scratch holds the bits the torch path gives (NaN payloads aside). Where a kernel fails to
build or launch, the caller's strata.triton_state.TritonState (`state`, a slice's) takes the torch path from then on,
not the process.
"""
from __future__ import annotations

import contextlib
import logging
import os

import torch

from strata.triton_state import TritonState
from strata.quant import LEGACY_FLAGS, block_size, type_size

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs without Triton
    triton = None

log = logging.getLogger("strata.quant")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# quant blocks per program. 4 left the kernels far from the memory's speed on an H100 (one layer's experts of
# gpt-oss in MXFP4: 4.28 ms at 4, 1.65 at 16, 1.18 at 32 and 1.17 at 64; a 70B layer of Q8_0: 4.05, 1.04 at 16,
# 0.94 at 64; Q4_K 0.90 -> 0.57 at 16, Q6_K 0.83 -> 0.69: bench/dequant.py --blocks, BENCHMARKS.md 2026-12-06)
BLOCKS = 16
BLOCKS_OF = {"MXFP4": 32, "Q8_0": 64}  # where more measured faster still
_TYPES = ("Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ3_S", "MXFP4", *LEGACY_FLAGS)

if triton is not None:
    @triton.jit
    def _f16(ptr, live):
        h = tl.load(ptr, mask=live, other=0).to(tl.int32) | (tl.load(ptr + 1, mask=live, other=0).to(tl.int32) << 8)
        return h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _q8_0_into(b_ptr, out_ptr, n_blocks, BLOCKS: tl.constexpr):
        nb = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)[:, None]
        j = tl.arange(0, 32)[None, :]
        live = nb < n_blocks
        base = b_ptr + nb.to(tl.int64) * 34
        q = tl.load(base + 2 + j, mask=live, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        tl.store(out_ptr + nb.to(tl.int64) * 32 + j, (q * _f16(base, live)).to(out_ptr.dtype.element_ty), mask=live)

    @triton.jit
    def _legacy_into(b_ptr, out_ptr, n_blocks, MIN: tl.constexpr, FIVE: tl.constexpr, BLOCKS: tl.constexpr):
        """Q4_0, Q4_1 (MIN), Q5_0 (FIVE), Q5_1: fp16 d, [fp16 m], [32 fifth bits: bit j of the little-endian
        uint32], 16 bytes whose low nibbles are weights 0..15 and high ones 16..31. d * (q - 8 or 16) without a
        min, d * q + m with one (the torch path's order)."""
        qh_at: tl.constexpr = 2 + 2 * MIN
        qs_at: tl.constexpr = qh_at + 4 * FIVE
        nb = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)[:, None]
        j = tl.arange(0, 32)[None, :]
        live = nb < n_blocks
        base = b_ptr + nb.to(tl.int64) * (qs_at + 16)
        q = (tl.load(base + qs_at + j % 16, mask=live, other=0).to(tl.int32) >> (4 * (j // 16))) & 15
        if FIVE:
            q = q | (((tl.load(base + qh_at + j // 8, mask=live, other=0).to(tl.int32) >> (j % 8)) & 1) << 4)
        d = _f16(base, live)
        if MIN:
            w = d * q.to(tl.float32) + _f16(base + 2, live)
        else:
            w = d * (q - 8 - 8 * FIVE).to(tl.float32)
        tl.store(out_ptr + nb.to(tl.int64) * 32 + j, w.to(out_ptr.dtype.element_ty), mask=live)

    @triton.jit
    def _k45_into(b_ptr, out_ptr, n_blocks, FIVE: tl.constexpr, BLOCKS: tl.constexpr):
        """Q4_K / Q5_K: weight j of a block is in sub-block g = j // 32, lane j % 32: its nibble in byte
        qs + 32 * (g // 2) + lane (low for even g), Q5_K's fifth bit at bit g of byte 16 + lane; 6-bit scale and
        min of g from the 12 packed bytes at 4 (as blocks._scale_min_k4); (d * sc) * q - dmin * m."""
        if FIVE:
            size, qs_at = 176, 48
        else:
            size, qs_at = 144, 16
        nb = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)[:, None]
        j = tl.arange(0, 256)[None, :]
        live = nb < n_blocks
        base = b_ptr + nb.to(tl.int64) * size
        g, lane = j // 32, j % 32
        q = (tl.load(base + qs_at + 32 * (g // 2) + lane, mask=live, other=0).to(tl.int32) >> (4 * (g % 2))) & 15
        if FIVE:
            q = q | (((tl.load(base + 16 + lane, mask=live, other=0).to(tl.int32) >> g) & 1) << 4)
        sa = tl.load(base + 4 + g, mask=live, other=0).to(tl.int32)
        sb = tl.load(base + 8 + g, mask=live, other=0).to(tl.int32)
        sc = tl.load(base + 4 + tl.maximum(g - 4, 0), mask=live, other=0).to(tl.int32)
        scale = tl.where(g < 4, sa & 63, (sb & 15) | ((sc >> 6) << 4))
        mn = tl.where(g < 4, sb & 63, (sb >> 4) | ((sa >> 6) << 4))
        dl = _f16(base, live) * scale.to(tl.float32)
        dm = _f16(base + 2, live) * mn.to(tl.float32)
        w = dl * q.to(tl.float32) - dm
        tl.store(out_ptr + nb.to(tl.int64) * 256 + j, w.to(out_ptr.dtype.element_ty), mask=live)

    @triton.jit
    def _q6_k_into(b_ptr, out_ptr, n_blocks, BLOCKS: tl.constexpr):
        """Q6_K: weight j = 128h + 32t + lane: low nibble of byte 64h + 32 * (t % 2) + lane (the high one for
        t >= 2), bits 2t, 2t + 1 of byte 128 + 32h + lane above it, minus 32; (d * scale[j // 16]) * q."""
        nb = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)[:, None]
        j = tl.arange(0, 256)[None, :]
        live = nb < n_blocks
        base = b_ptr + nb.to(tl.int64) * 210
        h, t, lane = j // 128, (j // 32) % 4, j % 32
        lo = (tl.load(base + 64 * h + 32 * (t % 2) + lane, mask=live, other=0).to(tl.int32) >> (4 * (t // 2))) & 15
        hi = (tl.load(base + 128 + 32 * h + lane, mask=live, other=0).to(tl.int32) >> (2 * t)) & 3
        q = ((lo | (hi << 4)) - 32).to(tl.float32)
        sc = tl.load(base + 192 + j // 16, mask=live, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        w = (_f16(base + 208, live) * sc) * q
        tl.store(out_ptr + nb.to(tl.int64) * 256 + j, w.to(out_ptr.dtype.element_ty), mask=live)


    @triton.jit
    def _mxfp4_into(b_ptr, out_ptr, n_blocks, per, BLOCKS: tl.constexpr, SPLIT: tl.constexpr = False):
        """MXFP4: byte 0 the e8m0 exponent e (the scale 2^(e - 127), halved to match the doubled values: bits
        0x00200000 << e below e = 2, else (e - 1) << 23 as float32); value j the low nibble of byte 1 + j (j < 16)
        or the high one of byte 1 + j - 16: e2m1 doubled, sign bit 8, magnitude m -> m below 4, else
        2^(m // 2) * (1 + (m % 2) / 2); their product, exact in float32 (as strata.quant.mxfp4). SPLIT: the blocks
        in strata.quant.mxfp4's split layout, `per` blocks an expert's slab (its nibbles, value j in nibble j, then
        its exponent bytes)."""
        nb = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)[:, None]
        j = tl.arange(0, 32)[None, :]
        live = nb < n_blocks
        if SPLIT:
            slab = nb.to(tl.int64) // per
            k = nb.to(tl.int64) - slab * per
            base = b_ptr + slab * per * 17
            e = tl.load(base + 16 * per + k, mask=live, other=0).to(tl.int32)
            q = (tl.load(base + 16 * k + j // 2, mask=live, other=0).to(tl.int32) >> (4 * (j % 2))) & 15
        else:
            base = b_ptr + nb.to(tl.int64) * 17
            e = tl.load(base, mask=live, other=0).to(tl.int32)
            q = (tl.load(base + 1 + j % 16, mask=live, other=0).to(tl.int32) >> (4 * (j // 16))) & 15
        bits = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23)
        d = bits.to(tl.float32, bitcast=True)
        m = q & 7
        mag = tl.where(m < 4, m.to(tl.float32), (1 << (m // 2)).to(tl.float32) * (1.0 + 0.5 * (m % 2).to(tl.float32)))
        v = tl.where(q >= 8, 0.0 - mag, mag)  # (+0 for the nibble 8, as the table has it, not -0)
        tl.store(out_ptr + nb.to(tl.int64) * 32 + j, (d * v).to(out_ptr.dtype.element_ty), mask=live)


def takes(qtype: str | None, out: torch.Tensor, state: TritonState | None = None) -> bool:
    """Whether `dequantize_into` handles this type into this tensor (CUDA, or the CPU under Triton's interpreter)
    for the holder of `state` (none of its kernels failed)."""
    return (triton is not None and (state is None or state.into) and qtype in _TYPES and out.is_contiguous()
            and out.dtype.is_floating_point and (out.is_cuda or INTERPRET))


def dequantize_into(out: torch.Tensor, blocks: torch.Tensor, qtype: str, state: TritonState | None = None,
                    slab: int = 0) -> bool:
    """out (rows, cols) <- the rows' GGUF blocks (rows, bytes) dequantized, in out's dtype; False (nothing
    written) when the kernel cannot run, and the caller takes the torch path (a failure turns `state.into` off:
    that holder's later `takes` say no). slab: MXFP4 blocks in strata.quant.mxfp4's split layout, this many blocks
    an expert (whole experts only); 0: the file's layout."""
    bs, ts = block_size(qtype), type_size(qtype)
    flat = blocks.contiguous().view(-1, ts)
    n = flat.shape[0]
    if out.numel() != n * bs:
        raise ValueError(f"{qtype}: {n} blocks make {n * bs} weights, out has {out.numel()}")
    if slab and n % slab:
        raise ValueError(f"MXFP4 split layout: {n} blocks is not a whole number of experts of {slab}")
    if not n:
        return True
    per_program = BLOCKS_OF.get(qtype, BLOCKS)
    grid = (triton.cdiv(n, per_program),)
    try:
        with torch.cuda.device(out.device) if out.is_cuda else contextlib.nullcontext():
            if qtype == "Q8_0":
                _q8_0_into[grid](flat, out, n, BLOCKS=per_program, enable_fp_fusion=False)
            elif qtype == "Q6_K":
                _q6_k_into[grid](flat, out, n, BLOCKS=per_program, enable_fp_fusion=False)
            elif qtype == "MXFP4":
                _mxfp4_into[grid](flat, out, n, max(slab, 1), BLOCKS=per_program, SPLIT=slab > 0,
                                  enable_fp_fusion=False)
            elif qtype in LEGACY_FLAGS:
                _legacy_into[grid](flat, out, n, **LEGACY_FLAGS[qtype], BLOCKS=per_program, enable_fp_fusion=False)
            elif qtype == "IQ3_S":  # its float32 products (no add to contract) stored in out's dtype
                from strata.quant.iq import TRITON_BLOCKS, _iq3_s_kernel, _tables
                _iq3_s_kernel[(triton.cdiv(n, TRITON_BLOCKS),)](flat, _tables(flat.device)["IQ3_S_grid"], out, n,
                                                                BLOCKS=TRITON_BLOCKS, enable_fp_fusion=False)
            else:
                _k45_into[grid](flat, out, n, FIVE=qtype == "Q5_K", BLOCKS=per_program, enable_fp_fusion=False)
    except Exception as e:  # a Triton that cannot build it: the torch path still works
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise
        log.warning("%s dequantization kernel failed (%s: %s); using the torch path", qtype, type(e).__name__, e)
        if state is not None:
            state.into = False
        return False
    return True
