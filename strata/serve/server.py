"""OpenAI-compatible HTTP server over an Engine: one generation at a time (or max_seqs), a bounded queue, SSE."""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import difflib
import hmac
import json
import logging
import math
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import uvicorn
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from strata.config import DEFAULT_QUEUE
from strata.serve.engine import Engine, EngineError, GenerationStats, LocalEngine, PipelineEngine
from strata.kvcache.prefix_cache import PrefixCacheStats
from strata.text import tool_calls
from strata.text.sampling import MAX_SEED, Detokenizer, SamplingParams, StopMatcher

log = logging.getLogger("strata.serve.server")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
RETRY_AFTER_MAX_S = 60  # a 429's Retry-After: the waiting requests' expected time (the mean request's), at most this
COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


# -- errors ----------------------------------------------------------------------------------------

class RequestError(Exception):
    """A request refused with an HTTP status and a one-line reason (OpenAI's error shape)."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 **extra: Any):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.extra = status, message, type, param, extra

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status,
                          **self.extra}}

    headers: dict | None = None  # sent with the answer (a 429's Retry-After)

    def response(self, headers: dict | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers or self.headers)


def _bad(message: str, param: str | None = None) -> RequestError:
    return RequestError(400, message, param=param)


# -- metrics ---------------------------------------------------------------------------------------

@dataclass
class Metrics:
    """Counters and last-request gauges behind GET /metrics (written by the worker and the middleware)."""

    requests: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reused_tokens: int = 0
    engine_errors: int = 0
    restarts: int = 0
    last_prefill_tok_s: float = 0.0
    last_decode_tok_s: float = 0.0
    last_prefill_s: float = 0.0
    last_reused_tokens: int = 0
    last_ttft_s: float = 0.0  # generate() start to the first token: prefill plus the first sampling
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def count_request(self, path: str, status: int) -> None:
        with self.lock:
            self.requests[(path if path in ROUTES else "other", status)] += 1

    def record(self, s: GenerationStats, ttft_s: float | None) -> None:
        with self.lock:
            if ttft_s is not None:
                self.last_ttft_s = ttft_s
            self.prompt_tokens += s.prompt_tokens
            self.completion_tokens += s.completion_tokens
            self.reused_tokens += s.reused_tokens
            self.last_prefill_tok_s, self.last_decode_tok_s = s.prefill_tok_s, s.decode_tok_s
            self.last_prefill_s, self.last_reused_tokens = s.prefill_s, s.reused_tokens

    def render(self, queue_length: int, running: bool, running_sequences: int,
               prefix: PrefixCacheStats | None) -> str:
        """prefix: the engine's prefix-cache figures (None: it has no prefix cache, rendered as zeros)."""
        prefix = prefix or PrefixCacheStats()
        def metric(name, kind, help_, samples):
            lines = [f"# HELP strata_{name} {help_}", f"# TYPE strata_{name} {kind}"]
            lines += [f"strata_{name}{labels} {value:g}" if isinstance(value, float) else
                      f"strata_{name}{labels} {value}" for labels, value in samples]
            return lines
        with self.lock:
            reqs = sorted(self.requests.items())
            out = metric("requests_total", "counter", "HTTP requests answered, by path and status code.",
                         [(f'{{path="{p}",code="{c}"}}', n) for (p, c), n in reqs])
            out += metric("queue_length", "gauge", "Requests waiting for the engine.", [("", queue_length)])
            out += metric("running", "gauge", "1 while a request runs on the engine.", [("", int(running))])
            out += metric("running_sequences", "gauge", "Sequences (choices) being generated or scored now (more than 1 "
                          "with the rig's max_seqs above 1).", [("", running_sequences)])
            out += metric("prompt_tokens_total", "counter", "Prompt tokens of finished generations.",
                          [("", self.prompt_tokens)])
            out += metric("completion_tokens_total", "counter", "Generated tokens.", [("", self.completion_tokens)])
            out += metric("reused_tokens_total", "counter", "Prompt tokens served from the kept KV (prefix reuse).",
                          [("", self.reused_tokens)])
            out += metric("last_reused_tokens", "gauge", "Prompt tokens reused by the last generation.",
                          [("", self.last_reused_tokens)])
            out += metric("last_prefill_tokens_per_second", "gauge",
                          "Prefill speed of the last generation (new prompt tokens / prefill seconds).",
                          [("", float(self.last_prefill_tok_s))])
            out += metric("last_prefill_seconds", "gauge", "Prefill time of the last generation.",
                          [("", float(self.last_prefill_s))])
            out += metric("last_time_to_first_token_seconds", "gauge",
                          "From the engine taking the last request to its first generated token.",
                          [("", float(self.last_ttft_s))])
            out += metric("last_decode_tokens_per_second", "gauge", "Decode speed of the last generation.",
                          [("", float(self.last_decode_tok_s))])
            out += metric("prefix_cache_lookups_total", "counter",
                          "Prefills that looked their prompt up in the prefix cache.", [("", prefix.lookups)])
            out += metric("prefix_cache_hits_total", "counter", "Prefix-cache lookups that found a usable prefix of "
                          "the prompt held (whole blocks), whether still live or restored.", [("", prefix.hits)])
            out += metric("prefix_cache_blocks", "gauge", "Blocks the prefix cache holds now (on every stage).",
                          [("", prefix.blocks)])
            out += metric("prefix_cache_capacity_blocks", "gauge", "Blocks the prefix cache can hold (0: no prefix "
                          "cache, or off).", [("", prefix.capacity_blocks)])
            out += metric("prefix_cache_block_tokens", "gauge", "Tokens a prefix-cache block.",
                          [("", prefix.block_tokens)])
            out += metric("prefix_cache_disk_blocks", "gauge", "Blocks whose files every stage holds under "
                          "kv_cache_dir (0: no disk tier).", [("", prefix.disk_blocks)])
            out += metric("prefix_cache_disk_capacity_blocks", "gauge", "Blocks kv_cache_dir_bytes holds (0: no "
                          "disk tier).", [("", prefix.disk_capacity_blocks)])
            out += metric("prefix_cache_device_blocks", "gauge", "Blocks the CUDA stages' device tiers hold, the fewest "
                          "of any (prefix_cache_device_bytes; 0: none).", [("", prefix.device_blocks)])
            out += metric("prefix_cache_device_hits_total", "counter", "Blocks restored from a device tier instead of "
                          "host memory or disk, the fewest of any CUDA stage.", [("", prefix.device_hits)])
            out += metric("engine_errors_total", "counter", "Generations that failed in the engine.",
                          [("", self.engine_errors)])
            out += metric("engine_restarts_total", "counter", "Engine restarts after a failure.",
                          [("", self.restarts)])
        return "\n".join(out) + "\n"


