"""The OpenAI-compatible server, through a real uvicorn on a loopback port, over a deterministic fake engine."""
from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import json
import math
import re
import signal
import socket
import threading
import time

import httpx
import pytest
import torch

from strata.text.chat import ChatTemplate
from strata.serve.engine import Engine, EngineError, GenerationStats
from strata.text.sampling import Sampler, SamplingParams
from strata.serve.server import make_uvicorn

EOS = 256
WAIT_S = 10.0  # bound on every wait for an event; a pass never comes near it


def next_letter(prev: int) -> int:
    """The fake model's greedy rule: the next token is a function of the previous one (always a letter)."""
    return ord("a") + (prev * 7 + 3) % 26


class FakeEngine:
    """Bytes as tokens (EOS = 256); greedy next token = next_letter(previous). Knobs for the tests:
    gate (block inside generate until set), pause_after (block after that many tokens until `resume`),
    fail_next (raise EngineError naming that stage after `fail_after` tokens), eos_after."""

    model_name = "fake-model"
    vocab_size = EOS + 1
    eos_id = EOS

    def __init__(self, max_context: int = 256):
        self.max_context = max_context
        self.template = ChatTemplate("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                                     "{% if add_generation_prompt %}<assistant>{% endif %}")
        self.kept: list[int] = []  # the KV of the last prompt, for prefix reuse
        self.entered = threading.Event()
        self.gate: threading.Event | None = None
        self.pause_after: int | None = None
        self.paused = threading.Event()
        self.resume = threading.Event()
        self.fail_next: str | None = None
        self.fail_after = 0
        self.eos_after: int | None = None
        self.produced: list[int] = []  # tokens produced per generate call (including a refused one)
        self.restarts = 0
        self.restart_failures = 0  # how many restarts raise before one works
        self.broken = False
        self.closed = 0
        self.scored: list[tuple[list[int], int]] = []  # logprob_rows calls: (ids, start)
        self.inside = threading.Lock()  # held during generate: a second, overlapping call fails

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def chat_prompt(self, messages, **variables) -> str:
        return self.template.render(messages, **variables)

    def continuation(self, ids: list[int], n: int) -> list[int]:
        out, prev = [], ids[-1]
        for _ in range(n):
            prev = next_letter(prev)
            out.append(prev)
        return out

    def generate(self, ids, params: SamplingParams, on_token) -> GenerationStats:
        assert not self.broken, "generate after a failure without restart()"
        assert self.closed == 0
        if not self.inside.acquire(blocking=False):
            raise AssertionError("fake engine: overlapping generate calls")
        try:
            return self._generate(ids, params, on_token)
        finally:
            self.inside.release()

    def _generate(self, ids, params: SamplingParams, on_token) -> GenerationStats:
        reused = 0
        while reused < min(len(ids), len(self.kept)) and ids[reused] == self.kept[reused]:
            reused += 1
        self.kept = list(ids)
        self.entered.set()
        if self.gate is not None and not self.gate.wait(WAIT_S):
            raise AssertionError("fake engine: gate never opened")
        sampler = Sampler(params)
        t0 = time.perf_counter()
        prev, n, finish = ids[-1], 0, "length"
        self.produced.append(0)
        while n < params.max_tokens:
            if self.fail_next is not None and n == self.fail_after:
                stage, self.fail_next, self.broken = self.fail_next, None, True
                raise EngineError(stage, "process died (signal 9)")
            if self.pause_after is not None and n == self.pause_after:
                self.paused.set()
                if not self.resume.wait(WAIT_S):
                    raise AssertionError("fake engine: never resumed")
            if self.eos_after is not None and n == self.eos_after:
                finish = "stop"
                break
            logits = -torch.abs(torch.arange(26, dtype=torch.float32) - (next_letter(prev) - ord("a")))
            tok = ord("a") + sampler.next(logits)
            self.produced[-1] += 1
            n += 1
            prev = tok
            if not on_token(tok):
                finish = "stop"
                break
        return GenerationStats(prompt_tokens=len(ids), reused_tokens=reused, completion_tokens=n,
                               prefill_s=0.001, decode_s=max(time.perf_counter() - t0, 1e-6), finish_reason=finish)

    @staticmethod
    def logits_after(prev: int) -> torch.Tensor:
        """The fake model's logits over the whole vocabulary after `prev`: peaked at next_letter(prev)."""
        x = torch.full((EOS + 1,), -30.0)
        x[ord("a"):ord("a") + 26] = -torch.abs(torch.arange(26, dtype=torch.float32) - (next_letter(prev) - ord("a")))
        return x

    def logprob_rows(self, ids, start):  # the optional scoring hook
        self.scored.append((list(ids), start))
        for i in range(start, len(ids)):
            yield torch.log_softmax(self.logits_after(ids[i - 1]), dim=-1)[None]

    def metrics_text(self) -> str:  # the optional hook: an engine's own series on /metrics
        return "# HELP strata_fake_generations Generate calls.\n# TYPE strata_fake_generations counter\n" \
               f"strata_fake_generations {len(self.produced)}\n"

    def restart(self) -> None:
        if self.restart_failures:
            self.restart_failures -= 1
            raise RuntimeError("stage 1 did not come back")
        self.restarts += 1
        self.broken = False
        self.kept = []

    def close(self) -> None:
        self.closed += 1


def wait_until(cond, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


class Running:
    """A uvicorn server in a thread on a free loopback port."""

    def __init__(self, engine, **kw):
        self.engine = engine
        self.uv, self.app = make_uvicorn(engine, log_level="warning", **kw)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.uv.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        wait_until(lambda: self.uv.started or not self.thread.is_alive(), "the server to start")
        assert self.uv.started

    @property
    def worker(self):
        return self.app.state.server.worker

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, **{"timeout": WAIT_S, **kw})

    def stop(self) -> None:
        self.uv.should_exit = True
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive()


@pytest.fixture
def engine():
    return FakeEngine()


@pytest.fixture
def server(engine):
    s = Running(engine, queue_size=2)
    yield s
    if engine.gate is not None:
        engine.gate.set()
    engine.resume.set()
    s.stop()


def sse_events(lines) -> list[tuple[str | None, str]]:
    """(event, data) of each SSE message."""
    out, event, data = [], None, []
    for line in lines:
        if line == "":
            if data:
                out.append((event, "\n".join(data)))
            event, data = None, []
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].lstrip(" "))
    if data:
        out.append((event, "\n".join(data)))
    return out


# -- the happy paths ---------------------------------------------------------------------------------

def test_completion_text_usage_and_shape(server, engine):
    with server.client() as c:
        r = c.post("/v1/completions", json={"model": "fake-model", "prompt": "Hello", "max_tokens": 8})
    assert r.status_code == 200, r.text
    body = r.json()
    want = bytes(engine.continuation(list(b"Hello"), 8)).decode()
    assert body["object"] == "text_completion" and body["model"] == "fake-model" and body["id"].startswith("cmpl-")
    assert isinstance(body["created"], int)
    assert body["choices"] == [{"index": 0, "text": want, "logprobs": None, "finish_reason": "length"}]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_prefix_reuse_is_reported_as_cached_tokens(server):
    with server.client() as c:
        c.post("/v1/completions", json={"prompt": "The long document. Question one?", "max_tokens": 2})
        r = c.post("/v1/completions", json={"prompt": "The long document. Question two?", "max_tokens": 2})
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == len("The long document. Question ")


def test_default_max_tokens_is_16_for_completions_and_the_context_for_chat(server, engine):
    engine.max_context = 60
    with server.client() as c:
        r = c.post("/v1/completions", json={"prompt": "x"})
        assert r.json()["usage"]["completion_tokens"] == 16
        msgs = [{"role": "user", "content": "hi"}]
        r = c.post("/v1/chat/completions", json={"messages": msgs})
    prompt_len = len(engine.chat_prompt(msgs).encode())
    assert r.json()["usage"]["completion_tokens"] == 60 - prompt_len
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_chat_uses_the_template_and_answers_a_message(server, engine):
    msgs = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi?"}]
    engine.eos_after = 5
    with server.client() as c:
        r = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 50})
    body = r.json()
    prompt = engine.chat_prompt(msgs)
    assert prompt == "<system>Be terse.\n<user>Hi?\n<assistant>"
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant",
                                 "content": bytes(engine.continuation(list(prompt.encode()), 5)).decode()}
    assert choice["finish_reason"] == "stop"  # the end-of-sequence token, which is not part of the text
    assert body["usage"]["prompt_tokens"] == len(prompt.encode()) and body["usage"]["completion_tokens"] == 5


