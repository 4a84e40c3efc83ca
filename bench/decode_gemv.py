"""Dense decode GEMV (strata/kernels/decode_gemv.py): cuBLAS against each Triton launch shape, per matrix of a preset.

Median of CUDA-event timings with L2 flushed before each rep (a decode step meets its weights cold); GB/s of
weights read. The whole step's bytes at the end: what the graph step's products would cost with the fastest of each.

--graph: what a decode step's products cost back to back. One CUDA graph per launch shape holds every layer's
four products over the layers' own weights (so nothing is in L2 but x), as a decode graph replays them; the
table gives its median replay in ms and the weights' TB/s, for cuBLAS and a wider sweep of launch shapes
(rows per program, columns per step, warps, pipeline stages) than matvec's CONFIGS.

    python bench/decode_gemv.py --preset llama-3-8b [--graph]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strata.kernels import decode_gemv as dg  # noqa: E402
from strata.kernels.cuda_timing import median_ms  # noqa: E402
from strata.models.args import PRESETS  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama-3-8b")
    ap.add_argument("--graph", action="store_true", help="every layer's products in one graph, per launch shape")
    a = ap.parse_args()
    p = PRESETS[a.preset]
    q, kv = p.n_heads * p.head_dim, p.n_kv_heads * p.head_dim
    shapes = {"qkv": (q + 2 * kv, p.dim), "wo": (p.dim, q), "gate_up": (2 * p.ffn_dim, p.dim), "down": (p.dim, p.ffn_dim)}
    if a.graph:
        return graph_sweep(p, shapes)
    flush = torch.empty(64 << 20, dtype=torch.int32, device="cuda")
    print(f"{a.preset}, bf16, one row; us (GB/s)")
    print("| matrix | cuBLAS | " + " | ".join(f"Triton {c}" for c in dg.CONFIGS) + " |")
    total = {"cublas": 0.0, "best": 0.0}
    for name, (n, k) in shapes.items():
        w = (torch.randn(n, k, device="cuda") * 0.02).bfloat16()
        x = torch.randn(k, device="cuda").bfloat16()
        y = torch.empty(n, device="cuda", dtype=torch.bfloat16)
        gb = n * k * 2 / 1e9
        ms = {"cublas": median_ms(lambda: F.linear(x, w), 15, flush)}
        for c in dg.CONFIGS:
            if dg._fits(c, n, k):
                ms[c] = median_ms(lambda: dg._launch(c, x, w, None, y), 15, flush)
        cells = [f"{ms[c] * 1e3:.1f} ({gb / ms[c] * 1e3:,.0f})" if c in ms else "-" for c in ["cublas", *dg.CONFIGS]]
        print(f"| {name} {n}x{k} | " + " | ".join(cells) + " |")
        total["cublas"] += ms["cublas"] * p.n_layers
        total["best"] += min(ms.values()) * p.n_layers
    print(f"layers' products per token: cuBLAS {total['cublas']:.2f} ms, the fastest of each {total['best']:.2f} ms")
    return 0


SWEEP = [(bn, bk, w, st) for bn in (4, 8, 16) for bk in (256, 512, 1024) for w in (2, 4, 8) for st in (1, 3)
         if bn * bk // (32 * w) <= 128]  # at most 128 float32 accumulators a thread


def graph_sweep(p, shapes: dict) -> int:
    """Each launch shape's (and cuBLAS's) replay of all layers' products, in one graph each."""
    layers = [{name: (torch.randn(n, k, device="cuda") * 0.02).bfloat16() for name, (n, k) in shapes.items()}
              for _ in range(p.n_layers)]
    xs = {name: torch.randn(k, device="cuda").bfloat16() for name, (n, k) in shapes.items()}
    ys = {name: torch.empty(n, device="cuda", dtype=torch.bfloat16) for name, (n, k) in shapes.items()}
    tb = sum(n * k * 2 for n, k in shapes.values()) * p.n_layers / 1e12
    print(f"{p.n_layers} layers x {len(shapes)} products, {tb * 1e3:.2f} GB of bf16 weights a replay")

    def run(fn, names) -> float:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for lw in layers:
                for nm in names:
                    fn(xs[nm], lw[nm], ys[nm])
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for lw in layers:
                for nm in names:
                    fn(xs[nm], lw[nm], ys[nm])
        g.replay()
        ms = median_ms(g.replay, 7)
        del g
        return ms

    def triton_fn(c):
        bn, bk, w, st = c
        return lambda x, wt, y: dg._gemv[(wt.shape[0] // bn,)](x, wt, wt, y, wt.shape[1], wt.stride(0), HAS_BIAS=False,
                                                               BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=st)

    best = {}
    print("| launch shape | " + " | ".join(shapes) + " | all four |")
    cands = [("cuBLAS", None, lambda x, w, y: torch.matmul(w, x, out=y))] + [(str(c), c, triton_fn(c)) for c in SWEEP]
    for label, c, fn in cands:
        cells, tot = [], 0.0
        for name, (n, k) in shapes.items():
            if c is not None and not dg._fits(c, n, k):
                cells.append("-")
                continue
            ms = run(fn, [name])
            tot += ms
            cells.append(f"{ms:.3f} ({n * k * 2 * p.n_layers / ms / 1e9:.2f})")
            if name not in best or ms < best[name][1]:
                best[name] = (label, ms)
        print(f"| {label} | " + " | ".join(cells) + f" | {tot:.3f} |")
    all_ms = sum(ms for _, ms in best.values())
    print("fastest: " + ", ".join(f"{nm} {lb} {ms:.3f} ms" for nm, (lb, ms) in best.items())
          + f"; all four {all_ms:.3f} ms ({tb / all_ms * 1e3:.2f} TB/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
