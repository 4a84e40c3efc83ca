"""The interface between the server and whatever runs the model: the Engine protocol and its errors."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal, Protocol, runtime_checkable

from .errors import PipelineError
from .sampling import SamplingParams

FinishReason = Literal["stop", "length"]


class EngineError(PipelineError):
    """A generation that failed inside the engine; `stage` names where (e.g. 'stage 1 (cuda:1, pid 4242)')."""

    def __init__(self, stage: str, message: str):
        super().__init__(f"{stage}: {message}")
        self.stage, self.message = stage, message


@dataclass
class GenerationStats:
    """What one `Engine.generate` call did.

    prompt_tokens: the prompt's length; reused_tokens: how many of them came from the kept KV of the
    previous prompt (prefix reuse) instead of being prefilled; completion_tokens: tokens passed to on_token;
    finish_reason: 'length' when max_tokens (or the context) ran out, else 'stop' (end-of-sequence token,
    or on_token returned False).
    """

    prompt_tokens: int
    reused_tokens: int
    completion_tokens: int
    prefill_s: float
    decode_s: float
    finish_reason: FinishReason

    @property
    def prefill_tok_s(self) -> float:
        new = self.prompt_tokens - self.reused_tokens
        return new / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.completion_tokens / self.decode_s if self.decode_s > 0 else 0.0


@runtime_checkable
class Engine(Protocol):
    """A loaded model that generates for one request at a time. The server calls every method from one
    worker thread only, so an implementation needs no locking of its own."""

    model_name: str
    max_context: int  # prompt + generated tokens must fit

    def tokenize(self, text: str) -> list[int]:
        """Prompt text -> ids, with the model's BOS rule applied."""

    def detokenize(self, ids: list[int]) -> str:
        """Ids -> text (special tokens kept as text: the server cuts at stop strings itself)."""

    def chat_prompt(self, messages: list[dict[str, Any]]) -> str:
        """Chat messages -> prompt text through the model's chat template (generation prompt added).
        Raises ValueError (e.g. strata.chat.ChatError) for a conversation the template refuses."""

    def generate(self, ids: list[int], params: SamplingParams,
                 on_token: Callable[[int], bool]) -> GenerationStats:
        """Blocking: prefill `ids` (reusing the KV of the longest common prefix with the previous call), then
        decode up to params.max_tokens tokens with params' sampling. Calls on_token(id) for each generated
        token except the end-of-sequence one, and stops as soon as it returns False. Raises EngineError when
        a stage fails; the engine is then unusable until restart()."""

    def restart(self) -> None:
        """Bring a failed engine back (start the stages again); the kept KV is gone."""

    def close(self) -> None:
        """Stop the stages and free their resources; idempotent."""
