"""A decode batch's resident K-quant products alone, by kernel and launch options, at 8B Llama's shapes: the dp4a
kernels (strata.quant.gemv, 4 rows a launch) against strata/quant/rows.py's tensor-core kernels over tiles, warps,
pipeline stages and split K. Each shape's products run as a decode step runs them: captured in a CUDA graph
(no launch overhead), over enough distinct copies of the matrix (at least COPY_BYTES) that none is read from L2;
the time is a replay's over the copies. GB/s is the weight bytes over that time. Random blocks, bf16 x.

    python bench/rows_sweep.py                      # 16 rows, each 8B shape, every config
    python bench/rows_sweep.py --rows 8,16 --quick  # the current defaults and a few others
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strata.quant import gemv, random_blocks, rows  # noqa: E402

# (weight rows, cols, qtype, count in one 8B Q4_K_M step): qkv fused, o, gate+up fused, down (half the layers
# Q6_K), the head
SHAPES = [(6144, 4096, "Q4_K", 32), (4096, 4096, "Q4_K", 32), (28672, 4096, "Q4_K", 32), (4096, 14336, "Q4_K", 16),
          (4096, 14336, "Q6_K", 16), (128256, 4096, "Q6_K", 1)]


COPY_BYTES = 256 << 20  # each shape's copies together: past an H100 / H200's 50 / 60 MB of L2
REPLAYS = 10


def graph_us(fns) -> float:
    """us a call of fns (one product each, on distinct matrices) in one CUDA graph: compiled first, then captured,
    then REPLAYS replays timed by events."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # Triton compiles (and torch allocates) outside the capture
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    graph.replay()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(REPLAYS):
        graph.replay()
    t1.record()
    t1.synchronize()
    return t0.elapsed_time(t1) * 1e3 / REPLAYS / len(fns)


def product(arm: str, opts: dict, x: torch.Tensor, blocks: torch.Tensor, qtype: str, cols: int):
    out = torch.empty(x.shape[0], blocks.shape[0], device="cuda", dtype=torch.bfloat16)
    if arm == "dp4a":
        return lambda: gemv.quant_matmul(x, blocks, qtype, cols, out=out)
    return lambda: rows.quant_matmul_rows(x, [(blocks, qtype)], cols, out=out, **opts)


def configs(quick: bool):
    """(arm, quant_matmul_rows' options): {} is the arm as the server launches it."""
    yield ("dp4a", {})
    yield ("mma-float", {})
    if quick:
        return
    for bn, w in itertools.product((32, 64, 128), (4, 8)):
        if (bn, w) != (rows.BLOCK_N, 4):
            yield ("mma-float", {"block_n": bn, "warps": w})
    for st in (2, 3, None):
        yield ("mma-float", {"stages": st})
    for sp in (1, 2, 8):
        yield ("mma-float", {"split": sp})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="16")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    mats = {}
    for n, c, q, _ in SHAPES:
        first = random_blocks(q, n, c, g, device="cuda")
        mats[(n, c, q)] = [first] + [first.clone() for _ in range(1, -(-COPY_BYTES // first.numel()))]
    print(f"{torch.cuda.get_device_name()}; per shape: us (GB/s of weights); step: the shapes' sum as one 8B "
          "Q4_K_M decode step's products")
    arms = {}
    for m in (int(r) for r in a.rows.split(",")):
        arms.clear()
        print(f"\n{m} rows")
        print(f"{'arm':9} {'options':40} " + " ".join(f"{f'{n}x{c} {q}':>22}" for n, c, q, _ in SHAPES)
              + f" {'step ms':>8}")
        for arm, opts in configs(a.quick):
            cells, step = [], 0.0
            for n, c, q, count in SHAPES:
                copies = mats[(n, c, q)]
                x = torch.randn(m, c, generator=g, device="cuda").bfloat16()
                try:
                    us = graph_us([product(arm, opts, x, b, q, c) for b in copies])
                except Exception as e:  # noqa: BLE001 (a config that does not build: say so and go on)
                    cells.append(f"{type(e).__name__:>22}")
                    step = float("nan")
                    continue
                cells.append(f"{us:9.1f} ({copies[0].numel() / us / 1e3:6.0f} GB/s)")
                step += us * count / 1e3
            print(f"{arm:9} {str(opts):40} " + " ".join(f"{s:>22}" for s in cells) + f" {step:8.2f}", flush=True)
            if not opts:
                arms[arm] = step
    # the kernels.gemv_rows arm whose launch as the server makes it (default options) had the shortest step, at
    # the last --rows (nan, a failed build, never wins)
    print("fastest arm:", min(arms, key=lambda k: arms[k] if arms[k] == arms[k] else float("inf")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
