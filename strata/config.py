"""The rig file: parsed and validated here, once, into one typed `RigConfig`.

Every check that can be made before a process starts is made here (or in `plan.py`, which
needs the model's metadata), and each failure is one line: `ConfigError`.
"""
from __future__ import annotations

import difflib
import os
import types
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, get_args, get_type_hints

import yaml

from strata.errors import ConfigError

DTYPES = ("auto", "float32", "bfloat16", "float16")  # auto: bfloat16 when every stage is a GPU, else float32
ATTENTION = ("auto", "flash", "cudnn-split")   # CUDA attention path (strata/models/model.py); auto = the model's default
WEIGHTS = ("auto", "resident", "dequantized")   # how a stage holds quantized weights (issue 12)
KV_DTYPES = ("auto", "bfloat16", "float16", "float8_e4m3fn", "q8_0")  # the KV cache's dtype (issue 12); auto = dtype
DECODE_BATCH = ("rows", "steps")
# batch_ahead auto's steps on one CUDA stage: on an H100 (8B Q4_K_M, 16 greedy streams, prefill groups on) 3 took the
# decode from 1,804.5 to 1,894.3 tok/s and 7 gave 1,893.9 with the spin (3 with it: 1,921.9); BENCHMARKS.md 2026-12-06
AUTO_BATCH_AHEAD = 3
MAX_BATCH_AHEAD = 64  # batch_ahead's most steps past a note (a decode batch's result carries each step's argmaxes)
# max_seqs auto's most sequences when serving (a run of one prompt takes 1): on GPU stages a decode step is bound by
# reading the weights, so 16 rows cost little more than one (an H100, 8B Q4_K_M: 214.7 tok/s at 1 stream, 1,234 at 16,
# issue 58) and the batch graphs are captured for every batch size up to it; a CPU stage's step is its own compute,
# past a few rows each more costs nearly its full share, so 4. The planner takes fewer where memory holds fewer
# (plan.auto_max_seqs). A rig with any CPU stage takes the CPU cap.
AUTO_SEQS_CUDA = 16
AUTO_SEQS_CPU = 4
DEFAULT_QUEUE = 64  # server_queue's default: requests waiting for a slot before a 429 (aiperf at 16 users filled 8)
PREFIX_REUSE = ("rows", "chunks")  # a restored prefix: every held row, or up to a chunk boundary of the cold schedule  # max_seqs > 1: several sequences' steps multiplied as one batch, or one by one
DECODE_WEIGHTS = ("auto", "none", "float16", "int8", "int4", "blocks")  # CPU stages: weight-only copies for one-token steps
# the default `remote_command`: the same interpreter and checkout path on the remote host, over ssh
REMOTE_COMMAND = "ssh {host} env PYTHONPATH={cwd} {python} -m workers.join --join {join} --key {key}"
REMOTE_FIELDS = ("host", "python", "cwd", "join", "key", "stage")
# the kernels' A/B arms (`kernels`)
PREFILL_KERNELS = ("triton", "torch")
GRAPH_ATTENTION = ("split-k", "masked")
GRAPH_KERNELS = ("triton", "torch")
DECODE_GEMV = ("auto", "cublas")
IQ3S_KERNELS = ("dp4a", "dp4a-table", "dp4a-u16", "dp4a-smem", "float")
KQUANT_KERNELS = ("bytes", "words", "dp4a")   # Q4_K / Q5_K, and Q6_K
Q8_0_KERNELS = ("dp4a", "bytes")
Q8_ATTENTION = ("widen", "int8", "int8x2")  # split-K decode attention over a q8_0 cache (strata/kernels/decode_attention.py;
                                            # the order is its kernel's INT8 constexpr)
MXFP4_KERNELS = ("dp4a", "float")
ROWS_KERNELS = ("dp4a", "mma-float")  # resident K-quant products of 4 rows or more (decode batches)
WINDOW_KERNELS = ("flex", "band")


@dataclass(frozen=True)
class StageSpec:
    device: str = "cpu"            # "cpu" or "cuda:N"
    threads: int | None = None     # CPU stages: torch threads, pinned to their own cores
    memory: int | None = None      # bytes this stage may use (a cap for the planner)
    speed: float | None = None     # relative speed for layer_split: auto (else calibrated)
    host: str | None = None        # where it runs: None (or "local") = this machine; else a name or address for
                                   # `remote_command` ({host}); activations to and from it travel over tcp

    @property
    def remote(self) -> bool:
        return self.host is not None


PROMPT_KINDS = ("text", "file", "stdlib", "ids_file", "random")  # a prompt's sources: exactly one is given


@dataclass(frozen=True)
class PromptSpec:
    text: str | None = None        # literal text
    file: str | None = None        # a text file
    stdlib: str | None = None      # a module of Python's standard library, e.g. "typing": its source text
    ids_file: str | None = None    # token ids: .npy, or whitespace-separated integers
    random: dict | None = None     # {tokens: N, seed: S}: random ids (synthetic models)
    max_tokens: int | None = None  # cut the tokenized prompt to this many tokens


@dataclass(frozen=True)
class DebugSpec:
    """Test hooks: fault injection and delays. Not for normal use."""
    delay_s: float = 0.0           # sleep added to every chunk's work (orders events in tests)
    delay_step_s: float = 0.0      # ... plus this times the stage index: later stages slower, so
                                   # the order of events no longer races on equal sleeps
    fail_stage: int | None = None  # this stage ...
    fail_chunk: int | None = None  # ... at this chunk ...
    fail_mode: str = "raise"       # ... raises, exits ("exit"), stops moving ("hang") or SIGKILLs itself ("kill")
    fail_phase: str = "prefill"    # ... in this phase: "prefill", "decode", or "load" (before ready; no chunk)
    memory_trace: bool = False     # a CUDA stage logs where its allocated bytes at load came from (workers.memory_trace)


