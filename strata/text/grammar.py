"""Structured output (the server's response_format json_object / json_schema): a grammar compiled by llguidance, a
well-kept grammar library, against the model's own vocabulary, and applied as a token mask before each pick.

A request's grammar travels in SamplingParams as llguidance's serialized form (a string: `json_grammar`); each
sequence's Sampler keeps its own matcher (`Constraint`), which says which tokens may come next and follows the
ones picked. The mask is applied to the logits on the head, so a constrained request takes its logits rows as a
sampled one does (SamplingParams.needs_logits), greedy or not. Once the JSON is complete the mask leaves only
the end-of-sequence token. A token the matcher refuses (never picked: only allowed ones are) fails the request.
"""
from __future__ import annotations

import json

import numpy as np
import torch

try:
    import llguidance
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask
except ImportError:  # the server then answers json modes with 400, naming the missing library
    llguidance = None

MAX_SCHEMA_BYTES = 1 << 20  # a schema larger than this is refused before it is compiled
# JSON as one line with a space after each separator, no other whitespace: a model cannot loop on blank space
# (the JSON compiler's default lets any run of it between tokens); a schema's "x-guidance" may say otherwise
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A response_format that cannot be enforced: one line, the request's 400."""


def missing() -> str | None:
    """Why structured output is off here (None: llguidance is installed)."""
    return None if llguidance is not None else "llguidance is not installed (pip install llguidance)"


def _ll_tokenizer(tokenizer, eos=()):
    """llguidance's view of a strata.text.tokenizer.Tokenizer, whose ends of sequence are `eos` (the tokens the engine
    stops on: an id or several, which may not be the vocabulary's own, e.g. an instruct model's end of turn) and the
    vocabulary's. Built once per set of ends (about a second for a large vocabulary)."""
    given = [eos] if isinstance(eos, int) else list(eos or ())
    ends = sorted({e for e in (*given, tokenizer.eos_id) if e is not None})
    cache = tokenizer.__dict__.setdefault("_llguidance", {})
    key = tuple(ends)
    if key not in cache:
        try:
            cache[key] = llguidance.LLTokenizer(tokenizer.tk.to_str(), n_vocab=tokenizer.vocab_size,
                                                eos_token=ends or None)
        except Exception as e:  # noqa: BLE001 - the library's own errors: one line, the request's 400
            raise GrammarError(f"response_format: llguidance cannot read this model's vocabulary "
                               f"({str(e).splitlines()[0][:200]})") from None
    return cache[key]


def json_grammar(tokenizer, response_format: dict) -> str | None:
    """OpenAI's response_format -> the grammar a sampler enforces (None for {"type": "text"}). json_object: any JSON
    object; json_schema: {"json_schema": {"name": ..., "schema": {...}}}. GrammarError (one line) for a schema
    llguidance refuses, a missing library or a model without a vocabulary to enforce it on."""
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind not in ("json_object", "json_schema"):
        raise GrammarError(f"response_format type must be text, json_object or json_schema, got {kind!r}")
    why = missing()
    if why:
        raise GrammarError(f"response_format {kind}: {why}")
    if tokenizer is None:
        raise GrammarError(f"response_format {kind}: the model has no vocabulary to constrain")
    if kind == "json_object":
        schema = {"type": "object"}
    else:
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise GrammarError("response_format json_schema: expected {\"json_schema\": {\"name\": ..., "
                               "\"schema\": {...}}}")
        schema = spec.get("schema", {})
        if len(json.dumps(schema)) > MAX_SCHEMA_BYTES:
            raise GrammarError(f"response_format json_schema: the schema is over {MAX_SCHEMA_BYTES} bytes")
    return _compiled(lambda: llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS), tokenizer,
                     f"response_format {kind}")


