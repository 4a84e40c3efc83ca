"""Multi-head latent attention (MLA: DeepSeek V3 / R1 / V3.1, Kimi K2), written once for every path.

A token's keys and values come from one latent of kv_lora_rank values (kv_a's first rows, normed) and one roped key
of qk_rope_dim values shared by every head (kv_a's last rows). The cache holds exactly those, [latent | roped key]
per position: kv_lora_rank + qk_rope_dim values (576 for V3) in the K tensor of an attention layer's two, the V
tensor empty (ModelArgs.kv_rows), so the prefix cache, KV files, slots and pools move it as any other cache.

Queries: q_a, its norm, q_b (or one q projection), each head's last qk_rope_dim values roped. Attention over the
cache takes one of two forms with the same scores (q.k = q_nope.(W_kb c) + q_rot.k_rot = (q_nope W_kb).c + ...):

* expanded: kv_b turns every cached latent into per-head keys (nope part) and values, then ordinary attention; cheap
  per query, dear per key: a prefill chunk with many rows.
* absorbed: each head's nope query is carried through kv_b's key rows into latent space, so the latent is one key
  (and value) head shared by all heads; the output is carried back through kv_b's value rows. Cheap per key: decode.

`form` picks by cost (multiply-adds) for each segment of rows. A path supplies only its rows' segments and rope
tables (`layer.segments`): the body here is the same for prefill chunks, prefill groups and decode rows / batches.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from strata.models.args import DECODE_T
from strata.models.dsa import Indexer, select, sparse_attention
from strata.kernels.attention import (_FP8, PREFIX_BLOCK, Q8_0, attention_with_lse, from_cache, merge_lse, rope_rows,
                                     store_rows, to_cache)

# the reference's q_a / kv_a norms (transformers' DeepseekV3RMSNorm(width): its default eps, not rms_norm_eps;
# llama.cpp takes the model's, which is this value in every released DeepSeek V3 / R1 / Kimi K2 config)
LATENT_NORM_EPS = 1e-6


def halves_order(rope: int) -> torch.Tensor:
    """Row order that turns adjacent rope pairs (x0, x1), (x2, x3), ... into the two halves rotate-half RoPE
    takes (x0, x2, ..., x1, x3, ...): DeepSeek's interleaved layout, undone once on the weights' rows."""
    return torch.cat((torch.arange(0, rope, 2), torch.arange(1, rope, 2)))


def deinterleave_rows(w: torch.Tensor, heads: int, width: int, rope: int, first: bool = False) -> torch.Tensor:
    """A projection's rows (or a vector's entries) as `heads` blocks of `width` whose last (first: first) `rope` rows
    are roped: those rows from adjacent pairs to halves (the values RoPE then gives are the reference's interleaved
    RoPE's, in halves order, for q and k alike, so every q.k is the same)."""
    order = torch.arange(heads * width).view(heads, width)
    part = slice(0, rope) if first else slice(width - rope, width)
    order[:, part] = order[:, part][:, halves_order(rope)]
    return w[order.reshape(-1)]


class LatentMatrix(nn.Module):
    """One of MLA's projections, x -> x @ W.T: dense (in the compute dtype), or resident GGUF blocks
    (strata.models.resident.Packed) multiplied on the blocks for decode rows where the fused kernels take the type
    (strata.quant.gemv), else dequantized into the slice's scratch region `name` first (prefill)."""

    def __init__(self, w, name: str = "", scratch=None, kernels=None):
        super().__init__()
        self.w, self.name, self.scratch, self.kernels = w, name, scratch, kernels

    @property
    def resident(self) -> bool:
        return not isinstance(self.w, torch.Tensor)

    def fused_ok(self, device) -> bool:
        from strata.models.resident import fused_ok
        return not self.resident or fused_ok(self.w, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.resident:
            return F.linear(x, self.w)
        p = self.w
        if x.shape[0] <= DECODE_T and self.fused_ok(x.device):
            from strata.quant.gemv import quant_matmul_parts
            return quant_matmul_parts(x, [(p.data, p.qtype)], p.cols, kernels=self.kernels)
        return F.linear(x, p.into(self.scratch.view(self.name)))


class LatentAttention(nn.Module):
    """An MLA layer's weights (dense, in the compute dtype) and its cache, [latent | roped key] per position in
    k_cache (1, 1, rows, kv_lora_rank + qk_rope_dim); v_cache is the empty (1, 1, rows, 0) partner."""

    latent = True

    def __init__(self, args, layer: int, norm):
        """norm(width, eps): the model's RMSNorm class (strata.models.model, which builds this one)."""
        super().__init__()
        self.key = str(layer)
        self.nh, self.hd, self.rope, self.vd = args.n_heads, args.head_dim, args.qk_rope_dim, args.v_head_dim
        self.nope, self.rank, self.q_rank = args.head_dim - args.qk_rope_dim, args.kv_lora_rank, args.q_lora_rank
        self.nkv = 1  # one shared latent "head" in the cache
        self.scale = args.attn_scale if args.attn_scale is not None else args.head_dim ** -0.5
        self.window, self.sinks, self.gated, self.q_norm, self.k_norm = None, None, False, None, None
        self.rope_kind = "global"
        # DSA (strata.models.dsa): this layer's indexer, or None where it takes the layer before's selection
        self.sparse = args.index_topk > 0
        self.shared = self.sparse and args.index_shared is not None and args.index_shared[layer]
        self.indexer = Indexer(args) if self.sparse and not self.shared else None
        self.q_a_norm = norm(self.q_rank, LATENT_NORM_EPS) if self.q_rank else None
        self.kv_a_norm = norm(self.rank, LATENT_NORM_EPS)
        # LatentMatrix: wq (nh * hd, dim) or, low-rank, wq_a (q_rank, dim) and wq_b (nh * hd, q_rank); wkv_a (rank +
        # rope, dim); wo (dim, nh * vd). wkv_b (nh * (nope + vd), rank), per head its key rows then its value rows:
        # a dense tensor (the absorbed form's per-head views of it)
        self.wq = self.wq_a = self.wq_b = self.wkv_a = self.wkv_b = self.wo = None
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.max_len = 0
        self.prefix_block = PREFIX_BLOCK  # prefix positions expanded at once (expanded; the planner's, setup_cache)
        self.triton_state = None

    def check(self, pos: int, T: int, cache: torch.Tensor | None = None) -> None:
        c = self.k_cache if cache is None else cache
        if c is None:
            raise RuntimeError("KV cache not allocated: call Transformer.setup_cache(max_len) first")
        if pos + T > min(self.max_len, c.shape[2]):
            raise ValueError(f"positions {pos}..{pos + T} exceed the KV cache ({min(self.max_len, c.shape[2])})")

    def kv_b(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b's key rows (nh, nope, rank) and value rows (nh, vd, rank)."""
        w = self.wkv_b.view(self.nh, self.nope + self.vd, self.rank)
        return w[:, :self.nope], w[:, self.nope:]


class Projected(NamedTuple):
    """A layer's rows projected: q's nope part (T, nh, nope) and roped part (T, nh, rope), the cache rows (T, width:
    [latent | roped key | index key]), and the indexer's queries and head weights (None: no indexer here)."""
    q_nope: torch.Tensor
    q_rot: torch.Tensor
    lat: torch.Tensor
    iq: tuple | None


def latent_attention(a: LatentAttention, x: torch.Tensor, ops) -> torch.Tensor:
    """MLA over the normed rows x (..., T, dim) -> the output projection's rows (..., T, dim): the rows projected
    and roped here, their cache writes and attention by the path (ops.latent: `attend_segments` for the eager paths,
    `attend_step` for a CUDA graph's row), the output projection here."""
    shape, T = x.shape, x.shape[-2]
    x = x.reshape(T, shape[-1])
    y = ops.latent(a, project(a, x, *ops.tabs[a.rope_kind]))  # (T, nh * vd)
    return a.wo(y.to(x.dtype)).view(*shape[:-1], -1)


def project(a: LatentAttention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Projected:
    """q through q_a, its norm and q_b (or one q), kv_a into the normed latent and the roped shared key, and (DSA)
    the indexer's key, queries and weights; cos, sin: the rows' rope tables."""
    T = x.shape[0]
    q_resid = a.q_a_norm(a.wq_a(x)) if a.q_rank else None
    q = (a.wq_b(q_resid) if a.q_rank else a.wq(x)).view(T, a.nh, a.hd)
    ckv = a.wkv_a(x)
    parts = [a.kv_a_norm(ckv[:, :a.rank]), rope_rows(ckv[:, None, a.rank:], cos, sin)[:, 0]]
    iq = None
    if a.sparse:  # the index key beside them (zeros in a shared layer, which has no indexer of its own)
        parts.append(a.indexer.keys(x, cos, sin) if a.indexer is not None
                     else x.new_zeros(T, a.k_cache.shape[-1] - a.rank - a.rope))
        iq = a.indexer.queries(q_resid, x, cos, sin) if a.indexer is not None else None
    return Projected(q[..., :a.nope], rope_rows(q[..., a.nope:], cos, sin), torch.cat(parts, -1), iq)


def _cache_rows(kc: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return to_cache(rows, kc.dtype) if kc.dtype in _FP8 or kc.dtype == Q8_0 else rows


def attend_segments(a: LatentAttention, pr: Projected, segments: list, ops, dtype: torch.dtype) -> torch.Tensor:
    """The eager paths': each segment of rows ((pos, n, (k_cache, v_cache)) in row order: a chunk, a prefill
    group's sequences, a decode batch's rows) writes its rows at its positions and attends over its own cache, in
    the form its cost picks (or, DSA, over the positions its indexer, or the layer before's, selected)."""
    ys, o, chosen = [], 0, []
    for j, (pos, n, (kc, _)) in enumerate(segments):
        a.check(pos, n, kc)
        store_rows(kc, _cache_rows(kc, pr.lat[o:o + n].view(1, 1, n, -1)), pos)
        cached = kc[:, :, :pos + n]
        if cached.dtype != dtype:
            cached = from_cache(cached, dtype, a.triton_state)
        idx = None
        if a.sparse:
            idx = (select(a.indexer, pr.iq[0][o:o + n], pr.iq[1][o:o + n], cached[0, 0, :, a.rank + a.rope:], pos)
                   if a.indexer is not None else ops.selected[j])
            chosen.append(idx)
        q_nope, q_rot = pr.q_nope[o:o + n], pr.q_rot[o:o + n]
        if idx is not None:
            ys.append(sparse_attention(a, q_nope, q_rot, cached, pos, idx))
        else:
            attend = expanded if form(a, n, pos + n) == "expanded" else absorbed
            ys.append(attend(a, q_nope, q_rot, cached, pos))
        o += n
    if a.sparse:
        ops.selected = chosen  # for a next layer that shares them (GLM-5)
    return torch.cat(ys) if len(ys) > 1 else ys[0]


def attend_step(a: LatentAttention, pr: Projected, pos: torch.Tensor, b: int, ops, dtype: torch.dtype,
                store) -> torch.Tensor:
    """A CUDA graph's one row at position `pos` (a device tensor) over the cache's first b positions (the graph's
    bucket), every shape fixed: the row written by store(cache, pos, rows), the absorbed form with the positions past
    pos masked (DSA: the top-k of the bucket's index scores, those past pos masked after)."""
    kc = a.k_cache
    store(kc, pos, pr.lat.view(1, 1, 1, -1))
    cached = kc[:, :, :b]
    if cached.dtype != dtype:
        cached = from_cache(cached, dtype, a.triton_state)
    idx = None
    if a.sparse:
        idx = (select(a.indexer, pr.iq[0], pr.iq[1], cached[0, 0, :, a.rank + a.rope:], pos)
               if a.indexer is not None else ops.selected[0])
        ops.selected = [idx]
    if idx is not None:
        return sparse_attention(a, pr.q_nope, pr.q_rot, cached, pos, idx)
    wk, wv = a.kv_b()
    q = torch.cat((torch.einsum("thd,hdr->htr", pr.q_nope, wk), pr.q_rot.transpose(0, 1)), -1)[:, 0]  # (nh, w)
    kv = cached[0, 0, :, :a.rank + a.rope]
    s = torch.matmul(q, kv.t()).float() * a.scale
    s = s.masked_fill(torch.arange(b, device=s.device) > pos, float("-inf"))
    out = torch.matmul(s.softmax(-1).to(q.dtype), kv[:, :a.rank])  # (nh, rank)
    return torch.einsum("hr,hvr->hv", out, wv).reshape(1, a.nh * a.vd)


def form(a: LatentAttention, n: int, keys: int) -> str:
    """The cheaper form, in multiply-adds, for n query rows over `keys` cached positions: expanded pays kv_b over
    every key and attends at head width (its values padded to it); absorbed carries each query through kv_b twice
    and attends at latent width."""
    expanded = keys * a.rank * a.nh * (a.nope + a.vd) + 2 * n * keys * a.nh * a.hd
    w = a.rank + a.rope
    absorbed = n * a.nh * a.rank * (a.nope + a.vd) + 2 * n * keys * a.nh * w
    return "expanded" if expanded < absorbed else "absorbed"


def expanded(a: LatentAttention, q_nope, q_rot, cached, pos: int) -> torch.Tensor:
    """Per-head keys and values from the cached latents, then attention of the n rows at `pos`: the prefix in
    blocks of a.prefix_block positions (its expansion is n_heads x (nope + v) values a position: a whole long
    prefix at once would outweigh the cache itself), the rows' own keys causal, merged by log-sum-exp. Values are
    padded with zeros to the key width (the kernels take equal widths), the padding dropped after."""
    n = q_nope.shape[0]
    q = torch.cat((q_nope, q_rot), -1).transpose(0, 1)[None]  # (1, nh, n, hd)

    def keys(lo: int, hi: int):
        c = cached[0, 0, lo:hi]
        kv = F.linear(c[:, :a.rank], a.wkv_b).view(hi - lo, a.nh, a.nope + a.vd)
        k = torch.cat((kv[..., :a.nope], c[:, None, a.rank:a.rank + a.rope].expand(hi - lo, a.nh, a.rope)), -1)
        v = F.pad(kv[..., a.nope:], (0, a.hd - a.vd)) if a.hd > a.vd else kv[..., a.nope:]
        return k.transpose(0, 1)[None], v.transpose(0, 1)[None]

    out, lse = attention_with_lse(q, *keys(pos, pos + n), True, a.scale)
    for lo in range(0, pos, a.prefix_block):
        po, pl = attention_with_lse(q, *keys(lo, min(pos, lo + a.prefix_block)), False, a.scale)
        out, lse = merge_lse(po, pl, out, lse), torch.logaddexp(pl, lse)
    return out[0, :, :, :a.vd].transpose(0, 1).reshape(n, a.nh * a.vd)


def absorbed(a: LatentAttention, q_nope, q_rot, cached, pos: int) -> torch.Tensor:
    """Attention in latent space: q_nope through kv_b's key rows, one key head [latent | roped key] shared by all
    heads, whose latent part is also the value; the output through kv_b's value rows."""
    n = q_nope.shape[0]
    wk, wv = a.kv_b()
    q = torch.cat((torch.einsum("thd,hdr->htr", q_nope, wk), q_rot.transpose(0, 1)), -1)  # (nh, n, rank + rope)
    out = shared_head_attention(q, cached[0, 0, :, :a.rank + a.rope], pos, a.scale)[..., :a.rank]  # (nh, n, rank)
    return torch.einsum("htr,hvr->thv", out, wv).reshape(n, a.nh * a.vd)


def shared_head_attention(q: torch.Tensor, kv: torch.Tensor, pos: int, scale: float) -> torch.Tensor:
    """Every head's n rows at [pos, pos + n) (q: (nh, n, w)) against one key head kv (pos + n, w) that is its own
    value: the cached prefix unmasked with the heads' rows as one head's rows (each key read once), the rows' own
    keys causal, merged by log-sum-exp -> (nh, n, w)."""
    nh, n, w = q.shape
    own = _attend(q[None], kv[None, None, pos:].expand(1, nh, n, w), True, scale)
    if pos == 0:
        return own[0][0]
    pre = _attend(q.reshape(1, 1, nh * n, w), kv[None, None, :pos], False, scale)
    out = merge_lse(pre[0].view(1, nh, n, w), pre[1].view(1, nh, n), *own)
    return out[0]


def _attend(q, k, causal: bool, scale: float):
    """(out, log-sum-exp) of q against k that is also the values, in float32 softmax: the math that every device
    runs (the latent width, 576 for V3, is past the fused kernels' head widths)."""
    s = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if causal:
        T = q.shape[2]
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.matmul(torch.exp(s - lse[..., None]).to(q.dtype), k), lse
