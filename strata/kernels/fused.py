"""Triton kernels of the CUDA prefill path; strata.models.model imports this lazily and keeps a torch fallback for each.

Each function returns None where its caller should take the torch formula: Triton missing, a layout it does not
take, or its holder's kernels off. `state` is the caller's strata.triton_state.TritonState (a model's, shared by its
layers): a kernel that fails to build or launch turns `state.kernels` off, logged once, and that holder's later calls
return None at once; another holder is not affected. Without a state, a call tries the kernel every time."""
from __future__ import annotations

import contextlib
import logging

import torch

from strata.triton_state import TritonState

try:  # ships with CUDA builds of torch; absent elsewhere (callers then take their torch formula)
    import triton
    import triton.language as tl
except ImportError:
    triton = None

log = logging.getLogger("strata.kernels.fused")

MERGE_ROWS = 32  # query rows per program: with head_dim 128, 4,096 values of each input
SILU_COLS = 1024  # values of one row per program
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}  # gate_act's ACT for strata.models.args.ACTIVATIONS
ROPE_ROWS = 16  # token rows of one head per program

if triton is not None:
    # Stores round float32 to the output dtype to nearest even (Triton's default for a narrowing cast; its CPU
    # interpreter truncates to bfloat16 instead). T and the strides change with the chunk (a short last chunk):
    # not specialized, so one compile serves all
    @triton.jit(do_not_specialize=["T", "sp_h", "sp_t", "ss_h", "ss_t", "slp_h", "slp_t", "sls_h", "sls_t",
                                   "so_h", "so_t"])
    def _lse_merge_kernel(op, os_, lp, ls, out, T, sp_h, sp_t, ss_h, ss_t, slp_h, slp_t, sls_h, sls_t, so_h, so_t,
                          D: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
        h = tl.program_id(1).to(tl.int64)
        t = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        live = t < T
        m = live[:, None] & (d[None, :] < D)
        a = tl.load(lp + h * slp_h + t * slp_t, mask=live, other=0.0).to(tl.float32)
        b = tl.load(ls + h * sls_h + t * sls_t, mask=live, other=0.0).to(tl.float32)
        top = tl.maximum(a, b)
        wa = tl.exp(a - top)
        wb = tl.exp(b - top)
        inv = 1.0 / (wa + wb)  # weights exp(lse_x - logaddexp(lse_p, lse_s)), each part's share of the softmax
        x = tl.load(op + h * sp_h + t[:, None] * sp_t + d[None, :], mask=m, other=0.0).to(tl.float32)
        y = tl.load(os_ + h * ss_h + t[:, None] * ss_t + d[None, :], mask=m, other=0.0).to(tl.float32)
        r = x * (wa * inv)[:, None] + y * (wb * inv)[:, None]
        tl.store(out + h * so_h + t[:, None] * so_t + d[None, :], r.to(out.dtype.element_ty), mask=m)

    @triton.jit
    def gate_act(a, ACT: tl.constexpr):
        # float32 a -> silu(a) (ACT 0) or the tanh-approximated GELU (ACT 1): torch's 0.5 a (1 + tanh(z)) as
        # a * sigmoid(2z), exact in its negative tail where 1 + tanh(z) cancels (1 - 2 / (exp(2z) + 1) lost half
        # the bits of gelu(-4) on the GPU). The prefill's and the decode graphs' gated activations both take it
        if ACT == 0:
            return a / (1.0 + tl.exp(-a))
        else:
            z = 0.7978845608028654 * (a + 0.044715 * a * a * a)
            return a / (1.0 + tl.exp(-2.0 * z))

    @triton.jit(do_not_specialize=["s_g", "s_u", "s_o"])
    def _gated_kernel(g, u, out, cols, s_g, s_u, s_o, ACT: tl.constexpr, BLOCK: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        live = c < cols
        a = tl.load(g + r * s_g + c, mask=live, other=0.0).to(tl.float32)
        b = tl.load(u + r * s_u + c, mask=live, other=0.0).to(tl.float32)
        y = gate_act(a, ACT) * b  # act(a) * b, rounded once
        tl.store(out + r * s_o + c, y.to(out.dtype.element_ty), mask=live)

    @triton.jit(do_not_specialize=["T", "sx_t", "sc_t"])
    def _rope_kernel(x, cos, ssin, out, T, sx_t, sc_t, H: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr):
        h = tl.program_id(0)  # heads vary fastest: programs running together share their rows' cos/sin
        t = tl.program_id(1).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
        d = tl.arange(0, D)
        live = t[:, None] < T
        row = x + t[:, None] * sx_t + h * D
        a = tl.load(row + d[None, :], mask=live, other=0.0).to(tl.float32)
        b = tl.load(row + ((d + D // 2) % D)[None, :], mask=live, other=0.0).to(tl.float32)  # cat((x2, x1))
        c = tl.load(cos + t[:, None] * sc_t + d[None, :], mask=live, other=0.0).to(tl.float32)
        s = tl.load(ssin + t[:, None] * sc_t + d[None, :], mask=live, other=0.0).to(tl.float32)
        tl.store(out + t[:, None] * (H * D) + h * D + d[None, :], (a * c + b * s).to(out.dtype.element_ty), mask=live)

    @triton.jit
    def _route_row(x, c, live, logits, w_out, i_out, K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr,
                   CHOSEN: tl.constexpr, RENORM: tl.constexpr):
        """One row's float32 logits x (BLOCK,; `live` the first n) -> its top K's weights and expert ids, stored at
        w_out / i_out: softmax over all the logits then the top K (CHOSEN: the top K logits, then the softmax over
        those K: gpt-oss, rounded to the logits' dtype as the torch path's softmax), renormalized to sum 1 (RENORM).
        Ties go to the lower expert, picked one at a time as a running maximum."""
        x = tl.where(live, x, float("-inf"))
        if not CHOSEN:
            e = tl.exp(x - tl.max(x, 0))
            x = tl.where(live, e / tl.sum(e, 0), float("-inf"))
        j = tl.arange(0, KP)
        vals = tl.full((KP,), float("-inf"), tl.float32)
        ids = tl.zeros((KP,), tl.int64)
        for i in tl.static_range(K):
            best = tl.max(x, 0)
            at = tl.min(tl.where(x == best, c, BLOCK), 0)
            vals = tl.where(j == i, best, vals)
            ids = tl.where(j == i, at.to(tl.int64), ids)
            x = tl.where(c == at, float("-inf"), x)
        if CHOSEN:
            e = tl.exp(vals - tl.max(vals, 0))  # the pads' -inf give 0
            vals = (e / tl.sum(e, 0)).to(logits.dtype.element_ty).to(tl.float32)
        elif RENORM:
            vals = vals / tl.sum(tl.where(j < K, vals, 0.0), 0)
        tl.store(w_out + j, vals, mask=j < K)
        tl.store(i_out + j, ids, mask=j < K)

    @triton.jit
    def _route_kernel(logits, w_out, i_out, n, stride, K: tl.constexpr, KP: tl.constexpr,
                      BLOCK: tl.constexpr, CHOSEN: tl.constexpr, RENORM: tl.constexpr):
        """Row r's router over its logits (_route_row), float32 inside."""
        r = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, BLOCK)
        live = c < n
        x = tl.load(logits + r * stride + c, mask=live, other=0.0).to(tl.float32)
        _route_row(x, c, live, logits, w_out + r * K, i_out + r * K, K, KP, BLOCK, CHOSEN, RENORM)

    @triton.jit
    def _router_kernel(h, wr, bias, logits, count, w_out, i_out, n, dim, HAS_BIAS: tl.constexpr, R: tl.constexpr,
                       BLOCK_D: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr,
                       CHOSEN: tl.constexpr, RENORM: tl.constexpr):
        """One row's router logits and its route in one launch: each program takes R of the n logits (float32
        sums, the bias added, rounded to h's dtype as F.linear's output), then counts itself done on `count`; the
        last program to finish routes all n (_route_row) and sets `count` back to 0 for the next launch."""
        p = tl.program_id(0)
        rows = p * R + tl.arange(0, R)
        live_r = rows < n
        acc = tl.zeros((R,), tl.float32)
        for d0 in range(0, dim, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            ld = d < dim
            x = tl.load(h + d, mask=ld, other=0.0).to(tl.float32)
            w = tl.load(wr + rows.to(tl.int64)[:, None] * dim + d[None, :], mask=live_r[:, None] & ld[None, :],
                        other=0.0).to(tl.float32)
            acc += tl.sum(w * x[None, :], 1)
        if HAS_BIAS:
            acc += tl.load(bias + rows, mask=live_r, other=0.0).to(tl.float32)
        tl.store(logits + rows, acc.to(logits.dtype.element_ty), mask=live_r)
        # every thread's stores before the one thread's count (the barrier), whose acq_rel at GPU scope publishes
        # them to the last program; that one's loads go past L1 all the same
        tl.debug_barrier()
        if tl.atomic_add(count, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
            c = tl.arange(0, BLOCK)
            live = c < n
            x = tl.load(logits + c, mask=live, other=0.0, cache_modifier=".cg").to(tl.float32)
            _route_row(x, c, live, logits, w_out, i_out, K, KP, BLOCK, CHOSEN, RENORM)
            tl.atomic_xchg(count, 0, sem="acq_rel", scope="gpu")

    @triton.jit
    def _weigh_kernel(y, w, out, cols, K: tl.constexpr, BLOCK: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        live = c < cols
        acc = tl.zeros((BLOCK,), tl.float32)
        for j in tl.static_range(K):
            acc += tl.load(w + r * K + j) * tl.load(y + (r * K + j) * cols + c, mask=live, other=0.0).to(tl.float32)
        tl.store(out + r * cols + c, acc.to(out.dtype.element_ty), mask=live)

    @triton.jit(do_not_specialize=["T", "s_h", "s_t"])
    def _q8_0_widen_kernel(qs, ds, out, T, s_h, s_t, HD: tl.constexpr, ROWS: tl.constexpr):
        # qs / ds: the same uint8 cache seen as int8 / float16 (s_h, s_t: its head and row strides in bytes);
        # one program widens ROWS rows of one head: value d of a row is qs[d] times the float16 at byte HD + 2 (d // 32)
        # (strata.kernels.attention.to_q8_0's row)
        h = tl.program_id(0).to(tl.int64)
        t = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
        d = tl.arange(0, HD)
        live = (t < T)[:, None]
        row = tl.multiple_of(h * s_h + t.to(tl.int64) * s_t, HD // 16)[:, None]  # (q8_0_widen checks)
        q = tl.load(qs + row + d[None, :], mask=live, other=0).to(tl.float32)
        sc = tl.load(ds + (row + HD) // 2 + (d // 32)[None, :], mask=live, other=0.0).to(tl.float32)
        tl.store(out + (h * T + t.to(tl.int64)[:, None]) * HD + d[None, :], (q * sc).to(out.dtype.element_ty),
                 mask=live)


def weigh(y: torch.Tensor, w: torch.Tensor, state: TritonState | None = None) -> torch.Tensor | None:
    """The experts' outputs y (n * k, cols) summed per token with float32 weights w (n, k), float32 inside, rounded
    once to y's dtype -> (n, cols): one launch for a decode step's upcast, weighted sum and downcast. None where
    Triton is missing or failed."""
    if not _on(state) or y.dim() != 2 or not y.is_contiguous() or w.dtype != torch.float32:
        return None
    n, k = w.shape
    cols = y.shape[1]
    out = torch.empty(n, cols, device=y.device, dtype=y.dtype)
    try:
        with torch.cuda.device(y.device) if y.is_cuda else contextlib.nullcontext():
            _weigh_kernel[(n, triton.cdiv(cols, SILU_COLS))](y, w.contiguous(), out, cols, K=k, BLOCK=SILU_COLS)
    except Exception as e:
        _failed("experts' weighted sum", e, state)
        return None
    return out


def route(logits: torch.Tensor, k: int, chosen: bool, renorm: bool,
          state: TritonState | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """strata.models.moe.MoE.route's softmax routers in one launch: logits (N, n) -> (weights (N, k) float32, ids (N, k)
    int64). chosen: the top k logits (the router's bias already in them), softmax over those (topk_softmax); else softmax over all, the top
    k, renormalized where `renorm`. A decode step's five or so small launches become one (Qwen3-30B-A3B: topk
    alone was 9 us of a layer's ~105). None where Triton is missing or failed (the caller's torch ops)."""
    if not _on(state) or logits.dim() != 2 or logits.stride(1) != 1 or logits.shape[1] > 4096:
        return None
    N, n = logits.shape
    w = torch.empty(N, k, device=logits.device, dtype=torch.float32)
    ids = torch.empty(N, k, device=logits.device, dtype=torch.int64)
    try:
        with torch.cuda.device(logits.device) if logits.is_cuda else contextlib.nullcontext():
            _route_kernel[(N,)](logits, w, ids, n, logits.stride(0), K=k, KP=triton.next_power_of_2(k),
                                BLOCK=triton.next_power_of_2(n), CHOSEN=chosen, RENORM=renorm)
    except Exception as e:
        _failed("router", e, state)
        return None
    return w, ids


ROUTER_PROGRAMS = 64  # programs of a one-row router launch: each reads R = n / 64 rows of the router (at least 1)
ROUTER_TILE = 8192  # router values a program reads at once (R rows x BLOCK_D columns)


def router(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, count: torch.Tensor, k: int,
           chosen: bool, renorm: bool, state: TritonState | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`route` with its logits in the same launch, for one row h (dim,) against the router weight (n, dim) (and
    bias (n,)): -> (weights (1, k) float32, ids (1, k) int64). count: an int32 zero on h's device, left zero after
    each launch; a launch must not run beside another on the same count (one per MoE layer, one stream). A decode
    step's cuBLAS gemv and route launch become one (Qwen3-30B-A3B on an H100: 4.9 + 3.4 us a layer). None where
    Triton is missing or failed, or for a layout it does not take (the caller's two launches)."""
    if (not _on(state) or h.dim() != 1 or not h.is_contiguous() or not weight.is_contiguous()
            or weight.dtype != h.dtype or weight.shape[1] != h.shape[0] or weight.shape[0] > 4096
            or (bias is not None and not bias.is_contiguous())):
        return None
    n, dim = weight.shape
    r = max(1, triton.next_power_of_2(triton.cdiv(n, ROUTER_PROGRAMS)))
    logits = torch.empty(n, device=h.device, dtype=h.dtype)
    w = torch.empty(1, k, device=h.device, dtype=torch.float32)
    ids = torch.empty(1, k, device=h.device, dtype=torch.int64)
    try:
        with torch.cuda.device(h.device) if h.is_cuda else contextlib.nullcontext():
            _router_kernel[(triton.cdiv(n, r),)](
                h, weight, weight if bias is None else bias, logits, count, w, ids, n, dim, HAS_BIAS=bias is not None,
                R=r, BLOCK_D=min(triton.next_power_of_2(dim), ROUTER_TILE // r), K=k, KP=triton.next_power_of_2(k),
                BLOCK=triton.next_power_of_2(n), CHOSEN=chosen, RENORM=renorm)
    except Exception as e:
        _failed("router", e, state)
        return None
    return w, ids


def _on(state: TritonState | None) -> bool:
    """Whether this holder's calls take the kernels: Triton imported and none of them failed for it."""
    return triton is not None and (state is None or state.kernels)


def _failed(what: str, e: Exception, state: TritonState | None) -> None:
    """A kernel failed: say so and turn the holder's kernels off (once: its later calls no longer try them)."""
    log.warning("%s Triton kernel failed (%s: %s); using the torch formulas", what, type(e).__name__, e)
    if state is not None:
        state.kernels = False


def lse_merge(out_p: torch.Tensor, lse_p: torch.Tensor, out_s: torch.Tensor,
              lse_s: torch.Tensor, state: TritonState | None = None) -> torch.Tensor | None:
    """Two attention parts over disjoint keys merged by their log-sum-exp, in one pass (float32 inside).

    out_p, out_s: (1, nh, T, hd), any strides with the last one 1; lse_p, lse_s: (1, nh, T) float32.
    Returns (1, nh, T, hd) in out_p's dtype, laid out (1, T, nh, hd) underneath (the o-projection
    reads it as rows without a copy); None where Triton is missing or failed (the caller falls back)."""
    if not _on(state):
        return None
    _, nh, T, hd = out_p.shape
    if out_p.shape[0] != 1 or out_p.stride(-1) != 1 or out_s.stride(-1) != 1 or out_s.shape != out_p.shape:
        return None
    out = torch.empty(1, T, nh, hd, device=out_p.device, dtype=out_p.dtype).transpose(1, 2)
    if T == 0:
        return out
    try:
        # Triton launches on the current device (CPU tensors: only under TRITON_INTERPRET=1)
        with torch.cuda.device(out_p.device) if out_p.is_cuda else contextlib.nullcontext():
            _lse_merge_kernel[(triton.cdiv(T, MERGE_ROWS), nh)](
                out_p, out_s, lse_p, lse_s, out, T,
                out_p.stride(1), out_p.stride(2), out_s.stride(1), out_s.stride(2),
                lse_p.stride(1), lse_p.stride(2), lse_s.stride(1), lse_s.stride(2), out.stride(1), out.stride(2),
                D=hd, ROWS=MERGE_ROWS, BLOCK_D=triton.next_power_of_2(hd))
    except Exception as e:  # a Triton that cannot build the kernel: the torch formula still works
        _failed("LSE merge", e, state)
        return None
    return out


def gated(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu",
          state: TritonState | None = None) -> torch.Tensor | None:
    """act(gate) * up in one pass (SwiGLU or GeGLU), float32 inside, rounded once: gate, up (1, T, ffn), rows of any
    stride (the two halves of the fused gate/up GEMM's output). Returns a new (1, T, ffn) tensor in gate's dtype;
    None where Triton is missing or failed (the caller falls back to its torch formula)."""
    if not _on(state):
        return None
    if gate.dim() != 3 or gate.shape[0] != 1 or gate.shape != up.shape or gate.stride(-1) != 1 or up.stride(-1) != 1:
        return None
    if activation not in ACTIVATIONS:
        raise ValueError(f"no gated activation {activation!r} (known: {', '.join(ACTIVATIONS)})")
    _, T, cols = gate.shape
    out = torch.empty(1, T, cols, device=gate.device, dtype=gate.dtype)
    if T == 0 or cols == 0:
        return out
    try:
        with torch.cuda.device(gate.device) if gate.is_cuda else contextlib.nullcontext():
            _gated_kernel[(T, triton.cdiv(cols, SILU_COLS))](gate, up, out, cols, gate.stride(1), up.stride(1),
                                                             out.stride(1), ACT=ACTIVATIONS[activation],
                                                             BLOCK=SILU_COLS)
    except Exception as e:
        _failed("gated activation", e, state)
        return None
    return out


def rope(x: torch.Tensor, cos: torch.Tensor, ssin: torch.Tensor,
         state: TritonState | None = None) -> torch.Tensor | None:
    """strata.models.model.apply_rope in one pass, float32 inside, rounded once: x (1, T, heads, hd) with any row
    stride (a q or k view of the fused q/k/v GEMM's output), cos and ssin (T, 1, hd). Returns a new contiguous
    (1, T, heads, hd) tensor; None where Triton is missing or failed, or for a head_dim that is not a power
    of two (the caller falls back to the torch ops)."""
    if not _on(state):
        return None
    _, T, H, D = x.shape
    if (x.shape[0] != 1 or D & (D - 1) or x.stride(3) != 1 or x.stride(2) != D or cos.shape != (T, 1, D)
            or ssin.shape != cos.shape or cos.stride(0) != ssin.stride(0) or cos.stride(2) != 1
            or ssin.stride(2) != 1):
        return None
    out = torch.empty(1, T, H, D, device=x.device, dtype=x.dtype)
    if T == 0 or H == 0:
        return out
    try:
        with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
            _rope_kernel[(H, triton.cdiv(T, ROPE_ROWS))](x, cos, ssin, out, T, x.stride(1), cos.stride(0),
                                                          H=H, D=D, ROWS=ROPE_ROWS)
    except Exception as e:
        _failed("RoPE", e, state)
        return None
    return out


def q8_0_widen(x: torch.Tensor, dtype: torch.dtype, state: TritonState | None = None) -> torch.Tensor | None:
    """strata.kernels.attention.from_q8_0 of a cache's rows in one pass: x (1, heads, T, hd * 17 / 16) uint8 with the last
    two dims' strides a row's bytes and 1 (a narrowed cache) -> (1, heads, T, hd) in dtype, contiguous; None
    where Triton is missing or failed, or for another layout (the caller falls back to torch ops)."""
    if not _on(state) or x.dim() != 4 or x.shape[0] != 1 or x.stride(3) != 1 or x.stride(2) != x.shape[3]:
        return None
    _, H, T, W = x.shape
    hd = W // 34 * 32  # strata.kernels.attention.q8_head_dim (which imports this module)
    if hd & (hd - 1) or any(a % (hd // 16) for a in (x.storage_offset(), x.stride(1), x.stride(2))):
        return None  # (rows off the kernel's vector loads' alignment)
    out = torch.empty(1, H, T, hd, device=x.device, dtype=dtype)
    if T == 0 or H == 0:
        return out
    try:
        with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
            _q8_0_widen_kernel[(H, triton.cdiv(T, ROPE_ROWS))](x.view(torch.int8), x.view(torch.float16), out, T,
                                                                x.stride(1), x.stride(2), HD=hd, ROWS=ROPE_ROWS)
    except Exception as e:
        _failed("q8_0 widening", e, state)
        return None
    return out
