"""Time one transformer layer's dequantization into bfloat16, per block type: the torch path (`strata.quant.dequantize`
then a copy) and, for the types it takes, `strata.quant.into` (one Triton kernel straight into the output).

Resident quantized weights dequantize one layer per chunk, so this time, times layers, times
chunks, is what resident weights add to a prefill.

    python bench/dequant.py --preset llama-3-70b --types IQ3_S,Q4_K,Q5_K,Q6_K,Q8_0 --device cuda

`--experts` times one layer's expert stacks instead (the preset's gate, up and down of every expert; MXFP4 in the
split layout the resident experts keep, strata.quant.mxfp4), as the MoE prefill dequantizes them every chunk.
`--blocks 4,16,64` repeats the `into` arm with strata.quant.into.BLOCKS (quant blocks per program) at each value.
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
from strata.models.args import PRESETS  # noqa: E402
from strata.triton_state import TritonState  # noqa: E402

TORCH_ONLY = TritonState(kernels=False, iq3s=False, into=False)


def layer_shapes(preset: str) -> list[tuple[int, int]]:
    a = PRESETS[preset]
    q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    return [(q, a.dim), (kv, a.dim), (kv, a.dim), (a.dim, q), (a.ffn_dim, a.dim), (a.ffn_dim, a.dim), (a.dim, a.ffn_dim)]


def expert_shapes(preset: str) -> list[tuple[int, int]]:
    """One layer's expert matrices, each a stack of n_experts: gate, up (ffn x dim), down (dim x ffn)."""
    a = PRESETS[preset]
    return [(a.expert_ffn_dim, a.dim), (a.expert_ffn_dim, a.dim), (a.dim, a.expert_ffn_dim)]


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
    ap.add_argument("--experts", action="store_true", help="one layer's expert stacks (MXFP4: the split layout)")
    ap.add_argument("--blocks", default="", help="comma list: the `into` arm again at each strata.quant.into.BLOCKS")
    a = ap.parse_args()
    dev = torch.device(a.device)
    E = PRESETS[a.preset].n_experts if a.experts else 1
    shapes = [(E * r, c) for r, c in (expert_shapes(a.preset) if a.experts else layer_shapes(a.preset))]
    n = sum(r * c for r, c in shapes)
    g = torch.Generator().manual_seed(0)
    sweep = [int(b) for b in a.blocks.split(",") if b]
    if any(b < 1 or b & (b - 1) for b in sweep):
        ap.error(f"--blocks {a.blocks}: each a power of two (the kernels' tl.arange)")
    print(f"{a.preset}: one layer{f' of {E} experts' if a.experts else ''} = {n / 1e6:.0f}M weights, device {dev}")
    print("| type | stored MB/layer | torch ms/layer | "
          + " | ".join(f"`into` ms/layer (BLOCKS {b})" for b in sweep or ["as set"])
          + " | GB/s written (bf16, the fastest) |")
    print("|---|---:|---:|" + "---:|" * max(1, len(sweep)) + "---:|")
    for t in a.types.split(","):
        blocks = [quant.random_blocks(t, r, c, g, "cpu").to(dev) for r, c in shapes]
        slab = 0
        if a.experts and t == "MXFP4":  # as resident experts hold it: each expert's slab on its own
            from strata.quant.mxfp4 import to_split
            blocks = [to_split(b.view(E, b.shape[0] // E, -1)).view(b.shape) for b in blocks]
            slab = shapes[0][0] // E * shapes[0][1] // 32
            assert all(r // E * c // 32 == slab for r, c in shapes), "the bench takes one slab size a layer"
        out = [torch.empty(r, c, dtype=torch.bfloat16, device=dev) for r, c in shapes]

        def torch_path():  # IQ3_S's Triton kernel off for this holder: the torch formulas, as the header says
            for b, o in zip(blocks, out):
                if slab:
                    from strata.quant.mxfp4 import mxfp4_split
                    o.copy_(mxfp4_split(b.view(E, b.shape[0] // E, -1)).view(o.shape))
                else:
                    o.copy_(quant.dequantize(b, t, TORCH_ONLY))

        def into_path():
            for b, o in zip(blocks, out):
                assert into.dequantize_into(o, b, t, slab=slab), f"{t}: the kernel failed (see the log)"
        arms = [timed(torch_path, dev, a.reps)]
        for bl in sweep or [None]:  # None: the module's own counts
            if bl is not None:
                into.BLOCKS, into.BLOCKS_OF = bl, {}  # every type at this count
            arms.append(timed(into_path, dev, a.reps) if into.takes(t, out[0]) else None)
        stored = sum(b.numel() for b in blocks)
        best = min(x for x in arms if x is not None)
        cells = " | ".join("-" if x is None else f"{x:,.2f}" for x in arms)
        print(f"| {t} | {stored / 1e6:,.0f} | {cells} | {2 * n / best / 1e6:,.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