@dataclass(frozen=True)
class KernelSpec:
    """Which kernel or decode path each step takes (`kernels`): the defaults are the fast paths, the others the
    arms they were measured against. Carried to every stage in its job (a remote stage computes as the head's rig
    says, whatever its own host's environment) and handed to the model and kernels as arguments. Each field has an
    environment override (ENV_KERNELS), read here only."""
    prefill: str = field(default="triton", metadata={"choices": PREFILL_KERNELS})  # CUDA prefill: strata/kernels/fused.py's
                                   # fused LSE merge, RoPE and SwiGLU / GeGLU (torch's formulas where Triton is missing),
                                   # or "torch": those formulas
    graph_attention: str = field(default="split-k", metadata={"choices": GRAPH_ATTENTION})  # decode graphs: the
                                   # split-K Triton kernel over the live keys, or efficient attention masked over
                                   # the whole bucket
    graph_kernels: str = field(default="triton", metadata={"choices": GRAPH_KERNELS})  # decode graphs' RMSNorm and
                                   # RoPE-with-cache-write: Triton kernels (strata/kernels/decode_kernels.py) or torch ops
    decode_gemv: str = field(default="auto", metadata={"choices": DECODE_GEMV})  # decode graphs' dense one-row
                                   # products: the Triton kernel by a fixed rule of the shape, or cuBLAS
    gemv_iq3s: str = field(default="dp4a-u16", metadata={"choices": IQ3S_KERNELS})  # resident IQ3_S decode products
    gemv_kquant: str = field(default="dp4a", metadata={"choices": KQUANT_KERNELS})  # resident Q4_K / Q5_K: int32
                                   # words with int8 x by dp4a, words with float x, or byte by byte
    gemv_q6k: str = field(default="dp4a", metadata={"choices": KQUANT_KERNELS})     # resident Q6_K, the same arms
    gemv_q8_0: str = field(default="dp4a", metadata={"choices": Q8_0_KERNELS})      # resident Q8_0: int16 loads
                                   # with int8 x by dp4a, or byte by byte with float x
    gemv_mxfp4: str = field(default="dp4a", metadata={"choices": MXFP4_KERNELS})    # resident MXFP4 experts
                                   # (gpt-oss): aligned words, nibbles to int8 by byte permutes, int8 x by dp4a
                                   # (the stacks re-laid at load), or float x and float32 products per value
    gemv_rows: str = field(default="mma-float", metadata={"choices": ROWS_KERNELS})  # resident Q4_K / Q5_K /
                                   # Q6_K products of a decode batch of 4 rows or more: "mma-float", every row in
                                   # one launch on tensor cores, bf16 x against the weights dequantized in float
                                   # (strata/quant/rows.py; the 8B's graph step on an H100: 7.9 ms for 16 rows
                                   # against 32.4, 7.8 for 4 against 8.6; its logits nearer the float32 model's),
                                   # or "dp4a": the one-row kernels, 4 rows a launch (the weights read once per 4)
    q8_attention: str = field(default="int8x2", metadata={"choices": Q8_ATTENTION})  # decode graphs' split-K
                                   # over a q8_0 cache: "int8x2": q rounded to int8 per 32 dims plus its rounding
                                   # residual as a second int8 dot (~15 bits of q), scores on int8 tensor cores, V
                                   # widened to float16 by byte permutes; "int8": without the residual (~1e-2
                                   # relative error of the output); "widen": each tile widened to the compute
                                   # dtype with float products (8B, 122,880 keys on an H200: 118.6 / 119.9 / 85.1
                                   # tok/s; an int8 arm Triton cannot build falls back to widen)
    window_attention: str = field(default="flex", metadata={"choices": WINDOW_KERNELS})  # window layers' chunk
                                   # attention: FlexAttention with the window as its block mask (CUDA, 16-bit;
                                   # elsewhere, or where it fails, the band) or the band: blocks of queries each
                                   # against its band of keys under a dense mask (strata/kernels/attention.py)
    decode_bells: bool | str = "auto"  # decode notes as shared-memory doorbells: auto (every stage a local GPU
                                   # one), true (any local stages), false (ZeroMQ only)
    decode_ahead: bool | str = "auto"  # with bells and a GPU per stage, queue the next decode step behind a
                                   # GPU-side wait on the bell: auto, or false (the host launches each step)
    slot_spin: bool = True         # max_seqs > 1 with every stage on a GPU: the slot driver polls its socket
                                   # without sleeping while a micro-batch is in flight (up to HEAD_SPIN_S after
                                   # its last send or result), and each stage polls for its next micro-batch (up
                                   # to DECODE_SPIN_S after its last), as one sequence's decode does. On an H100
                                   # (8B, 16 streams) 1,804.5 -> 1,872.4 decode tok/s (bench/device_kv8.sh serve-ab)


