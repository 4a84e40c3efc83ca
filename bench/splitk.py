"""Split-K decode attention alone (strata.kernels.decode_attention) on one GPU: one layer's step for an 8B shape (8 kv heads
of 4 query rows, head dim 128) over a cache of --keys positions, with a bfloat16 cache and a q8_0 cache read by each
of its arms (kernels.q8_attention: widen, int8, int8x2), for a few split counts and warps per program; the time a
launch pair takes (CUDA events over --reps back-to-back launches, no L2 flush: at 122,880 keys the caches, 0.50 GB
bf16 and 0.27 GB q8_0 for K and V, are 5-10x the H200's 50 MB L2, so each launch streams them from HBM; shorter
--keys would be partly L2-resident), the cache bytes a microsecond streams, and the output's relative error to
float64 attention over the same cache (a q8_0 cache dequantized). Prints one row per setting: the bf16 cache and the
widen arm at 64, 128 and 256 ranges and 4 or 8 warps (as timed before, 2026-12-03); the int8 arms at 128 and 256
ranges, 4 or 8 warps, tiles of 64 and 128 keys and Triton's default pipelining depth or 2 stages (less shared
memory a program: more programs an SM).

    python bench/splitk.py --keys 122880
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strata.kernels.attention import from_q8_0, to_q8_0  # noqa: E402
from strata.config import Q8_ATTENTION  # noqa: E402
from strata.kernels.decode_attention import SplitKAttention  # noqa: E402


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """float64 softmax attention of q (nkv, g, hd) over k, v (nkv, S, hd), one kv head at a time."""
    out = []
    for h in range(q.shape[0]):
        s = q[h].double() @ k[h].double().T / q.shape[-1] ** 0.5
        out.append(torch.softmax(s, -1) @ v[h].double())
    return torch.stack(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, default=122880)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--arms", default=",".join(Q8_ATTENTION), help="the q8_0 cache's arms to time")
    a = ap.parse_args()
    dev, nkv, g, hd, S = "cuda", 8, 4, 128, a.keys
    torch.manual_seed(0)
    q = torch.randn(nkv, g, hd, device=dev, dtype=torch.bfloat16)
    kf, vf = (torch.randn(nkv, S, hd, device=dev, dtype=torch.bfloat16) for _ in range(2))
    k8, v8 = to_q8_0(kf), to_q8_0(vf)
    want = {"bfloat16": reference(q, kf, vf),
            "q8_0": reference(q, from_q8_0(k8, torch.float32), from_q8_0(v8, torch.float32))}
    n = torch.tensor([S], device=dev)
    ref = None
    print("| cache | arm | splits | warps | block | stages | us per layer | GB/s of cache | rel. error to float64 | "
          "max abs diff to bf16 splits 64 warps 4 |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    runs = [("bfloat16", kf, vf, "-")] + [("q8_0", k8, v8, arm) for arm in a.arms.split(",")]
    for name, k, v, arm in runs:
        int8 = arm.startswith("int8")
        settings = [(splits, warps, block, stages) for splits in ((128, 256) if int8 else (64, 128, 256))
                    for warps in (4, 8) for block in ((64, 128) if int8 else (64,))
                    for stages in ((None, 2) if int8 else (None,))]
        for splits, warps, block, stages in settings:
            att = SplitKAttention(nkv, g, hd, S, dev, splits=splits, num_warps=warps,
                                  q8=arm if name == "q8_0" else "widen", block=block, num_stages=stages)
            out = torch.empty_like(q)
            cells = f"| {name} | {arm} | {att.splits} | {warps} | {block} | {stages or 'default'} |"
            try:
                att(q, k, v, n, out)
                torch.cuda.synchronize()
            except Exception as e:  # a setting the compiler refuses
                print(f"{cells} failed: {type(e).__name__}: {str(e)[:200]} | | | |")
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
            err = float((out.double() - want[name]).norm() / want[name].norm())
            nbytes = k.numel() * k.element_size() * 2
            print(f"{cells} {us:.1f} | {nbytes / us / 1e3:,.0f} | {err:.2e} | "
                  f"{float((out.float() - ref).abs().max()):.3g} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
