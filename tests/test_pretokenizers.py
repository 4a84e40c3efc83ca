"""The splitting rules Strata gives llama.cpp's `tokenizer.ggml.pre` names of the DeepSeek line (deepseek-v3, and
Kimi K2's kimi-k2), against the same rules run by another regex engine (the `regex` module; its V1 sets for Kimi's
class intersections): the pieces byte-level BPE then merges within."""
from __future__ import annotations

import pytest

regex = pytest.importorskip("regex")

from strata.text.tokenizer import _DEEPSEEK3, _KIMI_K2  # noqa: E402

TEXTS = ["Hello WORLD's 12345 numbers, isn't it?\n\n  indented\tand\r\nwindows",
         "中文字符abc日本語のテキストとカタカナ ok!!!\n\n", "x=1; y+=22; print(f'{x:>3}')  # café naïve ÆØÅ",
         "DON'T stop—“quoted” … ¿qué? ¡sí! 3.14159 and 1,000,000", "  \n \n\n\t  trailing   ", "ÀÉÎÕÜ ǅungla Ǉ ǈ ǉ"]


def strata_pieces(splits: list[str], text: str) -> list[str]:
    from tokenizers import Regex, pre_tokenizers
    seq = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits])
    return [p for p, _ in seq.pre_tokenize_str(text)]


def reference_pieces(patterns: list[str], text: str, flags=0) -> list[str]:
    """Each pattern isolates its matches within every piece of the one before (the gaps between matches stay
    pieces), as a sequence of splits does."""
    pieces = [text]
    for pat in patterns:
        out = []
        for p in pieces:
            at = 0
            for m in regex.finditer(pat, p, flags):
                if m.start() > at:
                    out.append(p[at:m.start()])
                if m.end() > m.start():
                    out.append(m.group())
                at = m.end()
            if at < len(p):
                out.append(p[at:])
        pieces = out
    return pieces


@pytest.mark.parametrize("text", TEXTS)
def test_deepseek_v3_pieces(text):
    assert strata_pieces(_DEEPSEEK3, text) == reference_pieces(_DEEPSEEK3, text)
    assert "".join(strata_pieces(_DEEPSEEK3, text)) == text


@pytest.mark.parametrize("text", TEXTS)
def test_kimi_k2_pieces(text):
    got = strata_pieces([_KIMI_K2], text)
    assert got == reference_pieces([_KIMI_K2], text, regex.V1) and "".join(got) == text


def test_kimi_k2_keeps_han_apart_from_other_letters():
    assert strata_pieces([_KIMI_K2], "中文abc日本") == ["中文", "abc", "日本"]
