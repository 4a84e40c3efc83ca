"""Torch dequantization of the legacy, K-quant and IQ4 GGUF block types, bit-exact with gguf-py.

Each function maps uint8 blocks `(N, type_size)` to float32 `(N, block_size)`. The float32
operations (which multiply, which add, in which order) follow gguf-py's numpy code so that the
CPU result is identical bit for bit; the integer unpacking is free to differ. Byte layouts:
ggml-common.h (block_q4_0 ... block_iq4_xs).
"""
from __future__ import annotations

import gguf
import torch

QK_K = 256


def f16_to_f32(h: torch.Tensor) -> torch.Tensor:
    """fp16 bit patterns (int16/int32) -> float32, exactly like numpy's conversion.

    Done on the bits because torch's `.float()` turns every NaN into one canonical NaN, while
    numpy keeps sign and payload; with this, NaN scales poison their blocks identically.
    """
    h = h.to(torch.int32)
    em = h & 0x7FFF
    special = (em >= 0x7C00).to(torch.int32)  # inf/NaN: exponent 31 -> 255, else rebias 15 -> 127
    bits = (em << 13) + (112 << 23) * (1 + special)
    sub = (em.float() * 2.0 ** -24).view(torch.int32)  # zero and subnormals: exact in float32
    bits = torch.where(em < 0x0400, sub, bits) | ((h & 0x8000) << 16)
    return bits.view(torch.float32)


def f16(b: torch.Tensor, off: int) -> torch.Tensor:
    """The little-endian fp16 field at byte `off` of each block, as float32 `(N, 1)`."""
    return f16_to_f32(b[:, off:off + 2].contiguous().view(torch.int16))