# -- scoring: per-position log-probabilities ---------------------------------------------------------

MAX_LOGPROBS = 20  # alternatives per token (OpenAI's own limit for chat's top_logprobs)
MAX_N = 16  # choices per prompt: each is one more generation in a row on the one engine


@dataclass
class Scored:
    """One token of an answer's logprobs: its text, log p(token | the tokens before it) (None for a prompt's
    first token), and the `top` most likely tokens there as (text, logprob), most likely first."""

    text: str
    logprob: float | None
    top: list[tuple[str, float]]


def _pieces(detokenize: Callable[[list[int]], str], ids: list[int], context: list[int] = ()) -> list[str]:
    """Each token's text, as the streamed answer gives it: they join to the decoded text (a token ending
    inside a UTF-8 character has "" and the next one carries the character)."""
    d = Detokenizer(detokenize, context=context)
    out = [d.add(t) for t in ids]
    if out:
        out[-1] += d.flush()
    return out


def _detokenized(engine: Engine, ids: list[int]) -> str:
    return "".join(_pieces(engine.detokenize, ids))


def can_score(engine: Engine) -> bool:
    return callable(getattr(engine, "logprob_rows", None)) or isinstance(engine, (LocalEngine, PipelineEngine))


def logprob_rows(engine: Engine, ids: list[int], start: int) -> Iterator[torch.Tensor]:
    """Float32 log-softmax rows, in order, a block (k, vocab) at a time: the distributions of ids[start:],
    each given the ids before it (start >= 1). An engine may provide `logprob_rows(ids, start)` itself;
    for the two engines of strata.serve.engine it is done here, on their own paths."""
    if not 1 <= start <= len(ids):
        raise ValueError(f"start {start} outside 1..{len(ids)}")
    hook = getattr(engine, "logprob_rows", None)
    if callable(hook):
        return hook(ids, start)
    if isinstance(engine, LocalEngine):
        return _local_rows(engine, ids, start)
    raise TypeError(f"{type(engine).__name__} cannot score tokens")


def _local_rows(eng: LocalEngine, ids: list[int], start: int) -> Iterator[torch.Tensor]:
    """The whole model in this process: the positions [start - 1, len - 1) through the model in chunks after
    the prefix whose KV it already holds, each chunk's rows through the head (the rows of Transformer.nll)."""
    net = eng.net
    if net is None:
        raise EngineError("local", "the engine is closed or failed: restart() it")
    n, chunk = len(ids), eng.prefill_chunk
    reused = 0
    for a, b in zip(ids, eng.kept):
        if a != b:
            break
        reused += 1
    reused = min(reused, start - 1)  # the row before `start` is needed: its position is computed again
    eng.kept = list(ids[:reused])  # past `reused` the cache is about to be overwritten
    try:
        for pos in range(reused, n - 1, chunk):  # the last position's row predicts nothing inside ids
            end = min(pos + chunk, n - 1)
            h = net(torch.tensor([ids[pos:end]], device=eng.device), pos)
            eng.kept = list(ids[:end])
            first = max(start - 1, pos)
            if first < end:
                yield torch.log_softmax(net.logits(h[0, first - pos:]).float(), dim=-1).cpu()
    except (RuntimeError, torch.cuda.OutOfMemoryError) as e:
        eng.net = None
        raise EngineError(f"local ({eng.device})", f"{type(e).__name__}: {e}") from e


def score_tokens(engine: Engine, ids: list[int], start: int, top: int) -> list[Scored]:
    """log p(ids[i] | ids[:i]) and the `top` likeliest tokens there, for i in [start, len(ids)); the texts
    of the tokens themselves are left "" for the caller (they depend on the tokens around them)."""
    if isinstance(engine, PipelineEngine) and not callable(getattr(engine, "logprob_rows", None)):
        # the stages: one prefill whose last stage scores each chunk's targets by the perplexity's head rows
        lps, which, values = engine.score(ids, start, top)
        return [Scored("", lp, [(engine.detokenize([t]), v) for t, v in zip(w, x)])
                for lp, w, x in zip(lps, which, values)]
    out: list[Scored] = []
    i = start
    for rows in logprob_rows(engine, ids, start):
        k = rows.shape[0]
        want = torch.tensor(ids[i:i + k], dtype=torch.long)
        chosen = rows.gather(1, want[:, None])[:, 0].tolist()
        if top:
            values, which = rows.topk(top, dim=1)
            alts = [[(engine.detokenize([t]), v) for t, v in zip(w, x)]
                    for w, x in zip(which.tolist(), values.tolist())]
        else:
            alts = [[] for _ in range(k)]
        out += [Scored("", lp, alt) for lp, alt in zip(chosen, alts)]
        i += k
    if i != len(ids):
        raise RuntimeError(f"the scoring gave {i - start} rows for {len(ids) - start} tokens")
    return out


# -- the worker that owns the engine ----------------------------------------------------------------

@dataclass
class Seq:
    """One choice of a request: a prompt's ids and how to sample them (n > 1: several share a prompt)."""

    index: int   # the choice's `index` in the answer
    prompt: int  # which of the request's prompts
    ids: list[int]
    params: SamplingParams


@dataclass
class Job:
    """One request, handed from the event loop to the worker thread, which serves its choices one after
    another. The worker answers through `events` (on the loop): ('start', index, echoed prompt text),
    ('text', index, str), ('done', index, GenerationStats, finish_reason, logprobs), then ('end',) after the
    last choice; or ('error', RequestError). ('cancelled',) arrives when the job is cancelled. With `ids_out` (a
    model without a tokenizer) no text comes: ('ids', index, the generated ids) comes before 'done'.
    logprobs: None, or {'prompt': [...] | None, 'completion': [...]}, each a list of `Scored` (the prompt's
    first token has no logprob: nothing comes before it)."""

    seqs: list[Seq]
    loop: asyncio.AbstractEventLoop
    echo: bool = False
    top: int | None = None  # logprobs asked: the alternatives per token (0..MAX_LOGPROBS); None: no logprobs
    # completions: an answer that ended at the end-of-sequence token has that token as its last logprobs entry
    # (its text not in the answer's), as OpenAI's and vLLM's completions do. A harness's loglikelihood relies on
    # it: lm-eval sends the text with echo and max_tokens 1 and drops the last entry, the generated token's.
    eos_logprob: bool = False
    ids_out: bool = False  # the answer as token ids (`token_ids`), its text "": a model without a tokenizer
    tools: bool = False    # chat with tools: the model's <tool_call> blocks go out as tool_calls (strata/text/tool_calls.py)
    events: asyncio.Queue = dataclasses.field(default_factory=asyncio.Queue)
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)

    def emit(self, event: tuple) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening any more
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def cancel(self) -> None:
        """The client is gone (or its answer is complete): stop generating, stop waiting."""
        if not self.cancelled.is_set():
            self.cancelled.set()
            self.emit(("cancelled",))  # wakes a handler still waiting for a job the worker will skip


