"""Several requests in the pipeline at once (the rig's max_seqs > 1, strata/head/slots.py): through the real openai
client on two CPU stages with SmolLM2. Exactness (each request's greedy ids alone and among others), overlap
asserted on the driver's record of what was in flight (not on time: bench/serve_concurrency.py measures that),
the prefix cache and scoring among other requests, a stage killed under several requests, and the refusals."""
from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import inspect
import math
import os
import signal
import threading
import time
import typing

import pytest

from strata.errors import ConfigError

openai = pytest.importorskip("openai")

from test_server import Running, parse_prometheus, wait_until  # noqa: E402 - after the importorskip

# prefix_reuse chunks: a prompt asked again (alone first, then among others) restores its KV only up to a chunk
# boundary of its cold schedule, so its answer has the cold bits and any difference is the concurrency's. (With rows,
# the default, its last token is computed alone, on the decode path: within rounding, and a near-tie may pick another
# token; on an AVX-512 box it did, where the AVX2 box's bits had happened to agree.)
RIG = dict(model="smollm2", stages=[{"device": "cpu", "threads": 1}] * 2, chunk=64, max_context=320,
           progress=False, max_seqs=4, prefix_reuse="chunks")
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):",
           "A long document. " + " ".join(f"Item {i} is number {i * 7 % 13}." for i in range(24))]  # 4 chunks of 64


# long documents (2 full blocks of the prefix cache's 256 tokens and a tail each) in a context that holds them
LONG_RIG = {**RIG, "max_context": 1024}
_SRC = inspect.getsource(typing)
DOCS = [_SRC[:2600], _SRC[20000:22600]]
QUESTION = "\nQ: What does this code define?\nA:"


def _smollm2():
    from strata.weights.checkpoint import smollm2_path
    try:
        smollm2_path()
    except Exception as e:  # noqa: BLE001
        pytest.skip(str(e))


def _recording(eng) -> dict:
    """Wrap eng.generate: each call's generated ids, by prompt ids (what the openai client's text hides)."""
    got: dict[tuple, list[list[int]]] = collections.defaultdict(list)
    lock = threading.Lock()
    generate = eng.generate

    def recorded(ids, params, on_token):
        made: list[int] = []
        try:
            return generate(ids, params, lambda t: made.append(t) or on_token(t))
        finally:
            with lock:
                got[tuple(ids)].append(made)
    eng.generate = recorded
    return got


@pytest.fixture(scope="module")
def slotted(tmp_path_factory):
    _smollm2()
    from strata.serve.engine import PipelineEngine
    eng = PipelineEngine(RIG, out=tmp_path_factory.mktemp("slots"))
    s = Running(eng, queue_size=4)
    yield s, eng
    s.stop()
    assert eng.pipe is None


