"""IQ (importance-matrix grid) block types in torch: IQ2_XXS IQ2_XS IQ2_S IQ3_XXS IQ3_S IQ1_S IQ1_M.

Every function maps uint8 blocks `(..., k * type_size)` to float32 `(..., k * 256)` on the blocks'
device, bit for bit what `gguf.quants.dequantize` gives on the CPU (NaN payloads included): the same
float32 operations on the same values. Grids and sign tables come from the installed gguf package,
are folded once per device into tables of signed (or delta-shifted) rows, and each 4 or 8 weights
take one gather from them and one multiply by their scale. `python -m strata.quant.iq` times them.
IQ3_S on CUDA takes one Triton kernel; where it fails, the caller's strata.triton_state.TritonState (`state`) takes
the torch path from then on, not the process.
"""
from __future__ import annotations

import contextlib
import functools
import logging
from typing import Callable

import torch

from strata.triton_state import TritonState

try:  # ships with CUDA builds of torch; only IQ3_S on CUDA uses it
    import triton
    import triton.language as tl
except ImportError:
    triton = None

log = logging.getLogger("strata.quant")

QK_K = 256
# Blocks per step: bounds the intermediates (~6 bytes per weight at the peak, besides the output).
# The CPU likes them cache-sized; a GPU wants few kernel launches (an 0.85 GB bf16 layer is ~7 steps).
BATCH_BLOCKS = 8192
CUDA_BATCH_FACTOR = 32
# Devices where a table row moves as complex128 scalars: torch's CPU scalar gather is several times
# faster than its row gather. Elsewhere (CUDA) rows move as float32, the plainest indexing kernel.
COMPLEX_ROW_DEVICES = {"cpu"}


@functools.lru_cache(maxsize=None)
def _gguf_tables() -> dict[str, torch.Tensor]:
    """The grids (G, W) float32 and the 7-bit sign index table, from gguf-py, on the CPU."""
    import numpy as np
    from gguf import quants as q

    out = {}
    for name in ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S"):
        cls = getattr(q, name)
        cls.init_grid()
        out[name] = torch.from_numpy(np.array(cls.grid, dtype=np.float32).reshape(cls.grid_shape))
    out["ksigns"] = torch.from_numpy(np.frombuffer(q.IQ2_XXS.ksigns, dtype=np.uint8).astype(np.int64))
    return out