# STRATA_<...> -> (the `kernels` field it overrides, {value as written: the field's value})
ENV_KERNELS = {
    "STRATA_CUDA_KERNELS": ("prefill", {v: v for v in PREFILL_KERNELS}),
    "STRATA_GRAPH_ATTENTION": ("graph_attention", {v: v for v in GRAPH_ATTENTION}),
    "STRATA_GRAPH_KERNELS": ("graph_kernels", {v: v for v in GRAPH_KERNELS}),
    "STRATA_DECODE_GEMV": ("decode_gemv", {v: v for v in DECODE_GEMV}),
    "STRATA_GEMV_IQ3S": ("gemv_iq3s", {v: v for v in IQ3S_KERNELS}),
    "STRATA_GEMV_KQUANT": ("gemv_kquant", {v: v for v in KQUANT_KERNELS}),
    "STRATA_GEMV_Q6K": ("gemv_q6k", {v: v for v in KQUANT_KERNELS}),
    "STRATA_GEMV_Q8_0": ("gemv_q8_0", {v: v for v in Q8_0_KERNELS}),
    "STRATA_GEMV_MXFP4": ("gemv_mxfp4", {v: v for v in MXFP4_KERNELS}),
    "STRATA_GEMV_ROWS": ("gemv_rows", {v: v for v in ROWS_KERNELS}),
    "STRATA_Q8_ATTENTION": ("q8_attention", {v: v for v in Q8_ATTENTION}),
    "STRATA_WINDOW_ATTENTION": ("window_attention", {v: v for v in WINDOW_KERNELS}),
    "STRATA_DECODE_BELLS": ("decode_bells", {"auto": "auto", "0": False, "1": True}),
    "STRATA_DECODE_AHEAD": ("decode_ahead", {"auto": "auto", "0": False}),
    "STRATA_SLOT_SPIN": ("slot_spin", {"0": False, "1": True}),
}


@dataclass(frozen=True)
class RigConfig:
    model: str = "smollm2"                  # HF dir, .gguf file, "smollm2", or "synthetic:PRESET"
    dtype: str = field(default="auto", metadata={"choices": DTYPES})  # compute dtype (auto: resolved in from_dict)
    attention: str = field(default="auto", metadata={"choices": ATTENTION})  # CUDA attention path (stages and
                                            # planner alike); STRATA_CUDA_ATTENTION overrides it
    weights: str = field(default="auto", metadata={"choices": WEIGHTS})      # quantized weights resident or
                                            # dequantized at load (carried to the stage; see issue 12)
    kv_dtype: str = field(default="auto", metadata={"choices": KV_DTYPES})   # KV cache dtype (see issue 12)
    stages: tuple[StageSpec, ...] | str = "auto"   # list of stages, or "auto"
    layer_split: tuple[int, ...] | str = "auto"     # layer counts per stage, or "auto"
    chunk: int | str = "auto"               # tokens per chunk (the largest, with dynamic chunks); auto: the
                                            # planner's, the largest that fits every stage's memory up to what
                                            # keeps the pipeline full (strata.plan.plan.preferred_chunk)
    dynamic_chunks: bool = False            # size later chunks so each costs what the first does
    depth: int = 1                          # chunks in flight below a stage: 1 overlap, 0 the old join
    prompt: PromptSpec = field(default_factory=lambda: PromptSpec(text="The capital of France is"))
    generate: int = 0                       # greedy continuation tokens after the prefill
    max_context: int | None = None          # prompt + generated tokens any prefill / generate may use: the ids
                                            # buffer and every stage's KV cache are sized for it once (default:
                                            # the model's context, halved until each stage's memory holds it)
    decode_weights: str = field(default="auto", metadata={"choices": DECODE_WEIGHTS})  # CPU stages: narrower
                                            # weight-only copies for decode steps (a prefill, its last logits
                                            # included, keeps the dense ones); auto: blocks for a quantized
                                            # Llama-core file where a C compiler is found and the CPU has
                                            # AVX-512 VNNI or AVX2, else none
                                            # (strata.kernels.cpu_decode.auto_kind; the log says which)
    cuda_graphs: bool = True                # CUDA stages: replay a captured graph for each one-token step
    perplexity: bool = True                 # mean NLL of the prompt, computed on the last stage
    dump_residual: bool = False             # write residual.npy (after the last layer) and its md5
    timing: bool = False                    # console: the per-stage timing table and busy histogram (report.json
                                            # always has the figures)
    out: str | None = None                  # run directory (default runs/<time>)
    seed: int = 0                           # synthetic weights
    ready_timeout_s: float = field(default=300.0, metadata={"positive": True})          # each stage must load and report ready within this
    stall_timeout_s: float = field(default=600.0, metadata={"positive": True})          # no progress for this long fails the run (stacks dumped)
    progress: bool = True                   # progress bar on the console
    # -- stages on other hosts (`stages[i].host`); none of these is used while every stage is local --------
    listen: str | None = None               # "ADDR" or "ADDR:PORT" (an address or interface name of this machine)
                                            # the head binds its tcp sockets on; required once a stage is remote
                                            # (never guessed; 0.0.0.0 only if written here). PORT: the join port
    remote_command: str = REMOTE_COMMAND    # how the head starts a remote stage: a template, split like a shell
                                            # line and run without one (fields {host} {python} {cwd} {join} {key}
                                            # {stage}; {key} is "-": the key goes on stdin), or "print": only print
                                            # the exact command for each remote stage, for a person to run
    heartbeat_s: float = field(default=1.0, metadata={"positive": True})                # head and remote stages tell each other they are alive this often
    heartbeat_timeout_s: float = field(default=10.0, metadata={"positive": True})       # a remote stage silent this long fails the run (naming host and
                                            # stage); a remote stage exits when the head is silent this long
    server_max_body_bytes: int | None = field(default=None, metadata={"positive": True})  # --serve: a request
                                            # body over this is refused (413) before it is read whole, parsed or
                                            # tokenized (default: max_context * 16 + 1 MiB, what max_context
                                            # tokens could take as JSON with room to spare)
    prefix_cache_bytes: int = 2 << 30       # each stage's host memory (pinned on CUDA) for snapshots of earlier
                                            # prompts' KV by block of 256 tokens, LRU (strata/kvcache/prefix_cache.py);
                                            # 0: off, only the last prompt's live KV is reused
    prefix_cache_device_bytes: int | str = 0  # each CUDA stage's device memory for copies of the prefix cache's
                                            # most recently used blocks, LRU (a subset of what the host tier
                                            # holds): a restore of those copies on the device instead of over PCIe;
                                            # the planner counts it. auto: half of what a capped CUDA stage's
                                            # memory leaves after the plan, at most prefix_cache_bytes (0 where the
                                            # prefix cache is off). 0: off (CPU stages have none)
    kv_cache_dir: str | None = None         # the prefix cache's disk tier: every snapshot block also written to a
                                            # file under this folder (a subfolder per model and rig, one per stage:
                                            # strata/kvcache/prefix_cache.py), and restored from it once the host copy is
                                            # evicted; a later run of the same model and rig reuses them
    kv_cache_dir_bytes: int = field(default=20 << 30, metadata={"positive": True})  # each stage's disk budget
                                            # under kv_cache_dir, LRU (the files' times carry over between runs)
    prefix_reuse: str = field(default="rows", metadata={"choices": PREFIX_REUSE})  # what a prompt reuses of KV
                                            # held for its prefix (the prefix cache, a loaded KV file): rows:
                                            # every row (a prompt's last, partial block included; the rest is
                                            # prefilled from there, its bits within rounding of a cold
                                            # prefill's); chunks: up to a chunk boundary of the prompt's cold
                                            # schedule (the rest in the cold prefill's own chunks: its bits)
    max_seqs: int | str = "auto"            # sequences whose KV each stage holds at once (--serve: concurrent
                                            # requests in the pipeline, one slot each; the planner counts max_seqs
                                            # x the KV). auto: with --serve as many as every stage holds at the
                                            # rig's context, at most AUTO_SEQS_CUDA (AUTO_SEQS_CPU with a CPU
                                            # stage); 1 for a run, and where max_seqs_refusal says so
    server_queue: int = DEFAULT_QUEUE       # --serve: requests that may wait for a slot (0: none wait); one
                                            # more is answered 429 with Retry-After
    decode_batch: str = field(default="rows", metadata={"choices": DECODE_BATCH})  # max_seqs > 1: rows: the
                                            # decoding sequences' steps go through a stage as one batch of rows
                                            # (each weight read once a batch; in C a row keeps the bits of its
                                            # step alone, with torch's products within rounding of them); steps:
                                            # each sequence's step alone, one after another, on a torch stage
    prefill_groups: bool | str = "auto"     # max_seqs > 1, decode_batch rows: the last prefill chunks of
                                            # sequences waiting at once go through the stages as one micro-batch
                                            # (each weight read once for them; each row within rounding of its
                                            # chunk alone). auto: when every stage is on a GPU, whose decode
                                            # batches round so too (a CPU stage decoding in C gives each sequence
                                            # the bits it gets alone, which a group would not). False (or
                                            # decode_batch steps, or prefix_reuse chunks, whose restores promise
                                            # cold bits): each chunk alone
    kv_pool: int | str = 0                  # max_seqs > 1: the KV positions each stage holds for all sequences
                                            # together in its global-attention layers, one pool from which each
                                            # sequence takes an extent of its prompt + max_tokens while it runs
                                            # (a sequence waits while none is free), >= max_context; auto: what
                                            # the stages' memory holds (the planner's). 0: each slot holds
                                            # max_context positions (max_seqs x max_context)
    batch_ahead: int | str = "auto"         # max_seqs > 1 on one stage: a decode batch whose rows are all greedy
                                            # runs up to this many more steps on its own argmaxes before the head
                                            # answers (the stage never waits for the head between them; a row
                                            # that ends early wastes those steps). 0: one step a note. auto:
                                            # AUTO_BATCH_AHEAD on one CUDA stage, else 0. With several stages the
                                            # n_stages batches in flight keep each busy: no effect (the head's log
                                            # says so)
    kernels: KernelSpec = field(default_factory=KernelSpec)  # the kernels' A/B switches (KernelSpec)
    debug: DebugSpec = field(default_factory=DebugSpec)


