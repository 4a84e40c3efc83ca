"""Triton kernels of the CUDA-graph decode step besides attention and products: RMSNorm of one row, the gated
activation, RoPE with the q/k norms and the cache write, and the head's argmax.

A graph step is ~15 kernels a layer on one token; each small one costs a few microseconds of launch-bound
latency. One RMSNorm program replaces torch's row-norm kernel, and with the residual add before it, the add's
kernel too; one RoPE-and-store launch replaces the q/k norms, the rotation's three kernels and the two cache
writes; the norms and the gated activation also write the int8 rounding of x that a dp4a product after them reads
(`strata.quant.gemv.quantize_x`'s bytes). Positions are read on the device (graph replays move them).
Same arithmetic as the eager path's torch ops: rotations rounded as `x * cos` then `+ roll(x) * signed_sin`.
"""
from __future__ import annotations

import torch

from strata.kernels.fused import ACTIVATIONS

try:
    import triton
    import triton.language as tl
    from strata.kernels.fused import gate_act
    from strata.quant.gemv import int8_groups_store
except ImportError:
    triton = None


def available() -> bool:
    return triton is not None


if triton is not None:
    @triton.jit
    def _norm_out(x, g, t, live, w_ptr, out_ptr, q_ptr, s_ptr, n, eps, INT8: tl.constexpr):
        # x (BLOCK / 32, 32) float32 at offsets 32 g + t: x * rstd * w rounded once to out's dtype (torch's fused
        # rms_norm; gemma's float32 (1 + w) too: its weight is loaded as it is held), and with INT8 that rounded
        # row's int8 groups for the dp4a product after it (quantize_x's bytes, without its launch)
        i = g * 32 + t
        w = tl.load(w_ptr + i, mask=live, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(tl.sum(x * x, 1), 0) / n + eps)
        y = (x * rstd * w).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + i, y, mask=live)
        if INT8:
            int8_groups_store(y.to(tl.float32), g, t, live, q_ptr, s_ptr, n // 32)

    @triton.jit
    def _rms_norm(x_ptr, w_ptr, out_ptr, q_ptr, s_ptr, n, eps, BLOCK: tl.constexpr, INT8: tl.constexpr):
        # row program_id(0) (its n values n apart from the row before's, its int8 groups likewise)
        r = tl.program_id(0).to(tl.int64)
        x_ptr += r * n
        out_ptr += r * n
        if INT8:
            q_ptr += r * n
            s_ptr += r * (n // 32)
        g, t = tl.arange(0, BLOCK // 32)[:, None], tl.arange(0, 32)[None, :]
        live = g * 32 + t < n
        x = tl.load(x_ptr + g * 32 + t, mask=live, other=0.0).to(tl.float32)
        _norm_out(x, g, t, live, w_ptr, out_ptr, q_ptr, s_ptr, n, eps, INT8)

    @triton.jit
    def _add_rms_norm(h_ptr, y_ptr, w_ptr, hout_ptr, out_ptr, q_ptr, s_ptr, pw_ptr, ew_ptr, n, eps, pre_eps,
                      BLOCK: tl.constexpr, INT8: tl.constexpr, PRE: tl.constexpr, K: tl.constexpr = 0):
        # PRE: y is first RMS-normed with pw_ptr and rounded (gemma3's post-attention / post-MLP norm of the
        # product, before its residual add), as _rms_norm would have in a launch of its own. K > 0: y is K rows
        # (a token's experts' outputs) summed with the float32 weights at ew_ptr and rounded to h's dtype first,
        # as strata.kernels.fused.weigh would have in a launch of its own. Row program_id(0): its values n apart (its
        # experts' K rows and weights K n and K apart)
        r = tl.program_id(0).to(tl.int64)
        h_ptr += r * n
        hout_ptr += r * n
        out_ptr += r * n
        if K > 0:
            y_ptr += r * (K * n)
            ew_ptr += r * K
        else:
            y_ptr += r * n
        if INT8:
            q_ptr += r * n
            s_ptr += r * (n // 32)
        g, t = tl.arange(0, BLOCK // 32)[:, None], tl.arange(0, 32)[None, :]
        i = g * 32 + t
        live = i < n
        h = tl.load(h_ptr + i, mask=live, other=0.0).to(tl.float32)
        if K > 0:
            acc = tl.zeros((BLOCK // 32, 32), tl.float32)
            for j in tl.static_range(K):
                acc += tl.load(ew_ptr + j) * tl.load(y_ptr + j * n + i, mask=live, other=0.0).to(tl.float32)
            y = acc.to(hout_ptr.dtype.element_ty).to(tl.float32)
        else:
            y = tl.load(y_ptr + i, mask=live, other=0.0).to(tl.float32)
        if PRE:
            pw = tl.load(pw_ptr + i, mask=live, other=0.0).to(tl.float32)
            ry = 1.0 / tl.sqrt(tl.sum(tl.sum(y * y, 1), 0) / n + pre_eps)
            y = (y * ry * pw).to(hout_ptr.dtype.element_ty).to(tl.float32)
        s = (h + y).to(hout_ptr.dtype.element_ty)  # the residual rounded as torch's h + y rounds it
        tl.store(hout_ptr + i, s, mask=live)
        _norm_out(s.to(tl.float32), g, t, live, w_ptr, out_ptr, q_ptr, s_ptr, n, eps, INT8)

    @triton.jit
    def _act_mul(g_ptr, u_ptr, out_ptr, q_ptr, s_ptr, n, in_stride, ACT: tl.constexpr, BLOCK: tl.constexpr,
                 INT8: tl.constexpr):
        # act(gate) * up of row program_id(1) (its gate and up in_stride apart from the row before's; its n outputs
        # and int8 groups n apart), float32 inside and rounded once, BLOCK values a program; with INT8 the rounded
        # values' int8 groups too (n a multiple of 32)
        r = tl.program_id(1).to(tl.int64)
        g_ptr += r * in_stride
        u_ptr += r * in_stride
        out_ptr += r * n
        if INT8:
            q_ptr += r * n
            s_ptr += r * (n // 32)
        g = tl.program_id(0) * (BLOCK // 32) + tl.arange(0, BLOCK // 32)[:, None]
        t = tl.arange(0, 32)[None, :]
        i = g * 32 + t
        live = i < n
        a = tl.load(g_ptr + i, mask=live, other=0.0).to(tl.float32)
        b = tl.load(u_ptr + i, mask=live, other=0.0).to(tl.float32)
        y = (gate_act(a, ACT) * b).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + i, y, mask=live)
        if INT8:
            int8_groups_store(y.to(tl.float32), g, t, live, q_ptr, s_ptr, n // 32)

    @triton.jit
    def _argmax_blocks(x_ptr, n, vals_ptr, idx_ptr, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + i, mask=i < n, other=float("-inf")).to(tl.float32)
        v = tl.max(x, 0)
        # the first index holding the maximum (min of a where, not max's return_indices: older interpreters
        # return those with a shape); a NaN row matches nowhere and keeps the block's first index
        j = tl.min(tl.where(x == v, i, n), 0)
        tl.store(vals_ptr + tl.program_id(0), v)
        tl.store(idx_ptr + tl.program_id(0), tl.where(j < n, j, tl.program_id(0) * BLOCK).to(tl.int64))

    @triton.jit
    def _argmax_final(vals_ptr, idx_ptr, parts, out_ptr, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        v = tl.load(vals_ptr + i, mask=i < parts, other=float("-inf"))
        b = tl.min(tl.where(v == tl.max(v, 0), i, parts), 0)  # the first block wins a tie
        tl.store(out_ptr, tl.load(idx_ptr + tl.where(b < parts, b, 0)))

    @triton.jit
    def _q8_store(ptr, sptr, off, r, NB: tl.constexpr, COLS: tl.constexpr):
        # r (HD / 32, 32) float32 -> the q8_0 row of one cached position at byte `off` (strata.kernels.attention.to_q8_0's
        # bytes: the values, then the scales d = amax / 127 as float16; values roundf(r * (1 / d)) with the float32
        # d, correctly rounded divisions as torch's)
        b = tl.arange(0, NB)
        d = tl.math.div_rn(tl.max(tl.abs(r), 1), tl.full(b.shape, 127.0, tl.float32))
        inv = tl.where(d == 0, 0.0, tl.math.div_rn(tl.full(b.shape, 1.0, tl.float32), tl.where(d == 0, 1.0, d)))
        y = r * inv[:, None]
        a = tl.abs(y)
        f = tl.floor(a)
        q = f + tl.floor(2 * (a - f))  # C's roundf: halves away from zero
        q = tl.where(y < 0, -q, q)
        j = tl.arange(0, COLS)
        tl.store(ptr + off + (b * COLS)[:, None] + j[None, :], q.to(tl.int8))
        tl.store(sptr + (off + NB * COLS) // 2 + b, d.to(tl.float16))

    @triton.jit
    def _rope_store(qkv_ptr, cos_ptr, ssin_ptr, pos_ptr, q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, qw_ptr, kw_ptr, eps,
                    skh, sks, svh, svs, slot_ptr, sk_slot, sv_slot, NH: tl.constexpr, NKV: tl.constexpr,
                    HD: tl.constexpr, COLS: tl.constexpr, Q8: tl.constexpr, QK_NORM: tl.constexpr,
                    ROWS: tl.constexpr = False):
        # a head's HD values as (HD / COLS, COLS): COLS = HD, or 32 with Q8 (a q8_0 cache: kc_ptr / vc_ptr its bytes
        # as int8, ks_ptr / vs_ptr as float16, strides in bytes; each row of the tile one block). QK_NORM: q and k
        # heads are first RMS-normed over their HD values with qw_ptr / kw_ptr (rounded once, as _norm_out).
        # ROWS: row program_id(1) of a decode batch: its qkv, cos, ssin and q rows after the rows before it, its
        # cache row pos_ptr[row] (< 0: none, a padding row) in slot slot_ptr[row] (sk_slot, sv_slot apart)
        h = tl.program_id(0)
        d = tl.arange(0, HD // COLS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
        if ROWS:
            row = tl.program_id(1)
            qkv_ptr += row * ((NH + 2 * NKV) * HD)
            cos_ptr += row * HD
            ssin_ptr += row * HD
            q_ptr += row * (NH * HD)
            pos = tl.load(pos_ptr + row)
            slot = tl.load(slot_ptr + row).to(tl.int64)
            kc_ptr += slot * sk_slot  # (bytes with Q8: the float16 views' offsets are halves of these)
            vc_ptr += slot * sv_slot
            ks_ptr += slot * sk_slot // 2
            vs_ptr += slot * sv_slot // 2
            store = pos >= 0
        else:
            pos = tl.load(pos_ptr)
            store = True
        x = tl.load(qkv_ptr + h * HD + d)
        if h < NH + NKV:  # q or k: rotate (rotate-half as a roll by HD/2 times the signed sin)
            dr = (d + HD // 2) % HD
            xr = tl.load(qkv_ptr + h * HD + dr).to(tl.float32)
            if QK_NORM:  # the partner value xr is the same head's: one rstd for both
                xf = x.to(tl.float32)
                rstd = 1.0 / tl.sqrt(tl.sum(tl.sum(xf * xf, 1), 0) / HD + eps)
                if h < NH:
                    w = tl.load(qw_ptr + d).to(tl.float32)
                    wr = tl.load(qw_ptr + dr).to(tl.float32)
                else:
                    w = tl.load(kw_ptr + d).to(tl.float32)
                    wr = tl.load(kw_ptr + dr).to(tl.float32)
                x = (xf * rstd * w).to(x.dtype)
                xr = (xr * rstd * wr).to(x.dtype).to(tl.float32)
            c = tl.load(cos_ptr + d).to(tl.float32)
            s = tl.load(ssin_ptr + d).to(tl.float32)
            a = (x.to(tl.float32) * c).to(x.dtype).to(tl.float32)  # x * cos, rounded as torch rounds it
            r = a + xr * s
            if h < NH:
                tl.store(q_ptr + h * HD + d, r.to(q_ptr.dtype.element_ty))
            elif store:
                if Q8:
                    k = r.to(x.dtype).to(tl.float32)
                    _q8_store(kc_ptr, ks_ptr, (h - NH) * skh + pos * sks, k, HD // COLS, COLS)
                else:
                    tl.store(kc_ptr + (h - NH) * skh + pos * sks + d, r.to(x.dtype).to(kc_ptr.dtype.element_ty))
        elif store:
            if Q8:
                _q8_store(vc_ptr, vs_ptr, (h - NH - NKV) * svh + pos * svs, x.to(tl.float32), HD // COLS, COLS)
            else:
                tl.store(vc_ptr + (h - NH - NKV) * svh + pos * svs + d, x.to(vc_ptr.dtype.element_ty))


ARGMAX_BLOCK = 4096  # values a program of the first pass reduces


def argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax of a 1-D row (0-dim int64; the first index among equal maxima) in two launches: block maxima,
    then the maximum of those. torch's one-block reduction took 37 us for a 128,256-word row on an H200."""
    n = x.numel()
    parts = triton.cdiv(n, ARGMAX_BLOCK)
    vals = torch.empty(parts, dtype=torch.float32, device=x.device)
    idx = torch.empty(parts, dtype=torch.int64, device=x.device)
    out = torch.empty((), dtype=torch.int64, device=x.device)
    _argmax_blocks[(parts,)](x, n, vals, idx, BLOCK=ARGMAX_BLOCK)
    _argmax_final[(1,)](vals, idx, parts, out, BLOCK=triton.next_power_of_2(parts))
    return out


def int8_out(x: torch.Tensor, int8: bool, rows: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_x's (q, s) buffers for x's `rows` rows (int8: the kernel fills them), else placeholders it ignores."""
    n = x.numel() // rows
    if not int8:
        return x, x
    if n % 32:
        raise ValueError(f"an int8 row takes a multiple of 32 values, got {n}")
    return (torch.empty((rows, n), dtype=torch.int8, device=x.device),
            torch.empty((rows, n // 32), dtype=torch.float32, device=x.device))


def _row_block(n: int) -> int:
    return max(32, triton.next_power_of_2(n))


def _rows_of(x: torch.Tensor, rows: int) -> int:
    """x's values per row, for `rows` contiguous rows of one length."""
    if rows < 1 or x.numel() % rows or not x.is_contiguous():
        raise ValueError(f"{rows} rows of one length, contiguous, from {tuple(x.shape)}")
    return x.numel() // rows


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, int8: bool = False, rows: int = 1):
    """One row x (..., n) with n = x.numel(): x * rsqrt(mean(x^2) + eps) * weight, float32 inside, rounded once
    (weight in x's dtype, or gemma's float32 (1 + w)). int8: (out, (q, s)), the second quantize_x's of out.
    rows: x is that many rows of n = x.numel() / rows, each normed alone, in one launch."""
    n = _rows_of(x, rows)
    out = torch.empty_like(x)
    q, s = int8_out(x, int8, rows)
    _rms_norm[(rows,)](x, weight, out, q, s, n, eps, BLOCK=_row_block(n), INT8=int8)
    return (out, (q, s)) if int8 else out


def add_rms_norm(h: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float, int8: bool = False,
                 pre: tuple[torch.Tensor, float] | None = None, experts: torch.Tensor | None = None, rows: int = 1):
    """The residual add and the next norm of one row in one launch: (h + y, rms_norm(h + y) * weight), the sum
    rounded to h's dtype first (what `h = h + y` then a norm compute). int8: a third item, quantize_x's (q, s) of
    the normed row. pre (weight, eps): y is rms_norm(y, weight, eps) first (gemma3's post norms). experts: y is
    k rows (a token's experts' outputs, in h's dtype) and these their float32 weights (k,): their weighted sum,
    rounded to h's dtype, is the y added (strata.kernels.fused.weigh's, without its launch). rows: h is that many rows
    (y, experts likewise, row after row), each its own add and norm, in one launch."""
    n = _rows_of(h, rows)
    k = 0 if experts is None else experts.numel() // rows
    if y.numel() != h.numel() * max(k, 1) or not (h.is_contiguous() and y.is_contiguous()) or (k and pre is not None) \
            or (k and (experts.dtype != torch.float32 or not experts.is_contiguous())):
        raise ValueError("add_rms_norm wants two contiguous rows of one length (or k rows with k float32 weights, "
                         "and no pre norm)")
    h_out, out = torch.empty_like(h), torch.empty_like(h)
    q, s = int8_out(h, int8, rows)
    pw, pre_eps = pre if pre is not None else (weight, 0.0)
    _add_rms_norm[(rows,)](h, y, weight, h_out, out, q, s, pw, h if experts is None else experts, n, eps, pre_eps,
                        BLOCK=_row_block(n), INT8=int8, PRE=pre is not None, K=k)
    return (h_out, out, (q, s)) if int8 else (h_out, out)


ACT_COLS = 1024  # values of the gated row a program takes


def act_mul(gate: torch.Tensor, up: torch.Tensor, activation: str, int8: bool = False):
    """act(gate) * up of one row (any shapes of n values, last dims contiguous), float32 inside, rounded once:
    SwiGLU's or GeGLU's one launch instead of two. int8: (out, quantize_x's (q, s) of out)."""
    n = gate.numel()
    if up.numel() != n or gate.stride(-1) != 1 or up.stride(-1) != 1 or activation not in ACTIVATIONS:
        raise ValueError(f"act_mul wants two rows of one length, last dims contiguous, and one of {list(ACTIVATIONS)}")
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    q, s = int8_out(out, int8)
    _act_mul[(triton.cdiv(n, ACT_COLS), 1)](gate, up, out, q, s, n, 0, ACT=ACTIVATIONS[activation], BLOCK=ACT_COLS,
                                            INT8=int8)
    return (out, (q, s)) if int8 else out


def act_mul_rows(gu: torch.Tensor, activation: str, int8: bool = False):
    """act(gate) * up of each row of gu (R, 2 f), its gate then its up (a token's experts' gate/up products) ->
    (R, f) in gu's dtype, float32 inside, rounded once: one launch for all rows. int8: (out, quantize_x's (q, s)
    of out, row by row), so the down products read it without a launch of their own."""
    R, f2 = gu.shape
    f = f2 // 2
    if gu.dim() != 2 or f2 % 2 or not gu.is_contiguous() or activation not in ACTIVATIONS or (int8 and f % 32):
        raise ValueError(f"act_mul_rows wants contiguous (rows, 2 f) rows (f a multiple of 32 with int8), and one "
                         f"of {list(ACTIVATIONS)}")
    out = torch.empty((R, f), dtype=gu.dtype, device=gu.device)
    q, s = ((torch.empty((R, f), dtype=torch.int8, device=gu.device),
             torch.empty((R, f // 32), dtype=torch.float32, device=gu.device)) if int8 else (out, out))
    _act_mul[(triton.cdiv(f, ACT_COLS), R)](gu, gu[:, f:], out, q, s, f, f2, ACT=ACTIVATIONS[activation],
                                            BLOCK=ACT_COLS, INT8=int8)
    return (out, (q, s)) if int8 else out


def rope_store(qkv: torch.Tensor, cos: torch.Tensor, ssin: torch.Tensor, pos: torch.Tensor, nh: int, nkv: int,
               k_cache: torch.Tensor, v_cache: torch.Tensor, qk_norm: tuple | None = None) -> torch.Tensor:
    """qkv (nh + 2 nkv, hd) of one token -> rotated q (nh, hd); rotated k and v written at cache position pos
    (a device tensor). k_cache, v_cache: (nkv, S, hd) views, last dim contiguous (a q8_0 cache: uint8 rows of
    hd * 17 / 16 bytes, written as strata.kernels.attention.to_q8_0 writes them). cos, ssin: (hd,). qk_norm (q weight,
    k weight, eps): each q and k head RMS-normed first (qwen3, gemma3), rounded once as rms_norm rounds."""
    hd = qkv.shape[-1]
    if not qkv.is_contiguous() or k_cache.stride(2) != 1 or v_cache.stride(2) != 1:
        raise ValueError("rope_store wants a contiguous qkv row and caches with a contiguous last dim")
    q8 = k_cache.dtype == torch.uint8
    q = torch.empty(nh, hd, dtype=qkv.dtype, device=qkv.device)
    kc, vc, ks, vs = k_cache, v_cache, k_cache, v_cache
    if q8:
        kc, vc, ks, vs = (k_cache.view(torch.int8), v_cache.view(torch.int8), k_cache.view(torch.float16),
                          v_cache.view(torch.float16))
    qw, kw, eps = qk_norm if qk_norm is not None else (qkv, qkv, 0.0)
    _rope_store[(nh + 2 * nkv,)](qkv, cos, ssin, pos, q, kc, vc, ks, vs, qw, kw, eps, k_cache.stride(0),
                                 k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), pos, 0, 0, NH=nh, NKV=nkv,
                                 HD=hd, COLS=32 if q8 else hd, Q8=q8, QK_NORM=qk_norm is not None)
    return q


def rope_store_rows(qkv: torch.Tensor, cos: torch.Tensor, ssin: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor,
                    nh: int, nkv: int, k_caches: torch.Tensor, v_caches: torch.Tensor,
                    qk_norm: tuple | None = None) -> torch.Tensor:
    """rope_store for R tokens of a decode batch in one launch: qkv (R, nh + 2 nkv, hd), cos and ssin (R, hd) each
    row's own -> rotated q (R, nh, hd); row t's k and v written at cache row rows[t] of slot slots[t] (device
    tensors (R,); rows[t] < 0: nothing written, a padding row). k_caches, v_caches: every slot's caches
    (slots, nkv, S, width) (strata.models.model.Transformer.slot_caches), last dim contiguous."""
    R, hd = qkv.shape[0], qkv.shape[-1]
    if (not qkv.is_contiguous() or qkv.shape[1] != nh + 2 * nkv or k_caches.stride(3) != 1 or v_caches.stride(3) != 1
            or tuple(cos.shape) != (R, hd) or tuple(ssin.shape) != (R, hd) or not cos.is_contiguous()
            or not ssin.is_contiguous() or rows.numel() != R or slots.numel() != R):
        raise ValueError("rope_store_rows wants contiguous (R, nh + 2 nkv, hd) rows, (R, hd) cos and ssin, R rows and "
                         "slots, and caches with a contiguous last dim")
    q8 = k_caches.dtype == torch.uint8
    q = torch.empty(R, nh, hd, dtype=qkv.dtype, device=qkv.device)
    kc, vc, ks, vs = k_caches, v_caches, k_caches, v_caches
    if q8:
        kc, vc, ks, vs = (k_caches.view(torch.int8), v_caches.view(torch.int8), k_caches.view(torch.float16),
                          v_caches.view(torch.float16))
    qw, kw, eps = qk_norm if qk_norm is not None else (qkv, qkv, 0.0)
    _rope_store[(nh + 2 * nkv, R)](qkv, cos, ssin, rows, q, kc, vc, ks, vs, qw, kw, eps, k_caches.stride(1),
                                   k_caches.stride(2), v_caches.stride(1), v_caches.stride(2), slots,
                                   k_caches.stride(0), v_caches.stride(0), NH=nh, NKV=nkv, HD=hd,
                                   COLS=32 if q8 else hd, Q8=q8, QK_NORM=qk_norm is not None, ROWS=True)
    return q