def test_stop_string_cuts_the_text_and_stops_generation(server, engine):
    full = bytes(engine.continuation(list(b"Q"), 40)).decode()
    stop = full[10:13]
    assert full.find(stop) == 10
    with server.client() as c:
        r = c.post("/v1/completions", json={"prompt": "Q", "max_tokens": 40, "stop": [stop, "not-there"]})
    body = r.json()
    assert body["choices"][0]["text"] == full[:10] and body["choices"][0]["finish_reason"] == "stop"
    assert engine.produced[-1] == 13  # the token completing the stop string was the last one made


def test_seeded_sampling_repeats_through_the_server(server):
    req = {"prompt": "seed me", "max_tokens": 24, "temperature": 1.0, "seed": 7}
    with server.client() as c:
        a = c.post("/v1/completions", json=req).json()["choices"][0]["text"]
        b = c.post("/v1/completions", json=req).json()["choices"][0]["text"]
        other = c.post("/v1/completions", json={**req, "seed": 8}).json()["choices"][0]["text"]
        greedy = c.post("/v1/completions", json={**req, "temperature": 0}).json()["choices"][0]["text"]
    assert a == b and a != other
    assert greedy != a  # temperature 1 over these logits leaves the greedy path within 24 tokens


def test_streaming_completion_ends_with_done(server, engine):
    with server.client() as c, c.stream("POST", "/v1/completions",
                                        json={"prompt": "Hi", "max_tokens": 6, "stream": True,
                                              "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == (None, "[DONE]")
    chunks = [json.loads(d) for _, d in events[:-1]]
    assert all(ch["object"] == "text_completion" and ch["id"] == chunks[0]["id"] for ch in chunks)
    text = "".join(ch["choices"][0]["text"] for ch in chunks if ch["choices"])
    assert text == bytes(engine.continuation(list(b"Hi"), 6)).decode()
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6


def test_streaming_chat_deltas(server, engine):
    msgs = [{"role": "user", "content": "Go"}]
    with server.client() as c, c.stream("POST", "/v1/chat/completions",
                                        json={"messages": msgs, "max_tokens": 4, "stream": True}) as r:
        events = sse_events(r.iter_lines())
    assert events[-1] == (None, "[DONE]")
    chunks = [json.loads(d) for _, d in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(ch["object"] == "chat.completion.chunk" for ch in chunks)
    text = "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks)
    assert text == bytes(engine.continuation(list(engine.chat_prompt(msgs).encode()), 4)).decode()
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}


def test_prompt_as_token_ids_and_batches(server, engine):
    with server.client() as c:
        text = c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 5}).json()
        ids = c.post("/v1/completions", json={"prompt": list(b"Hello"), "max_tokens": 5}).json()
        batch = c.post("/v1/completions", json={"prompt": ["ab", "cde", "f"], "max_tokens": 4}).json()
        id_batch = c.post("/v1/completions", json={"prompt": [list(b"ab"), list(b"xyz")], "max_tokens": 3}).json()
    assert ids["choices"] == text["choices"] and ids["usage"]["prompt_tokens"] == 5
    assert [ch["index"] for ch in batch["choices"]] == [0, 1, 2]
    assert [ch["text"] for ch in batch["choices"]] == [bytes(engine.continuation(list(p), 4)).decode()
                                                       for p in (b"ab", b"cde", b"f")]
    assert batch["usage"]["prompt_tokens"] == 6 and batch["usage"]["completion_tokens"] == 12
    assert [ch["text"] for ch in id_batch["choices"]] == [bytes(engine.continuation(list(p), 3)).decode()
                                                          for p in (b"ab", b"xyz")]
    assert engine.produced[-2:] == [3, 3]  # one generation per prompt, one after another


def test_n_choices_are_sampled_with_distinct_seeds(server, engine):
    req = {"prompt": ["p", "q"], "max_tokens": 24, "temperature": 1.0, "seed": 11, "n": 3}
    with server.client() as c:
        a = c.post("/v1/completions", json=req).json()
        b = c.post("/v1/completions", json=req).json()
        alone = [c.post("/v1/completions", json={**req, "prompt": p, "n": 1, "seed": 11 + j}).json()
                 for p in ("p", "q") for j in range(3)]
    texts = [ch["text"] for ch in a["choices"]]
    assert [ch["index"] for ch in a["choices"]] == list(range(6))  # prompt i's choices at i * n + j
    assert texts == [ch["text"] for ch in b["choices"]]  # seeded: repeatable
    assert len(set(texts[:3])) == 3 and len(set(texts[3:])) == 3  # distinct seeds per choice
    assert texts == [r["choices"][0]["text"] for r in alone]  # choice j is the request alone with seed + j
    assert a["usage"]["prompt_tokens"] == 2 and a["usage"]["completion_tokens"] == 6 * 24


def _fake_scores(engine, ids: list[int], start: int, top: int) -> tuple[list[float], list[list[int]]]:
    """The fake model's log p(ids[i] | ids[:i]) and top ids for i >= start, computed here, not by the server."""
    lps, tops = [], []
    for i in range(start, len(ids)):
        row = torch.log_softmax(engine.logits_after(ids[i - 1]), dim=-1)
        lps.append(row[ids[i]].item())
        tops.append(row.topk(top).indices.tolist() if top else [])
    return lps, tops


def test_echo_logprobs_score_the_prompt_and_the_answer(server, engine):
    with server.client() as c:
        r = c.post("/v1/completions", json={"prompt": "Hello", "echo": True, "logprobs": 2, "max_tokens": 3}).json()
    made = engine.continuation(list(b"Hello"), 3)
    ch = r["choices"][0]
    assert ch["text"] == "Hello" + bytes(made).decode() and ch["finish_reason"] == "length"
    lp = ch["logprobs"]
    full = list(b"Hello") + made
    assert lp["tokens"] == [chr(t) for t in full]
    assert lp["text_offset"] == list(range(len(full)))
    want, tops = _fake_scores(engine, full, 1, 2)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx(want, abs=1e-5)
    for i, (top, ids) in enumerate(zip(lp["top_logprobs"][1:], tops), start=1):
        assert set(top) == {chr(t) for t in ids} | {chr(full[i])}  # the 2 likeliest and the token itself
        assert top[chr(full[i])] == pytest.approx(want[i - 1], abs=1e-5)
    # the greedy answer's tokens are the likeliest ones
    assert all(lp["top_logprobs"][i][lp["tokens"][i]] == max(lp["top_logprobs"][i].values()) for i in range(5, 8))


def test_echo_with_max_tokens_0_only_scores_the_prompt(server, engine):
    with server.client() as c:
        r = c.post("/v1/completions", json={"prompt": ["abc", "xy"], "echo": True, "logprobs": 0,
                                            "max_tokens": 0}).json()
        plain = c.post("/v1/completions", json={"prompt": "abc", "echo": True, "max_tokens": 0}).json()
    assert engine.produced == [0]  # only the request without logprobs prefilled (generate with 0 tokens)
    assert [ch["text"] for ch in r["choices"]] == ["abc", "xy"]
    for ch, p in zip(r["choices"], (b"abc", b"xy")):
        want, _ = _fake_scores(engine, list(p), 1, 0)
        assert ch["logprobs"]["token_logprobs"][0] is None
        assert ch["logprobs"]["token_logprobs"][1:] == pytest.approx(want, abs=1e-5)
        assert ch["logprobs"]["top_logprobs"][1:] == [{chr(t): pytest.approx(w, abs=1e-5)}
                                                      for t, w in zip(p[1:], want)]
        assert ch["finish_reason"] == "length"
    assert r["usage"]["prompt_tokens"] == 5 and r["usage"]["completion_tokens"] == 0
    assert plain["choices"][0]["text"] == "abc" and plain["choices"][0]["logprobs"] is None


def test_logprobs_without_echo_cover_the_answer_cut_at_the_stop_string(server, engine):
    full = engine.continuation(list(b"Q"), 40)
    stop = bytes(full[6:8]).decode()
    assert bytes(full).decode().find(stop) == 6
    with server.client() as c:
        r = c.post("/v1/completions", json={"prompt": "Q", "logprobs": 1, "max_tokens": 40, "stop": stop}).json()
    ch = r["choices"][0]
    assert ch["text"] == bytes(full[:6]).decode()
    assert ch["logprobs"]["tokens"] == [chr(t) for t in full[:6]]  # not the stop string's tokens
    want, _ = _fake_scores(engine, list(b"Q") + full[:6], 1, 0)
    assert ch["logprobs"]["token_logprobs"] == pytest.approx(want, abs=1e-5)
    assert ch["logprobs"]["text_offset"] == list(range(6))
    assert engine.scored[-1] == (list(b"Q") + full[:8], 1)  # the answer's tokens only, not the prompt's