@pytest.mark.slow
def test_concurrent_greedy_equals_alone_and_steps_overlap(slotted):
    """4 requests at once (one streamed, one with a 4-chunk prompt) give each the ids it gets alone, while the
    driver had two or more sequences in the pipeline at once, sent decode steps between a prefill's chunks, and
    stepped several sequences in one decode batch."""
    s, eng = slotted
    got = _recording(eng)
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=300)

    def ask(p: str, stream: bool = False) -> str:
        if stream:
            parts = client.completions.create(model="smollm2", prompt=p, max_tokens=16, temperature=0, stream=True)
            return "".join(c.choices[0].text for c in parts if c.choices)
        return client.completions.create(model="smollm2", prompt=p, max_tokens=16, temperature=0).choices[0].text

    alone = [ask(p) for p in PROMPTS]
    before = eng.slot_stats().most_in_flight, eng.slot_stats().prefill_interleaved
    assert before[0] == 1  # one at a time: nothing overlapped yet
    texts: dict[int, str] = {}
    threads = [threading.Thread(target=lambda i=i, p=p: texts.__setitem__(i, ask(p, stream=i == 1)))
               for i, p in enumerate(PROMPTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert [texts[i] for i in range(len(PROMPTS))] == alone
    for p in PROMPTS:
        ids = got[tuple(eng.tokenize(p))]
        assert len(ids) == 2 and ids[0] == ids[1] and len(ids[0]) > 0, (p, ids)
    st = eng.slot_stats()
    assert st.most_in_flight >= 2, st          # two sequences' micro-batches in the pipeline at once
    assert st.overlapped_sends > 0, st
    assert st.prefill_interleaved > before[1], st  # decode steps went in between the long prompt's chunks
    assert st.most_in_batch >= 2 and st.batches < st.steps, st  # several sequences' steps in one micro-batch
    assert st.prefill_groups == 0, st  # (prefix_reuse chunks: each prompt's chunks alone, the cold bits)
    with s.client(timeout=30) as c:
        m = parse_prometheus(c.get("/metrics").text)
    assert m[("strata_kv_slots", "")] == 4 and m[("strata_kv_slots_in_use", "")] == 0
    assert m[("strata_decode_batch_steps_total", "")] == st.steps and m[("strata_decode_batches_total", "")] == st.batches
    assert m[("strata_decode_batch_rows_max", "")] == st.most_in_batch
    # each batch's round: its trip through the stages and the head's turnaround before it, both spent
    trip, turn = m[("strata_decode_batch_trip_seconds_total", "")], m[("strata_decode_batch_turnaround_seconds_total", "")]
    assert trip == pytest.approx(st.batch_trip_s, abs=1e-5) and 0 < trip and 0 < turn < trip, (trip, turn)


def test_n_choices_run_side_by_side_and_each_is_its_request_alone(slotted):
    """With max_seqs 4 a request's choices (n, a batch of prompts) run as sequences side by side: the driver had
    them in the pipeline at once (most in flight), and choice j is the request alone with seed + j."""
    s, eng = slotted
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    req = dict(model="smollm2", prompt=PROMPTS[1], max_tokens=12, temperature=0.9, seed=5)
    alone = [client.completions.create(**{**req, "seed": 5 + j}).choices[0].text for j in range(3)]
    before = eng.slot_stats().sequences
    eng._slots.stats.most_in_flight = 0  # (this request's own record)
    got = client.completions.create(**req, n=3)
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == alone
    assert len(set(alone)) > 1  # the seeds matter
    st = eng.slot_stats()
    assert st.sequences - before == 3 and st.most_in_flight >= 2, st


@pytest.mark.slow
def test_a_client_that_disconnects_frees_its_slot(slotted):
    """A stream closed after a few tokens ends its sequence (long before its max_tokens; its slot is free again),
    and only its own: a request decoding meanwhile goes on to its ids alone; a next request is served."""
    from strata.text.sampling import SamplingParams
    s, eng = slotted
    got_ids = _recording(eng)
    greedy = SamplingParams(max_tokens=250, temperature=0)
    ids = eng.tokenize(PROMPTS[1])  # (its greedy answer runs past 300 tokens without an end of sequence)
    alone, other, started = [], [], threading.Event()
    eng.generate(ids, greedy, alone.append)
    t = threading.Thread(target=lambda: eng.generate(ids, greedy, lambda x: other.append(x) or started.set()))
    t.start()
    try:
        assert started.wait(120)
        with s.client(timeout=120) as c:
            with c.stream("POST", "/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 200,
                                                           "temperature": 0, "stream": True}) as r:
                got, m = [], None
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        got.append(line)
                    if len(got) == 1 and m is None:  # /metrics while both run: the server's one, the engine's two
                        with s.client(timeout=30) as c2:
                            m = parse_prometheus(c2.get("/metrics").text)
                    if len(got) >= 3:
                        break
            assert m[("strata_running_sequences", "")] == 1 and m[("strata_kv_slots_in_use", "")] == 2, m
            wait_until(lambda: eng._slots.running <= 1, "the disconnected sequence to end")
            alive = t.is_alive()  # (the other had not finished: it was running when this one ended)
            r = c.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0})
    finally:
        t.join(300)
    streamed = [n for n in map(len, got_ids[tuple(ids)]) if n != 250]  # (alone and the other made 250)
    assert len(streamed) == 1 and 3 <= streamed[0] < 100, got_ids  # (not its 200: the disconnect ended it)
    assert alive and other == alone and len(alone) == 250, (alive, len(other), len(alone))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    wait_until(lambda: len(eng._slots._free) == eng._slots.max_seqs, "every slot to be free")


def test_the_next_step_goes_before_the_callers_callbacks(slotted):
    """The driver hands a decode step's token to its caller after sending the step that follows, so the stages work
    while the callbacks run: a lone sequence's callback sees that step in the pipeline at every token but the first
    (handed over from the prompt's last chunk at once) and the last (no step follows). A caller that stops at a token
    while the next step is out ends there: its ids are the first of its ids alone, the count that many; the wasted
    step is reaped before its slot is free again, and the next request gets its ids alone."""
    from strata.text.sampling import SamplingParams
    s, eng = slotted
    ids = eng.tokenize(PROMPTS[1])
    greedy = SamplingParams(max_tokens=10, temperature=0)
    alone, seen = [], []
    eng.generate(ids, greedy, lambda t: alone.append(t) or seen.append(eng.pipe.in_flight))
    assert len(alone) == 10 and seen[0] == 0 and seen[-1] == 0 and min(seen[1:-1]) >= 1, seen
    first = []
    eng.generate(eng.tokenize(PROMPTS[0]), greedy, first.append)
    made, steps = [], eng.slot_stats().steps
    stats = eng.generate(ids, greedy, lambda t: made.append(t) or len(made) < 3)
    assert made == alone[:3] and stats.completion_tokens == 3 and stats.finish_reason == "stop", (made, stats)
    wait_until(lambda: len(eng._slots._free) == eng._slots.max_seqs, "the stopped sequence's slot to be free")
    assert eng.slot_stats().steps - steps == 3  # its steps on tokens 1 to 3: the third one's was sent, not used
    again = []
    eng.generate(eng.tokenize(PROMPTS[0]), greedy, again.append)
    assert again == first and len(first) == 10


