"""Documents asked about again on a GPU stage: the prefix cache's host tier against its device tier (issue 29).

Four documents of random ids (one stage, one sequence: the live KV holds one prompt), each prefilled cold, then
each asked about again in turn with a short question after it: the again's time to its first token against its
cold one (target: <= 5 %), with the blocks restored from pinned host memory (prefix_cache_device_bytes 0) and
from the stage's device memory (the tier sized to hold every document). The two arms give the same ids (the rows
are the same bytes; printed as a check). Each arm is a Pipeline of its own, in this process.

    python bench/prefix_tiers.py --model /tmp/8b-q4km.gguf --tokens 32768
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strata.weights.checkpoint import model_args  # noqa: E402
from strata.head.pipeline import Pipeline  # noqa: E402
from strata.text.sampling import SamplingParams  # noqa: E402

QUESTION = 24  # ids after a document when it is asked about again (prefilled: not in the cache)


def arm(args, device_bytes: int, docs: list[np.ndarray], questions: list[np.ndarray], out: Path) -> list[dict]:
    block_bytes = args.block_bytes
    dtype = "float32" if all(d == "cpu" for d in args.devices.split(",")) else "bfloat16"  # (CPU: a sanity run)
    rig = dict(model=args.model, dtype=dtype, stages=[{"device": d} for d in args.devices.split(",")],
               chunk=args.chunk, max_context=args.tokens + max(len(q) for q in questions) + args.new + 64, progress=False,
               prefix_cache_bytes=len(docs) * (args.tokens // 256 + 1) * block_bytes,
               prefix_cache_device_bytes=device_bytes, prompt={"random": {"tokens": 8, "seed": 0}})
    greedy = SamplingParams(max_tokens=args.new, temperature=0)
    rows = []
    with Pipeline(rig, out=out, console=False) as p:
        p.start()
        cold = [p.generate(d, greedy) for d in docs]
        prof = None
        if args.profile and device_bytes:  # where the head's time of the device arm's re-asks goes
            import cProfile
            prof = cProfile.Profile()
            prof.enable()
        again = [p.generate(np.concatenate([d, q]), greedy) for d, q in zip(docs, questions)]
        if prof is not None:
            import pstats
            prof.disable()
            pstats.Stats(prof).sort_stats("cumulative").print_stats(18)
        st = p.prefix_cache_stats()
        print(f"{'device' if device_bytes else 'host'} arm: device tier {st.device_blocks} blocks held, "
              f"{st.device_hits} restored from it; the host tier {st.blocks} of {st.capacity_blocks} blocks", flush=True)
        for i, (c, a) in enumerate(zip(cold, again)):
            rows.append(dict(doc="ABCDEFGH"[i], cold=c.ttft_s, again=a.ttft_s, reused=a.reused_tokens,
                             ids=list(a.continuation_ids)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--devices", default="cuda:0", help="stage devices, comma-separated")
    ap.add_argument("--tokens", type=int, default=32768, help="tokens of each document")
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--new", type=int, default=4, help="tokens generated each time")
    ap.add_argument("--block-bytes", type=int, default=32 << 20,
                    help="bytes of a block of 256 positions on the largest stage (an 8B's bf16 KV: 32 MiB)")
    ap.add_argument("--questions", default=str(QUESTION),
                    help="ids after each document when it is asked again, comma-separated, one per document or one "
                         "for all (lengths that differ meet new attention shapes: cuDNN builds a graph per shape)")
    ap.add_argument("--arms", default="host,device", help="host, device or both: where the blocks are restored from")
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", action="store_true", help="cProfile the head during the device arm's re-asks, "
                    "and print the stage logs' restore and chunk lines")
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="prefix-tiers-"))
    rng = np.random.default_rng(0)
    vocab = model_args(args.model).vocab_size
    docs = [rng.integers(0, vocab, args.tokens).astype(np.int32) for _ in range(args.docs)]
    lengths = [int(x) for x in args.questions.split(",")]
    lengths = lengths * args.docs if len(lengths) == 1 else lengths
    if len(lengths) != args.docs or min(lengths) < 1:
        sys.exit(f"--questions: one length >= 1, or {args.docs} of them")
    questions = [rng.integers(0, vocab, q).astype(np.int32) for q in lengths]
    tier = args.docs * (args.tokens // 256 + 1) * args.block_bytes
    got = {}
    for name, device_bytes in (("host", 0), ("device", tier)):
        if name not in args.arms.split(","):
            continue
        got[name] = arm(args, device_bytes, docs, questions, out / name)
    print(f"{args.docs} documents of {args.tokens:,} tokens, then each again with {args.questions} ids more; "
          f"device tier {tier / 2**30:.1f} GiB")
    print("| tier | doc | cold ttft s | again ttft s | of cold | reused |")
    print("|---|---|---|---|---|---|")
    for name, rows in got.items():
        for r in rows:
            print(f"| {name} | {r['doc']} | {r['cold']:.3f} | {r['again']:.4f} | {100 * r['again'] / r['cold']:.2f} % "
                  f"| {r['reused']:,} |")
    if args.profile:
        for log in sorted(out.glob("*/stage-*.log")):
            lines = [x.rstrip() for x in log.read_text().splitlines()
                     if "restored in" in x or "snapped in" in x or "prefill" in x]
            print(f"{log}:", *lines[-24:], sep="\n  ")
    if len(got) == 2:
        same = all(h["ids"] == d["ids"] for h, d in zip(got["host"], got["device"]))
        print(f"the same ids from both tiers: {same}")


if __name__ == "__main__":
    main()
