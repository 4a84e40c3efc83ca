"""MXFP4 (gpt-oss's experts in GGUF): 32 4-bit e2m1 values and one e8m0 power-of-two scale a block, in torch.

A block is 17 bytes: the exponent byte, then 16 bytes whose low nibbles are values 0..15 and high nibbles 16..31.
The nibble indexes e2m1's values doubled (0, 0.5, ... 6 as 0, 1, ... 12); the scale is 2^(e - 127) halved to
match, as ggml's e8m0_to_fp32_half. The products are float32 and the same bits as gguf-py's.

The split layout (`to_split`, `from_split`): a resident expert stack (E, rows, nb * 17) re-laid at load for the dp4a
experts kernel (strata.quant.gemv), the same bytes in another order, each expert's slab on its own: first its
rows * nb blocks' 16 nibble bytes (block (r, b) at 16 (r nb + b), value v of it in nibble v: byte v // 2, the low
nibble for even v), then their rows * nb exponent bytes in the same order. A block's nibbles are then one aligned
16-byte load, and its 4 words hold values 8w..8w+7 in order: the int8 words of x (strata.quant.gemv.quantize_x) they
pair with need no shuffling. `split_ok` says which shapes take it (aligned words); the stack keeps its shape and
byte count, so the planner's counts and a slice of whole experts still hold; the dequantizers take `slab` (blocks
an expert) to read it (`mxfp4_split` here, strata.quant.into's kernel)."""
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


def split_ok(rows: int, cols: int) -> bool:
    """Whether an expert stack of (rows, cols) matrices takes the split layout: whole blocks, and each expert's
    slab (rows * nb * 17 bytes) a whole number of 4-byte words, so every slab, nibble block and word is aligned."""
    return cols % 32 == 0 and rows * (cols // 32) % 4 == 0


def to_split(stack: torch.Tensor) -> torch.Tensor:
    """uint8 (E, rows, nb * 17) in the file's layout -> the same shape in the split layout (a new tensor)."""
    E, rows, rb = stack.shape
    b = stack.reshape(E, rows * (rb // 17), 17)
    qs = b[..., 1:]
    v = torch.cat((qs & 0x0F, qs >> 4), -1)  # (E, blocks, 32): value v's nibble
    nib = v[..., 0::2] | (v[..., 1::2] << 4)  # byte j: values 2j (low) and 2j + 1 (high)
    return torch.cat((nib.reshape(E, -1), b[..., 0].reshape(E, -1)), 1).view(E, rows, rb)


def from_split(stack: torch.Tensor) -> torch.Tensor:
    """`to_split`'s inverse: the split layout (E, rows, nb * 17) -> the file's (a new tensor)."""
    E, rows, rb = stack.shape
    n = rows * (rb // 17)  # blocks an expert
    flat = stack.reshape(E, -1)
    nib = flat[:, :16 * n].reshape(E, n, 16)
    v = torch.stack((nib & 0x0F, nib >> 4), -1).reshape(E, n, 32)  # value order
    qs = v[..., :16] | (v[..., 16:] << 4)
    return torch.cat((flat[:, 16 * n:].reshape(E, n, 1), qs), -1).view(E, rows, rb)


def mxfp4_split(stack: torch.Tensor) -> torch.Tensor:
    """A split-layout stack (E, rows, nb * 17) -> float32 (E, rows, nb * 32), the file layout's values."""
    E, rows, rb = stack.shape
    return mxfp4(from_split(stack).reshape(-1, 17)).view(E, rows, rb // 17 * 32)


DEQUANT = {"MXFP4": mxfp4}