def _compiled(make, tokenizer, what: str) -> str:
    """make()'s grammar, validated against the tokenizer's vocabulary; what llguidance refuses is one line
    beginning `what`."""
    try:
        grammar = make()
    except ValueError as e:
        raise GrammarError(f"{what}: {str(e).splitlines()[0][:300]}") from None
    err = llguidance.LLMatcher.validate_grammar(grammar, _ll_tokenizer(tokenizer))
    if err:
        raise GrammarError(f"{what}: {err.splitlines()[0][:300]}")
    return grammar


def tool_grammar(tokenizer, tools: list[dict], name: str | None = None, parallel: bool = True) -> str:
    """OpenAI's tool_choice "required" (name None: any of `tools`) or a named function, as a grammar: the answer is
    one <tool_call> block (several, one a line, where `parallel`) of Qwen / Hermes's form, {"name": ..., "arguments":
    ...} with the function's name and its parameters' schema, nothing else (strata/text/tool_calls.py reads it back).
    GrammarError (one line) for a name not among the tools, a schema llguidance refuses, a missing library."""
    why = missing()
    if why:
        raise GrammarError(f"tool_choice: {why}")
    if tokenizer is None:
        raise GrammarError("tool_choice: the model has no vocabulary to constrain")
    fns = [t["function"] for t in tools]
    if name is not None:
        fns = [f for f in fns if f["name"] == name]
        if not fns:
            raise GrammarError(f"tool_choice names {name!r}, which is not among the request's tools")
    calls = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                               "arguments": f.get("parameters") or {"type": "object"}},
              "required": ["name", "arguments"], "additionalProperties": False} for f in fns]
    schema = {"anyOf": calls, "x-guidance": JSON_OPTIONS}
    if len(json.dumps(schema)) > MAX_SCHEMA_BYTES:
        raise GrammarError(f"tool_choice: the tools' schemas are over {MAX_SCHEMA_BYTES} bytes")
    more = ' ("\\n" call)*' if parallel else ""
    lark = (f"start: call{more}\n"
            'call: "<tool_call>\\n" body "\\n</tool_call>"\n'
            f"body: %json {json.dumps(schema)}\n")
    return _compiled(lambda: llguidance.LLMatcher.grammar_from_lark(lark), tokenizer, "tool_choice")


class Constraint:
    """One sequence's matcher of a grammar: the tokens allowed next (a mask on its logits), advanced by each pick."""

    def __init__(self, tokenizer, grammar: str, eos=()):
        """eos: the tokens the engine stops on, an id or several (the mask allows them, alone, once the grammar is
        complete)."""
        if llguidance is None:
            raise GrammarError(missing())
        ll = _ll_tokenizer(tokenizer, eos)
        self.matcher = llguidance.LLMatcher(ll, grammar)
        if self.matcher.is_error():
            raise GrammarError(f"grammar: {self.matcher.get_error()}")
        self.n_vocab = ll.vocab_size
        self._bits = allocate_token_bitmask(1, self.n_vocab)

    def allowed(self) -> np.ndarray:
        """A bool per token id of the vocabulary: may come next."""
        fill_next_token_bitmask(self.matcher, self._bits, 0)
        return np.unpackbits(self._bits[0].view(np.uint8), bitorder="little")[:self.n_vocab].astype(bool)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits (float32, on the CPU) with every token that may not come next at -inf (ids past the
        vocabulary's too: a model's padded rows)."""
        x = logits.detach().reshape(-1).to("cpu", torch.float32).clone()
        ok = torch.zeros(x.numel(), dtype=torch.bool)
        a = torch.from_numpy(self.allowed())
        ok[:min(a.numel(), x.numel())] = a[:x.numel()]
        if not bool(ok.any()):
            raise GrammarError("grammar: no token may come next")
        return x.masked_fill_(~ok, float("-inf"))

    def consume(self, tok: int) -> None:
        if not self.matcher.consume_token(tok) or self.matcher.is_error():
            raise GrammarError(f"grammar: token {tok} refused ({self.matcher.get_error() or 'not allowed'})")
