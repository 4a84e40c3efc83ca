"""The OpenAI-compatible server, through a real uvicorn on a loopback port, over a deterministic fake engine."""
from __future__ import annotations

import concurrent.futures
import contextlib
import json
import re
import signal
import socket
import threading
import time

import httpx
import pytest
import torch

from strata.chat import ChatTemplate
from strata.engine import Engine, EngineError, GenerationStats
from strata.sampling import Sampler, SamplingParams
from strata.server import make_uvicorn

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
        self.inside = threading.Lock()  # held during generate: a second, overlapping call fails

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def chat_prompt(self, messages) -> str:
        return self.template.render(messages)

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


def test_metrics_text_parses_and_counts(server):
    with server.client() as c:
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
    ("/v1/completions", {"prompt": ["a", "b"]}, "one prompt"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', "temperature"),
    ("/v1/completions", {"prompt": "x", "top_k": 1.5}, "top_k"),
    ("/v1/completions", {"prompt": "x", "seed": -3}, "seed"),
    ("/v1/completions", {"prompt": 17}, "prompt"),
    ("/v1/completions", {"prompt": "x", "model": 3}, "model"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": "y"}}, "include_usage"),
    ("/v1/completions", {"prompt": "x", "logprobs": 3}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "content"),
    ("/v1/chat/completions", {"messages": "hello"}, "non-empty"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, "stop"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "x", "n": 2}, "n=2"),
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
        assert m[("strata_queue_length", "")] == 2 and m[("strata_running", "")] == 1
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
import strata.server as S

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
    from strata.engine import LocalEngine
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
    from strata.engine import LocalEngine
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
    import dataclasses as dc
    from strata.engine import LocalEngine
    _, path = tiny_llama
    eng = LocalEngine(path)
    ids = list(range(10, 30))
    seen = []
    stats = eng.generate(ids, SamplingParams(max_tokens=50), lambda t: seen.append(t) or len(seen) < 3)
    assert len(seen) == 3 and stats.completion_tokens == 3 and stats.finish_reason == "stop"
    eng.args = dc.replace(eng.args, eos_id=seen[0])  # the first greedy token is now the end of sequence
    out, stats = _gen(eng, ids, 50)
    assert out == [] and stats.finish_reason == "stop"
    out, stats = _gen(eng, list(range(10, 250)), 50)  # the context (256) ends it first
    assert stats.completion_tokens == len(out) <= 16
    eng.close()
    with pytest.raises(EngineError):
        _gen(eng, ids, 2)


@pytest.fixture(scope="module")
def smollm2_server():
    from strata.engine import LocalEngine
    from strata.checkpoint import smollm2_path
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


# -- the pipeline engine: SmolLM2 on two CPU stages -------------------------------------------------
PIPE_RIG = dict(model="smollm2", stages=[{"device": "cpu", "threads": 1}] * 2, chunk=64, max_context=256,
                progress=False, debug={"delay_s": 0.01})  # a decode step of >= 10 ms: room to kill a stage


@pytest.fixture(scope="module")
def pipeline_server(tmp_path_factory):
    from strata.engine import PipelineEngine
    from strata.checkpoint import smollm2_path
    try:
        smollm2_path()
    except Exception as e:  # noqa: BLE001
        pytest.skip(str(e))
    eng = PipelineEngine(PIPE_RIG, out=tmp_path_factory.mktemp("serve"))
    s = Running(eng)
    yield s, eng
    s.stop()
    assert eng.pipe is None  # the worker closed the engine: no stage is left


def test_pipeline_engine_greedy_equals_the_cli_continuation(pipeline_server, tmp_path):
    from strata.pipeline import Pipeline
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
    with s.client() as c:
        m = parse_prometheus(c.get("/metrics").text)
    busy = [m[("strata_last_prefill_busy_fraction", f'{{stages="{k}"}}')] for k in ("none", "one", "two", "three_plus")]
    assert abs(sum(busy) - 1) < 1e-6 and m[("strata_last_decode_overhead_ms_per_token", "")] > 0


def test_pipeline_engine_stage_killed_mid_request_is_503_then_restarts(pipeline_server):
    import os
    s, eng = pipeline_server
    pid = eng.pipe.stages[1].pid
    starts, calls = eng.starts, eng.pipe.generations
    with s.client(timeout=120) as c:
        box = {}
        t = threading.Thread(target=lambda: box.update(r=c.post("/v1/completions", json={
            "prompt": "Once upon a time", "max_tokens": 150, "temperature": 0})))
        t.start()
        wait_until(lambda: eng.pipe.generations > calls and eng.pipe.steps >= 3, "a few decode steps")
        os.kill(pid, signal.SIGKILL)
        t.join(120)
        r = box["r"]
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["stage"].startswith(f"stage 1 (cpu, pid {pid}, chunk ") and "SIGKILL" in err["message"]
        ok = c.post("/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 4})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    assert eng.starts == starts + 1 and eng.pipe.stages[1].pid != pid
    assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read()


@contextlib.contextmanager
def _served_launcher(tmp_path):
    """`launcher.py --serve` on the default model's two CPU stages, answering /health: (process, url). Killed
    at the end if still up."""
    import subprocess
    import sys
    from pathlib import Path
    import yaml
    from strata.checkpoint import smollm2_path
    try:
        smollm2_path()
    except Exception as e:  # noqa: BLE001
        pytest.skip(str(e))
    rig = tmp_path / "rig.yaml"
    rig.write_text(yaml.safe_dump({k: v for k, v in PIPE_RIG.items() if k != "debug"}))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen([sys.executable, str(root / "launcher.py"), "--config", str(rig), "--serve",
                             "--port", str(port), "--out", str(tmp_path / "out")], cwd=root,
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


def test_cli_serve_answers_and_sigterm_leaves_nothing(tmp_path):
    """`launcher.py --serve`: answers, then SIGTERM ends the server, its fork server and stages, with no segment
    left."""
    from strata.leftovers import Proc, descendants, segments, wait_gone
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


def test_cli_serve_sigterm_exits_after_every_child(tmp_path):
    """When a supervisor sees `launcher.py --serve` exit after SIGTERM, nothing it started is alive: not the
    stages, nor multiprocessing's fork server and resource tracker. A head that died of the signal uvicorn
    raises again left those two running for 0.5-2 s after it."""
    from strata.leftovers import Proc, descendants
    with _served_launcher(tmp_path) as (proc, _):
        kids = [Proc(p, open(f"/proc/{p}/cmdline").read().replace("\0", " ")) for p in descendants(proc.pid)]
        assert any("forkserver" in k.what for k in kids), kids  # on this host the CPU stages are its forks
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(30)
        alive = [k for k in kids if k.alive()]  # at once: the moment the head's exit is seen
    assert alive == []
    assert rc == 128 + signal.SIGTERM


def _health_ok(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
