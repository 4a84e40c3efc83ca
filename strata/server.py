"""OpenAI-compatible HTTP server over an Engine: one generation at a time, a bounded queue, SSE streaming."""
from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import hmac
import json
import logging
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

import uvicorn
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from .engine import Engine, EngineError, GenerationStats
from .sampling import Detokenizer, SamplingParams, StopMatcher

log = logging.getLogger("strata.server")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_QUEUE = 8
DEFAULT_MAX_BODY = 64 << 20  # a long document as JSON, with room to spare
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

    def response(self, headers: dict | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


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

    def render(self, queue_length: int, running: bool) -> str:
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
            out += metric("engine_errors_total", "counter", "Generations that failed in the engine.",
                          [("", self.engine_errors)])
            out += metric("engine_restarts_total", "counter", "Engine restarts after a failure.",
                          [("", self.restarts)])
        return "\n".join(out) + "\n"


# -- the worker that owns the engine ----------------------------------------------------------------

@dataclass
class Job:
    """One generation request, handed from the event loop to the worker thread. The worker answers through
    `events` (on the loop): ('text', str), ('done', GenerationStats, finish_reason) or ('error', RequestError);
    ('cancelled',) arrives when the job is cancelled."""

    ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
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
    """A thread that owns the engine and runs one job at a time; up to `queue_size` jobs wait."""

    def __init__(self, engine: Engine, queue_size: int, metrics: Metrics):
        if queue_size < 0:
            raise ValueError(f"queue_size must be >= 0, got {queue_size}")
        self.engine, self.queue_size, self.metrics = engine, queue_size, metrics
        self._pending: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._running: Job | None = None
        self._draining = False
        self._stopping = False
        self.broken: str | None = None  # why the engine is down (a restart failed), else None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="strata-engine", daemon=True)
        self._closed = False

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._thread.start()

    @property
    def queue_length(self) -> int:
        with self._cond:
            return sum(not j.cancelled.is_set() for j in self._pending)

    @property
    def busy(self) -> bool:
        return self._running is not None

    @property
    def current(self) -> Job | None:
        """The job on the engine now (None when idle)."""
        return self._running

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
            if len(self._pending) >= self.queue_size + (self._running is None):
                raise RequestError(429, f"the queue is full ({self.queue_size} requests waiting); retry later",
                                   type="rate_limit_exceeded")
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
        if self._thread.is_alive():
            self._thread.join()
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
                job = self._running = self._pending.popleft()
            try:
                if not job.cancelled.is_set():
                    self._serve(job)
            except BaseException:  # never let the thread die with a client waiting
                log.exception("worker failed")
                job.emit(("error", RequestError(500, "internal error in the server's worker", type="server_error")))
            finally:
                with self._cond:
                    self._running = None

    def _serve(self, job: Job) -> None:
        if self.broken is not None:
            self._restart()
            if self.broken is not None:
                job.emit(("error", RequestError(503, f"the engine is down: {self.broken}", type="engine_error")))
                return
        detok = Detokenizer(self.engine.detokenize, context=job.ids)
        stop = StopMatcher(job.params.stop)
        first: list[float] = []

        def on_token(token: int) -> bool:
            if not first:
                first.append(time.perf_counter() - t0)
            if job.cancelled.is_set():
                return False
            piece = detok.add(token)
            text = stop.feed(piece) if piece else ""
            if text:
                job.emit(("text", text))
            return not stop.stopped

        t0 = time.perf_counter()
        try:
            stats = self.engine.generate(job.ids, job.params, on_token)
        except EngineError as e:
            with self.metrics.lock:
                self.metrics.engine_errors += 1
            log.error("engine failed: %s", e)
            job.emit(("error", RequestError(503, f"the engine failed: {e}", type="engine_error", stage=e.stage)))
            self._restart()
            return
        except Exception as e:
            with self.metrics.lock:
                self.metrics.engine_errors += 1
            log.exception("generation failed")
            job.emit(("error", RequestError(500, f"generation failed: {type(e).__name__}: {e}", type="server_error")))
            self._restart()
            return
        tail = stop.feed(detok.flush()) + stop.flush()
        if tail:
            job.emit(("text", tail))
        self.metrics.record(stats, first[0] if first else None)
        job.emit(("done", stats, "stop" if stop.stopped else stats.finish_reason))

    def _restart(self) -> None:
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

async def _json_body(request: Request, max_body: int) -> dict:
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > max_body:
        raise RequestError(413, f"the request body is {int(size)} bytes, over the limit of {max_body}")
    raw = await request.body()
    if len(raw) > max_body:
        raise RequestError(413, f"the request body is {len(raw)} bytes, over the limit of {max_body}")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise _bad(f"malformed JSON: {e}") from None
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    return body


def _unsupported(body: dict) -> None:
    """Refuse, rather than silently ignore, options that would change the answer."""
    checks = [("n", lambda v: v in (None, 1)), ("best_of", lambda v: v in (None, 1)),
              ("echo", lambda v: v in (None, False)), ("logprobs", lambda v: v in (None, False)),
              ("top_logprobs", lambda v: v is None), ("suffix", lambda v: v is None),
              ("logit_bias", lambda v: not v), ("tools", lambda v: not v),
              ("presence_penalty", lambda v: v in (None, 0)), ("frequency_penalty", lambda v: v in (None, 0))]
    for key, ok in checks:
        if key in body and not ok(body[key]):
            raise _bad(f"{key}={body[key]!r} is not supported by this server", param=key)


def _sampling(body: dict, max_tokens_keys: tuple[str, ...], default_max: int | None) -> tuple[SamplingParams, int | None]:
    """(params with max_tokens still to be fitted to the context, the requested max_tokens or None)."""
    requested = None
    for key in max_tokens_keys:
        if body.get(key) is not None:
            requested = body[key]
            break
    kw = {k: body[k] for k in ("temperature", "top_p", "top_k", "seed") if body.get(k) is not None}
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


def _usage(s: GenerationStats) -> dict:
    return {"prompt_tokens": s.prompt_tokens, "completion_tokens": s.completion_tokens,
            "total_tokens": s.prompt_tokens + s.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": s.reused_tokens}}


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

    def __init__(self, engine: Engine, queue_size: int = DEFAULT_QUEUE, max_body: int = DEFAULT_MAX_BODY):
        self.engine, self.max_body = engine, max_body
        self.metrics = Metrics()
        self.worker = Worker(engine, queue_size, self.metrics)
        self.created = int(time.time())

    # -- the two generation endpoints share everything but the prompt and the shapes
    async def completions(self, request: Request) -> Response:
        body = await _json_body(request, self.max_body)
        _unsupported(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise _bad("prompt must be a string (one prompt per request)", param="prompt")
        params, max_tokens = _sampling(body, ("max_tokens",), COMPLETIONS_MAX_TOKENS)
        return await self._generate(request, body, prompt, params, max_tokens, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        body = await _json_body(request, self.max_body)
        _unsupported(body)
        if "messages" not in body:
            raise _bad("messages is required", param="messages")
        params, max_tokens = _sampling(body, ("max_completion_tokens", "max_tokens"), None)
        try:
            prompt = await run_in_threadpool(self.engine.chat_prompt, body["messages"])
        except ValueError as e:  # strata.chat.ChatError, or a model without a template
            raise _bad(str(e), param="messages") from None
        return await self._generate(request, body, prompt, params, max_tokens, chat=True)

    async def _generate(self, request: Request, body: dict, prompt: str, params: SamplingParams,
                        max_tokens: int | None, chat: bool) -> Response:
        stream, include_usage = _stream_flags(body)
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise _bad("model must be a string", param="model")
        try:
            ids = await run_in_threadpool(self.engine.tokenize, prompt)
        except ValueError as e:  # e.g. strata's ModelError: a model without a tokenizer
            raise _bad(str(e), param="prompt") from None
        limit = self.engine.max_context
        if not ids:
            raise _bad("the prompt is empty", param="messages" if chat else "prompt")
        if len(ids) > limit:
            raise _bad(f"the prompt is {len(ids)} tokens, over the model's context of {limit} tokens "
                       "(max_context)", param="messages" if chat else "prompt")
        room = limit - len(ids)
        params = dataclasses.replace(params, max_tokens=room if max_tokens is None else min(max_tokens, room))
        job = Job(ids, params, asyncio.get_running_loop())
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
        pieces = []
        try:
            while True:
                ev = await job.events.get()
                if ev[0] == "text":
                    pieces.append(ev[1])
                elif ev[0] == "error":
                    return ev[1].response()
                elif ev[0] == "cancelled":
                    return Response(status_code=499)  # nobody reads it: the client has gone
                else:
                    stats, finish = ev[1], ev[2]
                    break
        finally:
            watcher.cancel()
            job.cancel()
        text = "".join(pieces)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}} if chat
                  else {"index": 0, "text": text})
        choice.update(logprobs=None, finish_reason=finish)
        return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                             "created": created, "model": model, "choices": [choice], "usage": _usage(stats)})

    async def _stream(self, job: Job, rid, created, model, chat, include_usage):
        def chunk(delta_or_text, finish=None) -> dict:
            c = ({"index": 0, "delta": delta_or_text} if chat else {"index": 0, "text": delta_or_text})
            c.update(logprobs=None, finish_reason=finish)
            out = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                   "created": created, "model": model, "choices": [c]}
            if include_usage:
                out["usage"] = None
            return out

        if chat:
            yield _sse(chunk({"role": "assistant", "content": ""}))
        while True:
            ev = await job.events.get()
            if ev[0] == "text":
                yield _sse(chunk({"content": ev[1]} if chat else ev[1]))
            elif ev[0] == "error":
                yield _sse(ev[1].body(), event="error")
                return
            elif ev[0] == "cancelled":
                return
            else:
                stats, finish = ev[1], ev[2]
                yield _sse(chunk({} if chat else "", finish))
                if include_usage:
                    last = chunk({} if chat else "")
                    last["choices"], last["usage"] = [], _usage(stats)
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
        text = self.metrics.render(self.worker.queue_length, self.worker.busy)
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
               max_body: int = DEFAULT_MAX_BODY) -> Starlette:
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
          queue_size: int = DEFAULT_QUEUE, log_level: str = "info", sock: socket.socket | None = None) -> None:
    """Serve until SIGTERM / SIGINT: then take no new requests, finish the running one, answer the waiting
    ones 503, close the engine and return (uvicorn then re-raises the signal for the usual exit status)."""
    server, app = make_uvicorn(engine, host, port, api_key, queue_size, log_level)
    try:
        server.run(sockets=[sock] if sock is not None else None)
    finally:
        app.state.server.worker.stop()  # a no-op after the lifespan's shutdown; closes the engine otherwise


def run_server(cfg, engine_factory: Callable[[Any], Engine] | None = None, host: str = DEFAULT_HOST,
               port: int = DEFAULT_PORT, api_key: str | None = None, queue_size: int = DEFAULT_QUEUE,
               log_level: str = "info") -> int:
    """`launcher.py --serve`: load the engine once from the rig config (engine_factory(cfg); default: the
    whole model in this process, strata.engine.local_engine), serve it, return the exit status."""
    if engine_factory is None:
        from .engine import local_engine as engine_factory
    engine = engine_factory(cfg)
    log.info("serving %s on http://%s:%d", engine.model_name, host, port)
    serve(engine, host=host, port=port, api_key=api_key, queue_size=queue_size, log_level=log_level)
    return 0
