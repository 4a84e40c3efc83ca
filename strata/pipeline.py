"""The head's side of a run: spawn one process per stage, feed chunks, collect results, tear down.

    with strata.Pipeline(config) as p:
        result = p.prefill("some long text")   # or token ids; None = the rig's prompt

`prefill` has a guard on every return path (normal, exception, Ctrl-C) that calls `finish()`:
the head never returns while chunks are in flight. Everything the run creates (processes,
sockets, the ipc directory, shared memory) is released by `close()`, reached through
`weakref.finalize` too, however the run ends.
"""
from __future__ import annotations

import math
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import time
import weakref
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from . import messages as M
from .config import ConfigError, PromptSpec, RigConfig, from_dict
from .plan import Plan, build_plan
from .planner import DTYPE_BYTES

PAGE = 4096


class PipelineError(RuntimeError):
    """A run that failed: names the stage (index, device, pid), the chunk and the cause."""


@dataclass
class StageInfo:
    index: int
    device: str
    layers: tuple[int, int]
    pid: int = 0
    mem_bytes: int = 0
    kv_bytes: int = 0
    pinned: bool = False
    load_s: float = 0.0
    chunk: int = -1            # the chunk it last started
    stats: dict = field(default_factory=dict)


@dataclass
class Result:
    report: dict
    continuation_ids: list[int]
    continuation: str | None
    perplexity: float | None
    last_logits: np.ndarray


