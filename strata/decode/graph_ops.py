"""The CUDA graphs' ops for the one layer body (strata.models.layer): one decode row (DecodeGraphs) or a batch of rows
(BatchGraphs), with the fused kernels as the layer's ops.

What the graphs capture is `strata.models.layer.run_layers` over these ops, the same layer code prefill and eager decode
run; only the kernels differ: Triton norms that add the previous layer's pending product in their launch (and write
x's int8 rounding for a dp4a product after them), RoPE with the cache write in one launch (the q/k norms inside it),
split-K attention that reads the live length on the device, the gated activation in one launch, products on
resident blocks (strata.quant.gemv) or strata.kernels.decode_gemv's dense ones. `FusedOps` holds what both share; `RowOps`
and `BatchOps` what differs: one row's fallbacks to torch (the masked attention, kernels.graph_kernels torch) and
the batch's per-row slots and positions read on the device.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from strata.kernels.attention import from_cache, rope_rows, to_cache
from strata.models.layer import LayerMats, gate
from strata.models.resident import ResidentMatrices
from strata.models.weight_only import Products, dense_products


def fusable(norm, x: torch.Tensor) -> bool:
    """Whether strata.kernels.decode_kernels' norms compute `norm` on x: rounded once from float32, as torch's fused
    rms_norm with the weight in x's dtype, or gemma's float32 (1 + w) on x widened (RMSNorm.forward)."""
    return x.dtype in (torch.bfloat16, torch.float16, torch.float32) and (
        norm.weight.dtype == x.dtype or (norm.upcast and norm.weight.dtype == torch.float32))


class FusedOps:
    """The norms of a graph's layers: `fused` (the Triton kernels; else torch's norm.rows), `rows` (None: one row,
    the kernels' one-row launch; r: the batch kernels' launch of r rows)."""

    def __init__(self, fused: bool, rows: int | None):
        self.fused, self.rows = fused, rows
        self._kw = {} if rows is None else {"rows": rows}

    def norm(self, x: torch.Tensor, norm) -> torch.Tensor:
        if self.fused and fusable(norm, x) and x.is_contiguous():
            from strata.kernels.decode_kernels import rms_norm
            return rms_norm(x, norm.weight, norm.eps, **self._kw)
        return norm.rows(x)

    @staticmethod
    def weighed(pend: tuple, h: torch.Tensor) -> tuple:
        """pend with a token's experts' outputs (ys, w) summed by their weights, rounded to h's dtype."""
        y, post = pend
        if not isinstance(y, tuple):
            return pend
        from strata.models.moe import weighed_sum
        return weighed_sum(*y).view(h.shape), post

    def add_norm(self, h: torch.Tensor, pend: tuple, norm,
                 int8: bool = False) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """pend (y, post): (h + y', norm(h + y'), {} or {"xq": quantize_x's rounding of the normed rows} with int8),
        y' = post(y) where post is a norm (gemma3's post norms), else y; y None: h. One launch where the kernels take
        it. y may be a token's experts' outputs and their weights (ys (k, dim), w (1, k)): summed in the same launch
        (MoE.step_rows)."""
        y, post = pend
        kw = self._kw
        if self.fused and fusable(norm, h) and h.is_contiguous():
            from strata.kernels.decode_kernels import add_rms_norm, rms_norm
            if isinstance(y, tuple):
                if y[0].dtype == h.dtype and y[0].is_contiguous() and post is None:
                    out = add_rms_norm(h, y[0], norm.weight, norm.eps, int8, experts=y[1].reshape(-1).contiguous())
                    return (out[0], out[1], {"xq": out[2]}) if int8 else (out[0], out[1], {})
                y, post = self.weighed((y, post), h)
            if y is None:
                out = rms_norm(h, norm.weight, norm.eps, int8, **kw)
                return (h, out[0], {"xq": out[1]}) if int8 else (h, out, {})
            if y.dtype == h.dtype and y.is_contiguous() and (post is None or fusable(post, y)):
                pre = None if post is None else (post.weight, post.eps)
                out = add_rms_norm(h, y, norm.weight, norm.eps, int8, pre, **kw)
                return (out[0], out[1], {"xq": out[2]}) if int8 else (out[0], out[1], {})
        y, post = self.weighed((y, post), h)
        if y is not None:
            h = h + (y if post is None else self.norm(y, post))
        return h, norm.rows(h), {}

    def finish(self, h: torch.Tensor, pend: tuple) -> torch.Tensor:
        """The last layer's product added (its experts summed first)."""
        y, post = self.weighed(pend, h)
        return h + (y if post is None else self.norm(y, post))

    @staticmethod
    def qk_norm(a, qkv: torch.Tensor, fuse: bool):
        """(qkv, the q/k norms for the rope launch or None): qwen3, gemma3's per-head norms before RoPE, inside the
        rope-and-store launch where it takes them (one eps: equal from args.norm_eps today), else torch's on the
        rows first."""
        if a.q_norm is None:
            return qkv, None
        if fuse and fusable(a.q_norm, qkv) and fusable(a.k_norm, qkv) and a.q_norm.eps == a.k_norm.eps:
            return qkv, (a.q_norm.weight, a.k_norm.weight, a.q_norm.eps)
        nh, nkv = a.nh, a.nkv
        return torch.cat((a.q_norm.rows(qkv[:, :nh]), a.k_norm.rows(qkv[:, nh:nh + nkv]), qkv[:, nh + nkv:]), 1), None