def test_an_answer_ended_by_eos_has_the_eos_logprob_last(server, engine):
    """lm-eval's loglikelihood request (echo, max_tokens 1, logprobs 1, seed) takes token_logprobs[ctxlen:-1], the
    last entry being the generated token's: when the answer ended at EOS at once, that entry is EOS's (as OpenAI's
    and vLLM's completions give it), not the prompt's last token's."""
    prompt = list(b"Hello")
    msgs = [{"role": "user", "content": "Hi"}]
    with server.client() as c:
        engine.eos_after = 0
        r = c.post("/v1/completions", json={"model": "fake-model", "prompt": [prompt], "temperature": 0,
                                            "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True}).json()
        engine.eos_after = 2
        plain = c.post("/v1/completions", json={"prompt": "Q", "logprobs": 0, "max_tokens": 5}).json()
        chat = c.post("/v1/chat/completions", json={"messages": msgs, "logprobs": True, "max_tokens": 5}).json()
    ch, lp = r["choices"][0], r["choices"][0]["logprobs"]
    assert ch["text"] == "Hello" and ch["finish_reason"] == "stop" and r["usage"]["completion_tokens"] == 0
    want, _ = _fake_scores(engine, prompt + [EOS], 1, 0)
    assert lp["tokens"] == list("Hello") + [""]  # EOS's text (the fake detokenizes it to ""), not in `text`
    assert lp["token_logprobs"][1:] == pytest.approx(want, abs=1e-5)
    assert lp["top_logprobs"][-1][""] == pytest.approx(want[-1], abs=1e-5) and lp["text_offset"][-1] == 5
    ctxlen = 2  # the context "He", the continuation "llo": what lm-eval sums
    assert sum(lp["token_logprobs"][ctxlen:-1]) == pytest.approx(sum(want[ctxlen - 1:-1]), abs=1e-5)
    # without echo: the answer's tokens, then EOS
    made = engine.continuation(list(b"Q"), 2)
    pl = plain["choices"][0]["logprobs"]
    assert plain["choices"][0]["text"] == bytes(made).decode() and pl["tokens"] == [chr(t) for t in made] + [""]
    assert pl["token_logprobs"] == pytest.approx(_fake_scores(engine, list(b"Q") + made + [EOS], 1, 0)[0],
                                                 abs=1e-5)
    assert plain["usage"]["completion_tokens"] == 2
    # chat's logprobs are the message's tokens only
    content = chat["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == list(chat["choices"][0]["message"]["content"]) and len(content) == 2


def test_chat_logprobs_and_top_logprobs(server, engine):
    msgs = [{"role": "user", "content": "Hi"}]
    with server.client() as c:
        r = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 4, "logprobs": True,
                                                 "top_logprobs": 3}).json()
        off = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 4, "logprobs": False}).json()
    prompt = list(engine.chat_prompt(msgs).encode())
    made = engine.continuation(prompt, 4)
    content = r["choices"][0]["logprobs"]["content"]
    want, tops = _fake_scores(engine, prompt + made, len(prompt), 3)
    assert [e["token"] for e in content] == [chr(t) for t in made]
    assert [e["bytes"] for e in content] == [[t] for t in made]
    assert [e["logprob"] for e in content] == pytest.approx(want, abs=1e-5)
    assert [[t["token"] for t in e["top_logprobs"]] for e in content] == [[chr(t) for t in ids] for ids in tops]
    assert r["choices"][0]["logprobs"]["refusal"] is None and off["choices"][0]["logprobs"] is None


def test_streaming_a_batch_with_echo(server, engine):
    with server.client() as c, c.stream("POST", "/v1/completions", json={
            "prompt": ["ab", "c"], "max_tokens": 3, "echo": True, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        events = sse_events(r.iter_lines())
    chunks = [json.loads(d) for _, d in events[:-1]]
    texts = collections.defaultdict(str)
    for ch in chunks:
        for choice in ch["choices"]:
            texts[choice["index"]] += choice["text"]
    assert dict(texts) == {0: "ab" + bytes(engine.continuation(list(b"ab"), 3)).decode(),
                           1: "c" + bytes(engine.continuation(list(b"c"), 3)).decode()}
    finals = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [f["index"] for f in finals] == [0, 1]
    assert chunks[-1]["usage"]["prompt_tokens"] == 3 and chunks[-1]["usage"]["completion_tokens"] == 6


def test_response_format_text_is_accepted(server, engine):
    with server.client() as c:
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                                                 "response_format": {"type": "text"}, "user": "u1"})
    assert r.status_code == 200, r.text


def test_models_and_health(server):
    with server.client() as c:
        m = c.get("/v1/models").json()
        h = c.get("/health")
    assert m["object"] == "list" and m["data"][0]["id"] == "fake-model" and m["data"][0]["max_context"] == 256
    assert h.status_code == 200 and h.json()["status"] == "ok"


def parse_prometheus(text: str) -> dict[tuple[str, str], float]:
    """A strict reader of the text format: every line a comment (HELP/TYPE) or `name{labels} value`."""
    samples, typed = {}, set()
    for line in text.splitlines():
        if line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            name, kind = line[7:].split(" ")
            assert kind in ("counter", "gauge"), line
            typed.add(name)
            continue
        m = re.fullmatch(r'([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[a-zA-Z_]\w*="[^"]*",?)*\})? (\S+)', line)
        assert m, f"not Prometheus text: {line!r}"
        assert m.group(1) in typed, f"{m.group(1)} has no TYPE line"
        samples[(m.group(1), m.group(2) or "")] = float(m.group(3))
    return samples


IDLE_GAUGES = ("strata_queue_length", "strata_running", "strata_running_sequences", "strata_prefix_cache_blocks")
PREFIX_COUNTERS = ("strata_prefix_cache_lookups_total", "strata_prefix_cache_hits_total")


def test_metrics_text_parses_and_counts(server):
    with server.client() as c:
        before = parse_prometheus(c.get("/metrics").text)
        c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3})
        c.post("/v1/completions", json={"prompt": "abcd", "max_tokens": 3})
        c.post("/v1/completions", content=b"{nope")
        r = c.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    s = parse_prometheus(r.text)
    assert s[("strata_requests_total", '{path="/v1/completions",code="200"}')] == 2
    assert s[("strata_requests_total", '{path="/v1/completions",code="400"}')] == 1
    assert s[("strata_queue_length", "")] == 0
    assert s[("strata_last_reused_tokens", "")] == 3
    assert s[("strata_reused_tokens_total", "")] == 3
    assert s[("strata_completion_tokens_total", "")] == 6
    assert s[("strata_last_decode_tokens_per_second", "")] > 0
    assert 0 < s[("strata_last_time_to_first_token_seconds", "")] < WAIT_S
    assert s[("strata_last_prefill_tokens_per_second", "")] == pytest.approx(1 / 0.001)
    assert s[("strata_fake_generations", "")] == 2
    # an engine without prefix_cache_stats (the fake one): its figures are zeros, before and after requests
    for m in (before, s):
        assert all(m[(name, "")] == 0 for name in IDLE_GAUGES + PREFIX_COUNTERS)
        assert m[("strata_prefix_cache_capacity_blocks", "")] == m[("strata_prefix_cache_block_tokens", "")] == 0


def test_concurrent_clients_are_served_one_at_a_time_in_full(engine):
    s = Running(engine, queue_size=8)
    try:
        def ask(i):
            with s.client() as c:
                if i % 2:
                    with c.stream("POST", "/v1/completions",
                                  json={"prompt": f"client {i}", "max_tokens": 20, "stream": True}) as r:
                        ev = sse_events(r.iter_lines())
                    return "".join(json.loads(d)["choices"][0]["text"] for _, d in ev[:-1])
                return c.post("/v1/completions", json={"prompt": f"client {i}", "max_tokens": 20}).json()[
                    "choices"][0]["text"]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            texts = list(pool.map(ask, range(8)))
    finally:
        s.stop()
    assert texts == [bytes(engine.continuation(list(f"client {i}".encode()), 20)).decode() for i in range(8)]
    assert engine.produced == [20] * 8


