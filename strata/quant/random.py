"""Random but valid GGUF blocks: random bytes with every fp16 scale set to a small finite value."""
from __future__ import annotations

import torch

from strata.quant.types import block_size, qtype_of, type_size

# Per type: the fp16 scale fields as (byte offset, multiple of the block's d). d sits first in
# most blocks, last in Q2_K / Q3_K / Q6_K. A min field gets the multiple that centres the
# block's weights near 0 (Q4_1/Q5_1 store -min; Q2_K/Q4_K/Q5_K subtract dmin * m).
# IQ1_M has no plain d field: see _iq1_m_d.
_FIELDS: dict[str, tuple[tuple[int, float], ...]] = {
    "Q4_0": ((0, 1.0),), "Q4_1": ((0, 1.0), (2, -7.5)), "Q5_0": ((0, 1.0),),
    "Q5_1": ((0, 1.0), (2, -15.5)), "Q8_0": ((0, 1.0),),
    "Q2_K": ((80, 1.0), (82, 1.5)), "Q3_K": ((108, 1.0),), "Q4_K": ((0, 1.0), (2, 7.5)),
    "Q5_K": ((0, 1.0), (2, 15.5)), "Q6_K": ((208, 1.0),), "IQ4_NL": ((0, 1.0),), "IQ4_XS": ((0, 1.0),),
    "IQ2_XXS": ((0, 1.0),), "IQ2_XS": ((0, 1.0),), "IQ2_S": ((0, 1.0),), "IQ3_XXS": ((0, 1.0),),
    "IQ3_S": ((0, 1.0),), "IQ1_S": ((0, 1.0),), "IQ1_M": (),
}

# Mean d per type so the weights' std comes out near 0.02: 0.02 / (the std with d = 1),
# measured once with gguf-py on random blocks laid out as above.
_D: dict[str, float] = {
    "Q4_0": 4.3e-3, "Q4_1": 4.3e-3, "Q5_0": 2.2e-3, "Q5_1": 2.2e-3, "Q8_0": 2.7e-4,
    "Q2_K": 1.4e-3, "Q3_K": 4.6e-4, "Q4_K": 7.4e-5, "Q5_K": 3.6e-5, "Q6_K": 1.5e-5,
    "IQ4_NL": 3.0e-4, "IQ4_XS": 1.6e-5, "IQ2_XXS": 3.8e-4, "IQ2_XS": 3.6e-4, "IQ2_S": 3.6e-4,
    "IQ3_XXS": 1.4e-4, "IQ3_S": 1.4e-4, "IQ1_S": 2.8e-3, "IQ1_M": 2.8e-3,
}
_PLAIN = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _fp16_bytes(x: torch.Tensor) -> torch.Tensor:
    """float32 `(N,)` -> its fp16 encoding as uint8 `(N, 2)` (little-endian, like the file)."""
    return x.to(torch.float16).view(torch.uint8).view(-1, 2)


def _iq1_m_d(b: torch.Tensor, d: torch.Tensor) -> None:
    """IQ1_M packs its fp16 d into the top nibbles of the four uint16 `scales` (bytes 48..55)."""
    bits = d.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
    for i in range(4):  # nibble i of d -> bits 12..15 of scales word i = high nibble of byte 49 + 2i
        nib = ((bits >> (4 * i)) & 0xF).to(torch.uint8)
        b[:, 49 + 2 * i] = (b[:, 49 + 2 * i] & 0x0F) | (nib << 4)


def random_blocks(qtype, rows: int, cols: int, generator: torch.Generator, device="cpu") -> torch.Tensor:
    """uint8 `(rows, cols // block_size * type_size)`: random valid blocks, weights roughly N(0, 0.02)-sized."""
    name = qtype_of(qtype).name
    bs, ts = block_size(name), type_size(name)
    if cols % bs:
        raise ValueError(f"{name}: {cols} columns is not a multiple of the block size {bs}")
    if name in _PLAIN:
        w = torch.randn((rows, cols), generator=generator, device=device) * 0.02
        return w.to(_PLAIN[name]).view(torch.uint8)
    n = rows * (cols // bs)
    if name == "MXFP4":  # an e8m0 exponent byte, not an fp16 d: 2^(e - 127) / 2 near 0.0036 gives std ~0.02
        b = torch.randint(0, 256, (n, ts), generator=generator, device=device, dtype=torch.uint8)
        b[:, 0] = torch.randint(119, 122, (n,), generator=generator, device=device, dtype=torch.uint8)
        return b.view(rows, -1)
    if name not in _FIELDS:
        raise ValueError(f"random_blocks: GGUF quantization type {name} is not supported")
    b = torch.randint(0, 256, (n, ts), generator=generator, device=device, dtype=torch.uint8)
    # per-block d in [0.5, 1.5) times the type's mean: scales vary as in a real file
    d = (torch.rand(n, generator=generator, device=device) + 0.5) * _D[name]
    for off, mult in _FIELDS[name]:
        b[:, off:off + 2] = _fp16_bytes(d * mult)
    if name == "IQ1_M":
        _iq1_m_d(b, d)
    return b.view(rows, -1)
