"""Narrower copies of dense matrices for CPU decode steps (int4 / int8 / float16), and a layer's four decode products."""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

# -- weight-only kernels for decode (CPU) -------------------------------------------------------
WEIGHT_ONLY = ("int4", "int8", "float16")
DECODE_KINDS = WEIGHT_ONLY + ("blocks",)  # blocks: strata.kernels.cpu_decode (C on 4/8-bit blocks)
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


def dense_products(w, wo: LayerWeightOnly | None) -> Products:
    # each matrix read when its product runs: a resident layer's (strata.models.resident.LazyMats) is dequantized then,
    # into a scratch that holds one group at a time
    return Products(lambda x: _mm_rows(x, w=w.wqkv, b=w.bqkv, wo=wo and wo.wqkv),
                    lambda x: _mm_rows(x, w=w.wo, b=w.bo, wo=wo and wo.wo),
                    lambda x: _mm_rows(x, w=w.w13, b=None, wo=wo and wo.w13),
                    lambda x: _mm_rows(x, w=w.w2, b=None, wo=wo and wo.w2))
