"""MXFP4 (gpt-oss's experts in GGUF): 32 4-bit e2m1 values and one e8m0 power-of-two scale a block, in torch.

A block is 17 bytes: the exponent byte, then 16 bytes whose low nibbles are values 0..15 and high nibbles 16..31.
The nibble indexes e2m1's values doubled (0, 0.5, ... 6 as 0, 1, ... 12); the scale is 2^(e - 127) halved to
match, as ggml's e8m0_to_fp32_half. The products are float32 and the same bits as gguf-py's."""
from __future__ import annotations

import torch

_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def mxfp4(b: torch.Tensor) -> torch.Tensor:
    """uint8 (N, 17) -> float32 (N, 32)."""
    e = b[:, 0].to(torch.int32)
    # e < 2: the subnormal halves (0x00200000 << e); else the float32 exponent field e - 1
    bits = torch.where(e < 2, torch.full_like(e, 0x00200000) << e, (e - 1) << 23)
    d = bits.view(torch.float32)
    qs = b[:, 1:]
    idx = torch.cat((qs & 0x0F, qs >> 4), 1).long()
    return d[:, None] * torch.tensor(_VALUES, dtype=torch.float32, device=b.device)[idx]


DEQUANT = {"MXFP4": mxfp4}