_TOP = {f.name for f in fields(RigConfig)}


def _suggest(key: str, known) -> str:
    m = difflib.get_close_matches(key, sorted(known), n=1)
    return f" (did you mean {m[0]!r}?)" if m else ""


def _check_keys(d: dict, known: set, where: str) -> None:
    for k in d:
        if k not in known:
            raise ConfigError(f"unknown key {where}{k!r}{_suggest(str(k), known)}")


def _typed(name: str, value: Any, kind, allow_none=False):
    if value is None and allow_none:
        return None
    if kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{name}: expected true or false, got {value!r}")
        return value
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name}: expected an integer, got {value!r}")
        return value
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{name}: expected a number, got {value!r}")
        return float(value)
    if kind is str:
        if not isinstance(value, str):
            raise ConfigError(f"{name}: expected a string, got {value!r}")
        return value
    raise AssertionError(kind)


def _scalar_kind(cls, f) -> tuple[type, bool]:
    """(python type, None allowed) of a scalar field, from its annotation (resolved, not string-edited)."""
    t = get_type_hints(cls)[f.name]
    args = get_args(t) if isinstance(t, types.UnionType) else (t,)
    kinds = [a for a in args if a is not type(None)]
    if len(kinds) != 1 or kinds[0] not in (str, int, float, bool):
        raise AssertionError(f"{cls.__name__}.{f.name}: {t} needs a parser in _PARSERS")
    return kinds[0], len(kinds) != len(args)