def test_slotted_refusals_are_one_line(slotted, tmp_path):
    """With max_seqs > 1: kv_save is refused naming max_seqs, and Pipeline.kv_load naming the driver (the engine's
    kv_load goes through it); the prefix cache is on; Pipeline.score on the engine's pipeline (a second loop beside
    the engine's, which owns it) is refused naming the engine."""
    s, eng = slotted
    from strata.kvcache.kv_file import KvFileError
    with pytest.raises(KvFileError, match="max_seqs 4"):
        eng.kv_save(tmp_path / "kv.bin")
    with pytest.raises(KvFileError, match="max_seqs 4 the slot driver loads"):
        eng.pipe.kv_load(tmp_path / "kv.bin")
    assert eng.pipe.kv.prefix_cache_off is None
    with pytest.raises(ConfigError, match="driven by its engine's request loop"):
        eng.pipe.score([1, 2, 3])
    log = (eng.out / "stage-0.log").read_text()
    assert "KV slots: 4 sequences" in log
    from strata.comm import messages as M
    with pytest.raises(M.BadMessage, match="negative slot"):
        M.encode(M.Chunk(k=0, kind=M.Kind.STEP, pos=0, n=1, t0=0.0, tokens=1, score=-1, slot=-1))


@pytest.fixture(scope="module")
def slotted_long(tmp_path_factory):
    _smollm2()
    from strata.serve.engine import PipelineEngine
    # prefix_reuse chunks (RIG's): a repeat's answer has the cold bits (rows: tests/test_prefix_cache.py).
    # decode_weights none: float32 decode steps, as the scoring's float32 prefill, so a greedy token is the likeliest
    # in its scores to float32 rounding (on the blocks the steps' int8 products move log-probabilities by up to ~0.3)
    eng = PipelineEngine({**LONG_RIG, "decode_weights": "none"}, out=tmp_path_factory.mktemp("slots-long"))
    s = Running(eng, queue_size=4)
    yield s, eng
    s.stop()
    assert eng.pipe is None


@contextlib.contextmanager
def _decoding_meanwhile(client, prompt: str = "Once upon a time"):
    """A streamed greedy request decoding in the background (its answer runs past 300 tokens without an end of
    sequence), closed at the end -> a function: (tokens it has had, whether it still runs)."""
    got, stop, ended = [], threading.Event(), threading.Event()

    def run():
        try:
            with client.completions.create(model="smollm2", prompt=prompt, max_tokens=900, temperature=0,
                                           stream=True) as stream:
                for c in stream:
                    got.append(c)
                    if stop.is_set():
                        break
        finally:
            ended.set()
    t = threading.Thread(target=run)
    t.start()
    wait_until(lambda: len(got) >= 2 or ended.is_set(), "the background request to decode")
    try:
        yield lambda: (len(got), not ended.is_set())
    finally:
        stop.set()
        t.join(60)


@pytest.mark.slow
def test_alternating_documents_come_from_the_prefix_cache_among_other_requests(slotted_long):
    """Two documents asked about in turn (A, B, A, B) through the openai client while another request decodes: the
    repeats restore their documents' blocks into their slots (cached_tokens, the driver's record) and answer as
    cold; a repeat's answer scored by logprobs (its prompt's blocks restored again) has greedy tokens' logprobs."""
    s, eng = slotted_long
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=600)
    before, cache = eng.slot_stats(), eng.prefix_cache_stats()
    restores, restored = before.restores, before.restored_tokens
    got = []
    with _decoding_meanwhile(client) as background:
        seen = background()[0]
        for doc in DOCS + DOCS:
            r = client.completions.create(model="smollm2", prompt=doc + QUESTION, max_tokens=8, temperature=0)
            got.append((r.choices[0].text, r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens))
        scored = client.completions.create(model="smollm2", prompt=DOCS[0] + QUESTION, max_tokens=4, temperature=0,
                                           logprobs=1)
        tokens, running = background()
    assert running and tokens > seen, (tokens, seen)  # the other request decoded all along
    (a1, na, ca1), (b1, nb, cb1), (a2, _, ca2), (b2, _, cb2) = got
    assert ca1 == cb1 == 0  # cold: A and B share no block
    for n, cached in ((na, ca2), (nb, cb2)):
        assert cached == (n - 1) // 256 * 256 >= 512, (n, cached)  # whole blocks up to the prompt's last token
    assert (a2, b2) == (a1, b1) and a1 and b1
    st = eng.slot_stats()
    # A and B again, then A's generate and the scoring of its answer (prompt and answer: A's blocks restored)
    assert st.restores - restores == 4 and st.restored_tokens - restored == ca2 + cb2 + 2 * ca2, st
    assert st.most_in_flight >= 2, st
    now = eng.prefix_cache_stats()  # a lookup a sequence: the background's, 4 documents, the scored one's 2
    assert (now.lookups - cache.lookups, now.hits - cache.hits) == (7, 4), (cache, now)
    lp = scored.choices[0].logprobs
    assert scored.usage.prompt_tokens_details.cached_tokens == ca2
    assert "".join(lp.tokens) == scored.choices[0].text and a1.startswith(scored.choices[0].text)
    for token, tl, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == tl == pytest.approx(max(top.values()), abs=1e-5)  # greedy: the likeliest