def test_queue_size_zero_serves_one_at_a_time():
    eng = FakeEngine()
    eng.gate = threading.Event()
    s = Running(eng, queue_size=0)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool, s.client() as c:
            first = pool.submit(c.post, "/v1/completions", json={"prompt": "a", "max_tokens": 1})
            assert eng.entered.wait(WAIT_S)
            assert c.post("/v1/completions", json={"prompt": "b"}).status_code == 429
            eng.gate.set()
            assert first.result(WAIT_S).status_code == 200
            assert c.post("/v1/completions", json={"prompt": "c", "max_tokens": 1}).status_code == 200
    finally:
        s.stop()


# -- refusals ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("path, payload, words", [
    ("/v1/completions", b"{not json", "malformed JSON"),
    ("/v1/completions", b"[1, 2]", "JSON object"),
    ("/v1/completions", b"\xff\xfe", "malformed JSON"),
    ("/v1/completions", {"max_tokens": 3}, "prompt"),
    ("/v1/completions", {"prompt": []}, "empty list"),
    ("/v1/completions", {"prompt": [1, "a"]}, "mixes forms"),
    ("/v1/completions", {"prompt": [1.5, 2]}, "holds 1.5"),
    ("/v1/completions", {"prompt": [[65, 66], []]}, "prompt[1] is an empty list"),
    ("/v1/completions", {"prompt": [[65, True]]}, "holds True"),
    ("/v1/completions", {"prompt": [65, 257]}, "token id 257, outside the vocabulary [0, 257)"),
    ("/v1/completions", {"prompt": [[65], [-1]]}, "prompt[1] holds token id -1"),
    ("/v1/completions", {"prompt": ["a", ""]}, "prompt[1] is empty"),
    # the fake engine has no vocabulary: a grammar has nothing to constrain (tests/test_grammar.py: a real one)
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "json_object"}}, "response_format json_object: "),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {}}}},
     "response_format json_schema: "),
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "yaml"}}, "response_format type must be"),
    ("/v1/completions", {"prompt": "x", "min_p": 1.5}, "min_p must be between 0 and 1"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 3}, "presence_penalty must be between -2 and 2"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty must be in (0, 10]"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"65": 101}}, "between -100 and 100"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"300": 1}}, "token id 300, outside the vocabulary"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"a": 1}}, "is not a token id"),
    ("/v1/completions", {"prompt": "x", "min_tokens": -1}, "min_tokens must be >= 0"),
    ("/v1/completions", {"prompt": "x", "ignore_eos": "yes"}, "ignore_eos must be true or false"),
    ("/v1/completions", {"prompt": "x", "min_pp": 0.1}, "unknown field 'min_pp'"),
    # the fake engine's template shows no tools: refused, not silently dropped
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {}}}]}, "does not show tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"name": "f"}]},
     "tools must be a list"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": [1]},
     "chat_template_kwargs must be an object"),
    ("/v1/completions", {"prompt": "x", "max_token": 3}, "did you mean 'max_tokens'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "echo": True}, "unknown field 'echo'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
     "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "extreme"},
     "reasoning_effort must be one of"),
    ("/v1/completions", {"prompt": "x", "best_of": 2}, "best_of"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', "temperature"),
    ("/v1/completions", {"prompt": "x", "top_k": 1.5}, "top_k"),
    ("/v1/completions", {"prompt": "x", "seed": -3}, "seed"),
    ("/v1/completions", {"prompt": 17}, "prompt"),
    ("/v1/completions", {"prompt": "x", "model": 3}, "model"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": "y"}}, "include_usage"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "from 0 to 20"),
    ("/v1/completions", {"prompt": "x", "logprobs": True}, "logprobs must be an integer"),
    ("/v1/completions", {"prompt": "x", "logprobs": 1, "stream": True}, "stream"),
    ("/v1/completions", {"prompt": "x", "echo": "yes"}, "echo must be true or false"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "needs logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": 2}, "true or false"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs must be"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "content"),
    ("/v1/chat/completions", {"messages": "hello"}, "non-empty"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, "stop"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "x", "n": 17}, "n must be an integer from 1 to 16"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n must be"),
    ("/v1/completions", {"prompt": ""}, "empty"),
    ("/v1/chat/completions", {"prompt": "x"}, "messages"),
    ("/v1/chat/completions", {"messages": []}, "non-empty"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "role"),
])
def test_bad_requests_are_400_with_the_reason(server, path, payload, words):
    with server.client() as c:
        r = c.post(path, content=payload) if isinstance(payload, bytes) else c.post(path, json=payload)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["type"] == "invalid_request_error"


def test_prompt_over_the_context_is_400_naming_the_limit(server, engine):
    engine.max_context = 32
    with server.client() as c:
        r = c.post("/v1/completions", json={"prompt": "y" * 33})
        ok = c.post("/v1/completions", json={"prompt": "y" * 30, "max_tokens": 100})
    assert r.status_code == 400 and "33 tokens" in r.json()["error"]["message"] \
        and "32" in r.json()["error"]["message"]
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2  # clamped to the context


def test_many_malformed_requests_then_still_serving(server):
    with server.client() as c:
        for i in range(50):
            assert c.post("/v1/completions", content=b"{" * (i + 1)).status_code == 400
        assert c.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2}).status_code == 200


def test_unknown_path_is_a_json_404(server):
    with server.client() as c:
        r = c.get("/v2/nothing")
    assert r.status_code == 404 and "error" in r.json()


def test_api_key():
    eng = FakeEngine()
    s = Running(eng, api_key="s3cret")
    try:
        with s.client() as c:
            assert c.post("/v1/completions", json={"prompt": "x"}).status_code == 401
            r = c.post("/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
            assert c.get("/v1/models").status_code == 401
            assert c.get("/health").status_code == 200  # liveness probes carry no key
            ok = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2},
                        headers={"Authorization": "Bearer s3cret"})
            assert ok.status_code == 200
    finally:
        s.stop()
    assert eng.closed == 1


def test_full_queue_answers_429(server, engine):
    engine.gate = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        def post(prompt):
            with server.client() as c:
                return c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3})
        running = pool.submit(post, "first")
        assert engine.entered.wait(WAIT_S)
        waiting = [pool.submit(post, p) for p in ("second", "third")]
        wait_until(lambda: server.worker.queue_length == 2, "two requests waiting")
        with server.client() as c:
            r = c.post("/v1/completions", json={"prompt": "fourth"})
            m = parse_prometheus(c.get("/metrics").text)
        assert r.status_code == 429 and "queue is full" in r.json()["error"]["message"]
        assert 1 <= int(r.headers["retry-after"]) <= 60  # (the mean request's seconds, at least 1)
        assert m[("strata_queue_length", "")] == 2 and m[("strata_running", "")] == 1
        assert m[("strata_running_sequences", "")] == 1
        engine.gate.set()
        results = [f.result(WAIT_S) for f in [running, *waiting]]
    assert [x.status_code for x in results] == [200, 200, 200]
    assert len(engine.produced) == 3  # the refused request never reached the engine


# -- faults ------------------------------------------------------------------------------------------

def test_engine_failure_is_503_naming_the_stage_then_restart_and_serve(server, engine):
    engine.fail_next, engine.fail_after = "stage 1 (cpu:1, pid 4242)", 2
    with server.client() as c:
        r = c.post("/v1/completions", json={"prompt": "doomed", "max_tokens": 8})
        assert r.status_code == 503
        err = r.json()["error"]
        assert err["stage"] == "stage 1 (cpu:1, pid 4242)" and "stage 1" in err["message"]
        r2 = c.post("/v1/completions", json={"prompt": "fine", "max_tokens": 4})
        m = parse_prometheus(c.get("/metrics").text)
    assert r2.status_code == 200 and r2.json()["usage"]["completion_tokens"] == 4
    assert engine.restarts == 1  # between the two: the worker restarts before taking the next request
    assert m[("strata_engine_errors_total", "")] == 1 and m[("strata_engine_restarts_total", "")] == 1


def test_failed_restart_marks_the_server_down_until_a_restart_works(server, engine):
    engine.fail_next, engine.restart_failures = "stage 1 (cpu:1, pid 9)", 2
    with server.client() as c:
        assert c.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}).status_code == 503
        wait_until(lambda: server.worker.broken is not None, "the failed restart")
        h = c.get("/health")
        assert h.status_code == 503 and "did not come back" in h.json()["reason"]
        r = c.post("/v1/completions", json={"prompt": "b", "max_tokens": 2})  # the second restart fails too
        assert r.status_code == 503 and "engine is down" in r.json()["error"]["message"]
        ok = c.post("/v1/completions", json={"prompt": "c", "max_tokens": 2})  # the third works
        assert ok.status_code == 200 and c.get("/health").json()["status"] == "ok"
    assert engine.restarts == 1


