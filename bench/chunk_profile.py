"""Where one prefill chunk's time goes in one stage slice: wall time per chunk and the top kernels.

    python bench/chunk_profile.py --model /tmp/8b.gguf --layers 0:16 --chunk 8192 --chunks 3 --weights resident
    python bench/chunk_profile.py --model /tmp/q32y-l8.gguf --chunk 448 --kv q8_0 --at 110000 --profile
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strata.weights.checkpoint import load_stage, model_args  # noqa: E402
from strata.config import from_dict  # noqa: E402

# the rig's defaults with the environment's overrides (STRATA_CUDA_ATTENTION, the kernels' switches)
ENV = from_dict({})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--layers", default="", help="start:end (default all)")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--chunks", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--kv", default="auto", help="kv_dtype (e.g. q8_0)")
    ap.add_argument("--at", type=int, default=0, help="the first timed chunk's position (a cached prefix before it)")
    a = ap.parse_args()
    args = model_args(a.model)
    start, end = (int(x) for x in a.layers.split(":")) if a.layers else (0, args.n_layers)
    t = time.perf_counter()
    m = load_stage(a.model, args, start, end, device=a.device, dtype=a.dtype, weights=a.weights,
                   max_len=a.at + a.chunk * a.chunks, kv_dtype=a.kv, max_chunk=a.chunk, kernels=ENV.kernels,
                   attention=ENV.attention)
    dev = torch.device(a.device)
    print(f"{a.model} layers [{start}, {end}) {a.weights}: loaded in {time.perf_counter() - t:.1f} s, "
          f"weights {m.weight_bytes / 2**30:.2f} GiB, scratch {m.scratch_bytes / 2**30:.2f} GiB")
    g = torch.Generator(device="cpu").manual_seed(0)
    for k in range(a.chunks):
        if start == 0:
            x = torch.randint(0, args.vocab_size, (1, a.chunk), generator=g).to(dev)
        else:
            x = (torch.randn(1, a.chunk, args.dim, generator=g) * 0.1).to(dev, getattr(torch, a.dtype))
        torch.cuda.synchronize(dev) if dev.type == "cuda" else None
        t = time.perf_counter()
        if a.profile and k == a.chunks - 1:
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                m(x, a.at + k * a.chunk, decode=False)
                torch.cuda.synchronize(dev)
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
        else:
            m(x, a.at + k * a.chunk, decode=False)
        torch.cuda.synchronize(dev) if dev.type == "cuda" else None
        print(f"chunk {k}: {time.perf_counter() - t:.3f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
