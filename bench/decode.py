"""Model-level decode speed: per-token ms of one process's slice, one token at a time after a context.

Modes: prefill-path (forward(decode=False): the chunk path with T=1, what decode cost before),
fast (the decode path), float16 / int8 / int4 (Transformer.set_decode_weights), graphs (CUDA graphs), token (what a
stage runs: `decode_token`, layers, head and argmax in one replay, the token read back). The KV cache
is filled with random keys/values for --context positions (decode time depends on the length,
not the values) unless --prefill. With --check, float16/int8/int4 are compared with the fast path on a real
prompt: max relative logit difference (teacher-forced) and whether --steps greedy tokens match.

    python bench/decode.py --model smollm2 --device cpu --threads 1 --context 2000 --steps 64
"""
from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strata.weights.checkpoint import load_stage, model_args  # noqa: E402
from strata.config import from_dict  # noqa: E402
from strata.decode.graphs import GraphedDecode  # noqa: E402
from strata.models.weight_only import WEIGHT_ONLY  # noqa: E402

# the rig's defaults with the environment's overrides (STRATA_CUDA_ATTENTION, the kernels' switches)
ENV = from_dict({})

TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
        "movable metal type, oil-based ink and a screw press adapted from wine making. Within decades, print "
        "shops spread across Europe, books became cheaper, and literacy rose. ")


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


@functools.cache
def graphed(m) -> GraphedDecode:
    """The slice's CUDA graphs, one set for every run of it (the warm-up's captures serve the timed steps)."""
    return GraphedDecode(m)


