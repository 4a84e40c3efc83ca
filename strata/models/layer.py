"""A decoder layer written once: the body every path runs, over the ops of its path.

`layer(blk, h, pend, ops)` is the one definition of what a layer does: the attention's norm, q/k/v (and qwen3_5's
output gate), the attention kind over its cache (or a linear-attention step), the output projection, the
post-attention residual add (gemma3: normed first), the MLP's norm, a gated MLP or the experts. A path supplies its
kernels as `ops`, so each keeps its own arithmetic:

* `PrefillOps`: chunked prefill and prefill groups (Block.forward): RoPE on q and k (fused on CUDA), FlexAttention
  / cuDNN / flash over the cache (Attention.attend), the fused gated activation.
* `RowsOps`: eager decode of a few rows at one position or of a batch of sequences' steps (Transformer._run,
  decode_seqs): bound by dispatch, so q and k roped in one op, one unmasked attention call per row, weight-only
  products left in bfloat16 until added to the float32 residual.
* the CUDA graphs' ops (strata.decode.graphs, strata.decode.batch_graphs): Triton norms that add the previous product,
  rope with the cache write in one launch, split-K attention, dp4a products reading x's int8 rounding.

A layer leaves its MLP's product pending, (y, post norm or None), for the next layer's first norm to add: the graph
ops add it in the norm's launch, the eager ops add it first and then norm, which is the order a layer-by-layer
coding has (`finish` adds the last one). A new attention kind is a function beside `attention` over the ops' few
entry points; every path then has it.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from strata.kernels.attention import (_FP8, BF16_ATTENTION_FROM, Q8_0, _bf16_cache_attention, apply_rope, chunk_attention,
                        decode_attention, from_cache, rope_rows, sink_attention, store_rows, to_cache,
                        window_attention)
from strata.models.mla import attend_segments, latent_attention
from strata.models.resident import ResidentMatrices
from strata.models.weight_only import Products, dense_products

NOTHING = (None, None)  # no product pending (the first layer's input)
EAGER_INT8 = {"in": False, "wo": False, "mlp": False, "w2": False}  # torch's products read x as it is


class LayerMats(NamedTuple):
    """A layer's products for one call: `mm` its four products (each x -> x @ W.T, taking the int8 rounding of x as
    xq= where `int8` says its kernel reads that); `int8` per input: "in" (q/k/v or the linear attention's inputs),
    "wo", "mlp" (gate/up or the experts), "w2"; `src` what a linear-attention layer's products come from."""
    mm: Products
    int8: dict
    src: object = None


def layer(blk, h: torch.Tensor, pend: tuple, ops) -> tuple[torch.Tensor, tuple]:
    """One decoder layer on the residual h plus the previous layer's pending product -> (residual, this layer's
    MLP product and the norm it still takes, not yet added)."""
    mats = ops.products(blk)
    h, x, xq = ops.add_norm(h, pend, blk.attn_norm, mats.int8["in"])
    if blk.linear:
        o = ops.linear(blk, h, x, xq, mats)
    elif blk.latent:  # MLA (strata.models.mla): the same body on every path, over the path's row segments
        o = latent_attention(blk.attn, x, ops).to(h.dtype)
    else:
        o = attention(blk.attn, h, x, xq, mats, ops)
    h, x, xq = ops.add_norm(h, (o, blk.attn_post_norm), blk.mlp_norm, mats.int8["mlp"])
    if blk.moe:  # routing and the chosen experts (strata.models.moe)
        return h, ops.experts(blk, h, x, xq)
    z, zq = ops.act(blk.mlp, mats.mm.w13(x, **xq), mats.int8["w2"])
    return h, (mats.mm.w2(z, **zq), blk.mlp_post_norm)


def attention(a, h: torch.Tensor, x: torch.Tensor, xq: dict, mats: LayerMats, ops) -> torch.Tensor:
    """Grouped-query attention over the layer's cache: q, k, v of the normed rows x, the output gate split off
    (qwen3_5), the path's q/k norms, rope with the cache write and attention (ops.attend), the gate, the output
    projection (reading y's int8 rounding from the attention's launch where the path makes one)."""
    qkv, gate = split_gate(a, mats.mm.qkv(x, **xq))
    y, yq = ops.attend(a, qkv, h, mats.int8["wo"] and gate is None)
    return mats.mm.wo(gated(y, gate), **yq)


def split_gate(a, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q, k, v's values and the output gate's (wqkv's last nh * hd rows: qwen3_5), on the last dim."""
    if not a.gated:
        return qkv, None
    n = (a.nh + 2 * a.nkv) * a.hd
    return qkv[..., :n], qkv[..., n:]


def gated(y: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    return y if gate is None else y * torch.sigmoid(gate.to(y.dtype)).view(y.shape)


def gate(gate: torch.Tensor, up: torch.Tensor, activation: str, fused: bool = True,
         triton_state=None) -> torch.Tensor:
    """act(gate) * up: SwiGLU or GeGLU with the tanh-approximated GELU; one Triton kernel on CUDA unless not fused
    (it falls back on `triton_state`, a strata.triton_state.TritonState, to the torch formula)."""
    if gate.is_cuda and fused:
        from strata.kernels.fused import gated as fused_gated
        y = fused_gated(gate, up, activation, triton_state)
        if y is not None:
            return y
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    return F.silu(gate) * up


def run_layers(blocks, h: torch.Tensor, ops) -> torch.Tensor:
    """The layers in turn, each adding the one before's product; then the last one's."""
    pend = NOTHING
    for blk in blocks:
        h, pend = layer(blk, h, pend, ops)
    return ops.finish(h, pend)


class PrefillOps:
    """Chunked prefill's ops: T rows (1, T, dim) at `pos`, rope tables per kind; for a prefill group, `segs` gives a
    layer's sequences by its key, [(pos, n, (k_cache, v_cache))] in row order (Attention._segments). Each layer's
    matrices read as its weights hold them (a resident layer's dequantized into the scratch just before each
    product)."""

    def __init__(self, pos: int, tabs: dict, segs: Callable[[str], list] | None = None):
        self.pos, self.tabs, self.segs = pos, tabs, segs
        self.selected: list | None = None  # DSA: the last indexer's positions per segment (strata.models.mla)

    def products(self, blk) -> LayerMats:
        w = blk.weights.get()
        return LayerMats(dense_products(w, None), EAGER_INT8, w)

    def add_norm(self, h, pend, norm, int8: bool):
        y, post = pend
        if y is not None:
            h = h + (y if post is None else post(y))
        return h, norm(h), {}

    def finish(self, h, pend):
        return self.add_norm(h, pend, _identity, False)[0]

    def attend(self, a, qkv: torch.Tensor, h, want_yq: bool):
        """q/k norms per head, RoPE on q and k (rope on the (1, T, heads, hd) rows, then (1, heads, T, hd) views: q's
        layout is what warm_chunk_attention builds cuDNN's graphs for), the rows into the cache and the attention
        over what each may see (Attention._cached; a group's sequences each on its own caches)."""
        T = qkv.shape[1]
        cos, sin = self.tabs[a.rope_kind]
        q, k, v = qkv.split([a.nh * a.hd, a.nkv * a.hd, a.nkv * a.hd], dim=-1)
        q, k = q.view(1, T, a.nh, a.hd), k.view(1, T, a.nkv, a.hd)
        if a.q_norm is not None:  # over each head's hd values, before RoPE
            q, k = a.q_norm(q), a.k_norm(k)
        q = apply_rope(q, cos, sin, a.fused, a.triton_state)    # (1, T, nh, hd)
        k = apply_rope(k, cos, sin, a.fused, a.triton_state)    # (1, T, nkv, hd)
        v = v.view(1, T, a.nkv, a.hd)
        if self.segs is None:
            y = a._cached(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.pos, T)
        else:
            y = torch.cat(a._segments(q, k, v, self.segs(a.key)), dim=2)
        return y.transpose(1, 2).reshape(1, T, a.nh * a.hd), {}

    def segments(self, a, T: int) -> list:
        """The rows' (pos, n, caches) in order: the chunk on the layer's cache, or a group's sequences."""
        return [(self.pos, T, (a.k_cache, a.v_cache))] if self.segs is None else self.segs(a.key)

    def latent(self, a, pr):
        return attend_segments(a, pr, self.segments(a, pr.lat.shape[0]), self, pr.q_rot.dtype)

    def linear(self, blk, h, x, xq, mats: LayerMats):
        return blk.attn(x, mats.src, self.pos)

    def act(self, mlp, gu: torch.Tensor, int8: bool):
        g, up = gu.split(mlp.ffn, dim=-1)
        return gate(g, up, mlp.activation, mlp.fused, mlp.triton_state), {}

    def experts(self, blk, h, x, xq):
        return blk.mlp(x), blk.mlp_post_norm


def _identity(x):
    return x


class RowsOps:
    """Eager decode's ops: rows (T, dim) of one sequence at `pos` (T <= DECODE_T), or of a batch of sequences'
    steps (positions[t], caches[layer][t], slots: a device tensor of the rows' slots for linear-attention layers).
    Every view, cast and copy that can go does (a decode step is bound by dispatch); weight-only products (`wo`:
    layer -> LayerWeightOnly) stay in bfloat16 until added to the float32 residual. Resident matrices multiply on
    their blocks where the fused kernels can, else dequantized into the scratch as prefill's."""

    def __init__(self, tabs: dict, device, pos: int | None = None, wo: dict | None = None,
                 positions: list[int] | None = None, caches: Callable | None = None,
                 slots: torch.Tensor | None = None):
        self.tabs, self.device, self.pos, self.wo = tabs, device, pos, wo or {}
        self.positions, self.caches, self.slots = positions, caches, slots
        self.selected: list | None = None  # DSA: the last indexer's positions per segment (strata.models.mla)

    def products(self, blk) -> LayerMats:
        r, wo = blk.weights, self.wo.get(blk.key)
        if wo is None and isinstance(r, ResidentMatrices) and r.fused_decode_ok(self.device):
            return LayerMats(r.products(), EAGER_INT8, r)  # on the blocks: no per-token dequantization
        return LayerMats(dense_products(r.get(), wo), EAGER_INT8, r.get())

    def add_norm(self, h, pend, norm, int8: bool):
        y, post = pend
        if y is not None:
            h = h + (y if post is None else post.rows(y))
        return h, norm.rows(h), {}

    def finish(self, h, pend):
        y, post = pend
        return h + (y if post is None else post.rows(y))

    def attend(self, a, qkv: torch.Tensor, h, want_yq: bool):
        """q and k normed (qwen3, gemma3) and roped in one op each, then each row's attention over its cache."""
        T = qkv.shape[0]
        nh, nkv, hd = a.nh, a.nkv, a.hd
        qkv = qkv.reshape(T, nh + 2 * nkv, hd)
        cos, sin = self.tabs[a.rope_kind]
        if a.q_norm is not None:
            qk = rope_rows(torch.cat((a.q_norm.rows(qkv[:, :nh]), a.k_norm.rows(qkv[:, nh:nh + nkv])), 1), cos, sin)
        else:
            qk = rope_rows(qkv[:, :nh + nkv], cos, sin)  # in h's dtype (a bfloat16 qkv is promoted)
        weight_only = self.wo.get(a.key) is not None
        if self.positions is None:
            a.check(self.pos, T)
            return attend_rows(a, qk, qkv, self.pos, a.k_cache, a.v_cache, h.dtype, weight_only), {}
        ys = []
        for t, (pos, (kc, vc)) in enumerate(zip(self.positions, self.caches(a.key))):
            a.check(pos, 1)
            ys.append(attend_rows(a, qk[t:t + 1], qkv[t:t + 1], pos, kc, vc, h.dtype, weight_only))
        return torch.cat([r.to(ys[0].dtype) for r in ys]), {}  # (a row's attention may take another kernel)

    def segments(self, a, T: int) -> list:
        """The rows' (pos, n, caches) in order: one sequence's T rows, or each batch row at its position."""
        if self.positions is None:
            return [(self.pos, T, (a.k_cache, a.v_cache))]
        return [(p, 1, c) for p, c in zip(self.positions, self.caches(a.key))]

    def latent(self, a, pr):
        return attend_segments(a, pr, self.segments(a, pr.lat.shape[0]), self, pr.q_rot.dtype)

    def linear(self, blk, h, x, xq, mats: LayerMats):
        """The Gated DeltaNet step: one sequence's rows from its states (GatedDeltaNet.forward), or each batch row
        from its slot's (mix_rows), the states left after them."""
        a = blk.attn
        if self.positions is None:
            return a(x[None], mats.src, self.pos)[0].to(h.dtype)
        lp = a.products() if a.wqkv is not None else mats.src.linear()
        live = torch.ones(h.shape[0], dtype=torch.bool, device=h.device)
        return a.mix_rows(x, lp, self.slots, live).to(h.dtype)

    def act(self, mlp, gu: torch.Tensor, int8: bool):
        """silu(gate) * up in the products' dtype (bfloat16 from weight-only ones: the next kernel rounds its input
        to that anyway)."""
        g, up = gu.split(mlp.ffn, dim=-1)
        if mlp.activation == "silu":
            return F.silu(g) * up, {}
        return gate(g, up, mlp.activation, mlp.fused, mlp.triton_state), {}

    def experts(self, blk, h, x, xq):
        return blk.mlp(x).to(h.dtype), blk.mlp_post_norm  # only the chosen experts' matrices are read


def attend_rows(a, qk: torch.Tensor, qkv: torch.Tensor, pos: int, kc: torch.Tensor, vc: torch.Tensor,
                dtype: torch.dtype, weight_only: bool) -> torch.Tensor:
    """T decode rows' attention at [pos, pos + T) of attention layer `a`: their k and v into the cache (kc, vc),
    then q against what it may see -> (T, nh * hd). qk: q and k roped (T, nh + nkv, hd); qkv: v after them."""
    T = qk.shape[0]
    nh, hd = a.nh, a.hd
    k_new, v_new = qk[:, nh:].transpose(0, 1), qkv[:, nh + a.nkv:].transpose(0, 1)  # (nkv, T, hd)
    if kc.dtype in _FP8 or kc.dtype == Q8_0:  # clamped, or quantized in blocks (to_cache)
        k_new, v_new = to_cache(k_new, kc.dtype), to_cache(v_new, vc.dtype)
    if a.window is not None or a.sinks is not None:  # a window layer's cache may be a ring
        store_rows(kc, k_new, pos)
        store_rows(vc, v_new, pos)
        w = a.window if a.window is not None else pos + T
        if pos + T > w or a.sinks is not None:
            q = qk[:, :nh].transpose(0, 1).unsqueeze(0)  # (1, nh, T, hd)
            if a.window is None:  # a global layer with sinks
                keys, vals = kc[:, :, :pos + T], vc[:, :, :pos + T]
                if keys.dtype != q.dtype:
                    keys, vals = from_cache(keys, q.dtype, a.triton_state), from_cache(vals, q.dtype, a.triton_state)
                y = sink_attention(q, keys, vals, pos, a.sinks, a.scale)
            else:
                y = window_attention(q, kc, vc, pos, w, a.scale, a.sinks, triton_state=a.triton_state)
            return y.transpose(1, 2).reshape(T, nh * hd)
    else:
        kc.narrow(2, pos, T).copy_(k_new)  # copy_ casts (and broadcasts the missing batch dim)
        vc.narrow(2, pos, T).copy_(v_new)
    keys, vals = kc.narrow(2, 0, pos + T), vc.narrow(2, 0, pos + T)
    if (T == 1 and keys.dtype == torch.bfloat16 != qk.dtype and keys.device.type == "cpu"
            and pos + 1 >= BF16_ATTENTION_FROM):
        y = _bf16_cache_attention(qk[:, :nh], keys, vals, a.scale)  # the prefix is never widened
        return y if weight_only else y.to(dtype)
    if keys.dtype != qk.dtype:
        keys, vals = from_cache(keys, qk.dtype, a.triton_state), from_cache(vals, qk.dtype, a.triton_state)
    if T == 1:
        return decode_attention(qk[:, :nh].view(1, nh, 1, hd), keys, vals, a.scale).view(1, nh * hd)
    q = qk[:, :nh].transpose(0, 1).unsqueeze(0)  # (1, nh, T, hd)
    return chunk_attention(q, keys, vals, pos, a.scale, a.cuda_attention, a.fused, a.triton_state,
                           a.cudnn_shapes).transpose(1, 2).reshape(T, nh * hd)
