"""One stage's decode step on a GGUF, looked at: whether the CUDA graphs take it, graph and eager step times,
the kernels of five graph replays and the eager step's top CUDA kernels (torch.profiler).

    python bench/decode_probe.py --model /tmp/q30a3-q4km.gguf --context 2048
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
from strata.decode.graphs import GraphedDecode  # noqa: E402

# the rig's defaults with the environment's overrides (STRATA_CUDA_ATTENTION, the kernels' switches)
ENV = from_dict({})


def step_ms(m, x, pos, n=20) -> float:
    for i in range(3):
        m.decode_token(x, pos + i)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for i in range(n):
        m.decode_token(x, pos + 3 + i)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--context", type=int, default=2048)
    a = ap.parse_args()
    args = model_args(a.model)
    m = load_stage(a.model, args, 0, args.n_layers, device="cuda", dtype=torch.bfloat16, max_len=a.context + 256,
                   max_chunk=2048, kernels=ENV.kernels, attention=ENV.attention)
    ids = torch.randint(0, args.vocab_size, (1, a.context), device="cuda")
    with torch.inference_mode():
        for p in range(0, a.context, 2048):
            m(ids[:, p:p + 2048], p)
        x = ids[:, :1]
        g = GraphedDecode(m)
        print("graphable", g.graphable(x), "extras", args.extras())
        print(f"graphs: {step_ms(g, x, a.context):.2f} ms/token")
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:  # the kernels inside the replays (CUPTI)
            for i in range(5):
                g.decode_token(x, a.context + 30 + i)
            torch.cuda.synchronize()
        print("graph replays, 5 steps:")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
        print(f"eager: {step_ms(m, x, a.context + 40):.2f} ms/token")
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            m.decode_token(x, a.context + 100)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
    return 0


if __name__ == "__main__":
    sys.exit(main())
