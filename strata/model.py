"""Llama-family decoder (llama, qwen2) in plain PyTorch, sliceable by layer range.

The model knows nothing about stages, processes or transports. A `Transformer` holds layers
[start, end) of a model, plus the embedding when start == 0 and the final norm and head when
end == n_layers. Prefill is chunked: `forward(x, pos)` runs T tokens at absolute position
`pos`, appending their keys/values to a cache allocated once for the whole prompt.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

ARCHITECTURES = ("llama", "qwen2")


@dataclass(frozen=True)
class ModelArgs:
    arch: str = "llama"
    vocab_size: int = 32000
    dim: int = 4096                  # hidden size (residual width)
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 8              # < n_heads: grouped-query attention
    head_dim: int = 128
    ffn_dim: int = 14336             # SwiGLU inner width
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # Llama-3 style: factor, low/high_freq_factor, original_max_position_embeddings
    tie_embeddings: bool = False
    qkv_bias: bool = False           # qwen2 has q/k/v biases
    max_seq_len: int = 8192
    bos_id: int | None = None
    eos_id: int | None = None

    def __post_init__(self):
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.arch!r} (supported: {', '.join(ARCHITECTURES)})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")

    def layer_param_count(self) -> int:
        attn = self.dim * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        return attn + 3 * self.dim * self.ffn_dim + 2 * self.dim

    def param_count(self, start: int, end: int) -> int:
        """Parameters held by the slice [start, end) (embedding on the first, head on the last)."""
        n = (end - start) * self.layer_param_count()
        if start == 0:
            n += self.vocab_size * self.dim
        if end == self.n_layers:
            n += self.dim + (0 if self.tie_embeddings and start == 0 else self.vocab_size * self.dim)
        return n


# Shape presets for synthetic (random-weight) models: benchmarks and smoke tests.
PRESETS: dict[str, ModelArgs] = {
    "llama-3-8b": ModelArgs(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                            head_dim=128, ffn_dim=14336, rope_theta=500000.0, max_seq_len=131072,
                            rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                              original_max_position_embeddings=8192)),
    "llama-3-70b": ModelArgs(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                             head_dim=128, ffn_dim=28672, rope_theta=500000.0, max_seq_len=131072,
                             rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                               original_max_position_embeddings=8192)),
    "smoke": ModelArgs(vocab_size=512, dim=128, n_layers=8, n_heads=4, n_kv_heads=2, head_dim=32,
                       ffn_dim=256, max_seq_len=65536),
    "smoke-wide": ModelArgs(vocab_size=2048, dim=1024, n_layers=8, n_heads=16, n_kv_heads=4,
                            head_dim=64, ffn_dim=2816, max_seq_len=131072),
}


def rope_frequencies(args: ModelArgs) -> torch.Tensor:
    """Inverse frequencies (head_dim/2,), with Llama-3 wavelength-dependent scaling if configured."""
    inv = 1.0 / (args.rope_theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.float64) / args.head_dim))
    sc = args.rope_scaling
    if sc:
        factor, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
        old = sc["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = ((old / wavelen) - lo) / (hi - lo)
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        mid = (wavelen <= old / lo) & (wavelen >= old / hi)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    return inv.float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (1, nh, T, hd); rotate-half convention (HF layout; GGUF q/k rows are un-permuted on load)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int) -> torch.Tensor:
    """Queries of one chunk at `pos` against keys [0, pos + T): causal, bottom-right aligned.

    q: (1, nh, T, hd); k, v: (1, nkv, pos + T, hd). Never builds a dense (T, pos + T) mask.
    """
    T, S = q.shape[2], k.shape[2]
    if pos == 0:  # square: top-left and bottom-right alignment coincide
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    if q.is_cuda:
        if CUDA_ATTENTION == "cudnn-split" and q.dtype != torch.float32:
            return _split_attention(q, k, v, pos, _cudnn_with_lse)
        # flash (memory-efficient for fp32) handles the lower-right alignment natively.
        # Imported here: torch.nn.attention.bias pulls in dynamo, ~1 s at every process start.
        from torch.nn.attention.bias import causal_lower_right
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(T, S), enable_gqa=True)
    # CPU: the lower-right bias would materialise a mask; split instead
    return _split_attention(q, k, v, pos, _cpu_with_lse)


# "flash": one lower-right causal call. "cudnn-split": the cached prefix unmasked plus the
# chunk's own keys causal and square, both through cuDNN (its fast cases; performance.md).
CUDA_ATTENTION = os.environ.get("STRATA_CUDA_ATTENTION", "cudnn-split")


def _split_attention(q, k, v, pos, attend):
    """Attention over [prefix | own chunk] as two calls merged by their log-sum-exp."""
    out_p, lse_p = attend(q, k[:, :, :pos], v[:, :, :pos], False)
    out_s, lse_s = attend(q, k[:, :, pos:], v[:, :, pos:], True)
    lse = torch.logaddexp(lse_p, lse_s)
    w_p = torch.exp(lse_p - lse).unsqueeze(-1)
    w_s = torch.exp(lse_s - lse).unsqueeze(-1)
    return (out_p.float() * w_p + out_s.float() * w_s).to(q.dtype)


def _cpu_with_lse(q, k, v, causal):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
    return out, lse


def _cudnn_with_lse(q, k, v, causal):
    # grouped-query attention natively: fewer key/value heads than query heads, no expansion
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False)[:2]
    return out, lse.view(q.shape[:3])


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.nh, self.nkv, self.hd = args.n_heads, args.n_kv_heads, args.head_dim
        # q, k, v fused into one projection: one GEMM instead of three
        self.wqkv = nn.Linear(args.dim, (self.nh + 2 * self.nkv) * self.hd, bias=args.qkv_bias)
        self.wo = nn.Linear(self.nh * self.hd, args.dim, bias=False)
        self.k_cache: torch.Tensor | None = None  # (1, nkv, max_len, hd)
        self.v_cache: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, pos: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        T = x.shape[1]
        qkv = self.wqkv(x)
        q, k, v = qkv.split([self.nh * self.hd, self.nkv * self.hd, self.nkv * self.hd], dim=-1)
        q = q.view(1, T, self.nh, self.hd).transpose(1, 2)     # (1, nh, T, hd)
        k = k.view(1, T, self.nkv, self.hd).transpose(1, 2)    # (1, nkv, T, hd)
        v = v.view(1, T, self.nkv, self.hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.k_cache is None:
            raise RuntimeError("KV cache not allocated: call Transformer.setup_cache(max_len) first")
        if pos + T > self.k_cache.shape[2]:
            raise ValueError(f"positions {pos}..{pos + T} exceed the KV cache ({self.k_cache.shape[2]})")
        self.k_cache[:, :, pos:pos + T] = k
        self.v_cache[:, :, pos:pos + T] = v
        y = chunk_attention(q, self.k_cache[:, :, :pos + T], self.v_cache[:, :, :pos + T], pos)
        return self.wo(y.transpose(1, 2).reshape(1, T, self.nh * self.hd))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.ffn = args.ffn_dim
        self.w13 = nn.Linear(args.dim, 2 * args.ffn_dim, bias=False)  # gate and up, fused
        self.w2 = nn.Linear(args.ffn_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).split(self.ffn, dim=-1)
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attn_norm = RMSNorm(args.dim, args.norm_eps)
        self.attn = Attention(args)
        self.mlp_norm = RMSNorm(args.dim, args.norm_eps)
        self.mlp = FeedForward(args)

    def forward(self, h: torch.Tensor, pos: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(self.attn_norm(h), pos, cos, sin)
        return h + self.mlp(self.mlp_norm(h))


class Transformer(nn.Module):
    """Layers [start, end) of a model; the embedding if start == 0, norm and head if end == n_layers."""

    def __init__(self, args: ModelArgs, start: int = 0, end: int | None = None):
        super().__init__()
        end = args.n_layers if end is None else end
        if not 0 <= start < end <= args.n_layers:
            raise ValueError(f"layer range [{start}, {end}) is outside the model's {args.n_layers} layers")
        self.args, self.start, self.end = args, start, end
        self.has_embed = start == 0
        self.has_head = end == args.n_layers
        self.embed = nn.Embedding(args.vocab_size, args.dim) if self.has_embed else None
        self.layers = nn.ModuleDict({str(i): Block(args) for i in range(start, end)})
        self.norm = RMSNorm(args.dim, args.norm_eps) if self.has_head else None
        self.head = nn.Linear(args.dim, args.vocab_size, bias=False) if self.has_head else None
        self.register_buffer("inv_freq", rope_frequencies(args), persistent=False)

    # -- weights ---------------------------------------------------------------------------
    def load_weights(self, tensors: dict[str, torch.Tensor], device, dtype) -> None:
        """Assign canonical (HF-layout) tensors; see strata.weights for the names.

        Consumes `tensors` layer by layer (entries are popped), so fusing q/k/v and gate/up
        never holds a second copy of the whole slice: a 70B slice fills most of a GPU.
        """
        def take(name):
            if name not in tensors:
                raise ValueError(f"weights missing: {name}")
            return tensors.pop(name).to(device=device, dtype=dtype)

        def assign(sd):
            for name, t in sd.items():
                want = self.get_parameter(name).shape
                if tuple(t.shape) != tuple(want):
                    raise ValueError(f"weight {name} has shape {tuple(t.shape)}, the config expects {tuple(want)}")
            self.load_state_dict(sd, strict=False, assign=True)

        if self.has_head:  # before the embedding: a tied head on the first slice shares it
            head = take("head") if "head" in tensors else tensors["embed"].to(device=device, dtype=dtype)
            assign({"norm.weight": take("norm"), "head.weight": head})
        if self.has_embed:
            assign({"embed.weight": take("embed")})
        for i in range(self.start, self.end):
            p = f"layers.{i}."
            sd = {p + "attn_norm.weight": take(p + "attn_norm"), p + "mlp_norm.weight": take(p + "mlp_norm"),
                  p + "attn.wqkv.weight": torch.cat([take(p + n) for n in ("wq", "wk", "wv")]),
                  p + "attn.wo.weight": take(p + "wo"),
                  p + "mlp.w13.weight": torch.cat([take(p + "w_gate"), take(p + "w_up")]),
                  p + "mlp.w2.weight": take(p + "w_down")}
            if self.args.qkv_bias:
                sd[p + "attn.wqkv.bias"] = torch.cat([take(p + n) for n in ("bq", "bk", "bv")])
            assign(sd)
        meta = [n for n, t in self.named_parameters() if t.is_meta]
        if meta:
            raise ValueError(f"weights missing: {meta[:4]}")
        self.inv_freq = rope_frequencies(self.args).to(device)  # also when built on the meta device

    def setup_cache(self, max_len: int) -> int:
        """Allocate the KV cache for `max_len` positions once; returns its size in bytes."""
        p = next(self.layers.values().__iter__()).attn.wqkv.weight
        nbytes = 0
        for blk in self.layers.values():
            shape = (1, self.args.n_kv_heads, max_len, self.args.head_dim)
            blk.attn.k_cache = torch.zeros(shape, device=p.device, dtype=p.dtype)
            blk.attn.v_cache = torch.zeros(shape, device=p.device, dtype=p.dtype)
            nbytes += 2 * blk.attn.k_cache.numel() * blk.attn.k_cache.element_size()
        return nbytes

    # -- compute ---------------------------------------------------------------------------
    def rope(self, pos: int, T: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.arange(pos, pos + T, device=self.inv_freq.device, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, hd)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @torch.inference_mode()
    def forward(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        """x: token ids (1, T) on the first slice, else the residual (1, T, dim). Returns the residual."""
        h = self.embed(x) if self.has_embed else x
        cos, sin = self.rope(pos, h.shape[1], h.dtype)
        for blk in self.layers.values():
            h = blk(h, pos, cos, sin)
        return h

    @torch.inference_mode()
    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and head over residual rows (..., dim) -> float32 logits (..., vocab)."""
        return self.head(self.norm(h)).float()

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
