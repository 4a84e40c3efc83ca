"""From a validated RigConfig to a concrete run plan: stages with devices, cores and layer
ranges; the prompt as token ids; the chunk schedule; hand-off buffer sizes.

Everything here runs in the head before any process starts, so every refusal leaves nothing behind.
"""
from __future__ import annotations

import itertools
import logging
import os
import sysconfig
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from strata.comm import bells
from strata.config import (AUTO_BATCH_AHEAD, AUTO_SEQS_CPU, AUTO_SEQS_CUDA, ConfigError, RigConfig, StageSpec,
                           check_device, max_seqs_refusal, resolve_max_seqs)
from strata.models.args import ModelArgs
from strata.plan.schedule import chunk_schedule
from strata.kernels.attention import PREFIX_BLOCK
from strata.plan.planner import (DTYPE_BYTES, POOL_GRAIN, PlanError, Speed, check_split, cuda_attention, even_split,
                                 plan_split, predicted_times, stage_need, stage_needs)
from strata.weights.checkpoint import model_args, storage
from strata.errors import ModelError

log = logging.getLogger("strata.plan.plan")


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
    host: str | None = None   # None: this machine; else the rig's `stages[i].host`
    prefix_block: int = PREFIX_BLOCK  # an 8-bit cache's prefix positions widened at once (choose_split's)


@dataclass(frozen=True)
class Resolved:
    """Each `auto` of the rig that depends on where the stages run, taken once here (`resolve`); the head, its
    request loop and the stages read these and resolve none again."""
    all_cuda: bool        # every stage a GPU one: its waits may spin (a CPU stage has no core to spare)
    batch_ahead: int      # steps an all-greedy decode batch runs past its note: auto is AUTO_BATCH_AHEAD on one
                          # CUDA stage, 0 on CPU (its step is its own compute: no launch gap to hide); 0 on several
                          # stages, whose batches in flight keep each busy
    prefill_groups: bool  # sequences' last prefill chunks as one micro-batch: auto on GPU stages (their decode
                          # batches' rows round apart from each step alone anyway; CPU stages decoding in C keep each
                          # sequence's bits its own); never with decode_batch steps (each step's own bits), prefix_reuse
                          # chunks (a restored prefix promises the cold prefill's bits) or a model that cannot group
    slot_spin: bool       # kernels.slot_spin, on an all-GPU rig only
    decode_bells: bool    # kernels.decode_bells: decode notes as doorbells (one sequence, local stages, bells.wanted)
    decode_ahead: bool    # kernels.decode_ahead: with bells, each GPU stage queues its next step (bells.ahead_wanted)
    attention: str        # the CUDA prefill's attention path (the rig's `attention`; auto: the model's default)


def resolve(cfg: RigConfig, args: ModelArgs, stages) -> Resolved:
    """The rig's `auto`s for stages on these devices (StagePlan: device, host)."""
    devices = [s.device for s in stages]
    all_cuda = all(d.startswith("cuda") for d in devices)
    ahead = cfg.batch_ahead
    if ahead == "auto":
        ahead = AUTO_BATCH_AHEAD if all_cuda and len(stages) == 1 else 0
    groups = cfg.prefill_groups is True or (cfg.prefill_groups == "auto" and all_cuda)
    groups = groups and cfg.decode_batch == "rows" and cfg.prefix_reuse != "chunks" and args.group_refusal() is None
    remote = any(s.host is not None for s in stages)  # (several sequences' steps take the "taken" path: no bells)
    rung = cfg.max_seqs == 1 and bells.wanted(devices, remote, cfg.kernels.decode_bells)
    if ahead and len(stages) > 1:
        log.info("batch_ahead %d: no effect on %d stages (their batches in flight keep each busy)", ahead, len(stages))
    return Resolved(all_cuda=all_cuda, batch_ahead=ahead if len(stages) == 1 else 0, prefill_groups=groups,
                    slot_spin=cfg.kernels.slot_spin and all_cuda, decode_bells=rung,
                    decode_ahead=rung and bells.ahead_wanted(devices, cfg.kernels.decode_ahead),
                    attention=cuda_attention(cfg.attention))


