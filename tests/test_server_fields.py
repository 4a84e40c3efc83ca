"""The request fields clients send (issue 58 item 4) and several users by default (item 1): the sampler's adjustments on
hand-made logits, the tool-call parser on strings, tools through a chat template and back out as tool_calls (whole and
streamed, through the openai client), and `--serve`'s engine without max_seqs on SmolLM2 CPU stages."""
from __future__ import annotations

import concurrent.futures
import json

import pytest
import torch

from strata.serve.engine import GenerationStats
from strata.text import tool_calls
from strata.text.chat import ChatTemplate
from strata.text.sampling import Sampler, SamplingParams

from test_server import FakeEngine, Running

EOS = 9


def pick(params: SamplingParams, logits, prompt=(), made=()) -> int:
    """The next token after the answer `made` (each fed through the sampler first, as a generation would)."""
    s = Sampler(params, eos=EOS, prompt=prompt)
    for t in made:
        s.count += 1
        s.made[t] = s.made.get(t, 0) + 1
        if params.repetition_penalty != 1.0:
            s.seen.add(t)
    return s.next(torch.tensor(logits, dtype=torch.float32))


LOGITS = [0.0, 3.0, 2.9, 1.0, -1.0, -1.1, 0.5, 0.2, 0.1, 5.0]  # greedy: the end token, 9; then 1, just above 2


def test_logit_bias_forces_and_bans():
    assert pick(SamplingParams(), LOGITS) == EOS
    assert pick(SamplingParams(logit_bias={"7": 100}), LOGITS) == 7
    assert pick(SamplingParams(logit_bias={"9": -100, "1": -100}), LOGITS) == 2
    with pytest.raises(ValueError, match="between -100 and 100"):
        SamplingParams(logit_bias={"1": 100.5})


def test_ignore_eos_and_min_tokens_hold_the_end_off():
    assert pick(SamplingParams(ignore_eos=True), LOGITS) == 1
    p = SamplingParams(min_tokens=2)
    assert pick(p, LOGITS, made=[1]) == 1      # one made: still held off
    assert pick(p, LOGITS, made=[1, 1]) == EOS  # two: the end may come


def test_repetition_penalty_divides_positive_and_multiplies_negative_over_prompt_and_answer():
    p = SamplingParams(repetition_penalty=1.5, logit_bias={"9": -100})
    assert pick(p, LOGITS) == 1
    assert pick(p, LOGITS, prompt=[1]) == 2       # 3.0 / 1.5 = 2.0 < 2.9
    assert pick(p, LOGITS, made=[1]) == 2         # the answer counts as the prompt does
    neg = [-1.0, -2.0, -0.5] + [-9.0] * 7
    assert pick(SamplingParams(repetition_penalty=2.0), neg) == 2
    assert pick(SamplingParams(repetition_penalty=2.0), neg, prompt=[2]) == 0  # -0.5 x 2 = -1.0: ties 0, argmax first
    x = Sampler(SamplingParams(repetition_penalty=2.0), prompt=[0, 2]).adjust(torch.tensor(neg))
    assert x[:3].tolist() == [-2.0, -2.0, -1.0]


def test_presence_and_frequency_penalties_count_the_answer_only():
    p = SamplingParams(presence_penalty=0.2, logit_bias={"9": -100})
    assert pick(p, LOGITS, prompt=[1]) == 1        # OpenAI's penalties: the prompt is not counted
    assert pick(p, LOGITS, made=[1]) == 2          # 3.0 - 0.2 < 2.9
    f = SamplingParams(frequency_penalty=0.06, logit_bias={"9": -100})
    assert pick(f, LOGITS, made=[1]) == 1          # 3.0 - 0.06 > 2.9
    assert pick(f, LOGITS, made=[1, 1]) == 2       # 3.0 - 0.12 < 2.9: once a time it was made
    assert pick(SamplingParams(frequency_penalty=-1.0, logit_bias={"9": -100}), LOGITS, made=[2]) == 2