@pytest.mark.slow
def test_scoring_among_other_requests_equals_max_seqs_1(slotted_long, tmp_path):
    """echo + logprobs=2 + max_tokens=0 of a 4-chunk text while another request decodes: the same log-probabilities
    and alternatives as Pipeline.score with max_seqs 1 (within 1e-4), their perplexity the CLI's (within 1e-3)."""
    s, eng = slotted_long
    from strata.head.pipeline import Pipeline
    text = PROMPTS[3]
    with Pipeline({**LONG_RIG, "max_seqs": 1, "prompt": {"text": text}}, out=tmp_path / "one", console=False) as p:
        want_ppl = p.prefill().perplexity
        ids = p.prompt_ids(text)
        assert ids.size > 3 * 64
        want_lp, want_ids, want_top = p.score(ids, 1, 2)
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=600)
    with _decoding_meanwhile(client) as background:
        seen = background()[0]
        before = eng.slot_stats().prefill_interleaved
        eng._slots.stats.most_chunks_between_steps = 0  # (this request's own record)
        r = client.completions.create(model="smollm2", prompt=text, echo=True, logprobs=2, max_tokens=0)
        # the driver's record, not the clock: the other request's steps went between the scored text's chunks (a
        # stage works in order, so its step in flight comes back before their first result, and the next one goes),
        # never more than the window of them between two of its steps
        st = eng.slot_stats()
        interleaved = st.prefill_interleaved - before
        wait_until(lambda: background()[0] > seen or not background()[1], "the background request to decode on")
        tokens, running = background()
    assert interleaved >= 1 and st.most_chunks_between_steps <= eng._slots.window, st
    assert running and tokens > seen, (tokens, seen)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == text and "".join(lp.tokens) == text and len(lp.tokens) == ids.size
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(want_lp.tolist(), abs=1e-4)
    for token, tl, top, which, values in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:],
                                             want_ids.tolist(), want_top.tolist()):
        want = {eng.detokenize([t]): pytest.approx(v, abs=1e-4) for t, v in zip(which, values)}
        if token not in want:  # an entry holds the token itself too
            want[token] = tl
        assert top == want
    got_ppl = math.exp(-sum(lp.token_logprobs[1:]) / (ids.size - 1))
    assert abs(got_ppl / want_ppl - 1) < 1e-3, (got_ppl, want_ppl)


@pytest.mark.slow
@pytest.mark.parametrize("decoding", [1, 3])
def test_a_long_prompt_holds_a_decoding_request_up_by_at_most_the_window(slotted_long, decoding):
    """A 12-chunk prompt sent while 1 or 3 other requests decode: its chunks take turns with their steps, so between
    two steps of one of them the driver sent at most as many prefill micro-batches as it keeps in flight (n_stages
    + 1; a scheduler that sent the prompt's chunks first would hold them up by all 12, and one whose decode batches
    of 2 waited to be full left the third request out for 4). /metrics says so."""
    s, eng = slotted_long
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=600)
    doc = _SRC[30000 + 4000 * decoding:33200 + 4000 * decoding]  # (texts no other test sends: not in the cache)
    with contextlib.ExitStack() as stack:
        background = [stack.enter_context(_decoding_meanwhile(client)) for _ in range(decoding)]
        eng._slots.stats.most_chunks_between_steps = 0  # (this prompt's own record)
        chunks = eng.slot_stats().chunks
        r = client.completions.create(model="smollm2", prompt=doc, max_tokens=2, temperature=0)
        st = eng.slot_stats()
        running = all(b()[1] for b in background)
    assert running and r.usage.prompt_tokens_details.cached_tokens == 0
    assert st.chunks - chunks >= 12 and 1 <= st.most_chunks_between_steps <= eng._slots.window, st
    with s.client(timeout=30) as c:
        m = parse_prometheus(c.get("/metrics").text)
    assert m[("strata_prefill_chunks_between_steps_max", "")] == st.most_chunks_between_steps