@dataclass(frozen=True)
class Plan:
    cfg: RigConfig
    args: ModelArgs
    stages: tuple[StagePlan, ...]
    ids: np.ndarray            # int32 prompt token ids
    schedule: tuple[tuple[int, int], ...]  # (pos, length) of each prefill chunk
    max_chunk: int             # the hand-off buffers' rows: the largest chunk of any prompt up to max_context
    planner: dict = field(default_factory=dict)  # how the split was chosen: speeds, predicted times, needs
    max_context: int = 0       # KV positions every stage holds (and the ids buffer's length): any prompt + its
                               # continuation up to this runs on the same stages
    timings: dict = field(default_factory=dict)  # seconds build_plan spent: total_s, tokenizer_s (inside it)
    resolved: Resolved | None = None  # the rig's autos for these stages (build_plan sets it)

    @property
    def tokens(self) -> int:
        return int(self.ids.size)

    @property
    def kv_pool(self) -> int:
        """Positions of every stage's KV pool (the rig's kv_pool, auto resolved by the planner); 0: none."""
        return self.planner.get("kv_pool", 0) if self.cfg.kv_pool == "auto" else self.cfg.kv_pool

    @property
    def max_len(self) -> int:  # KV cache positions (the planner's kv_tokens)
        return self.max_context or self.tokens + self.cfg.generate

    def schedule_for(self, start: int, end: int) -> tuple[tuple[int, int], ...]:
        """The chunks of prompt positions [start, end) (start > 0: a reused prefix is not recomputed): the
        cold prompt's chunks from `start` on, the one it falls in cut there (dynamic chunks keep their cost)."""
        out = []
        for p, n in chunk_schedule(end, self.max_chunk, self.cfg.dynamic_chunks, self.args):
            if p + n > start:
                out.append((max(p, start), p + n - max(p, start)))
        return tuple(out)

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


def default_threads(stages: tuple[StageSpec, ...], n_cores: int | None = None) -> tuple[StageSpec, ...]:
    """Local CPU stages without `threads` share the cores the others' threads leave, evenly (at least one each).
    Left unset, torch took every core while assign_cores pinned the stage to one: two threads on one core, a 600-token
    prefill of SmolLM2 on this 2-core box 10x slower (21 s against 2.1 s with one thread, 2026-12-06)."""
    local = [i for i, s in enumerate(stages) if s.device == "cpu" and not s.remote]
    unset = [i for i in local if stages[i].threads is None]
    if not unset:
        return stages
    cores = n_cores or len(os.sched_getaffinity(0))
    left = cores - sum(stages[i].threads for i in local if stages[i].threads is not None)
    each = max(1, left // len(unset))
    return tuple(replace(s, threads=each) if i in unset else s for i, s in enumerate(stages))


def assign_cores(stages: tuple[StageSpec, ...]) -> list[tuple[int, ...]]:
    """Give each CPU stage its own cores (two stages on the same cores fight over them and both slow down)."""
    avail = sorted(os.sched_getaffinity(0))
    cpu_idx = [i for i, s in enumerate(stages) if s.device == "cpu" and not s.remote]  # remote: not our cores
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


def load_prompt(cfg: RigConfig, args: ModelArgs, timings: dict | None = None) -> np.ndarray:
    """The rig's prompt as ids; `timings["tokenizer_s"]` gets the tokenizer's build + encode time."""
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
        from strata.text.tokenizer import Tokenizer
        if p.text is not None:
            text = p.text
        elif p.file is not None:
            text = read_text_file(p.file)
        else:
            text = stdlib_source(p.stdlib)
        t0 = time.perf_counter()
        ids = np.array(Tokenizer.for_model(cfg.model).encode(text), dtype=np.int64)
        if timings is not None:
            timings["tokenizer_s"] = time.perf_counter() - t0
    if p.max_tokens is not None:
        ids = ids[: p.max_tokens]
    if ids.size == 0:
        raise ConfigError("prompt: empty after tokenization")
    return ids.astype(np.int32)


def read_text_file(path: str) -> str:
    """A prompt file: UTF-8 text, else refused naming the first offending byte (a binary file would
    otherwise be tokenized as garbage)."""
    data = Path(path).read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"prompt.file {path!r}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})") \
            from None
    nul = text.find("\0")
    if nul >= 0:
        raise ConfigError(f"prompt.file {path!r}: not text (a NUL byte at offset {len(text[:nul].encode())})")
    return text


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