def _parse_fields(cls, name: str, raw: dict, parsers: dict) -> Any:
    """raw mapping -> cls, every field of the dataclass reached: a scalar by its annotation, anything
    else by `parsers[field]`; a field with neither fails at import (see _check_parsers), never dropped."""
    _check_keys(raw, {f.name for f in fields(cls)}, f"in {name}: " if name else "")
    out = {}
    for f in fields(cls):
        if f.name not in raw:
            continue
        where = f"{name}.{f.name}" if name else f.name
        if f.name in parsers:
            out[f.name] = parsers[f.name](where, raw[f.name])
        else:
            kind, allow_none = _scalar_kind(cls, f)
            out[f.name] = _typed(where, raw[f.name], kind, allow_none)
        choices = f.metadata.get("choices")
        if choices and out[f.name] not in choices:
            raise ConfigError(f"{where}: {out[f.name]!r} is not one of {', '.join(map(str, choices))}")
        if f.metadata.get("positive") and out[f.name] is not None and out[f.name] <= 0:
            raise ConfigError(f"{where}: must be > 0, got {raw[f.name]!r}")
    return cls(**out)


def _sub(cls, parsers: dict | None = None):
    def parse(name: str, raw) -> Any:
        if raw is None:
            return cls()
        if not isinstance(raw, dict):
            raise ConfigError(f"{name}: expected a mapping, got {raw!r}")
        return _parse_fields(cls, name, raw, parsers or {})
    return parse


def _random(name: str, v) -> dict:
    if not isinstance(v, dict):
        raise ConfigError(f"{name}: expected {{tokens: N, seed: S}}, got {v!r}")
    _check_keys(v, {"tokens", "seed"}, f"in {name}: ")
    _typed(f"{name}.tokens", v.get("tokens"), int)
    _typed(f"{name}.seed", v.get("seed", 0), int)
    return {"tokens": v["tokens"], "seed": v.get("seed", 0)}


def _stages(name: str, s):
    if s == "auto":
        return "auto"
    if isinstance(s, list) and s:
        return tuple(_stage(i, x) for i, x in enumerate(s))
    raise ConfigError(f"stages: expected 'auto' or a non-empty list of {{device, threads?}}, got {s!r}")


def _bytes_or_auto(name: str, v):
    if v == "auto" or (isinstance(v, int) and not isinstance(v, bool)):
        return v
    raise ConfigError(f"{name}: expected 'auto' or a number of bytes, got {v!r}")


def _positions_or_auto(name: str, v):
    if v == "auto" or (isinstance(v, int) and not isinstance(v, bool)):
        return v
    raise ConfigError(f"{name}: expected 'auto' or a number of positions, got {v!r}")


def _count_or_auto(name: str, v):
    if v == "auto" or (isinstance(v, int) and not isinstance(v, bool)):
        return v
    raise ConfigError(f"{name}: expected 'auto' or a number of sequences, got {v!r}")


def _steps_or_auto(name: str, v):
    if v == "auto" or (isinstance(v, int) and not isinstance(v, bool)):
        return v
    raise ConfigError(f"{name}: expected 'auto' or a number of steps, got {v!r}")


def _chunk(name: str, c):
    if c == "auto" or (isinstance(c, int) and not isinstance(c, bool)):
        return c
    raise ConfigError(f"chunk: expected 'auto' or a number of tokens, got {c!r}")


def _auto_or(*flags: bool):
    """A switch that is `auto` or one of these YAML booleans (YAML reads a bare `off` as false anyway)."""
    def parse(name: str, v):
        if v == "auto" or (isinstance(v, bool) and v in flags):
            return v
        raise ConfigError(f"{name}: expected auto or {' or '.join(str(f).lower() for f in flags)}, got {v!r}")
    return parse


_KERNEL_PARSERS = {"decode_bells": _auto_or(True, False), "decode_ahead": _auto_or(False)}


def kernel_spec(raw: dict) -> KernelSpec:
    """A `kernels` mapping (the rig's, or a stage job's) -> KernelSpec, checked as the rig's keys are."""
    return _sub(KernelSpec, _KERNEL_PARSERS)("kernels", raw)


def _layer_split(name: str, ls):
    if ls == "auto":
        return "auto"
    if isinstance(ls, list) and ls and all(isinstance(n, int) and not isinstance(n, bool) for n in ls):
        if any(n <= 0 for n in ls):
            raise ConfigError(f"layer_split: every stage needs at least one layer, got {ls}")
        return tuple(ls)
    raise ConfigError(f"layer_split: expected 'auto' or a list of layer counts, got {ls!r}")


# fields whose type is not a plain scalar: every one of them has its parser here
_PARSERS = {
    RigConfig: {"stages": _stages, "layer_split": _layer_split, "chunk": _chunk,
                "prefix_cache_device_bytes": _bytes_or_auto, "kv_pool": _positions_or_auto,
                "max_seqs": _count_or_auto,
                "batch_ahead": _steps_or_auto, "prefill_groups": _auto_or(True, False),
                "prompt": _sub(PromptSpec, {"random": _random}), "debug": _sub(DebugSpec),
                "kernels": _sub(KernelSpec, _KERNEL_PARSERS)},
    PromptSpec: {"random": _random},
    StageSpec: {},
    KernelSpec: _KERNEL_PARSERS,
    DebugSpec: {},
}


def _check_parsers() -> None:
    """At import: a field added to a rig dataclass without a way to parse it fails loudly here."""
    for cls, parsers in _PARSERS.items():
        for f in fields(cls):
            if f.name not in parsers:
                _scalar_kind(cls, f)