class Worker:
    """Threads that run jobs on the engine: one (one job at a time), or the engine's `max_seqs` (a job each, the
    engine interleaving their sequences: strata/head/slots.py); up to `queue_size` jobs wait."""

    def __init__(self, engine: Engine, queue_size: int, metrics: Metrics):
        if queue_size < 0:
            raise ValueError(f"queue_size must be >= 0, got {queue_size}")
        self.engine, self.queue_size, self.metrics = engine, queue_size, metrics
        self._pending: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self.concurrency = max(1, int(getattr(engine, "max_seqs", 1)))  # jobs on the engine at once
        self._running: list[Job] = []  # the jobs on the engine now
        self._seqs: list[Seq] = []     # their sequences on the engine now (/metrics' running_sequences)
        self._restarting = threading.Lock()
        self._draining = False
        self._stopping = False
        self.broken: str | None = None  # why the engine is down (a restart failed), else None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._threads = [threading.Thread(target=self._run, name="strata-engine" + (f"-{i}" if i else ""), daemon=True)
                         for i in range(self.concurrency)]
        self._closed = False
        self._job_s = 1.0  # a request's seconds on the engine, a running mean (a 429's Retry-After)

    def retry_after(self) -> int:
        """Seconds until a waiting place is likely free: one of the running jobs ends, each the mean job's time (held
        to 1..RETRY_AFTER_MAX_S)."""
        return max(1, min(RETRY_AFTER_MAX_S, math.ceil(self._job_s / self.concurrency)))

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        for t in self._threads:
            t.start()

    @property
    def queue_length(self) -> int:
        with self._cond:
            return sum(not j.cancelled.is_set() for j in self._pending)

    @property
    def busy(self) -> bool:
        return bool(self._running)

    @property
    def running_sequences(self) -> int:
        """Sequences on the engine now (0 between a job's sequences, and when idle)."""
        return len(self._seqs)

    @property
    def current(self) -> Job | None:
        """A job on the engine now, the oldest (None when idle)."""
        running = self._running
        return running[0] if running else None

    @property
    def draining(self) -> bool:
        return self._draining

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._draining:
                raise RequestError(503, "the server is shutting down", type="unavailable")
            # a waiting client that went away frees its place
            self._pending = collections.deque(j for j in self._pending if not j.cancelled.is_set())
            # when idle, the first waiting job is about to run: it does not hold a waiting place
            if len(self._pending) >= self.queue_size + self.concurrency - len(self._running):
                err = RequestError(429, f"the queue is full ({self.queue_size} requests waiting); retry later",
                                   type="rate_limit_exceeded")
                err.headers = {"Retry-After": str(self.retry_after())}
                raise err
            self._pending.append(job)
            self._cond.notify()

    def begin_shutdown(self) -> None:
        """Take no more jobs; the waiting ones are answered 503, the running one finishes."""
        with self._cond:
            self._draining = True
            waiting, self._pending = list(self._pending), collections.deque()
        for job in waiting:
            job.emit(("error", RequestError(503, "the server is shutting down", type="unavailable")))

    def stop(self) -> None:
        """Drain, wait for the running job, close the engine (idempotent)."""
        self.begin_shutdown()
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        for t in self._threads:
            if t.is_alive():
                t.join()
        if not self._closed:
            self._closed = True
            self.engine.close()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._stopping:
                    self._cond.wait()
                if not self._pending:
                    return
                job = self._pending.popleft()
                self._running.append(job)
            t0 = time.perf_counter()
            try:
                if not job.cancelled.is_set():
                    self._serve(job)
            except BaseException:  # never let the thread die with a client waiting
                log.exception("worker failed")
                job.emit(("error", RequestError(500, "internal error in the server's worker", type="server_error")))
            finally:
                with self._cond:
                    self._running = [j for j in self._running if j is not job]
                    self._job_s = 0.8 * self._job_s + 0.2 * (time.perf_counter() - t0)

    def _serve(self, job: Job) -> None:
        if self.broken is not None:
            self._restart()
            if self.broken is not None:
                job.emit(("error", RequestError(503, f"the engine is down: {self.broken}", type="engine_error")))
                return
        scored: dict[int, list[Scored]] = {}  # prompt -> its tokens' scores (n > 1: scored once)
        failed = threading.Event()

        def one(seq: Seq) -> None:
            if job.cancelled.is_set() or failed.is_set():
                return
            with self._cond:
                self._seqs.append(seq)
            try:
                if not self._serve_seq(job, seq, scored):
                    failed.set()
            finally:
                with self._cond:
                    self._seqs = [q for q in self._seqs if q is not seq]
        width = min(len(job.seqs), self.concurrency)
        if width > 1:  # an engine with max_seqs > 1: a request's choices (n, a batch of prompts) run side by side
            with concurrent.futures.ThreadPoolExecutor(width, thread_name_prefix="strata-choice") as pool:
                list(pool.map(one, job.seqs))
        else:
            for seq in job.seqs:
                one(seq)
        if not (job.cancelled.is_set() or failed.is_set()):
            job.emit(("end",))

    def _serve_seq(self, job: Job, seq: Seq, scored: dict[int, list[Scored]]) -> bool:
        """One choice: generate, then score what was asked; False when it failed (the error is sent)."""
        try:
            job.emit(("start", seq.index, _detokenized(self.engine, seq.ids) if job.echo else ""))
            eos = None  # the end-of-sequence token that ended the answer, when it is to be scored
            if job.echo and job.top is not None and seq.params.max_tokens == 0:
                # scoring only (e.g. a harness's loglikelihood): no prefill that the scoring would repeat
                made, text, finish = [], "", "length"
                stats = GenerationStats(prompt_tokens=len(seq.ids), reused_tokens=0, completion_tokens=0,
                                        prefill_s=0.0, decode_s=0.0, finish_reason="length")
                first = None
            else:
                made, text, stats, finish, first, at_eos = self._generate(job, seq)
                if at_eos and job.eos_logprob:  # the end token that ended it (an engine that does not say: its eos)
                    eos = stats.end_token if getattr(stats, "end_token", None) is not None else _eos_id(self.engine)
            logprobs = None
            if job.top is not None:
                logprobs = self._logprobs(job, seq, made, text, scored, eos)
        except ValueError as e:  # the engine refused the prompt (ids out of range, too long): nothing ran
            job.emit(("error", _bad(str(e), param="prompt")))
            return False
        except EngineError as e:
            with self.metrics.lock:
                self.metrics.engine_errors += 1
            log.error("engine failed: %s", e)
            job.emit(("error", RequestError(503, f"the engine failed: {e}", type="engine_error", stage=e.stage)))
            self._restart()
            return False
        except Exception as e:
            with self.metrics.lock:
                self.metrics.engine_errors += 1
            log.exception("generation failed")
            job.emit(("error", RequestError(500, f"generation failed: {type(e).__name__}: {e}", type="server_error")))
            self._restart()
            return False
        self.metrics.record(stats, first)
        job.emit(("done", seq.index, stats, finish, logprobs))
        return True

    def _generate(self, job: Job, seq: Seq) -> tuple[list[int], str, GenerationStats, str, float | None, bool]:
        """(generated ids, their text as sent (cut at a stop string), stats, finish_reason, time to first token,
        whether the engine's end-of-sequence token ended it)."""
        # (a model without a tokenizer: no text, the ids go out as they are; the request had no stop strings)
        detok = Detokenizer((lambda ids: "") if job.ids_out else self.engine.detokenize, context=seq.ids)
        stop = StopMatcher(seq.params.stop)
        first: list[float] = []
        made: list[int] = []
        sent: list[str] = []

        def emit(text: str) -> None:
            if text:
                sent.append(text)
                job.emit(("text", seq.index, text))

        def on_token(token: int) -> bool:
            if not first:
                first.append(time.perf_counter() - t0)
            if job.cancelled.is_set():
                return False
            made.append(token)
            piece = detok.add(token)
            emit(stop.feed(piece) if piece else "")
            return not stop.stopped

        t0 = time.perf_counter()
        stats = self.engine.generate(seq.ids, seq.params, on_token)
        emit(stop.feed(detok.flush()) + stop.flush())
        if job.ids_out:
            job.emit(("ids", seq.index, list(made)))
        # the engine stops by itself ("stop") at its EOS token, else when on_token said so: a stop string, a cancel
        at_eos = stats.finish_reason == "stop" and not stop.stopped and not job.cancelled.is_set()
        return made, "".join(sent), stats, "stop" if stop.stopped else stats.finish_reason, \
            first[0] if first else None, at_eos

    def _logprobs(self, job: Job, seq: Seq, made: list[int], text: str, scored: dict, eos: int | None = None) -> dict:
        """The prompt's token scores (with echo) and the generated tokens' (those whose text was sent), then the
        end-of-sequence token `eos` that ended the answer, when given."""
        want_prompt = job.echo and seq.prompt not in scored
        start = 1 if want_prompt else len(seq.ids)
        full = seq.ids + made + ([eos] if eos is not None else [])
        scores = score_tokens(self.engine, full, start, job.top) if start < len(full) else []
        if want_prompt:
            pieces = _pieces(self.engine.detokenize, seq.ids)
            scored[seq.prompt] = [Scored(pieces[0], None, [])] + [
                dataclasses.replace(s, text=piece) for piece, s in zip(pieces[1:], scores)]
        completion = scores[len(seq.ids) - start:]
        pieces = _pieces(self.engine.detokenize, made, context=seq.ids)
        kept, offset = [], 0
        for piece, s in zip(pieces, completion):
            if offset >= len(text):  # cut by a stop string: its tokens are not part of the answer
                break
            kept.append(dataclasses.replace(s, text=piece))
            offset += len(piece)
        if eos is not None and len(kept) == len(made):  # the answer ended at it (and nothing was cut)
            kept.append(dataclasses.replace(completion[len(made)], text=self.engine.detokenize([eos])))
        return {"prompt": scored[seq.prompt] if job.echo else None, "completion": kept}

    def _restart(self) -> None:
        with self._restarting:
            up = getattr(self.engine, "is_up", None)
            if self.concurrency > 1 and up is not None and up():
                return  # another job's thread brought it back already (a failure fails every running job)
            self._restart_engine()

    def _restart_engine(self) -> None:
        try:
            self.engine.restart()
        except Exception as e:
            log.exception("engine restart failed")
            self.broken = f"restart failed: {type(e).__name__}: {e}"
            return
        self.broken = None
        with self.metrics.lock:
            self.metrics.restarts += 1


