"""Sampling: greedy is the argmax, seeds repeat, top-k / top-p filter, draws follow the distribution; stop strings."""
from __future__ import annotations

import pytest
import torch

from strata.text.sampling import Detokenizer, Sampler, SamplingParams, StopMatcher


def _logits(seed=0, vocab=50):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, generator=g) * 3


def test_greedy_is_argmax():
    s = Sampler(SamplingParams())
    for seed in range(20):
        x = _logits(seed)
        assert s.next(x) == int(torch.argmax(x))
    # ties: the first index, as torch.argmax picks it
    assert s.next(torch.tensor([0.0, 5.0, 5.0, 1.0])) == 1


def test_top_k_one_is_greedy_even_when_hot():
    s = Sampler(SamplingParams(temperature=1.5, top_k=1, seed=3))
    for seed in range(20):
        x = _logits(seed)
        assert s.next(x) == int(torch.argmax(x))


def test_seeded_runs_repeat_and_seeds_differ():
    p = SamplingParams(temperature=1.0, seed=1234)
    xs = [_logits(i) for i in range(40)]
    a = [Sampler(p).next(x) for x in xs]  # a fresh sampler per call: first draw of the stream
    s1, s2 = Sampler(p), Sampler(p)
    b1 = [s1.next(x) for x in xs]
    b2 = [s2.next(x) for x in xs]
    assert b1 == b2
    s3 = Sampler(SamplingParams(temperature=1.0, seed=4321))
    assert [s3.next(x) for x in xs] != b1
    assert len(set(a)) > 1  # temperature 1 over random logits is not secretly greedy


def test_top_k_keeps_only_k_best():
    x = _logits(7)
    s = Sampler(SamplingParams(temperature=2.0, top_k=3, seed=0))
    allowed = set(torch.topk(x, 3).indices.tolist())
    draws = {s.next(x) for _ in range(300)}
    assert draws <= allowed and len(draws) == 3


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    x = probs.log()
    # 0.5 < 0.7 so the second token is needed; 0.5 + 0.3 >= 0.7 so the third is not
    p = Sampler(SamplingParams(temperature=1.0, top_p=0.7, seed=0)).probs(x)
    assert torch.allclose(p, torch.tensor([0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]), atol=1e-6)
    s = Sampler(SamplingParams(temperature=1.0, top_p=0.7, seed=0))
    assert {s.next(x) for _ in range(300)} == {0, 1}
    # top_p at exactly the first token's mass keeps that token alone
    assert Sampler(SamplingParams(temperature=1.0, top_p=0.5)).probs(x).tolist() == [1.0, 0.0, 0.0, 0.0]


def test_draw_frequencies_follow_the_distribution():
    probs = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05])
    x = probs.log() * 0.5  # temperature 0.5 undoes the halving: the target is probs itself
    s = Sampler(SamplingParams(temperature=0.5, seed=99))
    n = 2000
    counts = torch.bincount(torch.tensor([s.next(x) for _ in range(n)]), minlength=5).double()
    freq = counts / n
    # 4 standard deviations of a binomial frequency: fails on a wrong temperature or a broken draw
    tol = 4 * torch.sqrt(probs.double() * (1 - probs.double()) / n)
    assert torch.all((freq - probs.double()).abs() <= tol), (freq, probs)


def test_temperature_changes_the_distribution():
    x = torch.tensor([2.0, 1.0, 0.0])
    cold = Sampler(SamplingParams(temperature=0.25)).probs(x)
    hot = Sampler(SamplingParams(temperature=2.0)).probs(x)
    assert cold[0] > 0.97 and hot[0] < 0.6
    assert torch.allclose(Sampler(SamplingParams(temperature=1.0)).probs(x), torch.softmax(x, 0))


@pytest.mark.parametrize("kw, words", [
    ({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"temperature": 3}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"), ({"top_k": 2.5}, "top_k"), ({"top_k": True}, "top_k"),
    ({"seed": -1}, "seed"), ({"seed": "7"}, "seed"), ({"max_tokens": -1}, "max_tokens"),
    ({"stop": [""]}, "empty"), ({"stop": [1]}, "stop"), ({"stop": ["x"] * 17}, "at most"),
    ({"temperature": "hot"}, "temperature"),
])
def test_bad_params_are_one_line_value_errors(kw, words):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kw)
    msg = str(e.value)
    assert words in msg and "\n" not in msg


def test_stop_as_one_string_becomes_a_tuple():
    assert SamplingParams(stop="END").stop == ("END",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")


def _run_stop(stops, pieces):
    m = StopMatcher(stops)
    out = "".join(m.feed(p) for p in pieces)
    return out + m.flush(), m.stopped


def test_stop_string_spanning_pieces_is_cut_before_it():
    assert _run_stop(["</end>"], ["Hello </", "en", "d> trailing"]) == ("Hello ", True)
    assert _run_stop(["\n\n"], ["a\n", "\nb"]) == ("a", True)


def test_never_emits_text_past_a_stop_even_mid_stream():
    m = StopMatcher(["STOP"])
    emitted = []
    for p in ["ab", "cS", "T", "O", "Pxyz"]:
        emitted.append(m.feed(p))
        assert "S" not in "".join(emitted)  # the partial stop is held back, never emitted
    assert "".join(emitted) == "abc" and m.stopped and m.feed("more") == ""


def test_held_back_tail_is_released_when_it_was_not_a_stop():
    assert _run_stop(["STOP"], ["ab", "ST", "x"]) == ("abSTx", False)
    assert _run_stop(["STOP"], ["ab", "STO"]) == ("abSTO", False)  # flush at the end releases it


def test_earliest_of_several_stops_wins():
    assert _run_stop(["world", "lo w"], ["hel", "lo world"]) == ("hel", True)
    assert _run_stop(["b", "abc"], ["xab"]) == ("xa", True)


def test_no_stops_passes_everything():
    assert _run_stop([], ["a", "b", "c"]) == ("abc", False)


def test_detokenizer_holds_split_utf8_characters():
    # a byte-level toy tokenizer: one token per byte; "é" is two bytes, "€" three
    data = "aé€b".encode()

    def decode(ids):
        return bytes(ids).decode("utf-8", errors="replace")
    d = Detokenizer(decode)
    pieces = [d.add(b) for b in data]
    assert "".join(pieces) + d.flush() == "aé€b"
    assert all("\ufffd" not in p for p in pieces)
    assert pieces == ["a", "", "é", "", "", "€", "b"]


def test_detokenizer_increments_add_up_on_a_real_tokenizer():
    from strata.text.tokenizer import Tokenizer
    from strata.weights.checkpoint import smollm2_path
    try:
        smollm2_path()
    except Exception as e:
        pytest.skip(str(e))
    tk = Tokenizer.for_model("smollm2")
    text = "Grüße, 世界! naïve café — emoji 🙂🚀 and\n  indented code: x = 1  # ok\n"
    ids = tk.encode(text)
    prompt = tk.encode("Say: ")
    d = Detokenizer(tk.decode, context=prompt)
    pieces = [d.add(i) for i in ids]
    assert "".join(pieces) + d.flush() == tk.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)
