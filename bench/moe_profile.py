"""Where an MoE model's prefill time goes, one stage on one GPU: attention (its projections included), the
router, the experts' dequantization into the scratch, their grouped GEMMs, the rest of the MoE block (sorting
rows by expert, gathering and scattering them), the head and everything else.

Each part is wrapped (here, not in strata/) with a device synchronize before and after, so the parts add up to
the chunk's wall time; the syncs cost a little, so the total is a bit above an unwrapped run's.

    python bench/moe_profile.py --model /tmp/q30a3-q4km.gguf --tokens 122880 --chunk 10240
"""
from __future__ import annotations

import argparse
import collections
import functools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strata.models import model as model_mod
from strata.models import moe as moe_mod
from strata.models import resident  # noqa: E402
from strata.weights.checkpoint import load_stage, model_args  # noqa: E402
from strata.config import from_dict  # noqa: E402

# the rig's defaults with the environment's overrides (STRATA_CUDA_ATTENTION, the kernels' switches)
ENV = from_dict({})

SPENT: collections.Counter = collections.Counter()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(name: str, fn):
    """fn, its wall time (device synchronized) added to SPENT[name]; nested parts are subtracted from the outer."""
    @functools.wraps(fn)
    def run(*a, **k):
        sync()
        t = time.perf_counter()
        inner = sum(SPENT.values())
        out = fn(*a, **k)
        sync()
        SPENT[name] += time.perf_counter() - t - (sum(SPENT.values()) - inner)
        return out
    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=122880)
    ap.add_argument("--chunk", type=int, default=10240)
    ap.add_argument("--device", default="cuda:0")
    a = ap.parse_args()
    args = model_args(a.model)
    t = time.perf_counter()
    m = load_stage(a.model, args, 0, args.n_layers, device=a.device, dtype=torch.bfloat16, max_len=a.tokens,
                   max_chunk=a.chunk, kernels=ENV.kernels, attention=ENV.attention)
    print(f"loaded {a.model} in {time.perf_counter() - t:.1f} s: weights {m.weight_bytes / 2**30:.2f} GiB, scratch "
          f"{m.scratch_bytes / 2**30:.2f} GiB, kv {m.kv_bytes / 2**30:.2f} GiB", flush=True)
    patches = [(model_mod.Attention, "forward", "attention"), (moe_mod.MoE, "route", "router"),
               (resident.ResidentExperts, "group", "experts' dequantization"),
               (resident.ResidentMatrices, "get", "attention's dequantization"),
               (model_mod.Transformer, "logits", "head")]
    for cls, attr, name in patches:
        setattr(cls, attr, timed(name, getattr(cls, attr)))
    moe_mod._grouped_experts = timed("experts' grouped GEMMs", moe_mod._grouped_experts)
    moe_mod.MoE._grouped = timed("MoE sort / gather / scatter", moe_mod.MoE._grouped)
    ids = torch.randint(0, args.vocab_size, (1, a.tokens), generator=torch.Generator().manual_seed(0)).to(a.device)
    total = 0.0
    with torch.inference_mode():
        m(ids[:, :256], 0)  # warm-up (kernels built); its KV is overwritten by the first chunk
        SPENT.clear()
        for p in range(0, a.tokens, a.chunk):
            sync()
            t = time.perf_counter()
            h = m(ids[:, p:p + a.chunk], p)
            if p + a.chunk >= a.tokens:
                m.logits(h[0, -1:])
            sync()
            total += time.perf_counter() - t
    SPENT["other (norms, embedding, residual adds)"] = total - sum(SPENT.values())
    print(f"{a.tokens:,} tokens in chunks of {a.chunk:,}: {total:.2f} s ({a.tokens / total:,.1f} tok/s, parts "
          "device-synchronized)")
    print("| part | s | share |\n|---|---:|---:|")
    for name, s in SPENT.most_common():
        print(f"| {name} | {s:.2f} | {s / total:.1%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
