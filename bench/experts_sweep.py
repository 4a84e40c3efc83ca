"""Launch shapes of the decode kernels that the experts models lean on, timed on the GPU: each candidate Config
for one matrix shape, ten launches captured in a CUDA graph (the host's launch time left out), best first.

    python bench/experts_sweep.py            # gpt-oss-20b's MXFP4 experts and Q8_0 attention, Qwen3-30B-A3B's experts
    python bench/experts_sweep.py MXFP4      # only those (MXFP4, Q8_0, Q6_K/Q4_K)

Prints, per case, the microseconds a launch and the weights' GB/s for the current default and the best few.
"""
from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strata.quant import gemv, random_blocks, type_size, block_size  # noqa: E402


def graph_us(fn, reps: int = 10, rounds: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        fn()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            for _ in range(reps):
                fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) * 1e3 / reps)
    return best


def sweep(name: str, nbytes: int, fn, configs, setter, default) -> None:
    rows = []
    for cfg in configs:
        setter(cfg)
        try:
            rows.append((graph_us(fn), cfg))
        except Exception as e:  # a shape the kernel refuses (e.g. registers): named, not fatal
            print(f"  {cfg}: {type(e).__name__}: {str(e)[:80]}")
    setter(default)
    rows.sort(key=lambda r: r[0])
    d = next((us for us, c in rows if c == default), None)
    print(f"{name}: {nbytes / 2**20:.1f} MiB; default {default}: "
          + (f"{d:.1f} us ({nbytes / d / 1e3:,.0f} GB/s)" if d else "failed"))
    for us, cfg in rows[:4]:
        print(f"  {us:8.1f} us  {nbytes / us / 1e3:7,.0f} GB/s  {cfg}")


def experts_case(qtype, E, rows, cols, k, xrows, dev):
    g = torch.Generator().manual_seed(0)
    st = random_blocks(qtype, E * rows, cols, g, "cpu").view(E, rows, -1).contiguous().to(dev)
    ids = torch.randperm(E, generator=g)[:k].to(dev)
    x = torch.randn(xrows, cols, device=dev, dtype=torch.bfloat16)
    nbytes = k * rows * cols // block_size(qtype) * type_size(qtype)
    return (lambda: gemv.quant_matmul_experts(x, st, ids, qtype, cols)), nbytes


def main() -> int:
    only = set(sys.argv[1:])  # e.g. MXFP4 Q8_0: those cases only
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(0))
    grid = [gemv.Config(bn, sb, w) for bn, sb, w in itertools.product((4, 8, 16, 32), (2, 4, 8), (4, 8))]
    kgrid = [gemv.Config(bn, sb, w) for bn, sb, w in itertools.product((4, 8, 16), (1, 2, 4), (4, 8))]

    def set_mx(c):
        gemv.MXFP4_EXPERTS = c
    for label, rows, cols, xr in (("gpt-oss-20b gate/up (4 of 32 experts)", 5760, 2880, 1),
                                  ("gpt-oss-20b down", 2880, 2880, 4)):
        if only and "MXFP4" not in only:
            break
        fn, nb = experts_case("MXFP4", 32, rows, cols, 4, xr, dev)
        sweep(f"MXFP4 experts {label}", nb, fn, grid, set_mx, gemv.MXFP4_EXPERTS)

    def set_q8(c):
        gemv.CONFIGS["Q8_0"] = c
    q8 = gemv.CONFIGS["Q8_0"]
    for label, rows, cols in (("gpt-oss-20b qkv", 5120, 2880), ("gpt-oss-20b head", 201088, 2880)):
        if only and "Q8_0" not in only:
            break
        w = random_blocks("Q8_0", rows, cols, torch.Generator().manual_seed(1), "cpu").to(dev)
        x = torch.randn(1, cols, device=dev, dtype=torch.bfloat16)
        big = rows >= gemv.BIG_ROWS  # (Q8_0 has no BIG_CONFIGS entry: CONFIGS serves every size)
        sweep(f"Q8_0 {label}{' (big)' if big else ''}", w.numel(), lambda: gemv.quant_matmul(x, w, "Q8_0", cols),
              grid, set_q8, q8)

    def setter(q):
        def set_cfg(c):
            gemv.EXPERTS_CONFIGS[q] = c
        return set_cfg
    if only and not only & {"Q6_K", "Q4_K"}:
        return 0
    fn, nb = experts_case("Q6_K", 128, 2048, 768, 8, 8, dev)
    sweep("Q6_K experts Qwen3-30B-A3B down (8 of 128, 3 blocks a row)", nb, fn, kgrid, setter("Q6_K"),
          gemv.EXPERTS_CONFIGS["Q6_K"])
    fn, nb = experts_case("Q4_K", 128, 1536, 2048, 8, 1, dev)
    sweep("Q4_K experts Qwen3-30B-A3B gate/up", nb, fn, kgrid, setter("Q4_K"), gemv.EXPERTS_CONFIGS["Q4_K"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
