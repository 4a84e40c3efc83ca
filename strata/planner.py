"""Layer split planning: contiguous layer ranges that make the slowest stage as fast as possible
while every stage fits its memory (weights, KV cache for the whole prompt, one chunk's
activations and scratch, hand-off buffers)."""
from __future__ import annotations

from dataclasses import dataclass

from .model import ModelArgs

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class PlanError(ValueError):
    """A split that cannot work: one line naming the stage and the bytes."""


@dataclass(frozen=True)
class StageNeed:
    weights: int
    kv_cache: int
    activations: int
    handoff: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.activations + self.handoff

    def describe(self) -> str:
        gib = 2**30
        return (f"weights {self.weights / gib:.2f} GiB, KV cache {self.kv_cache / gib:.2f} GiB, "
                f"activations {self.activations / gib:.2f} GiB, hand-off {self.handoff / gib:.2f} GiB")


def stage_need(args: ModelArgs, start: int, end: int, tokens: int, chunk: int, dtype: str,
               host_handoff: bool = False) -> StageNeed:
    """Bytes a stage holding layers [start, end) needs for a prompt of `tokens` in chunks of `chunk`."""
    b = DTYPE_BYTES[dtype]
    weights = args.param_count(start, end) * b
    if end == args.n_layers and args.tie_embeddings and start != 0:
        weights += args.vocab_size * args.dim * b  # the tied head keeps its own copy of the embedding
    kv = 2 * (end - start) * args.n_kv_heads * args.head_dim * tokens * b
    qkv = (args.n_heads + 2 * args.n_kv_heads) * args.head_dim
    # residual + normed input + qkv + attention out + gate/up + activation product, one chunk
    act = chunk * (3 * args.dim + qkv + args.n_heads * args.head_dim + 3 * args.ffn_dim) * b
    act += chunk * args.n_heads * 4 * 2  # log-sum-exp of split attention (float32)
    if end == args.n_layers:
        act += min(chunk, 1024) * args.vocab_size * 4  # blocked float32 logits for the NLL
    handoff = 2 * chunk * args.dim * b if host_handoff else 0
    return StageNeed(weights, kv, act, handoff)


def stage_cost(args: ModelArgs, start: int, end: int, tokens: int, with_head: bool = True) -> float:
    """FLOPs a stage spends on the whole prompt (linear layers + causal attention + head)."""
    n = end - start
    linear = 2 * args.layer_param_count() * tokens
    attn = 2 * args.n_heads * args.head_dim * tokens * tokens  # QK^T and PV over the causal half
    flops = n * (linear + attn)
    if end == args.n_layers and with_head:
        flops += 2 * args.vocab_size * args.dim * tokens
    return float(flops)


def plan_split(args: ModelArgs, n_stages: int, speeds: list[float], caps: list[int | None],
               tokens: int, chunk: int, dtype: str, host_handoff: list[bool] | None = None,
               with_head: bool = True) -> list[int]:
    """Optimal contiguous split (layer counts) by dynamic programming over (stage, first layer).

    Minimises the slowest stage's predicted time cost/speed subject to each stage's memory cap.
    """
    L = args.n_layers
    host_handoff = host_handoff or [False] * n_stages
    if n_stages > L:
        raise PlanError(f"{n_stages} stages but the model has only {L} layers")
    INF = float("inf")

    def t(i, a, b):
        if caps[i] is not None and stage_need(args, a, b, tokens, chunk, dtype, host_handoff[i]).total > caps[i]:
            return INF
        return stage_cost(args, a, b, tokens, with_head) / speeds[i]

    # best[i][a]: best max-time for stages i.. covering layers [a, L)
    best = [[INF] * (L + 1) for _ in range(n_stages + 1)]
    choice = [[0] * (L + 1) for _ in range(n_stages + 1)]
    best[n_stages][L] = 0.0
    for i in range(n_stages - 1, -1, -1):
        for a in range(L - 1, -1, -1):
            for b in range(a + 1, L - (n_stages - 1 - i) + 1):
                v = max(t(i, a, b), best[i + 1][b])
                if v < best[i][a]:
                    best[i][a], choice[i][a] = v, b
    if best[0][0] == INF:
        raise PlanError(_no_fit_reason(args, n_stages, caps, tokens, chunk, dtype, host_handoff))
    split, a = [], 0
    for i in range(n_stages):
        b = choice[i][a]
        split.append(b - a)
        a = b
    return split


def _no_fit_reason(args, n_stages, caps, tokens, chunk, dtype, host_handoff) -> str:
    # Name the stage that fails under the even split: the clearest single culprit to report.
    even = even_split(args.n_layers, n_stages)
    return check_split(args, even, caps, tokens, chunk, dtype, host_handoff, prefix="no split fits: even split fails: ") or \
        "no split fits the stages' memory"


def even_split(n_layers: int, n_stages: int) -> list[int]:
    base, extra = divmod(n_layers, n_stages)
    return [base + (1 if i < extra else 0) for i in range(n_stages)]


def check_split(args: ModelArgs, split: list[int], caps: list[int | None], tokens: int, chunk: int,
                dtype: str, host_handoff: list[bool] | None = None, prefix: str = "") -> str | None:
    """None if every stage fits; else one line naming the first stage that does not."""
    host_handoff = host_handoff or [False] * len(split)
    a = 0
    for i, n in enumerate(split):
        need = stage_need(args, a, a + n, tokens, chunk, dtype, host_handoff[i])
        if caps[i] is not None and need.total > caps[i]:
            return (f"{prefix}stage {i} (layers {a}-{a + n - 1}) needs {need.total:,} bytes but has {caps[i]:,} "
                    f"({need.describe()})")
        a += n
    return None


def predicted_times(args: ModelArgs, split: list[int], speeds: list[float], tokens: int,
                    with_head: bool = True) -> list[float]:
    out, a = [], 0
    for n, s in zip(split, speeds):
        out.append(stage_cost(args, a, a + n, tokens, with_head) / s)
        a += n
    return out
