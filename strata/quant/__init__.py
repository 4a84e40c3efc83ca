"""GGUF block dequantization in torch: `dequantize(blocks, qtype)` on the blocks' own device.

PLACEHOLDER (being replaced by the torch implementation): round-trips through gguf-py on the CPU.
The contract stays: `blocks` is a uint8 tensor shaped `(..., bytes)` like `gguf.quants.dequantize`'s
input, `qtype` a type name ("IQ3_S") or `gguf.GGMLQuantizationType`; the result is float32
`(..., weights)` on the blocks' device.
"""
from __future__ import annotations

import numpy as np
import torch


def qtype_of(qtype):
    import gguf
    if isinstance(qtype, str):
        try:
            return gguf.GGMLQuantizationType[qtype.upper()]
        except KeyError:
            raise ValueError(f"unknown GGUF quantization type {qtype!r}") from None
    return gguf.GGMLQuantizationType(qtype)


def dequantize(blocks: torch.Tensor, qtype) -> torch.Tensor:
    import gguf
    t = qtype_of(qtype)
    out = gguf.quants.dequantize(blocks.cpu().numpy(), t)
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).to(blocks.device)
