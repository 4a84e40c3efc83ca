"""Time the fused dequantize + matrix-vector kernels (strata.quant.gemv) against the current decode path.

Per type (IQ3_S: per kernel of --iq3s, GemvKernels.iq3s) at a preset's layer shapes (q/k/v and gate/up as the one launch decode makes): the kernel's
median time (CUDA events, L2 flushed before each rep; on CUDA each call replayed from a CUDA graph, as decode runs
it, so the host's launch time is not in it), the GB/s of blocks it reads, the current path
(dequantize into a bf16 buffer + F.linear) and the relative error against float64. Then one whole
layer (its 4 launches) eager and replayed from a CUDA graph, and what that makes per token.

    python bench/gemv.py                       # IQ3_S and Q8_0 at llama-3-70b shapes, M=1 and 4 (CUDA)
    python bench/gemv.py --types IQ3_S --iq3s float,dp4a,dp4a-table   # IQ3_S's kernels side by side
    python bench/gemv.py --types Q6_K --q6k bytes,words,dp4a   # Q6_K's kernels side by side
    python bench/gemv.py --types Q4_K,Q5_K --kquant bytes,words,dp4a   # Q4_K/Q5_K's kernels side by side
    python bench/gemv.py --preset gpt-oss-20b --types Q8_0 --q8-0 bytes,dp4a --m 1 --sweep   # Q8_0's, and shapes
    python bench/gemv.py --sweep               # also try launch shapes per matrix (pick CONFIGS from it)
    python bench/gemv.py --preset gemma-3-27b --types Q6_K,Q4_K --m 1 --splits 1,2,4,8   # split-K per matrix
    TRITON_INTERPRET=1 python bench/gemv.py --smoke    # tiny shapes on the CPU, through the interpreter
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strata import quant  # noqa: E402
from strata.models.args import PRESETS  # noqa: E402
from strata.models.resident import Packed  # noqa: E402
from strata.quant import gemv  # noqa: E402

SWEEP = [gemv.Config(bn, sb, w) for bn in (4, 8, 16, 32) for sb in (1, 2, 4) for w in (4, 8)]  # ~1 s to compile each
# the dp4a IQ3_S kernel: 8 * sb sub-blocks of a row side by side, block_n raised to fill the warps
DP4A_SWEEP = [gemv.Config(bn, sb, w) for bn in (1, 4, 16) for sb in (1, 2, 4, 8) for w in (1, 2, 4, 8)]
# Q6_K's word kernels (--q6k words, dp4a): [block_n rows, sb block pairs, 32 words] tiles
Q6K_SWEEP = [gemv.Config(bn, sb, w) for bn in (1, 2, 4, 8, 16) for sb in (1, 2, 4, 8) for w in (4, 8)]

# Q4_K/Q5_K's word kernels (--kquant words, dp4a): [block_n rows, sb blocks, 4 quarters, 8 words] tiles
KQ_SWEEP = [gemv.Config(bn, sb, w) for bn in (1, 2, 4, 8, 16) for sb in (2, 4, 8, 16) for w in (4, 8)]
# Q8_0's dp4a kernel (--q8-0 dp4a): [block_n rows, sb blocks, 8 words] tiles
Q8_SWEEP = [gemv.Config(bn, sb, w) for bn in (4, 8, 16) for sb in (4, 8) for w in (2, 4, 8)]


def mats(preset: str, smoke: bool) -> list[tuple[str, list[tuple[int, int]]]]:
    """(label, [(rows, cols) of each part]) as decode launches them."""
    if smoke:
        return [("qkv", [(64, 512), (16, 512), (16, 512)]), ("w_down", [(40, 768)]), ("head", [(72, 512)])]
    a = PRESETS[preset]
    q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    return [("qkv", [(q, a.dim), (kv, a.dim), (kv, a.dim)]), ("wo", [(a.dim, q)]),
            ("gate_up", [(a.ffn_dim, a.dim), (a.ffn_dim, a.dim)]), ("w_down", [(a.dim, a.ffn_dim)]),
            ("head", [(a.vocab_size, a.dim)])]


class Timer:
    """Median seconds of fn: CUDA events around each rep with L2 flushed before it; wall clock on the CPU."""

    def __init__(self, device: torch.device, reps: int):
        self.cuda, self.reps = device.type == "cuda", reps
        self.flush = torch.empty(512 << 20, dtype=torch.uint8, device=device) if self.cuda else None

    def __call__(self, fn) -> float:
        fn()
        out = []
        for _ in range(self.reps):
            if self.cuda:
                self.flush.zero_()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                out.append(a.elapsed_time(b) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
        return statistics.median(out)

    def graphed(self, fn):
        """fn captured in a CUDA graph (after one eager call: compiles, allocates), as a replay; fn on the CPU."""
        if not self.cuda:
            return fn
        fn()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph.replay


MODE_FIELD = {"IQ3_S": "iq3s", "Q6_K": "q6k", "Q4_K": "kquant", "Q5_K": "kquant", "Q8_0": "q8_0"}


def kernels_for(qtype: str, mode: str | None) -> gemv.GemvKernels:
    """The kernels with IQ3_S's, Q6_K's or Q4_K/Q5_K's set to `mode` (passed to each call, as a model passes its
    own); None: the type has one kernel."""
    return gemv.GemvKernels(**({} if mode is None else {MODE_FIELD[qtype]: mode}))


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm())


def bench_type(qtype: str, shapes, ms: list[int], timer: Timer, device, sweep: bool, dtype,
               modes: list[str | None], splits: list[int] = ()) -> dict:
    """Per matrix and M, each kernel of `modes` (IQ3_S's gemv.IQ3S_KERNELS; [None] for other types).
    Returns {mode: [(parts, cols) of one layer]}."""
    g = torch.Generator(device=device).manual_seed(0)
    layer = []
    for label, parts in shapes:
        cols = parts[0][1]
        blocks = [quant.random_blocks(qtype, r, cols, g, device=device) for r, _ in parts]
        rows = sum(r for r, _ in parts)
        nbytes = sum(b.numel() for b in blocks)
        packed = [(b, qtype) for b in blocks]
        w = torch.cat([quant.dequantize(b, qtype) for b in blocks])
        buf = torch.empty(rows, cols, device=device, dtype=dtype)
        pk = [Packed(b, qtype, cols, dtype) for b in blocks]

        def current(x):
            r0 = 0
            for p in pk:  # what ResidentMatrices.get + F.linear do per token today
                p.into(buf[r0:r0 + p.n_rows])
                r0 += p.n_rows
            return F.linear(x, buf)

        for m in ms:
            x = torch.randn(m, cols, generator=g, device=device).to(dtype)
            want = x.double() @ w.double().T
            tc = timer(lambda: current(x)) if m == 1 else float("nan")
            for mode in modes:
                k = kernels_for(qtype, mode)
                y = gemv.quant_matmul_parts(x, packed, cols, kernels=k)
                t = timer(timer.graphed(lambda: gemv.quant_matmul_parts(x, packed, cols, kernels=k)))
                err = rel(y, want)
                name = qtype if mode is None else f"{qtype}/{mode}"
                if qtype == "IQ3_S" and k.iq3s != mode:
                    name += "->" + k.iq3s  # it failed and fell back (see the warning)
                print(f"{name:16s} {label:8s} {rows:>6d}x{cols:<6d} M={m}  {t * 1e6:9.1f} us  {nbytes / t / 1e9:7.0f} GB/s"
                      f"  current {tc * 1e6:9.1f} us  x{tc / t:6.1f}  rel err {err:.1e}")
                if splits and m == ms[0] and mode in ("words", "dp4a") and qtype in ("Q6_K", "Q4_K", "Q5_K"):
                    big = rows >= gemv.BIG_ROWS  # the launch's own shape, cut among `split` programs a row
                    base = (gemv.Q6K_WORDS_CONFIGS[mode][big] if qtype == "Q6_K"
                            else gemv.KQ_BIG if big else gemv.KQ_WORDS)
                    times = []
                    for sp in splits:
                        cfg = dataclasses.replace(base, split=sp)
                        ys = gemv.quant_matmul_parts(x, packed, cols, config=cfg, kernels=k)
                        ts = timer(timer.graphed(lambda: gemv.quant_matmul_parts(x, packed, cols, config=cfg,
                                                                                  kernels=k)))
                        times.append(f"{sp}: {ts * 1e6:.1f} us ({rel(ys, want):.1e})")
                    print(f"{'':26s} {base} split " + ", ".join(times))
                if sweep and m == ms[0]:
                    best = None
                    sweep_cfgs = SWEEP
                    if qtype == "IQ3_S" and mode.startswith("dp4a"):
                        sweep_cfgs = DP4A_SWEEP
                    elif qtype == "Q6_K" and mode != "bytes":
                        sweep_cfgs = Q6K_SWEEP
                    elif qtype in ("Q4_K", "Q5_K") and mode != "bytes":
                        sweep_cfgs = KQ_SWEEP
                    elif qtype == "Q8_0" and mode == "dp4a":
                        sweep_cfgs = Q8_SWEEP
                    for cfg in sweep_cfgs:
                        ts = timer(timer.graphed(lambda: gemv.quant_matmul_parts(x, packed, cols, config=cfg,
                                                                                  kernels=k)))
                        if best is None or ts < best[0]:
                            best = (ts, cfg)
                    print(f"{'':26s} best launch shape {best[1]}: {best[0] * 1e6:.1f} us, {nbytes / best[0] / 1e9:.0f} GB/s")
        if label != "head":
            layer.append((packed, cols))
        del w  # buf stays bound: current() closes over it
    return layer


def bench_layer(qtype: str, layer, head_s: float | None, timer: Timer, device, n_layers: int, dtype,
                kernels: gemv.GemvKernels) -> None:
    """One layer's 4 launches at M=1 (with `kernels`), eager and from a CUDA graph (no launch overhead)."""
    xs = [torch.randn(1, cols, device=device).to(dtype) for _, cols in layer]

    def step():
        for (packed, cols), x in zip(layer, xs):
            gemv.quant_matmul_parts(x, packed, cols, kernels=kernels)

    eager = timer(step)
    line = f"{qtype:16s} one layer (4 launches) eager {eager * 1e6:8.1f} us"
    if device.type == "cuda":
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        replay = timer(graph.replay)
        line += f", graph {replay * 1e6:8.1f} us; x{n_layers} layers: {n_layers * replay * 1e3:.2f} ms / token"
        if head_s is not None:
            line += f" (+ head {head_s * 1e3:.2f} ms)"
    print(line)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama-3-70b")
    ap.add_argument("--types", default=",".join(gemv.CONFIGS))
    ap.add_argument("--m", default="1,4", help="x rows, comma-separated")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--iq3s", default=",".join(gemv.IQ3S_KERNELS), help="IQ3_S kernels to compare (gemv.IQ3S_KERNELS)")
    ap.add_argument("--q6k", default=gemv.GemvKernels.q6k, help="Q6_K kernels to compare (gemv.Q6K_KERNELS)")
    ap.add_argument("--kquant", default=gemv.GemvKernels.kquant, help="Q4_K/Q5_K kernels to compare (gemv.KQUANTS)")
    ap.add_argument("--q8-0", default=gemv.GemvKernels.q8_0, help="Q8_0 kernels to compare (config.Q8_0_KERNELS)")
    ap.add_argument("--sweep", action="store_true", help="also time every launch shape in SWEEP (dp4a: DP4A_SWEEP)")
    ap.add_argument("--splits", default="", help="word kernels: also time the default launch shape cut among these "
                    "split-K programs, e.g. 1,2,4,8 (Config.split)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU under TRITON_INTERPRET=1)")
    a = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not a.smoke else "cpu")
    if not gemv.available(device):
        print("needs CUDA, or TRITON_INTERPRET=1 with --smoke", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    timer = Timer(device, 3 if a.smoke else a.reps)
    ms = [int(m) for m in a.m.split(",")]
    shapes = mats(a.preset, a.smoke)
    n_layers = PRESETS[a.preset].n_layers
    if device.type == "cuda":
        print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, triton {gemv.triton.__version__}")
    iq3s = a.iq3s.split(",")
    for mode in iq3s:
        if mode not in gemv.IQ3S_KERNELS:
            print(f"--iq3s: {mode!r} is not one of {', '.join(gemv.IQ3S_KERNELS)}", file=sys.stderr)
            return 2
    for qtype in a.types.split(","):
        modes = {"IQ3_S": iq3s, "Q6_K": a.q6k.split(","), "Q4_K": a.kquant.split(","),
                 "Q5_K": a.kquant.split(","), "Q8_0": a.q8_0.split(",")}.get(qtype, [None])
        layer = bench_type(qtype, shapes, ms, timer, device, a.sweep, dtype, modes,
                           [int(v) for v in a.splits.split(",")] if a.splits else [])
        for mode in modes:
            bench_layer(qtype if mode is None else f"{qtype}/{mode}", layer, None, timer, device, n_layers, dtype,
                        kernels_for(qtype, mode))
    return 0


if __name__ == "__main__":
    sys.exit(main())
