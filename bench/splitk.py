"""Split-K decode attention alone (strata.decode_attention) on one GPU: one layer's step for an 8B shape (8 kv heads
of 4 query rows, head dim 128) over a cache of --keys positions, with a bfloat16 and a q8_0 cache, for a few
split counts and warps per program; the time a launch pair takes (CUDA events over --reps) and the cache bytes a
microsecond streams. Prints one row per setting.

    python bench/splitk.py --keys 122880
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strata.attention import Q8_0, to_q8_0  # noqa: E402
from strata.decode_attention import SplitKAttention  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, default=122880)
    ap.add_argument("--reps", type=int, default=200)
    a = ap.parse_args()
    dev, nkv, g, hd, S = "cuda", 8, 4, 128, a.keys
    torch.manual_seed(0)
    q = torch.randn(nkv, g, hd, device=dev, dtype=torch.bfloat16)
    kf, vf = (torch.randn(nkv, S, hd, device=dev, dtype=torch.bfloat16) for _ in range(2))
    caches = {"bfloat16": (kf, vf), "q8_0": (to_q8_0(kf), to_q8_0(vf))}
    n = torch.tensor([S], device=dev)
    ref = None
    print("| cache | splits | warps | us per layer | GB/s of cache | max abs diff to bf16 splits 64 warps 4 |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in ("bfloat16", "q8_0"):
        k, v = caches[name]
        for splits in (64, 128, 256):
            for warps in (4, 8):
                att = SplitKAttention(nkv, g, hd, S, dev, splits=splits, num_warps=warps)
                out = torch.empty_like(q)
                try:
                    att(q, k, v, n, out)
                    torch.cuda.synchronize()
                except Exception as e:  # a setting the compiler refuses
                    print(f"| {name} | {att.splits} | {warps} | failed: {type(e).__name__}: {str(e)[:200]} | | |")
                    continue
                t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0.record()
                for _ in range(a.reps):
                    att(q, k, v, n, out)
                t1.record()
                torch.cuda.synchronize()
                us = t0.elapsed_time(t1) * 1000 / a.reps
                if ref is None:
                    ref = out.float().clone()
                nbytes = k.numel() * k.element_size() * 2
                print(f"| {name} | {att.splits} | {warps} | {us:.1f} | {nbytes / us / 1e3:,.0f} | "
                      f"{float((out.float() - ref).abs().max()):.3g} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
