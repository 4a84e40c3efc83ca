"""Aggregate decode tok/s of `launcher.py --serve`'s server with 1 and 4 concurrent streams, max_seqs 1 vs 4.

Each arm starts the server (uvicorn in a thread, PipelineEngine over the rig's stages) on a loopback port, sends one
warm-up request, then `--streams` chat requests at once through the real openai client (httpx without it), greedy,
`--tokens` each. Printed per arm: completion tokens over the wall time from the first request to the last answer
(the prompts are short: that time is nearly all decode), and the driver's most sequences in flight (max_seqs > 1).

    python bench/serve_concurrency.py                       # SmolLM2 on 2 CPU stages of one thread each
    python bench/serve_concurrency.py --tokens 128 --threads 2
"""
from __future__ import annotations

import argparse
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strata.engine import PipelineEngine  # noqa: E402
from strata.server import make_uvicorn  # noqa: E402

QUESTIONS = ["Tell me a long story about a dragon.", "Explain how a steam engine works.",
             "Write a poem about the sea.", "Describe the city of Paris in detail."]


def ask(url: str, question: str, tokens: int) -> int:
    """One chat request; -> completion tokens."""
    try:
        import openai
    except ImportError:
        import httpx
        r = httpx.post(url + "/v1/chat/completions", timeout=600, json={
            "messages": [{"role": "user", "content": question}], "max_tokens": tokens, "temperature": 0})
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    r = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": question}],
                                       max_tokens=tokens, temperature=0)
    return r.usage.completion_tokens


def arm(rig: dict, max_seqs: int, streams: list[int], tokens: int, out: Path) -> list[tuple]:
    eng = PipelineEngine({**rig, "max_seqs": max_seqs}, out=out / f"seqs{max_seqs}")
    uv, _ = make_uvicorn(eng, log_level="warning", queue_size=16)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    server.start()
    while not uv.started:
        time.sleep(0.05)
    rows = []
    try:
        ask(url, "Hello", 4)  # warm-up: the first request's one-time costs are not decode
        for n in streams:
            counts = [0] * n
            t0 = time.perf_counter()
            threads = [threading.Thread(target=lambda i=i: counts.__setitem__(
                i, ask(url, QUESTIONS[i % len(QUESTIONS)], tokens))) for i in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
            st = eng.slot_stats()
            rows.append((max_seqs, n, sum(counts), wall, st.most_in_flight if st else 1))
    finally:
        uv.should_exit = True
        server.join(120)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--stages", type=int, default=2, help="CPU stages")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per CPU stage")
    ap.add_argument("--tokens", type=int, default=64, help="max_tokens of each request (greedy; EOS may end one early)")
    ap.add_argument("--streams", default="1,4", help="concurrent requests of each measurement, comma-separated")
    ap.add_argument("--max-seqs", default="1,4", help="the arms' max_seqs, comma-separated")
    ap.add_argument("--max-context", type=int, default=1024)
    a = ap.parse_args()
    rig = dict(model=a.model, stages=[{"device": "cpu", "threads": a.threads}] * a.stages,
               max_context=a.max_context, progress=False)
    streams = [int(x) for x in a.streams.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="serve-concurrency-") as tmp:
        for m in [int(x) for x in a.max_seqs.split(",")]:
            rows += arm(rig, m, streams, a.tokens, Path(tmp))
    print(f"\n{a.model}, {a.stages} CPU stages x {a.threads} thread(s), {a.tokens} tokens a request, greedy")
    print(f"{'max_seqs':>8} {'streams':>7} {'tokens':>7} {'wall s':>8} {'agg tok/s':>10} {'most in flight':>15}")
    base = {}
    for m, n, toks, wall, most in rows:
        rate = toks / wall if wall > 0 else 0.0
        base.setdefault(n, rate)
        print(f"{m:>8} {n:>7} {toks:>7} {wall:>8.2f} {rate:>10.2f} {most:>15}   x{rate / base[n]:.2f} vs max_seqs "
              f"{rows[0][0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