@functools.lru_cache(maxsize=None)
def _tables(device: torch.device) -> dict[str, torch.Tensor]:
    """Per-device tables, one gather per output row of 4 (or 8) weights with the signs folded in.

    For the sign-carrying types a row is `(grid index, [which half of an 8-wide entry,] 4 sign bits)`
    and holds grid * (+-1): flipping a sign is exact, and a NaN/inf scale propagates the same, so
    `scale * (+-g)` has the bits of gguf-py's `(scale * g) * +-1`. IQ1 rows hold gguf-py's exact
    `grid + delta` for either delta sign."""
    g = {k: v.to(device) for k, v in _gguf_tables().items()}
    bits = (torch.arange(16, device=device)[:, None] >> torch.arange(4, device=device)) & 1
    s4 = (1 - 2 * bits).to(torch.float32)  # (16, 4): nibble -> +-1 for its 4 weights

    def signed(grid: torch.Tensor) -> torch.Tensor:  # (G, W) -> (G * W/4 * 16, 4)
        quads = grid.reshape(-1, 1, 4)  # (G * W/4, 1, 4): the 4-wide slices of each entry
        return (quads * s4[None]).reshape(-1, 4)

    t = {name: signed(g[name]) for name in ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S")}
    delta = torch.tensor([0.125, -0.125], dtype=torch.float32, device=device)
    t["IQ1"] = (g["IQ1_S"][:, None, :] + delta[None, :, None]).reshape(-1, 8)  # row g << 1 | negative
    t["ksigns"] = g["ksigns"].to(torch.int32)
    t["IQ3_S_grid"] = g["IQ3_S"].contiguous()  # the fused kernel's plain grid
    t["IQ3_S_bf16"] = signed_bf16_grid(g["IQ3_S"])  # the fused matrix-vector kernel's: two loads per 4 weights
    return t


def signed_bf16_grid(grid: torch.Tensor) -> torch.Tensor:
    """(G, 4) float32 grid -> (G * 16 * 2,) int32: rows `entry << 4 | sign nibble`, each 2 int32 holding
    the entry's 4 values as bfloat16 pairs (value i negated where bit i of the nibble is set; value 2k
    in the low half of word k). A bfloat16 widens to float32 by a shift: no int-to-float conversion."""
    if grid.shape[1] != 4 or bool((grid.bfloat16().float() != grid).any()):
        raise ValueError("signed_bf16_grid takes 4-wide grids exact in bfloat16")
    bits = (torch.arange(16, device=grid.device)[:, None] >> torch.arange(4, device=grid.device)) & 1
    signed = (grid[:, None, :] * (1 - 2 * bits)[None]).reshape(-1, 4)  # (G * 16, 4)
    return signed.bfloat16().contiguous().view(torch.int32).reshape(-1)  # little-endian: value 2k low


def _half(h: torch.Tensor) -> torch.Tensor:
    """int32 fp16 bit patterns -> float32. torch's own cast loses NaN payloads and signs on some
    CPU paths; gguf-py keeps them, so NaNs are rebuilt from their bits (quiet, as any multiply makes them)."""
    f = h.to(torch.int16).view(torch.float16).to(torch.float32)
    nan = (h & 0x7C00) == 0x7C00
    nan &= (h & 0x03FF) != 0
    bits = ((h & 0x8000) << 16) | 0x7FC00000 | ((h & 0x03FF) << 13)
    return torch.where(nan, bits.view(torch.float32), f)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """(M, 2) little-endian fp16 bytes -> (M, 1) float32."""
    return _half(_u16(b))


def _u16(b: torch.Tensor) -> torch.Tensor:
    """(M, 2k) bytes -> (M, k) int32 of the little-endian uint16 values."""
    b = b.reshape(b.shape[0], -1, 2).to(torch.int32)
    return b[..., 0] | (b[..., 1] << 8)


def _ksign_indices(b: torch.Tensor) -> torch.Tensor:
    """(M, 4k) bytes, k little-endian uint32 -> (M, 4k) int32: the four 7-bit fields in bits 0..27."""
    b = b.reshape(b.shape[0], -1, 4).to(torch.int32)
    low28 = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | ((b[..., 3] & 0x0F) << 24)
    return (_shifts(low28, (0, 7, 14, 21)) & 0x7F).reshape(b.shape[0], -1)


def _nibbles(b: torch.Tensor) -> torch.Tensor:
    """(M, k) bytes -> (M, 2k): low nibble then high nibble of each byte."""
    return torch.stack((b & 0x0F, b >> 4), dim=-1).reshape(b.shape[0], -1)


def _shifts(x: torch.Tensor, shifts: tuple[int, ...]) -> torch.Tensor:
    """(M, k) -> (M, k, len(shifts)) of x >> each shift."""
    return x[..., None] >> torch.tensor(shifts, dtype=x.dtype, device=x.device)


def _gather(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Rows of `table` (G, W) at int32 `idx` (m, k): (m, k * W), bits untouched."""
    m, w = idx.shape[0], table.shape[1]
    if table.device.type in COMPLEX_ROW_DEVICES:  # a row is one complex128 (W=4) or two (W=8)
        table = table.view(torch.complex128).reshape(-1) if w == 4 else table.view(torch.complex128)
    return table.index_select(0, idx.reshape(-1)).view(torch.float32).reshape(m, -1)


def _lookup(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """table[idx] for a 1-D table and integer indices of any shape."""
    return table.index_select(0, idx.reshape(-1)).reshape(idx.shape)


def _halves(g: torch.Tensor, sign_bytes: torch.Tensor) -> torch.Tensor:
    """Signed-table rows for 8-wide grid entries `g` (m, k) with one sign byte each: (m, 2k)."""
    sb = sign_bytes.to(torch.int32)
    return ((g << 5)[..., None] | torch.stack((sb & 15, (sb >> 4) | 16), dim=-1)).reshape(g.shape[0], -1)


# -- the block types: each writes (m, type_size) uint8 blocks into `out` (m, 256) float32 ----------
def _iq2_xxs(b: torch.Tensor, t: dict, out: torch.Tensor) -> None:
    m = b.shape[0]
    d = _f16(b[:, :2])
    q = b[:, 2:].reshape(m, 8, 8)  # per 32 weights: 4 grid indices, then a uint32 of signs + scale
    db = d * (0.5 + (q[:, :, 7] >> 4).to(torch.float32)) * 0.25
    sign_bytes = _lookup(t["ksigns"], _ksign_indices(q[:, :, 4:]))
    rows = _gather(t["IQ2_XXS"], _halves(q[:, :, :4].reshape(m, 32).to(torch.int32), sign_bytes))
    torch.mul(db[:, :, None], rows.view(m, 8, 32), out=out.view(m, 8, 32))


def _iq2_xs(b: torch.Tensor, t: dict, out: torch.Tensor) -> None:
    m = b.shape[0]
    d = _f16(b[:, :2])
    qs = _u16(b[:, 2:66])  # (m, 32): 9-bit grid index, 7-bit sign index
    db = d * (0.5 + _nibbles(b[:, 66:74]).to(torch.float32)) * 0.25  # (m, 16)
    rows = _gather(t["IQ2_XS"], _halves(qs & 511, _lookup(t["ksigns"], qs >> 9)))
    torch.mul(db[:, :, None], rows.view(m, 16, 16), out=out.view(m, 16, 16))


def _iq2_s(b: torch.Tensor, t: dict, out: torch.Tensor) -> None:
    m = b.shape[0]
    d = _f16(b[:, :2])
    qh = (_shifts(b[:, 66:74], (0, 2, 4, 6)) & 3).reshape(m, 32).to(torch.int32)
    qs = b[:, 2:34].to(torch.int32) | (qh << 8)  # 10-bit grid index
    db = d * (0.5 + _nibbles(b[:, 74:82]).to(torch.float32)) * 0.25  # (m, 16)
    rows = _gather(t["IQ2_S"], _halves(qs, b[:, 34:66]))
    torch.mul(db[:, :, None], rows.view(m, 16, 16), out=out.view(m, 16, 16))


def _iq3_xxs(b: torch.Tensor, t: dict, out: torch.Tensor) -> None:
    m = b.shape[0]
    d = _f16(b[:, :2])
    db = d * (0.5 + (b[:, 69:98:4] >> 4).to(torch.float32)) * 0.5
    sign_bytes = _lookup(t["ksigns"], _ksign_indices(b[:, 66:98]))  # uint32s: 4 sign indices + a scale
    idx = (b[:, 2:66].to(torch.int32) << 4) | _nibbles(sign_bytes)  # a sign byte covers 2 grid entries
    torch.mul(db[:, :, None], _gather(t["IQ3_XXS"], idx).view(m, 8, 32), out=out.view(m, 8, 32))


def _iq3_s(b: torch.Tensor, t: dict, out: torch.Tensor) -> None:
    m = b.shape[0]
    d = _f16(b[:, :2])
    qh = b[:, 66:74].to(torch.int32)[:, :, None] << torch.arange(12, 4, -1, dtype=torch.int32, device=b.device)
    sg = _nibbles(b[:, 74:106].to(torch.int32))  # (m, 64): 4 sign bits per grid entry
    idx = (b[:, 2:66].to(torch.int32) << 4) | (qh & 0x1000).reshape(m, 64) | sg  # grid index << 4 | signs
    db = d * (1 + 2 * _nibbles(b[:, 106:110]).to(torch.int32)).to(torch.float32)  # (m, 8)
    torch.mul(db[:, :, None], _gather(t["IQ3_S"], idx).view(m, 8, 32), out=out.view(m, 8, 32))


def _iq1_s(b: torch.Tensor, t: dict, out: torch.Tensor) -> None:
    m = b.shape[0]
    d = _f16(b[:, :2])
    qh = _u16(b[:, 34:50])  # (m, 8)
    dl = d * (2 * ((qh >> 12) & 7) + 1).to(torch.float32)
    idx = b[:, 2:34].reshape(m, 8, 4).to(torch.int32) | ((_shifts(qh, (0, 3, 6, 9)) & 7) << 8)
    idx = (idx << 1) | (qh >> 15)[:, :, None]  # the delta's sign
    torch.mul(dl[:, :, None], _gather(t["IQ1"], idx.reshape(m, 32)).view(m, 8, 32), out=out.view(m, 8, 32))


def _iq1_m(b: torch.Tensor, t: dict, out: torch.Tensor) -> None:
    m = b.shape[0]
    sc = _u16(b[:, 48:56])  # (m, 4): 4 x 3-bit scales each, the fp16 d in the top nibbles
    dbits = (sc[:, 0] >> 12) | ((sc[:, 1] >> 12) << 4) | ((sc[:, 2] >> 12) << 8) | ((sc[:, 3] >> 12) << 12)
    d = _half(dbits)[:, None]
    dl = d * (2 * (_shifts(sc, (0, 3, 6, 9)) & 7).reshape(m, 16) + 1).to(torch.float32)
    qh = _nibbles(b[:, 32:48].to(torch.int32))  # (m, 32): 3 high index bits + the delta's sign
    idx = ((b[:, :32].to(torch.int32) | ((qh & 7) << 8)) << 1) | (qh >> 3)
    torch.mul(dl[:, :, None], _gather(t["IQ1"], idx).view(m, 16, 16), out=out.view(m, 16, 16))


# -- IQ3_S on CUDA: one fused Triton kernel (reads 110 bytes, writes 1 KiB per block, no intermediates); where it
# fails, the torch path for the caller's TritonState (its iq3s field)
TRITON_BLOCKS = 4  # quant blocks per program: 1024 outputs

if triton is not None:
    @triton.jit
    def _iq3_s_kernel(blocks_ptr, grid_ptr, out_ptr, n_blocks, BLOCKS: tl.constexpr):
        nb = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)[:, None]  # (BLOCKS, 1) block numbers
        j = tl.arange(0, 256)[None, :]  # (1, 256) weight within the block
        live = nb < n_blocks
        base = blocks_ptr + nb.to(tl.int64) * 110
        h = tl.load(base, mask=live, other=0).to(tl.int32) | (tl.load(base + 1, mask=live, other=0).to(tl.int32) << 8)
        d = h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        e = j // 4  # grid entry (4 weights each)
        qs = tl.load(base + 2 + e, mask=live, other=0).to(tl.int32)
        qh = tl.load(base + 66 + j // 32, mask=live, other=0).to(tl.int32)
        gv = tl.load(grid_ptr + (qs | (((qh >> (e % 8)) & 1) << 8)) * 4 + j % 4)
        sb = tl.load(base + 74 + j // 8, mask=live, other=0).to(tl.int32)
        gv = tl.where(((sb >> (j % 8)) & 1) != 0, -gv, gv)
        sc = tl.load(base + 106 + j // 64, mask=live, other=0).to(tl.int32)
        db = d * (1 + 2 * ((sc >> ((j // 32) % 2 * 4)) & 15)).to(tl.float32)
        tl.store(out_ptr + nb.to(tl.int64) * 256 + j, db * gv, mask=live)


def _iq3_s_triton(flat: torch.Tensor, out: torch.Tensor) -> None:
    """IQ3_S (M, 110) uint8 -> `out` (M, 256) float32 in one kernel. Same float32 operations as
    `_iq3_s` (d * (1 + 2s), times the signed grid value), so equal up to NaN payloads."""
    n = flat.shape[0]
    if n:
        grid = _tables(flat.device)["IQ3_S_grid"]
        # Triton launches on the current device (CPU tensors: only under TRITON_INTERPRET=1)
        with torch.cuda.device(flat.device) if flat.is_cuda else contextlib.nullcontext():
            _iq3_s_kernel[(triton.cdiv(n, TRITON_BLOCKS),)](flat.contiguous(), grid, out, n, BLOCKS=TRITON_BLOCKS)


_TYPES: dict[str, tuple[int, Callable]] = {
    "IQ2_XXS": (66, _iq2_xxs), "IQ2_XS": (74, _iq2_xs), "IQ2_S": (82, _iq2_s),
    "IQ3_XXS": (98, _iq3_xxs), "IQ3_S": (110, _iq3_s), "IQ1_S": (50, _iq1_s), "IQ1_M": (56, _iq1_m),
}


def _dequantizer(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    type_size, fn = _TYPES[name]

    def dequant(blocks: torch.Tensor, state: TritonState | None = None) -> torch.Tensor:
        if blocks.dtype != torch.uint8:
            raise TypeError(f"{name} blocks must be uint8, got {blocks.dtype}")
        if blocks.ndim == 0 or blocks.shape[-1] % type_size:
            raise ValueError(f"{name}: last dim of {tuple(blocks.shape)} is not a multiple of {type_size} bytes")
        lead, k = blocks.shape[:-1], blocks.shape[-1] // type_size
        flat = blocks.reshape(-1, type_size)
        out = torch.empty(flat.shape[0], QK_K, dtype=torch.float32, device=blocks.device)
        if fn is _iq3_s and blocks.is_cuda and triton is not None and (state is None or state.iq3s):
            try:
                _iq3_s_triton(flat, out)
                return out.reshape(*lead, k * QK_K)
            except Exception as e:  # a Triton that cannot build the kernel: the torch path still works
                log.warning("IQ3_S Triton kernel failed (%s: %s); using the torch path", type(e).__name__, e)
                if state is not None:  # this holder's later calls take the torch path at once
                    state.iq3s = False
        t = _tables(blocks.device)
        step = BATCH_BLOCKS * (CUDA_BATCH_FACTOR if blocks.is_cuda else 1)
        for i in range(0, flat.shape[0], step):
            fn(flat[i:i + step], t, out[i:i + step])
        return out.reshape(*lead, k * QK_K)

    dequant.__name__ = dequant.__qualname__ = f"dequant_{name.lower()}"
    dequant.__doc__ = (f"{name} blocks uint8 (..., k*{type_size}) -> float32 (..., k*{QK_K}) on the same device "
                       "(state: the caller's TritonState, where IQ3_S's kernel falls back).")
    return dequant


DEQUANT: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {name: _dequantizer(name) for name in _TYPES}


if __name__ == "__main__":  # CPU time for one 4096 x 14336 weight (a 70B model's MLP matrix) per type
    import time

    shape = (4096, 14336)
    for name, (type_size, _) in _TYPES.items():
        raw = torch.randint(0, 256, (shape[0], shape[1] // QK_K * type_size), dtype=torch.uint8)
        DEQUANT[name](raw[:1])
        best = float("inf")
        for _ in range(3):  # best of 3: a shared machine's noise only ever adds time
            t0 = time.perf_counter()
            DEQUANT[name](raw)
            best = min(best, time.perf_counter() - t0)
        print(f"{name:8s} {shape[0]}x{shape[1]}: {best:.3f} s on {torch.get_num_threads()} CPU threads")
