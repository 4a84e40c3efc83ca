"""Text <-> token ids for a model: from a GGUF file's embedded vocabulary or an HF tokenizer.json."""
from __future__ import annotations

import json
from pathlib import Path

from strata.weights.checkpoint import resolve
from strata.errors import ModelError

# GGUF token types (llama.cpp): 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4

# Splitting rules of llama.cpp's `tokenizer.ggml.pre` names, applied before byte-level BPE.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# DeepSeek V3 / R1 / V3.1 (llama.cpp's DEEPSEEK3_LLM): digits by threes, runs of CJK ideographs and kana, then words
# with their leading punctuation and the GPT-style rest; each split applied to the pieces of the one before
_DEEPSEEK3 = [r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
              r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
              r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"]
# Kimi K2's (its tiktoken pattern, as llama.cpp's unicode.cpp documents it): Han runs apart from other letters,
# cased words with their contractions, digits by threes, punctuation runs, newlines and spaces
_KIMI_K2 = (r"[\p{Han}]+"
            r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
            r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
            r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
            r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
            r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_SPLITS: dict[str, list[str]] = {
    "default": [_GPT2], "gpt2": [_GPT2], "gpt-2": [_GPT2],
    "smollm": [r"\p{N}", _GPT2], "starcoder": [r"\p{N}", _GPT2], "refact": [r"\p{N}", _GPT2],
    "llama3": [_LLAMA3], "llama-v3": [_LLAMA3], "llama-bpe": [_LLAMA3], "smaug-bpe": [_LLAMA3],
    "falcon3": [_LLAMA3], "dbrx": [_LLAMA3],
    "qwen2": [_QWEN2], "deepseek-r1-qwen": [_QWEN2],
    "deepseek-v3": _DEEPSEEK3, "kimi-k2": [_KIMI_K2],
}


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE vocabularies."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


class Tokenizer:
    """Wraps a `tokenizers.Tokenizer`; BOS is added here (not by a post-processor) so it is explicit."""

    def __init__(self, tk, bos_id: int | None, eos_id: int | None, vocab_size: int,
                 add_bos: bool = False, add_eos: bool = False, source: str = ""):
        self.tk = tk
        self.bos_id, self.eos_id, self.vocab_size = bos_id, eos_id, vocab_size
        self.add_bos_default, self.add_eos_default = add_bos, add_eos
        self.source = source

    def __repr__(self) -> str:
        return f"Tokenizer({self.source!r}, vocab={self.vocab_size}, bos={self.bos_id}, eos={self.eos_id})"

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        ids = self.tk.encode(text, add_special_tokens=False).ids
        if (self.add_bos_default if add_bos is None else add_bos):
            if self.bos_id is None:
                raise ModelError(f"{self.source}: the tokenizer has no BOS token to add")
            ids = [self.bos_id] + ids
        if add_bos is None and self.add_eos_default and self.eos_id is not None:
            ids = ids + [self.eos_id]
        return ids

    def decode(self, ids) -> str:
        return self.tk.decode([int(i) for i in ids], skip_special_tokens=False)

    # -- constructors ------------------------------------------------------------------------------
    @classmethod
    def for_model(cls, model_spec: str) -> "Tokenizer":
        kind, loc = resolve(model_spec)
        if kind == "gguf":
            return cls.from_gguf(Path(loc))
        if kind == "hf":
            return cls.from_hf_dir(Path(loc))
        raise ModelError(f"model {model_spec!r} is synthetic and has no tokenizer: give prompts as token ids "
                         "or use random prompts")

    @classmethod
    def from_hf_dir(cls, d: Path) -> "Tokenizer":
        from tokenizers import Tokenizer as TK
        d = Path(d)
        f = d / "tokenizer.json"
        if not f.is_file():
            raise ModelError(f"{d}: no tokenizer.json (only fast tokenizers are supported)")
        try:
            tk = TK.from_file(str(f))
        except Exception as e:
            raise ModelError(f"{f}: cannot load tokenizer ({' '.join(str(e).split())[:200]})") from None
        cfg = _read_json(d / "tokenizer_config.json")
        model_cfg = _read_json(d / "config.json")

        def token_id(key):
            tok = cfg.get(key)
            if isinstance(tok, dict):
                tok = tok.get("content")
            return tk.token_to_id(tok) if isinstance(tok, str) else None

        bos = token_id("bos_token")
        if bos is None:
            bos = model_cfg.get("bos_token_id")
        eos = model_cfg.get("eos_token_id")
        eos = eos[0] if isinstance(eos, list) and eos else eos
        if eos is None:
            eos = token_id("eos_token")
        if "add_bos_token" in cfg:
            add_bos = bool(cfg["add_bos_token"])
        else:  # whatever tokenizer.json's post-processor does
            probe = tk.encode("a", add_special_tokens=True).ids
            add_bos = bos is not None and len(probe) > 0 and probe[0] == bos
        add_eos = bool(cfg.get("add_eos_token", False))
        return cls(tk, bos, eos, tk.get_vocab_size(with_added_tokens=True), add_bos, add_eos, str(d))

    @classmethod
    def from_gguf(cls, path: Path) -> "Tokenizer":
        from strata.weights.gguf_files import field_value, open_model
        path = Path(path)
        r = open_model(path).meta  # (a split model's first part, which alone holds the vocabulary)
        kind = field_value(r, "tokenizer.ggml.model")
        tokens = field_value(r, "tokenizer.ggml.tokens")
        if kind is None or not tokens:
            raise ModelError(f"{path}: the GGUF file has no embedded tokenizer")
        types = field_value(r, "tokenizer.ggml.token_type") or [1] * len(tokens)
        if len(types) != len(tokens):
            raise ModelError(f"{path}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
        merges = field_value(r, "tokenizer.ggml.merges")
        bos = field_value(r, "tokenizer.ggml.bos_token_id")
        eos = field_value(r, "tokenizer.ggml.eos_token_id")
        if kind == "gpt2":
            tk = _byte_level_bpe(path, tokens, types, merges, field_value(r, "tokenizer.ggml.pre"))
            add_bos_default = False
        elif kind == "llama":
            tk = _sentencepiece_bpe(path, tokens, types, merges, field_value(r, "tokenizer.ggml.scores"),
                                    field_value(r, "tokenizer.ggml.unknown_token_id"),
                                    field_value(r, "tokenizer.ggml.add_space_prefix", True))
            add_bos_default = True  # llama.cpp's default for sentencepiece vocabularies
        else:
            raise ModelError(f"{path}: unsupported tokenizer type {kind!r} (supported: gpt2, llama)")
        add_bos = field_value(r, "tokenizer.ggml.add_bos_token", add_bos_default)
        add_eos = field_value(r, "tokenizer.ggml.add_eos_token", False)
        return cls(tk, bos, eos, len(tokens), bool(add_bos), bool(add_eos), str(path))


def _read_json(f: Path) -> dict:
    if not f.is_file():
        return {}
    try:
        return json.loads(f.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelError(f"{f}: cannot read ({e})") from None


def _split_merges(path, merges) -> list[tuple[str, str]]:
    out = []
    for m in merges:
        a, sep, b = m.partition(" ")
        if not sep:
            raise ModelError(f"{path}: malformed merge {m!r} in tokenizer.ggml.merges")
        out.append((a, b))
    return out


def _add_special(tk, tokens, types) -> None:
    from tokenizers import AddedToken
    special = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types)
               if k in (_CONTROL, _UNKNOWN) and t]
    user = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == _USER_DEFINED and t]
    if special:
        tk.add_special_tokens(special)
    if user:
        tk.add_tokens(user)


def _byte_level_bpe(path, tokens, types, merges, pre):
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as TK
    if merges is None:
        raise ModelError(f"{path}: byte-level BPE vocabulary without tokenizer.ggml.merges")
    pre = pre or "default"
    if pre not in _PRE_SPLITS:
        raise ModelError(f"{path}: unsupported pre-tokenizer {pre!r} (supported: {', '.join(sorted(_PRE_SPLITS))})")
    table = _byte_alphabet()
    alphabet = set(table.values())
    vocab: dict[str, int] = {}
    for i, (t, k) in enumerate(zip(tokens, types)):
        # Ordinary tokens are stored in the byte alphabet; control / user-defined ones as raw text.
        if k not in (_CONTROL, _USER_DEFINED, _UNKNOWN) and not set(t) <= alphabet:
            t = "".join(table[b] for b in t.encode("utf-8"))
        vocab.setdefault(t, i)
    try:
        model = models.BPE(vocab=vocab, merges=_split_merges(path, merges), fuse_unk=False, byte_fallback=False)
    except Exception as e:
        raise ModelError(f"{path}: invalid BPE vocabulary/merges ({' '.join(str(e).split())[:200]})") from None
    tk = TK(model)
    splits = _PRE_SPLITS[pre]
    if splits == [_GPT2]:
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tk.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    _add_special(tk, tokens, types)
    return tk


def _sentencepiece_bpe(path, tokens, types, merges, scores, unk_id, add_space_prefix):
    """A sentencepiece BPE vocabulary as a `tokenizers` BPE with byte fallback.

    Without merges in the file, they are rebuilt from the scores: every split of a token into two
    vocabulary pieces is a merge, ranked by the merged token's score (best first), as sentencepiece
    merges the best-scoring adjacent pair first.
    """
    from tokenizers import decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as TK
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    if merges is not None:
        pairs = _split_merges(path, merges)
    else:
        if scores is None or len(scores) != len(tokens):
            raise ModelError(f"{path}: sentencepiece vocabulary without scores or merges")
        ranked = []
        for t, i in vocab.items():
            if types[i] != 1 or len(t) < 2:
                continue
            for cut in range(1, len(t)):
                a, b = t[:cut], t[cut:]
                if a in vocab and b in vocab and types[vocab[a]] in (1, 6) and types[vocab[b]] in (1, 6):
                    ranked.append((-scores[i], vocab[a], vocab[b], a, b))
        ranked.sort()
        pairs = [(a, b) for *_, a, b in ranked]
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    try:
        model = models.BPE(vocab=vocab, merges=pairs, unk_token=unk, fuse_unk=True, byte_fallback=True)
    except Exception as e:
        raise ModelError(f"{path}: invalid sentencepiece vocabulary ({' '.join(str(e).split())[:200]})") from None
    tk = TK(model)
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581",
                                                prepend_scheme="first" if add_space_prefix else "never", split=False)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tk.decoder = decoders.Sequence(steps)
    _add_special(tk, tokens, types)
    return tk
