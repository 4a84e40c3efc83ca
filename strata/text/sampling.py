"""Choosing the next token (greedy, temperature / top-k / top-p / min-p, seeded; penalties, logit bias, EOS held off)
and cutting text at stop strings."""
from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

MAX_STOP_STRINGS = 16
MAX_SEED = 2**63 - 1
MAX_LOGIT_BIAS = 100.0   # OpenAI's range for a logit_bias value: -100 bans a token, +100 all but forces it
MAX_LOGIT_BIAS_TOKENS = 1024


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
    # what clients send besides (OpenAI, vLLM, llama.cpp): each at its default changes nothing
    ignore_eos: bool = False        # the end tokens never picked: generation runs to max_tokens
    min_tokens: int = 0             # the end tokens never picked before this many generated tokens
    min_p: float = 0.0              # a draw keeps the tokens whose probability is at least min_p x the top one's
    repetition_penalty: float = 1.0  # HF / llama.cpp: each token of the prompt or the answer so far has its logit
                                    # divided by this when positive, multiplied when negative
    presence_penalty: float = 0.0   # OpenAI: subtracted once from the logit of each token the answer holds
    frequency_penalty: float = 0.0  # OpenAI: subtracted from a token's logit once a time the answer holds it
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit): OpenAI's {"id": bias} map

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
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        if number("min_tokens", self.min_tokens, int) < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        mp = number("min_p", self.min_p, (int, float))
        if not math.isfinite(mp) or not 0.0 <= mp <= 1.0:
            raise ValueError(f"min_p must be between 0 and 1, got {mp!r}")
        rp = number("repetition_penalty", self.repetition_penalty, (int, float))
        if not math.isfinite(rp) or not 0.0 < rp <= 10.0:
            raise ValueError(f"repetition_penalty must be in (0, 10] (1 = off), got {rp!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = number(name, getattr(self, name), (int, float))
            if not math.isfinite(v) or not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be between -2 and 2, got {v!r}")
            object.__setattr__(self, name, float(v))
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        object.__setattr__(self, "min_p", float(mp))
        object.__setattr__(self, "repetition_penalty", float(rp))
        object.__setattr__(self, "stop", tuple(stop))
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_p", float(p))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def adjusts(self) -> bool:
        """Whether the logits are changed before a pick: penalties, a bias, the end tokens held off."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or bool(self.logit_bias) or self.ignore_eos or self.min_tokens > 0)

    @property
    def needs_logits(self) -> bool:
        """Whether a pick needs the logits row, not only the argmax: a draw, a grammar's mask, or an adjustment."""
        return not self.greedy or self.grammar is not None or self.adjusts


def _logit_bias(bias) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias ({"token id": bias}, the ids as JSON's string keys) -> sorted (id, bias) pairs."""
    items = bias.items() if isinstance(bias, dict) else bias
    try:
        items = list(items)
    except TypeError:
        raise ValueError(f"logit_bias must be an object of token id -> bias, got {bias!r}") from None
    if len(items) > MAX_LOGIT_BIAS_TOKENS:
        raise ValueError(f"logit_bias takes at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(items)}")
    out = {}
    for pair in items:
        key, v = pair if isinstance(pair, (tuple, list)) and len(pair) == 2 else (pair, None)
        tok = int(key) if isinstance(key, str) and key.strip().lstrip("-").isdigit() else key
        if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
            raise ValueError(f"logit_bias: {key!r} is not a token id")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias[{key!r}] must be a number between -100 and 100, got {v!r}")
        out[tok] = float(v)
    return tuple(sorted(out.items()))


class Sampler:
    """Picks token ids from logits for one request. Draws come from its own seeded CPU generator, so a
    given seed repeats on any device (the logits are moved to the CPU for a non-greedy draw)."""

    def __init__(self, params: SamplingParams, tokenizer=None, eos=(), prompt=()):
        """tokenizer: the model's (strata.text.tokenizer.Tokenizer), for a grammar's mask (params.grammar); eos: the tokens
        the caller stops on (an id or several), which the grammar allows once complete, and which ignore_eos and
        min_tokens hold off; prompt: its ids (repetition_penalty counts them with the answer's)."""
        self.params = params
        self.ends = sorted({int(eos)} if isinstance(eos, int) else {int(e) for e in eos or ()})
        self.made: dict[int, int] = {}  # each generated token's count (presence and frequency penalties)
        self.seen = set(int(t) for t in prompt) if params.repetition_penalty != 1.0 else set()
        self.count = 0                  # tokens picked so far
        self.seed = params.seed if params.seed is not None else secrets.randbits(63)
        self._gen = torch.Generator(device="cpu")
        self._gen.manual_seed(self.seed)
        self.constraint = None
        if params.grammar is not None:
            from strata.text.grammar import Constraint
            self.constraint = Constraint(tokenizer, params.grammar, eos)

    def adjust(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits a pick sees (float32, CPU; a copy): repetition penalty over the prompt and the answer so far
        (HF, llama.cpp: divided when positive, multiplied when negative), then OpenAI's presence and frequency
        penalties over the answer, then the logit bias, then the end tokens at -inf while held off."""
        p = self.params
        x = logits.detach().reshape(-1).to("cpu", torch.float32).clone()
        n = x.numel()
        if p.repetition_penalty != 1.0 and self.seen:
            ids = torch.tensor(sorted(t for t in self.seen if t < n), dtype=torch.long)
            v = x[ids]
            x[ids] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and self.made:
            ids = torch.tensor([t for t in self.made if t < n], dtype=torch.long)
            counts = torch.tensor([c for t, c in self.made.items() if t < n], dtype=torch.float32)
            x[ids] -= counts * p.frequency_penalty + p.presence_penalty
        for tok, bias in p.logit_bias:
            if tok < n:
                x[tok] += bias
        if p.ignore_eos or self.count < p.min_tokens:
            for e in self.ends:
                if e < n:
                    x[e] = float("-inf")
        return x

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution a non-greedy draw samples from: tempered, then top-k, then min-p, then top-p (float32,
        CPU)."""
        p = self.params
        x = logits.detach().reshape(-1).to("cpu", torch.float32) / p.temperature
        if 0 < p.top_k < x.numel():
            kth = torch.topk(x, p.top_k).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        probs = torch.softmax(x, dim=-1)
        if p.min_p > 0.0:  # (llama.cpp, vLLM: relative to the most likely token, on the tempered distribution)
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
            probs = probs / probs.sum()
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
        if self.params.adjusts:
            logits = self.adjust(logits)
        if c is not None:
            logits = c.mask(logits)
        if self.params.greedy:
            tok = int(torch.argmax(logits))
        else:
            tok = int(torch.multinomial(self.probs(logits), 1, generator=self._gen))
        if c is not None:
            c.consume(tok)
        self.count += 1
        self.made[tok] = self.made.get(tok, 0) + 1
        if self.params.repetition_penalty != 1.0:
            self.seen.add(tok)
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