# -- request parsing --------------------------------------------------------------------------------

def default_max_body(max_context: int) -> int:
    """The body limit when the rig sets no `server_max_body_bytes`: what max_context tokens could take as
    JSON with room to spare (a token is ~4 bytes of text, up to 12 JSON-escaped; an id is at most 8 as
    "151935, "), plus 1 MiB for the rest of the request (chat messages' framing, options)."""
    return max_context * 16 + (1 << 20)


def _model_id(engine: Engine, field: str) -> int | None:
    """A token-id figure of the engine's model (`vocab_size`, `eos_id`), where the engine tells: on itself, its
    args (LocalEngine) or its pipeline's plan (PipelineEngine)."""
    for path in ((field,), ("args", field), ("pipe", "plan", "args", field)):
        v = engine
        for name in path:
            v = getattr(v, name, None)
        if _is_id(v):
            return v
    return None


def _vocab_size(engine: Engine) -> int | None:
    """The engine's vocabulary size, where it tells (token-id prompts are checked against it)."""
    return _model_id(engine, "vocab_size")


def _eos_id(engine: Engine) -> int | None:
    """The engine's end-of-sequence token id, where it tells."""
    return _model_id(engine, "eos_id")


def _firsts(seqs: list[Seq]) -> list[Seq]:
    """Each prompt's first choice (usage counts a prompt once, however many choices it has)."""
    seen, out = set(), []
    for s in seqs:
        if s.prompt not in seen:
            seen.add(s.prompt)
            out.append(s)
    return out


async def _json_body(request: Request, max_body: int) -> dict:
    """The body as a JSON object, refused with 413 before it is read whole when it is over `max_body`: by its
    Content-Length, else (chunked) as soon as the bytes streamed in pass the limit."""
    size = request.headers.get("content-length")
    if size is not None and size.strip().isdigit() and int(size) > max_body:
        raise RequestError(413, f"the request body is {int(size)} bytes, over the limit of {max_body} "
                           "(server_max_body_bytes)", type="request_too_large")
    parts, got = [], 0
    async for part in request.stream():
        got += len(part)
        if got > max_body:  # uvicorn stops reading the socket while nobody consumes: nothing more comes in
            raise RequestError(413, f"the request body is over the limit of {max_body} bytes "
                               "(server_max_body_bytes)", type="request_too_large")
        parts.append(part)
    raw = b"".join(parts)
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise _bad(f"malformed JSON: {e}") from None
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    return body


