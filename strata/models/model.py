"""The decoder core in plain PyTorch, sliceable by layer range: norms, attention and MLP blocks, `Transformer`.

The model knows nothing about stages, processes or transports. A `Transformer` holds layers
[start, end) of a model, plus the embedding when start == 0 and the final norm and head when
end == n_layers. What a family varies (q/k norms, norm placement, windows, activation, ...) comes
from its `ModelArgs` (strata.models.args; the families and their files: strata.models.families). Prefill is chunked:
`forward(x, pos)` runs T tokens at absolute position `pos`, appending their keys/values to a cache
allocated once for the whole prompt. Up to DECODE_T rows take a decode path (one unmasked attention call
for T=1, fewer ops), optionally with narrower CPU weights (`set_decode_weights`). Every path runs the one layer
body of strata.models.layer with its own ops. CUDA graphs of the one-token step are built from outside (strata.decode.graphs);
`storage_version` tells them when cache or weights changed.
"""
from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from strata.models.args import ModelArgs
from strata.kernels.attention import (CUDA_ATTENTION_DEFAULT, PREFIX_BLOCK, cache_width, chunk_attention, from_cache, kv_dtype_of,
                        narrow_cache_attention, rope_tables, sink_attention, store_rows, window_attention)
from strata.models.resident import (DECODE_T, PRODUCTS, DenseMatrices, Head, Packed, QuantEmbedding, Quantized,
                       ResidentExperts, ResidentMatrices, Scratch, _dequantize, head_rows)
from strata.config import KernelSpec
from strata.triton_state import TritonState
from strata.models.layer import NOTHING, PrefillOps, RowsOps, layer, run_layers
from strata.models.linear_attention import GatedDeltaNet
from strata.models.mla import LatentAttention, LatentMatrix, deinterleave_rows
from strata.models.moe import MoE
from strata.models.weight_only import DECODE_KINDS, LayerWeightOnly, WeightOnly

def rope_frequencies(args: ModelArgs, theta: float | None = None, scaled: bool = True) -> torch.Tensor:
    """Inverse frequencies (head_dim/2,) float32 for base `theta` (default the model's), with its scaling if
    `scaled` (strata.models.rope: llama3, yarn, linear). Computed on the CPU, also inside a `torch.device("meta")` build:
    meta arange goes through torch's compiler (~1 s import)."""
    from strata.models.rope import inv_frequencies
    hd, rot = _rope_dims(args)
    inv, _ = inv_frequencies(hd, args.rope_theta if theta is None else theta, _scaling(args) if scaled else None, rot)
    return inv.float()


def _rope_dims(args: ModelArgs) -> tuple[int, int | None]:
    """(head width, rotary_dim) the frequencies are over: MLA ropes its qk_rope_dim values as a head of its own."""
    return (args.qk_rope_dim, None) if args.latent else (args.head_dim, args.rotary_dim)


def rope_attention_factor(args: ModelArgs) -> float:
    """What cos and sin are multiplied by (YaRN's attention factor; 1.0 otherwise)."""
    from strata.models.rope import inv_frequencies
    hd, rot = _rope_dims(args)
    return inv_frequencies(hd, args.rope_theta, _scaling(args), rot)[1]


def _scaling(args: ModelArgs) -> dict | None:
    sc = args.rope_scaling
    if sc and "rope_type" not in sc:  # the Llama-3 form, as older presets and callers spell it
        sc = {"rope_type": "llama3", **sc}
    return sc


