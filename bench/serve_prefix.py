"""Time to first token of documents asked about again (issue 29's prefix-cache targets), SmolLM2 on CPU stages.

1. Four documents (slices of Python's typing module, ~1,500 tokens each) asked about in turn, A B C D A B C D,
   through `launcher.py --serve`'s server and the real openai client (streamed, greedy, 8 tokens): each repeat's
   time to its first token against its cold one (target: <= 5 %), and the cached tokens the server reports.
2. A document's KV saved by one process (`kv_save` after its cold prefill) and loaded by another (`kv_load`, a new
   Python process with its own stages): the loaded one's time to first token against the cold prefill's.
3. The prefix cache's disk tier (`kv_cache_dir`): a server asks about four documents once each (cold), is closed,
   and a new server (new stage processes, the same folder) asks about them again: each one's time to its first
   token against its cold one, and the cached tokens the server reports.

    python bench/serve_prefix.py                      # max_seqs 1
    python bench/serve_prefix.py --max-seqs 4         # the same through the slot driver (part 2 needs max_seqs 1)
    python bench/serve_prefix.py --skip-alternating --skip-kv-file    # part 3 alone
"""
from __future__ import annotations

import argparse
import inspect
import json
import subprocess
import sys
import tempfile
import time
import typing
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strata.serve.engine import PipelineEngine  # noqa: E402
from strata.text.sampling import SamplingParams  # noqa: E402
from serve_concurrency import served  # noqa: E402 - the same server in a thread

QUESTION = "\n\nQ: What does this code define?\nA:"


def documents(n: int, chars: int) -> list[str]:
    src = inspect.getsource(typing)
    return [src[i * chars:(i + 1) * chars] + QUESTION for i in range(n)]


def rig(args) -> dict:
    return dict(model="smollm2", stages=[{"device": "cpu", "threads": args.threads}] * args.stages, chunk=256,
                max_context=args.max_context, progress=False, max_seqs=args.max_seqs)


def first_token(client, prompt: str) -> tuple[float, int, int]:
    """(seconds to the first streamed text, prompt tokens, cached tokens) of one greedy completion."""
    t0, first, usage = time.perf_counter(), None, None
    for c in client.completions.create(model="smollm2", prompt=prompt, max_tokens=8, temperature=0, stream=True,
                                       stream_options={"include_usage": True}):
        if first is None and c.choices and c.choices[0].text:
            first = time.perf_counter() - t0
        if c.usage is not None:
            usage = c.usage
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return first if first is not None else float("nan"), usage.prompt_tokens, cached


def alternating(args, out: Path) -> None:
    import openai
    eng = PipelineEngine(rig(args), out=out / "serve")
    with served(eng) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
        first_token(client, "Hello")  # warm-up
        docs = documents(4, args.chars)
        rows = [(name, *first_token(client, d)) for name, d in zip("ABCDABCD", docs + docs)]
    print(f"\n1. four documents in turn, max_seqs {args.max_seqs}, {args.stages} CPU stages x {args.threads} thread(s)")
    print(f"{'doc':>4} {'prompt':>7} {'cached':>7} {'first token s':>14} {'of cold':>8}")
    cold = {}
    for name, t, n, cached in rows:
        cold.setdefault(name, t)
        print(f"{name:>4} {n:>7} {cached:>7} {t:>14.3f} {t / cold[name]:>7.1%}")


def load_side(args) -> None:
    """In a new process: load the KV file, then the same prompt's first token (and the ids it made)."""
    eng = PipelineEngine(rig(args), out=Path(args.out) / "load")
    try:
        ids = eng.tokenize(documents(1, args.chars)[0])
        eng.generate(eng.tokenize("Hello"), SamplingParams(max_tokens=1), lambda t: None)  # warm-up
        t0 = time.perf_counter()
        eng.kv_load(args.load)
        t_load = time.perf_counter() - t0
        made, stamps = [], []
        t0 = time.perf_counter()
        eng.generate(ids, SamplingParams(max_tokens=8), lambda t: made.append(t) or stamps.append(time.perf_counter()))
        print(json.dumps({"load_s": t_load, "first_s": stamps[0] - t0, "ids": made}))
    finally:
        eng.close()


