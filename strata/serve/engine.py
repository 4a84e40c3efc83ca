"""The interface between the server and whatever runs the model: the Engine protocol and its errors."""
from __future__ import annotations

import os
import re
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Literal, Protocol, runtime_checkable

import numpy as np
import torch

from strata.errors import ModelError, PipelineError
from strata.kvcache.prefix_cache import PrefixCacheStats
from strata.text.sampling import SamplingParams

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
    end_token: int | None = None  # the end token that ended it (the eos, an end of turn, ...), else None

    @property
    def prefill_tok_s(self) -> float:
        new = self.prompt_tokens - self.reused_tokens
        return new / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.completion_tokens / self.decode_s if self.decode_s > 0 else 0.0


@runtime_checkable
class Engine(Protocol):
    """A loaded model that generates for one request at a time. The server calls generate and restart from
    one worker thread only (close after that thread has stopped), so those need no locking; an engine with an
    attribute `max_seqs` > 1 has generate called from that many threads at once (and restart from any of them
    after a failure, once: `is_up()` says whether another already did). tokenize,
    detokenize and chat_prompt are also called from other threads, during a generate: they must not touch
    the stages. Optional: `metrics_text() -> str`, Prometheus lines appended to the server's /metrics, and
    `prefix_cache_stats() -> PrefixCacheStats` (strata/kvcache/prefix_cache.py), read by /metrics from another thread."""

    model_name: str
    max_context: int  # prompt + generated tokens must fit

    def tokenize(self, text: str) -> list[int]:
        """Prompt text -> ids, with the model's BOS rule applied."""

    def detokenize(self, ids: list[int]) -> str:
        """Ids -> text (special tokens kept as text: the server cuts at stop strings itself)."""

    def chat_prompt(self, messages: list[dict[str, Any]], **variables: Any) -> str:
        """Chat messages -> prompt text through the model's chat template (generation prompt added); `variables`
        go to the template as they are (tools, reasoning_effort, a request's chat_template_kwargs).
        Raises ValueError (e.g. strata.text.chat.ChatError) for a conversation the template refuses."""

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


class _ModelText:
    """The text side every engine shares: the model's served name, its tokenizer (loaded at start, not on
    the first request: parsing a GGUF vocabulary takes seconds) and its own chat template."""

    def _init_text(self, model: str, name: str | None) -> None:
        self._text_model = model
        self.model_name = name or (model if model == "smollm2" or model.startswith("synthetic:") else Path(model).name)
        self._template = None
        self._tokenizer = self._tokenizer_error = None
        try:
            from strata.text.tokenizer import Tokenizer
            self._tokenizer = Tokenizer.for_model(model)
        except ModelError as e:  # a synthetic model or a directory without one: ids only
            self._tokenizer_error = e

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            raise self._tokenizer_error
        return self._tokenizer

    @property
    def has_tokenizer(self) -> bool:
        """False for a model without a vocabulary (synthetic, a random-block GGUF): the server then takes token-id
        prompts and answers with token ids."""
        return self._tokenizer is not None

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def chat_prompt(self, messages: list[dict[str, Any]], **variables: Any) -> str:
        from strata.text.chat import ChatTemplate
        if self._template is None:
            self._template = ChatTemplate.for_model(self._text_model) or False
        if not self._template:
            raise ValueError(f"model {self.model_name!r} has no chat template: use /v1/completions")
        return self._template.render(messages, **variables)