# Every field a request may carry. A field outside these is refused, not ignored: it might change the answer.
_SAMPLER = ("temperature", "top_p", "top_k", "seed", "min_p", "logit_bias", "presence_penalty", "frequency_penalty",
            "repetition_penalty", "ignore_eos", "min_tokens")  # SamplingParams' own fields, as they are named there
_COMMON = {"model", "stream", "stream_options", "stop", "max_tokens", "n", "response_format", "logprobs", *_SAMPLER}
_FIELDS = {"completions": _COMMON | {"prompt", "echo", "best_of", "suffix"},
           "chat": _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                              "functions", "function_call", "modalities", "audio", "reasoning_effort",
                              "chat_template_kwargs", "web_search_options", "verbosity", "prediction"}}
_BOOKKEEPING = {"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier",
                "parallel_tool_calls"}  # accepted and ignored: none of them changes the tokens (every <tool_call> the
                                        # model writes is parsed; a template that reads the flag gets it: _template_vars)


def _check_fields(body: dict, endpoint: str) -> None:
    """Refuse, rather than silently ignore, fields that would change the answer and that this server does not
    implement (a field given as null is the default, whatever it is)."""
    known = _FIELDS[endpoint]
    for key, value in body.items():
        if value is None or key in _BOOKKEEPING:
            continue
        if key not in known:
            m = difflib.get_close_matches(key, sorted(known | _BOOKKEEPING), n=1)
            hint = f" (did you mean {m[0]!r}?)" if m else ""
            raise _bad(f"unknown field {key!r}{hint}: refused rather than ignored, since it could change the "
                       "answer", param=key)
    checks = [("best_of", lambda v: v == 1), ("suffix", lambda v: v == ""),
              ("functions", lambda v: not v), ("function_call", lambda v: v == "none"),
              ("tool_choice", lambda v: v in ("none", "auto", "required") or _named_tool(v) is not None),
              ("modalities", lambda v: v == ["text"]), ("audio", lambda v: False), ("prediction", lambda v: False),
              ("web_search_options", lambda v: False), ("verbosity", lambda v: False)]
    for key, ok in checks:
        if body.get(key) is not None and not ok(body[key]):
            why = (' (none, auto, required or {"type": "function", "function": {"name": ...}})'
                   if key == "tool_choice" else "")
            raise _bad(f"{key}={body[key]!r} is not supported by this server{why}", param=key)
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind not in ("text", "json_object", "json_schema"):
            raise _bad(f"response_format type must be text, json_object or json_schema, got {fmt!r}",
                       param="response_format")


def _named_tool(choice) -> str | None:
    """A tool_choice naming one function ({"type": "function", "function": {"name": ...}}) -> its name."""
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        return name if isinstance(name, str) else None
    return None


REASONING_EFFORT = ("minimal", "low", "medium", "high")


def _template_vars(body: dict) -> dict:
    """A chat request's variables for the model's chat template, as HF's apply_chat_template and vLLM pass them:
    tools (unless tool_choice is none: then the model is shown none), reasoning_effort (gpt-oss), and
    chat_template_kwargs as they are (e.g. Qwen3's enable_thinking)."""
    out: dict = {}
    extra = body.get("chat_template_kwargs")
    if extra is not None:
        if not isinstance(extra, dict) or not all(isinstance(k, str) for k in extra):
            raise _bad("chat_template_kwargs must be an object", param="chat_template_kwargs")
        out.update(extra)
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in REASONING_EFFORT:
            raise _bad(f"reasoning_effort must be one of {', '.join(REASONING_EFFORT)}, got {effort!r}",
                       param="reasoning_effort")
        out["reasoning_effort"] = effort
    tools = body.get("tools")
    if tools and body.get("tool_choice") != "none":
        if not isinstance(tools, list) or not all(
                isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
                and isinstance(t["function"].get("name"), str) for t in tools):
            raise _bad("tools must be a list of {\"type\": \"function\", \"function\": {\"name\": ..., "
                       "\"parameters\": {...}}}", param="tools")
        out["tools"] = tools
    return out


def _sampling(body: dict, max_tokens_keys: tuple[str, ...], default_max: int | None) -> tuple[SamplingParams, int | None]:
    """(params with max_tokens still to be fitted to the context, the requested max_tokens or None)."""
    requested = None
    for key in max_tokens_keys:
        if body.get(key) is not None:
            requested = body[key]
            break
    kw = {k: body[k] for k in _SAMPLER if body.get(k) is not None}
    if body.get("stop") is not None:
        kw["stop"] = body["stop"]
    try:
        params = SamplingParams(max_tokens=requested if requested is not None else 0, **kw)
    except ValueError as e:
        raise _bad(str(e)) from None
    return params, requested if requested is not None else default_max


def _stream_flags(body: dict) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _bad(f"stream must be true or false, got {stream!r}", param="stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise _bad("stream_options must be an object", param="stream_options")
    usage = opts.get("include_usage", False)
    if not isinstance(usage, bool):
        raise _bad("stream_options.include_usage must be true or false", param="stream_options")
    return stream, usage


def _usage(first: list[GenerationStats], all_: list[GenerationStats]) -> dict:
    """Prompt tokens once per prompt (`first`: each prompt's first choice), completion tokens of every choice."""
    prompt, completion = sum(s.prompt_tokens for s in first), sum(s.completion_tokens for s in all_)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(s.reused_tokens for s in first)}}


def _is_id(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _prompts(prompt: Any) -> list[str | list[int]]:
    """OpenAI's prompt forms: a string, a list of token ids, a list of strings, a list of lists of ids."""
    forms = "a string, a list of token ids, a list of strings or a list of lists of token ids"
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list):
        raise _bad(f"prompt must be {forms}", param="prompt")
    if not prompt:
        raise _bad("prompt is an empty list", param="prompt")
    if all(_is_id(x) for x in prompt):
        return [list(prompt)]
    if all(isinstance(x, str) for x in prompt):
        return list(prompt)
    if all(isinstance(x, list) for x in prompt):
        for i, x in enumerate(prompt):
            if not x:
                raise _bad(f"prompt[{i}] is an empty list of token ids", param="prompt")
            bad = next((t for t in x if not _is_id(t)), None)
            if bad is not None:
                raise _bad(f"prompt[{i}] holds {bad!r}: token ids are integers", param="prompt")
        return [list(x) for x in prompt]
    bad = next((x for x in prompt if not (_is_id(x) or isinstance(x, (str, list)))), None)
    what = f"holds {bad!r}" if bad is not None else "mixes forms"
    raise _bad(f"prompt {what}: it must be {forms}", param="prompt")