class RMSNorm(nn.Module):
    """x / rms(x) * w. upcast (gemma): w is held in float32 as (1 + w) of the file, and the product is rounded
    once, from float32, to x's dtype."""

    def __init__(self, dim: int, eps: float, upcast: bool = False):
        super().__init__()
        self.eps, self.upcast = eps, upcast
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.upcast:
            return F.rms_norm(x.float(), (x.shape[-1],), self.weight, self.eps).to(x.dtype)
        if x.dtype == self.weight.dtype:
            # one fused kernel on CUDA (float32 inside, the weight applied before the one rounding) instead of
            # ~8 over a float32 copy; below, transformers' formula (normalized rows rounded, then the weight)
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """forward for decode rows: one fused op when the dtypes agree (a decode step is bound by dispatch)."""
        if self.upcast or x.dtype != self.weight.dtype:
            return self(x)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.nh, self.nkv, self.hd = args.n_heads, args.n_kv_heads, args.head_dim
        self.key = str(layer)  # the layer's key in Transformer.layers (its caches' and decode weights')
        self.window = args.window(layer)
        self.scale = args.attn_scale  # None: head_dim ** -0.5, every backend's default
        self.rope_kind = "window" if self.window is not None and args.window_rope_theta is not None else "global"
        if args.qk_norm:  # over each head's hd values, before RoPE
            self.q_norm = RMSNorm(args.head_dim, args.norm_eps, upcast=args.norm_offset)
            self.k_norm = RMSNorm(args.head_dim, args.norm_eps, upcast=args.norm_offset)
        else:
            self.q_norm = self.k_norm = None
        self.sinks = nn.Parameter(torch.empty(args.n_heads), requires_grad=False) if args.attn_sinks else None
        self.gated = args.attn_gate  # wqkv's last nh * hd rows: the output gate (qwen3_5)
        self.k_cache: torch.Tensor | None = None  # (1, nkv, rows, hd), in the KV dtype; position p in row p % rows
        self.v_cache: torch.Tensor | None = None
        self.max_len = 0  # positions the cache serves (a window layer's ring has fewer rows)
        self.prefix_block = PREFIX_BLOCK  # a narrower cache's prefix positions widened at once (setup_cache)
        # CUDA prefill: the attention path and the fused RoPE / LSE-merge kernels (Transformer.set_kernels)
        self.cuda_attention, self.fused = CUDA_ATTENTION_DEFAULT, True
        self.cudnn_shapes: frozenset | None = None  # the (pos, T) chunks cuDNN's split takes (workers/load.warm_up)
        self.triton_state: TritonState | None = None  # the slice's, on which a failed kernel falls back (Transformer)
        self.window_kernel = "flex"  # kernels.window_attention: a window layer's chunk attention (window_attention)

    def _cached(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int, T: int) -> torch.Tensor:
        """k, v (1, nkv, T, hd) into the cache at [pos, pos + T), then q's attention over what it may see."""
        self.check(pos, T)
        store_rows(self.k_cache, k, pos)
        store_rows(self.v_cache, v, pos)
        return self.attend(q, pos, T)

    def _segments(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segs: list) -> list[torch.Tensor]:
        """`_cached` for each sequence's rows of a prefill group (q, k, v: (1, T, heads, hd)), on its own caches
        (the layer's own, the slot in use, are put back after). Each sequence's rows are viewed with the strides of
        its chunk alone (unsqueeze: a leading stride of n rows, not T), which cuDNN's graph cache keys on."""
        held, ys, o = (self.k_cache, self.v_cache), [], 0
        try:
            for pos, n, caches in segs:
                self.k_cache, self.v_cache = caches
                qs, ks, vs = (t[0, o:o + n].unsqueeze(0).transpose(1, 2) for t in (q, k, v))
                ys.append(self._cached(qs, ks, vs, pos, n))
                o += n
        finally:
            self.k_cache, self.v_cache = held
        return ys

    def check(self, pos: int, T: int) -> None:
        if self.k_cache is None:
            raise RuntimeError("KV cache not allocated: call Transformer.setup_cache(max_len) first")
        if pos + T > self.max_len:
            raise ValueError(f"positions {pos}..{pos + T} exceed the KV cache ({self.max_len})")
        if self.k_cache.shape[2] < min(pos + T, self.window + T - 1 if self.window else pos + T):
            raise ValueError(f"{T} rows at {pos} exceed the window ring ({self.k_cache.shape[2]} rows)")

    def attend(self, q: torch.Tensor, pos: int, T: int) -> torch.Tensor:
        """q (1, nh, T, hd) at positions [pos, pos + T), whose keys are cached, against what it may see."""
        if self.sinks is not None and self.window is None:  # a global layer with sinks: flash with its log-sum-exp
            keys, vals = self.cached(pos + T, q.dtype)
            return sink_attention(q, keys, vals, pos, self.sinks, self.scale)
        if self.sinks is not None:  # a window layer with sinks: window_attention, whose log-sum-exp it takes
            return window_attention(q, self.k_cache, self.v_cache, pos, self.window, self.scale, self.sinks,
                                    self.window_kernel, self.triton_state)
        if self.window is not None and pos + T > self.window:
            return window_attention(q, self.k_cache, self.v_cache, pos, self.window, self.scale,
                                    kernel=self.window_kernel, triton_state=self.triton_state)
        if self.k_cache.dtype != q.dtype and pos > self.prefix_block:  # an 8-bit cache: its prefix widened in blocks
            return narrow_cache_attention(q, self.k_cache, self.v_cache, pos, self.scale, self.fused,
                                          triton_state=self.triton_state, block=self.prefix_block)
        keys, vals = self.cached(pos + T, q.dtype)
        return chunk_attention(q, keys, vals, pos, self.scale, self.cuda_attention, self.fused, self.triton_state,
                               self.cudnn_shapes)

    def cached(self, end: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [0, end) as attention reads them (a global layer's, or a window layer's before its ring
        wraps): views of the cache, or a narrower cache's prefix widened to `dtype` for this layer's attention."""
        keys, vals = self.k_cache[:, :, :end], self.v_cache[:, :, :end]
        if keys.dtype != dtype:
            keys, vals = from_cache(keys, dtype, self.triton_state), from_cache(vals, dtype, self.triton_state)
        return keys, vals


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.ffn, self.activation = args.ffn_dim, args.activation
        self.fused = True  # act(gate)*up as one Triton kernel on CUDA (Transformer.set_kernels)
        self.triton_state: TritonState | None = None  # the slice's (Transformer)


# a Gated DeltaNet layer's matrices: its attribute, the canonical name (strata.models.names)
LINEAR_MATS = (("wqkv", "lin_qkv"), ("wz", "lin_z"), ("wb", "lin_b"), ("wa", "lin_a"), ("wo", "lin_out"))


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        up = args.norm_offset
        self.key = str(layer)  # its key in Transformer.layers
        self.attn_norm = RMSNorm(args.dim, args.norm_eps, up)
        self.linear = args.is_linear(layer)  # Gated DeltaNet in place of attention (qwen3_5)
        self.latent = args.latent and not self.linear  # MLA (deepseek_v3): its weights held by the attention
        self.attn = (GatedDeltaNet(args) if self.linear else LatentAttention(args, layer, RMSNorm) if self.latent
                     else Attention(args, layer))
        self.mlp_norm = RMSNorm(args.dim, args.norm_eps, up)
        self.moe = args.is_moe(layer)
        self.mlp = MoE(args) if self.moe else FeedForward(args)
        # gemma3's sandwich: the attention's and the MLP's outputs are normed before each residual add
        self.attn_post_norm = RMSNorm(args.dim, args.norm_eps, up) if args.post_norms else None
        self.mlp_post_norm = RMSNorm(args.dim, args.norm_eps, up) if args.post_norms else None
        self.weights: DenseMatrices | ResidentMatrices = DenseMatrices(args, mlp=not self.moe,
                                                                       attn=not (self.linear or self.latent))

    def forward(self, h: torch.Tensor, pos: int, cos: torch.Tensor, sin: torch.Tensor,
                segs: list | None = None) -> torch.Tensor:
        """Prefill of T rows h (1, T, dim) at `pos` (the one layer body, strata.models.layer, with prefill's ops). cos, sin:
        (T, 1, hd), sin signed (`rope_tables`). segs: a prefill group's sequences (PrefillOps.attend); an attention
        layer only."""
        ops = PrefillOps(pos, {self.attn.rope_kind: (cos, sin)}, None if segs is None else lambda _: segs)
        return ops.finish(*layer(self, h, NOTHING, ops))


class Transformer(nn.Module):
    """Layers [start, end) of a model; the embedding if start == 0, norm and head if end == n_layers."""

    def __init__(self, args: ModelArgs, start: int = 0, end: int | None = None, kernels: KernelSpec | None = None,
                 attention: str = "auto"):
        super().__init__()
        end = args.n_layers if end is None else end
        if not 0 <= start < end <= args.n_layers:
            raise ValueError(f"layer range [{start}, {end}) is outside the model's {args.n_layers} layers")
        self.args, self.start, self.end = args, start, end
        self.has_embed = start == 0
        self.has_head = end == args.n_layers
        # _weight: no random initialisation (see _Linear)
        self.embed = nn.Embedding(args.vocab_size, args.dim, _weight=torch.empty(args.vocab_size, args.dim)) \
            if self.has_embed else None
        self.layers = nn.ModuleDict({str(i): Block(args, i) for i in range(start, end)})
        self.norm = RMSNorm(args.dim, args.norm_eps, args.norm_offset) if self.has_head else None
        self.head = (Head(nn.Parameter(torch.empty(args.vocab_size, args.dim), requires_grad=False), head_rows(args))
                     if self.has_head else None)
        self.scratch: Scratch | None = None
        self.register_buffer("inv_freq", rope_frequencies(args), persistent=False)
        self.rope_factor = rope_attention_factor(args)  # cos and sin times this (YaRN)
        sc = _scaling(args)
        self.rope_dynamic = sc if sc and sc["rope_type"] == "dynamic" else None  # dynamic NTK's parameters
        self.prompt_len = 0  # the prompt being prefilled (set_prompt_length): dynamic NTK's frequencies follow it
        # gemma3: window layers rotate with their own base, unscaled
        self.inv_freq_window = (None if args.window_rope_theta is None
                                else rope_frequencies(args, args.window_rope_theta, scaled=False))
        self._device_dtype: tuple[torch.device, torch.dtype] | None = None
        self.decode_weights: str | None = None
        self._gemv = None  # strata.quant.gemv.GemvKernels, made with the first resident matrix (`gemv`)
        # the slice's Triton fallbacks (strata.kernels.fused, IQ3_S and scratch dequantization): one object its layers and
        # resident matrices share, so a kernel that fails here falls back for this slice only, once for them all
        self.triton_state = TritonState()
        for blk in self.layers.values():
            if isinstance(blk.attn, (Attention, LatentAttention)):
                blk.attn.triton_state = self.triton_state
            if isinstance(blk.mlp, (FeedForward, MoE)):
                blk.mlp.triton_state = self.triton_state
        self.set_kernels(kernels or KernelSpec(), attention)
        self._weight_only: dict[str, LayerWeightOnly] = {}
        self._head_weight_only: WeightOnly | None = None
        self._blocks = None  # strata.kernels.cpu_decode.Decoder (decode_weights="blocks")
        self.pool, self._pools, self._extents, self._cache_len = 0, {}, [], 0  # setup_cache's
        self._slots: list[dict] = []  # per sequence: layer -> (k, v) cache (setup_cache's seqs); self.slot is in use
        self._slot_caches: dict = {}  # layer -> (k, v) of every slot (the tensors _slots' caches are views of)
        self.batch_rows = True  # decode_seqs multiplies a batch's rows at once (the rig's decode_batch: rows)
        self.slot = -1
        # bumped whenever the weights or the KV cache are replaced: what holds their addresses (the CUDA graphs of
        # strata.decode.graphs) is stale
        self.storage_version = 0
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None  # CPU decode: cos, signed sin by position

    # -- weights ---------------------------------------------------------------------------
    def load_weights(self, tensors: dict, device, dtype) -> None:
        """Assign canonical (HF-layout) tensors; see strata.models.names for the names.

        A value is a float tensor (held dense in `dtype`) or a `Quantized` block tensor (held as
        stored: its layer runs from the scratch). Consumes `tensors` layer by layer (entries are
        popped), so fusing q/k/v and gate/up never holds a second copy of the whole slice.
        """
        from strata.models.names import shapes
        args, want = self.args, shapes(self.args)
        self._device_dtype = (torch.device(device), dtype)
        if any(isinstance(t, Quantized) for t in tensors.values()):
            self.scratch = Scratch(args, device, dtype)

        def check(name, t):
            s = name.rsplit(".", 1)[-1]
            got = (*t.blocks.shape[:-1], t.cols) if isinstance(t, Quantized) else tuple(t.shape)
            if tuple(got) != want[s]:
                raise ValueError(f"weight {name} has shape {tuple(got)}, the config expects {want[s]}")
            return t

        def take(name, keep=False):
            if name not in tensors:
                raise ValueError(f"weights missing: {name}")
            return check(name, tensors[name] if keep else tensors.pop(name))

        def dense(t):
            if isinstance(t, Quantized):
                q, t = t, _dequantize(t.blocks.to(device), t.qtype, self.triton_state)
                if q.col_perm is not None:  # columns back in the canonical order
                    t = t[:, q.col_perm.to(device)]
            return t.to(device=device, dtype=dtype)

        def param(t):
            return nn.Parameter(dense(t), requires_grad=False)

        def norm(t):  # gemma's (1 + w), held in float32: its products are taken there
            if not args.norm_offset:
                return param(t)
            return nn.Parameter(t.to(device=device, dtype=torch.float32) + 1.0, requires_grad=False)

        orders: dict = {}  # a column order on the device, one for all the layers' matrices that share it

        def packed(t):
            if isinstance(t, Quantized):
                perm = None if t.col_perm is None else orders.setdefault(id(t.col_perm), t.col_perm.to(device))
                return Packed(t.blocks.to(device), t.qtype, t.cols, dtype, self.triton_state, perm)
            return Packed(dense(t), None, t.shape[1], dtype)

        head_w = None
        if self.has_head:  # before the embedding: a tied head on the first slice shares it
            src = take("head") if "head" in tensors else take("embed", keep=True)
            head_w = packed(src) if isinstance(src, Quantized) else param(src)
            self.norm.weight = norm(take("norm"))
            self.head = Head(head_w, head_rows(args), self.scratch, self.gemv if isinstance(head_w, Packed) else None)
        if self.has_embed:
            src = take("embed")
            if head_w is not None and args.tie_embeddings:
                table = head_w
            else:
                table = packed(src) if isinstance(src, Quantized) else param(src)
            if isinstance(table, Packed):
                self.embed = QuantEmbedding(table)
            else:
                self.embed = nn.Embedding(args.vocab_size, args.dim, _weight=table)
                self.embed.weight = table  # the very Parameter the tied head holds: one copy
        for i in range(self.start, self.end):
            p, blk = f"layers.{i}.", self.layers[str(i)]
            blk.attn_norm.weight = norm(take(p + "attn_norm"))
            blk.mlp_norm.weight = norm(take(p + "mlp_norm"))
            if args.post_norms:
                blk.attn_post_norm.weight = norm(take(p + "attn_post_norm"))
                blk.mlp_post_norm.weight = norm(take(p + "mlp_post_norm"))
            lin = {}  # a linear layer's quantized matrices: held resident with its MLP's (ResidentMatrices)
            if blk.linear:
                la = blk.attn
                for attr, n in (("conv", "lin_conv"), ("dt_bias", "lin_dt"), ("a_log", "lin_alog"),
                                ("norm", "lin_norm")):
                    setattr(la, attr, param(take(p + n)))
                mats = {attr: take(p + n) for attr, n in LINEAR_MATS}
                if any(isinstance(t, Quantized) for t in mats.values()):
                    lin = {n: mats[attr] for attr, n in LINEAR_MATS}
                    for attr, _ in LINEAR_MATS:
                        setattr(la, attr, None)
                else:
                    for attr, t in mats.items():
                        setattr(la, attr, param(t))
            elif blk.latent:
                self._load_latent(blk.attn, p, take, param, dense, packed)
            elif args.qk_norm:
                blk.attn.q_norm.weight = norm(take(p + "q_norm"))
                blk.attn.k_norm.weight = norm(take(p + "k_norm"))
            if args.attn_sinks:
                blk.attn.sinks = nn.Parameter(dense(take(p + "sinks")).float(), requires_grad=False)
            if blk.moe:
                e = blk.mlp
                # a sigmoid router's logits and bias are taken in float32 (as GLM's)
                f32 = (lambda t: nn.Parameter(dense(t).float(), requires_grad=False)) if e.kind == "sigmoid" else param
                e.router = f32(take(p + "router"))
                if e.router_bias is not None:
                    e.router_bias = f32(take(p + "router_bias"))
                if e.bias:
                    e.b13 = param(torch.cat([dense(take(p + "e_gate_b")), dense(take(p + "e_up_b"))], 1))
                    e.b2 = param(take(p + "e_down_b"))
                g, u, d = take(p + "e_gate"), take(p + "e_up"), take(p + "e_down")
                if isinstance(g, Quantized) and isinstance(u, Quantized) and g.qtype == u.qtype \
                        and isinstance(d, Quantized):  # as stored: a row of blocks is a row of weights
                    e.resident = ResidentExperts(packed(Quantized(torch.cat([g.blocks, u.blocks], 1), g.qtype, g.cols)),
                                                 packed(d), self.scratch, self.gemv)
                    e.w13 = e.w2 = None
                else:
                    e.w13 = param(torch.cat([dense(g), dense(u)], 1))
                    e.w2 = param(d)
                if e.sffn:
                    e.s13 = param(torch.cat([dense(take(p + "s_gate")), dense(take(p + "s_up"))]))
                    e.s2 = param(take(p + "s_down"))
                if e.s_sig is not None:
                    e.s_sig = param(take(p + "s_sig"))
            mats = ((() if blk.linear or blk.latent else ("wq", "wk", "wv", "wo") + (("wg",) if args.attn_gate else ()))
                    + (() if blk.moe else ("w_gate", "w_up", "w_down")))
            parts = {**{n: take(p + n) for n in mats}, **lin}
            bias = (torch.cat([dense(take(p + n)) for n in ("bq", "bk", "bv")])
                    if args.qkv_bias and not blk.linear else None)
            if any(isinstance(t, Quantized) for t in parts.values()):
                bo = dense(take(p + "bo")) if args.o_bias and not blk.linear else None
                blk.weights = ResidentMatrices({n: packed(t) for n, t in parts.items()}, bias, self.scratch, bo,
                                               self.gemv)
                continue
            with torch.device("meta"):
                m = DenseMatrices(args, mlp=not blk.moe, attn=not (blk.linear or blk.latent))
            if not (blk.linear or blk.latent):
                qkv = ("wq", "wk", "wv") + (("wg",) if args.attn_gate else ())
                m.wqkv.weight = param(torch.cat([dense(parts.pop(n)) for n in qkv]))
                m.wqkv.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
                m.wo.weight = param(parts.pop("wo"))
                if args.o_bias:
                    m.wo.bias = param(take(p + "bo"))
            if not blk.moe:
                m.w13.weight = param(torch.cat([dense(parts.pop(n)) for n in ("w_gate", "w_up")]))
                m.w2.weight = param(parts.pop("w_down"))
            blk.weights = m
        unused = sorted(n for n in tensors if n != "embed")  # (a tied head's source, read in place)
        if unused:  # a tensor given and not held would be a variation computed without it: silently wrong
            raise ValueError(f"weights given but not used: {unused[:4]}")
        meta = [n for n, t in list(self.named_parameters()) + list(self.named_buffers()) if t.is_meta and n != "inv_freq"]
        if meta:
            raise ValueError(f"weights missing: {meta[:4]}")
        self.inv_freq = rope_frequencies(self.args).to(device)  # also when built on the meta device
        if self.inv_freq_window is not None:
            self.inv_freq_window = self.inv_freq_window.to(device)
        self.storage_version += 1
        if self.decode_weights:
            self.set_decode_weights(self.decode_weights)

    def _load_latent(self, la: LatentAttention, p: str, take, param, dense, packed) -> None:
        """An MLA layer's projections (LatentMatrix: dense, or a quantized file's blocks held resident) and norms;
        kv_b dense (the absorbed form's per-head views); DeepSeek's interleaved rope rows (of q and of kv_a's shared
        key) put in halves order once here (mla.deinterleave_rows: whole rows, so a resident matrix's block rows too)."""
        a = self.args

        def mat(name, heads=0, width=0):
            t = take(p + name)
            if heads and a.rope_interleave:
                if isinstance(t, Quantized):
                    t = Quantized(deinterleave_rows(t.blocks, heads, width, a.qk_rope_dim), t.qtype, t.cols)
                else:
                    t = deinterleave_rows(dense(t), heads, width, a.qk_rope_dim)
            if isinstance(t, Quantized):
                return LatentMatrix(packed(t), name, self.scratch, self.gemv)
            return LatentMatrix(param(t))

        if a.q_lora_rank:
            la.wq_a = mat("wq_a")
            la.q_a_norm.weight = param(take(p + "q_a_norm"))
            la.wq_b = mat("wq_b", a.n_heads, a.head_dim)
        else:
            la.wq = mat("wq", a.n_heads, a.head_dim)
        la.wkv_a = mat("wkv_a", 1, a.kv_lora_rank + a.qk_rope_dim)
        la.kv_a_norm.weight = param(take(p + "kv_a_norm"))
        la.wkv_b = param(take(p + "wkv_b"))
        la.wo = mat("wo")
        ix = la.indexer
        if ix is not None:  # DSA: its first qk_rope_dim values roped; GLM-5's in adjacent pairs (its LayerNorm's too)
            r, heads, width = a.qk_rope_dim, a.index_heads, a.index_head_dim
            pairs = ((lambda t, h: deinterleave_rows(dense(t), h, width, r, first=True)) if a.index_rope_interleave
                     else (lambda t, h: dense(t)))
            ix.wq_b = param(pairs(take(p + "ix_wq_b"), heads))
            ix.wk = param(pairs(take(p + "ix_wk"), 1))
            ix.k_norm_w = param(pairs(take(p + "ix_k_norm"), 1))
            ix.k_norm_b = param(pairs(take(p + "ix_k_norm_b"), 1))
            ix.w = param(take(p + "ix_w"))

    def set_kernels(self, kernels: KernelSpec, attention: str = "auto") -> None:
        """The kernels this slice computes with: the rig's `kernels` (read here by strata.decode.graphs too) and its
        `attention`, the CUDA prefill path (auto: CUDA_ATTENTION_DEFAULT). Arguments, not module globals, so a
        remote stage computes as the head's rig says. A Triton fallback already on `triton_state` stays (a kernel
        that failed to build would fail again); the GemvKernels' is forgotten with its choices."""
        self.kernels = kernels
        self.cuda_attention = CUDA_ATTENTION_DEFAULT if attention == "auto" else attention
        fused = kernels.prefill == "triton"
        for blk in self.layers.values():
            if isinstance(blk.attn, Attention):
                blk.attn.cuda_attention, blk.attn.fused = self.cuda_attention, fused
                blk.attn.window_kernel = kernels.window_attention
            if isinstance(blk.mlp, FeedForward):
                blk.mlp.fused = fused
        if self._gemv is not None:
            self._gemv.choose(kernels)

    @property
    def gemv(self):
        """The resident decode products' kernels (strata.quant.gemv.GemvKernels, from `kernels`), one object for the
        slice's matrices, head and experts: a dp4a kernel that fails to build falls back on it, once for them all."""
        if self._gemv is None:
            from strata.quant.gemv import GemvKernels  # Triton: imported only by a slice with resident matrices
            self._gemv = GemvKernels()
            self._gemv.choose(self.kernels)
        return self._gemv

    def device_dtype(self) -> tuple[torch.device, torch.dtype]:
        if self._device_dtype is not None:
            return self._device_dtype
        w = next(iter(self.layers.values())).attn_norm.weight  # before loading: the norms' (the compute dtype)
        return w.device, w.dtype

    def setup_cache(self, max_len: int, kv_dtype="auto", max_chunk: int | None = None, seqs: int = 1,
                    prefix_block: int = PREFIX_BLOCK, pool: int = 0) -> int:
        """Allocate the KV cache for `max_len` positions once; returns its size in bytes.

        kv_dtype: "auto" (the compute dtype), "bfloat16", "float16", "float8_e4m3fn" or "q8_0" (8-bit K and V,
        q8_0 with a scale per 32 values; each layer's cached prefix is widened to the compute dtype for its
        attention). max_chunk: the most rows
        a forward call takes; given, a window layer keeps a ring of window + max_chunk - 1 rows
        (ModelArgs.kv_positions) instead of every position. seqs: that many caches (slots), one per sequence;
        `use_slot` says which one the next forward reads and writes (slot 0 after this). prefix_block: an 8-bit
        cache's prefix positions widened at once for a chunk's attention (the planner's, by the stage's memory). pool
        (seqs > 1; >= max_len): the global layers' positions of every slot in one pool of that many, a slot holding
        the extent place_slot gives it (the rig's kv_pool); 0: each slot max_len of its own."""
        device, dtype = self.device_dtype()
        kv = kv_dtype_of(kv_dtype, dtype)
        self.storage_version += 1  # captured graphs address the old cache
        for i, blk in self.layers.items():
            if blk.linear:  # a state of fixed size, not a cache: one a sequence
                blk.attn.setup_state(device, seqs)
                blk.attn.max_len = max_len  # (positions the slice serves: the decode graphs' bound)
                continue
            blk.attn.k_cache = blk.attn.v_cache = None  # free the old cache before the new one
            blk.attn.max_len, blk.attn.prefix_block = max_len, prefix_block
        self._slots, self._slot_caches, self._pools = [], {}, {}  # (the old caches freed first)
        self.pool, self._cache_len = (pool if seqs > 1 else 0), max_len
        if self.pool and self.pool < max_len:
            raise ValueError(f"a KV pool of {self.pool} positions holds no {max_len}-position sequence")
        rows = [(h, cache_width(w, kv)) for h, w in self.args.kv_rows()]  # K's and V's (heads, width)
        # a layer's slots in one tensor (seqs, nkv, positions, width), each slot its view [s:s + 1]: a decode batch's
        # kernels reach every row's cache from one base by the row's slot (strata.decode.batch_graphs). With a pool, a
        # global layer's positions are one tensor (1, nkv, pool, width) for every slot, and slot s is the extent
        # place_slot gave it, [off, off + cap); slot_caches then shows the pool as (1, nkv, pool, width) with
        # one position between "slots" (its first dim's stride; no index past 0 is a valid view, but the kernels read
        # only the rows a slot holds), so the same kernels reach row p of the extent at off from "slot" `off`.
        for i, blk in self.layers.items():
            if blk.linear:
                continue
            if self.pool and blk.attn.window is None:
                k, v = (torch.zeros(1, h, self.pool, w, device=device, dtype=kv) for h, w in rows)
                self._pools[i] = (k, v)
                self._slot_caches[i] = tuple(c.as_strided((1, h, self.pool, w), (w, self.pool * w, w, 1))
                                             for c, (h, w) in zip((k, v), rows))
                continue
            n = self.args.kv_positions(int(i), max_len, max_chunk)
            self._slot_caches[i] = tuple(torch.zeros(seqs, h, n, w, device=device, dtype=kv) for h, w in rows)
        # (a pooled layer's slot holds no position until place_slot)
        self._slots = [{i: (k[:, :, :0], v[:, :, :0]) if i in self._pools else (ck[s:s + 1], cv[s:s + 1])
                        for i, (ck, cv) in self._slot_caches.items() for k, v in [self._pools.get(i, (ck, cv))]}
                       for s in range(seqs)]
        self._extents = [(0, 0)] * seqs  # with a pool: each slot's (offset, positions)
        self.slot = -1
        self.use_slot(0)
        if self._blocks is not None:
            self._blocks.bind_cache()
        return self.kv_bytes

    @property
    def n_slots(self) -> int:
        """Sequences whose caches the slice holds (setup_cache's seqs)."""
        return len(self._slots)

    def slot_caches(self, layer: str) -> tuple[torch.Tensor, torch.Tensor]:
        """An attention layer's K and V caches of every slot: (seqs, nkv, positions, width) each; slot s is [s]. A
        pooled layer's (setup_cache's pool): the pool as (1, nkv, pool, width) whose first dim's stride is one
        position: the decode batch kernels' slot index slot_base(s) reaches slot s's extent."""
        return self._slot_caches[layer]

    def pooled(self, layer: str) -> bool:
        """Whether the layer's slots are extents of one pool (setup_cache's pool): slot_base, not the slot, is a
        batch row's index into slot_caches."""
        return layer in self._pools

    def pool_caches(self, layer: str) -> tuple[torch.Tensor, torch.Tensor]:
        """A pooled layer's K and V pools as allocated, (1, nkv, pool, width) each."""
        return self._pools[layer]

    def slot_base(self, slot: int) -> int:
        """A pooled layer's index of slot `slot` in slot_caches: its extent's first position."""
        return self._extents[slot][0]

    def slot_positions(self, slot: int) -> int:
        """Positions slot `slot` holds in every layer: its extent's with a pool, else the cache's."""
        return self._extents[slot][1] if self.pool else self._cache_len

    def place_slot(self, slot: int, offset: int, positions: int) -> None:
        """Slot `slot`'s global layers at positions [offset, offset + positions) of the pool (setup_cache's pool):
        the extent the head's allocator gave its sequence (strata.head.slots). Its rows there are the sequence's; what
        the extent held before is not cleared (its sequence wrote every row it reads)."""
        if not self.pool:
            raise ValueError("place_slot: the slots have no pool (setup_cache's pool is 0)")
        if not (0 <= slot < len(self._slots) and 0 <= offset and 0 <= positions and offset + positions <= self.pool):
            raise ValueError(f"slot {slot} at [{offset}, {offset + positions}) of a {self.pool}-position pool "
                             f"with {len(self._slots)} slots")
        if self._extents[slot] == (offset, positions):
            return
        for i, (k, v) in self._pools.items():
            self._slots[slot][i] = (k[:, :, offset:offset + positions], v[:, :, offset:offset + positions])
        self._extents[slot] = (offset, positions)
        if slot == self.slot:
            self.slot = -1
            self.use_slot(slot)
        if self._blocks is not None:
            self._blocks.slot_moved(slot)

    def use_slot(self, slot: int) -> None:
        """Point every layer at sequence `slot`'s cache (setup_cache's seqs): what the next forward reads and
        writes. The CUDA graphs address one slot's cache: a stage with several slots decodes eagerly."""
        if slot == self.slot:
            return
        if not 0 <= slot < len(self._slots):
            raise ValueError(f"slot {slot} outside the {len(self._slots)} sequence caches")
        for i, (k, v) in self._slots[slot].items():
            attn = self.layers[i].attn
            attn.k_cache, attn.v_cache = k, v
        for blk in self.layers.values():
            if blk.linear:  # its recurrent states, where the slot's sequence left them
                blk.attn.use(slot)
        self.slot = slot
        if self._blocks is not None:
            self._blocks.point_cache()

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights as held (blocks for resident tensors), each shared tensor once."""
        seen, n = set(), 0
        for name, t in list(self.named_parameters()) + list(self.named_buffers()):
            if name == "inv_freq" or id(t) in seen:
                continue
            seen.add(id(t))
            n += t.numel() * t.element_size()
        return n

    @property
    def scratch_bytes(self) -> int:
        return 0 if self.scratch is None else self.scratch.nbytes

    @property
    def state_bytes(self) -> int:
        """Bytes of the linear-attention layers' states (their memory does not grow with the prompt)."""
        return sum(blk.attn.state_bytes for blk in self.layers.values() if blk.linear)

    @property
    def kv_bytes(self) -> int:
        """Every slot's K and V (setup_cache's seqs)."""
        if not self._slots:  # caches set by hand (strata.plan.calibrate's probes)
            return sum(c.numel() * c.element_size() for blk in self.layers.values()
                       for c in (blk.attn.k_cache, blk.attn.v_cache) if c is not None)
        pooled = sum(c.numel() * c.element_size() for kv in self._pools.values() for c in kv)
        return pooled + sum(c.numel() * c.element_size() for slot in self._slots for i, kv in slot.items()
                            if i not in self._pools for c in kv)

    # -- compute ---------------------------------------------------------------------------
    def set_prompt_length(self, n: int) -> None:
        """The length of the prompt the next chunks belong to. Only dynamic NTK rope reads it: transformers gives a
        forward over [0, L) the frequencies of L, so each chunk of a prompt of L takes L's, and a decode step at
        position p (>= L) those of p + 1. Stages set it from each chunk's note; 0: a chunk's own end."""
        self.prompt_len = n

    def rope(self, pos: int, T: int, dtype: torch.dtype, kind: str = "global") -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (T, hd) of positions [pos, pos + T); kind "window": the window layers' own base (gemma3)."""
        inv = self.inv_freq_window if kind == "window" else self.inv_freq
        dyn = getattr(self, "rope_dynamic", None)  # (a stand-in (calibrate) has none)
        if dyn is not None and kind == "global" and max(self.prompt_len, pos + T) > dyn["max_position_embeddings"]:
            from strata.models.rope import dynamic_inv_frequencies
            a = self.args
            inv = dynamic_inv_frequencies(a.head_dim, a.rope_theta, dyn, max(self.prompt_len, pos + T),
                                          a.rotary_dim).float().to(inv.device)
        t = torch.arange(pos, pos + T, device=inv.device, dtype=torch.float32)
        freqs = torch.outer(t, inv)
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, hd)
        f = 1.0 if kind == "window" else getattr(self, "rope_factor", 1.0)  # a stand-in (calibrate) has none
        if f != 1.0:
            return (emb.cos() * f).to(dtype), (emb.sin() * f).to(dtype)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def _tables(self, pos: int, T: int, dtype: torch.dtype, decode: bool, device) -> dict:
        """Each rope kind's (cos, signed sin) the slice's layers read, made once per chunk or step."""
        out = {"global": (self._decode_rope(pos, T, dtype, device) if decode
                          else rope_tables(*self.rope(pos, T, dtype)))}
        if self.inv_freq_window is not None:
            out["window"] = rope_tables(*self.rope(pos, T, dtype, "window"))
        return out

    def _decode_rope(self, pos: int, T: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin (T, 1, hd) for a decode step. On CPU, rows of a table made once (grown by
        doubling), the same bits as rope(): a step costs two narrows instead of a dozen ops."""
        if device.type != "cpu" or self.rope_dynamic is not None:  # (dynamic: each step's own frequencies)
            return rope_tables(*self.rope(pos, T, dtype))
        tab = self._rope_table
        if tab is None or tab[0].shape[0] < pos + T or tab[0].dtype != dtype:
            n = max(256, 1 << (pos + T - 1).bit_length())
            tab = self._rope_table = tuple(t.contiguous() for t in rope_tables(*self.rope(0, n, dtype)))
        return tab[0].narrow(0, pos, T), tab[1].narrow(0, pos, T)

    @torch.inference_mode()
    def forward(self, x: torch.Tensor, pos: int, decode: bool | None = None) -> torch.Tensor:
        """x: token ids (1, T) on the first slice, else the residual (1, T, dim). Returns the residual.

        decode: None picks the decode path (strata.models.layer.RowsOps, weight-only kernels if set) for T <= DECODE_T rows,
        the prefill path above; True / False force one. The prefill path's arithmetic is the same for every T;
        the two paths agree up to rounding. (One-token steps through CUDA graphs: strata.decode.graphs.)"""
        T = x.shape[1]
        if decode is None:
            decode = T <= DECODE_T
        return self._run(x, pos, decode)

    def _embedded(self, x: torch.Tensor) -> torch.Tensor:
        """The slice's input as residual rows: ids (1, T) embedded (the first slice), else x itself."""
        if not self.has_embed:
            return x
        h = self.embed(x)
        if self.args.embed_scale != 1.0:
            h = h * torch.tensor(self.args.embed_scale, dtype=h.dtype)  # the scale rounded to the dtype, as gemma
        return h

    def _run(self, x: torch.Tensor, pos: int, decode: bool) -> torch.Tensor:
        T = x.shape[1]
        h = self._embedded(x)
        tabs = self._tables(pos, T, h.dtype, decode, h.device)
        if decode:
            dim = h.shape[-1]
            if self._blocks is not None and T == 1:
                h = h.reshape(dim) if self.has_embed else h.reshape(dim).clone()  # in place: never the caller's
                self._blocks.layers(h, pos, *tabs["global"])
                return h.view(1, 1, dim)
            ops = RowsOps(tabs, h.device, pos=pos, wo=self._weight_only)
            return run_layers(self.layers.values(), h.view(T, dim), ops).view(1, T, dim)
        return run_layers(self.layers.values(), h, PrefillOps(pos, tabs))

    @torch.inference_mode()
    def forward_group(self, x: torch.Tensor, segs: list[tuple[int, int, int]]) -> torch.Tensor:
        """Several sequences' prefill chunks as one (a prefill group, strata/head/slots.py): x their rows in the order of
        segs [(slot, pos, n)] (ids (1, N) on the first slice, else the residual (1, N, dim)) -> the residual.
        Each sequence's rows take its slot's caches and its positions' rope, and each attention is its chunk
        alone's (the same kernel for its (pos, n)); the products take all N rows at once, so each weight is read
        (or dequantized) once for the group. A row is within rounding of its chunk alone: a product's kernel may sum
        in another order for another row count. The caller checks `ModelArgs.group_refusal`."""
        why = self.args.group_refusal()
        if why is not None:
            raise ValueError(f"a prefill group: {why}")
        N = sum(n for _, _, n in segs)
        if x.shape[1] != N or len({s for s, _, _ in segs}) != len(segs):
            raise ValueError(f"a prefill group of {x.shape[1]} rows for {segs}")
        h = self._embedded(x)
        parts = [self._tables(pos, n, h.dtype, False, h.device) for _, pos, n in segs]
        tabs = {kind: tuple(torch.cat([p[kind][j] for p in parts]) for j in (0, 1)) for kind in parts[0]}
        for s, pos, n in segs:
            if not 0 <= s < len(self._slots) or pos + n > self.slot_positions(s):
                raise ValueError(f"a prefill group's rows [{pos}, {pos + n}) of slot {s}: outside its cache")
        ops = PrefillOps(0, tabs, lambda i: [(pos, n, self._slots[s][i]) for s, pos, n in segs])
        return run_layers(self.layers.values(), h, ops)

    @torch.inference_mode()
    def logits(self, h: torch.Tensor, decode: bool = False) -> torch.Tensor:
        """Final norm and head over residual rows (..., dim) -> float32 logits (..., vocab).

        decode: the rows come from decode steps, so the narrower head of `set_decode_weights` may make them. A
        prefill's logits (its last row, the perplexity's rows) always take the dense head: decode weights never
        move a prefill's bits."""
        if decode and self._blocks is not None and h.numel() == h.shape[-1]:
            return self._blocks.logits(h.reshape(-1))[0].view(*h.shape[:-1], -1)
        hw = self._head_weight_only
        if decode and hw is not None and h.numel() <= DECODE_T * h.shape[-1]:  # one fused norm op
            out = hw(self.norm.rows(h).float()).float()
        else:
            out = self.head(self.norm(h)).float()
        c = self.args.final_softcap
        return out if c is None else torch.tanh(out / c) * c

    # -- decode options --------------------------------------------------------------------------
    def set_decode_weights(self, kind: str | None, stored: dict | None = None) -> int:
        """Opt-in narrower weights for rows <= DECODE_T (decode) on CPU: "int4", "int8", "float16",
        "blocks" or None.

        int4 / int8 / float16: re-quantizes the layers' dense matrices to `kind` and the head to float16, once,
        kept beside them, for torch's kernels. blocks: one-token steps run in C on 4/8-bit blocks
        (strata.kernels.cpu_decode; `stored`: the slice's GGUF blocks, used as they are). The prefill path is untouched.
        Returns the extra bytes held."""
        self._weight_only, self._head_weight_only, self.decode_weights, self._blocks = {}, None, None, None
        if kind is None:
            return 0
        if kind not in DECODE_KINDS:
            raise ValueError(f"unknown decode_weights {kind!r} (known: {', '.join(DECODE_KINDS)}, or None)")
        device, _ = self.device_dtype()
        if device.type != "cpu":
            raise ValueError(f"decode_weights={kind!r} uses CPU kernels; this slice is on {device}")
        if self.args.n_experts:
            raise ValueError(f"decode_weights={kind!r} is not implemented for experts (decode reads the chosen ones)")
        if self.args.linear_layers is not None:
            raise ValueError(f"decode_weights={kind!r} is not implemented for linear-attention layers")
        if kind == "blocks":
            from strata.kernels.cpu_decode import Decoder
            self._blocks, self.decode_weights = Decoder(self, stored), kind
            return self._blocks.nbytes
        packs, n = {}, 0
        for i, blk in self.layers.items():
            if not isinstance(blk.weights, DenseMatrices):
                raise ValueError(f"decode_weights={kind!r} needs dense (dequantized) weights; layer {i} is resident")
            m = blk.weights
            packs[i] = LayerWeightOnly(*(WeightOnly(t.weight, kind) for t in (m.wqkv, m.wo, m.w13, m.w2)))
            n += sum(p.nbytes for p in packs[i])
        if self.has_head and not isinstance(self.head.weight, Packed):
            # the head in float16 whatever the layers: SmolLM2's head in int4 moved logits by 0.15 of their
            # max, int8 by 0.02, float16 by 5e-4, and float16 was the fastest of int8 / float16 (3.2 ms)
            self._head_weight_only = WeightOnly(self.head.weight, "float16")
            n += self._head_weight_only.nbytes
        self._weight_only, self.decode_weights = packs, kind
        return n

    def densify(self, max_bytes: int) -> int:
        """Dequantize resident layers, first to last, into dense matrices of their own while their
        dense bytes fit in `max_bytes`: decode steps (and prefill chunks) skip those layers'
        per-call dequantization, and they become eligible for CUDA graphs once all are dense. The
        weights are the bits the scratch would get, so results do not change. Returns layers densified."""
        device, dtype = self.device_dtype()
        n, left = 0, max_bytes
        for blk in self.layers.values():
            r = blk.weights
            if not isinstance(r, ResidentMatrices):
                continue
            parts = r.parts
            need = sum(p.n_rows * p.cols for p in parts.values()) * dtype.itemsize
            if need > left:
                break
            with torch.device("meta"):
                m = DenseMatrices(self.args, mlp=not blk.moe, attn=not (blk.linear or blk.latent))

            def dense(names):  # the parts `names` (those the layer has) stacked by rows, as the scratch gets them
                names = [k for k in names if k in parts]
                w = torch.empty(sum(parts[k].n_rows for k in names), parts[names[0]].cols, device=device, dtype=dtype)
                r0 = 0
                for k in names:
                    out = w[r0:r0 + parts[k].n_rows]
                    parts[k].into(out, stored=torch.empty_like(out) if parts[k].col_perm is not None else None)
                    r0 += parts[k].n_rows
                return nn.Parameter(w, requires_grad=False)
            for attr, names in (("wqkv", PRODUCTS["qkv"]), ("wo", ("wo",)), ("w13", ("w_gate", "w_up")),
                                ("w2", ("w_down",))):
                if any(k in parts for k in names):
                    getattr(m, attr).weight = dense(names)
            if m.wqkv is not None:
                m.wqkv.bias = r.bqkv
            if blk.linear and "lin_qkv" in parts:
                for attr, k in LINEAR_MATS:
                    setattr(blk.attn, attr, dense([k]))
            blk.weights = m
            left -= need
            n += 1
        if n:
            self.storage_version += 1
        return n

    @torch.inference_mode()
    def decode_step(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        """One token at `pos` (x: ids (1, 1) or residual (1, 1, dim)) -> residual (1, 1, dim), by the eager
        decode path (replayed from CUDA graphs: strata.decode.graphs.GraphedDecode.decode_step)."""
        if x.shape[1] != 1:
            raise ValueError(f"decode_step takes one token, got {x.shape[1]}")
        return self._run(x, pos, True)

    @torch.inference_mode()
    def decode_token(self, x: torch.Tensor, pos: int,
                     fresh: bool = True) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """One token at `pos` -> (residual (1, 1, dim), float32 logits (vocab,), argmax); the last two only on
        the slice with the head. By the eager decode path; strata.decode.graphs.GraphedDecode.decode_token gives
        all three from one replay of a CUDA graph, and takes `fresh` (here the outputs are always fresh)."""
        h = self._run(x, pos, True)
        if not self.has_head:
            return h, None, None
        logits = self.logits(h[0, -1], decode=True)
        return h, logits, logits.argmax()

    def decode_batch_kind(self) -> str:
        """How `decode_seqs` runs a batch on this slice (the stage log says it)."""
        if self._blocks is not None and self.rope_dynamic is None:
            return "in C, each weight block read once a batch (each row the bits of its step alone)"
        why = self._rows_refusal()
        if why is None:
            return "as rows through torch's products (each row within rounding of its step alone)"
        return f"one step after another ({why})"

    def _rows_refusal(self) -> str | None:
        if not self.batch_rows:
            return "decode_batch: steps"
        if self.rope_dynamic is not None:
            return "dynamic NTK rope: each step its own frequencies"
        return None

    @torch.inference_mode()
    def decode_seqs(self, x: torch.Tensor, slots: list[int],
                    positions: list[int]) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Several sequences' next tokens at once (max_seqs > 1): row t is sequence slots[t]'s token at
        positions[t] (x: ids (m,) or residual rows (m, dim)), read from and written to that slot's KV. ->
        (residual rows (m, dim), float32 logits (m, vocab), argmaxes (m,)); the last two only with the head.

        The C decoder (decode_weights blocks) reads each weight block once for all the rows and gives each row the
        bits of its step alone, so a sequence's tokens do not depend on what else runs. Through torch the products
        take all the rows at once (batch_rows: the rig's decode_batch rows), each row within rounding of its step
        alone (a product's kernel may sum in another order for another row count); else the rows are stepped one
        after another, each exactly as alone."""
        m, dim = len(slots), self.args.dim
        if self._blocks is not None and self.rope_dynamic is None:
            h = self._embedded(x.view(1, m) if self.has_embed else x).reshape(m, dim).float().contiguous()
            if h.data_ptr() == x.data_ptr():
                h = h.clone()  # in place: never the caller's rows
            top = max(positions) + 1
            cos, ssin = self._decode_rope(0, top, h.dtype, h.device)
            at = torch.tensor(positions, dtype=torch.long)
            self._blocks.layers_rows(h, at.to(torch.int32), cos.reshape(top, -1)[at].contiguous(),
                                     ssin.reshape(top, -1)[at].contiguous(), slots)
            if not self.has_head:
                return h, None, None
            logits, best = self._blocks.logits_rows(h)
            return h, logits, best
        if self._rows_refusal() is None and self._slots:
            h = self._embedded(x.view(1, m) if self.has_embed else x).reshape(m, dim)
            rows = [self._tables(p, 1, h.dtype, True, h.device) for p in positions]  # each row's own, as alone
            tabs = {kind: tuple(torch.cat([r[kind][j] for r in rows]) for j in (0, 1)) for kind in rows[0]}
            linear = [blk.attn for blk in self.layers.values() if blk.linear]
            if len(set(slots)) != m:
                raise ValueError(f"a decode batch names a slot twice: {slots}")
            for la in linear:  # each slot's states stand at its row's position (0: zeroed)
                la.begin_rows(slots, positions)
            at = torch.tensor(slots, device=h.device) if linear else None
            ops = RowsOps(tabs, h.device, wo=self._weight_only, positions=positions, slots=at,
                          caches=lambda i: [self._slots[s][i] for s in slots])
            h = run_layers(self.layers.values(), h, ops)
            for la in linear:
                la.step_rows(slots, positions)
            if not self.has_head:
                return h, None, None
            logits = self.logits(h, decode=True)
            return h, logits, logits.argmax(-1)
        hs, lgs, ams = [], [], []
        for t, (slot, pos) in enumerate(zip(slots, positions)):
            self.use_slot(slot)
            self.set_prompt_length(pos + 1)  # (dynamic NTK: a step at p takes the frequencies of p + 1)
            h, logits, am = self.decode_token(x[t:t + 1].view(1, 1, *x.shape[1:]), pos)
            hs.append(h.reshape(1, -1))
            if self.has_head:
                lgs.append(logits.reshape(1, -1))
                ams.append(am.reshape(1))
        h = torch.cat(hs)
        return (h, torch.cat(lgs), torch.cat(ams)) if self.has_head else (h, None, None)

    @torch.inference_mode()
    def score(self, h: torch.Tensor, targets: torch.Tensor, top: int, block: int = 1024) -> bytes:
        """Each target's log-probability given residual rows h (1, T, dim), and the `top` likeliest tokens at each
        row, as bytes: float32 log-probabilities, then int32 ids and float32 log-probabilities of the top (rows
        by the head of `nll`, in blocks of `block` rows)."""
        rows = h[0, : targets.numel()]
        lps, ids, tops = [], [], []
        for s in range(0, rows.shape[0], block):
            lg = torch.log_softmax(self.logits(rows[s:s + block]), dim=-1)
            lps.append(lg.gather(1, targets[s:s + block].to(lg.device)[:, None])[:, 0].float().cpu())
            if top:
                v, i = lg.topk(top, dim=1)
                tops.append(v.float().cpu().reshape(-1))
                ids.append(i.to(torch.int32).cpu().reshape(-1))
        parts = [torch.cat(lps)] + ([torch.cat(ids), torch.cat(tops)] if top and lps else [])
        return b"".join(p.numpy().tobytes() for p in parts) if lps else b""

    @torch.inference_mode()
    def nll(self, h: torch.Tensor, targets: torch.Tensor, block: int = 1024) -> tuple[float, int]:
        """Summed negative log-likelihood of `targets` given residual rows h (1, T, dim).

        Blocked so that full-vocabulary logits exist for at most `block` rows at once.
        """
        total, n = 0.0, 0
        rows = h[0, : targets.numel()]
        for s in range(0, rows.shape[0], block):
            lg = self.logits(rows[s:s + block])
            total += F.cross_entropy(lg, targets[s:s + block].to(lg.device), reduction="sum").item()
            n += lg.shape[0]
        return total, n
