"""Aggregate decode tok/s of `launcher.py --serve`'s server with concurrent streams, beside llama.cpp's
`llama-batched-bench` on the same GGUF file with as many threads as the stages have, in the same run.

Each arm starts the server (uvicorn in a thread, PipelineEngine over the rig's stages) on a loopback port, sends one
warm-up request, then `--streams` chat requests at once through the real openai client (httpx without it), greedy,
`--tokens` each. Printed per arm: completion tokens over the wall time from the first request to the last answer
(the prompts are short: that time is nearly all decode), the driver's most sequences in flight and in one decode
batch, and a decode batch's mean round in ms (max_seqs > 1) once every stream had its first token: its trip from
send to result (the stages' work, copies and notes; with batch_ahead, its steps ahead too) and the head's turnaround
before it (from the results it took last to its send).
The peer's row: its B x TG generated tokens over its whole time (prompts, then decode: as ours), and its decode-only
rate (S_TG), with -npp the prompts' mean length here.

    python bench/serve_concurrency.py --streams 1,4,16 --max-seqs 16   # SmolLM2 on 2 CPU stages, 1 thread each
    python bench/serve_concurrency.py --tokens 128 --threads 2 --peer ''   # no peer
    python3 bench/serve_concurrency.py --model /tmp/8b-q4km.gguf --devices cuda:0 --prompt-ids 32 \
        --streams 1,4,16 --max-seqs 16 --tokens 128 --peer /tmp/ll/build/bin/llama-batched-bench   # one GPU

--devices puts the stages on those devices (the peer then offloads every layer, -ngl 99). --prompt-ids N sends
each request's prompt as N random token ids through /v1/completions (a random-block GGUF has no vocabulary, unless
bench/make_gguf.py gave it one with --vocab: then chat requests of text work, and --stream takes their answers as
server-sent events, as a chat UI does).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strata.serve.engine import PipelineEngine  # noqa: E402
from strata.serve.server import DEFAULT_QUEUE, make_uvicorn  # noqa: E402

QUESTIONS = ["Tell me a long story about a dragon.", "Explain how a steam engine works.",
             "Write a poem about the sea.", "Describe the city of Paris in detail."]


def ask(url: str, question: str | list[int], tokens: int, prompt_tokens: list | None = None,
        stream: bool = False) -> int:
    """One chat request (stream: its answer as server-sent events, as a chat UI takes it), or a completion of token
    ids; -> completion tokens (its prompt's tokens appended to prompt_tokens)."""
    if not isinstance(question, str):
        import httpx
        r = httpx.post(url + "/v1/completions", timeout=600, json={
            "model": "m", "prompt": question, "max_tokens": tokens, "temperature": 0})
        if r.status_code != 200:
            raise RuntimeError(f"/v1/completions: {r.status_code} {r.text[:500]}")
        if prompt_tokens is not None:
            prompt_tokens.append(r.json()["usage"]["prompt_tokens"])
        return r.json()["usage"]["completion_tokens"]
    try:
        import openai
    except ImportError:  # (a device machine has httpx, not the openai client)
        import httpx
        body = {"messages": [{"role": "user", "content": question}], "max_tokens": tokens, "temperature": 0}
        if not stream:
            r = httpx.post(url + "/v1/chat/completions", timeout=600, json=body)
            r.raise_for_status()
            usage = r.json()["usage"]
        else:
            usage = None
            with httpx.stream("POST", url + "/v1/chat/completions", timeout=600, json={
                    **body, "stream": True, "stream_options": {"include_usage": True}}) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        usage = json.loads(line[6:]).get("usage") or usage  # (in the last event)
        if prompt_tokens is not None:
            prompt_tokens.append(usage["prompt_tokens"])
        return usage["completion_tokens"]
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    kw = dict(stream=True, stream_options={"include_usage": True}) if stream else {}
    r = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": question}],
                                       max_tokens=tokens, temperature=0, **kw)
    if stream:  # (the usage comes in the last event)
        r = [c for c in r if c.usage is not None][-1]
    if prompt_tokens is not None:
        prompt_tokens.append(r.usage.prompt_tokens)
    return r.usage.completion_tokens


