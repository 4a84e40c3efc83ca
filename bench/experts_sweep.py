"""Launch shapes of the decode kernels that the experts models lean on, timed on the GPU: each candidate Config
for one matrix shape, ten launches captured in a CUDA graph (the host's launch time left out), best first.

    python bench/experts_sweep.py            # gpt-oss-20b's MXFP4 experts and Q8_0 attention, Qwen3-30B-A3B's experts
    python bench/experts_sweep.py MXFP4      # only those (MXFP4, Q8_0, Q6_K/Q4_K)
    python bench/experts_sweep.py --mxfp4-dp4a   # the MXFP4 dp4a kernel's launch shapes against the float kernel

Prints, per case, the microseconds a launch and the weights' GB/s for the current default and the best few.
--mxfp4-dp4a times each launch alone from a CUDA graph with L2 flushed before it (gpt-oss-20b's 4 experts' gate/up
are 34 MiB: they would stay in the H200's L2 across back-to-back launches, which a decode step's other layers
evict): the float kernel on the file's layout (the earlier path) and on the split one, then the dp4a kernel per
Config on the split layout, x's int8 rounding given (the kernel alone) and made by its own launch (as a call
without xq).
"""
from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strata.quant import gemv, random_blocks, type_size, block_size  # noqa: E402
from bench.gemv import Timer  # noqa: E402


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


def cold_us(timer: Timer, fn) -> float:
    """Median microseconds of one call replayed from a CUDA graph, L2 flushed before each rep (bench/gemv.py's
    Timer and graph)."""
    return timer(timer.graphed(fn)) * 1e6


MXFP4_DP4A_GRID = [gemv.Config(bn, sb, w) for bn, sb, w in itertools.product((4, 8, 16, 32), (4, 8, 16), (2, 4, 8))]


def mxfp4_dp4a_sweep() -> int:
    """gpt-oss-20b's two experts launches: the float kernel (file and split layouts) and the dp4a one per Config."""
    from strata.quant import mxfp4
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(0), "| MXFP4 experts, L2 flushed, one launch a graph (median of 30)")
    timer = Timer(torch.device("cuda"), 30)
    default = gemv.MXFP4_DP4A
    total = {}
    for label, rows, cols, xr in (("gate/up 5760x2880, x 1 row", 5760, 2880, 1), ("down 2880x2880, x 4 rows", 2880,
                                                                                  2880, 4)):
        g = torch.Generator().manual_seed(0)
        st = random_blocks("MXFP4", 32 * rows, cols, g, "cpu").view(32, rows, -1).contiguous().to(dev)
        sp = mxfp4.to_split(st)
        ids = torch.randperm(32, generator=g)[:4].to(dev)
        x = torch.randn(xr, cols, device=dev, dtype=torch.bfloat16)
        xq = gemv.quantize_x(x)
        nbytes = 4 * rows * cols // 32 * 17
        fl = gemv.GemvKernels(mxfp4="float")
        ref = gemv.quant_matmul_experts(x.float(), st, ids, "MXFP4", cols, kernels=fl).double()
        got = gemv.quant_matmul_experts(x, sp, ids, "MXFP4", cols, xq=xq, split=True).double()
        err = ((got - ref).norm() / ref.norm()).item()
        print(f"{label}: {nbytes / 2**20:.1f} MiB read; dp4a vs float kernel rel. error {err:.2e}")
        cases = [("float, file layout (before)", lambda: gemv.quant_matmul_experts(x, st, ids, "MXFP4", cols,
                                                                                   kernels=fl)),
                 ("float, split layout", lambda: gemv.quant_matmul_experts(x, sp, ids, "MXFP4", cols, kernels=fl,
                                                                           split=True)),
                 ("quantize_x alone", lambda: gemv.quantize_x(x)),
                 (f"dp4a {default} + its quantize_x", lambda: gemv.quant_matmul_experts(x, sp, ids, "MXFP4", cols,
                                                                                       split=True))]
        for name, fn in cases:
            us = cold_us(timer, fn)
            total[(label, name)] = us
            print(f"  {us:8.1f} us  {nbytes / us / 1e3:7,.0f} GB/s  {name}")
        rows_t = []
        for cfg in MXFP4_DP4A_GRID:
            gemv.MXFP4_DP4A = cfg
            k = gemv.GemvKernels()
            try:
                rows_t.append((cold_us(timer, lambda: gemv.quant_matmul_experts(x, sp, ids, "MXFP4", cols, kernels=k, xq=xq,
                                                                       split=True)), cfg))
            except Exception as e:  # a shape the compiler refuses: named, not fatal
                print(f"  {cfg}: {type(e).__name__}: {str(e)[:80]}")
            if k.mxfp4 != "dp4a":
                print(f"  {cfg}: fell back to the float kernel")
        gemv.MXFP4_DP4A = default
        rows_t.sort(key=lambda r: r[0])
        d = next((us for us, c in rows_t if c == default), float("nan"))
        print(f"  dp4a kernel alone (xq given), default {default}: {d:.1f} us ({nbytes / d / 1e3:,.0f} GB/s); best:")
        for us, cfg in rows_t[:6]:
            print(f"  {us:8.1f} us  {nbytes / us / 1e3:7,.0f} GB/s  {cfg}")
    return 0


def main() -> int:
    if "--mxfp4-dp4a" in sys.argv:
        return mxfp4_dp4a_sweep()
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
