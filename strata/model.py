"""Llama-family decoder (llama, qwen2) in plain PyTorch, sliceable by layer range.

The model knows nothing about stages, processes or transports. A `Transformer` holds layers
[start, end) of a model, plus the embedding when start == 0 and the final norm and head when
end == n_layers. Prefill is chunked: `forward(x, pos)` runs T tokens at absolute position
`pos`, appending their keys/values to a cache allocated once for the whole prompt. Up to
DECODE_T rows take a decode path (one unmasked attention call for T=1, fewer ops), optionally
with narrower CPU weights (`set_decode_weights`) or CUDA graphs (`decode_step`, `cuda_graphs`).
"""
from __future__ import annotations

import functools
import math
import os
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple

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
    # on the CPU, also inside a `torch.device("meta")` build: meta arange goes through torch's compiler (~1 s import)
    inv = 1.0 / (args.rope_theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.float64, device="cpu")
                                     / args.head_dim))
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


def apply_rope(x: torch.Tensor, cos: torch.Tensor, ssin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (HF layout; GGUF q/k rows are un-permuted on load): one Triton kernel on CUDA
    (strata.kernels.rope), else 3 torch ops instead of the textbook 5.

    x: (1, T, heads, hd), any strides; cos, ssin: (T, 1, hd), ssin from `_signed_sin`. cat((-x2, x1)) * sin
    is cat((x2, x1)) * cat((-sin1, sin2)), the same products; the swap is a cat (not a roll, which copies a
    strided x first). Returns a new contiguous (1, T, heads, hd) tensor."""
    if x.is_cuda and CUDA_KERNELS == "triton":
        from .kernels import rope
        y = rope(x, cos, ssin)  # one pass instead of three
        if y is not None:
            return y
    half = x.shape[-1] // 2
    return torch.addcmul(x * cos, torch.cat((x[..., half:], x[..., :half]), dim=-1), ssin)


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


# The CUDA prefill path's fused kernels: "triton" (strata/kernels.py: the split path's LSE merge in one pass
# instead of ~8 float32 kernels, RoPE in one instead of three, SiLU*up in one instead of two; the torch
# formulas where Triton is missing) or "torch" (those formulas). STRATA_CUDA_KERNELS=torch: the A/B.
CUDA_KERNELS = os.environ.get("STRATA_CUDA_KERNELS", "triton")


def _split_attention(q, k, v, pos, attend):
    """Attention over [prefix | own chunk] as two calls merged by their log-sum-exp."""
    out_p, lse_p = attend(q, k[:, :, :pos], v[:, :, :pos], False)
    out_s, lse_s = attend(q, k[:, :, pos:], v[:, :, pos:], True)
    if q.is_cuda and CUDA_KERNELS == "triton":
        from .kernels import lse_merge
        out = lse_merge(out_p, lse_p, out_s, lse_s)
        if out is not None:
            return out
    return merge_lse(out_p, lse_p, out_s, lse_s)


def merge_lse(out_p, lse_p, out_s, lse_s):
    """Two attention parts over disjoint keys, (1, nh, T, hd) each with its log-sum-exp (1, nh, T), as
    one: each weighted by its share of the softmax, in float32, rounded once to the parts' dtype."""
    lse = torch.logaddexp(lse_p, lse_s)
    w_p = torch.exp(lse_p - lse).unsqueeze(-1)
    w_s = torch.exp(lse_s - lse).unsqueeze(-1)
    return (out_p.float() * w_p + out_s.float() * w_s).to(out_p.dtype)


def _cpu_with_lse(q, k, v, causal):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
    return out, lse


def _cudnn_with_lse(q, k, v, causal):
    # grouped-query attention natively: fewer key/value heads than query heads, no expansion
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False)[:2]
    return out, lse.view(q.shape[:3])


DECODE_T = 4  # forward() with at most this many rows takes the decode path (Block.decode)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One query row at the last position against all keys k, v (1, nkv, S, hd): nothing masked.

    q: (1, nh, 1, hd) or already (1, nkv, g, hd). Grouped-query attention runs as plain multi-head
    attention: a kv head's g query heads are g query rows against it, so no backend needs GQA
    support and each key is read once. One call, no split; on CUDA flash (efficient for fp32),
    whose kernels do not depend on the key length (cuDNN builds a graph per length)."""
    nkv, hd = k.shape[1], k.shape[3]
    qg = q.reshape(1, nkv, -1, hd)
    if q.is_cuda:
        try:
            if q.dtype in (torch.float16, torch.bfloat16):
                out = torch.ops.aten._scaled_dot_product_flash_attention(qg, k, v)[0]
            else:
                out = torch.ops.aten._scaled_dot_product_efficient_attention(qg, k, v, None, False)[0]
        except RuntimeError:  # a shape or GPU those kernels refuse: the generic dispatcher
            out = F.scaled_dot_product_attention(qg, k, v)
    else:
        out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qg, k, v, 0.0, False)[0]
    return out.reshape(q.shape)


# From this many cached positions a CPU decode step attends over a bfloat16 cache as is (below, widening the
# prefix and the float32 flash kernel were faster on SmolLM2: 512 positions, 7.9 vs 11.7 ms a stage)
BF16_ATTENTION_FROM = 2048


def _bf16_cache_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One query row (1, nh, hd) against a bfloat16 CPU cache k, v (1, nkv, S, hd) -> (1, nh * hd) bfloat16.

    Per kv head two bfloat16 GEMMs and a float32 softmax: at long contexts a decode step streams the cache
    from memory, and this reads it in half the bytes. Per head, because a batched GEMM over the narrowed
    cache (heads max_len apart) is slower than the float32 flash kernel; the flash kernel on bfloat16
    is slower still. The scores are rounded to bfloat16 before the softmax (relative 4e-3), as the cache is."""
    nkv, hd = k.shape[1], k.shape[3]
    qg = (q * hd ** -0.5).to(torch.bfloat16).view(nkv, -1, hd)  # a kv head's query rows
    out = torch.empty(qg.shape, dtype=torch.bfloat16)
    for j in range(nkv):
        p = torch.mm(qg[j], k[0, j].t()).softmax(-1, dtype=torch.float32).to(torch.bfloat16)
        torch.mm(p, v[0, j], out=out[j])
    return out.view(1, -1)


