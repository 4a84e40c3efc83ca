"""Decode through the stages: tok/s of `Pipeline.generate` after a short and after a long prompt.

One pipeline per setting (stages stay up across its prompts); greedy, `--tokens` generated per prompt.

    python bench/generate.py --model synthetic:llama-3-8b --devices cuda:0,cuda:1 --contexts 2048,32768 --tokens 128
    python bench/generate.py --model smollm2 --cpu-stages 2 --contexts 512 --tokens 64 --decode-weights none,int4
"""
from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strata.head.pipeline import Pipeline  # noqa: E402
from strata.text.sampling import SamplingParams  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--devices", help="comma-separated, one stage each")
    ap.add_argument("--cpu-stages", type=int, default=2, help="without --devices: CPU stages of one thread")
    ap.add_argument("--dtype", default="")
    ap.add_argument("--contexts", default="2048", help="prompt lengths (random ids), comma-separated")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--cuda-graphs", default="true", help="comma list of true/false (the rig's default: true)")
    ap.add_argument("--decode-weights", default="auto", help="comma list (CPU stages; auto: the rig's default)")
    ap.add_argument("--kv-dtype", default="auto", help="comma list: the KV cache dtype (auto: the compute dtype)")
    ap.add_argument("--ahead", default="auto", help="comma list: kernels.decode_ahead of each run (auto, 0: the A/B "
                    "of decode steps queued ahead behind GPU waits on the bells)")
    ap.add_argument("--llama-bench", help="also time llama.cpp's decode on the model's GGUF file, same contexts")
    ap.add_argument("--llama-gguf", help="the file llama-bench decodes (default: the model's own GGUF; for a "
                    "synthetic model, e.g. bench/make_gguf.py's F16 file of the same shape)")
    ap.add_argument("--llama-only", action="store_true", help="only the llama.cpp rows (Strata's came earlier in the "
                    "same device call)")
    ap.add_argument("--llama-threads", type=int, default=0, help="llama-bench -t (CPU; default: one per stage)")
    ap.add_argument("--json", help="also write the rows here (a list: Strata's and llama.cpp's, context and tok/s)")
    ap.add_argument("--llama-kv", default="f16", help="comma list: llama-bench's -ctk / -ctv of each llama.cpp row "
                    "(f16: its default; q8_0: its 8-bit cache, beside an 8-bit --kv-dtype)")
    a = ap.parse_args()
    stages = ([{"device": d} for d in a.devices.split(",")] if a.devices
              else [{"device": "cpu", "threads": 1}] * a.cpu_stages)
    dtype = a.dtype or ("bfloat16" if a.devices else "float32")
    contexts = [int(x) for x in a.contexts.split(",")]
    print(f"{a.model} {dtype}, stages {[s['device'] for s in stages]}, {a.tokens} tokens per prompt")
    print("| cuda_graphs | decode_weights | kv_dtype | ahead | context | decode tok/s | ms/token | outside the stages ms/token | ttft s |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|")
    import numpy as np
    rows: list[dict] = []  # (--json)
    runs = [(g, d, k, ah) for g in a.cuda_graphs.split(",") for d in a.decode_weights.split(",")
            for k in a.kv_dtype.split(",") for ah in a.ahead.split(",")]
    for graphs, dw, kv, ahead in ([] if a.llama_only else runs):
        cfg = dict(kv_dtype=kv, model=a.model, dtype=dtype, stages=stages, chunk=a.chunk, progress=False, perplexity=False,
                   max_context=max(contexts) + a.tokens + 1, cuda_graphs=graphs == "true", decode_weights=dw,
                   prompt={"random": {"tokens": 16, "seed": 0}},
                   kernels={"decode_ahead": {"auto": "auto", "0": False}[ahead]})
        with Pipeline(cfg, console=False) as p:
            vocab = p.plan.args.vocab_size
            for n in contexts:
                ids = np.random.default_rng(n).integers(0, vocab, n)
                res = p.generate(ids.tolist(), SamplingParams(max_tokens=a.tokens))
                r, toks = res.report, hashlib.md5(str(res.continuation_ids).encode()).hexdigest()[:12]
                print(f"| {graphs} | {dw} | {kv} | {ahead} | {n:,} | {r['decode_tok_s']:,.1f} | {1e3 / max(r['decode_tok_s'], 1e-9):.2f} "
                      f"| {r.get('decode_overhead_ms_per_token') or 0:.2f} | {r['ttft_s']:.3f} |", flush=True)
                rows.append(dict(arm="strata", cuda_graphs=graphs, decode_weights=dw, kv_dtype=kv, ahead=ahead,
                                 context=n, decode_tok_s=r["decode_tok_s"], ttft_s=r["ttft_s"],
                                 kv_bytes=[s.get("kv_bytes") for s in r["stages"]],
                                 peak_bytes=[s.get("peak_bytes") for s in r["stages"]],
                                 max_context=r.get("max_context")))
                steps = max(r.get("decode_steps") or 0, 1)
                print(f"    per token, ms: head {1e3 * r.get('decode_head_s', 0) / steps:.3f}; stages' work "
                      + ", ".join(f"{1e3 * (s.get('decode_work_s') or 0) / steps:.3f}" for s in r["stages"])
                      + "; stages' copies and notes " + ", ".join(f"{1e3 * (s.get('decode_copy_s') or 0) / steps:.3f}"
                                                              for s in r["stages"])
                      + f"; results by bell {r.get('decode_bell_steps', 0)} of {steps}; tokens' md5 {toks}", flush=True)
    if a.llama_bench:
        rows += llama_decode(a, stages, contexts)
    if a.json:
        import json
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


def llama_decode(a, stages, contexts) -> list[dict]:
    """llama-bench's generation speed on the same file after each context (`-d`), in the same run: its rows."""
    import json
    import subprocess
    from strata.weights.checkpoint import resolve
    kind, path = ("gguf", a.llama_gguf) if a.llama_gguf else resolve(a.model)
    if kind != "gguf":
        print(f"llama.cpp: needs a GGUF model, {a.model} is {kind}")
        return []
    rows = []
    for kv, n in ((kv, n) for kv in a.llama_kv.split(",") for n in contexts):
        cmd = [a.llama_bench, "-m", path, "-p", "0", "-n", str(a.tokens), "-d", str(n), "-r", "1", "-o", "json"]
        cmd += ["-ngl", "99", "-fa", "1"] + (["-sm", "layer"] if len(stages) > 1 else []) if a.devices else \
            ["-t", str(a.llama_threads or len(stages))]
        # a quantized V cache needs llama.cpp's flash attention (the CUDA rows have it already)
        cmd += ["-ctk", kv, "-ctv", kv] + (["-fa", "1"] if kv != "f16" and not a.devices else [])
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode:
            print(f"llama.cpp failed ({out.returncode}): {out.stderr[-500:]}")
            return rows
        ts = json.loads(out.stdout)[0]["avg_ts"]
        print(f"| llama.cpp | `{' '.join(cmd[3:])}` | - | - | {n:,} | {ts:,.1f} | {1e3 / ts:.2f} | - | - |", flush=True)
        rows.append(dict(arm="llama.cpp", kv_dtype=kv, context=n, decode_tok_s=ts, command=" ".join(cmd[1:])))
    return rows


if __name__ == "__main__":
    sys.exit(main())