def _page(n: int) -> int:
    return max(PAGE, (n + PAGE - 1) // PAGE * PAGE)


class _Resources:
    """Everything that must be released: kept apart from Pipeline so the finalizer holds no cycle."""

    def __init__(self):
        self.procs: list = []
        self.conns: list = []
        self.segments: list = []
        self.socks: list = []
        self.ctx = None
        self.ipc_dir: str | None = None

    def release(self, grace_s: float = 5.0) -> None:
        # ask (stop message, sent by the caller), wait, terminate, kill
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join(2.0)
        for c in self.conns:
            c.close()
        for s in self.socks:
            if not s.closed:
                s.close(linger=0)
        if self.ctx is not None:
            self.ctx.term()
        for seg in self.segments:
            seg.unlink()
            seg.close()
        if self.ipc_dir:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
        self.procs, self.conns, self.segments, self.socks, self.ctx, self.ipc_dir = [], [], [], [], None, None


class Pipeline:
    def __init__(self, config: RigConfig | dict, out: str | os.PathLike | None = None, console: bool = True):
        self.cfg = config if isinstance(config, RigConfig) else from_dict(config)
        self.plan: Plan = build_plan(self.cfg)
        self.out = Path(out or self.cfg.out or Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
        self.console = console
        self.run_id = f"{os.getpid():x}{int(time.time() * 1000) % 0xFFFFFF:x}"
        self._res = _Resources()
        self._finalizer = weakref.finalize(self, self._res.release, 1.0)
        self.stages = [StageInfo(s.index, s.device, (s.start, s.end)) for s in self.plan.stages]
        self.started = False
        self.failure: PipelineError | None = None
        self._sent = self._got = 0
        self._results: dict[int, dict] = {}
        self._last_logits = None

    # -- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        """Spawn the stages and wait until each has loaded its slice and mapped its buffers."""
        if self.started:
            return
        import zmq

        from . import shm
        from workers.stage import run_stage_process

        plan, cfg = self.plan, self.cfg
        shm.sweep_dead()
        n = len(plan.stages)
        b = DTYPE_BYTES[cfg.dtype]
        sizes = {"ids": _page((plan.max_len + 1) * 4), "result": _page(plan.args.vocab_size * 4)}
        for i in range(n - 1):
            sizes[f"b{i}"] = _page(plan.handoff_bytes())
        shm.check_room(sum(sizes.values()))
        self.out.mkdir(parents=True, exist_ok=True)
        res = self._res
        res.ipc_dir = tempfile.mkdtemp(prefix="strata-")  # mode 0700: only this user reaches the sockets
        segs = {}
        for what, nbytes in sizes.items():
            seg = shm.Segment.create(shm.segment_name(self.run_id, what), nbytes)
            res.segments.append(seg)
            segs[what] = (seg.name, nbytes)
        self._ids = res.segments[0].tensor(__import__("torch").int32, (plan.max_len + 1,))
        self._result_buf = res.segments[1].tensor(__import__("torch").float32, (plan.args.vocab_size,))
        self._write_ids(plan.ids)

        res.ctx = zmq.Context()
        self._pull = res.ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.MAXMSGSIZE, M.MAX_FRAME)
        res.socks.append(self._pull)
        head_ep = f"ipc://{res.ipc_dir}/head"
        self._pull.bind(head_ep)
        endpoints = [f"ipc://{res.ipc_dir}/s{i}" for i in range(n)]
        self._push = []
        for ep in endpoints:
            s = res.ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(ep)
            res.socks.append(s)
            self._push.append(s)

        ctx = mp.get_context("spawn")  # not fork: CUDA cannot survive a fork
        args_dict = {f: getattr(plan.args, f) for f in plan.args.__dataclass_fields__}
        for sp in plan.stages:
            spec = dict(index=sp.index, n_stages=n, device=sp.device, dtype=cfg.dtype, threads=sp.threads,
                        cores=list(sp.cores), start=sp.start, end=sp.end, model=cfg.model, args=args_dict,
                        seed=cfg.seed, max_len=plan.max_len, tokens=plan.tokens, max_chunk=plan.max_chunk,
                        depth=cfg.depth, perplexity=cfg.perplexity, segments=segs, endpoints=endpoints,
                        head_endpoint=head_ep, log_file=str(self.out / f"stage-{sp.index}.log"),
                        console=self.console,
                        dump_residual=str(self.out / "residual.npy") if cfg.dump_residual else "",
                        debug={f: getattr(cfg.debug, f) for f in cfg.debug.__dataclass_fields__})
            parent_end, child_end = ctx.Pipe(duplex=False)  # EOF on child_end's peer = head gone
            proc = ctx.Process(target=run_stage_process, args=(spec, parent_end), name=f"strata-stage-{sp.index}",
                               daemon=True)
            proc.start()
            parent_end.close()
            res.procs.append(proc)
            res.conns.append(child_end)
            self.stages[sp.index].pid = proc.pid
        self.started = True
        ready: set[int] = set()
        deadline = time.monotonic() + cfg.ready_timeout_s
        while len(ready) < n:
            if time.monotonic() > deadline:
                missing = [self._who(i) for i in range(n) if i not in ready]
                self._fail(f"stage(s) not ready within {cfg.ready_timeout_s:.0f}s: {', '.join(missing)}")
            for msg in self._recv(200):
                if msg["t"] == "ready":
                    st = self.stages[msg["stage"]]
                    st.mem_bytes, st.kv_bytes, st.pinned, st.load_s = (msg["mem_bytes"], msg["kv_bytes"],
                                                                      msg["pinned"], msg["load_s"])
                    ready.add(msg["stage"])
        # every stage has mapped its buffers: unlink now, so even SIGKILL leaks nothing
        for seg in res.segments:
            seg.unlink()

    def close(self) -> None:
        """Stop every stage and release everything; idempotent."""
        if self._res.procs:
            for s in getattr(self, "_push", []):
                try:
                    s.send(M.encode("stop"), flags=__import__("zmq").NOBLOCK)
                except Exception:  # noqa: BLE001 - a dead peer cannot be told
                    pass
        self._finalizer()

    # -- messages ----------------------------------------------------------------------------
    def _who(self, i: int) -> str:
        st = self.stages[i]
        return f"stage {i} ({st.device}, pid {st.pid}, chunk {st.chunk})"

    def _fail(self, why: str) -> None:
        self.failure = self.failure or PipelineError(why)
        raise self.failure

    def _recv(self, timeout_ms: int) -> list[dict]:
        """Messages that arrive within timeout_ms; a dead stage or a typed failure raises."""
        import zmq
        if self.failure:
            raise self.failure
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        for p in self._res.procs:
            poller.register(p.sentinel, zmq.POLLIN)
        events = dict(poller.poll(timeout_ms))
        out = []
        while True:
            try:
                frame = self._pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                msg = M.decode(frame)
            except M.BadMessage:
                continue  # not ours; never acted on
            if msg["t"] == "fail":
                st = self.stages[msg["stage"]]
                st.chunk = msg["chunk"] if msg["chunk"] >= 0 else st.chunk
                self._fail(f"{self._who(msg['stage'])} failed: {msg['error']}: {msg['message']}")
            if msg["t"] == "working":
                self.stages[msg["stage"]].chunk = msg["k"]
            out.append(msg)
        for i, p in enumerate(self._res.procs):
            if p.sentinel in events or not p.is_alive():
                p.join(0.1)
                if p.exitcode is None:
                    continue
                # a typed failure may still be in flight: give it a moment to arrive
                self._drain_for_failure(500)
                code = p.exitcode
                how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
                self._fail(f"{self._who(i)} {how}")
        return out

    def _drain_for_failure(self, ms: int) -> None:
        import zmq
        if self._pull.poll(ms, zmq.POLLIN):
            while True:
                try:
                    msg = M.decode(self._pull.recv(zmq.NOBLOCK))
                except zmq.Again:
                    return
                except M.BadMessage:
                    continue
                if msg["t"] == "fail":
                    self.stages[msg["stage"]].chunk = msg["chunk"]
                    self._fail(f"{self._who(msg['stage'])} failed: {msg['error']}: {msg['message']}")

    def _send(self, i: int, type_: str, **fields) -> None:
        self._push[i].send(M.encode(type_, **fields))

    def _broadcast(self, type_: str, **fields) -> None:
        for i in range(len(self._push)):
            self._send(i, type_, **fields)

    def _write_ids(self, ids: np.ndarray) -> None:
        import torch
        self._ids[: ids.size] = torch.from_numpy(ids.astype(np.int32))

    # -- the run -----------------------------------------------------------------------------
    def _handle(self, msg: dict) -> None:
        if msg["t"] == "result":
            self._results[msg["k"]] = msg
            self._last_logits = self._result_buf.numpy().copy()
            self._send(len(self.stages) - 1, "taken", k=msg["k"])
            self._got += 1
            self._on_result(msg)
        elif msg["t"] == "stats":
            self.stages[msg["stage"]].stats[msg["phase"]] = msg

    def _on_result(self, msg):
        pass

    def finish(self) -> None:
        """Wait until every chunk sent has come out of the last stage, or a failure is known.

        Public and idempotent: a caller may join the pipeline early; the prefill guard calls it."""
        deadline = time.monotonic() + self.cfg.stall_timeout_s
        progress = self._got
        while self._got < self._sent and not self.failure:
            for msg in self._recv(200):
                self._handle(msg)
            if self._got != progress:
                progress, deadline = self._got, time.monotonic() + self.cfg.stall_timeout_s
            elif time.monotonic() > deadline:
                self._stalled()
        if self.failure:
            raise self.failure

    def _stalled(self) -> None:
        # dump every stage's stacks into its log, then fail naming where each one was
        for p in self._res.procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGUSR1)
        time.sleep(0.5)
        where = ", ".join(self._who(i) for i in range(len(self.stages)))
        self._fail(f"no progress for {self.cfg.stall_timeout_s:.0f}s (stacks dumped to the stage logs): {where}")

    def _run_phase(self, phase: str, schedule, on_progress=None) -> float:
        """Feed `schedule` [(pos, n)] to stage 0 through a bounded window, with the finish guard."""
        n = len(self.stages)
        self._results.clear()
        self._sent = self._got = 0
        t0 = time.perf_counter()
        self._broadcast("begin", phase=phase, t0=t0)
        window = n + 1  # enough to keep stage 0 busy; bounds what Ctrl-C must wait for
        try:
            deadline = time.monotonic() + self.cfg.stall_timeout_s
            while self._got < len(schedule):
                while self._sent < len(schedule) and self._sent - self._got < window:
                    pos, m = schedule[self._sent]
                    self._send(0, "chunk", k=self._sent, pos=pos, n=m, phase=phase)
                    self._sent += 1
                before = self._got
                for msg in self._recv(100):
                    self._handle(msg)
                if on_progress:
                    on_progress()
                if self._got != before:
                    deadline = time.monotonic() + self.cfg.stall_timeout_s
                elif time.monotonic() > deadline:
                    self._stalled()
        finally:
            # the guard: never leave with chunks in flight; a known failure returns at once
            if not self.failure:
                try:
                    self.finish()
                except KeyboardInterrupt:
                    self._fail("interrupted while joining chunks in flight")
        seconds = time.perf_counter() - t0
        self._broadcast("end", phase=phase)
        deadline = time.monotonic() + self.cfg.stall_timeout_s
        while any(phase not in st.stats for st in self.stages):
            if time.monotonic() > deadline:
                self._stalled()
            for msg in self._recv(100):
                self._handle(msg)
        return seconds

    def prefill(self, prompt: str | list[int] | np.ndarray | None = None) -> Result:
        """Prefill the prompt (None: the rig's), then the greedy continuation. Returns the report."""
        from .report import build_report
        if prompt is not None:
            self._replan(prompt)
        self.start()
        plan = self.plan
        update, bar = self._progress_bar(plan.tokens)
        try:
            seconds = self._run_phase("prefill", plan.schedule, update)
        finally:
            if bar:
                bar.close()
        nll = sum(r["nll"] for r in self._results.values())
        count = sum(r["count"] for r in self._results.values())
        last_logits = self._last_logits
        cont = self._generate(int(self._results[len(plan.schedule) - 1]["argmax"])) if self.cfg.generate else []
        text = None
        if cont:
            try:
                from .tokenizer import Tokenizer
                text = Tokenizer.for_model(self.cfg.model).decode(cont)
            except Exception:  # noqa: BLE001 - synthetic models have no tokenizer
                text = None
        ppl = math.exp(nll / count) if count else None
        report = build_report(self, seconds, ppl, cont, text)
        return Result(report, cont, text, ppl, last_logits)

    def _generate(self, first: int) -> list[int]:
        eos = self.plan.args.eos_id
        out, tok, pos = [], first, self.plan.tokens
        for _ in range(self.cfg.generate):
            out.append(tok)
            if tok == eos or pos >= self.plan.max_len:
                break
            self._ids[pos] = tok
            self._run_phase("decode", [(pos, 1)])
            tok = int(self._results[0]["argmax"])
            pos += 1
        return out

    def _replan(self, prompt) -> None:
        if isinstance(prompt, str):
            spec = PromptSpec(text=prompt)
        else:
            ids = np.asarray(prompt, dtype=np.int64).reshape(-1)
            spec = None
        if self.started:
            raise ConfigError("prefill(prompt): give the prompt before the first prefill (buffers are sized for it)")
        if spec is not None:
            self.cfg = replace(self.cfg, prompt=spec)
            self.plan = build_plan(self.cfg)
        else:
            if ids.size == 0:
                raise ConfigError("prompt: empty")
            if ids.min() < 0 or ids.max() >= self.plan.args.vocab_size:
                raise ConfigError(f"prompt: ids must be in [0, {self.plan.args.vocab_size})")
            tmp = self.out / "prompt_ids.txt"
            self.out.mkdir(parents=True, exist_ok=True)
            tmp.write_text(" ".join(map(str, ids.tolist())))
            self.cfg = replace(self.cfg, prompt=PromptSpec(ids_file=str(tmp)))
            self.plan = build_plan(self.cfg)
        self.stages = [StageInfo(s.index, s.device, (s.start, s.end)) for s in self.plan.stages]

    def _progress_bar(self, total: int):
        if not (self.cfg.progress and self.console):
            return None, None
        from tqdm import tqdm
        bar = tqdm(total=total, unit="tok", unit_scale=True, desc="prefill", leave=False, dynamic_ncols=True)
        done = [0]
        schedule = self.plan.schedule

        def update():  # tokens through the last stage; which chunk each stage is on
            tokens = sum(schedule[k][1] for k in self._results)
            if tokens != done[0]:
                bar.update(tokens - done[0])
                done[0] = tokens
            bar.set_postfix_str(" ".join(f"s{s.index}:c{max(s.chunk, 0)}" for s in self.stages), refresh=False)
        return update, bar
