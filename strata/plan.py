"""From a validated RigConfig to a concrete run plan: stages with devices, cores and layer
ranges; the prompt as token ids; the chunk schedule; hand-off buffer sizes.

Everything here runs in the head before any process starts, so every refusal leaves nothing behind.
"""
from __future__ import annotations

import math
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .config import ConfigError, RigConfig, StageSpec, check_device
from .model import ModelArgs
from .planner import DTYPE_BYTES, PlanError, check_split, even_split, plan_split
from .weights import ModelError, model_args


@dataclass(frozen=True)
class StagePlan:
    index: int
    device: str
    start: int                # first layer
    end: int                  # one past the last layer
    threads: int | None       # CPU: torch threads
    cores: tuple[int, ...]    # CPU: cores this stage is pinned to (empty: no pinning)
    speed: float | None
    memory: int | None


@dataclass(frozen=True)
class Plan:
    cfg: RigConfig
    args: ModelArgs
    stages: tuple[StagePlan, ...]
    ids: np.ndarray            # int32 prompt token ids
    schedule: tuple[tuple[int, int], ...]  # (pos, length) of each prefill chunk
    max_chunk: int

    @property
    def tokens(self) -> int:
        return int(self.ids.size)

    @property
    def max_len(self) -> int:  # KV cache positions: the prompt plus the continuation
        return self.tokens + self.cfg.generate

    def handoff_bytes(self) -> int:
        """One buffer per boundary between stages: the largest chunk of residual rows."""
        return self.max_chunk * self.args.dim * DTYPE_BYTES[self.cfg.dtype]


def visible_gpus() -> int:
    try:
        import torch
        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no usable CUDA means CPU stages
        return 0