def _top(value: Any, name: str) -> int:
    if not _is_id(value) or not 0 <= value <= MAX_LOGPROBS:
        raise _bad(f"{name} must be an integer from 0 to {MAX_LOGPROBS}, got {value!r}", param=name)
    return value


def _bool(body: dict, name: str) -> bool:
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise _bad(f"{name} must be true or false, got {v!r}", param=name)
    return v


def _choices(body: dict) -> int:
    n = body.get("n")
    if n is None:
        return 1
    if not _is_id(n) or not 1 <= n <= MAX_N:
        raise _bad(f"n must be an integer from 1 to {MAX_N}, got {n!r}", param="n")
    return n


def _legacy_logprobs(scored: list[Scored]) -> dict:
    """OpenAI's completions logprobs: parallel lists; a top_logprobs entry also holds the token itself."""
    tokens, lps, tops, offsets, at = [], [], [], [], 0
    for s in scored:
        tokens.append(s.text)
        lps.append(s.logprob)
        offsets.append(at)
        at += len(s.text)
        if s.logprob is None:
            tops.append(None)
        else:
            top = dict(s.top)
            top.setdefault(s.text, s.logprob)
            tops.append(top)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def _chat_logprobs(scored: list[Scored]) -> dict:
    def entry(text, lp):
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}
    return {"content": [{**entry(s.text, s.logprob), "top_logprobs": [entry(t, lp) for t, lp in s.top]}
                        for s in scored], "refusal": None}


# -- the app ----------------------------------------------------------------------------------------

class _SSEResponse(StreamingResponse):
    """An SSE stream that cancels its job however it ends (done, client gone, server cancelled)."""

    def __init__(self, content, job: Job):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.job = job

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel()


def _sse(data: Any, event: str | None = None) -> str:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return (f"event: {event}\n" if event else "") + f"data: {text}\n\n"


class _Middleware:
    """Counts every answer by path and status, and checks the API key (all but /health need it)."""

    def __init__(self, app, metrics: Metrics, api_key: str | None):
        self.app, self.metrics, self.api_key = app, metrics, api_key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.metrics.count_request(path, message["status"])
            await send(message)

        if self.api_key is not None and path != "/health" and not self._authorized(scope):
            err = RequestError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                               type="authentication_error")
            return await err.response({"WWW-Authenticate": "Bearer"})(scope, receive, counting_send)
        await self.app(scope, receive, counting_send)

    def _authorized(self, scope) -> bool:
        expected = f"Bearer {self.api_key}".encode()
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                return hmac.compare_digest(value, expected)
        return False