def rope_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Transformer.rope's (T, hd) rows as every layer reads them: cos and signed sin (T, 1, hd), made once per
    chunk or step, not once per layer."""
    return cos[:, None], _signed_sin(sin[:, None])


def _signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin with its first half negated, once per step: rotate_half(x) * sin == roll(x) * signed_sin, bit for bit."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def _rope_rows(x: torch.Tensor, cos: torch.Tensor, ssin: torch.Tensor) -> torch.Tensor:
    # x: (T, heads, hd); cos, ssin: (T, 1, hd), ssin from _signed_sin. The rotate-half form of apply_rope on all
    # heads at once, in 3 ops instead of 5 (a decode step is bound by per-op dispatch): cat((-x2, x1)) * sin is
    # cat((x2, x1)) * cat((-sin1, sin2)), the same products, and cat((x2, x1)) is a roll by half
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), ssin)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype:
            # one fused kernel on CUDA (float32 inside, the weight applied before the one rounding) instead of
            # ~8 over a float32 copy; below, transformers' formula (normalized rows rounded, then the weight)
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


# -- weights as a Block asks for them ---------------------------------------------------------
@dataclass
class Quantized:
    """A matrix in its GGUF block format: `blocks` uint8 (rows, bytes_per_row), `cols` weights per row."""
    blocks: torch.Tensor
    qtype: str
    cols: int


class Mats(NamedTuple):
    """One layer's matrices in the compute dtype, fused: q/k/v in one GEMM, gate/up in one."""
    wqkv: torch.Tensor
    bqkv: torch.Tensor | None
    wo: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor


# strata.quant.dequantize returns float32; at most this many values at once bounds that transient (32 MiB)
DEQUANT_PIECE = 1 << 23
_ALIGN = 64  # scratch regions start on 256-byte (fp32) boundaries: GEMMs see the same alignment as a fresh tensor

KV_DTYPES = ("auto", "float32", "bfloat16", "float16", "float8_e4m3fn")


def _matrix_shapes(args: ModelArgs) -> dict[str, tuple[int, int]]:
    hd = args.head_dim
    return {"wq": (args.n_heads * hd, args.dim), "wk": (args.n_kv_heads * hd, args.dim),
            "wv": (args.n_kv_heads * hd, args.dim), "wo": (args.dim, args.n_heads * hd),
            "w_gate": (args.ffn_dim, args.dim), "w_up": (args.ffn_dim, args.dim), "w_down": (args.dim, args.ffn_dim)}


