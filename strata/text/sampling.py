"""Choosing the next token (greedy, temperature / top-k / top-p, seeded) and cutting text at stop strings."""
from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

MAX_STOP_STRINGS = 16
MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. temperature 0 (the default) is greedy: exactly the argmax, whatever the rest says.

    top_k 0 and top_p 1.0 mean "off"; seed None draws a fresh seed per request; stop strings end the text
    before the first occurrence of any of them; max_tokens bounds the generated tokens.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    max_tokens: int = 16
    grammar: str | None = None  # structured output: llguidance's serialized grammar (strata.text.grammar.json_grammar)

    def __post_init__(self) -> None:
        # bool is an int in Python: refuse it explicitly so `"top_k": true` is a 400, not top_k=1
        def number(name, v, kind):
            if isinstance(v, bool) or not isinstance(v, kind):
                raise ValueError(f"{name} must be a number, got {v!r}" if kind is not int
                                 else f"{name} must be an integer, got {v!r}")
            return v

        t = number("temperature", self.temperature, (int, float))
        if not math.isfinite(t) or not 0.0 <= t <= 2.0:
            raise ValueError(f"temperature must be between 0 and 2, got {t!r}")
        p = number("top_p", self.top_p, (int, float))
        if not math.isfinite(p) or not 0.0 < p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        k = number("top_k", self.top_k, int)
        if k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {k}")
        if self.seed is not None:
            s = number("seed", self.seed, int)
            if not 0 <= s <= MAX_SEED:
                raise ValueError(f"seed must be between 0 and {MAX_SEED}, got {s}")
        m = number("max_tokens", self.max_tokens, int)
        if m < 0:
            raise ValueError(f"max_tokens must be >= 0, got {m}")
        stop = self.stop
        if isinstance(stop, str):  # OpenAI accepts one string or a list
            stop = (stop,)
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
        if any(s == "" for s in stop):
            raise ValueError("stop strings must not be empty")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise ValueError("grammar must be a compiled grammar (strata.text.grammar.json_grammar), or None")
        object.__setattr__(self, "stop", tuple(stop))
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_p", float(p))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def needs_logits(self) -> bool:
        """Whether a pick needs the logits row, not only the argmax: a draw, or a grammar's mask."""
        return not self.greedy or self.grammar is not None


class Sampler:
    """Picks token ids from logits for one request. Draws come from its own seeded CPU generator, so a
    given seed repeats on any device (the logits are moved to the CPU for a non-greedy draw)."""

    def __init__(self, params: SamplingParams, tokenizer=None, eos=()):
        """tokenizer: the model's (strata.text.tokenizer.Tokenizer), for a grammar's mask (params.grammar); eos: the tokens
        the caller stops on (an id or several), which the grammar allows once complete."""
        self.params = params
        self.seed = params.seed if params.seed is not None else secrets.randbits(63)
        self._gen = torch.Generator(device="cpu")
        self._gen.manual_seed(self.seed)
        self.constraint = None
        if params.grammar is not None:
            from strata.text.grammar import Constraint
            self.constraint = Constraint(tokenizer, params.grammar, eos)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution a non-greedy draw samples from: tempered, then top-k, then top-p (float32, CPU)."""
        p = self.params
        x = logits.detach().reshape(-1).to("cpu", torch.float32) / p.temperature
        if 0 < p.top_k < x.numel():
            kth = torch.topk(x, p.top_k).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        probs = torch.softmax(x, dim=-1)
        if p.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            before = torch.cumsum(sorted_p, dim=0) - sorted_p  # mass of the tokens ranked above each one
            drop = before >= p.top_p  # keep the smallest prefix whose mass reaches top_p (the first always stays)
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
            probs = probs / probs.sum()
        return probs

    def next(self, logits: torch.Tensor) -> int:
        if logits.dim() != 1:
            raise ValueError(f"Sampler.next takes logits of shape (vocab,), got {tuple(logits.shape)}")
        c = self.constraint
        if c is not None:
            logits = c.mask(logits)
        if self.params.greedy:
            tok = int(torch.argmax(logits))
        else:
            tok = int(torch.multinomial(self.probs(logits), 1, generator=self._gen))
        if c is not None:
            c.consume(tok)
        return tok


class StopMatcher:
    """Cuts streamed text at the first stop string. Text arrives in pieces (a stop string may span them);
    `feed` returns what is safe to emit now, holding back a tail that could still begin a stop string."""

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped = False

    def feed(self, piece: str) -> str:
        if self.stopped:
            return ""
        text = self._held + piece
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self._held, self.stopped = "", True
            return text[:cut]
        keep = self._partial_tail(text)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def flush(self) -> str:
        """At the end of generation: the held-back tail was not a stop string after all."""
        out, self._held = ("" if self.stopped else self._held), ""
        return out

    def _partial_tail(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best


class Detokenizer:
    """Token ids -> text increments, never splitting a UTF-8 character across increments.

    Decodes a short window (the last emitted tokens plus the new ones) rather than everything so far, so a
    long answer costs O(1) per token; the window's first tokens give the decoder its context (a leading
    space that a decoder strips at the start of a text is kept)."""

    def __init__(self, decode: Callable[[list[int]], str], context: Sequence[int] = ()):
        self._decode = decode
        self._ids: list[int] = list(context)[-4:]
        self._prefix = 0  # window start
        self._read = len(self._ids)  # tokens up to here are already emitted

    def add(self, token: int) -> str:
        self._ids.append(int(token))
        before = self._decode(self._ids[self._prefix:self._read])
        now = self._decode(self._ids[self._prefix:])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            piece = now[len(before):]
            del self._ids[:self._read]  # only the window is ever decoded again: keep memory flat
            self._prefix, self._read = 0, len(self._ids)
            return piece
        return ""  # an incomplete character: wait for the next token

    def flush(self) -> str:
        """Whatever is left at the end (an incomplete character decodes as U+FFFD)."""
        before = self._decode(self._ids[self._prefix:self._read])
        now = self._decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return now[len(before):]