def kv_files(args, out: Path) -> None:
    args_one = argparse.Namespace(**{**vars(args), "max_seqs": 1})
    eng = PipelineEngine(rig(args_one), out=out / "save")
    path = out / "doc.kv"
    try:
        ids = eng.tokenize(documents(1, args.chars)[0])
        eng.generate(eng.tokenize("Hello"), SamplingParams(max_tokens=1), lambda t: None)  # warm-up
        made, stamps = [], []
        t0 = time.perf_counter()
        eng.generate(ids, SamplingParams(max_tokens=8), lambda t: made.append(t) or stamps.append(time.perf_counter()))
        cold = stamps[0] - t0
        t0 = time.perf_counter()
        eng.kv_save(path)
        t_save = time.perf_counter() - t0
    finally:
        eng.close()
    r = subprocess.run([sys.executable, __file__, "--load", str(path), "--out", str(out), "--chars", str(args.chars),
                        "--stages", str(args.stages), "--threads", str(args.threads),
                        "--max-context", str(args.max_context)], capture_output=True, text=True, timeout=1200)
    if r.returncode:
        raise SystemExit(f"the load process failed:\n{r.stderr[-2000:]}")
    got = json.loads(r.stdout.strip().splitlines()[-1])
    print(f"\n2. a KV file: saved by one process, loaded by another ({len(ids)} prompt tokens, {path.stat().st_size:,} "
          f"bytes)")
    print(f"cold prefill to first token {cold:.3f} s; kv_save {t_save:.3f} s | new process: kv_load {got['load_s']:.3f} s,"
          f" first token {got['first_s']:.3f} s = {got['first_s'] / cold:.1%} of cold; "
          f"same 8 ids as cold: {got['ids'] == made}")


def disk_tier(args, out: Path) -> None:
    import openai
    cfg = dict(rig(args), kv_cache_dir=str(out / "kv-cache"))
    docs = documents(4, args.chars)
    rows = []
    for run in ("first server", "a new server"):
        eng = PipelineEngine(cfg, out=out / f"disk-{len(rows)}")
        try:
            with served(eng) as url:
                client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
                first_token(client, "Hello")  # warm-up
                rows += [(run, name, *first_token(client, d)) for name, d in zip("ABCD", docs)]
        finally:
            eng.close()
    print(f"\n3. the disk tier: four documents, then a new server on the same kv_cache_dir, max_seqs {args.max_seqs}")
    print(f"{'server':>13} {'doc':>4} {'prompt':>7} {'cached':>7} {'first token s':>14} {'of cold':>8}")
    cold = {}
    for run, name, t, n, cached in rows:
        cold.setdefault(name, t)
        print(f"{run:>13} {name:>4} {n:>7} {cached:>7} {t:>14.3f} {t / cold[name]:>7.1%}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-seqs", type=int, default=1)
    ap.add_argument("--max-context", type=int, default=2048)
    ap.add_argument("--chars", type=int, default=5500, help="characters of each document (~1,500 tokens)")
    ap.add_argument("--skip-alternating", action="store_true", help="leave out part 1 (alternating documents)")
    ap.add_argument("--skip-kv-file", action="store_true", help="leave out part 2 (a KV file)")
    ap.add_argument("--load", help=argparse.SUPPRESS)  # the load side's process
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.load:
        load_side(args)
        return 0
    with tempfile.TemporaryDirectory(prefix="serve-prefix-") as tmp:
        if not args.skip_alternating:
            alternating(args, Path(tmp))
        if not args.skip_kv_file:
            kv_files(args, Path(tmp))
        disk_tier(args, Path(tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
