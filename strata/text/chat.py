"""Chat messages -> prompt text through the model's own chat template, rendered in a Jinja sandbox."""
from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from strata.errors import ModelError

ROLES = ("system", "user", "assistant", "tool", "developer")


class ChatError(ValueError):
    """A conversation the template cannot render (bad messages, or the template refused them). One line."""


@dataclass(frozen=True)
class ChatTemplate:
    """A model's chat template (Jinja source) with the special tokens it may refer to."""

    source: str
    bos_token: str = ""
    eos_token: str = ""

    @classmethod
    def from_gguf(cls, path: str | Path) -> "ChatTemplate | None":
        """The template under GGUF key `tokenizer.chat_template` (None when the file has none)."""
        from strata.weights.gguf_files import field_value, open_model
        r = open_model(Path(path)).meta
        source = field_value(r, "tokenizer.chat_template")
        if not source:
            return None
        tokens = field_value(r, "tokenizer.ggml.tokens") or []

        def token(key: str) -> str:
            i = field_value(r, key)
            return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else ""
        return cls(source, token("tokenizer.ggml.bos_token_id"), token("tokenizer.ggml.eos_token_id"))

    @classmethod
    def from_hf_dir(cls, d: str | Path) -> "ChatTemplate | None":
        """The template of an HF model directory: tokenizer_config.json's `chat_template` or chat_template.jinja."""
        d = Path(d)
        cfg: dict[str, Any] = {}
        if (d / "tokenizer_config.json").is_file():
            try:
                cfg = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                raise ModelError(f"{d / 'tokenizer_config.json'}: unreadable ({e})") from None
        source = cfg.get("chat_template")
        if isinstance(source, list):  # named templates: the 'default' one
            source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"),
                          None)
        if not source and (d / "chat_template.jinja").is_file():
            source = (d / "chat_template.jinja").read_text(encoding="utf-8")
        if not source:
            return None

        def token(key: str) -> str:
            v = cfg.get(key)
            return v.get("content", "") if isinstance(v, dict) else (v or "")
        return cls(str(source), token("bos_token"), token("eos_token"))

    @classmethod
    def for_model(cls, model_spec: str) -> "ChatTemplate | None":
        from strata.weights.checkpoint import resolve
        kind, loc = resolve(model_spec)
        if kind == "gguf":
            return cls.from_gguf(loc)
        if kind == "hf":
            return cls.from_hf_dir(loc)
        return None

    def takes(self, name: str) -> bool:
        """Whether the template reads variable `name` (e.g. tools: a template that never does shows the model none)."""
        import jinja2.meta
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        try:
            return name in jinja2.meta.find_undeclared_variables(ImmutableSandboxedEnvironment(
                extensions=["jinja2.ext.loopcontrols"]).parse(self.source))
        except jinja2.TemplateError:
            return False

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **variables: Any) -> str:
        """The prompt text; `variables` are the template's too, as HF's apply_chat_template passes them (tools,
        documents, reasoning_effort, enable_thinking, ...); they cannot replace the messages or the special tokens."""
        import jinja2
        clash = sorted(set(variables) & {"messages", "bos_token", "eos_token", "add_generation_prompt"})
        if clash:
            raise ChatError(f"chat template variable {clash[0]!r} is set by the server, not the request")
        try:
            template = _compile(self.source)
        except jinja2.TemplateError as e:
            raise ModelError(f"the model's chat template does not compile: {e}") from None
        try:
            return template.render(messages=validate_messages(messages), add_generation_prompt=add_generation_prompt,
                                   bos_token=self.bos_token, eos_token=self.eos_token, **variables)
        except jinja2.exceptions.SecurityError as e:
            raise ChatError(f"the chat template tried an unsafe operation: {e}") from None
        except jinja2.TemplateError as e:
            raise ChatError(f"chat template: {e}") from None


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """OpenAI chat messages -> plain {'role', 'content': str} dicts; content given as text parts is joined. An
    assistant's tool_calls are kept (content may then be null: ""), each call's arguments parsed from their JSON
    string into an object, as the templates expect (HF's, vLLM's); a tool message keeps its tool_call_id."""
    if not isinstance(messages, list) or not messages:
        raise ChatError("messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ChatError(f"messages[{i}] must be an object")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise ChatError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}")
        calls = m.get("tool_calls") if role == "assistant" else None
        if calls is not None and content is None:
            content = ""
        if isinstance(content, list):
            parts = []
            for j, p in enumerate(content):
                if not (isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)):
                    raise ChatError(f"messages[{i}].content[{j}] must be a text part {{'type': 'text', 'text': ...}}")
                parts.append(p["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise ChatError(f"messages[{i}].content must be a string or a list of text parts")
        msg = {"role": role, "content": content}
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        if calls is not None:
            msg["tool_calls"] = _tool_calls(i, calls)
        if role == "tool" and isinstance(m.get("tool_call_id"), str):
            msg["tool_call_id"] = m["tool_call_id"]
        out.append(msg)
    return out


def _tool_calls(i: int, calls: Any) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise ChatError(f"messages[{i}].tool_calls must be a list")
    out = []
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise ChatError(f"messages[{i}].tool_calls[{j}] must be {{'type': 'function', 'function': {{'name': ..., "
                            "'arguments': ...}}")
        args = f.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise ChatError(f"messages[{i}].tool_calls[{j}].function.arguments is not JSON") from None
        out.append({"id": c.get("id", ""), "type": "function", "function": {"name": f["name"], "arguments": args}})
    return out


def _raise(message: str):
    import jinja2
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes <, >, & for HTML; chat templates expect the plain JSON text
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


_CACHE: dict[str, Any] = {}


def _compile(source: str):
    """The template compiled in an immutable sandbox: no attribute access to internals, no mutation of
    the values passed in, nothing imported; a model file's template can only produce text."""
    t = _CACHE.get(source)
    if t is None:
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        # trim_blocks / lstrip_blocks: the whitespace rules every published chat template is written for
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        t = _CACHE[source] = env.from_string(source)
    return t
