"""The head's side of a run: spawn one process per stage, feed chunks, collect results, tear down.

    with strata.Pipeline(config) as p:
        result = p.prefill("some long text")   # or token ids; None = the rig's prompt

`prefill` has a guard on every return path (normal, exception, Ctrl-C) that calls `finish()`:
the head never returns while chunks are in flight. Everything the run creates (processes,
sockets, the ipc directory, shared memory) is released by `close()`, reached through
`weakref.finalize` too, however the run ends.

Stages on other hosts (`stages[i].host`): the head also listens on tcp (`listen`) with CurveZMQ,
starts each remote stage through `remote_command` (or prints the command), serves its join and
watches it by heartbeats as well as by its launcher process (strata/net.py); boundaries that cross
hosts carry their rows over tcp (strata/transport.py).
"""
from __future__ import annotations

import logging
import math
import multiprocessing as mp
import os
import signal
import time
import weakref
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from . import messages as M
from .checkpoint import check_model_files
from .config import PromptSpec, RigConfig, check_run_dir, from_dict
from .errors import ConfigError, PipelineError
from .head_wire import HeadWire, poll_until
from .plan import Plan, build_plan
from .stage_procs import Buffers, Resources, spawn_local, sweep_dead_ipc_dirs

log = logging.getLogger("strata.pipeline")


