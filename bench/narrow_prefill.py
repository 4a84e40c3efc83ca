"""An 8-bit cache's prefill attention (strata.attention.narrow_cache_attention) for one layer, chunk after chunk as
a prefill meets it: each call at a new cached-prefix length (cold: cuDNN builds a graph for the remainder block's
new shape) and the same calls again (warm), wall time per call with the host's part included; and the remainder
block by torch's flash kernel instead (no per-shape build). For the seed's rig's slow prefill (issue 26).

    python bench/narrow_prefill.py --chunk 448 --heads 64 --kv-heads 8
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import strata.attention as A  # noqa: E402


def wall(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunk", type=int, default=448)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--keys", type=int, default=122880)
    ap.add_argument("--calls", type=int, default=6)
    a = ap.parse_args()
    nh, nkv, hd, T = a.heads, a.kv_heads, 128, a.chunk
    dev, dt = torch.device("cuda"), torch.bfloat16
    k = A.to_cache(torch.randn(1, nkv, a.keys, hd, device=dev, dtype=dt), A.Q8_0)
    v = A.to_cache(torch.randn(1, nkv, a.keys, hd, device=dev, dtype=dt), A.Q8_0)
    q = torch.randn(1, T, nh, hd, device=dev, dtype=dt).transpose(1, 2)
    first = (A.PREFIX_BLOCK // T + 1) * T  # past one block: the blocked path
    spots = [first + i * 7 * T for i in range(a.calls)]
    print(f"chunk {T}, {nh}/{nkv} heads, q8_0 cache of {a.keys:,} keys; ms per call (wall, synchronized)")
    for name in ("cudnn", "flash-remainder"):
        rem = "flash" if name == "flash-remainder" else "cudnn"
        cold = [wall(lambda: A.narrow_cache_attention(q, k, v, p, remainder=rem)) for p in spots]
        warm = [wall(lambda: A.narrow_cache_attention(q, k, v, p, remainder=rem)) for p in spots]
        print(f"{name}: cold {' '.join(f'{x:.1f}' for x in cold)} | warm {' '.join(f'{x:.1f}' for x in warm)}")
        if name == "cudnn":
            ref = A.narrow_cache_attention(q, k, v, spots[-1], remainder=rem)
        else:
            got = A.narrow_cache_attention(q, k, v, spots[-1], remainder=rem)
            print(f"flash-remainder vs cudnn: max abs diff {(got.float() - ref.float()).abs().max().item():.3e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