def parse_value(text: str) -> Any:
    """A --set value: parsed as YAML so `chunk=64`, `timing=true`, `stages=[...]` all work."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"--set value {text!r} is not valid YAML: {str(e).splitlines()[0]}") from None


def apply_override(raw: dict, assignment: str) -> None:
    if "=" not in assignment:
        raise ConfigError(f"--set expects key=value, got {assignment!r}")
    key, text = assignment.split("=", 1)
    parts = key.strip().split(".")
    if parts[0] not in _TOP:
        raise ConfigError(f"--set: unknown key {parts[0]!r}{_suggest(parts[0], _TOP)}")
    d = raw
    for p in parts[:-1]:
        if not isinstance(d.get(p), dict):
            d[p] = {}
        d = d[p]
    if parts[0] == "prompt" and len(parts) >= 2 and parts[1] in PROMPT_KINDS:
        for kind in PROMPT_KINDS:  # a prompt has one source: `--set prompt.file=doc.txt` replaces the rig's
            if kind != parts[1]:
                raw["prompt"].pop(kind, None)
    d[parts[-1]] = parse_value(text)


def load_raw(path: str | os.PathLike) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"rig file {str(p)!r} not found")
    try:
        raw = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"rig file {str(p)!r} is not valid YAML{at}: {getattr(e, 'problem', e)}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"rig file {str(p)!r}: expected a mapping of keys, got {type(raw).__name__}")
    return raw


def from_dict(raw: dict, env: dict | None = None) -> RigConfig:
    """Validate a raw mapping (from YAML, --set, or the Python API) into a RigConfig.

    STRATA_PF_DEPTH, STRATA_PREFILL_TIMING, STRATA_CUDA_ATTENTION and the `kernels` switches (ENV_KERNELS) in
    `env` (default os.environ) override the rig.
    """
    env = os.environ if env is None else env
    _check_keys(raw, _TOP, "")
    raw = _apply_env(raw, env)
    cfg = _parse_fields(RigConfig, "", raw, _PARSERS[RigConfig])
    _check_values(cfg)
    if cfg.dtype == "auto":
        cfg = replace(cfg, dtype=auto_dtype(cfg.stages))
    return cfg


def auto_dtype(stages) -> str:
    """`dtype: auto`: bfloat16 when every stage is a GPU (the fast path: a float32 32B on four GPU stages
    prefilled at a sixth of the speed and held the dequantization scratch twice), float32 with any CPU stage
    (its kernels and the exact comparisons are float32's). `stages: auto` is the visible GPUs, else CPUs."""
    if isinstance(stages, str):
        import torch
        return "bfloat16" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "float32"
    return "bfloat16" if all(s.device.startswith("cuda") for s in stages) else "float32"


def _apply_env(raw: dict, env) -> dict:
    raw = dict(raw)
    if env.get("STRATA_PF_DEPTH", "") != "":
        try:
            raw["depth"] = int(env["STRATA_PF_DEPTH"])
        except ValueError:
            raise ConfigError(f"STRATA_PF_DEPTH={env['STRATA_PF_DEPTH']!r}: expected 0 or 1") from None
    if env.get("STRATA_PREFILL_TIMING", "") not in ("", "0"):
        raw["timing"] = True
    if env.get("STRATA_CUDA_ATTENTION", "") != "":
        if env["STRATA_CUDA_ATTENTION"] not in ATTENTION:
            raise ConfigError(f"STRATA_CUDA_ATTENTION={env['STRATA_CUDA_ATTENTION']!r}: expected one of "
                              f"{', '.join(ATTENTION)}")
        raw["attention"] = env["STRATA_CUDA_ATTENTION"]
    for var, (key, values) in ENV_KERNELS.items():  # each overrides its `kernels` key (--set overrides it again)
        if env.get(var, "") == "":
            continue
        if env[var] not in values:
            raise ConfigError(f"{var}={env[var]!r}: expected one of {', '.join(values)} (it overrides kernels.{key})")
        raw["kernels"] = {**(raw.get("kernels") or {}), key: values[env[var]]}
    return raw


def _stage(i: int, x) -> StageSpec:
    if isinstance(x, str):
        x = {"device": x}
    spec = _sub(StageSpec)(f"stages[{i}]", x)
    if spec.threads is not None and spec.threads <= 0:
        raise ConfigError(f"stages[{i}].threads: must be > 0, got {spec.threads}")
    if spec.memory is not None and spec.memory <= 0:
        raise ConfigError(f"stages[{i}].memory: must be > 0 bytes, got {spec.memory}")
    if spec.speed is not None and spec.speed <= 0:
        raise ConfigError(f"stages[{i}].speed: must be > 0, got {spec.speed}")
    if spec.host is not None:
        if spec.host.strip() == "":
            raise ConfigError(f"stages[{i}].host: empty (leave it out, or write local, for this machine)")
        if spec.host == "local":
            spec = replace(spec, host=None)
    return spec


def max_seqs_refusal(cfg: RigConfig) -> str | None:
    """Why the rig cannot hold several sequences (max_seqs > 1), or None. (A linear-attention layer keeps a
    recurrent state a slot, as an attention layer keeps a KV cache a slot.)"""
    if cfg.depth == 0:
        return "depth 0 joins every chunk through the whole pipeline, so no two sequences' steps overlap"
    if cfg.dump_residual:
        return "dump_residual writes one prompt's residual"
    if isinstance(cfg.stages, tuple) and any(s.host is not None for s in cfg.stages):
        return "a stage on another host gets its ids by note, for one sequence only"
    return None


def _check_one_seq(cfg: RigConfig) -> None:
    """What one sequence cannot take: the keys of several sequences' sharing."""
    if cfg.kv_pool:
        raise ConfigError("kv_pool: a pool shared by several sequences needs max_seqs > 1")
    if cfg.prefill_groups is True:
        raise ConfigError("prefill_groups: a group is several sequences' chunks; it needs max_seqs > 1")
    if cfg.batch_ahead != "auto" and cfg.batch_ahead:
        raise ConfigError("batch_ahead: decode batches need max_seqs > 1 (one sequence's steps take the decode "
                          "graphs' launch-ahead: kernels.decode_ahead)")


def resolve_max_seqs(cfg: RigConfig, seqs: int) -> RigConfig:
    """The rig with max_seqs auto taken as `seqs` (plan.auto_max_seqs), checked as a rig that gave it would be."""
    cfg = replace(cfg, max_seqs=seqs)
    if seqs == 1:
        _check_one_seq(cfg)
    return cfg


def _check_values(cfg: RigConfig) -> None:
    if cfg.depth not in (0, 1):
        raise ConfigError(
            f"depth {cfg.depth} refused: a stage owns one set of chunk buffers, so at most one chunk may be "
            "in flight below it (1 = overlap, 0 = the old full join)")
    if cfg.max_seqs != "auto" and cfg.max_seqs < 1:
        raise ConfigError(f"max_seqs: must be >= 1 (or auto), got {cfg.max_seqs}")
    if cfg.max_seqs != "auto" and cfg.max_seqs > 1:
        why = max_seqs_refusal(cfg)
        if why:
            raise ConfigError(f"max_seqs {cfg.max_seqs} refused: {why}")
    if cfg.max_seqs == 1:  # (auto: checked again once resolved, by resolve_max_seqs)
        _check_one_seq(cfg)
    if cfg.batch_ahead != "auto" and not 0 <= cfg.batch_ahead <= MAX_BATCH_AHEAD:
        raise ConfigError(f"batch_ahead: 0 to {MAX_BATCH_AHEAD} steps, got {cfg.batch_ahead}")
    if cfg.kv_pool != "auto" and cfg.kv_pool < 0:
        raise ConfigError(f"kv_pool: must be >= 0 positions (0: a slot of max_context each), got {cfg.kv_pool}")
    if cfg.server_queue < 0:
        raise ConfigError(f"server_queue: must be >= 0 requests (0: none wait), got {cfg.server_queue}")
    if cfg.chunk != "auto" and cfg.chunk <= 0:
        raise ConfigError(f"chunk: must be a positive number of tokens, got {cfg.chunk}")
    if cfg.generate < 0:
        raise ConfigError(f"generate: must be >= 0, got {cfg.generate}")
    if cfg.max_context is not None and cfg.max_context < 1:
        raise ConfigError(f"max_context: must be a positive number of tokens, got {cfg.max_context}")
    if cfg.prefix_cache_bytes < 0:
        raise ConfigError(f"prefix_cache_bytes: must be >= 0 (0 turns the prefix cache off), got {cfg.prefix_cache_bytes}")
    tier = cfg.prefix_cache_device_bytes
    if tier != "auto" and tier < 0:
        raise ConfigError(f"prefix_cache_device_bytes: must be >= 0 (0: no device tier), got {tier}")
    if tier != "auto" and tier and not cfg.prefix_cache_bytes:
        raise ConfigError("prefix_cache_device_bytes: the device tier copies blocks the host tier holds, and "
                          "prefix_cache_bytes is 0 (the prefix cache is off)")
    if cfg.kv_cache_dir is not None:
        if not cfg.kv_cache_dir.strip():
            raise ConfigError("kv_cache_dir: empty (leave it out for no disk tier)")
        if not cfg.prefix_cache_bytes:
            raise ConfigError("kv_cache_dir: the disk tier writes the prefix cache's blocks through, and "
                              "prefix_cache_bytes is 0 (the prefix cache is off)")
    p = cfg.prompt
    given = [n for n in PROMPT_KINDS if getattr(p, n) is not None]
    if len(given) != 1:
        raise ConfigError(f"prompt: give exactly one of {', '.join(PROMPT_KINDS)} (got {given or 'none'})")
    if p.max_tokens is not None and p.max_tokens <= 0:
        raise ConfigError(f"prompt.max_tokens: must be > 0, got {p.max_tokens}")
    if p.random is not None and p.random["tokens"] <= 0:
        raise ConfigError(f"prompt.random.tokens: must be > 0, got {p.random['tokens']}")
    if p.text is not None and p.text == "":
        raise ConfigError("prompt: the text is empty")
    for name in ("file", "ids_file"):
        v = getattr(p, name)
        if v is not None and not Path(v).is_file():
            raise ConfigError(f"prompt.{name}: {v!r} not found")
    if cfg.debug.fail_mode not in ("raise", "exit", "hang", "kill"):
        raise ConfigError(f"debug.fail_mode: expected raise, exit, hang or kill, got {cfg.debug.fail_mode!r}")
    if cfg.debug.fail_phase not in ("load", "prefill", "decode"):
        raise ConfigError(f"debug.fail_phase: expected load, prefill or decode, got {cfg.debug.fail_phase!r}")
    if cfg.decode_weights == "blocks" and cfg.kv_dtype in ("float16", "q8_0") and not (
            isinstance(cfg.stages, tuple) and all(s.device.startswith("cuda") for s in cfg.stages)):
        raise ConfigError("decode_weights: blocks decodes CPU stages in C on a float32, bfloat16 or float8_e4m3fn KV "
                          f"cache, not kv_dtype {cfg.kv_dtype}: set kv_dtype bfloat16 or float8_e4m3fn, or "
                          "decode_weights auto (dense steps)")
    if isinstance(cfg.stages, tuple):
        for i, s in enumerate(cfg.stages):
            if not s.remote:  # a remote stage's device is checked on its host, when it loads
                check_device(s.device, f"stages[{i}].device")
    _check_remote(cfg)


def split_listen(listen: str) -> tuple[str, int | None]:
    """`listen` -> (address or interface, join port or None for any free port)."""
    host, sep, port = listen.rpartition(":") if listen.count(":") == 1 else (listen, "", "")
    if not sep:
        return listen, None
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"listen: {listen!r}: the port must be a number in 1..65535")
    return host, int(port)


