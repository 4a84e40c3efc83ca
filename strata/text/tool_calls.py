"""A model's tool calls read back out of its text: Qwen / Hermes-style `<tool_call>{"name": ..., "arguments": ...}
</tool_call>` blocks into OpenAI's `tool_calls`, whole (`parse`) or as the text streams in (`ToolCallParser`)."""
from __future__ import annotations

import json
import uuid
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def _call(body: str) -> dict | None:
    """One block's JSON -> an OpenAI tool call (its arguments as a JSON string), or None when it is not one."""
    try:
        d = json.loads(body)
    except ValueError:
        return None
    if not isinstance(d, dict) or not isinstance(d.get("name"), str):
        return None
    args = d.get("arguments", d.get("parameters", {}))
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": d["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}}


class ToolCallParser:
    """Text in pieces -> events: ("content", text) for what is outside the blocks, ("tool_call", call) for each
    block once closed. A tail that could begin `<tool_call>` is held back until the next piece tells; a block that is
    not a tool call (bad JSON, no name) goes out as the text it was."""

    def __init__(self):
        self._held = ""
        self._inside = False
        self.calls = 0

    def feed(self, piece: str) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        text = self._held + piece
        while True:
            if self._inside:
                end = text.find(CLOSE)
                if end < 0:
                    self._held = text
                    return out
                self._inside = False
                out.append(self._block(text[:end]))
                text = text[end + len(CLOSE):]
                continue
            start = text.find(OPEN)
            if start >= 0:
                if start:
                    out.append(("content", text[:start]))
                self._inside = True
                text = text[start + len(OPEN):]
                continue
            keep = next((n for n in range(min(len(OPEN) - 1, len(text)), 0, -1) if text.endswith(OPEN[:n])), 0)
            if len(text) > keep:
                out.append(("content", text[:len(text) - keep]))
            self._held = text[len(text) - keep:]
            return out

    def flush(self) -> list[tuple[str, Any]]:
        """At the end of the answer: a block never closed is parsed as it is (a model stopped at its end token right
        after the JSON), else its text goes out; a held tail was content."""
        text, self._held = self._held, ""
        if self._inside:
            self._inside = False
            event = self._block(text)
            return [event] if event[0] == "tool_call" else [("content", OPEN + text)]
        return [("content", text)] if text else []

    def _block(self, body: str) -> tuple[str, Any]:
        call = _call(body.strip())
        if call is None:
            return "content", OPEN + body + CLOSE
        self.calls += 1
        return "tool_call", call


def parse(text: str) -> tuple[str, list[dict]]:
    """A whole answer -> (its content outside the blocks, stripped; its tool calls)."""
    p = ToolCallParser()
    events = p.feed(text) + p.flush()
    content = "".join(v for k, v in events if k == "content").strip()
    return content, [v for k, v in events if k == "tool_call"]