def test_oversized_body_is_413():
    s = Running(FakeEngine(), max_body=200)
    try:
        with s.client() as c:
            r = c.post("/v1/completions", json={"prompt": "x" * 300})
            assert r.status_code == 413 and "200" in r.json()["error"]["message"]
            assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200
    finally:
        s.stop()


def _answer(sock: socket.socket) -> tuple[int, dict, float]:
    """(status, JSON body, seconds) of the answer on a raw socket, read until the server closes or the body ends."""
    t0, data = time.monotonic(), b""
    while b"\r\n\r\n" not in data:
        part = sock.recv(65536)
        if not part:
            break
        data += part
    head, _, rest = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?i)content-length: (\d+)", head).group(1))
    while len(rest) < length:
        part = sock.recv(65536)
        if not part:
            break
        rest += part
    return int(head.split()[1]), json.loads(rest[:length]), time.monotonic() - t0


def test_body_limit_defaults_from_the_context_and_takes_the_rig_key(engine):
    from strata.config import from_dict
    from strata.errors import ConfigError
    from strata.serve.server import Server, default_max_body
    assert Server(engine).max_body == 256 * 16 + (1 << 20) == default_max_body(256)
    assert Server(FakeEngine(max_context=8192)).max_body == 8192 * 16 + (1 << 20)
    assert from_dict({"server_max_body_bytes": 5000}).server_max_body_bytes == 5000
    assert from_dict({}).server_max_body_bytes is None
    with pytest.raises(ConfigError, match="server_max_body_bytes: must be > 0"):
        from_dict({"server_max_body_bytes": 0})


def test_huge_body_is_413_by_its_length_before_it_is_sent():
    """A 60 MB Content-Length is refused from the headers: the answer comes with only 1 KB of the body sent."""
    eng = FakeEngine()
    s = Running(eng)
    try:
        limit = 256 * 16 + (1 << 20)
        sock = socket.create_connection(("127.0.0.1", s.port), timeout=WAIT_S)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 60000000\r\n\r\n" + b'{"prompt": "' + b"x" * 1000)
        status, body, seconds = _answer(sock)
        sock.close()
        assert status == 413 and body["error"]["code"] == 413, body
        assert "60000000" in body["error"]["message"] and str(limit) in body["error"]["message"]
        assert seconds < 10  # (answered with the body not sent: a server that waited for it would time out)
        # the real client with the whole 60 MB: still a 413 (or the server hangs up mid-upload), never a parse
        try:
            with s.client(timeout=30) as c:
                t0 = time.monotonic()
                r = c.post("/v1/completions", content=b'{"prompt": "' + b"x" * 60_000_000 + b'"}',
                           headers={"Content-Type": "application/json"})
            assert r.status_code == 413 and time.monotonic() - t0 < 10
        except httpx.TransportError:
            pass  # the server answered and closed while the client was still writing
        with s.client() as c:
            assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200
    finally:
        s.stop()
    assert len(eng.produced) == 1  # only the last request reached the engine


def test_chunked_body_over_the_limit_is_413_without_reading_the_rest():
    """No Content-Length: the body is counted as it streams in; the server answers 413 once it passes the limit,
    while the client has not finished (it never sends the last chunk)."""
    eng = FakeEngine()
    s = Running(eng, max_body=100_000)
    try:
        sock = socket.create_connection(("127.0.0.1", s.port), timeout=WAIT_S)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        piece = b"x" * 16384
        for _ in range(8):  # 128 KiB, over the 100,000-byte limit; no terminating chunk
            sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        status, body, _ = _answer(sock)
        sock.close()
        assert status == 413 and "100000" in body["error"]["message"], body
        # under the limit, chunked, it is read and served
        sock = socket.create_connection(("127.0.0.1", s.port), timeout=WAIT_S)
        payload = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(payload), payload))
        status, body, _ = _answer(sock)
        sock.close()
        assert status == 200 and body["choices"][0]["text"] == bytes(eng.continuation(list(b"hi"), 2)).decode()
    finally:
        s.stop()
    assert len(eng.produced) == 1


def test_engine_failure_mid_stream_is_an_sse_error_event(server, engine):
    engine.fail_next, engine.fail_after = "stage 0 (cpu:0, pid 1)", 3
    with server.client() as c:
        with c.stream("POST", "/v1/completions", json={"prompt": "s", "max_tokens": 9, "stream": True}) as r:
            events = sse_events(r.iter_lines())
        assert r.status_code == 200
        texts = [json.loads(d)["choices"][0]["text"] for e, d in events if e is None]
        assert "".join(texts) == bytes(engine.continuation(list(b"s"), 3)).decode()
        kind, data = events[-1]
        assert kind == "error" and json.loads(data)["error"]["stage"] == "stage 0 (cpu:0, pid 1)"
        assert (None, "[DONE]") not in events
        assert c.post("/v1/completions", json={"prompt": "next", "max_tokens": 2}).status_code == 200
    assert engine.restarts == 1


def test_client_disconnect_mid_stream_stops_generation(server, engine):
    engine.pause_after = 3
    with server.client() as c:
        with c.stream("POST", "/v1/completions", json={"prompt": "p", "max_tokens": 200, "stream": True}) as r:
            lines = r.iter_lines()
            got = 0
            while got < 3:  # read the first three tokens' chunks, then hang up
                line = next(lines)
                if line.startswith("data:"):
                    got += 1
        assert engine.paused.wait(WAIT_S)
        wait_until(lambda: server.worker.current is not None and server.worker.current.cancelled.is_set(),
                   "the server to notice the disconnect")
        engine.resume.set()
        wait_until(lambda: server.worker.current is None, "the generation to stop")
        assert engine.produced == [4]  # the fourth token was refused; 196 were never made
        assert c.post("/v1/completions", json={"prompt": "after", "max_tokens": 2}).status_code == 200


def raw_post(port: int, path: str, payload: dict) -> socket.socket:
    """Send a POST and leave the answer unread: the caller hangs up by closing the socket."""
    body = json.dumps(payload).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return sock


def test_client_disconnect_without_streaming_stops_generation(server, engine):
    engine.pause_after = 2
    sock = raw_post(server.port, "/v1/completions", {"prompt": "p", "max_tokens": 200})
    assert engine.paused.wait(WAIT_S)
    sock.close()  # hang up while the answer is being made
    wait_until(lambda: server.worker.current is not None and server.worker.current.cancelled.is_set(),
               "the server to notice the disconnect")
    engine.resume.set()
    wait_until(lambda: server.worker.current is None, "the generation to stop")
    assert engine.produced == [3]


def test_waiting_client_that_leaves_never_reaches_the_engine(server, engine):
    engine.gate = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(1) as pool, server.client() as c:
        first = pool.submit(c.post, "/v1/completions", json={"prompt": "one", "max_tokens": 2})
        assert engine.entered.wait(WAIT_S)
        sock = raw_post(server.port, "/v1/completions", {"prompt": "two", "max_tokens": 2})
        wait_until(lambda: server.worker.queue_length == 1, "the second request to wait")
        sock.close()
        wait_until(lambda: server.worker.queue_length == 0, "the queue to drop the request that left")
        engine.gate.set()
        assert first.result(WAIT_S).status_code == 200
        assert c.post("/v1/completions", json={"prompt": "three", "max_tokens": 2}).status_code == 200
    assert len(engine.produced) == 2  # "one" and "three": "two" never reached the engine


def test_shutdown_finishes_the_running_request_refuses_the_waiting_and_closes(engine):
    s = Running(engine, queue_size=2)
    engine.gate = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        def stream_all():
            with s.client() as c, c.stream("POST", "/v1/completions",
                                           json={"prompt": "drain", "max_tokens": 5, "stream": True}) as r:
                return sse_events(r.iter_lines())

        def post():
            with s.client() as c:
                return c.post("/v1/completions", json={"prompt": "late", "max_tokens": 5})
        running = pool.submit(stream_all)
        assert engine.entered.wait(WAIT_S)
        waiting = pool.submit(post)
        wait_until(lambda: s.worker.queue_length == 1, "a waiting request")
        s.uv.handle_exit(signal.SIGTERM, None)  # what uvicorn's signal handler calls
        r = waiting.result(WAIT_S)
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]

        def refused():
            try:
                socket.create_connection(("127.0.0.1", s.port), timeout=1).close()
                return False
            except OSError:
                return True
        wait_until(refused, "the listener to close")
        assert engine.closed == 0  # the running request is not done yet
        engine.gate.set()
        events = running.result(WAIT_S)
    assert events[-1] == (None, "[DONE]")
    text = "".join(json.loads(d)["choices"][0]["text"] for _, d in events[:-1])
    assert text == bytes(engine.continuation(list(b"drain"), 5)).decode()
    s.thread.join(WAIT_S)
    assert not s.thread.is_alive() and engine.closed == 1


