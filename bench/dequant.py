"""Time one transformer layer's dequantization into bfloat16, per block type: the torch path (`strata.quant.dequantize`
then a copy) and, for the types it takes, `strata.quant.into` (one Triton kernel straight into the output).

Resident quantized weights dequantize one layer per chunk, so this time, times layers, times
chunks, is what resident weights add to a prefill.

    python bench/dequant.py --preset llama-3-70b --types IQ3_S,Q4_K,Q5_K,Q6_K,Q8_0 --device cuda
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strata import quant  # noqa: E402
from strata.quant import into  # noqa: E402
from strata.args import PRESETS  # noqa: E402
from strata.triton_state import TritonState  # noqa: E402

TORCH_ONLY = TritonState(kernels=False, iq3s=False, into=False)


def layer_shapes(preset: str) -> list[tuple[int, int]]:
    a = PRESETS[preset]
    q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    return [(q, a.dim), (kv, a.dim), (kv, a.dim), (a.dim, q), (a.ffn_dim, a.dim), (a.ffn_dim, a.dim), (a.dim, a.ffn_dim)]


def timed(fn, dev: torch.device, reps: int) -> float:
    """ms per call, after one untimed call (kernel builds)."""
    fn()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama-3-70b")
    ap.add_argument("--types", default="IQ3_S,Q4_K,Q4_0,Q8_0")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    dev = torch.device(a.device)
    shapes = layer_shapes(a.preset)
    n = sum(r * c for r, c in shapes)
    g = torch.Generator().manual_seed(0)
    print(f"{a.preset}: one layer = {n / 1e6:.0f}M weights, device {dev}")
    print("| type | stored MB/layer | torch ms/layer | `into` ms/layer | GB/s written (bf16, the faster) |")
    print("|---|---:|---:|---:|---:|")
    for t in a.types.split(","):
        blocks = [quant.random_blocks(t, r, c, g, "cpu").to(dev) for r, c in shapes]
        out = [torch.empty(r, c, dtype=torch.bfloat16, device=dev) for r, c in shapes]

        def torch_path():  # IQ3_S's Triton kernel off for this holder: the torch formulas, as the header says
            for b, o in zip(blocks, out):
                o.copy_(quant.dequantize(b, t, TORCH_ONLY))

        def into_path():
            for b, o in zip(blocks, out):
                into.dequantize_into(o, b, t)
        arms = [timed(torch_path, dev, a.reps)]
        arms.append(timed(into_path, dev, a.reps) if into.takes(t, out[0]) else None)
        stored = sum(b.numel() for b in blocks)
        best = min(x for x in arms if x is not None)
        cells = " | ".join("-" if x is None else f"{x:,.2f}" for x in arms)
        print(f"| {t} | {stored / 1e6:,.0f} | {cells} | {2 * n / best / 1e6:,.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
