"""GGUF block dequantization in torch: `dequantize(blocks, qtype)` on the blocks' own device.

`blocks` is a uint8 tensor shaped `(..., bytes)` like `gguf.quants.dequantize`'s input, `qtype` a
type name ("IQ3_S", any case) or `gguf.GGMLQuantizationType`; the result is float32
`(..., weights)` on the blocks' device. Per-type kernels live in submodules, each exporting
`DEQUANT: dict[name, fn]` with fn mapping uint8 `(N, type_size)` -> float32 `(N, block_size)`.
`triton_state`: the caller's strata.triton_state.TritonState, on which IQ3_S's CUDA kernel falls back where it fails
(strata.quant.iq; None: no holder, the kernel is tried on every call).
"""
from __future__ import annotations

import functools

import torch

from strata.triton_state import TritonState
from strata.quant import blocks as blocks_mod, iq, mxfp4
from strata.quant.random import random_blocks
from strata.quant.types import block_size, qtype_of, type_size

__all__ = ["DEQUANT", "MIXES", "SUPPORTED", "block_size", "dequantize", "mix_type", "qtype_of", "random_blocks",
           "type_size"]

_PLAIN = ("F32", "F16", "BF16")  # viewed from bytes, no blocks
DEQUANT: dict = {**blocks_mod.DEQUANT, **iq.DEQUANT, **mxfp4.DEQUANT}
SUPPORTED: tuple[str, ...] = _PLAIN + tuple(DEQUANT)

# llama.cpp's "_M" file types mix two block types: the base one for most matrices, a wider one for the head,
# attn_v and ffn_down. (llama.cpp widens attn_v / ffn_down in about half of the layers; the synthetic models and
# bench/make_gguf.py widen them in all, a slightly larger file of the same kinds of tensors.)
MIXES: dict[str, tuple[str, str]] = {"Q4_K_M": ("Q4_K", "Q6_K"), "Q5_K_M": ("Q5_K", "Q6_K")}
_WIDE_IN_MIX = ("head", "wv", "w_down", "e_down")  # canonical short names (strata.models.names)


def mix_type(qtype: str, short_name: str) -> str:
    """The block type a matrix `short_name` ("wq", "w_down", "head", ...) gets in a file of type `qtype`: a mix
    picks per matrix (MIXES), any other type is itself."""
    base, wide = MIXES.get(qtype.upper(), (qtype, qtype))
    return wide if short_name in _WIDE_IN_MIX else base


# The legacy 32-weight types as two layout flags, for the kernels that share one body among them
# (strata.quant.gemv, strata.quant.into): a min after d (Q4_1, Q5_1), 32 fifth bits before the nibbles (Q5_0, Q5_1).
LEGACY_FLAGS: dict[str, dict[str, bool]] = {"Q4_0": {"MIN": False, "FIVE": False}, "Q4_1": {"MIN": True, "FIVE": False},
                                            "Q5_0": {"MIN": False, "FIVE": True}, "Q5_1": {"MIN": True, "FIVE": True}}


# Blocks per kernel call: bounds the intermediates (a few bytes per weight) on big tensors.
_CHUNK_WEIGHTS = {"cpu": 1 << 20, "cuda": 1 << 26}


def _supported(qtype) -> str:
    name = qtype_of(qtype).name
    if name not in SUPPORTED:
        raise ValueError(f"GGUF quantization type {name} is not supported (supported: {', '.join(SUPPORTED)})")
    return name


def dequantize(blocks: torch.Tensor, qtype, triton_state: TritonState | None = None) -> torch.Tensor:
    """uint8 `(..., n_blocks * type_size)` -> float32 `(..., n_blocks * block_size)`, same device."""
    name = _supported(qtype)
    if blocks.dtype != torch.uint8:
        raise ValueError(f"GGUF blocks must be uint8, got {blocks.dtype}")
    if blocks.dim() == 0:
        raise ValueError("GGUF blocks must have at least one dimension")
    bs, ts = block_size(name), type_size(name)
    nbytes = blocks.shape[-1]
    if nbytes % ts:
        raise ValueError(f"{name}: last dimension {nbytes} is not a multiple of the block size of {ts} bytes")
    lead = tuple(blocks.shape[:-1])
    out_shape = lead + (nbytes // ts * bs,)
    b = blocks.contiguous().view(-1, ts)
    if name == "F32":
        return b.view(torch.float32).reshape(out_shape).clone()
    if name == "F16":
        h = b.view(torch.int16)
        w = h.view(torch.float16).float()
        if w.device.type == "cpu" and bool(torch.isnan(w).any()):  # .float() canonicalises NaN payloads
            w = torch.where(torch.isnan(w), blocks_mod.f16_to_f32(h), w)
        return w.reshape(out_shape)
    if name == "BF16":  # the top half of a float32
        return (b.view(torch.int16).to(torch.int32) << 16).view(torch.float32).reshape(out_shape)
    fn = DEQUANT[name]
    if triton_state is not None and name in iq.DEQUANT:  # (only the IQ types take a state)
        fn = functools.partial(fn, state=triton_state)
    n = b.shape[0]
    step = max(1, _CHUNK_WEIGHTS.get(b.device.type, 1 << 22) // bs)
    if n <= step:
        return fn(b).reshape(out_shape)
    out = torch.empty((n, bs), dtype=torch.float32, device=b.device)
    for i in range(0, n, step):
        out[i:i + step] = fn(b[i:i + step])
    return out.reshape(out_shape)