# -- the real openai client ----------------------------------------------------------------------------

def test_openai_client_streaming_and_not(server, engine):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=WAIT_S)
    msgs = [{"role": "user", "content": "Say something."}]
    r = client.chat.completions.create(model="fake-model", messages=msgs, max_tokens=7)
    want = bytes(engine.continuation(list(engine.chat_prompt(msgs).encode()), 7)).decode()
    assert r.choices[0].message.content == want and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 7 and r.usage.prompt_tokens_details.cached_tokens == 0
    stream = client.chat.completions.create(model="fake-model", messages=msgs, max_tokens=7, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    # the fake keeps the whole last prompt: the same conversation again is all reused
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == len(engine.chat_prompt(msgs).encode())
    c = client.completions.create(model="fake-model", prompt="abc", max_tokens=3)
    assert c.choices[0].text == bytes(engine.continuation(list(b"abc"), 3)).decode()
    assert [m.id for m in client.models.list()] == ["fake-model"]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="fake-model", prompt="abc", temperature=5)


def test_openai_client_sees_a_stream_error(server, engine):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=WAIT_S)
    engine.fail_next, engine.fail_after = "stage 2 (cuda:2, pid 77)", 1
    with pytest.raises(openai.APIError, match="stage 2"):
        for _ in client.completions.create(model="fake-model", prompt="x", max_tokens=5, stream=True):
            pass


# -- SIGTERM for real, in a child process -----------------------------------------------------------------

CHILD = r"""
import socket, sys
sys.path[:0] = [{root!r}, {tests!r}]
from test_server import FakeEngine
import strata.serve.server as S

class Engine(FakeEngine):
    def close(self):
        super().close()
        print("CLOSED", flush=True)

engine = Engine()
engine.pause_after = 2
sock = socket.socket(); sock.bind(("127.0.0.1", 0))
print("PORT", sock.getsockname()[1], flush=True)
uv, app = S.make_uvicorn(engine, log_level="warning")
graceful = uv.handle_exit

def on_signal(sig, frame):  # the paused generation (a slow decode) goes on once shutdown has begun
    graceful(sig, frame)
    engine.resume.set()

uv.handle_exit = on_signal
uv.run(sockets=[sock])
"""


def test_sigterm_finishes_the_stream_closes_the_engine_and_exits(tmp_path):
    import os
    import subprocess
    import sys
    script = tmp_path / "child.py"
    tests = os.path.dirname(os.path.abspath(__file__))
    script.write_text(CHILD.format(root=os.path.dirname(tests), tests=tests))
    child = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = child.stdout.readline()
        assert first.startswith("PORT "), child.communicate(timeout=WAIT_S)[1][-2000:]
        port = int(first.split()[1])
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=url, timeout=WAIT_S) as c:
            wait_until(lambda: _up(c), "the child server")
            with c.stream("POST", "/v1/completions", json={"prompt": "bye", "max_tokens": 6, "stream": True}) as r:
                lines = r.iter_lines()
                got = []
                while sum(x.startswith("data:") for x in got) < 2:
                    got.append(next(lines))
                child.send_signal(signal.SIGTERM)  # mid-answer: the generation is paused after 2 tokens
                got += list(lines)
        events = sse_events(got)
        assert events[-1] == (None, "[DONE]")
        text = "".join(json.loads(d)["choices"][0]["text"] for _, d in events[:-1])
        assert text == bytes(FakeEngine().continuation(list(b"bye"), 6)).decode()
        out, err = child.communicate(timeout=WAIT_S)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    assert "CLOSED" in out, err
    assert child.returncode == -signal.SIGTERM, err  # uvicorn re-raises the signal after its graceful exit


def _up(c: httpx.Client) -> bool:
    try:
        return c.get("/health").status_code == 200
    except httpx.TransportError:
        return False


# -- LocalEngine: the in-process reference engine ----------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(3)
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256,
                                   rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    path = tmp_path_factory.mktemp("tiny") / "llama"
    model.save_pretrained(path, safe_serialization=True)
    return model, str(path)


def _gen(engine, ids, n, **kw):
    out = []
    stats = engine.generate(ids, SamplingParams(max_tokens=n, **kw), lambda t: out.append(t) or True)
    return out, stats


def test_local_engine_greedy_matches_transformers(tiny_llama):
    from strata.serve.engine import LocalEngine
    model, path = tiny_llama
    ids = torch.randint(3, 300, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    eng = LocalEngine(path, prefill_chunk=10)  # several prefill chunks
    ours, stats = _gen(eng, ids, 16)
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=2,
                             pad_token_id=2)[0, len(ids):].tolist()
    assert ours == ref[:len(ours)]
    if stats.finish_reason == "stop":
        assert ref[len(ours)] == 2
    else:
        assert len(ours) == 16
    assert (stats.prompt_tokens, stats.reused_tokens, stats.completion_tokens) == (24, 0, len(ours))
    assert eng.max_context == 256 and eng.model_name == "llama"
    from strata.errors import ModelError
    with pytest.raises(ModelError, match="tokenizer"):  # this directory has none: ids only (a 400 when served)
        eng.tokenize("text")


def test_local_engine_prefix_reuse_gives_the_cold_tokens(tiny_llama):
    from strata.serve.engine import LocalEngine
    _, path = tiny_llama
    g = torch.Generator().manual_seed(1)
    doc = torch.randint(3, 300, (40,), generator=g).tolist()
    q1, q2 = torch.randint(3, 300, (5,), generator=g).tolist(), torch.randint(3, 300, (6,), generator=g).tolist()
    warm = LocalEngine(path)
    _gen(warm, doc + q1, 8)
    second, s2 = _gen(warm, doc + q2, 8)
    common = next(i for i, (a, b) in enumerate(zip(doc + q1, doc + q2)) if a != b)
    assert s2.reused_tokens == common >= 40
    # a follow-up that contains the previous answer reuses it too (all but the last token, never fed back)
    follow = doc + q2 + second + q1
    third, s3 = _gen(warm, follow, 8)
    assert s3.reused_tokens == len(doc + q2) + len(second) - 1
    cold = LocalEngine(path)
    assert _gen(cold, doc + q2, 8)[0] == second
    cold.restart()
    assert _gen(cold, follow, 8)[0] == third
    # the same prompt again: everything but the last token is reused, same answer
    again, s4 = _gen(warm, follow, 8)
    assert again == third and s4.reused_tokens == len(follow) - 1


def test_local_engine_stops_when_told_and_at_eos(tiny_llama):
    from strata.serve.engine import LocalEngine
    _, path = tiny_llama
    eng = LocalEngine(path)
    ids = list(range(10, 30))
    seen = []
    stats = eng.generate(ids, SamplingParams(max_tokens=50), lambda t: seen.append(t) or len(seen) < 3)
    assert len(seen) == 3 and stats.completion_tokens == 3 and stats.finish_reason == "stop"
    eng.end_ids = frozenset({seen[0]})  # the first greedy token is now an end of sequence
    out, stats = _gen(eng, ids, 50)
    assert out == [] and stats.finish_reason == "stop"
    out, stats = _gen(eng, list(range(10, 250)), 50)  # the context (256) ends it first
    assert stats.completion_tokens == len(out) <= 16
    eng.close()
    with pytest.raises(EngineError):
        _gen(eng, ids, 2)


@pytest.fixture(scope="module")
def smollm2_server():
    from strata.serve.engine import LocalEngine
    from strata.weights.checkpoint import smollm2_path
    try:
        smollm2_path()
    except Exception as e:
        pytest.skip(str(e))
    eng = LocalEngine("smollm2", max_context=512)
    s = Running(eng)
    yield s, eng
    s.stop()