def auto_stages(n_cores: int | None = None) -> tuple[StageSpec, ...]:
    """One stage per visible GPU; with none, CPU stages that split the cores between them."""
    n = visible_gpus()
    if n > 0:
        return tuple(StageSpec(device=f"cuda:{i}") for i in range(n))
    cores = n_cores or len(os.sched_getaffinity(0))
    k = 1 if cores < 2 else 2 if cores < 8 else 4
    return tuple(StageSpec(device="cpu", threads=max(1, cores // k)) for _ in range(k))


def assign_cores(stages: tuple[StageSpec, ...]) -> list[tuple[int, ...]]:
    """Give each CPU stage its own cores (two stages on the same cores fight; performance.md)."""
    avail = sorted(os.sched_getaffinity(0))
    cpu_idx = [i for i, s in enumerate(stages) if s.device == "cpu"]
    out: list[tuple[int, ...]] = [() for _ in stages]
    want = sum((stages[i].threads or 1) for i in cpu_idx)
    if want > len(avail):
        return out  # oversubscribed: leave placement to the OS rather than stack stages on one core
    nxt = 0
    for i in cpu_idx:
        n = stages[i].threads or 1
        out[i] = tuple(avail[nxt:nxt + n])
        nxt += n
    return out


def load_prompt(cfg: RigConfig, args: ModelArgs) -> np.ndarray:
    p = cfg.prompt
    if p.random is not None:
        rng = np.random.default_rng(p.random["seed"])
        ids = rng.integers(0, args.vocab_size, size=p.random["tokens"], dtype=np.int64)
    elif p.ids_file is not None:
        path = Path(p.ids_file)
        try:
            ids = np.load(path) if path.suffix == ".npy" else np.array(path.read_text().split(), dtype=np.int64)
        except ValueError as e:
            raise ConfigError(f"prompt.ids_file {p.ids_file!r}: not token ids ({e})") from None
        ids = np.asarray(ids).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= args.vocab_size):
            raise ConfigError(f"prompt.ids_file: ids must be in [0, {args.vocab_size}) for this model")
    else:
        from .tokenizer import Tokenizer
        if p.text is not None:
            text = p.text
        elif p.file is not None:
            text = Path(p.file).read_text(errors="replace")
        else:
            text = stdlib_source(p.stdlib)
        ids = np.array(Tokenizer.for_model(cfg.model).encode(text), dtype=np.int64)
    if p.max_tokens is not None:
        ids = ids[: p.max_tokens]
    if ids.size == 0:
        raise ConfigError("prompt: empty after tokenization")
    return ids.astype(np.int32)


def stdlib_source(module: str) -> str:
    """The source of a standard-library module: a long real prompt that needs nothing shipped."""
    if not module.replace(".", "").replace("_", "").isalnum():
        raise ConfigError(f"prompt.stdlib: {module!r} is not a module name")
    base = Path(sysconfig.get_paths()["stdlib"])
    rel = Path(*module.split("."))
    for cand in (base / rel.with_suffix(".py"), base / rel / "__init__.py"):
        if cand.is_file():
            return cand.read_text()
    raise ConfigError(f"prompt.stdlib: no source for module {module!r} under {base}")


def chunk_schedule(tokens: int, chunk: int, dynamic: bool, args: ModelArgs) -> list[tuple[int, int]]:
    """(pos, length) of each chunk. Dynamic: later chunks shrink so each costs what the first does.

    Cost of a chunk of T tokens at position p, per layer: linear 2*P*T plus attention
    4*nh*hd*T*(p + T/2) FLOPs. The first chunk sets the budget; buffers stay sized for it.
    """
    if not dynamic:
        return [(p, min(chunk, tokens - p)) for p in range(0, tokens, chunk)]
    lin = 2 * args.layer_param_count()
    att = 4 * args.n_heads * args.head_dim

    def cost(p, t):
        return lin * t + att * t * (p + t / 2)

    first = min(chunk, tokens)
    budget = cost(0, first)
    out, p = [], 0
    while p < tokens:
        # largest t with cost(p, t) <= budget: att/2 t^2 + (lin + att p) t - budget = 0
        a, b = att / 2, lin + att * p
        t = int((-b + math.sqrt(b * b + 4 * a * budget)) / (2 * a))
        t = max(64, (t // 64) * 64) if t >= 64 else max(1, t)  # multiples of 64 keep kernels efficient
        t = min(t, chunk, tokens - p)
        out.append((p, t))
        p += t
    return out


def build_plan(cfg: RigConfig) -> Plan:
    try:
        args = model_args(cfg.model)
    except ModelError as e:
        raise ConfigError(str(e)) from None
    stages = cfg.stages if isinstance(cfg.stages, tuple) else auto_stages()
    for i, s in enumerate(stages):
        check_device(s.device, f"stages[{i}].device")
    if len(stages) > args.n_layers:
        raise ConfigError(f"stages: {len(stages)} stages but the model has only {args.n_layers} layers")
    ids = load_prompt(cfg, args)
    total = ids.size + cfg.generate
    if total > args.max_seq_len:
        raise ConfigError(f"prompt: {ids.size} tokens + {cfg.generate} generated exceeds the model's context "
                          f"of {args.max_seq_len} tokens (cut it with prompt.max_tokens)")
    schedule = chunk_schedule(int(ids.size), cfg.chunk, cfg.dynamic_chunks, args)
    max_chunk = max(t for _, t in schedule)
    caps = [s.memory for s in stages]
    host = [s.device == "cpu" for s in stages]
    if cfg.layer_split == "auto":
        speeds = [s.speed or 1.0 for s in stages]
        try:
            split = plan_split(args, len(stages), speeds, caps, total, max_chunk, cfg.dtype, host,
                               with_head=cfg.perplexity)
        except PlanError as e:
            raise ConfigError(str(e)) from None
    else:
        split = list(cfg.layer_split)
        if len(split) != len(stages):
            raise ConfigError(f"layer_split: {len(split)} entries for {len(stages)} stages")
        if sum(split) != args.n_layers:
            raise ConfigError(f"layer_split: {split} sums to {sum(split)}, the model has {args.n_layers} layers")
        err = check_split(args, split, caps, total, max_chunk, cfg.dtype, host)
        if err:
            raise ConfigError(err)
    cores = assign_cores(stages)
    plans, a = [], 0
    for i, (s, n) in enumerate(zip(stages, split)):
        plans.append(StagePlan(i, s.device, a, a + n, s.threads, cores[i], s.speed, s.memory))
        a += n
    return Plan(cfg, args, tuple(plans), ids, tuple(schedule), max_chunk)


__all__ = ["Plan", "StagePlan", "build_plan", "chunk_schedule", "even_split", "load_prompt"]
