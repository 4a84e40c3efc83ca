"""Structured output (strata/text/grammar.py, llguidance): the mask keeps a pick inside the grammar whatever the logits
say, a greedy constrained answer through the server parses as the schema asks, and what cannot be enforced is
refused in one line."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("llguidance")

from strata.text.grammar import Constraint, GrammarError, json_grammar  # noqa: E402
from strata.text.sampling import Sampler, SamplingParams  # noqa: E402

BOOL_SCHEMA = {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"],
               "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer():
    from strata.weights.checkpoint import smollm2_path
    from strata.text.tokenizer import Tokenizer
    try:
        smollm2_path()
    except Exception as e:  # noqa: BLE001
        pytest.skip(str(e))
    return Tokenizer.for_model("smollm2")


def _run(tokenizer, grammar: str, logits_of, params: SamplingParams, limit: int = 64) -> tuple[list[int], bool]:
    """Picks from logits_of(step) through a constrained sampler until EOS -> (the ids before it, EOS reached)."""
    s = Sampler(SamplingParams(**{**params.__dict__, "grammar": grammar}), tokenizer)
    out = []
    for step in range(limit):
        tok = s.next(logits_of(step))
        if tok == tokenizer.eos_id:
            return out, True
        out.append(tok)
    return out, False


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_mask_keeps_random_logits_inside_a_schema(tokenizer, temperature):
    """Random logits (greedy, and drawn) picked through a boolean-answer schema: the text is that JSON, then EOS."""
    g = json_grammar(tokenizer, {"type": "json_schema", "json_schema": {"name": "a", "schema": BOOL_SCHEMA}})
    gen = torch.Generator().manual_seed(0)
    for seed in range(4):
        ids, ended = _run(tokenizer, g, lambda step: torch.randn(tokenizer.vocab_size, generator=gen) * 5,
                          SamplingParams(temperature=temperature, seed=seed))
        assert ended, tokenizer.decode(ids)
        got = json.loads(tokenizer.decode(ids))
        assert set(got) == {"answer"} and isinstance(got["answer"], bool)


def test_a_json_object_starts_as_one_whatever_the_logits(tokenizer):
    """json_object: the first pick is an object's opening even where the logits favour plain text by far; every
    allowed first token opens an object."""
    g = json_grammar(tokenizer, {"type": "json_object"})
    c = Constraint(tokenizer, g)
    allowed = np.flatnonzero(c.allowed())
    assert allowed.size and all(tokenizer.decode([int(t)]).lstrip().startswith("{") for t in allowed)
    hello = tokenizer.encode("Hello")[0]
    logits = torch.zeros(tokenizer.vocab_size)
    logits[hello] = 100.0
    s = Sampler(SamplingParams(grammar=g), tokenizer)
    assert s.next(logits) in set(allowed.tolist())
    with pytest.raises(GrammarError, match="refused"):
        c.consume(hello)  # a token outside the grammar is never taken silently


def test_the_engines_end_of_sequence_closes_the_grammar(tokenizer):
    """Once the JSON is whole the mask allows only the end of sequence: the engine's (an instruct model's end of
    turn may not be the vocabulary's own) and the vocabulary's; before that, neither."""
    g = json_grammar(tokenizer, {"type": "json_schema", "json_schema": {"name": "a", "schema": BOOL_SCHEMA}})
    end = 0 if tokenizer.eos_id != 0 else 1
    c = Constraint(tokenizer, g, eos=end)
    for tok in tokenizer.encode('{"answer": true'):
        assert not c.allowed()[[end, tokenizer.eos_id]].any()
        c.consume(tok)
    c.consume(tokenizer.encode("}")[0])
    assert set(np.flatnonzero(c.allowed()).tolist()) == {end, tokenizer.eos_id}


def test_what_cannot_be_enforced_is_one_line(tokenizer):
    with pytest.raises(GrammarError, match="^response_format json_schema: .*nonsense"):
        json_grammar(tokenizer, {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "nonsense"}}})
    with pytest.raises(GrammarError, match="json_schema: expected"):
        json_grammar(tokenizer, {"type": "json_schema", "json_schema": "nope"})
    with pytest.raises(GrammarError, match="no vocabulary"):
        json_grammar(None, {"type": "json_object"})
    assert json_grammar(tokenizer, {"type": "text"}) is None
    with pytest.raises(ValueError, match="grammar must be"):
        SamplingParams(grammar=3)
    assert SamplingParams(grammar="x").needs_logits and not SamplingParams().needs_logits


@pytest.mark.slow
@pytest.mark.parametrize("max_seqs", [1, 2])
def test_the_server_answers_in_the_schema(tokenizer, tmp_path, max_seqs):
    """Chat with response_format json_schema (a boolean answer), greedy, through the openai client on two CPU
    stages (max_seqs 2: the slot driver, its rows read for the mask): the content parses to the schema, finish
    reason stop; json_object: an object. A bad schema is a 400 naming it."""
    openai = pytest.importorskip("openai")
    from strata.serve.engine import PipelineEngine
    from test_server import Running
    eng = PipelineEngine(dict(model="smollm2", stages=[{"device": "cpu", "threads": 1}] * 2, chunk=64,
                              max_context=512, progress=False, max_seqs=max_seqs), out=tmp_path / "o")
    s = Running(eng, queue_size=2)
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        msg = [{"role": "user", "content": "Is Paris the capital of France? Answer in JSON."}]
        r = client.chat.completions.create(model="smollm2", messages=msg, max_tokens=24, temperature=0,
                                           response_format={"type": "json_schema", "json_schema": {
                                               "name": "yes_no", "schema": BOOL_SCHEMA}})
        c = r.choices[0]
        assert c.finish_reason == "stop", c
        got = json.loads(c.message.content)
        assert set(got) == {"answer"} and isinstance(got["answer"], bool)
        # json_object where the model alone answers in prose (asked for JSON, SmolLM2 writes it unconstrained too)
        prose = [{"role": "user", "content": "Name the capital of France."}]
        free = client.chat.completions.create(model="smollm2", messages=prose, max_tokens=48, temperature=0)
        assert not free.choices[0].message.content.lstrip().startswith("{"), free
        r = client.chat.completions.create(model="smollm2", messages=prose, max_tokens=48, temperature=0,
                                           response_format={"type": "json_object"})
        assert r.choices[0].finish_reason == "stop", r
        assert isinstance(json.loads(r.choices[0].message.content), dict)
        with pytest.raises(ValueError, match="grammar"):  # the engine's API: a grammar llguidance cannot read fails
            # its own request, before its prefill (with max_seqs 2: before it takes a slot), and nothing else
            eng.generate(eng.tokenize("Hi"), SamplingParams(grammar="not a grammar", max_tokens=2), lambda t: True)
        r = client.chat.completions.create(model="smollm2", messages=msg, max_tokens=2)  # the others still served
        assert r.choices[0].message.content is not None
        with pytest.raises(openai.BadRequestError, match="response_format json_schema"):
            client.chat.completions.create(model="smollm2", messages=msg, max_tokens=4, response_format={
                "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})
    finally:
        s.stop()


TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
             "additionalProperties": False}}},
         {"type": "function", "function": {"name": "clock", "parameters": {"type": "object", "properties": {}}}}]


@pytest.mark.parametrize("name,parallel", [(None, False), ("weather", False), (None, True)])
def test_tool_choice_makes_the_answer_a_tool_call_whatever_the_logits(tokenizer, name, parallel):
    """tool_choice required (any tool) or named, enforced: random logits at temperature 1 still give <tool_call>
    blocks of Qwen / Hermes's form that strata.text.tool_calls reads back as calls of the tools (the named one),
    their arguments in its parameters' schema, one block unless parallel_tool_calls."""
    from strata.text import tool_calls
    from strata.text.grammar import tool_grammar
    g = tool_grammar(tokenizer, TOOLS, name, parallel)
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        ids, ended = _run(tokenizer, g, lambda step: torch.randn(tokenizer.vocab_size, generator=gen) * 5,
                          SamplingParams(temperature=1.0, seed=seed), limit=200)
        text = tokenizer.decode(ids)
        content, calls = tool_calls.parse(text)
        if not ended:  # a parallel answer may still be adding blocks at the limit: its whole ones are calls
            assert parallel, text
            continue
        assert calls and not (content or "").strip(), text
        assert parallel or len(calls) == 1
        for c in calls:
            args = json.loads(c["function"]["arguments"])
            assert c["function"]["name"] in ({name} if name else {"weather", "clock"}), text
            assert set(args) == ({"city"} if c["function"]["name"] == "weather" else set()) or \
                c["function"]["name"] == "clock", text


def test_tool_choice_that_cannot_be_enforced_is_one_line(tokenizer):
    from strata.text.grammar import tool_grammar
    with pytest.raises(GrammarError, match="^tool_choice names 'nope', which is not among"):
        tool_grammar(tokenizer, TOOLS, "nope")
    with pytest.raises(GrammarError, match="no vocabulary"):
        tool_grammar(None, TOOLS)