@contextlib.contextmanager
def served(eng, queue_size: int = DEFAULT_QUEUE):
    """eng behind `--serve`'s server (uvicorn in a thread) on a free loopback port: its URL, until the block ends."""
    uv, _ = make_uvicorn(eng, log_level="warning", queue_size=queue_size)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    server.start()
    while not uv.started:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        uv.should_exit = True
        server.join(120)


def arm(rig: dict, max_seqs: int, streams: list[int], tokens: int, out: Path, prompt_tokens: list,
        questions: list | None = None, groups: bool = True, stream: bool = False) -> list[tuple]:
    questions = questions or QUESTIONS
    eng = PipelineEngine({**rig, "max_seqs": max_seqs, "prefill_groups": groups},
                         out=out / f"seqs{max_seqs}-{'groups' if groups else 'alone'}")
    stamps: list[list[float]] = []  # each generation's token times, as the engine hands them to the server
    generate = eng.generate

    firsts: list[tuple] = []  # at each generation's first token: (time, the driver's batches, trip s, turnaround s)

    def stamp(mine: list[float]) -> None:
        mine.append(time.perf_counter())
        if len(mine) == 1:  # (on the driver's thread: its stats as they stand)
            st = eng.slot_stats()
            firsts.append((mine[0], *((st.batches, st.batch_trip_s, st.batch_turnaround_s) if st else (0, 0.0, 0.0))))

    def timed(ids, params, on_token):
        mine: list[float] = []
        stamps.append(mine)
        return generate(ids, params, lambda t: stamp(mine) or on_token(t))
    eng.generate = timed
    rows = []
    with served(eng, max(16, max(streams))) as url:
        ask(url, questions[0] if questions is not QUESTIONS else "Hello", 4)  # warm-up: one-time costs are not decode
        for n in streams:
            del stamps[:], firsts[:]
            counts = [0] * n
            t0 = time.perf_counter()
            threads = [threading.Thread(target=lambda i=i: counts.__setitem__(
                i, ask(url, questions[i % len(questions)], tokens, prompt_tokens, stream))) for i in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
            st = eng.slot_stats()
            # decode only, as llama-batched-bench's S_TG: the tokens made once every stream had its first, over
            # that time
            begin, end = max(s[0] for s in stamps), max(s[-1] for s in stamps)  # (begin - t0: the last first token)
            made = sum(1 for s in stamps for t in s if t > begin)
            # a decode batch's round once every stream had its first token (the streams' first chunks no longer
            # in the pipeline): from its send to its result (the stages), and the head's turnaround before it
            before = max(firsts)[1:]
            b = (st.batches - before[0]) if st else 0
            trip, turn = ((st.batch_trip_s - before[1]) * 1e3 / b, (st.batch_turnaround_s - before[2]) * 1e3 / b) \
                if b else (float("nan"), float("nan"))
            rows.append((max_seqs, groups, n, sum(counts), wall, made / (end - begin) if end > begin else float("nan"),
                         st.most_in_flight if st else 1, st.most_in_batch if st else 1, trip, turn, begin - t0))
    return rows


def peer(binary: str, gguf: str, threads: int, npp: int, tokens: int, streams: list[int],
         gpu: bool = False) -> list[tuple]:
    """llama-batched-bench on the same file: (B, generated tokens over the whole time, S_TG) per stream count
    (gpu: every layer offloaded, flash attention)."""
    ctx = max(streams) * (npp + tokens) + 256
    cmd = [binary, "-m", gguf, "-t", str(threads), "-c", str(ctx), "-b", "2048", "-ub", "512", "-npp", str(npp),
           "-ntg", str(tokens), "-npl", ",".join(map(str, streams))] + (["-ngl", "99", "-fa", "on"] if gpu else [])
    print("$", " ".join(cmd), flush=True)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600).stdout
    rows = []
    for line in out.splitlines():  # | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and re.fullmatch(r"\d+", cells[2]):
            b, t_all, s_tg = int(cells[2]), float(cells[8]), float(cells[7])
            rows.append((b, b * tokens / t_all, s_tg))
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
    ap.add_argument("--devices", default="", help="stages on these devices (comma-separated), not on CPU")
    ap.add_argument("--prompt-ids", type=int, default=0, help="prompts as this many random token ids (no vocabulary)")
    ap.add_argument("--stream", action="store_true", help="chat requests answered as server-sent events (text "
                    "prompts only: a model with a vocabulary, e.g. bench/make_gguf.py --vocab smollm2)")
    ap.add_argument("--prefill-groups", default="on", help="the rig's prefill_groups: on, off, or on,off (both "
                    "arms, each max_seqs > 1)")
    ap.add_argument("--batch-ahead", type=int, default=None, help="the rig's batch_ahead (default its auto; one "
                    "stage: steps a greedy "
                    "decode batch runs past its note)")
    default_peer = Path(__file__).resolve().parents[1] / ".peer" / "cpu" / "bin" / "llama-batched-bench"
    ap.add_argument("--peer", default=str(default_peer) if default_peer.exists() else "",
                    help="llama-batched-bench built for this CPU ('' for none; ../shared/tools/llamacpp-peer.sh cpu)")
    a = ap.parse_args()
    if a.stream and a.prompt_ids:
        ap.error("--stream takes text prompts: not with --prompt-ids")
    stages = ([{"device": d} for d in a.devices.split(",")] if a.devices
              else [{"device": "cpu", "threads": a.threads}] * a.stages)
    rig = dict(model=a.model, stages=stages, max_context=a.max_context, progress=False)
    if a.batch_ahead is not None:
        rig["batch_ahead"] = a.batch_ahead
    questions = None
    if a.prompt_ids:
        import numpy as np
        from strata.weights.checkpoint import model_args
        rng = np.random.default_rng(0)
        questions = [rng.integers(0, model_args(a.model).vocab_size, a.prompt_ids).tolist() for _ in range(4)]
        rig["prompt"] = {"random": {"tokens": 8, "seed": 0}}
    streams = [int(x) for x in a.streams.split(",")]
    rows, prompt_tokens = [], []
    with tempfile.TemporaryDirectory(prefix="serve-concurrency-") as tmp:
        for m in [int(x) for x in a.max_seqs.split(",")]:
            for g in ([True] if m == 1 else [x == "on" for x in a.prefill_groups.split(",")]):
                rows += arm(rig, m, streams, a.tokens, Path(tmp), prompt_tokens, questions, g, a.stream)
    theirs = {}
    if a.peer:
        from strata.weights.checkpoint import resolve
        kind, path = resolve(a.model)
        if kind != "gguf":
            raise SystemExit(f"--peer needs a GGUF model (got {kind})")
        npp = round(sum(prompt_tokens) / max(1, len(prompt_tokens)))
        theirs = {b: (e2e, tg) for b, e2e, tg in peer(a.peer, path, a.stages * a.threads, npp, a.tokens, streams,
                                                       gpu=bool(a.devices))}
    where = f"stages on {a.devices}" if a.devices else f"{a.stages} CPU stages x {a.threads} thread(s)"
    what = "token ids" if a.prompt_ids else "streamed chat" if a.stream else "chat"
    print(f"\n{a.model}, {where}, {a.tokens} tokens a request ({what}), greedy; {os.cpu_count()} cores")
    print("tok/s: all: completion tokens over the wall time (prompts and decode); decode: once every stream had its "
          "first token (llama.cpp: B x TG over its whole time, and its S_TG); groups: prefill_groups; last 1st s: "
          "the last stream's first token, from the first request; trip / head ms: a decode batch's, once every "
          "stream had its first token")
    print(f"{'max_seqs':>8} {'groups':>6} {'streams':>7} {'tokens':>7} {'wall s':>7} {'in flight':>9} {'in batch':>8} "
          f"{'all':>7} {'llama.cpp':>9} {'ratio':>6} {'decode':>7} {'S_TG':>7} {'ratio':>6} {'trip ms':>7} "
          f"{'head ms':>7} {'last 1st s':>10}")
    for m, g, n, toks, wall, dec, most, batch, trip, turn, first in rows:
        rate = toks / wall if wall > 0 else 0.0
        e2e, tg = theirs.get(n, (float("nan"), float("nan")))
        print(f"{m:>8} {'on' if g else 'off':>6} {n:>7} {toks:>7} {wall:>7.2f} {most:>9} {batch:>8} {rate:>7.1f} "
              f"{e2e:>9.1f} {rate / e2e:>5.2f}x "
              f"{dec:>7.1f} {tg:>7.1f} {dec / tg:>5.2f}x {trip:>7.2f} {turn:>7.3f} {first:>10.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