@pytest.mark.slow
def test_a_kv_file_loads_among_other_requests_into_the_prefix_cache(slotted_long, tmp_path):
    """max_seqs > 1: the engine's kv_load reads a KV file (a max_seqs 1 pipeline's) into a free slot while another
    request decodes (the driver admits it beside that request, which decodes on), then its blocks into the prefix
    cache: a prompt that begins with its ids restores them (the driver counts the file's whole blocks restored) and
    gets the max_seqs 1 pipeline's greedy ids. A file that is not one is refused in one line."""
    import numpy as np
    from strata.kvcache.kv_file import KvFileError
    from strata.head.pipeline import Pipeline
    from strata.text.sampling import SamplingParams
    s, eng = slotted_long
    greedy = SamplingParams(max_tokens=8, temperature=0)
    with Pipeline({**LONG_RIG, "decode_weights": "none", "max_seqs": 1}, out=tmp_path / "one", console=False) as p:
        doc = p.prompt_ids(_SRC[40000:42600])
        prompt = np.concatenate([doc, p.prompt_ids(QUESTION)])
        assert 512 < doc.size < 768
        p.prefill(doc)
        p.kv_save(tmp_path / "doc.kv")
        want = p.generate(prompt, greedy).continuation_ids  # (the live KV's rows up to a chunk boundary: cold bits)
    before = dataclasses.replace(eng.slot_stats())  # (a copy: the driver's own object moves on)
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=600)
    with _decoding_meanwhile(client) as background:
        seen = background()[0]
        got = eng.kv_load(tmp_path / "doc.kv")
        loaded_among = eng.slot_stats().loads_among_running - before.loads_among_running
        # the other request goes on decoding (whether a token came during the load is a matter of time: a ~600-token
        # file can load within one token's step, so the driver's record says the load went in beside it)
        wait_until(lambda: background()[0] > seen or not background()[1], "the background request to decode on")
        tokens, running = background()
    assert loaded_among == 1 and running and tokens > seen, (loaded_among, tokens, seen)
    assert got["tokens"] == doc.size and list(got["ids"]) == list(doc)
    made = []
    eng.generate(prompt, greedy, made.append)
    assert made == want and want
    # the file's two whole blocks (prefix_reuse chunks)
    assert eng.slot_stats().restored_tokens - before.restored_tokens == 512
    (tmp_path / "junk.kv").write_bytes(b"not a kv file" * 10)
    with pytest.raises(KvFileError, match="is not a Strata KV file"):
        eng.kv_load(tmp_path / "junk.kv")


@pytest.mark.slow
def test_a_restore_among_chunks_in_flight_keeps_their_results(tmp_path):
    """KvRounds.restore, the driver's KV round, while another slot's prefill chunks are queued on the stages,
    and again while their results wait unread at the head: every result comes back through take_results, and both
    sequences' first tokens are their cold ones (the restored slot prefilled from its restored prefix, with
    prefix_reuse chunks)."""
    _smollm2()
    from strata.head.pipeline import Pipeline
    from strata.text.sampling import SamplingParams
    # prefix_reuse chunks: the restore stops at the cold chunk boundary (256), so doc's first token has the cold bits
    with Pipeline({**LONG_RIG, "max_seqs": 2, "prefix_reuse": "chunks"}, out=tmp_path, console=False) as p:
        doc, other = p.prompt_ids(DOCS[0][:1200] + QUESTION), p.prompt_ids(PROMPTS[3])
        assert doc.size > 256 and len(p.plan.schedule_for(0, other.size)) == 4
        cold = [p.generate(ids, SamplingParams(max_tokens=1)).continuation_ids[0] for ids in (doc, other)]
        # (slot 0 alone, as the CLI: doc's block went into the prefix cache)
        t0 = p.begin_slots()
        p.put_slot_ids(0, other)
        p.put_slot_ids(1, doc)
        chunks = list(p.plan.schedule_for(0, other.size))
        sent = [p.send_slot(0, pos, n, "prefill", other.size, t0, row=False) for pos, n in chunks[:3]]
        assert p.kv.restore(doc, 0, doc.size - 1, 1) == 256  # the stages have other's chunks queued or running
        time.sleep(3)  # the first one's result reaches the head, unread (the last stage waits for its "taken")
        assert p.kv.restore(doc, 0, doc.size - 1, 1) == 256
        assert p.in_flight < len(sent)  # read during the round
        results = p.take_results(0)
        assert [k for k, _, _ in results][:1] == sent[:1]  # kept for take_results
        last = {0: p.send_slot(0, *chunks[3], "prefill", other.size, t0, row=False)}
        for pos, n in p.plan.schedule_for(256, doc.size):
            last[1] = p.send_slot(1, pos, n, "prefill", doc.size, t0, row=False)
            wait = time.monotonic() + 300
            while p.in_flight and time.monotonic() < wait:
                results += p.take_results(100)
        assert [k for k, _, _ in results] == list(range(last[1] + 1))  # every chunk's result, once
        argmax = {k: res.argmax for k, res, _ in results}
        assert [argmax[last[0]], argmax[last[1]]] == [cold[1], cold[0]]
        assert p.prefix_cache_stats().hits == 2