def test_smollm2_through_the_openai_client(smollm2_server):
    openai = pytest.importorskip("openai")
    s, eng = smollm2_server
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=6)
    text = r.choices[0].message.content
    prompt_len = len(eng.tokenize(eng.chat_prompt(msgs)))
    assert text and r.usage.prompt_tokens == prompt_len and r.usage.completion_tokens == 6
    chunks = list(client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=6, stream=True,
                                                 stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == prompt_len - 1  # the same prompt again
    # too long for the context: refused before it reaches the model, naming the limit
    with pytest.raises(openai.BadRequestError, match="512"):
        client.completions.create(model="smollm2", prompt="word " * 600, max_tokens=1)


SCORE_TEXT = ("The capital of France is Paris. It lies on the Seine, and about two million people live in the "
              "city itself.")


@pytest.fixture(scope="module")
def cli_perplexity(tmp_path_factory):
    """The CLI's perplexity of SCORE_TEXT (a fresh two-stage pipeline, the whole prompt in chunks: the last
    stage's Transformer.nll) and its ids."""
    from strata.head.pipeline import Pipeline
    from strata.weights.checkpoint import smollm2_path
    try:
        smollm2_path()
    except Exception as e:  # noqa: BLE001
        pytest.skip(str(e))
    rig = {k: v for k, v in PIPE_RIG.items() if k != "debug"}
    with Pipeline({**rig, "prompt": {"text": SCORE_TEXT}}, out=tmp_path_factory.mktemp("ppl"), console=False) as p:
        r = p.prefill()
        ids = p.prompt_ids(SCORE_TEXT).tolist()
    assert r.report["perplexity_tokens"] == len(ids) - 1 and r.reused_tokens == 0
    return r.perplexity, ids


def _check_scored_text(client, ids, want_ppl):
    """echo + logprobs=1 + max_tokens=0 through the openai client: exp(-mean) of the prompt's token logprobs is
    the CLI's perplexity of the same ids; the tokens spell the text; the ids form scores the same."""
    r = client.completions.create(model="smollm2", prompt=SCORE_TEXT, echo=True, logprobs=1, max_tokens=0)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == SCORE_TEXT and "".join(lp.tokens) == SCORE_TEXT and len(lp.tokens) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    got = math.exp(-sum(lp.token_logprobs[1:]) / (len(ids) - 1))
    assert abs(got / want_ppl - 1) < 1e-3, (got, want_ppl)
    # the likeliest token's logprob is at least the token's own: the top entry is the row's maximum
    assert all(max(top.values()) >= tl - 1e-6 for top, tl in zip(lp.top_logprobs[1:], lp.token_logprobs[1:]))
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 0
    by_ids = client.completions.create(model="smollm2", prompt=ids, echo=True, logprobs=1, max_tokens=0)
    assert by_ids.choices[0].logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-4)


def _check_greedy_logprobs(client):
    """Greedy tokens are the scoring's likeliest: each generated token's logprob is its top alternative's."""
    r = client.completions.create(model="smollm2", prompt="The capital of France is", logprobs=2, max_tokens=4,
                                  temperature=0)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text and len(lp.tokens) == r.usage.completion_tokens == 4
    for token, tl, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert tl == pytest.approx(max(top.values()), abs=1e-5) and top[token] == tl


def _scored_by_openai(s, cli_perplexity):
    """The real openai client on server s: a text's echo logprobs give the CLI's perplexity, greedy tokens'
    logprobs their top alternative's. Returns the client."""
    openai = pytest.importorskip("openai")
    want_ppl, ids = cli_perplexity
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    _check_scored_text(client, ids, want_ppl)
    _check_greedy_logprobs(client)
    return client


@pytest.mark.slow
def test_smollm2_scoring_and_chat_logprobs_in_process(smollm2_server, cli_perplexity):
    s, eng = smollm2_server
    client = _scored_by_openai(s, cli_perplexity)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=5, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert "".join(e.token for e in content) == r.choices[0].message.content and len(content) == 5
    for e in content:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-5)
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob and bytes(e.bytes).decode() == e.token


# -- the pipeline engine: SmolLM2 on two CPU stages -------------------------------------------------
PIPE_RIG = dict(model="smollm2", stages=[{"device": "cpu", "threads": 1}] * 2, chunk=64, max_context=256,
                progress=False, debug={"delay_s": 0.01})  # a decode step of >= 10 ms: room to kill a stage


@pytest.fixture(scope="module")
def pipeline_server(tmp_path_factory):
    from strata.serve.engine import PipelineEngine
    from strata.weights.checkpoint import smollm2_path
    try:
        smollm2_path()
    except Exception as e:  # noqa: BLE001
        pytest.skip(str(e))
    # max_seqs 1 (the tests below read its one request loop: ring steps, no batches; auto would take 4 here)
    eng = PipelineEngine({**PIPE_RIG, "max_seqs": 1}, out=tmp_path_factory.mktemp("serve"))
    s = Running(eng)
    yield s, eng
    s.stop()
    assert eng.pipe is None  # the worker closed the engine: no stage is left


@pytest.mark.slow
def test_pipeline_engine_greedy_equals_the_cli_continuation(pipeline_server, tmp_path):
    from strata.head.pipeline import Pipeline
    s, eng = pipeline_server
    assert isinstance(eng, Engine) and eng.max_context == 256
    prompt = "The capital of France is"
    with Pipeline({**PIPE_RIG, "generate": 8, "prompt": {"text": prompt}}, out=tmp_path / "cli", console=False) as p:
        want = p.prefill()
    with s.client(timeout=120) as c:
        r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0})
        again = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want.continuation
    assert r.json()["usage"]["completion_tokens"] == len(want.continuation_ids) == 8
    # the same prompt again: all but its last token come from the stages' KV
    n = len(eng.tokenize(prompt))
    assert again.json()["choices"][0]["text"] == want.continuation
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 1
    # max_seqs 1 through the one request loop: each sequence alone, its 7 steps a request round the ring, no batch
    st = eng.slot_stats()
    assert st.sequences >= 2 and st.ring_steps >= 14 and st.batches == 0, st
    with s.client() as c:
        m = parse_prometheus(c.get("/metrics").text)
    busy = [m[("strata_last_prefill_busy_fraction", f'{{stages="{k}"}}')] for k in ("none", "one", "two", "three_plus")]
    assert abs(sum(busy) - 1) < 1e-6 and m[("strata_last_decode_overhead_ms_per_token", "")] > 0


def test_pipeline_engine_scoring_gives_the_cli_perplexity(pipeline_server, cli_perplexity):
    s, eng = pipeline_server
    _scored_by_openai(s, cli_perplexity)