class Server:
    """The HTTP handlers over one Worker."""

    def __init__(self, engine: Engine, queue_size: int = DEFAULT_QUEUE, max_body: int | None = None):
        self.engine = engine
        self.max_body = max_body if max_body is not None else default_max_body(engine.max_context)
        self.vocab_size = _vocab_size(engine)
        self.metrics = Metrics()
        self.worker = Worker(engine, queue_size, self.metrics)
        self.created = int(time.time())

    async def _constrained(self, body: dict, params: SamplingParams) -> SamplingParams:
        """params with the request's response_format as a grammar (strata/text/grammar.py: llguidance), compiled
        against the model's vocabulary off the event loop; a format that cannot be enforced is a 400."""
        fmt = body.get("response_format")
        if fmt is None or fmt.get("type") == "text":
            return params
        from strata.text.grammar import GrammarError, json_grammar
        tokenizer = self.engine.tokenizer if getattr(self.engine, "has_tokenizer", False) else None
        try:
            grammar = await run_in_threadpool(json_grammar, tokenizer, fmt)
        except GrammarError as e:
            raise _bad(str(e), param="response_format") from None
        return dataclasses.replace(params, grammar=grammar)

    # -- the two generation endpoints share everything but the prompt and the shapes
    async def completions(self, request: Request) -> Response:
        body = await _json_body(request, self.max_body)
        if body.get("prompt") is None:
            raise _bad("prompt is required", param="prompt")
        _check_fields(body, "completions")
        prompts = _prompts(body["prompt"])
        params, max_tokens = _sampling(body, ("max_tokens",), COMPLETIONS_MAX_TOKENS)
        params = await self._constrained(body, params)
        top = None if body.get("logprobs") is None else _top(body["logprobs"], "logprobs")
        return await self._generate(request, body, prompts, params, max_tokens, chat=False,
                                    echo=_bool(body, "echo"), top=top)

    async def chat_completions(self, request: Request) -> Response:
        body = await _json_body(request, self.max_body)
        if "messages" not in body:
            raise _bad("messages is required", param="messages")
        _check_fields(body, "chat")
        params, max_tokens = _sampling(body, ("max_completion_tokens", "max_tokens"), None)
        params = await self._constrained(body, params)
        top = None
        if _bool(body, "logprobs"):
            top = 0 if body.get("top_logprobs") is None else _top(body["top_logprobs"], "top_logprobs")
        elif body.get("top_logprobs") is not None:
            raise _bad("top_logprobs needs logprobs: true", param="top_logprobs")
        variables = _template_vars(body)
        try:
            prompt = await run_in_threadpool(self.engine.chat_prompt, body["messages"], **variables)
            if "tools" in variables and prompt == await run_in_threadpool(
                    self.engine.chat_prompt, body["messages"], **{k: v for k, v in variables.items() if k != "tools"}):
                raise _bad(f"tools: the chat template of {self.engine.model_name!r} does not show tools to the model",
                           param="tools")
        except ValueError as e:  # strata.text.chat.ChatError, or a model without a template
            raise _bad(str(e), param="messages") from None
        if body.get("tool_choice") not in (None, "none", "auto"):
            params = await self._tool_choice(body, variables, prompt, params)
        return await self._generate(request, body, [prompt], params, max_tokens, chat=True, echo=False, top=top,
                                    tools="tools" in variables)

    async def _tool_choice(self, body: dict, variables: dict, prompt, params: SamplingParams) -> SamplingParams:
        """tool_choice required or a named function, enforced: the answer constrained to the <tool_call> blocks the
        model's template asks for (strata/text/grammar.py's tool_grammar; parallel_tool_calls false: one block)."""
        from strata.text.grammar import GrammarError, tool_grammar
        if "tools" not in variables:
            raise _bad("tool_choice required or a named function needs tools", param="tool_choice")
        fmt = body.get("response_format")
        if fmt is not None and fmt.get("type") != "text":
            raise _bad("tool_choice with response_format: one enforced shape at a time", param="tool_choice")
        if not isinstance(prompt, str) or tool_calls.OPEN not in prompt:
            raise _bad(f"tool_choice={body['tool_choice']!r} is enforced for chat templates whose tool calls are "
                       f"{tool_calls.OPEN} blocks (Qwen / Hermes); {self.engine.model_name!r}'s shows no such form",
                       param="tool_choice")
        tokenizer = self.engine.tokenizer if getattr(self.engine, "has_tokenizer", False) else None
        try:
            grammar = await run_in_threadpool(tool_grammar, tokenizer, variables["tools"],
                                              _named_tool(body["tool_choice"]), body.get("parallel_tool_calls") is not False)
        except GrammarError as e:
            raise _bad(str(e), param="tool_choice") from None
        return dataclasses.replace(params, grammar=grammar)

    async def _generate(self, request: Request, body: dict, prompts: list[str | list[int]], params: SamplingParams,
                        max_tokens: int | None, chat: bool, echo: bool, top: int | None, tools: bool = False) -> Response:
        stream, include_usage = _stream_flags(body)
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise _bad("model must be a string", param="model")
        n = _choices(body)
        if top is not None and stream:
            raise _bad("logprobs with stream: true is not supported (the logprobs are computed once the answer "
                       "is complete)", param="logprobs")
        if top is not None and not can_score(self.engine):
            raise _bad(f"logprobs are not supported by this engine ({type(self.engine).__name__})", param="logprobs")
        param = "messages" if chat else "prompt"
        ids_out = not getattr(self.engine, "has_tokenizer", True)
        if ids_out:
            asked = [k for k, v in (("stop", params.stop), ("echo", echo), ("logprobs", top is not None)) if v]
            if asked:
                raise _bad(f"model {self.engine.model_name!r} has no tokenizer: it takes prompts as token ids and "
                           f"answers with token ids (token_ids), without {asked[0]}", param=asked[0])
        limit = self.engine.max_context
        batch = len(prompts) > 1
        seqs: list[Seq] = []
        for p, prompt in enumerate(prompts):
            where = f"prompt[{p}]" if batch else "the prompt"
            if isinstance(prompt, str):
                try:
                    ids = await run_in_threadpool(self.engine.tokenize, prompt)
                except ValueError as e:  # e.g. strata's ModelError: a model without a tokenizer
                    raise _bad(str(e), param=param) from None
            else:
                ids = prompt
                vocab = self.vocab_size
                bad = next((t for t in ids if t < 0 or (vocab is not None and t >= vocab)), None)
                if bad is not None:
                    raise _bad(f"{where} holds token id {bad}, outside the vocabulary [0, {vocab})", param=param)
            if not ids:
                raise _bad(f"{where} is empty", param=param)
            if len(ids) > limit:
                raise _bad(f"{where} is {len(ids)} tokens, over the model's context of {limit} tokens "
                           "(max_context)", param=param)
            room = limit - len(ids)
            for j in range(n):
                # n > 1: distinct seeds, reproducible when the request gave one
                seed = params.seed if params.seed is None or n == 1 else (params.seed + j) % (MAX_SEED + 1)
                seqs.append(Seq(index=p * n + j, prompt=p, ids=list(ids), params=dataclasses.replace(
                    params, seed=seed, max_tokens=room if max_tokens is None else min(max_tokens, room))))
        vocab = self.vocab_size
        bad = next((t for t, _ in params.logit_bias if vocab is not None and t >= vocab), None)
        if bad is not None:
            raise _bad(f"logit_bias holds token id {bad}, outside the vocabulary [0, {vocab})", param="logit_bias")
        job = Job(seqs, asyncio.get_running_loop(), echo=echo, top=top, eos_logprob=not chat, ids_out=ids_out,
                  tools=tools)
        self.worker.submit(job)  # 429 / 503 from here
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created, name = int(time.time()), self.engine.model_name
        if stream:
            return _SSEResponse(self._stream(job, rid, created, name, chat, include_usage), job)
        return await self._collect(request, job, rid, created, name, chat)

    async def _collect(self, request: Request, job: Job, rid, created, model, chat) -> Response:
        async def watch_disconnect():
            while (await request.receive())["type"] != "http.disconnect":
                pass
            job.cancel()
        watcher = asyncio.create_task(watch_disconnect())
        texts: dict[int, list[str]] = collections.defaultdict(list)
        ids: dict[int, list[int]] = {}
        done: dict[int, tuple] = {}
        try:
            while True:
                ev = await job.events.get()
                if ev[0] in ("start", "text"):
                    texts[ev[1]].append(ev[2])
                elif ev[0] == "ids":
                    ids[ev[1]] = ev[2]
                elif ev[0] == "done":
                    done[ev[1]] = ev[2:]
                elif ev[0] == "error":
                    return ev[1].response()
                elif ev[0] == "cancelled":
                    return Response(status_code=499)  # nobody reads it: the client has gone
                else:
                    break
        finally:
            watcher.cancel()
            job.cancel()
        choices = []
        for seq in job.seqs:
            stats, finish, lp = done[seq.index]
            text = "".join(texts[seq.index])
            if chat:
                message = {"role": "assistant", "content": text}
                if job.tools:
                    content, calls = tool_calls.parse(text)
                    if calls:
                        message = {"role": "assistant", "content": content or None, "tool_calls": calls}
                        finish = "tool_calls" if finish == "stop" else finish
                choice = {"index": seq.index, "message": message,
                          "logprobs": _chat_logprobs(lp["completion"]) if lp else None}
            else:
                choice = {"index": seq.index, "text": text,
                          "logprobs": _legacy_logprobs((lp["prompt"] or []) + lp["completion"]) if lp else None}
            if seq.index in ids:
                choice["token_ids"] = ids[seq.index]
            choices.append({**choice, "finish_reason": finish})
        stats = [done[s.index][0] for s in job.seqs]
        first = [done[s.index][0] for s in _firsts(job.seqs)]
        return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                             "created": created, "model": model, "choices": choices, "usage": _usage(first, stats)})

    async def _stream(self, job: Job, rid, created, model, chat, include_usage):
        def chunk(index, delta_or_text, finish=None) -> dict:
            c = ({"index": index, "delta": delta_or_text} if chat else {"index": index, "text": delta_or_text})
            c.update(logprobs=None, finish_reason=finish)
            out = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                   "created": created, "model": model, "choices": [c]}
            if include_usage:
                out["usage"] = None
            return out

        done: dict[int, GenerationStats] = {}
        # chat with tools: each choice's text through its parser, tool calls as OpenAI's deltas (one a call, whole)
        parsers = {s.index: tool_calls.ToolCallParser() for s in job.seqs} if chat and job.tools else {}
        sent_calls: collections.Counter = collections.Counter()  # each choice's tool calls streamed so far

        def deltas(index: int, events) -> Iterator[str]:
            for kind, v in events:
                if kind == "content" and v:
                    yield _sse(chunk(index, {"content": v}))
                elif kind == "tool_call":
                    yield _sse(chunk(index, {"tool_calls": [{"index": sent_calls[index], **v}]}))
                    sent_calls[index] += 1
        while True:
            ev = await job.events.get()
            if ev[0] == "start":
                if chat:
                    yield _sse(chunk(ev[1], {"role": "assistant", "content": ""}))
                elif ev[2]:  # echo: the prompt's text first
                    yield _sse(chunk(ev[1], ev[2]))
            elif ev[0] == "text" and ev[1] in parsers:
                for line in deltas(ev[1], parsers[ev[1]].feed(ev[2])):
                    yield line
            elif ev[0] == "text":
                yield _sse(chunk(ev[1], {"content": ev[2]} if chat else ev[2]))
            elif ev[0] == "ids":  # a model without a tokenizer: the answer's ids in one chunk
                c = chunk(ev[1], "")
                c["choices"][0]["token_ids"] = ev[2]
                yield _sse(c)
            elif ev[0] == "done":
                done[ev[1]] = ev[2]
                finish = ev[3]
                if ev[1] in parsers:
                    for line in deltas(ev[1], parsers[ev[1]].flush()):
                        yield line
                    finish = "tool_calls" if finish == "stop" and parsers[ev[1]].calls else finish
                yield _sse(chunk(ev[1], {} if chat else "", finish))
            elif ev[0] == "error":
                yield _sse(ev[1].body(), event="error")
                return
            elif ev[0] == "cancelled":
                return
            else:
                if include_usage:
                    last = chunk(0, {} if chat else "")
                    last["choices"] = []
                    last["usage"] = _usage([done[s.index] for s in _firsts(job.seqs)], list(done.values()))
                    yield _sse(last)
                yield _sse("[DONE]")
                return

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": self.engine.model_name, "object": "model", "created": self.created, "owned_by": "strata",
            "max_context": self.engine.max_context}]})

    async def health(self, request: Request) -> Response:
        w = self.worker
        status = "shutting down" if w.draining else ("down" if w.broken else "ok")
        return JSONResponse({"status": status, "model": self.engine.model_name, "queue_length": w.queue_length,
                             "running": w.busy, **({"reason": w.broken} if w.broken else {})},
                            status_code=200 if status == "ok" else 503)

    async def prometheus(self, request: Request) -> Response:
        stats = getattr(self.engine, "prefix_cache_stats", None)  # optional, like metrics_text
        w = self.worker
        text = self.metrics.render(w.queue_length, w.busy, w.running_sequences,
                                   stats() if callable(stats) else None)
        extra = getattr(self.engine, "metrics_text", None)  # optional: an engine's own series (busy histogram)
        if callable(extra):
            text += extra()
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        self.worker.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            # uvicorn calls this once every connection has finished: the running job is done
            await run_in_threadpool(self.worker.stop)