@pytest.mark.slow
def test_stage_killed_under_three_requests_fails_each_then_serves(tmp_path):
    """SIGKILL of stage 1 while 3 requests decode: each gets a 503 (the streamed one an SSE error), the stages are
    started again once, the next request succeeds; at the end no process or segment of any run is left."""
    _smollm2()
    from strata.serve.engine import PipelineEngine
    from strata.head.leftovers import Proc, segments, wait_gone
    eng = PipelineEngine({**RIG, "max_seqs": 3, "debug": {"delay_s": 0.01}}, out=tmp_path / "serve")
    s = Running(eng, queue_size=2)
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    stages, runs = [Proc(p.pid) for p in eng.pipe.procs.res.procs], [(eng.pipe.run_id, eng.pipe.procs.res.ipc_dir)]
    try:
        pid, starts = eng.pipe.stages[1].pid, eng.starts
        errors: dict[int, BaseException] = {}

        def ask(i: int) -> None:
            try:
                if i == 0:
                    for _ in client.completions.create(model="smollm2", prompt=PROMPTS[i], max_tokens=200,
                                                       temperature=0, stream=True):
                        pass
                else:
                    client.completions.create(model="smollm2", prompt=PROMPTS[i], max_tokens=200, temperature=0)
            except openai.APIError as e:
                errors[i] = e
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        wait_until(lambda: eng._slots.running == 3 and eng.slot_stats().steps >= 9, "3 sequences decoding")
        os.kill(pid, signal.SIGKILL)
        for t in threads:
            t.join(120)
        assert sorted(errors) == [0, 1, 2], errors
        for i in (1, 2):
            assert isinstance(errors[i], openai.APIStatusError) and errors[i].status_code == 503, errors[i]
            assert "SIGKILL" in str(errors[i]) and f"pid {pid}" in str(errors[i])
        assert "SIGKILL" in str(errors[0])  # the stream's error event
        ok = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=4)
        assert ok.usage.completion_tokens == 4
        assert eng.starts == starts + 1 and eng.pipe.stages[1].pid != pid  # restarted once, not once per request
        stages += [Proc(p.pid) for p in eng.pipe.procs.res.procs]
        runs.append((eng.pipe.run_id, eng.pipe.procs.res.ipc_dir))
    finally:
        s.stop()
    assert eng.pipe is None
    assert wait_gone(stages, 10) == []
    assert all(segments(run_id=r) == [] for r, _ in runs)  # shared memory
    assert not any(os.path.exists(d) for _, d in runs)      # the ipc sockets' directories


@pytest.mark.slow
def test_cli_generate_with_max_seqs_2_equals_max_seqs_1(tmp_path):
    """Pipeline.generate (the CLI's one sequence, slot 0) on stages that hold 2 slots gives max_seqs 1's tokens."""
    _smollm2()
    from strata.head.pipeline import Pipeline
    got = {}
    for m in (1, 2):
        with Pipeline({**RIG, "max_seqs": m, "generate": 8, "prompt": {"text": PROMPTS[0]}}, out=tmp_path / str(m),
                      console=False) as p:
            got[m] = p.prefill().continuation_ids
    assert got[1] == got[2] and len(got[1]) == 8


def test_max_seqs_counts_in_the_plan_and_refusals(tmp_path):
    """The planner counts max_seqs caches (and refuses with numbers); the rig refuses what slots cannot do."""
    _smollm2()
    from strata.plan.plan import build_plan
    from strata.config import from_dict
    base = dict(model="smollm2", stages=[{"device": "cpu"}] * 2, layer_split=[15, 15], chunk=64, max_context=2048,
                progress=False)
    one = build_plan(from_dict(base)).planner["needs"]
    four = build_plan(from_dict({**base, "max_seqs": 4})).planner["needs"]
    assert [n["kv_cache"] for n in four] == [4 * n["kv_cache"] for n in one]
    cap = max(n["total"] + n["kv_cache"] for n in one)  # room for two sequences' KV, not for four
    capped = {**base, "stages": [{"device": "cpu", "memory": cap}] * 2}
    build_plan(from_dict({**capped, "max_seqs": 2}))
    with pytest.raises(ConfigError, match="for 4 sequences"):
        build_plan(from_dict({**capped, "max_seqs": 4}))
    with pytest.raises(ConfigError, match="max_seqs 2 refused: depth 0"):
        from_dict({**base, "max_seqs": 2, "depth": 0})
    with pytest.raises(ConfigError, match="max_seqs 2 refused: dump_residual"):
        from_dict({**base, "max_seqs": 2, "dump_residual": True})
    with pytest.raises(ConfigError, match="max_seqs"):
        from_dict({**base, "max_seqs": 0})
    # a hybrid model: its linear-attention layers' states a slot each, counted with the KV
    q35 = {**base, "model": "synthetic:qwen3.5-27b", "layer_split": "auto", "stages": [{"device": "cpu", "memory": 2 ** 36}] * 2, "prompt": {"random": {"tokens": 8}}}
    one, two = (build_plan(from_dict({**q35, "max_seqs": m})).planner["needs"] for m in (1, 2))
    assert [n["kv_cache"] for n in two] == [2 * n["kv_cache"] for n in one]