class Interrupted(BaseException):
    """SIGINT / SIGTERM to the head, raised at a safe point of the head's loop (see `interrupt`)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclass
class StageInfo:
    index: int
    device: str
    layers: tuple[int, int]
    host: str | None = None    # None: this machine
    pid: int = 0
    mem_bytes: int = 0
    kv_bytes: int = 0
    weight_bytes: int = 0
    scratch_bytes: int = 0
    weights: str = ""
    warm_s: float = 0.0
    pinned: bool = False
    load_s: float = 0.0
    chunk: int = -1            # the chunk it last said it started, this phase ("working"; a typed failure's)
    stats: dict = field(default_factory=dict)


@dataclass
class Result:
    report: dict
    continuation_ids: list[int]
    continuation: str | None
    perplexity: float | None
    last_logits: np.ndarray


class Pipeline:
    def __init__(self, config: RigConfig | dict, out: str | os.PathLike | None = None, console: bool = True):
        self.cfg = config if isinstance(config, RigConfig) else from_dict(config)
        self.plan: Plan = build_plan(self.cfg)
        check_model_files(self.cfg.model)
        self.out = Path(out or self.cfg.out or Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
        check_run_dir(self.out)
        self.console = console
        self.run_id = f"{os.getpid():x}{int(time.time() * 1000) % 0xFFFFFF:x}"
        self._res = Resources()
        self._finalizer = weakref.finalize(self, self._res.release, 1.0)
        self.stages = [StageInfo(s.index, s.device, (s.start, s.end), s.host) for s in self.plan.stages]
        self.started = False
        self.closed = False
        self.failure: PipelineError | None = None
        self._signals: list[int] = []  # filled by `interrupt` (signal handlers), read at safe points
        self._signals_seen = 0
        self._sent = self._got = 0     # chunks of the current phase sent to stage 0 / back from the last
        self._results: dict[int, M.ChunkResult] = {}
        self._last_logits = None
        self._ready: set[int] = set()
        self._wire: HeadWire | None = None
        self._remote = None            # strata.remote.RemoteStages when a stage is remote
        self.boundaries: list[str] = []            # per boundary: "shm" or "tcp"

    # -- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        """Spawn the stages and wait until each has loaded its slice and mapped its buffers."""
        self._refuse_if_closed()
        if self.started:
            return
        sweep_dead_ipc_dirs()
        remote = [sp.host is not None for sp in self.plan.stages]
        across = [remote[i] or remote[i + 1] for i in range(len(remote) - 1)]  # boundary i leaves this host
        self.boundaries = ["tcp" if a else "shm" for a in across]
        self._buffers = Buffers(self._res, self.run_id, self.plan, remote, across)
        self._buffers.ids[: self.plan.ids.size] = torch.from_numpy(self.plan.ids.astype(np.int32))
        self.out.mkdir(parents=True, exist_ok=True)
        self._res.make_ipc_dir()
        self._wire = HeadWire(self._res, len(remote))
        if any(remote):
            from .remote import RemoteStages
            self._remote = RemoteStages(self._res, self.cfg, self.plan, remote, across)
        self._wire.connect(self._remote)
        self._wire.handlers = {M.Ready: self._on_ready, M.Bound: self._on_bound, M.Working: self._on_working,
                               M.ChunkResult: self._on_result, M.Stats: self._on_stats, M.Fail: self._on_fail,
                               M.Rejected: self._on_rejected}
        self._result_row = self._result_buffer(remote[-1])
        for sp in self.plan.stages:
            self.stages[sp.index].pid = self._launch(sp, self._spec(sp))
        self.started = True
        self._wait_ready()
        if self._remote:
            self._link_remote()
        for seg in self._res.segments:  # every stage has mapped its buffers: unlink now, so even SIGKILL leaks nothing
            seg.unlink()

    def _result_buffer(self, remote_last: bool) -> torch.Tensor:
        """The last stage's logits row: a shared segment, or (a remote last stage) a buffer its rows land in."""
        if not remote_last:
            return self._buffers.result
        from .transport import TcpLink
        link = TcpLink(torch.float32, (self.plan.args.vocab_size,))
        self._wire.land_result = lambda frame: link.land(link.buf.numel(), frame)
        return link.buf

    def _spec(self, sp) -> M.StageJob:
        """What stage sp needs to build and serve its slice (validated again by a remote stage on arrival)."""
        plan, cfg, w = self.plan, self.cfg, self._wire
        return M.StageJob(
            index=sp.index, n_stages=len(plan.stages), device=sp.device, dtype=cfg.dtype, attention=cfg.attention,
            weights=cfg.weights, kv_dtype=cfg.kv_dtype, memory=sp.memory, threads=sp.threads, cores=list(sp.cores), start=sp.start,
            end=sp.end, model=cfg.model, args={f: getattr(plan.args, f) for f in plan.args.__dataclass_fields__},
            seed=cfg.seed, max_len=plan.max_len, tokens=plan.tokens, max_chunk=plan.max_chunk, depth=cfg.depth,
            perplexity=cfg.perplexity, segments=self._buffers.names, endpoints=w.endpoints, head_endpoint=w.endpoint,
            log_file=str(self.out / f"stage-{sp.index}.log"), console=self.console,
            dump_residual=str(self.out / "residual.npy") if cfg.dump_residual else "",
            debug={f: getattr(cfg.debug, f) for f in cfg.debug.__dataclass_fields__},
            net=self._remote.stage_net(sp.index) if self._remote else None)

    def _launch(self, sp, spec: M.StageJob) -> int:
        if sp.host is None:
            return spawn_local(self._res, spec, sp.index)
        try:
            proc = self._remote.launch(sp, spec, self.out)
        except PipelineError as e:
            self._fail(str(e))
        self._res.procs.append(proc)
        return proc.pid

    def _wait_ready(self) -> None:
        if self._remote:
            self._remote.net.start()  # joins are served from here on
        n = len(self.stages)
        poll_until(lambda: len(self._ready) == n, self.cfg.ready_timeout_s, step=lambda: self._receive(200),
                   what=lambda: self._fail(f"stage(s) not ready within {self.cfg.ready_timeout_s:.0f}s: "
                                           + ", ".join(self._who(i) for i in range(n) if i not in self._ready)))

    def _link_remote(self) -> None:
        """Tell each stage with a neighbour across hosts where it listens; write net.json."""
        try:
            peers = self._remote.peers()
        except LookupError as e:
            self._fail(f"{self._who(e.args[0])} is ready but never said where it listens")
        for i, p in peers.items():
            self._wire.send(i, M.Peers(**p))
        self._remote.write_net_json(self.out / "net.json", self.boundaries)

    @property
    def bad_frames(self) -> int:
        """Frames the head rejected (garbled, unknown, out of range)."""
        return self._wire.bad_frames if self._wire else 0

    @property
    def rejected_connections(self) -> int:
        """Handshakes refused on this run's tcp sockets (no key, a wrong key): the head's and the stages'."""
        return self._remote.rejected_connections if self._remote else 0

    def _refuse_if_closed(self) -> None:
        if self.closed:
            raise PipelineError("this pipeline is closed (its stages have stopped): make a new Pipeline")

    def close(self) -> None:
        """Stop every stage and release everything; idempotent."""
        self.closed = True
        if self._res.procs and self._wire is not None:
            self._wire.stop_all()
        self._finalizer()

    def interrupt(self, signum: int) -> None:
        """Ask the head to stop (safe from a signal handler: it only records the signal). The head
        raises `Interrupted` at its next safe point, within ~0.2 s, then joins chunks in flight."""
        self._signals.append(signum)

    def _check_interrupt(self) -> None:
        if len(self._signals) > self._signals_seen:
            self._signals_seen = len(self._signals)
            raise Interrupted(self._signals[-1])

    # -- who is where --------------------------------------------------------------------------
    def _chunk_of(self, i: int) -> int:
        """The chunk stage i is on, by what the head knows itself as well as by the stage's notes: chunks
        leave the pipeline in order, so every stage has started the oldest chunk the head sent and has not
        got back (or waits for it). A note lost with a killed stage cannot make the head name an older one."""
        oldest_in_flight = self._got if self._got < self._sent else -1
        return max(self.stages[i].chunk, oldest_in_flight)

    def _who(self, i: int) -> str:
        st = self.stages[i]
        where = f"{st.device} on {st.host}" if st.host else st.device
        return f"stage {i} ({where}, pid {st.pid}, chunk {self._chunk_of(i)})"

    def where(self) -> str:
        """Every stage with its device, pid and the chunk it is on."""
        return ", ".join(self._who(i) for i in range(len(self.stages)))

    def _fail(self, why: str) -> None:
        self.failure = self.failure or PipelineError(why)
        raise self.failure

    # -- receiving -----------------------------------------------------------------------------
    def _receive(self, timeout_ms: int) -> None:
        """Handle what arrives within timeout_ms; a dead stage, a silent remote one or a typed failure raises."""
        if self.failure:
            raise self.failure
        self._check_interrupt()  # only here: never between receiving a message and handling it
        procs = self._res.procs
        fired = self._wire.poll(timeout_ms, [p.sentinel for p in procs if p.sentinel is not None])
        self._wire.take_all()
        for i, p in enumerate(procs):  # a stage started by hand has no sentinel: heartbeats watch it
            if (p.sentinel is not None and p.sentinel in fired) or not p.is_alive():
                p.join(0.1)
                if p.exitcode is None:
                    continue
                self._wire.drain(500, only=(M.Fail, M.Working))  # its typed failure may still be in flight
                code = p.exitcode
                how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
                self._fail(f"{self._who(i)} {how}")
        if self._remote is not None:
            pids: dict[int, int] = {}
            problem = self._remote.problem(pids)
            for i, pid in pids.items():
                self.stages[i].pid = pid
            if problem:
                i, why = problem
                self._fail(why if i is None else f"{self._who(i)} {why}")

    # -- the head's handlers: one per message type it accepts ------------------------------------
    def _on_ready(self, msg: M.Ready, data) -> None:
        st = self.stages[msg.stage]
        st.mem_bytes, st.kv_bytes, st.pinned, st.load_s = msg.mem_bytes, msg.kv_bytes, msg.pinned, msg.load_s
        st.weights, st.weight_bytes, st.scratch_bytes = msg.weights, msg.weight_bytes, msg.scratch_bytes
        st.warm_s = msg.warm_s
        self._ready.add(msg.stage)

    def _on_bound(self, msg: M.Bound, data) -> None:
        self._remote.on_bound(msg.stage, msg.endpoint, self._wire.push[msg.stage])

    def _on_working(self, msg: M.Working, data) -> None:
        self.stages[msg.stage].chunk = msg.k

    def _on_result(self, msg: M.ChunkResult, data) -> None:
        k = msg.k
        if not (0 <= k < self._sent and k not in self._results):
            raise M.BadMessage(f"result: chunk {k} is not in flight")
        if data is not None:
            self._wire.land_result(data)
        self._results[k] = msg
        self._last_logits = self._result_row.numpy().copy()
        self._wire.send(len(self.stages) - 1, M.Taken(k=k))
        self._got += 1

    def _on_stats(self, msg: M.Stats, data) -> None:
        self.stages[msg.stage].stats[msg.phase] = msg

    def _on_fail(self, msg: M.Fail, data) -> None:
        st = self.stages[msg.stage]
        st.chunk = msg.chunk if msg.chunk >= 0 else st.chunk
        self._fail(f"{self._who(msg.stage)} failed: {msg.error}: {msg.message}")

    def _on_rejected(self, msg: M.Rejected, data) -> None:
        self._remote.on_rejected(msg.stage, msg.count, msg.detail)

    # -- the run -----------------------------------------------------------------------------
    def finish(self) -> None:
        """Wait until every chunk sent has come out of the last stage, or a failure is known.

        Public and idempotent: a caller may join the pipeline early; the prefill guard calls it."""
        if self._wire is not None:
            poll_until(lambda: self._got >= self._sent or self.failure is not None, self.cfg.stall_timeout_s,
                       what=self._stalled, step=lambda: self._receive(200), progress=lambda: self._got)
        if self.failure:
            raise self.failure

    def _stalled(self) -> None:
        # dump every stage's stacks into its log, then fail naming where each one was
        for p in self._res.procs:
            if p.is_alive() and isinstance(p, mp.process.BaseProcess):  # not a remote stage's ssh
                os.kill(p.pid, signal.SIGUSR1)
        time.sleep(0.5)
        self._fail(f"no progress for {self.cfg.stall_timeout_s:.0f}s (stacks dumped to the stage logs): "
                   f"{self.where()}")

    def _run_phase(self, phase: str, schedule, on_progress=None) -> float:
        """Feed `schedule` [(pos, n)] to stage 0 through a bounded window, with the finish guard."""
        n = len(self.stages)
        self._results.clear()
        self._sent = self._got = 0
        for st in self.stages:  # a second prefill must wait for fresh timing, not find the last one's
            st.stats.pop(phase, None)
            st.chunk = -1       # notes of the last phase name none of this phase's chunks
        t0 = time.perf_counter()
        window = n + 1  # enough to keep stage 0 busy; bounds what Ctrl-C must wait for

        def step():
            while self._sent < len(schedule) and self._sent - self._got < window:
                pos, m = schedule[self._sent]
                self._wire.send(0, M.Chunk(k=self._sent, pos=pos, n=m, phase=phase, t0=t0))
                self._sent += 1
            self._receive(100)
            if on_progress:
                on_progress()
        try:
            poll_until(lambda: self._got >= len(schedule), self.cfg.stall_timeout_s, what=self._stalled, step=step,
                       progress=lambda: self._got)
        finally:
            # the guard: never leave with chunks in flight; a known failure returns at once
            # (a second SIGINT/SIGTERM through `interrupt` raises Interrupted here and abandons the join)
            if not self.failure:
                try:
                    self.finish()
                except KeyboardInterrupt:
                    self._fail("interrupted while joining chunks in flight")
        seconds = time.perf_counter() - t0
        if phase != "prefill":  # only the prefill's timing is reported; a decode step needs no round trip
            return seconds
        self._wire.broadcast(M.End(phase=phase))
        poll_until(lambda: all(phase in st.stats for st in self.stages), self.cfg.stall_timeout_s,
                   what=self._stalled, step=lambda: self._receive(100))
        return seconds

    def prefill(self, prompt: str | list[int] | np.ndarray | None = None) -> Result:
        """Prefill the prompt (None: the rig's), then the greedy continuation. Returns the report."""
        from .report import build_report
        self._refuse_if_closed()
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
        nll = sum(r.nll for r in self._results.values())
        count = sum(r.count for r in self._results.values())
        last_logits = self._last_logits
        cont = self._generate(self._results[len(plan.schedule) - 1].argmax) if self.cfg.generate else []
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
            self._buffers.ids[pos] = tok
            if self.stages[0].host is not None:  # stage 0 is remote: it has its own copy of the ids
                self._wire.send(0, M.Token(pos=pos, id=tok))
            self._run_phase("decode", [(pos, 1)])
            tok = self._results[0].argmax
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
        self.stages = [StageInfo(s.index, s.device, (s.start, s.end), s.host) for s in self.plan.stages]

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