def build_plan(cfg: RigConfig, always_calibrate: bool = False, serving: bool = False) -> Plan:
    """The run's plan from the rig (its cfg: the rig with max_seqs auto resolved, auto_max_seqs). always_calibrate:
    time identical stages' speeds too (calibrate.stage_facts; bench/split.py --calibrate), where the planner would
    take them as equal. serving: the plan is a server's (max_seqs auto holds several sequences)."""
    t0 = time.perf_counter()
    auto_seqs = cfg.max_seqs == "auto"
    if auto_seqs:  # the context (and chunk) as for one sequence; then as many sequences as that context leaves room for
        cfg = replace(cfg, max_seqs=1)
    timings = {"tokenizer_s": 0.0}
    try:
        args = model_args(cfg.model)
    except ModelError as e:
        raise ConfigError(str(e)) from None
    stages = default_threads(cfg.stages if isinstance(cfg.stages, tuple) else auto_stages())
    for i, s in enumerate(stages):
        if not s.remote:  # a remote stage's device is checked on its host
            check_device(s.device, f"stages[{i}].device")
    if len(stages) > args.n_layers:
        raise ConfigError(f"stages: {len(stages)} stages but the model has only {args.n_layers} layers")
    if cfg.kv_dtype == "q8_0" and any(w % 32 for _, w in args.kv_rows()):
        what = (f"latent cache row is {args.kv_rows()[0][1]} values" if args.latent
                else f"head dim is {args.head_dim}")
        raise ConfigError(f"kv_dtype: q8_0 caches blocks of 32 values; this model's {what} (use float8_e4m3fn)")
    from strata.kvcache.prefix_cache import supported
    why = supported(args)
    for key in ("kv_cache_dir", "prefix_cache_device_bytes"):
        if why and getattr(cfg, key) not in (None, 0, "auto"):  # (auto: none where the cache is off)
            raise ConfigError(f"{key}: the prefix cache is off for this model ({why})")
    if cfg.kv_cache_dir is not None:
        try:
            os.makedirs(os.path.expanduser(cfg.kv_cache_dir), exist_ok=True)
        except OSError as e:
            raise ConfigError(f"kv_cache_dir: cannot make {cfg.kv_cache_dir!r}: {e.strerror}") from None
    ids = load_prompt(cfg, args, timings)
    total = ids.size + cfg.generate
    if cfg.max_context is not None and cfg.max_context > args.max_seq_len:
        raise ConfigError(f"max_context: {cfg.max_context} exceeds the model's context of {args.max_seq_len} tokens")
    limit = cfg.max_context or args.max_seq_len
    if total > limit:
        what = "max_context" if cfg.max_context else "the model's context"
        raise ConfigError(f"prompt: {ids.size} tokens + {cfg.generate} generated exceeds {what} "
                          f"of {limit} tokens (cut it with prompt.max_tokens)")
    cores = assign_cores(stages)
    # the buffers and KV are sized once for max_context: a default one is halved until every stage holds it
    while True:
        if cfg.chunk == "auto":  # the preferred chunk, then smaller ones (before a default context is halved;
            # down to 64 once the context cannot shrink, the rig's or the prompt's own)
            top = preferred_chunk(stages, int(ids.size))
            fixed = cfg.max_context is not None or limit <= total
            chunks = chunk_ladder(top, 64 if fixed else max(64, top // 8))
        else:
            chunks = [cfg.chunk]
        chunks = list(dict.fromkeys(min(c, limit) for c in chunks))  # any later prompt's largest chunk
        try:
            split, planner = choose_split(cfg, args, stages, cores, int(ids.size), limit, chunks, always_calibrate)
            break
        except ConfigError:
            if cfg.max_context is not None or limit <= total:
                raise
            limit = max(limit // 2, int(total))
    max_chunk = planner["chunk"]
    if auto_seqs:
        cfg, found = auto_max_seqs(cfg, args, stages, cores, int(ids.size), limit, max_chunk, serving,
                                   always_calibrate)
        if found is not None:
            split, planner = found
        planner["max_seqs_from"] = "auto"
    schedule = chunk_schedule(int(ids.size), max_chunk, cfg.dynamic_chunks, args)
    plans, a = [], 0
    for i, (s, n) in enumerate(zip(stages, split)):
        plans.append(StagePlan(i, s.device, a, a + n, s.threads, cores[i], s.speed, s.memory, s.host,
                               planner["prefix_block"][i]))
        a += n
    timings["total_s"] = time.perf_counter() - t0
    return Plan(cfg, args, tuple(plans), ids, tuple(schedule), max_chunk, planner, limit, timings,
                resolve(cfg, args, plans))


def auto_max_seqs(cfg: RigConfig, args: ModelArgs, stages, cores, prompt_tokens: int, limit: int, chunk: int,
                  serving: bool, always_calibrate: bool) -> tuple[RigConfig, tuple[list[int], dict] | None]:
    """max_seqs auto: 1 for a run (one prompt) or where max_seqs_refusal says so; a server's, the most sequences up
    to the cap (AUTO_SEQS_CPU with any CPU stage, else AUTO_SEQS_CUDA) whose KV every stage holds at the context
    `limit` and `chunk` already chosen for one, as the planner counts it (choose_split: max_seqs x a slot's KV, or the
    kv_pool once; the host's available memory for CPU stages together). Fits grow with fewer sequences, so the most
    is found by bisection. (the rig resolved, (split, planner) for it, or None: one sequence's, already planned)."""
    if not serving or max_seqs_refusal(cfg) is not None:
        return resolve_max_seqs(cfg, 1), None
    cap = AUTO_SEQS_CPU if any(s.device == "cpu" for s in stages) else AUTO_SEQS_CUDA
    found = None  # ((split, planner), its sequences) of the last fit
    lo, hi = 1, cap  # lo fits (the plan for one was made), hi + 1 does not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        try:
            found = choose_split(replace(cfg, max_seqs=mid), args, stages, cores, prompt_tokens, limit, [chunk],
                                 always_calibrate), mid
            lo = mid
        except ConfigError:
            hi = mid - 1
    if lo == 1:
        log.info("max_seqs auto: 1 (the stages hold no second sequence's KV at max_context %d)", limit)
        return resolve_max_seqs(cfg, 1), None
    if found is None or found[1] != lo:
        found = choose_split(replace(cfg, max_seqs=lo), args, stages, cores, prompt_tokens, limit, [chunk],
                             always_calibrate), lo
    log.info("max_seqs auto: %d sequences (at most %d on these stages) at max_context %d", lo, cap, limit)
    return resolve_max_seqs(cfg, lo), found[0]


CUDA_CHUNK = 8192  # a CUDA stage's preferred chunk: its GEMMs run near peak from a few thousand rows, and the
                   # 8B's prefill on one H200 measured ~12k tok/s at 10,240 (BENCHMARKS.md)
CPU_CHUNK = 512    # a CPU stage's: its time per token barely falls past a few hundred rows
FILL_CHUNKS = 4    # chunks per stage that keep a pipeline of N stages busy: N*C / (C + N - 1) is 0.8 N at C = 4 N


def preferred_chunk(stages, prompt_tokens: int) -> int:
    """`chunk: auto` before memory: the device's preferred chunk, cut (in steps of 256) so the configured prompt
    makes FILL_CHUNKS chunks per stage when there are several stages, since fewer leave stages idle."""
    top = CPU_CHUNK if all(s.device == "cpu" for s in stages) else CUDA_CHUNK
    if len(stages) > 1:
        top = min(top, max(256, prompt_tokens // (FILL_CHUNKS * len(stages)) // 256 * 256))
    return top


def chunk_ladder(top: int, floor: int) -> list[int]:
    """top, then halvings (multiples of 64) down to floor: the chunks `chunk: auto` tries, largest first."""
    out, c = [top], top
    while c // 2 >= floor:
        c = max(64, c // 2 // 64 * 64)
        out.append(c)
    return list(dict.fromkeys(out))


def choose_split(cfg: RigConfig, args: ModelArgs, stages, cores, prompt_tokens: int, kv_tokens: int,
                 chunks: list[int], always_calibrate: bool = False) -> tuple[list[int], dict]:
    """The layer split (auto: planned; else the rig's, checked) at the first of `chunks` (largest first) that
    fits every stage, and how it was chosen, for the report (its "chunk": the one taken). When none fits, the
    refusal says what would: a smaller chunk, a shorter max_context, an 8-bit KV cache.

    Memory caps: the rig's `memory:`, else a CUDA device's free memory now, else none per CPU
    stage (all CPU stages together are checked against the host's available memory). Speeds: the
    rig's `speed:` (all stages or none), else calibrated (strata.plan.calibrate) when the stages differ."""
    from strata.plan.calibrate import CalibrationError, host_available_bytes, stage_facts
    auto = cfg.layer_split == "auto"
    n = len(stages)
    given = [i for i, s in enumerate(stages) if s.speed is not None]
    if auto and n > 1 and given and len(given) != n:
        raise ConfigError(f"stages: speed is given for stage(s) {given} but not for all {n}: give it for every "
                          "stage (relative speeds) or for none (then it is calibrated)")
    try:
        facts = stage_facts(stages, cores, args, cfg.dtype, chunks[0], kv_tokens, prompt_tokens,
                            want_speed=auto, with_head=cfg.perplexity, always_calibrate=always_calibrate)
    except CalibrationError as e:
        raise ConfigError(f"{e} (give every stage `speed:` and, on CUDA, `memory:` to skip the probes)") from None
    host = [s.device == "cpu" for s in stages]
    labels = [s.device + (f", {s.threads} thread{'s' if s.threads != 1 else ''}" if s.threads else "")
              for s in stages]
    # weights as stored (resident GGUF blocks + one layer's scratch, or dense in dtype) and KV at kv_dtype
    # max_seqs sequences' KV on every stage, and on a CUDA stage the prefix cache's device tier (auto: after the
    # split, from the memory it leaves: device_tiers)
    tier = 0 if cfg.prefix_cache_device_bytes == "auto" else cfg.prefix_cache_device_bytes
    if cfg.kv_pool != "auto" and cfg.kv_pool and cfg.kv_pool < kv_tokens:
        raise ConfigError(f"kv_pool {cfg.kv_pool} holds no sequence of max_context {kv_tokens} positions: give at "
                          f"least {kv_tokens}")
    pool = kv_tokens if cfg.kv_pool == "auto" else cfg.kv_pool  # (auto: the split for one sequence, then kv_pools)
    store = {kind: replace(storage(cfg.model, args, cfg.dtype, cfg.weights, cfg.kv_dtype, kind), seqs=cfg.max_seqs,
                           prefix_device=tier if kind == "cuda" else 0, pool=pool)
             for kind in {"cpu" if h else "cuda" for h in host}}
    per_stage = [store["cpu" if h else "cuda"] for h in host]
    if not auto:
        if len(cfg.layer_split) != n:
            raise ConfigError(f"layer_split: {len(cfg.layer_split)} entries for {n} stages")
        if sum(cfg.layer_split) != args.n_layers:
            raise ConfigError(f"layer_split: {list(cfg.layer_split)} sums to {sum(cfg.layer_split)}, the model has "
                              f"{args.n_layers} layers")
        for start in itertools.accumulate(cfg.layer_split[:-1]):
            why = args.stage_start_refusal(start)
            if why is not None:
                raise ConfigError(f"layer_split: {list(cfg.layer_split)} starts a stage at layer {start}: {why}")

    def fit(chunk: int, tokens: int = kv_tokens, st=per_stage) -> tuple[list[int] | None, str]:
        """(the split, "") when every stage holds `tokens` KV positions at `chunk`, else (None, why not)."""
        kw = dict(with_head=cfg.perplexity, labels=labels, cap_notes=facts.cap_notes, attention=cfg.attention,
                  storage=st)
        if auto:
            try:
                return plan_split(args, n, facts.speeds, facts.caps, tokens, chunk, cfg.dtype, host,
                                  prompt_tokens=prompt_tokens, **kw), ""
            except PlanError as e:
                return None, str(e)
        err = check_split(args, list(cfg.layer_split), facts.caps, tokens, chunk, cfg.dtype, host, **kw)
        return (None, err) if err else (list(cfg.layer_split), "")

    for max_chunk in chunks:
        split, err = fit(max_chunk)
        if split is not None:
            break
    else:
        pooled = [replace(st, pool=kv_tokens) for st in per_stage] if cfg.max_seqs > 1 and not pool else None
        raise ConfigError(err + would_fit(fit, chunks[-1], kv_tokens, cfg.kv_dtype,
                                          lambda kv: [replace(storage(cfg.model, args, cfg.dtype, cfg.weights, kv,
                                                                      "cpu" if h else "cuda"), seqs=cfg.max_seqs,
                                                              prefix_device=0 if h else tier, pool=pool)
                                                      for h in host], pooled))
    per_stage = prefix_blocks(args, split, kv_tokens, max_chunk, cfg, host, facts.caps, per_stage)
    per_stage = kv_pools(args, split, kv_tokens, max_chunk, cfg, host, facts.caps, per_stage)
    per_stage = device_tiers(args, split, kv_tokens, max_chunk, cfg, host, facts.caps, per_stage)
    needs = stage_needs(args, split, kv_tokens, max_chunk, cfg.dtype, host, cfg.perplexity, cfg.attention,
                        storage=per_stage)
    cpu = [i for i in range(n) if host[i] and not stages[i].remote]
    # CPU stages share this host: checked together, unless every one of them gives its own `memory:`
    # (a remote stage's memory is its own host's)
    avail = host_available_bytes() if any(stages[i].memory is None for i in cpu) else None
    if avail is not None:
        want = sum(needs[i].total for i in cpu)
        if want > avail:
            part = {k: sum(getattr(needs[i], k) for i in cpu) / 2**30 for k in ("weights", "kv_cache", "activations")}
            raise ConfigError(
                f"the CPU stage(s) {cpu} together need {want:,} bytes ({want / 2**30:.2f} GiB: weights "
                f"{part['weights']:.2f} GiB, KV cache {part['kv_cache']:.2f} GiB, activations "
                f"{part['activations']:.2f} GiB) but the host has {avail:,} bytes available "
                f"({avail / 2**30:.2f} GiB, MemAvailable); if it can give more (a VM that grows its memory on "
                f"demand), give each CPU stage `memory:` to plan with your own caps")
    predicted = predicted_times(args, split, facts.speeds, prompt_tokens, cfg.perplexity)
    total = sum(predicted) or 1.0
    planner = {
        "split": split, "mode": "auto" if auto else "given", "speeds_from": facts.source,
        "chunk": max_chunk, "chunk_from": "auto" if cfg.chunk == "auto" else "rig",
        "unit": "s" if facts.source == "calibrated" else "relative",
        "predicted": predicted, "predicted_share": [t / total for t in predicted],
        "speeds": [Speed.of(s).as_dict() for s in facts.speeds],
        "caps": facts.caps, "cap_notes": facts.cap_notes, "needs": [x.as_dict() for x in needs],
        "prefix_block": [st.prefix_block for st in per_stage],
        "kv_pool": per_stage[0].pool if per_stage and per_stage[0] is not None else 0,
        "host_available": avail, "calibration_s": facts.seconds,
        "probes": [{"device": p.device, "threads": p.threads, "seconds": p.seconds, **p.detail} for p in facts.probes],
    }
    return split, planner


def prefix_blocks(args: ModelArgs, split: list[int], tokens: int, chunk: int, cfg: RigConfig, host: list[bool],
                  caps: list[int | None], per_stage: list) -> list:
    """Each stage's storage with the prefix block its 8-bit cache is widened in: on a CUDA stage with a memory cap,
    the whole context where the cap holds it, else the largest of halvings down to PREFIX_BLOCK that it holds
    (one attention call over the widened prefix is faster than blocks merged by log-sum-exp); CPU stages and an
    uncapped stage keep PREFIX_BLOCK. Chosen after the split and the chunk, from the memory they leave: it
    changes neither."""
    out, a = [], 0
    b = DTYPE_BYTES[cfg.dtype]
    for i, (n, st) in enumerate(zip(split, per_stage)):
        if st is not None and not host[i] and caps[i] is not None and st.kv_elem < b and tokens > PREFIX_BLOCK:
            sizes = [tokens] + [s for s in (1 << k for k in range(tokens.bit_length() - 1, 0, -1))
                                if PREFIX_BLOCK < s < tokens]
            for size in sizes:
                wide = replace(st, prefix_block=size)
                if stage_need(args, a, a + n, tokens, chunk, cfg.dtype, host[i], cfg.perplexity, cfg.attention,
                              wide).total <= caps[i]:
                    st = wide
                    break
        out.append(st)
        a += n
    return out


def kv_pools(args: ModelArgs, split: list[int], tokens: int, chunk: int, cfg: RigConfig, host: list[bool],
             caps: list[int | None], per_stage: list) -> list:
    """kv_pool auto: the most positions every stage's pool holds, one size for all (the head's one allocator serves
    them): on a stage with a memory cap, max_context plus nine tenths of what the cap leaves after the split, the
    chunk and the 8-bit prefix block, over a position's bytes in its global layers; at most max_seqs x max_context
    (the slots' own), in whole steps of the allocator's. Chosen after the split, which was made for a pool of one
    max_context. Before the device tier's auto: the pool comes first. Another value: the storage as it is."""
    if cfg.kv_pool != "auto":
        return per_stage
    most = cfg.max_seqs * tokens
    pool, a = most, 0
    for i, (n, st) in enumerate(zip(split, per_stage)):
        glob = sum(1 for j in range(a, a + n) if not args.is_linear(j) and args.window(j) is None)
        if st is not None and caps[i] is not None and glob:
            need = stage_need(args, a, a + n, tokens, chunk, cfg.dtype, host[i], cfg.perplexity, cfg.attention,
                              replace(st, pool=tokens, prefix_device=0)).total
            per = args.kv_values() * st.kv_elem * glob
            pool = min(pool, tokens + int(max(0, caps[i] - need) * 9 // 10 // per))
        a += n
    pool = max(tokens, pool // POOL_GRAIN * POOL_GRAIN if pool < most else most)
    return [st if st is None else replace(st, pool=pool) for st in per_stage]


def device_tiers(args: ModelArgs, split: list[int], tokens: int, chunk: int, cfg: RigConfig, host: list[bool],
                 caps: list[int | None], per_stage: list) -> list:
    """prefix_cache_device_bytes auto: each capped CUDA stage's device tier is half of what its cap leaves after
    the split, the chunk and the 8-bit prefix block (it changes none of them), at most prefix_cache_bytes; a CPU
    stage, an uncapped one and a model whose prefix cache is off get none. Another value: the storage as it is."""
    from strata.kvcache.prefix_cache import supported
    if cfg.prefix_cache_device_bytes != "auto":
        return per_stage
    on = cfg.prefix_cache_bytes > 0 and supported(args) is None
    out, a = [], 0
    for i, (n, st) in enumerate(zip(split, per_stage)):
        if on and st is not None and not host[i] and caps[i] is not None:
            need = stage_need(args, a, a + n, tokens, chunk, cfg.dtype, host[i], cfg.perplexity, cfg.attention,
                              replace(st, prefix_device=0)).total
            st = replace(st, prefix_device=min(max(0, caps[i] - need) // 2, cfg.prefix_cache_bytes))
        out.append(st)
        a += n
    return out


def would_fit(fit, chunk: int, tokens: int, kv_dtype: str, storage_at, pooled=None) -> str:
    """A refusal's suggestion: "; would fit: ..." naming the largest smaller chunk that fits, the longest
    max_context at `chunk`, an 8-bit KV cache if that alone fits, and kv_pool auto if a pool of one max_context
    fits (pooled: each stage's storage with that pool; None: the rig has one or no several sequences) ("" when
    nothing does). fit(chunk, tokens, storage) -> (split or None, why); storage_at(kv_dtype) -> each stage's
    storage at that KV dtype."""
    out = []
    if pooled is not None and fit(chunk, tokens, pooled)[0] is not None:
        out.append("kv_pool auto (the sequences' KV in one pool as large as memory allows, at least one "
                   "max_context)")
    smaller = next((c for c in chunk_ladder(chunk, 64)[1:] if fit(c)[0] is not None), None)
    if smaller is not None:
        out.append(f"chunk {smaller}")
    lo, hi = 0, tokens - 1  # the longest context that fits at this chunk, by bisection
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if mid >= chunk and fit(chunk, mid)[0] is not None else (lo, mid - 1)
    if lo >= chunk:
        out.append(f"max_context {lo} at chunk {chunk}")
    if kv_dtype not in ("q8_0", "float8_e4m3fn"):  # q8_0 first: its scales keep the perplexity (README)
        eight = next((k for k in ("q8_0", "float8_e4m3fn") if fit(chunk, tokens, storage_at(k))[0] is not None), None)
        if eight:
            out.append(f"kv_dtype {eight}")
    return f"; would fit: {', or '.join(out)}" if out else ""


__all__ = ["Plan", "StagePlan", "build_plan", "chunk_ladder", "chunk_schedule", "even_split", "load_prompt",
           "preferred_chunk"]
