"""An 8-bit cache's prefill attention (strata.kernels.attention.narrow_cache_attention) for one layer, chunk after chunk as
a prefill meets it: each call at a new cached-prefix length (cold: cuDNN builds a graph for the remainder block's
new shape) and the same calls again (warm), wall time per call with the host's part included; and the remainder
block by torch's flash kernel instead (no per-shape build). For the seed's rig's slow prefill (issue 26).
--prefill: one layer's attention over a whole prefill (chunk after chunk up to --keys), summed, in arms: a bfloat16
cache (chunk_attention, the rig's default path), and the q8_0 cache widened PREFIX_BLOCK positions at a time for each
--blocks value (0: the whole prefix widened at once, then chunk_attention, what the planner now gives a CUDA stage
whose memory holds it); cold (each prefix shape met first, as a
stage meets it once for all its layers) and warm (the same calls again). For the q8_0 prefill's 89 % (issue 26).

    python bench/narrow_prefill.py --chunk 448 --heads 64 --kv-heads 8
    python bench/narrow_prefill.py --prefill --chunk 10240 --heads 32 --kv-heads 8 --blocks 16384,32768,65536,0
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import strata.kernels.attention as A  # noqa: E402


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
    ap.add_argument("--prefill", action="store_true")
    ap.add_argument("--blocks", default="16384,32768,65536,0")
    a = ap.parse_args()
    if a.prefill:
        return prefill(a)
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


def prefill(a) -> int:
    nh, nkv, hd, T = a.heads, a.kv_heads, 128, a.chunk
    dev, dt = torch.device("cuda"), torch.bfloat16
    kb = torch.randn(1, nkv, a.keys, hd, device=dev, dtype=dt)
    vb = torch.randn(1, nkv, a.keys, hd, device=dev, dtype=dt)
    k8, v8 = A.to_cache(kb, A.Q8_0), A.to_cache(vb, A.Q8_0)
    q = torch.randn(1, T, nh, hd, device=dev, dtype=dt).transpose(1, 2)
    spots = list(range(0, a.keys - T + 1, T))

    def q8(block):
        def run(p):
            if block == 0 or p <= block:
                kw, vw = A.from_cache(k8[:, :, :p + T], dt), A.from_cache(v8[:, :, :p + T], dt)
                return A.chunk_attention(q, kw, vw, p)
            return A.narrow_cache_attention(q, k8, v8, p, block=block)
        return run

    arms = {"bf16 cache": lambda p: A.chunk_attention(q, kb[:, :, :p + T], vb[:, :, :p + T], p)}
    for b in (int(x) for x in a.blocks.split(",")):
        arms[f"q8_0, blocks of {b:,}" if b else "q8_0, whole prefix"] = q8(b)
    print(f"one layer's prefill attention: chunk {T}, {len(spots)} chunks to {a.keys:,} keys, {nh}/{nkv} heads; "
          "ms summed over the chunks (wall, synchronized per call)")
    print("| arm | cold ms | warm ms | warm vs bf16 | max abs diff vs bf16 at the last chunk |")
    base, ref = None, arms["bf16 cache"](spots[-1])
    for name, fn in arms.items():
        cold = sum(wall(lambda: fn(p)) for p in spots)
        warm = sum(wall(lambda: fn(p)) for p in spots)
        base = base or warm
        diff = (fn(spots[-1]).float() - ref.float()).abs().max().item()
        print(f"| {name} | {cold:.1f} | {warm:.1f} | {warm / base:.3f} | {diff:.2e} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
