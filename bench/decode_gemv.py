"""Dense decode GEMV (strata/decode_gemv.py): cuBLAS against each Triton launch shape, per matrix of a preset.

Median of CUDA-event timings with L2 flushed before each rep (as matvec's own choice times them); GB/s of
weights read. The whole step's bytes at the end: what the graph step's products would cost with each choice.

    python bench/decode_gemv.py --preset llama-3-8b
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strata import decode_gemv as dg  # noqa: E402
from strata.model import PRESETS  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama-3-8b")
    a = ap.parse_args()
    p = PRESETS[a.preset]
    q, kv = p.n_heads * p.head_dim, p.n_kv_heads * p.head_dim
    shapes = {"qkv": (q + 2 * kv, p.dim), "wo": (p.dim, q), "gate_up": (2 * p.ffn_dim, p.dim), "down": (p.dim, p.ffn_dim)}
    flush = torch.empty(64 << 20, dtype=torch.int32, device="cuda")
    print(f"{a.preset}, bf16, one row; us (GB/s)")
    print("| matrix | cuBLAS | " + " | ".join(f"Triton {c}" for c in dg.CONFIGS) + " |")
    total = {"cublas": 0.0, "best": 0.0}
    for name, (n, k) in shapes.items():
        w = (torch.randn(n, k, device="cuda") * 0.02).bfloat16()
        x = torch.randn(k, device="cuda").bfloat16()
        y = torch.empty(n, device="cuda", dtype=torch.bfloat16)
        gb = n * k * 2 / 1e9
        ms = {"cublas": dg._time(lambda: F.linear(x, w), flush)}
        for c in dg.CONFIGS:
            if dg._fits(c, n, k):
                ms[c] = dg._time(lambda: dg._launch(c, x, w, None, y), flush)
        cells = [f"{ms[c] * 1e3:.1f} ({gb / ms[c] * 1e3:,.0f})" if c in ms else "-" for c in ["cublas", *dg.CONFIGS]]
        print(f"| {name} {n}x{k} | " + " | ".join(cells) + " |")
        total["cublas"] += ms["cublas"] * p.n_layers
        total["best"] += min(ms.values()) * p.n_layers
    print(f"layers' products per token: cuBLAS {total['cublas']:.2f} ms, the fastest of each {total['best']:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