@pytest.mark.slow
def test_a_hybrid_model_serves_several_sequences_each_as_alone(tmp_path):
    """A tiny Qwen3.5 (Gated DeltaNet layers beside full attention) with max_seqs 3 on two CPU stages: three
    prompts of several chunks sent at once give each the greedy ids it gets from a max_seqs 1 engine, while the
    driver had several sequences in the pipeline (each slot its own recurrent states)."""
    import numpy as np
    from families_fixtures import make_hf
    from strata.serve.engine import PipelineEngine
    from strata.text.sampling import SamplingParams
    _, d = make_hf(tmp_path, "qwen3_5")
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 200, n).tolist() for n in (70, 33, 51)]
    cfg = dict(model=d, stages=[{"device": "cpu", "threads": 1}] * 2, chunk=16, max_context=128, progress=False,
               prompt={"random": {"tokens": 10, "seed": 0}})
    got = {}
    for m in (1, 3):
        eng = PipelineEngine({**cfg, "max_seqs": m}, out=tmp_path / f"eng{m}")
        try:
            made = [[] for _ in prompts]
            threads = [threading.Thread(target=eng.generate, args=(ids, SamplingParams(max_tokens=8, temperature=0),
                                                                   made[i].append))
                       for i, ids in enumerate(prompts)]
            for t in threads:  # (max_seqs 1: one at a time, as the server's single worker sends them)
                t.start()
                if m == 1:
                    t.join(300)
            for t in threads:
                t.join(300)
            got[m] = (made, eng.slot_stats() if m > 1 else None)
        finally:
            eng.close()
    (alone, _), (together, st) = got[1], got[3]
    assert together == alone and all(len(x) == 8 for x in alone)
    assert st.sequences == 3 and st.most_in_flight >= 2 and st.overlapped_sends > 0, st


@pytest.mark.slow
def test_batch_ahead_on_one_stage_gives_each_its_tokens_alone(tmp_path):
    """batch_ahead 3 on one CPU stage: 4 greedy sequences at once, token limits that are not a multiple of 4 (the
    last batch's steps clamped to what each row may still take), give each the ids it gets alone with batch_ahead 0;
    the batches ran steps past their notes (more steps than a note's rows could hold without); a sampled request's
    batches run none. The refusals are one line each."""
    _smollm2()
    from strata.config import from_dict
    from strata.serve.engine import PipelineEngine
    from strata.text.sampling import SamplingParams
    rig = {**RIG, "stages": [{"device": "cpu", "threads": 1}], "decode_batch": "steps"}
    limits = [13, 6, 9, 2]

    def run(ahead: int, together: bool) -> tuple[list[list[int]], object]:
        eng = PipelineEngine({**rig, "batch_ahead": ahead}, out=tmp_path / f"a{ahead}{together}")
        try:
            got: dict[int, list[int]] = {}

            def one(i: int) -> None:
                made: list[int] = []
                eng.generate(eng.tokenize(PROMPTS[i]), SamplingParams(max_tokens=limits[i]),
                             lambda t: made.append(t) or True)
                got[i] = made
            if together:
                threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(300)
            else:
                for i in range(4):
                    one(i)
            st = copy.copy(eng.slot_stats())
            eng.generate(eng.tokenize(PROMPTS[0]), SamplingParams(max_tokens=5, temperature=0.8, seed=1),
                         lambda t: True)
            after = eng.slot_stats()
            assert after.steps - st.steps == after.batches - st.batches >= 1, (st, after)  # sampled: one step a note
            return [got[i] for i in range(4)], st
        finally:
            eng.close()
    alone, _ = run(0, False)
    ahead, st = run(3, True)
    assert ahead == alone and [len(a) for a in alone] == limits, (ahead, alone)
    assert st.steps > st.batches * st.most_in_batch, st  # a note's batch ran past its own step
    base = dict(model="smollm2", stages=[{"device": "cpu"}], progress=False)
    with pytest.raises(ConfigError, match=r"^batch_ahead: 0 to 64 steps, got 65$"):
        from_dict({**base, "max_seqs": 2, "batch_ahead": 65})
    with pytest.raises(ConfigError, match="^batch_ahead: decode batches need max_seqs > 1"):
        from_dict({**base, "max_seqs": 1, "batch_ahead": 2})
    assert from_dict({**base, "batch_ahead": 2}).max_seqs == "auto"  # (checked once the plan resolves it)
    with pytest.raises(ConfigError, match="^batch_ahead: expected 'auto' or a number of steps, got 'soon'$"):
        from_dict({**base, "max_seqs": 2, "batch_ahead": "soon"})
    assert from_dict(base).batch_ahead == "auto"  # (one CUDA stage: AUTO_BATCH_AHEAD; a CPU stage: 0)
    assert from_dict(base).prefill_groups == "auto"  # (GPU stages only)
    with pytest.raises(ConfigError, match="^prefill_groups: expected auto or true or false, got 'yes'$"):
        from_dict({**base, "max_seqs": 2, "prefill_groups": "yes"})
    with pytest.raises(ConfigError, match="^prefill_groups: a group is several sequences' chunks; it needs max_seqs"):
        from_dict({**base, "max_seqs": 1, "prefill_groups": True})
    from strata.comm import messages as M
    batch = dict(k=0, kind=M.Kind.BATCH, pos=0, n=1, t0=0.0, tokens=9, score=-1, seqs=[0, 8])
    M.encode(M.Chunk(**batch, rows=False, ahead=3))
    for bad in (dict(batch, rows=True, ahead=1), dict(batch, rows=False, ahead=65),
                dict(batch, kind=M.Kind.STEP, seqs=[], ahead=1, rows=False)):
        with pytest.raises(M.BadMessage, match="ahead"):
            M.encode(M.Chunk(**bad))