def run_steps(m, dev, pos: int, steps: int, first, greedy: bool, mode: str) -> tuple[list[float], list[int], list]:
    """steps one-token calls from pos; returns (seconds of each step, greedy ids, logits rows)."""
    x, ids, logits, times = first, [], [], []
    decode = mode != "prefill-path"
    step = graphed(m) if mode in ("graphs", "token") else m  # what runs the steps
    sync(dev)
    for i in range(steps):
        t0 = time.perf_counter()
        if mode == "token":  # what a stage runs: one replay gives residual, logits and argmax
            h, lg, am = step.decode_token(x, pos + i, fresh=False)
            if m.has_head:
                ids.append(int(am))
                logits.append(lg)
            x = (torch.tensor([[ids[-1] if greedy else (pos + i) % m.args.vocab_size]], device=dev)
                 if m.has_embed else h)
            sync(dev)
            times.append(time.perf_counter() - t0)
            continue
        h = step(x, pos + i, decode=decode)
        if m.has_head:
            lg = m.logits(h[0, -1], decode=True)
            tok = int(lg.argmax())
            ids.append(tok)
            logits.append(lg)
        else:
            tok = None
        if m.has_embed:
            x = torch.tensor([[tok if greedy and tok is not None else (pos + i) % m.args.vocab_size]], device=dev)
        else:
            x = h
        sync(dev)
        times.append(time.perf_counter() - t0)
    return times, ids, logits


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="default float32 on CPU, bfloat16 on CUDA")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layers", default=None, help="slice start:end (default all)")
    ap.add_argument("--context", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--modes", default=None, help="comma list (default: all that apply)")
    ap.add_argument("--weights", default="auto", help="dequantized | resident | auto")
    ap.add_argument("--kv-dtype", default="auto", help="KV cache dtype (auto = the compute dtype)")
    ap.add_argument("--prefill", action="store_true", help="fill the context by a real prefill (slow on CPU)")
    ap.add_argument("--profile", action="store_true", help="CUDA time per kernel kind of the steps (modes fast, graphs, token)")
    ap.add_argument("--check", action="store_true", help="float16/int8/int4 logits and greedy tokens vs the fast path")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    dtype = getattr(torch, a.dtype or ("bfloat16" if dev.type == "cuda" else "float32"))
    args = model_args(a.model)
    start, end = (int(v) for v in a.layers.split(":")) if a.layers else (0, args.n_layers)
    t = time.perf_counter()
    m = load_stage(a.model, args, start, end, device=dev, dtype=dtype, weights=a.weights,
                   max_len=max(a.context, 400) + a.steps + 1, kv_dtype=a.kv_dtype,
                   kernels=ENV.kernels, attention=ENV.attention)  # --check: a ~200-token prompt
    print(f"{a.model} layers [{start}, {end}) on {dev} {dtype}, {a.threads} thread(s): loaded in "
          f"{time.perf_counter() - t:.2f} s; context {a.context}, {a.steps} steps")
    g = torch.Generator().manual_seed(0)
    if a.prefill and m.has_embed:
        ids = torch.randint(0, args.vocab_size, (1, a.context), generator=g).to(dev)
        for p in range(0, a.context, 512):
            m(ids[:, p:p + 512], p)
    else:
        for blk in m.layers.values():
            for c in (blk.attn.k_cache, blk.attn.v_cache):
                c[:, :, :a.context].copy_(torch.randn(c[:, :, :a.context].shape, generator=g).clamp(-4, 4))
    first = (torch.tensor([[1]], device=dev) if m.has_embed
             else torch.randn(1, 1, args.dim, generator=g).to(dev, dtype))
    modes = a.modes.split(",") if a.modes else (
        ["prefill-path", "fast"] + (["graphs", "token"] if dev.type == "cuda" else ["float16", "int8", "int4"]))
    base = None
    for mode in modes:
        if mode in WEIGHT_ONLY:
            extra = m.set_decode_weights(mode)
        else:
            m.set_decode_weights(None)
            extra = 0
        run_steps(m, dev, a.context, 2, first, False, mode)  # warm-up (graph capture, kernels)
        times, _, _ = run_steps(m, dev, a.context, a.steps, first, False, mode)
        ms = statistics.median(times) * 1e3  # the median: robust to a shared machine's preemptions
        mean = sum(times) / len(times) * 1e3
        base = base or ms
        note = f" (+{extra / 2**20:.0f} MiB weight-only copies)" if extra else ""
        print(f"  {mode:13s} {ms:8.2f} ms/token median ({mean:.2f} mean)  {1e3 / ms:7.1f} tok/s  x{base / ms:.2f}{note}")
    m.set_decode_weights(None)
    if a.profile and dev.type == "cuda":
        for mode in [md for md in modes if md in ("fast", "graphs", "token")]:
            profile(m, dev, a.context, first, mode)
    if a.check and m.has_embed and m.has_head:
        check(m, a, dev)
    return 0


def profile(m, dev, pos: int, first, mode: str, steps: int = 8) -> None:
    """Kernel time of `steps` decode steps in `mode` (fast: eager; graphs: replays), by kind."""
    from torch.profiler import ProfilerActivity, profile as prof
    run_steps(m, dev, pos, 2, first, False, mode)
    with prof(activities=[ProfilerActivity.CUDA]) as p:
        run_steps(m, dev, pos, steps, first, False, mode)
    kinds: dict[str, float] = {}
    top: dict[str, float] = {}
    for e in p.events():
        if e.device_type.name != "CUDA":
            continue
        n = e.name.lower()
        kind = ("attention" if any(w in n for w in ("flash", "fmha", "attention", "_partial", "_merge")) else
                "gemm/gemv" if any(w in n for w in ("gemm", "gemv", "cutlass", "sm90", "xmma", "splitk")) else
                "copy" if "copy" in n or "memcpy" in n else "elementwise/other")
        us = e.device_time / steps
        kinds[kind] = kinds.get(kind, 0.0) + us
        top[e.name[:90]] = top.get(e.name[:90], 0.0) + us
    total = sum(kinds.values())
    print(f"  kernel time per step ({mode}, {steps} steps): {total / 1e3:.2f} ms")
    for k, us in sorted(kinds.items(), key=lambda kv: -kv[1]):
        print(f"    {k:18s} {us / 1e3:7.3f} ms  {us / total:5.1%}")
    for name, us in sorted(top.items(), key=lambda kv: -kv[1])[:12]:
        print(f"      {us:9.1f} us  {name}")


def check(m, a, dev) -> None:
    """Real prompt: greedy tokens and logits of float16/int8/int4 against the fast (dense) decode path."""
    from strata.text.tokenizer import Tokenizer
    ids = Tokenizer.for_model(a.model).encode(TEXT * 4)
    prompt = torch.tensor([ids], device=dev)
    n = prompt.shape[1]

    def greedy(kind):
        m.set_decode_weights(kind)
        h = m(prompt, 0, decode=False)
        first = torch.tensor([[int(m.logits(h[0, -1]).argmax())]], device=dev)
        _, toks, lg = run_steps(m, dev, n, a.steps, first, True, "fast")
        return [int(first)] + toks, lg

    ref, ref_lg = greedy(None)
    for kind in WEIGHT_ONLY:
        toks, _ = greedy(kind)
        # teacher-forced: the reference's tokens through this kind, logits compared row by row
        m.set_decode_weights(kind)
        worst = 0.0
        for i, tok in enumerate(ref[:-1]):
            lg = m.logits(m(torch.tensor([[tok]], device=dev), n + i)[0, -1], decode=True)
            worst = max(worst, float((lg - ref_lg[i]).abs().max() / ref_lg[i].abs().max()))
        same = next((i for i, (x, y) in enumerate(zip(ref, toks)) if x != y), None)
        print(f"  {kind}: max relative logit difference {worst:.2e}; greedy {len(ref)} tokens "
              f"{'identical' if same is None else f'differ from token {same}'}")
    m.set_decode_weights(None)


if __name__ == "__main__":
    sys.exit(main())