def scratch_layout(args: ModelArgs) -> tuple[dict[str, tuple[int, int, int]], int]:
    """Where each matrix of a layer lands in the scratch: name -> (offset, rows, cols); and the total elements.

    q, k, v are adjacent (one wqkv view), as are gate and up (one w13 view)."""
    sh = _matrix_shapes(args)
    out, off = {}, 0
    for group in (("wq", "wk", "wv"), ("wo",), ("w_gate", "w_up"), ("w_down",)):
        off = -(-off // _ALIGN) * _ALIGN
        for n in group:
            r, c = sh[n]
            out[n] = (off, r, c)
            off += r * c
    return out, off


def head_rows(args: ModelArgs) -> int:
    """Vocabulary rows per head slice, in both load modes (the same slicing gives the same logits bits)."""
    _, total = scratch_layout(args)
    return max(1, min(args.vocab_size, total // args.dim))


def dequant_piece_bytes(args: ModelArgs) -> int:
    """Largest float32 transient strata.quant.dequantize returns while a resident slice runs."""
    sh = dict(_matrix_shapes(args), head=(args.vocab_size, args.dim))
    return max(min(r, max(1, DEQUANT_PIECE // c)) * c * 4 for r, c in sh.values())


def kv_dtype_of(kv_dtype, compute: torch.dtype) -> torch.dtype:
    if isinstance(kv_dtype, torch.dtype):
        return kv_dtype
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"unknown kv_dtype {kv_dtype!r} (known: {', '.join(KV_DTYPES)})")
    return compute if kv_dtype == "auto" else getattr(torch, kv_dtype)


def _dequantize(blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    from .quant import dequantize
    return dequantize(blocks, qtype)


class Scratch:
    """ONE buffer in the compute dtype that each resident layer is dequantized into just before it runs.

    Every layer (and the head, slice by slice) reuses it, so a stage holds its weights as stored plus
    one layer dense. A prefill chunk of thousands of tokens amortizes the dequantization."""

    def __init__(self, args: ModelArgs, device, dtype: torch.dtype):
        self.layout, total = scratch_layout(args)
        self.buf = torch.empty(total, device=device, dtype=dtype)
        self.piece_bytes = dequant_piece_bytes(args)

    def view(self, name: str) -> torch.Tensor:
        off, r, c = self.layout[name]
        return self.buf[off:off + r * c].view(r, c)

    def span(self, first: str, last: str) -> torch.Tensor:
        """Adjacent matrices first..last as one (rows, cols) view (wqkv, w13)."""
        off, _, c = self.layout[first]
        o2, r2, _ = self.layout[last]
        return self.buf[off:o2 + r2 * c].view(-1, c)

    def rows(self, n: int, cols: int) -> torch.Tensor:
        return self.buf[:n * cols].view(n, cols)

    @property
    def nbytes(self) -> int:
        """The buffer plus the bounded float32 transient of the dequantizer."""
        return self.buf.numel() * self.buf.element_size() + self.piece_bytes


class Packed(nn.Module):
    """One matrix as stored: GGUF blocks (uint8, rows of whole blocks) or, for F32/F16 tensors, dense in the compute dtype."""

    def __init__(self, data: torch.Tensor, qtype: str | None, cols: int, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("data", data)
        self.qtype, self.cols, self.out_dtype = qtype, cols, dtype

    @property
    def n_rows(self) -> int:
        return self.data.shape[0]

    def into(self, out: torch.Tensor, r0: int = 0, r1: int | None = None) -> torch.Tensor:
        """Rows [r0, r1) dequantized into `out` (r1 - r0, cols), in pieces that bound the float32 transient."""
        r1 = self.n_rows if r1 is None else r1
        if self.qtype is None:
            return out.copy_(self.data[r0:r1])
        if out.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":  # Triton imported only where it can run
            from .quant import into  # the usual K-quants and Q8_0: one kernel, straight into out's dtype
            if into.takes(self.qtype, out) and into.dequantize_into(out, self.data[r0:r1], self.qtype):
                return out
        step = max(1, DEQUANT_PIECE // self.cols)
        for a in range(r0, r1, step):
            b = min(r1, a + step)
            out[a - r0:b - r0].copy_(_dequantize(self.data[a:b], self.qtype))
        return out

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (any shape) only: the embedding never dequantizes its whole table."""
        if self.qtype is None:
            return F.embedding(ids, self.data)
        rows = _dequantize(self.data[ids.reshape(-1)], self.qtype)
        return rows.to(self.out_dtype).view(*ids.shape, self.cols)


class _Linear(nn.Linear):
    """nn.Linear without its random initialisation: every weight comes from a checkpoint (or the synthetic
    generator), and initialising on the meta device imports torch's compiler for the random ops (~1 s of each
    stage's start-up on a 2-core box)."""

    def reset_parameters(self) -> None:
        pass


class DenseMatrices(nn.Module):
    """A layer's matrices held dense in the compute dtype (q/k/v and gate/up fused at load)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        hd = args.head_dim
        self.wqkv = _Linear(args.dim, (args.n_heads + 2 * args.n_kv_heads) * hd, bias=args.qkv_bias)
        self.wo = _Linear(args.n_heads * hd, args.dim, bias=False)
        self.w13 = _Linear(args.dim, 2 * args.ffn_dim, bias=False)
        self.w2 = _Linear(args.ffn_dim, args.dim, bias=False)

    def get(self) -> Mats:
        return Mats(self.wqkv.weight, self.wqkv.bias, self.wo.weight, self.w13.weight, self.w2.weight)


class ResidentMatrices(nn.Module):
    """A layer's matrices as stored; `get` dequantizes them all into the shared scratch (valid until the next layer's get)."""

    def __init__(self, parts: dict[str, Packed], bqkv: torch.Tensor | None, scratch: Scratch):
        super().__init__()
        self.parts = nn.ModuleDict(parts)
        self.bqkv = None if bqkv is None else nn.Parameter(bqkv, requires_grad=False)
        self.scratch = scratch
        self._fused: dict[torch.device, bool] = {}

    def get(self) -> Mats:
        s = self.scratch
        for name, p in self.parts.items():
            p.into(s.view(name))
        return Mats(s.span("wq", "wv"), self.bqkv, s.view("wo"), s.span("w_gate", "w_up"), s.view("w_down"))

    def fused_decode_ok(self, device) -> bool:
        """Whether decode can multiply on the blocks themselves (strata.quant.gemv) on `device`: every
        part quantized in a type the fused kernel takes. Then `products` replaces `get` for few rows."""
        device = torch.device(device)
        if device not in self._fused:  # asked once per layer per token: answered once per device
            self._fused[device] = all(_fused_ok(p, device) for p in self.parts.values())
        return self._fused[device]

    def products(self) -> Products:
        """The layer's four products computed on the blocks (fused_decode_ok must hold): no scratch."""
        return Products(functools.partial(self._matmul, ("wq", "wk", "wv"), bias=self.bqkv),
                        functools.partial(self._matmul, ("wo",)), functools.partial(self._matmul, ("w_gate", "w_up")),
                        functools.partial(self._matmul, ("w_down",)))

    def _matmul(self, names: tuple[str, ...], x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        from .quant.gemv import quant_matmul_parts
        parts = [self.parts[n] for n in names]
        y = quant_matmul_parts(x.reshape(-1, x.shape[-1]), [(p.data, p.qtype) for p in parts], parts[0].cols)
        y = y.view(*x.shape[:-1], y.shape[-1])
        return y if bias is None else y + bias


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.nh, self.nkv, self.hd = args.n_heads, args.n_kv_heads, args.head_dim
        self.k_cache: torch.Tensor | None = None  # (1, nkv, max_len, hd), in the KV dtype
        self.v_cache: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, w: Mats, pos: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: (1, T, dim); cos, sin: (T, 1, hd), sin signed (`rope_tables`)."""
        T = x.shape[1]
        qkv = F.linear(x, w.wqkv, w.bqkv)
        q, k, v = qkv.split([self.nh * self.hd, self.nkv * self.hd, self.nkv * self.hd], dim=-1)
        # rope on the (1, T, heads, hd) rows, then (1, heads, T, hd) views: q's layout is what
        # warm_chunk_attention builds cuDNN's graphs for
        q = apply_rope(q.view(1, T, self.nh, self.hd), cos, sin).transpose(1, 2)    # (1, nh, T, hd)
        k = apply_rope(k.view(1, T, self.nkv, self.hd), cos, sin).transpose(1, 2)   # (1, nkv, T, hd)
        v = v.view(1, T, self.nkv, self.hd).transpose(1, 2)
        if self.k_cache is None:
            raise RuntimeError("KV cache not allocated: call Transformer.setup_cache(max_len) first")
        if pos + T > self.k_cache.shape[2]:
            raise ValueError(f"positions {pos}..{pos + T} exceed the KV cache ({self.k_cache.shape[2]})")
        self.k_cache[:, :, pos:pos + T] = _to_cache(k, self.k_cache.dtype)
        self.v_cache[:, :, pos:pos + T] = _to_cache(v, self.v_cache.dtype)
        keys, vals = self.cached(pos + T, q.dtype)
        y = chunk_attention(q, keys, vals, pos)
        return F.linear(y.transpose(1, 2).reshape(1, T, self.nh * self.hd), w.wo)

    def cached(self, end: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [0, end) as attention reads them: views of the cache, or a narrower cache's
        prefix widened to `dtype` for this layer's attention only."""
        keys, vals = self.k_cache[:, :, :end], self.v_cache[:, :, :end]
        if keys.dtype != dtype:
            keys, vals = keys.to(dtype), vals.to(dtype)
        return keys, vals


# cuDNN builds (and caches, process-wide) an execution graph per attention shape, and each chunk of a prompt
# meets a new cached-prefix length (and, with dynamic chunks, a new own-chunk length), so a cold prefill pays one
# set-up per chunk (8B, 122,880 tokens: 14.2 s cold vs 10.2 s warm, performance.md). Bounded: at most
# WARM_CHUNKS chunk shapes and WARM_BUDGET_S seconds of host time are spent building them ahead.
WARM_CHUNKS = 48
WARM_BUDGET_S = 30.0


@torch.inference_mode()
def warm_chunk_attention(model: "Transformer", shapes, attend=None) -> int:
    """Build cuDNN's graphs for the attention of chunks (pos, n) ahead of a prefill: one layer's unmasked call
    against its cache's first `pos` keys, and the causal call on the chunk's own n keys (once per shape), with a
    zero q of the chunk's shape and layout (the same strides as Attention.forward, which the graph is keyed on).
    Only where chunk_attention takes the cuDNN split (CUDA, half precision); returns how many chunk shapes were
    built (0 elsewhere). Reads the cache, writes nothing. `attend`: the call to make instead (tests)."""
    device, dtype = model._compute()
    if attend is None:
        if device.type != "cuda" or CUDA_ATTENTION != "cudnn-split" or dtype == torch.float32:
            return 0
        attend = _cudnn_with_lse
    attn = next(iter(model.layers.values())).attn
    t0, built, own = time.perf_counter(), 0, set()
    for pos, n in list(shapes)[:WARM_CHUNKS]:
        if pos <= 0 or n <= 0 or pos + n > attn.k_cache.shape[2]:
            continue
        q = torch.zeros(1, n, attn.nh, attn.hd, device=device, dtype=dtype).transpose(1, 2)
        keys, vals = attn.cached(pos + n, dtype)
        attend(q, keys[:, :, :pos], vals[:, :, :pos], False)
        if (n, keys.stride()) not in own:  # a widened cache's strides move with pos: part of the key
            attend(q, keys[:, :, pos:], vals[:, :, pos:], True)
            own.add((n, keys.stride()))
        built += 1
        if time.perf_counter() - t0 > WARM_BUDGET_S:
            break
    return built


_FP8 = {torch.float8_e4m3fn: torch.finfo(torch.float8_e4m3fn).max}


def _to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # fp8 keys/values carry no per-tensor scale: values beyond +-448 are clamped on store (a cast would
    # make them NaN); K and V of Llama-family models sit well inside that range
    if dtype in _FP8:
        return x.clamp(-_FP8[dtype], _FP8[dtype]).to(dtype)
    return x.to(dtype)


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.ffn = args.ffn_dim

    def forward(self, x: torch.Tensor, w: Mats) -> torch.Tensor:
        gate, up = F.linear(x, w.w13).split(self.ffn, dim=-1)
        if x.is_cuda and CUDA_KERNELS == "triton":
            from .kernels import silu_mul
            y = silu_mul(gate, up)
            if y is not None:
                return F.linear(y, w.w2)
        return F.linear(F.silu(gate) * up, w.w2)


# -- weight-only kernels for decode (CPU) -------------------------------------------------------
WEIGHT_ONLY = ("int4", "int8", "float16")
DECODE_KINDS = WEIGHT_ONLY + ("blocks",)  # blocks: strata.cpu_decode (C on 4/8-bit blocks)
INT4_GROUP = 32


class WeightOnly:
    """A dense matrix in fewer bytes for CPU decode, which is bound by reading the weights.

    int8 / int4: torch's weight-only GEMM kernels, whose fast paths take bfloat16 activations (x is
    rounded to bfloat16). int8: one scale per row, symmetric. int4: groups of 32 along a row,
    w = (q - 8) * scale + zero (GGUF Q4_1's w = d*q + m is that with scale d, zero m + 8d).
    float16: the matrix and x in float16 (oneDNN's half GEMM). The product comes back in x's dtype."""

    def __init__(self, w: torch.Tensor, kind: str):
        if kind not in WEIGHT_ONLY:
            raise ValueError(f"unknown decode_weights {kind!r} (known: {', '.join(WEIGHT_ONLY)})")
        n, k = w.shape
        self.kind, self.rows = kind, n
        wf = w.detach().float()
        if kind == "float16":
            self.q, self.scales = wf.half(), torch.empty(0)
            return
        if kind == "int8":
            scale = (wf.abs().amax(1) / 127).clamp_min(torch.finfo(torch.float32).tiny).bfloat16()
            self.q = torch.round(wf / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
            self.scales = scale
            return
        if k % INT4_GROUP:
            raise ValueError(f"int4 decode weights need rows of whole {INT4_GROUP}-groups, got {k}")
        g = wf.view(n, k // INT4_GROUP, INT4_GROUP)
        lo, hi = g.amin(-1), g.amax(-1)
        d = ((hi - lo) / 15).clamp_min(torch.finfo(torch.float32).tiny)
        # round the scale and zero to bfloat16 first, then pick q against the rounded ones
        d_b, z_b = d.bfloat16(), (lo + 8 * d).bfloat16()
        q = torch.round((g - z_b.float()[..., None]) / d_b.float()[..., None]) + 8
        q = q.clamp(0, 15).to(torch.int32).view(n, k)
        self.q = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        self.scales = torch.stack([d_b, z_b], -1).transpose(0, 1).contiguous()  # (k/32, n, 2)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "float16":
            return F.linear(x.to(torch.float16), self.q).to(x.dtype)
        xb = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        if self.kind == "int4":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, self.q, INT4_GROUP, self.scales)
        else:
            y = torch.ops.aten._weight_int8pack_mm(xb, self.q, self.scales)
        return y.to(x.dtype).view(*x.shape[:-1], self.rows)

    def native(self, x: torch.Tensor) -> torch.Tensor:
        """x (rows, k) -> (rows, n) in the kernel's own dtype (bfloat16 for int4 / int8, which take x as
        bfloat16 anyway): the decode path adds it to a float32 residual (type promotion, one op) or feeds it to
        the next kernel, so the casts back and forth of __call__ are skipped."""
        if self.kind == "int4":
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.q, INT4_GROUP, self.scales)
        if self.kind == "int8":
            return torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.q, self.scales)
        return self(x)

    @property
    def nbytes(self) -> int:
        return self.q.numel() * self.q.element_size() + self.scales.numel() * self.scales.element_size()


class LayerWeightOnly(NamedTuple):
    wqkv: WeightOnly
    wo: WeightOnly
    w13: WeightOnly
    w2: WeightOnly


def _mm_rows(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, wo: WeightOnly | None) -> torch.Tensor:
    # x (rows, k); a weight-only product comes back in its kernel's dtype (see WeightOnly.native)
    if wo is None:
        return F.linear(x, w, b)
    y = wo.native(x)
    return y if b is None else y + b


class Products(NamedTuple):
    """A layer's four products for the decode path, each x (..., in) -> (..., out)."""
    qkv: Callable[[torch.Tensor], torch.Tensor]
    wo: Callable[[torch.Tensor], torch.Tensor]
    w13: Callable[[torch.Tensor], torch.Tensor]
    w2: Callable[[torch.Tensor], torch.Tensor]


def _dense_products(w: Mats, wo: LayerWeightOnly | None) -> Products:
    p = functools.partial
    return Products(p(_mm_rows, w=w.wqkv, b=w.bqkv, wo=wo and wo.wqkv), p(_mm_rows, w=w.wo, b=None, wo=wo and wo.wo),
                    p(_mm_rows, w=w.w13, b=None, wo=wo and wo.w13), p(_mm_rows, w=w.w2, b=None, wo=wo and wo.w2))


class Block(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attn_norm = RMSNorm(args.dim, args.norm_eps)
        self.attn = Attention(args)
        self.mlp_norm = RMSNorm(args.dim, args.norm_eps)
        self.mlp = FeedForward(args)
        self.weights: DenseMatrices | ResidentMatrices = DenseMatrices(args)

    def forward(self, h: torch.Tensor, pos: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        w = self.weights.get()
        h = h + self.attn(self.attn_norm(h), w, pos, cos, sin)
        return h + self.mlp(self.mlp_norm(h), w)

    def decode(self, h: torch.Tensor, pos: int, cos: torch.Tensor, sin: torch.Tensor,
               wo: LayerWeightOnly | None = None) -> torch.Tensor:
        """The layer for a few rows (T <= DECODE_T) in fewer ops: fused norms, rope on q and k at
        once, T == 1 attention as one unmasked call; `wo`: weight-only kernels for the matrices.

        h: (1, T, dim). cos, sin: (T, 1, hd), sin signed (`_signed_sin`, made once per step). Same arithmetic as
        forward up to rounding (not the same bits)."""
        T = h.shape[1]
        return self.decode_rows(h.view(T, h.shape[2]), pos, cos, sin, wo).view(1, T, -1)

    def decode_rows(self, h: torch.Tensor, pos: int, cos: torch.Tensor, sin: torch.Tensor,
                    wo: LayerWeightOnly | None = None) -> torch.Tensor:
        """Block.decode on the residual as rows (T, dim): a decode step is bound by per-op dispatch (SmolLM2:
        ~35 tiny ops a layer), so every view, cast and copy that can go does (weight-only products stay in
        bfloat16 until added to the float32 residual; silu(gate) * up in bfloat16, which the next kernel
        rounds its input to anyway)."""
        a, T = self.attn, h.shape[0]
        nh, nkv, hd = a.nh, a.nkv, a.hd
        if a.k_cache is None:
            raise RuntimeError("KV cache not allocated: call Transformer.setup_cache(max_len) first")
        if pos + T > a.k_cache.shape[2]:
            raise ValueError(f"positions {pos}..{pos + T} exceed the KV cache ({a.k_cache.shape[2]})")
        r = self.weights
        if wo is None and isinstance(r, ResidentMatrices) and r.fused_decode_ok(h.device):
            mm = r.products()  # multiply on the blocks: no per-token dequantization into the scratch
        else:
            mm = _dense_products(r.get(), wo)
        x = F.rms_norm(h, (h.shape[-1],), self.attn_norm.weight, self.attn_norm.eps)
        qkv = mm.qkv(x).view(T, nh + 2 * nkv, hd)
        qk = _rope_rows(qkv[:, :nh + nkv], cos, sin)  # in h's dtype (a bfloat16 qkv is promoted)
        kc, vc = a.k_cache, a.v_cache
        k_new, v_new = qk[:, nh:].transpose(0, 1), qkv[:, nh + nkv:].transpose(0, 1)  # (nkv, T, hd)
        if kc.dtype in _FP8:
            k_new, v_new = _to_cache(k_new, kc.dtype), _to_cache(v_new, vc.dtype)
        kc.narrow(2, pos, T).copy_(k_new)  # copy_ casts (and broadcasts the missing batch dim)
        vc.narrow(2, pos, T).copy_(v_new)
        keys, vals = kc.narrow(2, 0, pos + T), vc.narrow(2, 0, pos + T)
        if (T == 1 and keys.dtype == torch.bfloat16 != qk.dtype and keys.device.type == "cpu"
                and pos + 1 >= BF16_ATTENTION_FROM):
            y = _bf16_cache_attention(qk[:, :nh], keys, vals)  # the prefix is never widened
            h = h + mm.wo(y if wo is not None else y.to(h.dtype))
            return self._mlp_rows(h, mm)
        if keys.dtype != qk.dtype:
            keys, vals = keys.to(qk.dtype), vals.to(qk.dtype)
        if T == 1:
            y = decode_attention(qk[:, :nh].view(1, nh, 1, hd), keys, vals).view(1, nh * hd)
        else:
            q = qk[:, :nh].transpose(0, 1).unsqueeze(0)  # (1, nh, T, hd)
            y = chunk_attention(q, keys, vals, pos).transpose(1, 2).reshape(T, nh * hd)
        h = h + mm.wo(y)
        return self._mlp_rows(h, mm)

    def _mlp_rows(self, h: torch.Tensor, mm: Products) -> torch.Tensor:
        x = F.rms_norm(h, (h.shape[-1],), self.mlp_norm.weight, self.mlp_norm.eps)
        gate, up = mm.w13(x).split(self.mlp.ffn, dim=-1)
        return h + mm.w2(F.silu(gate) * up)


class QuantEmbedding(nn.Module):
    """Token embedding kept as stored: a chunk's rows are gathered from their blocks and dequantized."""

    def __init__(self, table: Packed):
        super().__init__()
        self.table = table

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table.gather(ids)


def _fused_ok(p: Packed, device) -> bool:
    from .quant import gemv
    return p.qtype is not None and gemv.supports(p.qtype) and gemv.available(device)


class Head(nn.Module):
    """Output projection to float32 logits, computed in vocabulary slices of `rows`.

    Dense: slices of the weight. Resident: each slice dequantized into the scratch in turn, so the
    whole head never exists dense. Both modes slice alike, so their logits are the same bits."""

    def __init__(self, weight: nn.Parameter | Packed, rows: int, scratch: Scratch | None = None):
        super().__init__()
        self.weight = weight
        self.rows, self.scratch = rows, scratch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        vocab = w.n_rows if isinstance(w, Packed) else w.shape[0]
        out = torch.empty(*x.shape[:-1], vocab, device=x.device, dtype=torch.float32)
        if isinstance(w, Packed) and x.reshape(-1, x.shape[-1]).shape[0] <= DECODE_T and _fused_ok(w, x.device):
            from .quant.gemv import quant_matmul  # decode: one pass over the blocks, float32 logits directly
            quant_matmul(x.reshape(-1, w.cols), w.data, w.qtype, w.cols, out=out.view(-1, vocab))
            return out
        for s in range(0, vocab, self.rows):
            e = min(vocab, s + self.rows)
            if isinstance(w, Packed):
                ws = w.into(self.scratch.rows(e - s, w.cols), s, e)
            else:
                ws = w[s:e]
            out[..., s:e] = F.linear(x, ws)
        return out


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
        # _weight: no random initialisation (see _Linear)
        self.embed = nn.Embedding(args.vocab_size, args.dim, _weight=torch.empty(args.vocab_size, args.dim)) \
            if self.has_embed else None
        self.layers = nn.ModuleDict({str(i): Block(args) for i in range(start, end)})
        self.norm = RMSNorm(args.dim, args.norm_eps) if self.has_head else None
        self.head = (Head(nn.Parameter(torch.empty(args.vocab_size, args.dim), requires_grad=False), head_rows(args))
                     if self.has_head else None)
        self.scratch: Scratch | None = None
        self.register_buffer("inv_freq", rope_frequencies(args), persistent=False)
        self.decode_weights: str | None = None
        self._weight_only: dict[str, LayerWeightOnly] = {}
        self._head_weight_only: WeightOnly | None = None
        self._blocks = None  # strata.cpu_decode.Decoder (decode_weights="blocks")
        self.cuda_graphs = False  # opt-in: forward's one-token steps replay CUDA graphs (decode_step)
        self._graphs = None  # strata.decode_graphs.DecodeGraphs, made on the first graph step
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None  # CPU decode: cos, signed sin by position

    # -- weights ---------------------------------------------------------------------------
    def load_weights(self, tensors: dict, device, dtype) -> None:
        """Assign canonical (HF-layout) tensors; see strata.names for the names.

        A value is a float tensor (held dense in `dtype`) or a `Quantized` block tensor (held as
        stored: its layer runs from the scratch). Consumes `tensors` layer by layer (entries are
        popped), so fusing q/k/v and gate/up never holds a second copy of the whole slice.
        """
        from .names import shapes
        args, want = self.args, shapes(self.args)
        if any(isinstance(t, Quantized) for t in tensors.values()):
            self.scratch = Scratch(args, device, dtype)

        def check(name, t):
            s = name.rsplit(".", 1)[-1]
            got = (t.blocks.shape[0], t.cols) if isinstance(t, Quantized) else tuple(t.shape)
            if tuple(got) != want[s]:
                raise ValueError(f"weight {name} has shape {tuple(got)}, the config expects {want[s]}")
            return t

        def take(name, keep=False):
            if name not in tensors:
                raise ValueError(f"weights missing: {name}")
            return check(name, tensors[name] if keep else tensors.pop(name))

        def dense(t):
            if isinstance(t, Quantized):
                t = _dequantize(t.blocks.to(device), t.qtype)
            return t.to(device=device, dtype=dtype)

        def param(t):
            return nn.Parameter(dense(t), requires_grad=False)

        def packed(t):
            if isinstance(t, Quantized):
                return Packed(t.blocks.to(device), t.qtype, t.cols, dtype)
            return Packed(dense(t), None, t.shape[1], dtype)

        head_w = None
        if self.has_head:  # before the embedding: a tied head on the first slice shares it
            src = take("head") if "head" in tensors else take("embed", keep=True)
            head_w = packed(src) if isinstance(src, Quantized) else param(src)
            self.norm.weight = param(take("norm"))
            self.head = Head(head_w, head_rows(args), self.scratch)
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
            blk.attn_norm.weight = param(take(p + "attn_norm"))
            blk.mlp_norm.weight = param(take(p + "mlp_norm"))
            parts = {n: take(p + n) for n in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")}
            bias = torch.cat([dense(take(p + n)) for n in ("bq", "bk", "bv")]) if args.qkv_bias else None
            if any(isinstance(t, Quantized) for t in parts.values()):
                blk.weights = ResidentMatrices({n: packed(t) for n, t in parts.items()}, bias, self.scratch)
                continue
            with torch.device("meta"):
                m = DenseMatrices(args)
            m.wqkv.weight = param(torch.cat([dense(parts.pop(n)) for n in ("wq", "wk", "wv")]))
            m.wqkv.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
            m.wo.weight = param(parts.pop("wo"))
            m.w13.weight = param(torch.cat([dense(parts.pop(n)) for n in ("w_gate", "w_up")]))
            m.w2.weight = param(parts.pop("w_down"))
            blk.weights = m
        meta = [n for n, t in list(self.named_parameters()) + list(self.named_buffers()) if t.is_meta and n != "inv_freq"]
        if meta:
            raise ValueError(f"weights missing: {meta[:4]}")
        self.inv_freq = rope_frequencies(self.args).to(device)  # also when built on the meta device
        self._graphs = None
        if self.decode_weights:
            self.set_decode_weights(self.decode_weights)

    def _compute(self) -> tuple[torch.device, torch.dtype]:
        w = next(iter(self.layers.values())).attn_norm.weight  # norms are held in the compute dtype
        return w.device, w.dtype

    def setup_cache(self, max_len: int, kv_dtype="auto") -> int:
        """Allocate the KV cache for `max_len` positions once; returns its size in bytes.

        kv_dtype: "auto" (the compute dtype), "bfloat16", "float16", "float8_e4m3fn" (8-bit K and V;
        each layer's cached prefix is widened to the compute dtype for its attention)."""
        device, dtype = self._compute()
        kv = kv_dtype_of(kv_dtype, dtype)
        shape = (1, self.args.n_kv_heads, max_len, self.args.head_dim)
        self._graphs = None  # captured graphs address the old cache
        for blk in self.layers.values():
            blk.attn.k_cache = blk.attn.v_cache = None  # free the old cache before the new one
            blk.attn.k_cache = torch.zeros(shape, device=device, dtype=kv)
            blk.attn.v_cache = torch.zeros(shape, device=device, dtype=kv)
        if self._blocks is not None:
            self._blocks.bind_cache()
        return self.kv_bytes

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
    def kv_bytes(self) -> int:
        return sum(c.numel() * c.element_size() for blk in self.layers.values()
                   for c in (blk.attn.k_cache, blk.attn.v_cache) if c is not None)

    # -- compute ---------------------------------------------------------------------------
    def rope(self, pos: int, T: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.arange(pos, pos + T, device=self.inv_freq.device, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, hd)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def _decode_rope(self, pos: int, T: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin (T, 1, hd) for a decode step. On CPU, rows of a table made once (grown by
        doubling), the same bits as rope(): a step costs two narrows instead of a dozen ops."""
        if device.type != "cpu":
            return rope_tables(*self.rope(pos, T, dtype))
        tab = self._rope_table
        if tab is None or tab[0].shape[0] < pos + T or tab[0].dtype != dtype:
            n = max(256, 1 << (pos + T - 1).bit_length())
            tab = self._rope_table = tuple(t.contiguous() for t in rope_tables(*self.rope(0, n, dtype)))
        return tab[0].narrow(0, pos, T), tab[1].narrow(0, pos, T)

    @torch.inference_mode()
    def forward(self, x: torch.Tensor, pos: int, decode: bool | None = None) -> torch.Tensor:
        """x: token ids (1, T) on the first slice, else the residual (1, T, dim). Returns the residual.

        decode: None picks the decode path (Block.decode, weight-only kernels if set, CUDA graphs if
        enabled) for T <= DECODE_T rows, the prefill path above; True / False force one. The prefill
        path's arithmetic is the same for every T; the two paths agree up to rounding."""
        T = x.shape[1]
        if decode is None:
            decode = T <= DECODE_T
        if decode and T == 1 and self.cuda_graphs and self._graphable(x):
            return self._graph_step(x, pos)
        return self._run(x, pos, decode)

    def _run(self, x: torch.Tensor, pos: int, decode: bool) -> torch.Tensor:
        T = x.shape[1]
        h = self.embed(x) if self.has_embed else x
        if decode:
            cos, sin = self._decode_rope(pos, T, h.dtype, h.device)
            dim = h.shape[-1]
            if self._blocks is not None and T == 1:
                h = h.reshape(dim) if self.has_embed else h.reshape(dim).clone()  # in place: never the caller's
                self._blocks.layers(h, pos, cos, sin)
                return h.view(1, 1, dim)
            h = h.view(T, dim)
            for i, blk in self.layers.items():
                h = blk.decode_rows(h, pos, cos, sin, self._weight_only.get(i))
            return h.view(1, T, dim)
        cos, sin = rope_tables(*self.rope(pos, T, h.dtype))
        for blk in self.layers.values():
            h = blk(h, pos, cos, sin)
        return h

    @torch.inference_mode()
    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and head over residual rows (..., dim) -> float32 logits (..., vocab)."""
        if self._blocks is not None and h.numel() == h.shape[-1]:
            return self._blocks.logits(h.reshape(-1))[0].view(*h.shape[:-1], -1)
        hw = self._head_weight_only
        if hw is not None and h.numel() <= DECODE_T * h.shape[-1]:  # decode rows: one fused norm op
            return hw(F.rms_norm(h, (h.shape[-1],), self.norm.weight, self.norm.eps).float()).float()
        x = self.norm(h)
        return self.head(x).float()

    # -- decode options --------------------------------------------------------------------------
    def set_decode_weights(self, kind: str | None, stored: dict | None = None) -> int:
        """Opt-in narrower weights for rows <= DECODE_T (decode) on CPU: "int4", "int8", "float16",
        "blocks" or None.

        int4 / int8 / float16: re-quantizes the layers' dense matrices to `kind` and the head to float16, once,
        kept beside them, for torch's kernels. blocks: one-token steps run in C on 4/8-bit blocks
        (strata.cpu_decode; `stored`: the slice's GGUF blocks, used as they are). The prefill path is untouched.
        Returns the extra bytes held."""
        self._weight_only, self._head_weight_only, self.decode_weights, self._blocks = {}, None, None, None
        if kind is None:
            return 0
        if kind not in DECODE_KINDS:
            raise ValueError(f"unknown decode_weights {kind!r} (known: {', '.join(DECODE_KINDS)}, or None)")
        device, _ = self._compute()
        if device.type != "cpu":
            raise ValueError(f"decode_weights={kind!r} uses CPU kernels; this slice is on {device}")
        if kind == "blocks":
            from .cpu_decode import Decoder
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

    def _graphable(self, x: torch.Tensor) -> bool:
        """Dense layers, or resident ones the fused kernels multiply on their blocks (strata.quant.gemv); a
        resident head likewise. A resident embedding is gathered outside the graph."""
        if not x.is_cuda or self._weight_only:
            return False
        if self.has_head and isinstance(self.head.weight, Packed) and not _fused_ok(self.head.weight, x.device):
            return False
        return all(isinstance(b.weights, DenseMatrices) or b.weights.fused_decode_ok(x.device)
                   for b in self.layers.values())

    def densify(self, max_bytes: int) -> int:
        """Dequantize resident layers, first to last, into dense matrices of their own while their
        dense bytes fit in `max_bytes`: decode steps (and prefill chunks) skip those layers'
        per-call dequantization, and they become eligible for CUDA graphs once all are dense. The
        weights are the bits the scratch would get, so results do not change. Returns layers densified."""
        device, dtype = self._compute()
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
                m = DenseMatrices(self.args)
            for attr, names in (("wqkv", ("wq", "wk", "wv")), ("wo", ("wo",)), ("w13", ("w_gate", "w_up")),
                                ("w2", ("w_down",))):
                rows = sum(parts[k].n_rows for k in names)
                w = torch.empty(rows, parts[names[0]].cols, device=device, dtype=dtype)
                r0 = 0
                for k in names:
                    parts[k].into(w[r0:r0 + parts[k].n_rows])
                    r0 += parts[k].n_rows
                getattr(m, attr).weight = nn.Parameter(w, requires_grad=False)
            m.wqkv.bias = r.bqkv
            blk.weights = m
            left -= need
            n += 1
        if n:
            self._graphs = None
        return n

    @torch.inference_mode()
    def decode_step(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        """One token at `pos` (x: ids (1, 1) or residual (1, 1, dim)) -> residual (1, 1, dim).

        On CUDA with dense weights: replays a CUDA graph captured (lazily) for the
        bucket of cache positions that holds pos; elsewhere the eager decode path."""
        if x.shape[1] != 1:
            raise ValueError(f"decode_step takes one token, got {x.shape[1]}")
        return self._graph_step(x, pos) if self._graphable(x) else self._run(x, pos, True)

    @torch.inference_mode()
    def decode_token(self, x: torch.Tensor, pos: int,
                     fresh: bool = True) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """One token at `pos` -> (residual (1, 1, dim), float32 logits (vocab,), argmax); the last two only on
        the slice with the head. With cuda_graphs on a graphable slice all three come from one replay; fresh=False
        returns the graph's own output tensors, valid until the next step (a caller that copies them out at once:
        three kernels fewer per token)."""
        if self.cuda_graphs and self._graphable(x):
            return self.decode_graphs().step_all(x, pos, fresh)
        h = self._run(x, pos, True)
        if not self.has_head:
            return h, None, None
        logits = self.logits(h[0, -1])
        return h, logits, logits.argmax()

    def decode_graphs(self):
        """This slice's strata.decode_graphs.DecodeGraphs (made on first use; dropped when cache or weights change)."""
        if self._graphs is None:
            from .decode_graphs import DecodeGraphs  # imports Triton: only where graphs are built
            self._graphs = DecodeGraphs(self)
        return self._graphs

    def _graph_step(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        return self.decode_graphs().step(x, pos)

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