def test_min_p_keeps_the_tokens_near_the_top():
    s = Sampler(SamplingParams(temperature=1.0, min_p=0.5, seed=1))
    probs = s.probs(torch.tensor(LOGITS))
    kept = (probs > 0).nonzero().flatten().tolist()
    assert kept == [9]  # e^3 / e^5 < 0.5
    s = Sampler(SamplingParams(temperature=1.0, min_p=0.1, seed=1))
    assert (s.probs(torch.tensor(LOGITS)) > 0).nonzero().flatten().tolist() == [1, 2, 9]
    assert SamplingParams(min_p=0.3).needs_logits is False  # greedy: min_p changes nothing, the argmax serves


def test_tool_call_parser_whole_and_in_pieces():
    text = ('Let me look.<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "time", "arguments": {}}</tool_call>')
    content, calls = tool_calls.parse(text)
    assert content == "Let me look."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("weather", {"city": "Paris"}), ("time", {})]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    for size in (1, 2, 5, 11):
        p, events = tool_calls.ToolCallParser(), []
        for i in range(0, len(text), size):
            events += p.feed(text[i:i + size])
        events += p.flush()
        assert "".join(v for k, v in events if k == "content").strip() == "Let me look."
        assert [v["function"]["name"] for k, v in events if k == "tool_call"] == ["weather", "time"]
    assert tool_calls.parse("a <tool_ca b") == ("a <tool_ca b", [])           # a held tail that was text
    assert tool_calls.parse("<tool_call>{oops}</tool_call>") == ("<tool_call>{oops}</tool_call>", [])
    assert tool_calls.parse('<tool_call>{"name": "f", "arguments": {"a": 1}}')[1][0]["function"]["arguments"] == \
        '{"a": 1}'  # never closed: the model ended right after the JSON


# a Hermes / Qwen-style template: the tools in the system turn, an assistant's calls and the tools' answers
TOOLS_TEMPLATE = (
    "{% if tools %}<|system|>Tools:{% for t in tools %} {{ t.function.name }}{% endfor %}\n{% endif %}"
    "{% if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}"
    "{% if reasoning_effort is defined %}<effort {{ reasoning_effort }}>{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments}"
    " | tojson }}</tool_call>{% endfor %}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "the weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
ANSWER = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_template_gets_tools_kwargs_and_an_assistants_calls():
    t = ChatTemplate(TOOLS_TEMPLATE)
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    out = t.render(msgs, tools=TOOLS, reasoning_effort="low", enable_thinking=False)
    assert out == ('<|system|>Tools: weather<no-think><effort low><|user|>Weather in Paris?<|assistant|>'  # (the
                   '<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call><|tool|>sunny'  # newline
                   '<|assistant|>')  # after a tag goes: trim_blocks)
    assert t.takes("tools") and not ChatTemplate("{{ messages }}").takes("tools")


class ScriptedEngine(FakeEngine):
    """A fake engine whose answer is a given text (its bytes as tokens), whatever the prompt; it keeps the prompts."""

    def __init__(self, answer: str):
        super().__init__(max_context=4096)
        self.template = ChatTemplate(TOOLS_TEMPLATE)
        self.answer = answer
        self.prompts: list[str] = []

    def generate(self, ids, params, on_token) -> GenerationStats:
        self.prompts.append(self.detokenize(ids))
        n = 0
        for tok in self.answer.encode()[:params.max_tokens]:
            n += 1
            if not on_token(tok):
                break
        return GenerationStats(prompt_tokens=len(ids), reused_tokens=0, completion_tokens=n, prefill_s=0.001,
                               decode_s=0.001, finish_reason="stop")


def test_tools_through_the_template_and_back_as_tool_calls():
    openai = pytest.importorskip("openai")
    eng = ScriptedEngine("Checking. " + ANSWER)
    s = Running(eng)
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=30)
        ask = dict(model="fake-model", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS,
                   extra_body={"chat_template_kwargs": {"enable_thinking": False}}, reasoning_effort="high")
        r = client.chat.completions.create(**ask)
        assert eng.prompts[-1].startswith("<|system|>Tools: weather<no-think><effort high><|user|>")
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content == "Checking."
        assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == \
            [("weather", {"city": "Paris"})]
        calls: dict[int, dict] = {}
        content, finish = [], None
        for chunk in client.chat.completions.create(**ask, stream=True):
            d = chunk.choices[0].delta
            content.append(d.content or "")
            for t in d.tool_calls or []:
                calls.setdefault(t.index, {"name": "", "arguments": ""})
                calls[t.index]["name"] += t.function.name or ""
                calls[t.index]["arguments"] += t.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert "".join(content).strip() == "Checking." and finish == "tool_calls"
        assert [(v["name"], json.loads(v["arguments"])) for v in calls.values()] == [("weather", {"city": "Paris"})]
        # tool_choice none: the model is shown no tools and its text is left as it is
        r = client.chat.completions.create(**{**ask, "tool_choice": "none"})
        assert "Tools:" not in eng.prompts[-1] and r.choices[0].message.tool_calls is None
        assert r.choices[0].message.content == "Checking. " + ANSWER
        with pytest.raises(openai.BadRequestError, match="tool_choice"):
            client.chat.completions.create(**{**ask, "tool_choice": "required"})
    finally:
        s.stop()