def _check_remote(cfg: RigConfig) -> None:
    """Stages on other hosts: the head must be told where to listen; the launch template must be usable;
    what the planner would measure on this machine (speed, a card's free memory) must be given."""
    import shlex
    import string
    if cfg.heartbeat_s <= 0 or cfg.heartbeat_timeout_s < 2 * cfg.heartbeat_s:
        raise ConfigError(f"heartbeat_timeout_s ({cfg.heartbeat_timeout_s:g}) must be at least twice heartbeat_s "
                          f"({cfg.heartbeat_s:g}), and heartbeat_s > 0")
    remote = [i for i, s in enumerate(cfg.stages) if s.remote] if isinstance(cfg.stages, tuple) else []
    if not remote:
        return
    who = f"stage {remote[0]} runs on host {cfg.stages[remote[0]].host!r}"
    if not cfg.listen:
        raise ConfigError(f"listen: required when a stage is remote ({who}): the address of this machine the "
                          "stages reach it at, e.g. listen: 10.0.0.5 (it is never guessed)")
    if "://" in cfg.listen or not split_listen(cfg.listen)[0]:
        raise ConfigError(f"listen: {cfg.listen!r}: expected ADDR or ADDR:PORT, e.g. 10.0.0.5 or 10.0.0.5:5555")
    if cfg.remote_command != "print":
        try:
            names = {f for arg in shlex.split(cfg.remote_command)
                     for _, f, _, _ in string.Formatter().parse(arg) if f is not None}
        except ValueError as e:
            raise ConfigError(f"remote_command: {e}") from None
        unknown = sorted(names - set(REMOTE_FIELDS))
        if unknown:
            raise ConfigError(f"remote_command: unknown field {{{unknown[0]}}} (fields: "
                              + " ".join("{" + f + "}" for f in REMOTE_FIELDS) + ")")
        if not {"join", "key"} <= names:
            raise ConfigError("remote_command: must pass {join} and {key} to the stage, e.g. "
                              "'ssh {host} {python} -m workers.join --join {join} --key {key}' (or use: print)")
    for i in remote:
        s = cfg.stages[i]
        if s.device != "cpu" and s.memory is None:
            raise ConfigError(f"stages[{i}].memory: required for a remote {s.device} (host {s.host!r}): its free "
                              "memory cannot be measured from here")
    alike = len({(s.device.split(":")[0], s.threads) for s in cfg.stages}) == 1
    if cfg.layer_split == "auto" and not alike and any(s.speed is None for s in cfg.stages):
        raise ConfigError(f"stages: give every stage `speed:` (or give layer_split) when a stage is remote and the "
                          f"stages differ ({who}): calibration measures this machine only")


