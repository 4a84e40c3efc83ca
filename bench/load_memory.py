"""What a CUDA stage holds after load, against what it reports and what the planner counted: load layers
[start, end) of a model with the allocator's history on, then group the live allocations by the first strata
frame that made them (file:line), largest first. For the gap between a stage's measured bytes at load and its
plan (issue 26: ~0.5 GiB per CUDA stage of the seed's rig).

    python bench/load_memory.py --model /tmp/q32y-l8.gguf --layers 0:4 --max-len 122880 --kv q8_0 --chunk 448
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers import memory_trace  # noqa: E402
from strata.weights.checkpoint import load_stage, model_args, stage_bytes, weights_mode  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--layers", required=True, help="start:end")
    ap.add_argument("--max-len", type=int, default=122880)
    ap.add_argument("--kv", default="q8_0")
    ap.add_argument("--chunk", type=int, default=448)
    a = ap.parse_args()
    start, end = (int(x) for x in a.layers.split(":"))
    args = model_args(a.model)
    dev = torch.device("cuda:0")
    torch.cuda.init()
    base = torch.cuda.memory_allocated(dev)
    memory_trace.start()
    m = load_stage(a.model, args, start, end, device=dev, dtype=torch.bfloat16, kv_dtype=a.kv, max_len=a.max_len,
                   max_chunk=a.chunk)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated(dev) - base
    mode = weights_mode(a.model, "cuda", "auto", args)
    w, s, kv = stage_bytes(a.model, args, start, end, torch.bfloat16, mode, a.kv, a.max_len, "cuda", a.chunk)
    gib = lambda b: f"{b / 2**30:.3f}"
    print(f"layers [{start}, {end}) of {a.model}, weights {mode}")
    print(f"allocated {gib(held)} GiB; model reports weights {gib(m.weight_bytes)} scratch {gib(m.scratch_bytes)} "
          f"kv {gib(m.kv_bytes)} = {gib(m.weight_bytes + m.scratch_bytes + m.kv_bytes)}; "
          f"stage_bytes {gib(w)} / {gib(s)} / {gib(kv)} = {gib(w + s + kv)}; "
          f"unaccounted {gib(held - (m.weight_bytes + m.scratch_bytes + m.kv_bytes))} GiB")
    for line in memory_trace.summary(14):
        print("  " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