class RowOps(FusedOps):
    """One decode row (DecodeGraphs._body): pos a device tensor, the cache read up to `b` positions (the graph's
    bucket), the attention split-K (`mask` the live count) or masked (`mask` additive, over the bucket)."""

    def __init__(self, g, tabs: dict, mask, b: int, ring_pos: dict):
        super().__init__(g.fused, None)
        self.g, self.tabs, self.mask, self.b, self.ring_pos = g, tabs, mask, b, ring_pos
        self.selected: list | None = None  # DSA: the last indexer's positions (strata.models.mla)

    def products(self, blk) -> LayerMats:
        """Resident: the fused kernels read the blocks (graphable checked they can); dense: strata.kernels.decode_gemv's
        (Triton or cuBLAS, whichever it measured faster for the shape) with the fused kernels, else torch's. Per
        input, whether its kernel reads x rounded to int8 (only a resident layer's dp4a products; fused steps only),
        so the kernel before it writes that rounding too."""
        r, fused = blk.weights, self.fused
        mm = r.products() if isinstance(r, ResidentMatrices) else self._dense(r.get())
        want = fused and isinstance(r, ResidentMatrices)
        int8 = {p: want and r.int8_x(p) for p in ("qkv", "wo", "w13", "w2")}
        if blk.linear:  # resident: its input products on the blocks read the norm's rounding where they take it
            first = fused and r.linear_int8() if blk.attn.wqkv is None else False
        else:
            first = int8["qkv"]
        mlp = fused and blk.mlp.int8_x(self.g.device) if blk.moe else int8["w13"]  # the experts' gate/up in int8
        return LayerMats(mm, {"in": first, "wo": int8["wo"], "mlp": mlp, "w2": int8["w2"]})

    def _dense(self, w) -> Products:
        if not self.fused:
            return dense_products(w, None)
        from strata.kernels.decode_gemv import matvec
        p, mode = functools.partial, self.g.kernels.decode_gemv
        return Products(p(matvec, w=w.wqkv, b=w.bqkv, mode=mode), p(matvec, w=w.wo, b=w.bo, mode=mode),
                        p(matvec, w=w.w13, mode=mode), p(matvec, w=w.w2, mode=mode))

    def attend(self, a, qkv: torch.Tensor, h, want_yq: bool):
        """q/k norms, RoPE, the cache write and the attention; with the fused kernels one rope_store launch (q and k
        rotated, k and v written at pos) and split-K, whose merge also writes y's int8 rounding for the o-projection
        where that reads it (want_yq: not through the output gate). Partial rotary (qwen3_5, glm4_moe: cos narrower
        than hd) takes torch's rope_rows and the row stores. A window layer (split-K only) stores at pos's row of
        its ring and reads the last `window` positions from the whole ring."""
        g, b = self.g, self.b
        nh, nkv, hd = a.nh, a.nkv, a.hd
        qkv = qkv.reshape(1, nh + 2 * nkv, hd)
        cos, sin = self.tabs[a.rope_kind]
        fuse = self.fused and cos.shape[-1] == hd
        qkv, qk_norm = self.qk_norm(a, qkv, fuse)
        if a.window is not None:
            row, kc, vc = self.ring_pos[a.k_cache.shape[2]], a.k_cache[0], a.v_cache[0]
            att, win = g._attention(min(b, a.window)), a.window
        else:
            row, kc, vc = g.pos, a.k_cache[0, :, :b], a.v_cache[0, :, :b]
            att, win = (g._attention(b) if g.use_split_k else None), 0
        if fuse:
            from strata.kernels.decode_kernels import int8_out, rope_store
            q = rope_store(qkv[0], cos.view(hd), sin.view(hd), row, nh, nkv, a.k_cache[0], a.v_cache[0], qk_norm)
            yq = int8_out(q, True) if want_yq and hd % 32 == 0 else None
            y = att(q.view(nkv, nh // nkv, hd), kc, vc, self.mask, scale=a.scale, window=win, sinks=a.sinks, xq=yq)
            return y.reshape(1, 1, -1), ({} if yq is None else {"xq": yq})
        qk = rope_rows(qkv[:, :nh + nkv], cos, sin)
        store_row(a.k_cache, row, qk[:, nh:].transpose(0, 1).unsqueeze(0))
        store_row(a.v_cache, row, qkv[:, nh + nkv:].transpose(0, 1).unsqueeze(0))
        if g.use_split_k:  # reads only the live keys, in the cache's own dtype
            y = att(qk[0, :nh].view(nkv, nh // nkv, hd), kc, vc, self.mask, scale=a.scale, window=win, sinks=a.sinks)
        else:
            keys, vals = a.k_cache[:, :, :b], a.v_cache[:, :, :b]
            if keys.dtype != qk.dtype:  # widened (a q8_0 cache's blocks times their scales)
                keys, vals = from_cache(keys, qk.dtype, a.triton_state), from_cache(vals, qk.dtype, a.triton_state)
            q = qk[:, :nh].reshape(1, nkv, nh // nkv, hd)  # grouped-query as multi-head, as decode_attention
            y = F.scaled_dot_product_attention(q, keys, vals, attn_mask=self.mask, scale=a.scale)
        return y.reshape(1, 1, -1), {}

    def latent(self, a, pr):
        """MLA's row (strata.models.mla.attend_step): written at pos, the absorbed form over the bucket (DSA: its
        top-k), positions past pos masked."""
        from strata.models.mla import attend_step
        return attend_step(a, pr, self.g.pos, self.b, self, pr.q_rot.dtype, store_row)

    def linear(self, blk, h, x, xq, mats: LayerMats):
        """The Gated DeltaNet step (GatedDeltaNet.mix on one row: its states advanced in place); resident, its input
        products on the blocks read the norm's int8 rounding where they take it."""
        la = blk.attn
        lp = blk.weights.linear_taking(xq) if la.wqkv is None else self._dense_linear(la)
        return la.mix(x.view(1, -1), lp).view(1, 1, -1)

    def _dense_linear(self, la):
        """A linear-attention layer's own dense products: strata.kernels.decode_gemv's with the fused kernels, else F.linear."""
        if not self.fused:
            return la.products()
        from strata.kernels.decode_gemv import matvec
        from strata.models.linear_attention import LinearProducts
        mode = self.g.kernels.decode_gemv
        mv = lambda w: functools.partial(matvec, w=w, mode=mode)  # noqa: E731
        b, a = mv(la.wb), mv(la.wa)
        return LinearProducts(mv(la.wqkv), mv(la.wz), lambda x: (b(x), a(x)), mv(la.wo))

    def act(self, mlp, gu: torch.Tensor, int8: bool):
        """act(gate) * up in one launch, rounded once, and x's int8 rounding for w2 if it reads that."""
        g, up = gu.split(mlp.ffn, dim=-1)
        if not self.fused:
            return gate(g, up, mlp.activation, fused=False), {}
        from strata.kernels.decode_kernels import act_mul
        z = act_mul(g, up, mlp.activation, int8)
        return (z[0], {"xq": z[1]}) if int8 else (z, {})

    def experts(self, blk, h, x, xq):
        """Routing and the chosen experts' products, all on the device (strata.models.moe's few-rows path); their weighted
        sum left to the next norm's launch where it can (add_rms_norm's experts)."""
        e = blk.mlp
        if self.fused and blk.mlp_post_norm is None and e.unweighed(h.device):
            return e.step_rows(x.view(1, -1), xq.get("xq")), None
        return e(x.view(1, -1), xq.get("xq")).view(x.shape), blk.mlp_post_norm


class BatchOps(FusedOps):
    """A decode batch of r rows (BatchGraphs.body): row t at slot slot[t], position pos[t], its cache row rows[...][t]
    (a padding row: -1, writes nothing), n_keys its live keys, all read on the device; always the fused kernels."""

    def __init__(self, bg, r: int, b: int, tabs: dict, rows: dict, n_keys, slot, live):
        super().__init__(True, r)
        self.bg, self.r, self.b, self.tabs, self.rows = bg, r, b, tabs, rows
        self.n_keys, self.slot, self.live = n_keys, slot, live

    def products(self, blk) -> LayerMats:
        """On its blocks where resident, else dense through torch; per input, whether it reads r rows of x rounded
        to int8. A mixture's rows: only a single row takes the norm's int8 rounding (strata.models.moe's few-rows path)."""
        w, r = blk.weights, self.r
        resident = isinstance(w, ResidentMatrices)
        mm = w.products() if resident else dense_products(w.get(), None)
        int8 = {p: resident and w.int8_x(p, r) for p in ("qkv", "wo", "w13", "w2")}
        if blk.linear:
            first = w.linear_int8(r) if blk.attn.wqkv is None else False
        else:
            first = int8["qkv"]
        mlp = (blk.mlp.int8_x(self.bg.device) and r == 1) if blk.moe else int8["w13"]
        return LayerMats(mm, {"in": first, "wo": int8["wo"], "mlp": mlp, "w2": int8["w2"]})

    def attend(self, a, qkv: torch.Tensor, h, want_yq: bool):
        """Each row roped and stored at its slot's row (one rope_store_rows launch; partial rotary: torch's rope and
        an indexed store), then split-K over each row's own cache (rows_call)."""
        from strata.kernels.decode_kernels import rope_store_rows
        bg, m, r = self.bg, self.bg.m, self.r
        nh, nkv, hd = a.nh, a.nkv, a.hd
        qkv = qkv.reshape(r, nh + 2 * nkv, hd)
        cos, ssin = self.tabs[a.rope_kind]
        fuse = cos.shape[-1] == hd
        qkv, qk_norm = self.qk_norm(a, qkv, fuse)
        i = a.key
        kc, vc = m.slot_caches(i)
        at = self.rows[kc.shape[2] if a.window is not None else None]
        pooled = m.pooled(i)
        slot, live = self.slot, self.live
        at_slot = bg.base[:r] if pooled else slot  # (a pool's "slot" is the extent's first position)
        if fuse:
            q = rope_store_rows(qkv.contiguous(), cos, ssin, at, at_slot, nh, nkv, kc, vc, qk_norm)
        else:
            qk = rope_rows(qkv[:, :nh + nkv], cos[:, None], ssin[:, None])
            q = qk[:, :nh].contiguous()
            for c, x in ((0, qk[:, nh:]), (1, qkv[:, nh + nkv:])):
                if pooled:  # the pool itself (its "slots" overlap): row t at position base + at
                    store_rows_at(m.pool_caches(i)[c], x, torch.zeros_like(slot), at_slot + at, live)
                else:
                    store_rows_at((kc, vc)[c], x, slot, at, live)
        att = bg._attention(min(self.b, a.window) if a.window is not None else self.b, r)
        y = att.rows_call(q.view(r, nkv, nh // nkv, hd), kc, vc, self.n_keys, at_slot, scale=a.scale,
                          window=a.window or 0, sinks=a.sinks).reshape(r, nh * hd)
        return y, {}

    def linear(self, blk, h, x, xq, mats: LayerMats):
        """Each row's Gated DeltaNet step from its slot's states (GatedDeltaNet.mix_rows); not written during a
        capture's warm-up (BatchGraphs._write)."""
        la, w = blk.attn, blk.weights
        lp = w.linear_taking(xq, self.r) if la.wqkv is None else la.products()
        return la.mix_rows(x, lp, self.slot, self.live, write=self.bg._write)

    def act(self, mlp, gu: torch.Tensor, int8: bool):
        from strata.kernels.decode_kernels import act_mul_rows
        z = act_mul_rows(gu.contiguous(), mlp.activation, int8)
        return (z[0], {"xq": z[1]}) if int8 else (z, {})

    def experts(self, blk, h, x, xq):
        return blk.mlp(x, xq.get("xq"), gather=True).view(self.r, -1), blk.mlp_post_norm


def store_row(cache: torch.Tensor, row: torch.Tensor, x: torch.Tensor) -> None:
    """x (1, nkv, 1, hd) into cache row `row` (a device tensor). An 8-bit cache through its bytes: CUDA's index_copy_
    has no float8 kernel (it failed at load with kv_dtype float8_e4m3fn)."""
    x = to_cache(x, cache.dtype)
    if cache.element_size() == 1 and cache.dtype != torch.uint8:
        cache.view(torch.uint8).index_copy_(2, row, x.view(torch.uint8))
    else:
        cache.index_copy_(2, row, x)


def store_rows_at(cache: torch.Tensor, x: torch.Tensor, slot, at, live) -> None:
    """Rows x (r, nkv, hd) into every slot's cache (slots, nkv, S, width): row t at slot[t], position at[t]. A
    padding row (not live; its slot row 0's, its position -1) writes row 0's values at row 0's position again
    (the same bytes)."""
    r, nkv = x.shape[:2]
    x = to_cache(x, cache.dtype)
    src = torch.where(live, torch.arange(r, device=x.device), torch.zeros_like(slot))
    heads = torch.arange(nkv, device=x.device)[None, :]
    dst = cache.view(torch.uint8) if cache.element_size() == 1 and cache.dtype != torch.uint8 else cache
    val = x.index_select(0, src)
    if val.dtype != dst.dtype:
        val = val.view(dst.dtype)
    dst.index_put_((slot[:, None], heads, at.index_select(0, src)[:, None]), val)