def check_run_dir(path: Path) -> None:
    """The run directory must be creatable and writable: refused here, before any stage starts and
    dies trying to open its log there. Creates the directory (the run would anyway)."""
    probe = path / f".strata-probe-{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"out: {str(path)!r} cannot be the run directory: {e.strerror or e}") from None


def device_syntax_ok(dev: str) -> bool:
    """'cpu' or 'cuda:N': the one place device syntax is defined (the rig and a remote stage's spec)."""
    return dev == "cpu" or (dev.startswith("cuda:") and dev[5:].isdigit())


def check_device(dev: str, name: str) -> None:
    if dev == "cpu":
        return
    if not device_syntax_ok(dev):
        raise ConfigError(f"{name}: {dev!r} is not a device (expected 'cpu' or 'cuda:N')")
    import torch
    n = torch.cuda.device_count()
    if int(dev[5:]) >= n:
        raise ConfigError(f"{name}: {dev} does not exist ({n} CUDA device{'s' if n != 1 else ''} visible)")


def load(path: str | os.PathLike, overrides: list[str] = (), env: dict | None = None) -> RigConfig:
    """Rig file, then the environment (STRATA_PF_DEPTH, STRATA_PREFILL_TIMING, STRATA_CUDA_ATTENTION, ENV_KERNELS),
    then --set."""
    return load_dict(load_raw(path), overrides, env)


def load_dict(raw: dict, overrides: list[str] = (), env: dict | None = None) -> RigConfig:
    """`load` for a rig given as a mapping (the launcher's rig-less jobs: `strata run MODEL ...`)."""
    env = os.environ if env is None else env
    raw = dict(raw)
    _check_keys(raw, _TOP, "")
    raw = _apply_env(raw, env)
    for a in overrides:
        apply_override(raw, a)
    return from_dict(raw, env={})


def cache_dir(env: dict | None = None) -> Path:
    """Where this host keeps what Strata builds (strata/kernels/cpu_decode.py's C library): STRATA_CACHE_DIR, else
    $XDG_CACHE_HOME/strata, else ~/.cache/strata. Not a rig key: a path on the machine that builds, read there
    when it builds (a remote stage's is its own host's, not the head's), and no switch of the computation."""
    env = os.environ if env is None else env
    return Path(env.get("STRATA_CACHE_DIR") or os.path.join(
        env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "strata"))


_check_parsers()