def test_a_spinning_driver_gives_each_its_tokens_alone(slotted):
    """kernels.slot_spin (on all-GPU rigs only; forced here on two CPU stages): the driver polls without sleeping
    while micro-batches are in flight, and three greedy requests at once still get each its ids alone; it did spin
    (its busy loop took results with no wait)."""
    from strata.text.sampling import SamplingParams
    s, eng = slotted
    driver = eng._slots
    greedy = SamplingParams(max_tokens=12, temperature=0)

    def run(i, box):
        made = []
        eng.generate(eng.tokenize(PROMPTS[i]), greedy, lambda t: made.append(t) or True)
        box[i] = made
    alone = {}
    for i in range(3):
        run(i, alone)
    polls = []
    take = driver.pipe.take_results
    driver.pipe.take_results = lambda ms: polls.append(ms) or take(ms)
    driver.spin = True
    try:
        together = {}
        threads = [threading.Thread(target=run, args=(i, together)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
    finally:
        driver.spin = False
        driver.pipe.take_results = take
    assert together == alone and all(alone.values())
    assert polls.count(0) > len(polls) // 2, (polls.count(0), len(polls))


def test_prefill_group_notes_validated():
    """A prefill group's note names [slot, pos] and the rows of each sequence, its rows in all, each slot once, one
    KV-pool span a sequence or none, unscored, no state kept, no steps ahead; anything else is a BadMessage."""
    from strata.comm import messages as M
    group = dict(k=0, kind=M.Kind.GROUP, pos=0, n=12, t0=0.0, tokens=40, score=-1, seqs=[0, 0, 3, 32], lens=[5, 7])
    M.encode(M.Chunk(**group))
    M.encode(M.Chunk(**group, span=[0, 64, 64, 64]))
    for bad in (dict(group, n=11), dict(group, lens=[5, 0, 7], n=12), dict(group, lens=[12]),
                dict(group, seqs=[0, 0, 0, 32]), dict(group, kind=M.Kind.BATCH), dict(group, score=2),
                dict(group, keep=b"k" * 16), dict(group, span=[0, 64]), dict(group, ahead=1, rows=False)):
        with pytest.raises(M.BadMessage):
            M.encode(M.Chunk(**bad))


@pytest.mark.slow
@pytest.mark.parametrize("pool", [0, 640])
def test_prompts_sent_together_prefill_as_one_group_each_as_alone(tmp_path, pool):
    """prefill_groups true (auto leaves CPU stages without), prefix_reuse rows: the short prompts of four requests sent
    at once are prefilled as one micro-batch (or a few), and each request gets the greedy ids it gets alone; /metrics
    counts the groups. With a KV pool each sequence's extent travels with the group (alone, each runs in the pool's
    first extent). decode_weights none: float32 decode steps through torch. A group's rows are within rounding of each
    chunk alone (~1e-3 here), and the C decoder's int8 rows turned that into other tokens a few steps on (3 of these
    4 prompts, once), where torch's float32 steps keep these prompts' ids."""
    _smollm2()
    from strata.serve.engine import PipelineEngine
    eng = PipelineEngine({**RIG, "prefix_reuse": "rows", "prefix_cache_bytes": 0, "kv_pool": pool,
                          "prefill_groups": True, "decode_weights": "none"}, out=tmp_path / "groups")
    s = Running(eng, queue_size=4)
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=300)

        def ask(p: str) -> str:
            return client.completions.create(model="smollm2", prompt=p, max_tokens=12, temperature=0).choices[0].text
        prompts = PROMPTS[:3] + ["Water boils at"]
        alone = [ask(p) for p in prompts]
        assert eng.slot_stats().prefill_groups == 0  # one at a time: nothing to group
        texts: dict[int, str] = {}
        gate = threading.Barrier(len(prompts))
        def together(i: int, p: str) -> None:
            gate.wait()  # (all four at once: their prompts wait for the driver together)
            texts[i] = ask(p)
        threads = [threading.Thread(target=together, args=(i, p)) for i, p in enumerate(prompts)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert [texts[i] for i in range(len(prompts))] == alone
        st = eng.slot_stats()
        assert st.prefill_groups >= 1 and st.grouped_chunks >= 2 * st.prefill_groups, st
        with s.client(timeout=30) as c:
            m = parse_prometheus(c.get("/metrics").text)
        assert m[("strata_prefill_groups_total", "")] == st.prefill_groups
        assert m[("strata_prefill_grouped_chunks_total", "")] == st.grouped_chunks
    finally:
        s.stop()