class LocalEngine(_ModelText):
    """A whole model in this process, no stages: the reference Engine (greedy here is the plain
    model's greedy), and a server for a model that fits one device. Prefix reuse: the KV cache is
    indexed by absolute position, so the positions a new prompt shares with the kept one stay valid."""

    def __init__(self, model: str, max_context: int | None = None, device: str = "cpu",
                 dtype: torch.dtype = torch.float32, prefill_chunk: int = 512, name: str | None = None):
        from strata.weights.checkpoint import end_ids, model_args
        self.model, self.device, self.dtype, self.prefill_chunk = model, torch.device(device), dtype, prefill_chunk
        self.args = model_args(model)
        self.end_ids = end_ids(model, self.args)  # the tokens that end a generation (its eos, an end of turn, ...)
        self.max_context = min(max_context or self.args.max_seq_len, self.args.max_seq_len)
        if self.max_context < 1:
            raise ValueError(f"max_context must be >= 1, got {self.max_context}")
        self._init_text(model, name)
        self.net = None
        self.kept: list[int] = []
        self._loaded = False
        self.restart()

    # -- compute -------------------------------------------------------------------------------
    def generate(self, ids: list[int], params: SamplingParams,
                 on_token: Callable[[int], bool]) -> GenerationStats:
        from strata.text.sampling import Sampler
        if self.net is None:
            raise EngineError("local", "the engine is closed or failed: restart() it")
        n = len(ids)
        if not 0 < n <= self.max_context:
            raise ValueError(f"prompt of {n} tokens: must be 1..{self.max_context}")
        if min(ids) < 0 or max(ids) >= self.args.vocab_size:
            raise ValueError(f"prompt ids must be in [0, {self.args.vocab_size})")
        reused = 0
        for a, b in zip(ids, self.kept):
            if a != b:
                break
            reused += 1
        reused = min(reused, n - 1)  # the last prompt token is always run: its logits give the first token
        if self._loaded:  # a kv_load's rows: the rest in a cold prefill's own chunks (its bits, its answer)
            reused -= reused % self.prefill_chunk
            self._loaded = False
        self.kept = list(ids[:reused])  # past `reused` the cache is about to be overwritten
        try:
            t0 = time.perf_counter()
            h = None
            for pos in range(reused, n, self.prefill_chunk):
                chunk = torch.tensor([ids[pos:pos + self.prefill_chunk]], device=self.device)
                h = self.net(chunk, pos)
            self.kept = list(ids)
            logits = self.net.logits(h[0, -1])
            t1 = time.perf_counter()
            ends, end = self.end_ids, None
            sampler, count, finish = Sampler(params, self.tokenizer if params.grammar is not None else None,
                                                  ends, ids), 0, "length"
            limit = min(params.max_tokens, self.max_context - n)
            while count < limit:
                tok = sampler.next(logits)
                if tok in ends:
                    finish, end = "stop", tok
                    break
                count += 1
                if not on_token(tok):
                    finish = "stop"
                    break
                if count == limit:
                    break
                # the generated token joins the cache: a follow-up prompt that contains it reuses it
                logits = self.net.logits(self.net(torch.tensor([[tok]], device=self.device), len(self.kept))[0, -1],
                                          decode=True)
                self.kept.append(tok)
            t2 = time.perf_counter()
        except (RuntimeError, torch.cuda.OutOfMemoryError) as e:
            self.net = None
            raise EngineError(f"local ({self.device})", f"{type(e).__name__}: {e}") from e
        return GenerationStats(prompt_tokens=n, reused_tokens=reused, completion_tokens=count, end_token=end,
                               prefill_s=t1 - t0, decode_s=t2 - t1, finish_reason=finish)

    def restart(self) -> None:
        from strata.models.model import Transformer
        from strata.weights.checkpoint import slice_tensors
        self.close()
        with torch.device("meta"):
            net = Transformer(self.args)
        net.load_weights(slice_tensors(self.model, self.args, 0, self.args.n_layers), self.device, self.dtype)
        net.setup_cache(self.max_context)
        self.net, self.kept = net.eval(), []

    def close(self) -> None:
        self.net, self.kept = None, []

    # -- KV files (strata/kvcache/kv_file.py; the pipeline's format: a file from either loads into the other) -------------
    def _fingerprint(self) -> dict:
        from strata.kvcache.kv_file import fingerprint
        return fingerprint(self.model, 0, self.args, str(self.dtype).removeprefix("torch."), "auto", self.max_context)

    def kv_save(self, path) -> dict:
        """The kept prompt's (and answer's) KV and ids into `path`, as Pipeline.kv_save writes it."""
        from strata.kvcache.kv_file import KvFileError, create, replacing, write_rows
        from strata.kvcache.prefix_cache import layer_caches, row_bytes, supported
        if self.net is None or not self.kept:
            raise KvFileError("kv_save: nothing to save: no prompt has been prefilled on this engine")
        if supported(self.args, files=True):
            raise KvFileError(f"kv_save: not for this model: {supported(self.args, files=True)}")
        caches, n, path = layer_caches(self.net), len(self.kept), Path(path)
        try:
            with replacing(path) as tmp:
                data_at = create(tmp, self._fingerprint(), np.asarray(self.kept),
                                 row_bytes(caches) // self.args.n_layers, [[0, self.args.n_layers]])
                write_rows(str(tmp), data_at, n, caches)
        except OSError as e:
            raise KvFileError(f"kv_save: cannot write {path}: {e.strerror or e}") from None
        return {"path": str(path), "tokens": n, "bytes": path.stat().st_size}

    def kv_load(self, path) -> dict:
        """A KV file (this engine's or a pipeline's, for the same model and rig) into the cache: its ids are kept."""
        from strata.kvcache.kv_file import KvFileError, check, read_header, read_rows
        from strata.kvcache.prefix_cache import layer_caches, row_bytes, supported
        if self.net is None:
            raise EngineError("local", "the engine is closed or failed: restart() it")
        if supported(self.args, files=True):
            raise KvFileError(f"kv_load: not for this model: {supported(self.args, files=True)}")
        h, ids, data_at = read_header(path)
        caches = layer_caches(self.net)
        check(path, h, self._fingerprint(), row_bytes(caches) // self.args.n_layers, self.max_context,
              self.args.vocab_size, ids)
        self.kept = []
        try:
            read_rows(str(path), data_at, ids.size, caches)
        except OSError as e:
            raise KvFileError(f"kv_load: cannot read {path}: {e.strerror or e}") from None
        self.kept, self._loaded = ids.tolist(), True
        return {"ids": ids, "tokens": int(ids.size), "bytes": os.path.getsize(path)}


def local_engine(cfg) -> LocalEngine:
    """A LocalEngine for a rig config: its model and dtype on the first stage's device (default: cuda:0 when
    there is a GPU, else the CPU), the rig's `max_context` when it has one."""
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    stages = getattr(cfg, "stages", "auto")
    if isinstance(stages, tuple) and stages and getattr(stages[0], "device", None):
        device = stages[0].device
    return LocalEngine(cfg.model, max_context=getattr(cfg, "max_context", None), device=device,
                       dtype=getattr(torch, cfg.dtype))


_STAGE = re.compile(r"(stage \d+ \([^)]*\))")


class PipelineEngine(_ModelText):
    """The Engine over one running `strata.Pipeline`: the stages load once and stay up; each generate
    prefills only what the stages' KV does not already hold (the previous prompt and its answer), then
    decodes through them. A stage failure is an EngineError naming the stage; restart() starts new stages."""

    def __init__(self, cfg, out: str | Path | None = None, name: str | None = None):
        from strata.config import RigConfig, from_dict
        from strata.errors import ConfigError
        self.cfg = cfg if isinstance(cfg, RigConfig) else from_dict(cfg)
        self.out = Path(out or self.cfg.out or Path("runs") / time.strftime("serve-%Y%m%d-%H%M%S"))
        self._init_text(self.cfg.model, name)
        self._config_error = ConfigError
        self.pipe = None
        self.max_seqs = 1                  # > 1: generate from several threads at once (strata/head/slots.py); the
                                           # plan's (max_seqs auto: as many as memory holds), set by the first start
        self._slots = None                 # the request loop over self.pipe (strata.head.slots.SlotDriver)
        self._life = threading.Lock()      # restart / close against each other (several callers)
        self.starts = 0
        self.last_report: dict | None = None  # the last generation's report (metrics_text reads it)
        # lookups and hits of the pipelines closed so far: /metrics' counters survive a restart, as the server's do
        self._earlier = PrefixCacheStats()
        self._stats_lock = threading.Lock()  # /metrics reads while the worker thread swaps pipelines
        self.restart()
        self.max_context = self.pipe.max_context

    # -- compute: every call through the request loop (strata/head/slots.py), at every max_seqs -----------------------
    def generate(self, ids: list[int], params: SamplingParams,
                 on_token: Callable[[int], bool]) -> GenerationStats:
        # stop strings are the server's (it cuts the text it streams); the pipeline only decodes
        params = replace(params, stop=())
        run = self._through_loop(lambda d: d.generate(d.pipe.prompt_ids(list(ids)), params, on_token))
        if run.result is not None:  # one slot: the sequence's report (several: their phases overlap, none)
            self.last_report = run.result.report
        return GenerationStats(prompt_tokens=int(run.ids.size), reused_tokens=run.reused,
                               completion_tokens=len(run.out), prefill_s=run.prefill_s, decode_s=run.decode_s,
                               finish_reason=run.finish, end_token=run.end_token)

    def score(self, ids: list[int], start: int, top: int) -> tuple[list[float], list[list[int]], list[list[float]]]:
        """log p(ids[i] | ids[:i]) for i in [start, n), the `top` likeliest tokens there and their log-probabilities
        (SlotDriver.score: a sequence among the others). A prompt the pipeline refuses is a ValueError; a failed
        pipeline an EngineError naming the stage (and the engine closes)."""
        lp, ti, tl = self._through_loop(lambda d: d.score(d.pipe.prompt_ids(list(ids)), start, top))
        return lp.tolist(), ti.tolist(), tl.tolist()

    def _through_loop(self, call, refused=ValueError):
        """call(driver) on the running request loop. A ConfigError (a prompt the pipeline refuses) becomes
        `refused` (None: raised as it is); a failed pipeline an EngineError naming the stage, and the engine closes
        it (the first of its callers to see it does)."""
        driver = self._slots
        if driver is None:
            raise EngineError("pipeline", "the engine is closed or failed: restart() it")
        try:
            return call(driver)
        except self._config_error as e:
            if refused is None:
                raise
            raise refused(str(e)) from None
        except PipelineError as e:
            where = _STAGE.search(str(e))
            self._failed(driver)
            raise EngineError(where.group(1) if where else "pipeline", str(e)) from e

    def _failed(self, driver) -> None:
        """The pipeline under `driver` failed: close it once (the first of its callers to get here does)."""
        with self._life:
            if self._slots is driver:
                self._close()

    def is_up(self) -> bool:
        """The stages are running (a restart after a failure that another caller already restarted is not needed)."""
        return self.pipe is not None and self._slots is not None and self._slots.failure is None

    def slot_stats(self):
        """strata.head.slots.SlotStats of the running request loop (None: closed)."""
        return self._slots.stats if self._slots is not None else None

    def kv_save(self, path) -> dict:
        """The stages' KV of the last prompt (and answer) into a KV file (Pipeline.kv_save, between sequences;
        refused with max_seqs > 1: no one sequence is the stages' own)."""
        return self._through_loop(lambda d: d.save(path), refused=None)

    def kv_load(self, path) -> dict:
        """A KV file into the stages (SlotDriver.load): with max_seqs 1 the live KV (Pipeline.kv_load), so the next
        prompt that begins with its ids skips them; with more, among the running sequences, into a free slot and from
        there into the prefix cache, where any later prompt that begins with its ids finds it."""
        return self._through_loop(lambda d: d.load(path), refused=None)

    def metrics_text(self) -> str:
        """Prometheus lines for /metrics: the request loop's slots and decode batches; the last prefill's busy
        histogram and the last decode's split."""
        lines = self._slot_metrics()
        rep = self.last_report
        if not rep:
            return "\n".join(lines) + "\n" if lines else ""
        lines += ["# HELP strata_last_prefill_busy_fraction Share of the last prefill with that many stages working.",
                 "# TYPE strata_last_prefill_busy_fraction gauge"]
        lines += [f'strata_last_prefill_busy_fraction{{stages="{k}"}} {v:g}' for k, v in rep["busy"].items()]
        if rep.get("decode_overhead_ms_per_token") is not None:
            lines += ["# HELP strata_last_decode_overhead_ms_per_token Decode time per token outside the stages' "
                      "layers (messaging, the head).", "# TYPE strata_last_decode_overhead_ms_per_token gauge",
                      f"strata_last_decode_overhead_ms_per_token {rep['decode_overhead_ms_per_token']:g}"]
        return "\n".join(lines) + "\n"

    def _slot_metrics(self) -> list[str]:
        slots = self._slots
        if slots is None:
            return []
        st = slots.stats

        def metric(name, kind, help_, value):
            return [f"# HELP strata_{name} {help_}", f"# TYPE strata_{name} {kind}", f"strata_{name} {value}"]
        return (metric("kv_slots", "gauge", "Sequences whose KV every stage holds (the rig's max_seqs).", slots.max_seqs)
                + metric("kv_slots_in_use", "gauge", "KV slots held by running sequences now.", slots.running)
                + metric("slot_queue_length", "gauge", "Sequences waiting for a KV slot.", slots.waiting)
                + metric("decode_batches_total", "counter", "Decode batches sent through the stages (this start).",
                         st.batches)
                + metric("decode_batch_steps_total", "counter", "Sequences' decode steps in those batches: over "
                         "decode_batches_total, the mean batch.", st.steps)
                + metric("decode_batch_rows_max", "gauge", "The most sequences' steps in one decode batch.",
                         st.most_in_batch)
                + metric("prefill_groups_total", "counter", "Prefill groups sent: several sequences' last prefill "
                         "chunks as one micro-batch.", st.prefill_groups)
                + metric("prefill_grouped_chunks_total", "counter", "Chunks in those groups.", st.grouped_chunks)
                + metric("prefill_chunks_between_steps_max", "gauge", "The most prefill micro-batches sent between "
                         "two decode steps of one sequence (while its step was out or waiting): at most the micro-"
                         "batches in flight, n_stages + 1.", st.most_chunks_between_steps)
                + metric("decode_batch_trip_seconds_total", "counter", "Seconds from each decode batch's send to its "
                         "result taken (the stages' work, copies and notes, and any callbacks the head ran meanwhile).",
                         f"{st.batch_trip_s:.6f}")
                + metric("decode_batch_turnaround_seconds_total", "counter", "Seconds from the results taken last "
                         "before each decode batch's send to that send (the head's own share of a step).",
                         f"{st.batch_turnaround_s:.6f}")
                + (metric("kv_pool_positions", "gauge", "Positions of every stage's KV pool (the rig's kv_pool).",
                          slots.pool.size)
                   + metric("kv_pool_positions_in_use", "gauge", "Positions of the KV pool held by sequences now.",
                            slots.pool.size - slots.pool.free)
                   + metric("kv_pool_waits_total", "counter", "Admissions put off for room in the KV pool.",
                            st.pool_waits) if slots.pool is not None else []))

    def prefix_cache_stats(self) -> PrefixCacheStats:
        """The prefix cache's figures now: the running pipeline's index, lookups and hits since the first start."""
        with self._stats_lock:
            now = self.pipe.prefix_cache_stats() if self.pipe is not None else PrefixCacheStats()
            return replace(now, lookups=now.lookups + self._earlier.lookups, hits=now.hits + self._earlier.hits)

    def restart(self) -> None:
        """New stages (the kept KV is gone); the run directory of each start after the first is a subfolder."""
        with self._life:
            self._restart()

    def _restart(self) -> None:
        from strata.head.pipeline import Pipeline
        self._close()
        out = self.out if self.starts == 0 else self.out / f"restart-{self.starts}"
        self.starts += 1
        cfg = replace(self.cfg, progress=False, generate=0)
        pipe = Pipeline(cfg, out=out, console=False, serving=True)
        try:
            pipe.start()
        except BaseException:
            pipe.close()
            raise
        from strata.head.slots import SlotDriver
        # a restart keeps the first start's sequences (the server's threads were made for them)
        self.cfg, self.max_seqs = replace(self.cfg, max_seqs=pipe.cfg.max_seqs), pipe.cfg.max_seqs
        self.pipe = pipe
        self._slots = SlotDriver(pipe, self.max_seqs)

    def close(self) -> None:
        with self._life:
            self._close()

    def _close(self) -> None:
        if self._slots is not None:
            self._slots, driver = None, self._slots
            driver.stop()
        if self.pipe is not None:
            with self._stats_lock:
                pipe, self.pipe = self.pipe, None
                done = pipe.prefix_cache_stats()
                self._earlier = replace(self._earlier, lookups=self._earlier.lookups + done.lookups,
                                        hits=self._earlier.hits + done.hits)
            pipe.close()


def pipeline_engine(cfg, out: str | Path | None = None) -> PipelineEngine:
    """`launcher.py --serve`'s engine factory: the rig's stages, loaded once."""
    return PipelineEngine(cfg, out=out)