def _errors(request: Request, exc: Exception) -> Response:
    if isinstance(exc, RequestError):
        return exc.response()
    assert isinstance(exc, HTTPException)
    return RequestError(exc.status_code, str(exc.detail), type="not_found" if exc.status_code == 404
                        else "invalid_request_error").response(exc.headers)


def create_app(engine: Engine, api_key: str | None = None, queue_size: int = DEFAULT_QUEUE,
               max_body: int | None = None) -> Starlette:
    """The ASGI app; `app.state.server` holds the Server (its worker starts with the app's lifespan)."""
    s = Server(engine, queue_size, max_body)
    app = Starlette(routes=[
        Route("/v1/completions", s.completions, methods=["POST"]),
        Route("/v1/chat/completions", s.chat_completions, methods=["POST"]),
        Route("/v1/models", s.models, methods=["GET"]),
        Route("/health", s.health, methods=["GET"]),
        Route("/metrics", s.prometheus, methods=["GET"]),
    ], lifespan=s.lifespan, exception_handlers={RequestError: _errors, HTTPException: _errors})
    app.state.server = s
    app.add_middleware(_Middleware, metrics=s.metrics, api_key=api_key)
    return app


class _Uvicorn(uvicorn.Server):
    """uvicorn's Server, whose SIGTERM / SIGINT also turns away the requests still waiting for the engine."""

    def __init__(self, config: uvicorn.Config, app_server: Server):
        super().__init__(config)
        self.app_server = app_server

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        loop = self.app_server.worker.loop
        if loop is not None:  # maybe inside a signal handler: let the loop do the work
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self.app_server.worker.begin_shutdown)


def make_uvicorn(engine: Engine, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, api_key: str | None = None,
                 queue_size: int = DEFAULT_QUEUE, log_level: str = "info", **app_kw) -> tuple[_Uvicorn, Starlette]:
    """(uvicorn server, ASGI app), not started: `server.run()` (or `server.run(sockets=[sock])`) serves."""
    app = create_app(engine, api_key=api_key, queue_size=queue_size, **app_kw)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on")
    return _Uvicorn(config, app.state.server), app


def serve(engine: Engine, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, api_key: str | None = None,
          queue_size: int = DEFAULT_QUEUE, log_level: str = "info", sock: socket.socket | None = None,
          max_body: int | None = None) -> None:
    """Serve until SIGTERM / SIGINT: then take no new requests, finish the running one, answer the waiting
    ones 503, close the engine and return (uvicorn then re-raises the signal for the usual exit status).
    max_body: the request body limit in bytes (None: default_max_body of the engine's context)."""
    server, app = make_uvicorn(engine, host, port, api_key, queue_size, log_level, max_body=max_body)
    try:
        server.run(sockets=[sock] if sock is not None else None)
    finally:
        app.state.server.worker.stop()  # a no-op after the lifespan's shutdown; closes the engine otherwise


def run_server(cfg, engine_factory: Callable[[Any], Engine] | None = None, host: str = DEFAULT_HOST,
               port: int = DEFAULT_PORT, api_key: str | None = None, queue_size: int | None = None,
               log_level: str = "info") -> int:
    """`launcher.py --serve`: load the engine once from the rig config (engine_factory(cfg); default: the
    whole model in this process, strata.serve.engine.local_engine), serve it, return the exit status. queue_size:
    the waiting requests (default: the rig's server_queue)."""
    if engine_factory is None:
        from strata.serve.engine import local_engine as engine_factory
    engine = engine_factory(cfg)
    log.info("serving %s on http://%s:%d", engine.model_name, host, port)
    if queue_size is None:
        queue_size = getattr(cfg, "server_queue", DEFAULT_QUEUE)
    serve(engine, host=host, port=port, api_key=api_key, queue_size=queue_size, log_level=log_level,
          max_body=getattr(cfg, "server_max_body_bytes", None))
    return 0
