"""A short chunk after a long cached prefix on one stage: a question asked again about a cached document (issue
29's re-ask, whose first token took 6.6-12 % of the document's cold prefill on H100s against a 5 % target). Where
does its time go: the host issuing the layers' launches, syncs that stall the host, or the GPU's kernels?

Loads the model (one stage, all layers, as the server's stage does), prefills --prefix tokens of random ids in
chunks of --chunk, then for each question length T runs that chunk at position --prefix and the head's last row,
--reps times (after one untimed run that builds any new shape), and prints per T and path (--paths: `prefill`,
the path a chunk of more than DECODE_T rows takes; `decode`, the decode rows path (RowsOps) forced: the products on the blocks,
no dequantization into the scratch, fused norms; its rounding differs, so only its time is of interest):
- wall ms: from the call to the end of the GPU's work (synchronized), the median;
- issued ms: from the call until it returned to the host (before the sync): near wall where the host is the bound;
- GPU busy ms: the kernels' summed time in one profiled run (CUDA only), and their count (copies and fills not
  counted);
- syncs: the host's waits for the device in that run (cudaStreamSynchronize / cudaDeviceSynchronize calls: an
  .item() or a copy to the host makes one), the profiler's own final one not counted.
The cuDNN split takes the prefix schedule's chunk shapes only (as a server's warm-up leaves it): a question, a shape
outside them, takes flash, as a re-ask does.
Then the profiled run's ops by host time, for the longest question, and its kernels by GPU time.

    python3 bench/short_chunk.py --model /tmp/8b-q4km.gguf --prefix 16384 --rows 24,40,57,73
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strata.kernels.attention import keep_cudnn_shapes  # noqa: E402
from strata.weights.checkpoint import load_stage, model_args  # noqa: E402

SYNC_OPS = ("cudaStreamSynchronize", "cudaDeviceSynchronize")


def run(model, ids: torch.Tensor, pos: int, decode: bool = False) -> torch.Tensor:
    h = model(ids, pos, decode=decode)
    return model.logits(h[0, -1])


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profiled(model, ids: torch.Tensor, pos: int, device: torch.device, decode: bool):
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        run(model, ids, pos, decode)
        sync(device)
    evs = prof.events()
    gpu = [e for e in evs if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.self_device_time_total for e in gpu) / 1e3
    kernels = sum(1 for e in gpu if not e.name.startswith(("Memcpy", "Memset")))
    syncs = sum(1 for e in evs if e.name in SYNC_OPS and e.device_type == torch.autograd.DeviceType.CPU)
    return busy, kernels, max(0, syncs - 1), prof


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a .gguf file, an HF directory or synthetic:PRESET[@QTYPE]")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--weights", default="auto", help="resident / dequantized / auto (the stage's default)")
    ap.add_argument("--prefix", type=int, default=16384)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--rows", default="24,40,57,73", help="question lengths, comma-separated")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--paths", default="prefill,decode", help="prefill and / or decode (see above)")
    ap.add_argument("--top", type=int, default=25, help="ops listed from the profiled run of the longest question")
    a = ap.parse_args()
    rows = [int(r) for r in a.rows.split(",")]
    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    args = model_args(a.model)
    max_len = a.prefix + max(rows + [a.chunk]) + 1
    t = time.perf_counter()
    model = load_stage(a.model, args, 0, args.n_layers, device=device, dtype=dtype, weights=a.weights,
                       max_len=max_len, max_chunk=max(a.chunk, *rows))
    print(f"{a.model}: {args.n_layers} layers on {device} ({a.weights}), loaded in {time.perf_counter() - t:.1f} s")
    keep_cudnn_shapes(model, [(p, min(a.chunk, a.prefix - p)) for p in range(a.chunk, a.prefix, a.chunk)]
                      + [(a.prefix, a.chunk)])
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab_size, (1, a.prefix + max(rows)), generator=g).to(device)
    with torch.inference_mode():
        t = time.perf_counter()
        for p in range(0, a.prefix, a.chunk):
            run(model, ids[:, p:min(a.prefix, p + a.chunk)], p)
        sync(device)
        print(f"prefix of {a.prefix:,} in chunks of {a.chunk:,}: {time.perf_counter() - t:.3f} s (builds included)")
        print("| rows | path | wall ms | issued ms | GPU busy ms | kernels | syncs |")
        print("|---:|---|---:|---:|---:|---:|---:|")
        prof = None
        for T in rows + [a.chunk]:
            q = ids[:, a.prefix:a.prefix + T] if T <= max(rows) else ids[:, :T]
            for path in a.paths.split(","):
                if path == "decode" and T > max(rows):
                    continue  # (a long chunk's path is the prefill's)
                decode = {"prefill": False, "decode": True}[path]
                run(model, q, a.prefix, decode)  # any new shape's build, untimed
                sync(device)
                walls, issued = [], []
                for _ in range(a.reps):
                    t0 = time.perf_counter()
                    run(model, q, a.prefix, decode)
                    t1 = time.perf_counter()
                    sync(device)
                    walls.append(time.perf_counter() - t0)
                    issued.append(t1 - t0)
                busy, n, syncs, p = profiled(model, q, a.prefix, device, decode)
                if T == max(rows) and prof is None:
                    prof = p
                print(f"| {T:,} | {path} | {statistics.median(walls) * 1e3:.2f} | "
                      f"{statistics.median(issued) * 1e3:.2f} | {busy:.2f} | {n} | {syncs} |", flush=True)
    if prof is not None and a.top:
        print(f"\nthe profiled run of {max(rows)} rows ({a.paths.split(',')[0]} path), by host time:")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.top, max_name_column_width=60))
        if device.type == "cuda":
            print("\nthe same run's kernels by GPU time:")
            print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=a.top,
                                            max_name_column_width=60))
    return 0


if __name__ == "__main__":
    sys.exit(main())