def _smollm2():
    from strata.weights.checkpoint import smollm2_path
    try:
        smollm2_path()
    except Exception as e:  # noqa: BLE001
        pytest.skip(str(e))


@pytest.mark.slow
def test_serve_without_max_seqs_batches_and_the_fields_act(tmp_path):
    """`--serve`'s engine on a rig without max_seqs: auto takes AUTO_SEQS_CPU on CPU stages; 4 requests sent together
    are in the pipeline together (the slot driver's record, not time); logit_bias, ignore_eos and min_tokens act."""
    openai = pytest.importorskip("openai")
    _smollm2()
    from strata.config import AUTO_SEQS_CPU
    from strata.serve.engine import pipeline_engine
    from strata.serve.server import _eos_id
    rig = dict(model="smollm2", stages=[{"device": "cpu", "threads": 1}] * 2, chunk=64, max_context=320,
               progress=False)
    eng = pipeline_engine(rig, out=tmp_path / "run")
    s = None
    try:
        assert eng.max_seqs == AUTO_SEQS_CPU == 4 and eng.pipe.plan.planner["max_seqs_from"] == "auto"
        s = Running(eng)
        assert s.worker.concurrency == 4
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=300)

        def ask(prompt, **kw):
            return client.completions.create(model="smollm2", prompt=prompt, temperature=0, **kw)
        prompts = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "Water boils at"]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda p: ask(p, max_tokens=24, extra_body={"ignore_eos": True}), prompts))
        assert [a.usage.completion_tokens for a in answers] == [24] * 4  # ignore_eos: exactly max_tokens
        st = eng.slot_stats()
        assert st.sequences >= 4 and st.most_in_flight >= 2 and st.most_in_batch >= 2, st
        forced = ask("Hello", max_tokens=6, logit_bias={"330": 100})
        assert forced.choices[0].text == eng.detokenize([330] * 6)
        eos = _eos_id(eng)
        ended = ask("Hello", max_tokens=8, logit_bias={str(eos): 100})
        assert ended.usage.completion_tokens == 0 and ended.choices[0].finish_reason == "stop"
        held = ask("Hello", max_tokens=8, logit_bias={str(eos): 100}, extra_body={"min_tokens": 3})
        assert held.usage.completion_tokens == 3 and held.choices[0].finish_reason == "stop"
    finally:
        if s is not None:
            s.stop()
        else:
            eng.close()