def nan_first(a: torch.Tensor, r: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`r = a + b` (or `a - b`) with numpy's NaN choice: a's NaN when both operands are NaN.

    torch's CPU add/sub kernels return b's NaN then. Only NaN/inf scales make NaNs, so the
    check runs on the small per-block `scales`; CUDA makes canonical NaNs anyway, so skip there.
    """
    if r.device.type != "cpu" or bool(torch.isfinite(scales).all()):
        return r
    return torch.where(torch.isnan(a), a, r)


_shift_cache: dict[tuple, torch.Tensor] = {}


def _shifts(values: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A small constant column `(len(values), 1)`, made once per device (no copy per call on CUDA)."""
    key = (values, device, dtype)
    t = _shift_cache.get(key)
    if t is None:
        t = _shift_cache[key] = torch.tensor(values, dtype=dtype, device=device).view(-1, 1)
    return t


def nibbles(qs: torch.Tensor) -> torch.Tensor:
    """`(N, G, k)` bytes -> `(N, G, 2k)`: the k low nibbles, then the k high nibbles."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def bits_of(x: torch.Tensor, shifts: list[int], mask: int) -> torch.Tensor:
    """`(N, G, k)` -> `(N, G, len(shifts), k)`: (x >> s) & mask for each shift s."""
    return (x.unsqueeze(-2) >> _shifts(tuple(shifts), x.device, x.dtype)) & mask


def _u32_bits(b: torch.Tensor, off: int) -> torch.Tensor:
    """Bits 0..31 of the little-endian uint32 at byte `off`, as uint8 `(N, 32)`."""
    by = b[:, off:off + 4]  # bit j lives in byte j // 8, position j % 8
    return bits_of(by.unsqueeze(1), list(range(8)), 1).permute(0, 1, 3, 2).reshape(b.shape[0], 32)


# -- legacy 32-weight blocks ----------------------------------------------------------------------
def q4_0(b: torch.Tensor) -> torch.Tensor:
    q = nibbles(b[:, 2:18]).to(torch.int8) - 8
    return f16(b, 0) * q.float()


def q4_1(b: torch.Tensor) -> torch.Tensor:
    q = nibbles(b[:, 4:20]).float()
    d, m = f16(b, 0), f16(b, 2)
    a = d * q
    return nan_first(a, a + m, d)


def _q5(b: torch.Tensor, qh_off: int) -> torch.Tensor:
    """The 5-bit quants: low nibbles as in Q4, the fifth bit j of the uint32 qh for weight j."""
    return nibbles(b[:, qh_off + 4:qh_off + 20]) | (_u32_bits(b, qh_off) << 4)


def q5_0(b: torch.Tensor) -> torch.Tensor:
    q = _q5(b, 2).to(torch.int8) - 16
    return f16(b, 0) * q.float()


def q5_1(b: torch.Tensor) -> torch.Tensor:
    q = _q5(b, 4).float()
    d, m = f16(b, 0), f16(b, 2)
    a = d * q
    return nan_first(a, a + m, d)


def q8_0(b: torch.Tensor) -> torch.Tensor:
    x = b[:, 2:34].view(torch.int8).float()
    return x * f16(b, 0)


# -- K-quants: 256-weight super-blocks --------------------------------------------------------------
def q2_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc, qs = b[:, 0:16], b[:, 16:80]
    d, dmin = f16(b, 80), f16(b, 82)
    dl = (d * (sc & 0x0F).float()).view(n, 16, 1)
    ml = (dmin * (sc >> 4).float()).view(n, 16, 1)
    # weight h*128 + s*32 + l = bits 2s..2s+1 of qs[h*32 + l]
    q = bits_of(qs.reshape(n, 2, 32), [0, 2, 4, 6], 3).reshape(n, 16, 16).float()
    a = dl * q
    return nan_first(a, a - ml, d).reshape(n, QK_K)


def q3_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    hmask, qs, scales = b[:, 0:32], b[:, 32:96], b[:, 96:108]
    d = f16(b, 108)
    # 16 six-bit scales: low 4 bits from bytes 0..7 (low nibbles, then high nibbles),
    # high 2 bits from bytes 8..11 (bit pairs 0, 2, 4, 6 of each, pair-major)
    lo = nibbles(scales[:, 0:8].unsqueeze(1)).reshape(n, 16)
    hi = bits_of(scales[:, 8:12].unsqueeze(1), [0, 2, 4, 6], 3).reshape(n, 16)
    s = ((lo | (hi << 4)).to(torch.int8) - 32).float()
    dl = (d * s).view(n, 16, 1)
    ql = bits_of(qs.reshape(n, 2, 32), [0, 2, 4, 6], 3).reshape(n, 16, 16)
    qh = bits_of(hmask.reshape(n, 1, 32), list(range(8)), 1).reshape(n, 16, 16) ^ 1  # set bit: no -4 offset
    q = (ql.to(torch.int8) - (qh << 2).to(torch.int8)).float()
    return (dl * q).reshape(n, QK_K)


def _scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and 8 six-bit mins packed in 12 bytes (Q4_K, Q5_K), as uint8 `(N, 8)`."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=1)
    return sc, mn


def _k4_affine(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc, mn = _scale_min_k4(b[:, 4:16])
    d = (f16(b, 0) * sc.float()).view(n, 8, 1)
    dm = (f16(b, 2) * mn.float()).view(n, 8, 1)
    a = d * q.float()
    return nan_first(a, a - dm, d).reshape(n, QK_K)


def q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    return _k4_affine(b, nibbles(b[:, 16:144].reshape(n, 4, 32)).reshape(n, 8, 32))


def q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql = nibbles(b[:, 48:176].reshape(n, 4, 32)).reshape(n, 8, 32)
    qh = bits_of(b[:, 16:48].reshape(n, 1, 32), list(range(8)), 1).reshape(n, 8, 32)
    return _k4_affine(b, ql | (qh << 4))


def q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql, qh, scales = b[:, 0:128], b[:, 128:192], b[:, 192:208]
    d = (f16(b, 208) * scales.view(torch.int8).float()).view(n, 16, 1)
    lo = nibbles(ql.reshape(n, 2, 64)).reshape(n, 8, 32)
    hi = bits_of(qh.reshape(n, 2, 32), [0, 2, 4, 6], 3).reshape(n, 8, 32)
    q = ((lo | (hi << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
    return (d * q).reshape(n, QK_K)


# -- IQ4: non-linear 4-bit grid ---------------------------------------------------------------------
_KVALUES = tuple(int(v) for v in gguf.quants.IQ4_NL.kvalues)
_kv_cache: dict[torch.device, torch.Tensor] = {}


def _kvalues(device: torch.device) -> torch.Tensor:
    t = _kv_cache.get(device)
    if t is None:
        t = _kv_cache[device] = torch.tensor(_KVALUES, dtype=torch.float32, device=device)
    return t


def iq4_nl(b: torch.Tensor) -> torch.Tensor:
    q = nibbles(b[:, 2:18]).long()
    return f16(b, 0) * _kvalues(b.device)[q]


def iq4_xs(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = f16(b, 0)
    lo = nibbles(b[:, 4:8].unsqueeze(-1)).reshape(n, 8)  # sub-block 2k+s: nibble s of byte k
    hi16 = b[:, 2:4].contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    hi = bits_of(hi16, list(range(0, 16, 2)), 3).reshape(n, 8).to(torch.uint8)
    s = ((lo | (hi << 4)).to(torch.int8) - 32).float()
    dl = (d * s).view(n, 8, 1)
    q = nibbles(b[:, 8:136].reshape(n, 8, 16)).long()
    return (dl * _kvalues(b.device)[q]).reshape(n, QK_K)


DEQUANT = {"Q4_0": q4_0, "Q4_1": q4_1, "Q5_0": q5_0, "Q5_1": q5_1, "Q8_0": q8_0,
           "Q2_K": q2_k, "Q3_K": q3_k, "Q4_K": q4_k, "Q5_K": q5_k, "Q6_K": q6_k,
           "IQ4_NL": iq4_nl, "IQ4_XS": iq4_xs}