@pytest.mark.slow
def test_pipeline_engine_stage_killed_mid_request_is_503_then_restarts(pipeline_server):
    import os
    s, eng = pipeline_server
    pid = eng.pipe.stages[1].pid
    starts, steps = eng.starts, eng.slot_stats().ring_steps  # (max_seqs 1: the request loop's steps on the ring)
    with s.client(timeout=120) as c:
        lookups = parse_prometheus(c.get("/metrics").text)[("strata_prefix_cache_lookups_total", "")]
        box = {}
        t = threading.Thread(target=lambda: box.update(r=c.post("/v1/completions", json={
            "prompt": "Once upon a time", "max_tokens": 150, "temperature": 0})))
        t.start()
        wait_until(lambda: eng.slot_stats().ring_steps >= steps + 3, "a few decode steps")
        os.kill(pid, signal.SIGKILL)
        t.join(120)
        r = box["r"]
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["stage"].startswith(f"stage 1 (cpu, pid {pid}, chunk ") and "SIGKILL" in err["message"]
        ok = c.post("/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 4})
        m = parse_prometheus(c.get("/metrics").text)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    assert eng.starts == starts + 1 and eng.pipe.stages[1].pid != pid
    # a counter outlives the restart: the killed request's lookup (on the old stages) and the new one's
    assert m[("strata_prefix_cache_lookups_total", "")] == lookups + 2
    assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read()


@pytest.mark.slow
def test_openai_client_alternating_documents_are_served_from_the_prefix_cache(tmp_path):
    """Two documents asked about in turn (A, B, A, B) through the real openai client on two CPU stages: the third
    and fourth requests come from the stages' snapshots (cached_tokens covers the document), with the first two's
    answers (their times are printed: speed is the benchmarks' to judge); /metrics counts the hits and blocks."""
    openai = pytest.importorskip("openai")
    import inspect
    import typing
    from strata.serve.engine import PipelineEngine
    from strata.weights.checkpoint import model_args, smollm2_path
    try:
        smollm2_path()
    except Exception as e:  # noqa: BLE001
        pytest.skip(str(e))
    rig = {k: v for k, v in PIPE_RIG.items() if k != "debug"}
    # prefix_reuse chunks: a repeat's answer has the cold bits (rows: tests/test_prefix_cache.py)
    eng = PipelineEngine({**rig, "chunk": 256, "max_context": 1024, "prefix_reuse": "chunks"}, out=tmp_path / "serve")
    s = Running(eng)
    try:
        src = inspect.getsource(typing)
        docs = [src[:2600], src[20000:22600]]
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        got, metrics = [], [parse_prometheus(httpx.get(s.url + "/metrics").text)]
        for doc in docs + docs:
            t = time.perf_counter()
            r = client.completions.create(model="smollm2", prompt=doc + "\nQ: What does this code define?\nA:",
                                          max_tokens=4, temperature=0)
            got.append((r.choices[0].text, r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens,
                        time.perf_counter() - t))
            metrics.append(parse_prometheus(httpx.get(s.url + "/metrics").text))
        layers = max(b - a for a, b in (st.layers for st in eng.pipe.stages))
    finally:
        s.stop()
    (a1, na, ca1, ta1), (b1, nb, cb1, tb1), (a2, _, ca2, ta2), (b2, _, cb2, tb2) = got
    assert ca1 == 0 and cb1 < 256  # cold: A and B share at most their first tokens
    for n, cached in ((na, ca2), (nb, cb2)):
        # whole blocks of 256 up to the cold prefill's last chunk (prefix_reuse chunks): the document's (~700
        # tokens) but its tail
        assert cached == (n - 1) // 256 * 256 >= 512, (n, cached)
    assert (a2, b2) == (a1, b1)
    # each stage's 2 GiB in blocks of 256 positions of k and v (float32) of its layers, the most layered stage's
    a = model_args("smollm2")
    capacity = (2 << 30) // (layers * 2 * a.n_kv_heads * a.head_dim * 4 * 256)
    assert all(m[("strata_prefix_cache_capacity_blocks", "")] == capacity for m in metrics)
    assert all(m[("strata_prefix_cache_block_tokens", "")] == 256 for m in metrics)
    assert all(metrics[0][(name, "")] == 0 for name in IDLE_GAUGES + PREFIX_COUNTERS)
    assert all(m[("strata_prefix_cache_device_blocks", "")] == 0 for m in metrics)  # CPU stages: no device tier
    # lookups, hits and blocks held after each request: A again is the first hit (B shares no block with A)
    figures = [tuple(m[(name, "")] for name in (*PREFIX_COUNTERS, "strata_prefix_cache_blocks")) for m in metrics[1:]]
    held = na // 256 + nb // 256
    assert figures == [(1, 0, na // 256), (2, 0, held), (3, 1, held), (4, 2, held)], figures
    assert metrics[-1][("strata_running_sequences", "")] == 0
    print(f"\ncold {ta1:.2f} s / {tb1:.2f} s; from the prefix cache {ta2:.2f} s / {tb2:.2f} s")


@contextlib.contextmanager
def _served_launcher(tmp_path, *extra: str, rig_over: dict | None = None):
    """`launcher.py --serve` on the default model's two CPU stages, answering /health: (process, url). Killed
    at the end if still up. extra: more arguments; rig_over: rig keys over PIPE_RIG's."""
    import subprocess
    import sys
    from pathlib import Path
    import yaml
    from strata.weights.checkpoint import smollm2_path
    try:
        smollm2_path()
    except Exception as e:  # noqa: BLE001
        pytest.skip(str(e))
    rig = tmp_path / "rig.yaml"
    rig.write_text(yaml.safe_dump({**{k: v for k, v in PIPE_RIG.items() if k != "debug"}, **(rig_over or {})}))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen([sys.executable, str(root / "launcher.py"), "--config", str(rig), "--serve",
                             "--port", str(port), "--out", str(tmp_path / "out"), *extra], cwd=root,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90  # loading two stages: seconds, more on a loaded machine
        while proc.poll() is None and not _health_ok(url) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.poll() is None, proc.stdout.read()
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_cli_serve_answers_and_sigterm_leaves_nothing(tmp_path):
    """`launcher.py --serve`: answers, then SIGTERM ends the server, its fork server and stages, with no segment
    left."""
    from strata.head.leftovers import Proc, descendants, segments, wait_gone
    with _served_launcher(tmp_path) as (proc, url):
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 4},
                       timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        kids = [Proc(p) for p in descendants(proc.pid)]
        assert len(kids) >= 2  # two stages (and, on a host without GPUs, the fork server they were forked from)
        proc.send_signal(signal.SIGTERM)
        # uvicorn drains and closes the stages, then raises the signal again; the launcher exits 143
        assert proc.wait(30) == 128 + signal.SIGTERM
        assert wait_gone(kids, 10) == []
        assert segments(owner_pid=proc.pid) == []


@pytest.mark.slow
def test_cli_serve_sigterm_exits_after_every_child(tmp_path):
    """When a supervisor sees `launcher.py --serve` exit after SIGTERM, nothing it started is alive: not the
    stages, nor multiprocessing's fork server and resource tracker. A head that died of the signal uvicorn
    raises again left those two running for 0.5-2 s after it."""
    from strata.head.leftovers import Proc, descendants
    with _served_launcher(tmp_path) as (proc, _):
        kids = [Proc(p, open(f"/proc/{p}/cmdline").read().replace("\0", " ")) for p in descendants(proc.pid)]
        assert any("forkserver" in k.what for k in kids), kids  # on this host the CPU stages are its forks
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(30)
        alive = [k for k in kids if k.alive()]  # at once: the moment the head's exit is seen
    assert alive == []
    assert rc == 128 + signal.SIGTERM


@pytest.mark.slow
def test_cli_serve_loads_a_kv_file_before_the_first_request(tmp_path):
    """`launcher.py --serve --kv-load PATH` with max_seqs 2 (through the slot driver into the prefix cache): the
    first request, a prompt that begins with the file's ids, is served from it (the server's cached tokens), with
    the answer a max_seqs 1 pipeline gives after the same file."""
    from strata.head.pipeline import Pipeline
    from strata.text.sampling import SamplingParams
    rig = {**{k: v for k, v in PIPE_RIG.items() if k != "debug"}, "max_context": 512}
    doc = " ".join(f"Item {i} is number {i * 7 % 13}." for i in range(40))
    question = "\nQ: Which number is item 3?\nA:"
    with Pipeline(rig, out=tmp_path / "one", console=False) as p:
        ids = p.prompt_ids(doc)
        assert 256 < ids.size < 500
        p.prefill(ids)
        p.kv_save(tmp_path / "doc.kv")
    with Pipeline(rig, out=tmp_path / "two", console=False) as p:
        p.kv_load(tmp_path / "doc.kv")
        want = p.generate(doc + question, SamplingParams(max_tokens=4, temperature=0))
    with _served_launcher(tmp_path, "--kv-load", str(tmp_path / "doc.kv"), rig_over={"max_context": 512,
                                                                                      "max_seqs": 2}) as (_, url):
        r = httpx.post(f"{url}/v1/completions", json={"prompt": doc + question, "max_tokens": 4, "temperature": 0},
                       timeout=120).json()
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == want.report["reused_tokens"] >= 256
    assert r["choices"][0]["text"] == want.continuation


def _health_ok(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.slow
def test_a_model_without_a_tokenizer_serves_token_ids(tmp_path):
    """A synthetic model (no vocabulary, as a random-block GGUF): token-id prompts are answered with `token_ids`
    (and text ""), streamed or not, the ids the engine generates for them; a text prompt, stop strings, echo and
    logprobs get a one-line 400."""
    from strata.serve.engine import PipelineEngine
    from strata.text.sampling import SamplingParams
    eng = PipelineEngine({"model": "synthetic:smoke", "stages": [{"device": "cpu"}], "max_context": 128,
                          "progress": False, "prompt": {"random": {"tokens": 8, "seed": 0}}}, out=tmp_path / "run")
    s = Running(eng)
    try:
        prompt = [5, 17, 99, 3, 250]
        want: list[int] = []
        eng.generate(prompt, SamplingParams(max_tokens=6, temperature=0), lambda t: want.append(t) or True)
        with s.client() as c:
            r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["token_ids"] == want and choice["text"] == "" and r.json()["usage"]["completion_tokens"] == 6
            with c.stream("POST", "/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0,
                                                           "stream": True}) as st:
                events = sse_events(st.iter_lines())
            streamed = [json.loads(d) for _, d in events if d != "[DONE]"]
            assert [i for e in streamed for ch in e["choices"] for i in ch.get("token_ids", [])] == want
            for extra, field in (({"stop": ["x"]}, "stop"), ({"echo": True}, "echo"), ({"logprobs": 1}, "logprobs")):
                r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, **extra})
                msg = r.json()["error"]["message"]
                assert r.status_code == 400 and "has no tokenizer" in msg and field in msg and "\n" not in msg, msg
            r = c.post("/v1/completions", json={"prompt": "some text", "max_tokens": 2})
            assert r.status_code == 400 and "give prompts as token ids" in r.json()["error"]["message"]
    finally:
        s.stop()
        eng.close()
