"""The prefill's prefix attention call (a chunk's queries against its cached prefix, unmasked, cuDNN) in three
layouts, each timed by CUDA events (median of reps) with its TFLOP/s:

- `gqa-strided`: what strata.models.model does now: q a (1, nh, T, hd) view of the (1, T, nh, hd) rows, grouped-query
  attention native (nkv key/value heads).
- `gqa-contig`: the same with q copied contiguous first (copy included).
- `packed`: each key/value head's g query heads as g*T query rows of one head, plain multi-head attention over
  nkv heads (exact: no mask, so a row's position does not matter); copy included.

    python bench/prefix_attention.py --chunk 10240 --prefix 112640
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strata.kernels.cuda_timing import median_ms  # noqa: E402


def cudnn(q, k, v):
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, False, False)[:2]
    return out, lse


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunk", type=int, default=10240)
    ap.add_argument("--prefix", default="51200,112640")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    nh, nkv, hd, T, g = a.heads, a.kv_heads, 128, a.chunk, a.heads // a.kv_heads
    dev, dt = "cuda", torch.bfloat16
    rows = torch.randn(1, T, nh, hd, device=dev, dtype=dt)
    q = rows.transpose(1, 2)  # (1, nh, T, hd) strided, as Attention.forward makes it
    print(f"q {T} rows x {nh} heads, kv {nkv} heads, hd {hd}; ms (TFLOP/s)")
    print("| prefix | gqa-strided | gqa-contig | packed | packed == strided (max abs diff) |")
    for S in (int(x) for x in a.prefix.split(",")):
        k = torch.randn(1, nkv, S, hd, device=dev, dtype=dt)
        v = torch.randn(1, nkv, S, hd, device=dev, dtype=dt)
        flops = 4.0 * nh * T * S * hd
        arms = {
            "gqa-strided": lambda: cudnn(q, k, v),
            "gqa-contig": lambda: cudnn(q.contiguous(), k, v),
            "packed": lambda: cudnn(q.contiguous().view(1, nkv, g * T, hd), k, v),
        }
        cells, outs = [], {}
        for name, fn in arms.items():
            outs[name] = fn()  # builds cuDNN's graph for the shape
            torch.cuda.synchronize()
            ms = median_ms(fn, a.reps)
            cells.append(f"{ms:.1f} ({flops / ms / 1e9:,.0f})")
        diff = (outs["packed"][0].view(1, nh, T, hd).float() - outs["gqa-strided"][0].float()).abs().max().item()
        print(f"| {S:,} | " + " | ".join(cells) + f" | {diff:.2e} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
