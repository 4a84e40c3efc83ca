"""The head's side of a run: spawn one process per stage, feed chunks, collect results, tear down.

    with strata.Pipeline(config) as p:
        result = p.prefill("some long text")   # or token ids; None = the rig's prompt
        answer = p.generate("same long text, then a question?", SamplingParams(max_tokens=64))

Buffers and every stage's KV cache are sized once for `max_context`: any number of prompts up to it run on
the same stages, and the prefix a prompt shares with what the stages hold (the last prompt and its
answer) is not prefilled again.

`prefill` has a guard on every return path (normal, exception, Ctrl-C) that calls `finish()`:
the head never returns while chunks are in flight. Everything the run creates (processes,
sockets, the ipc directory, shared memory) is released by `close()`, reached through
`weakref.finalize` too, however the run ends.

Stages on other hosts (`stages[i].host`): the head also listens on tcp (`listen`) with CurveZMQ,
starts each remote stage through `remote_command` (or prints the command), serves its join and
watches it by heartbeats as well as by its launcher process (strata/remote.py over strata/head_net.py);
boundaries that cross hosts carry their rows over tcp (strata/transport.py).
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
from typing import Callable

import numpy as np
import torch

from . import bells
from . import kv_file
from . import messages as M
from . import prefix_cache
from .checkpoint import check_model_files
from .config import RigConfig, check_run_dir, from_dict
from .errors import ConfigError, PipelineError
from .head_wire import HEAD_SPIN_S, HeadWire, poll_until
from .plan import Plan, build_plan
from .schedule import cut_at, kept_state_cut
from .stage_procs import Buffers, Resources, spawn_local, start_method, sweep_dead_ipc_dirs

log = logging.getLogger("strata.pipeline")


class Interrupted(BaseException):
    """SIGINT / SIGTERM to the head, raised at a safe point of the head's loop (see `interrupt`)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


BELL_CHECK_S = 0.0005  # spinning on a decode bell, the head still reads its socket and watches the stages this often


class KvRound:
    """KvOp notes sent to stages, and their answers (KvDone) as they come."""

    def __init__(self, what: str, waiting: set, then=None):
        self.what, self.waiting, self.then = what, waiting, then
        self.done: dict[int, M.KvDone] = {}
        self.failed = False  # a restore round whose `then` found an error

    @property
    def complete(self) -> bool:
        return not self.waiting


@dataclass
class StageInfo:
    index: int
    device: str
    layers: tuple[int, int]
    host: str | None = None    # None: this machine
    pid: int = 0
    mem_bytes: int = 0
    kv_bytes: int = 0
    state_bytes: int = 0         # linear-attention states
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
    continuation_ids: list[int]      # generated tokens (an end-of-sequence token is not one of them)
    continuation: str | None         # their text (cut before a stop string); None without a tokenizer
    perplexity: float | None         # over the prompt positions computed this time (not a reused prefix)
    last_logits: np.ndarray          # the prompt's last row
    finish_reason: str = "length"    # "stop": EOS, a stop string or on_token said stop; "length": out of tokens
    prompt_tokens: int = 0
    reused_tokens: int = 0           # prompt positions whose KV the stages already held (not prefilled)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    ttft_s: float | None = None      # from the call to the first generated token (prefill included)
    end_token: int | None = None     # the end token that ended it (one of Pipeline.end_ids), else None


class Pipeline:
    def __init__(self, config: RigConfig | dict, out: str | os.PathLike | None = None, console: bool = True,
                 marks: dict[str, float] | None = None, always_calibrate: bool = False):
        """marks: perf_counter times the caller knows (the launcher: `process` start, `imports` done); the
        start-up breakdown (`startup`, report.json's startup_s) counts from `process`, else from here.
        always_calibrate: the planner times identical stages too (build_plan; bench/split.py --calibrate)."""
        self._marks = dict(marks or {})
        self._marks.setdefault("process", time.perf_counter())
        self._marks.setdefault("imports", self._marks["process"])
        self.startup: dict | None = None
        self.cfg = config if isinstance(config, RigConfig) else from_dict(config)
        self.plan: Plan = build_plan(self.cfg, always_calibrate)
        check_model_files(self.cfg.model)
        self.out = Path(out or self.cfg.out or Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
        check_run_dir(self.out)
        self.console = console
        self.run_id = f"{os.getpid():x}{int(time.time() * 1000) % 0xFFFFFF:x}"
        self._res = Resources()
        self._finalizer = weakref.finalize(self, self._res.release, 1.0)
        self.stages = [StageInfo(s.index, s.device, (s.start, s.end), s.host) for s in self.plan.stages]
        self.all_cuda = all(s.device.startswith("cuda") for s in self.stages)  # (the head's spins read it)
        self._end_ids: frozenset[int] | None = None  # end_ids, read at the first generation
        self.started = False
        self.closed = False
        self.failure: PipelineError | None = None
        self._signals: list[int] = []  # filled by `interrupt` (signal handlers), read at safe points
        self._signals_seen = 0
        self._sent = self._got = 0     # chunks of the current phase sent to stage 0 / back from the last
        self._results: dict[int, M.ChunkResult] = {}
        self._bell_results = 0  # decode steps whose result came by bell (strata/bells.py), not ZeroMQ
        self._decoding = False  # decode phase: the ring head -> stage 0 -> ... -> head carries no "taken" notes
        # the ids whose KV every stage holds: positions [0, _kept_n) (a decoded token is one write, not a copy)
        self._kept = np.zeros(self.plan.max_len, dtype=np.int32)
        self._kept_n = 0
        # the prefix cache (strata/prefix_cache.py): which blocks of earlier prompts every stage holds a snapshot of
        self._index: prefix_cache.PrefixIndex | None = None
        self._disk: prefix_cache.PrefixIndex | None = None   # the disk tier's blocks (kv_cache_dir), every stage's
        self._tail_files: prefix_cache.TailFiles | None = None
        # the states of linear-attention and window layers kept at block boundaries (their state_key), every stage's;
        # and per slot, the prefill chunk ends (block boundaries) after which the stages keep them: end -> its key
        self._states: prefix_cache.PrefixIndex | None = None
        self._disk_states: prefix_cache.PrefixIndex | None = None  # ... and those whose files every stage holds
        self._keep: dict[int, dict[int, bytes]] = {}
        self._block = prefix_cache.BLOCK
        self._rounds: list[KvRound] = []          # KvOp rounds sent and not yet answered by every stage, oldest first
        self._device_tiers: dict[int, tuple[int, int]] = {}  # stage -> its device tier's (blocks, hits), last said
        self.kv_answers = 0                        # KvDone notes received (the slot driver's watchdog: progress)
        self._want_rows: set[int] = set()          # several sequences: chunks whose logits row the head keeps
        self._spans: dict[int, tuple[int, int]] = {}  # kv_pool: each slot's extent of the stages' pools (place_slot)
        self._rows: dict[int, torch.Tensor] = {}   # ... and those rows, by chunk
        self._restored = 0                         # this prefill's prompt positions restored from snapshots
        self._lookups = self._hits = 0             # prefix-cache lookups, and those that found a usable prefix
        self._loaded = False                       # the live KV is a kv_load's (no prefill since)
        self.prefix_cache_off: str | None = None   # why the prefix cache is off (None: on)
        self._tokenizer = None
        self.driver = None             # the engine's request loop (a SlotDriver on its thread) that owns this
                                       # pipeline; None: generate / score run the loop on the caller's thread
        self._decode_wait_s = 0.0      # a lone sequence's decode: seconds waiting on the stages
        self.steps = 0                 # decode steps of the current (or last) generate; then `generations` counts it
        self.generations = 0
        self._ready: set[int] = set()
        self._wire: HeadWire | None = None
        self._remote = None            # strata.remote.RemoteStages when a stage is remote
        self.boundaries: list[str] = []            # per boundary: "shm" or "tcp"
        self._marks["planned"] = time.perf_counter()

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
        self._marks["spawn"] = time.perf_counter()
        sweep_dead_ipc_dirs()
        remote = [sp.host is not None for sp in self.plan.stages]
        across = [remote[i] or remote[i + 1] for i in range(len(remote) - 1)]  # boundary i leaves this host
        self.boundaries = ["tcp" if a else "shm" for a in across]
        self._buffers = Buffers(self._res, self.run_id, self.plan, remote, across, self.cfg.kernels.decode_bells)
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
                               M.Rejected: self._on_rejected, M.KvDone: self._on_kv_done}
        self._result_rows = self._result_buffer(remote[-1])  # (max_seqs or 1, vocab)
        self._result_row = self._result_rows[0]
        for sp in self.plan.stages:
            self.stages[sp.index].pid = self._launch(sp, self._spec(sp))
        self.started = True
        self._marks["spawned"] = time.perf_counter()
        self._wait_ready()
        if self._remote:
            self._link_remote()
        self._marks["ready"] = time.perf_counter()
        self._start_prefix_cache()
        for seg in self._res.segments:  # every stage has mapped its buffers: unlink now, so even SIGKILL leaks nothing
            seg.unlink()

    def _result_buffer(self, remote_last: bool) -> torch.Tensor:
        """The last stage's logits rows: a shared segment, or (a remote last stage) a buffer its row lands in."""
        if not remote_last:
            return self._buffers.result
        from .transport import TcpLink
        link = TcpLink(torch.float32, (self.plan.args.vocab_size,))
        self._wire.land_result = lambda frame: link.land(link.buf.numel(), frame)
        return link.buf.view(1, -1)

    def _spec(self, sp) -> M.StageJob:
        """What stage sp needs to build and serve its slice (validated again by a remote stage on arrival)."""
        plan, cfg, w = self.plan, self.cfg, self._wire
        return M.StageJob(
            index=sp.index, n_stages=len(plan.stages), device=sp.device, dtype=cfg.dtype, attention=cfg.attention,
            weights=cfg.weights, kv_dtype=cfg.kv_dtype, memory=sp.memory, threads=sp.threads, cores=list(sp.cores), start=sp.start,
            end=sp.end, model=cfg.model, args={f: getattr(plan.args, f) for f in plan.args.__dataclass_fields__},
            seed=cfg.seed, max_len=plan.max_len, tokens=plan.tokens, max_chunk=plan.max_chunk,
            prefix_block=sp.prefix_block,
            dynamic_chunks=cfg.dynamic_chunks, depth=cfg.depth,
            max_seqs=cfg.max_seqs, kv_pool=plan.kv_pool, decode_batch=cfg.decode_batch,
            prefix_device_bytes=plan.planner.get("needs", [{}] * len(plan.stages))[sp.index].get("prefix_cache", 0),
            perplexity=cfg.perplexity, segments=self._buffers.names, endpoints=w.endpoints, head_endpoint=w.endpoint,
            log_file=str(self.out / f"stage-{sp.index}.log"), console=self.console,
            dump_residual=str(self.out / "residual.npy") if cfg.dump_residual else "",
            decode_weights=cfg.decode_weights, cuda_graphs=cfg.cuda_graphs,
            decode_ahead="bells" in self._buffers.names and bells.ahead_wanted([s.device for s in plan.stages],
                                                                               cfg.kernels.decode_ahead),
            # (slot_spin: a stage spins only where every stage is on a GPU, as the head's driver does: a CUDA
            # stage beside CPU ones would take a core from their threads)
            kernels={**{f: getattr(cfg.kernels, f) for f in cfg.kernels.__dataclass_fields__},
                     "slot_spin": cfg.kernels.slot_spin and self.all_cuda},
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
        st.warm_s, st.state_bytes = msg.warm_s, msg.state_bytes
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
        if k in self._want_rows:  # several sequences: the rows are copied before "taken" lets the next ones in
            self._want_rows.discard(k)
            self._rows[k] = (self._result_rows[:len(msg.argmaxes)] if msg.argmaxes else self._result_row).clone()
        self._results[k] = msg
        # a decode step's result is read before the next token goes down: nothing to free (but with max_seqs > 1 the
        # stages reap every step, one sequence's too)
        if not self._decoding or self.cfg.max_seqs > 1:
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

    def _on_kv_done(self, msg: M.KvDone, data) -> None:
        # a stage answers its KvOps in the order they came (one socket from the head): the oldest round that waits
        # on it is the one answered
        r = next((r for r in self._rounds if msg.stage in r.waiting), None)
        if r is None:
            raise M.BadMessage(f"kv_done: stage {msg.stage} has no KV operation in flight")
        self.kv_answers += 1
        self._device_tiers[msg.stage] = (msg.device_blocks, msg.device_hits)
        r.waiting.discard(msg.stage)
        r.done[msg.stage] = msg
        if not r.waiting:
            self._rounds.remove(r)
            if r.then is not None:
                r.then(r)

    # -- the run -----------------------------------------------------------------------------
    def finish(self) -> None:
        """Wait until every chunk sent has come out of the last stage, or a failure is known.

        Public and idempotent: a caller may join the pipeline early; the prefill guard calls it."""
        if self._wire is not None:
            bells = self._buffers.bells  # a decode step in flight may answer on its bell

            def step():
                if not (bells is not None and self._take_bell()):
                    self._receive(200 if bells is None else 1)
            poll_until(lambda: self._got >= self._sent or self.failure is not None, self.cfg.stall_timeout_s,
                       what=self._stalled, step=step, progress=lambda: self._got)
        if self.failure:
            raise self.failure

    def _take_bell(self) -> bool:
        """A decode step's result from the head's bell (strata/bells.py), handled as its note would be."""
        note = self._buffers.bells.take(len(self.stages))
        if note is None:
            return False
        self._bell_results += 1
        try:
            self._on_result(M.ChunkResult(k=note[0], nll=0.0, count=0, argmax=note[2], scores=b""), None)
        except M.BadMessage as e:  # checked as a frame is: counted and dropped, never acted on
            self._wire.bad_frames += 1
            log.warning("head rejected a decode bell: %s", e)
        return True

    def _stalled(self) -> None:
        # dump every stage's stacks into its log, then fail naming where each one was
        for p in self._res.procs:
            if p.is_alive() and isinstance(p, mp.process.BaseProcess):  # not a remote stage's ssh
                os.kill(p.pid, signal.SIGUSR1)
        time.sleep(0.5)
        self._fail(f"no progress for {self.cfg.stall_timeout_s:.0f}s (stacks dumped to the stage logs): "
                   f"{self.where()}")

    def _new_phase(self, phase: str) -> None:
        self._decoding = phase == "decode"
        self._results.clear()
        self._sent = self._got = 0
        for st in self.stages:  # a second prefill must wait for fresh timing, not find the last one's
            st.stats.pop(phase, None)
            st.chunk = -1       # notes of the last phase name none of this phase's chunks

    def guard(self) -> None:
        """Never leave with chunks in flight; a known failure returns at once (a second SIGINT/SIGTERM
        through `interrupt` raises Interrupted here and abandons the join)."""
        if not self.failure:
            try:
                self.finish()
            except KeyboardInterrupt:
                self._fail("interrupted while joining chunks in flight")

    def _collect_stats(self, phase: str) -> None:
        """One round trip at the end of a phase (never per token): each stage's timing of it."""
        self._wire.broadcast(M.End(phase=phase))
        poll_until(lambda: all(phase in st.stats for st in self.stages), self.cfg.stall_timeout_s,
                   what=self._stalled, step=lambda: self._receive(100))

    def _startup_done(self) -> None:
        """The first chunk has left for stage 0: where the seconds since the process started went."""
        from .report import format_startup, startup_breakdown
        self._marks["first"] = time.perf_counter()
        self.startup = startup_breakdown(self._marks, self.plan.timings.get("tokenizer_s", 0.0),
                                         max((st.load_s for st in self.stages), default=0.0))
        local = [start_method(st.device) for st in self.stages if st.host is None]
        self.startup["stage_start"] = "forkserver" if "forkserver" in local else "spawn" if local else "remote"
        log.info(format_startup(self.startup))

    # -- several sequences at once (max_seqs > 1): strata/slots.py drives these --------------------------
    def begin_slots(self, keep_live: bool = False) -> float:
        """A busy period begins: chunk indices from 0 and one `t0` (the stages' timing phase) for all its chunks and
        steps. What the live KV of slot 0 held is forgotten (other sequences write there), unless keep_live: a lone
        sequence's loop keeps it up to date (live_prefix, hold_live). -> t0."""
        self._refuse_if_closed()
        self.start()
        self._new_phase("prefill")
        self._want_rows.clear()
        self._rows.clear()
        if not keep_live:
            self._kept_n = 0
        return time.perf_counter()

    def place_slot(self, slot: int, offset: int, positions: int) -> None:
        """The extent [offset, offset + positions) of every stage's KV pool (kv_pool) that `slot`'s next sequence
        holds: its chunks and KV rounds carry it to the stages (Transformer.place_slot)."""
        self._spans[slot] = (offset, positions)

    def put_slot_ids(self, slot: int, ids: np.ndarray, start: int = 0) -> None:
        """ids[start:] into `slot`'s part of the ids segment (stage 0 reads a chunk's ids there)."""
        if slot == 0:  # (a remote stage 0 has its own copy of the ids: only with max_seqs 1, so only slot 0)
            return self._put_ids(ids, start)
        base = slot * (self.plan.max_len + 1)
        self._buffers.ids[base + start:base + ids.size] = torch.from_numpy(np.ascontiguousarray(ids[start:]))

    def put_slot_token(self, slot: int, pos: int, token: int) -> None:
        """A decode step's token at `pos` of `slot`'s ids (through a numpy view made for the write: a torch item write
        takes ~4 us, a batch of 16 rows writes 16; no view is kept, which would hold the segment's mapping open)."""
        self._buffers.ids.numpy()[slot * (self.plan.max_len + 1) + pos] = token

    def send_slot(self, slot: int, pos: int, n: int, phase: str, tokens: int, t0: float, row: bool,
                  score: int = -1) -> int:
        """Rows [pos, pos + n) of the sequence in `slot` to stage 0 (a prefill chunk, or a decode step when phase is
        "decode"); row: keep its logits row (a sampled token); score >= 0: a scored prefill chunk (its rows fit its
        result: strata.slots.scored_chunks). -> its chunk index."""
        k = self._sent
        if row:
            self._want_rows.add(k)
        self._wire.send(0, M.Chunk(k=k, pos=pos, n=n, phase=phase, t0=t0, tokens=tokens, score=score, slot=slot,
                                   keep=self._keep_after(slot, pos + n, phase), span=list(self._spans.get(slot, ()))))
        self._sent += 1
        if self.startup is None:
            self._startup_done()
        return k

    def groupable(self, slot: int, pos: int, n: int) -> bool:
        """Whether rows [pos, pos + n) of `slot`'s prompt may go in a prefill group (send_group): the model's layers
        take groups, and no state is kept after them (a linear or window model's prefix-cache boundary)."""
        return self.plan.args.group_refusal() is None and not self._keep_after(slot, pos + n, "prefill")

    def send_group(self, segs: list[tuple[int, int, int]], tokens: int, t0: float, rows: bool) -> int:
        """Several sequences' prefill chunks (slot, pos, n), each `groupable`, as one micro-batch (a prefill group,
        Transformer.forward_group); tokens: the longest prompt's length; rows: keep each one's last row's logits
        (row t of the result). Its result's argmaxes are each sequence's. -> its chunk index."""
        k = self._sent
        if rows:
            self._want_rows.add(k)
        span = [v for s, _, _ in segs for v in self._spans.get(s, ())]
        if span and len(span) != 2 * len(segs):
            raise ValueError(f"send_group: a sequence without its extent of the KV pool in {segs}")
        self._wire.send(0, M.Chunk(k=k, pos=0, n=sum(n for _, _, n in segs), phase="prefill", t0=t0, tokens=tokens,
                                   score=-1, seqs=[v for s, p, _ in segs for v in (s, p)], rows=rows, span=span,
                                   lens=[n for _, _, n in segs]))
        self._sent += 1
        if self.startup is None:
            self._startup_done()
        return k

    def send_batch(self, seqs: list[tuple[int, int]], t0: float, rows: bool, ahead: int = 0) -> int:
        """One decode step of each sequence (slot, pos) as one micro-batch (its tokens already at pos of each
        slot's ids: put_slot_token); rows: keep its logits rows (a sampled token). ahead (one stage, no rows): that
        many more steps on the batch's own argmaxes, at pos + 1 ..., each row's in the result (step-major). -> its
        chunk index."""
        if ahead and (rows or len(self.stages) != 1):
            raise ValueError("send_batch: ahead needs one stage and greedy rows (no logits rows)")
        k = self._sent
        if rows:
            self._want_rows.add(k)
        top = max(pos for _, pos in seqs) + 1 + ahead
        self._wire.send(0, M.Chunk(k=k, pos=0, n=len(seqs), phase="decode", t0=t0, tokens=top, score=-1,
                                   seqs=[v for sp in seqs for v in sp], rows=rows, ahead=ahead))
        self._sent += 1
        return k

    def restore_slot(self, slot: int, ids: np.ndarray, cap: int) -> int:
        """The longest prefix of ids[:cap] that the prefix cache holds, up to a chunk boundary of the prompt's cold
        schedule, restored into `slot` on every stage -> its positions (0: none). Every stage has answered when
        this returns, so the restore comes before the slot's first chunk on each, whatever socket that takes."""
        return self._from_snapshots(ids, 0, cap, slot)

    def restore_slot_begin(self, slot: int, ids: np.ndarray, cap: int,
                           live: int = 0) -> tuple[int, KvRound | None]:
        """restore_slot with its round sent, not waited for -> (the positions, the round): the slot's first chunk
        waits until the round is complete; if it `failed`, the slot holds `live` positions (live_prefix's: prefill
        the rest)."""
        return self._restore_begin(ids, live, cap, slot)

    def snapshot_slot(self, slot: int, ids: np.ndarray) -> None:
        """After the last prefill chunk of ids in `slot`: its prompt's full blocks into the prefix cache (their
        rows are final: the sequence's decode steps write later positions)."""
        self._snapshot(ids, slot)

    def snapshot_slot_begin(self, slot: int, ids: np.ndarray) -> KvRound | None:
        """snapshot_slot with its rounds sent, not waited for -> the last one: the slot is not written again (nor
        given to another sequence) before it is complete."""
        return self._snapshot(ids, slot, wait=False)

    def take_results(self, timeout_ms: int) -> list[tuple[int, M.ChunkResult, torch.Tensor | None]]:
        """What the last stage finished within timeout_ms: (chunk, result, its logits row or None), in order; a
        decode batch's result has its argmaxes, and its logits rows (m, vocab).
        A dead stage or a typed failure raises PipelineError."""
        self._receive(timeout_ms)
        done = sorted(self._results)
        return [(k, self._results.pop(k), self._rows.pop(k, None)) for k in done]

    @property
    def in_flight(self) -> int:
        return self._sent - self._got

    # -- prompts -------------------------------------------------------------------------------
    @property
    def end_ids(self) -> frozenset[int]:
        """The tokens that end a generation (strata.checkpoint.end_ids: the eos and every end the model's files
        declare, e.g. an instruct model's end of turn), read once."""
        if self._end_ids is None:
            from .checkpoint import end_ids
            self._end_ids = end_ids(self.cfg.model, self.plan.args)
        return self._end_ids

    @property
    def max_context(self) -> int:
        """Prompt + generated tokens one prefill / generate may use (the stages' KV positions)."""
        return self.plan.max_len

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from .tokenizer import Tokenizer
            self._tokenizer = Tokenizer.for_model(self.cfg.model)  # ModelError for a model without one
        return self._tokenizer

    def prompt_ids(self, prompt: str | list[int] | np.ndarray | None) -> np.ndarray:
        """The prompt as int32 ids (None: the rig's), checked against the vocabulary and max_context."""
        if prompt is None:
            ids = self.plan.ids
        elif isinstance(prompt, str):
            if not prompt:
                raise ConfigError("prompt: the text is empty")
            ids = np.asarray(self.tokenizer.encode(prompt), dtype=np.int64)
        else:
            ids = np.asarray(prompt, dtype=np.int64).reshape(-1)
            if ids.size and (ids.min() < 0 or ids.max() >= self.plan.args.vocab_size):
                raise ConfigError(f"prompt: ids must be in [0, {self.plan.args.vocab_size})")
        if ids.size == 0:
            raise ConfigError("prompt: empty")
        if ids.size > self.max_context:
            raise ConfigError(f"prompt: {ids.size} tokens exceeds max_context of {self.max_context} tokens")
        return ids.astype(np.int32)

    def _reusable(self, ids: np.ndarray) -> int:
        """Leading positions whose KV the stages already hold for these ids; the last prompt token is always
        recomputed (its logits give the first generated token). None with dump_residual (every row dumped)."""
        if self.cfg.dump_residual:
            return 0
        m = min(self._kept_n, ids.size)
        diff = np.flatnonzero(self._kept[:m] != ids[:m])
        common = int(diff[0]) if diff.size else m
        a = self.plan.args
        rings = [a.kv_positions(i, self.plan.max_len, self.plan.max_chunk) for i in range(a.n_layers) if a.window(i)]
        start = min(common, ids.size - 1)
        if a.linear_layers is not None and any(a.linear_layers) and start != self._kept_n:
            return 0  # a linear-attention state serves only the position it stands at: the end of what is kept
        if rings and self._kept_n > min(rings) and start + 1 - a.sliding_window < self._kept_n - min(rings):
            return 0  # a window layer's ring no longer holds the keys a restart at `start` would read
        sc = a.rope_scaling
        if sc and sc.get("rope_type") == "dynamic" and max(self._kept_n, ids.size) > sc["max_position_embeddings"]:
            return 0  # dynamic NTK: keys past max_position_embeddings rotate by their prompt's length, not this one's
        return start

    # -- the prefix cache and KV files -----------------------------------------------------------
    def _start_prefix_cache(self) -> None:
        """Once every stage is ready: how many blocks each stage's `prefix_cache_bytes` holds (the head's index
        decides for all of them, so the smallest budget in blocks is the index's capacity)."""
        budget = self.cfg.prefix_cache_bytes
        why = prefix_cache.supported(self.plan.args)
        if not budget:
            why = "prefix_cache_bytes is 0"
        elif self.cfg.dump_residual:
            why = "dump_residual prefills every prompt from position 0"
        args = self.plan.args
        stateful = prefix_cache.stateful(args)
        from .attention import kv_dtype_of
        kv = kv_dtype_of(self.cfg.kv_dtype, getattr(torch, self.cfg.dtype))
        # a block: one position's rows in the global attention layers (not the stage's kv_bytes over max_len, which
        # counts every slot's cache: max_seqs 4 held a quarter of the blocks the budget pays for)
        per_block = max(prefix_cache.row_bytes_of(args, [i for i in range(*st.layers) if not args.is_linear(i)
                                                         and not args.window(i)], kv) for st in self.stages) * self._block
        per_state = 0
        if stateful:  # the states kept at boundaries too: the linear layers', and the window layers' last window - 1
            # positions
            per_state = max(st.state_bytes // self.cfg.max_seqs + prefix_cache.kept_bytes(args, *st.layers, kv)
                            for st in self.stages)
            per_block, per_state = max(per_block, 1), max(per_state, 1)  # (a stage of window layers alone: no rows)
        if stateful and why is None:  # half the budget for the blocks, half for the states kept beside them
            if budget // 2 < per_state or budget // 2 < per_block:
                why = (f"prefix_cache_bytes {budget}: half of it holds no block of {self._block} tokens ({per_block} "
                       f"bytes a stage) or no state kept at a boundary ({per_state} bytes a stage: linear-attention "
                       "layers' states, window layers' last rows)")
            else:
                self._states = prefix_cache.PrefixIndex(budget // 2 // per_state)
                budget //= 2
        if why is None and budget < per_block:
            why = f"prefix_cache_bytes {budget} holds no block of {self._block} tokens ({per_block} bytes a stage)"
        self.prefix_cache_off = why
        if self.cfg.max_seqs > 1:  # one line for what several slots turn off (README, Serving)
            log.info("max_seqs %d: %d sequences' KV on every stage; off with it: reuse of the live KV between "
                     "requests (the prefix cache's blocks still are), kv_save / kv_load, decode bells",
                     self.cfg.max_seqs, self.cfg.max_seqs)
        if why is None:
            self._index = prefix_cache.PrefixIndex(budget // per_block)
            log.info("prefix cache: %d blocks of %d tokens (%.1f MB a stage)%s", self._index.capacity, self._block,
                     self._index.capacity * per_block / 1e6,
                     f", and the states at {self._states.capacity} block boundaries (linear layers', window rows) "
                     f"({self._states.capacity * per_state / 1e6:.1f} MB a stage)" if self._states else "")
            if self.cfg.kv_cache_dir is not None:
                self._open_disk_tier(per_block, per_state)
        elif budget:
            log.info("prefix cache off: %s; only the last prompt's KV is reused", why)

    def _open_disk_tier(self, per_block: int, per_state: int = 0) -> None:
        """kv_cache_dir: every stage opens its folder and lists the blocks it holds; those every stage holds are
        the disk index (oldest first), the rest are removed, and the index is cut to kv_cache_dir_bytes (with linear
        or window layers: half of it, the other half for the kept states' files, listed and kept alike)."""
        root = os.path.abspath(os.path.expanduser(self.cfg.kv_cache_dir))
        rig = prefix_cache.rig_folder(kv_file.rig_fingerprint(self.cfg, self.plan))
        msgs = {i: replace(m, path=prefix_cache.stage_folder(root, rig, *st.layers, torch.device(st.device).type))
                for (i, m), st in zip(self._kv_msgs("open").items(), self.stages)}
        done = self._kv_round("open", msgs)
        failed = self._kv_errors(done)
        if failed:
            log.warning("prefix cache on disk off: %s", "; ".join(failed))
            return
        common = set.intersection(*(set(d.keys) for d in done.values()))
        states = set.intersection(*(set(d.states) for d in done.values()))
        for i, d in done.items():  # a block not every stage has (a write cut short, another split's run)
            stray = [k for k in d.keys if k not in common] + [k for k in d.states if k not in states]
            if stray:  # (the stage's writer removes them in order; nothing waits for it)
                self._kv_send("unlink", {i: self._kv_msgs("unlink", stray)[i]})
        self._tail_files = prefix_cache.TailFiles(Path(root) / rig / "tails")
        tails = self._tail_files.read()
        self._tail_files.remove([k for k in tails if k not in common])
        tails = {k: t for k, t in tails.items() if k in common}
        budget = self.cfg.kv_cache_dir_bytes
        if self._states is not None:  # linear or window layers: half for the states kept at boundaries
            budget //= 2
            self._disk_states = prefix_cache.PrefixIndex(max(1, budget // per_state))
            self._unlink(self._disk_states.load([k for k in done[0].states if k in states], {}))
        self._disk = prefix_cache.PrefixIndex(budget // per_block)
        evicted = self._disk.load([k for k in done[0].keys if k in common], tails)
        self._unlink(evicted)
        log.info("prefix cache on disk: %s, %d of %d blocks held (%.1f GB a stage)", Path(root) / rig,
                 len(self._disk), self._disk.capacity, self._disk.capacity * per_block / 1e9)

    def _unlink(self, keys: list[bytes]) -> KvRound | None:
        """Out of the disk tier: every stage's files (its writer removes them in order with the writes queued
        before; the round is sent, not waited for) and the head's tail files of these blocks."""
        if not keys:
            return None
        self._tail_files.remove(keys)
        return self._kv_send("unlink", self._kv_msgs("unlink", keys))

    def _kv_errors(self, done: dict[int, M.KvDone]) -> list[str]:
        """A round's errors, one "stage i: error" each."""
        return [f"{self._who(i)}: {d.error}" for i, d in done.items() if d.error]

    def _tiers(self) -> list[prefix_cache.PrefixIndex]:
        return [self._index] + ([self._disk] if self._disk is not None else [])

    def prefix_cache_stats(self) -> prefix_cache.PrefixCacheStats:
        """Read-only figures of the head's index (safe from another thread: plain reads, no stage touched)."""
        index = self._index
        if index is None:
            return prefix_cache.PrefixCacheStats(self._lookups, self._hits)
        disk = self._disk
        tiers = [self._device_tiers.get(i, (0, 0)) for i, n in enumerate(self.plan.planner.get("needs", ()))
                 if n.get("prefix_cache")]  # the CUDA stages with a device tier
        return prefix_cache.PrefixCacheStats(self._lookups, self._hits, len(index), index.capacity, self._block,
                                             len(disk) if disk else 0, disk.capacity if disk else 0,
                                             min((b for b, _ in tiers), default=0), min((h for _, h in tiers), default=0))

    def _kv_send(self, what: str, msgs: dict[int, M.KvOp], then=None) -> KvRound:
        """Send each stage its KvOp; the round completes when every one has answered (`_receive` takes the
        answers, whatever thread waits; `then(round)` runs then)."""
        r = KvRound(what, set(msgs), then=then)
        self._rounds.append(r)
        for i, msg in msgs.items():
            self._wire.send(i, msg)
        return r

    def _kv_wait(self, rounds: list[KvRound]) -> None:
        """Until these rounds are complete. With several sequences other slots' micro-batches may be in flight:
        `_receive` keeps their results for take_results."""
        poll_until(lambda: all(not r.waiting for r in rounds), self.cfg.stall_timeout_s, what=self._stalled,
                   step=lambda: self._receive(100))

    def _kv_round(self, what: str, msgs: dict[int, M.KvOp]) -> dict[int, M.KvDone]:
        """Send each stage its KvOp and wait for every answer (a stage does one at once, in order)."""
        r = self._kv_send(what, msgs)
        self._kv_wait([r])
        return r.done

    def _kv_msgs(self, op: str, keys=(), blocks=(), path: str = "", offsets=None, tokens: int = 0,
                 slot: int = 0) -> dict[int, M.KvOp]:
        span = list(self._spans.get(slot, ())) if op in ("snap", "restore", "load") else []
        return {i: M.KvOp(op=op, keys=list(keys), blocks=list(blocks), block=self._block, path=path,
                          offset=offsets[i] if offsets else 0, tokens=tokens, slot=slot, span=span)
                for i in range(len(self.stages))}

    def _kv_all(self, op: str, keys=(), blocks=(), path: str = "", offsets=None, tokens: int = 0, slot: int = 0):
        return self._kv_round(op, self._kv_msgs(op, keys, blocks, path, offsets, tokens, slot))

    @property
    def kv_rounds(self) -> int:
        """KV rounds in flight (the slot driver's watchdog)."""
        return len(self._rounds)

    def _from_snapshots(self, ids: np.ndarray, live: int, cap: int, slot: int = 0) -> int:
        """The positions to reuse: `live` (what the live KV holds), or a longer prefix of snapshots, restored into
        `slot`'s cache now (every stage has answered when this returns). prefix_reuse rows: every held row of ids[:cap]
        (whole blocks, then the first rows of an earlier prompt's last block that this one shares); chunks: up to a
        chunk boundary of the prompt's cold schedule, so the rest is computed in the cold prefill's own chunks (the
        same bits as a cold prefill, when the snapshots were)."""
        self._restored = 0
        p, r = self._restore_begin(ids, live, cap, slot)
        if r is None:
            return p
        self._kv_wait([r])
        if r.failed:
            return live
        self._restored = p - live
        return p

    def _restore_begin(self, ids: np.ndarray, live: int, cap: int, slot: int) -> tuple[int, KvRound | None]:
        """_from_snapshots' lookup, and its restore round sent, not waited for -> (the positions the slot will hold,
        the round: None when nothing is restored). A round that fails (`failed`: a block file gone from kv_cache_dir,
        say) leaves the positions at `live`: the blocks are forgotten everywhere and those positions prefilled (the
        rows a restore of the same ids' blocks may have rewritten keep their meaning)."""
        if self._index is None:
            return live, None
        B = self._block
        keys = prefix_cache.block_keys(ids[:cap], B)
        tiers = self._tiers()
        m = prefix_cache.held_prefix(tiers, keys)
        for ix in tiers:
            ix.touch(keys[:m])
        tail, c, state = None, 0, b""
        if self._states is not None:  # linear or window layers: the last boundary whose states are held too
            cold = {q for q, _ in self.plan.schedule_for(0, ids.size)} if self.cfg.prefix_reuse == "chunks" else None
            held = [self._states] + ([self._disk_states] if self._disk_states is not None else [])
            j = next((j for j in range(m, 0, -1) if any(prefix_cache.state_key(keys[j - 1]) in ix.lru for ix in held)
                      and (cold is None or j * B in cold)), 0)
            if j:
                state = prefix_cache.state_key(keys[j - 1])
                for ix in held:
                    ix.touch([state])
            p = j * B
        elif self.cfg.prefix_reuse == "chunks":
            p = max((q for q, _ in self.plan.schedule_for(0, ids.size) if q <= m * B), default=0)
        else:
            tail, c = prefix_cache.best_tail(tiers, keys[m - 1] if m else b"", ids[m * B:cap])
            if tail is not None:
                for ix in tiers:
                    ix.touch([tail])
            p = m * B + c
        # a hit whether the live KV already holds those rows or they are restored: the cache would serve them
        self._lookups += 1
        self._hits += p > 0
        if p <= live:
            return live, None
        blocks = list(range(live // B, -(-p // B)))
        names = [keys[j] if j < m else tail for j in blocks]  # block m: the tail's (rows past c: never read)

        def then(r: KvRound) -> None:
            failed = self._kv_errors(r.done)
            if failed:
                r.failed = True
                log.warning("prefix cache: restore failed (%s); prefilling those positions", "; ".join(failed))
                self._hits -= 1
                self._forget(names + ([state] if state else []))
        msgs = self._kv_msgs("restore", names, blocks, slot=slot, tokens=p if state else 0)
        if state:
            msgs = {i: replace(mg, state=state) for i, mg in msgs.items()}
        return p, self._kv_send("restore", msgs, then)

    def keep_states(self, slot: int, ids: np.ndarray, start: int, schedule) -> list[tuple[int, int]]:
        """A prefill of ids from `start` in `schedule`'s chunks, of a model with linear-attention or window layers:
        the stages keep those layers' states (a window layer's: its last window - 1 rows) after the last chunks
        (as many as the index holds) that end on a block boundary, and at the prompt's last block boundary before its
        last token, its chunk cut there (prefix_reuse chunks: only boundaries of the cold schedule, uncut), so a
        later prompt sharing those blocks restores them: the chunk's note names the states' key. -> the schedule;
        the keys join the index at the prompt's snapshot."""
        self._keep.pop(slot, None)
        if self._states is None or self.failure:
            return list(schedule)
        B, n = self._block, ids.size
        last = kept_state_cut(n, B)
        if self.cfg.prefix_reuse == "chunks":  # (a restore point must be a chunk boundary of the cold schedule)
            cold = {p + m for p, m in self.plan.schedule_for(0, n)}
            last = next((q for q in range(last, start, -B) if q in cold), 0)
        if last > start:
            schedule = cut_at(schedule, last)
        # the last ones the index holds: a stage copies no more than that out (a Gemma-3-27B state is ~0.4 GB)
        ends = sorted(p + m for p, m in schedule if (p + m) % B == 0 and start < p + m <= last)[-self._states.capacity:]
        if not ends:
            return list(schedule)
        keys = prefix_cache.block_keys(ids[:ends[-1]], B)
        self._keep[slot] = {e: prefix_cache.state_key(keys[e // B - 1]) for e in ends}
        return list(schedule)

    def _keep_after(self, slot: int, end: int, phase: str) -> bytes:
        """The state key a prefill chunk of `slot` ending at `end` carries (b"": none)."""
        return self._keep.get(slot, {}).get(end, b"") if phase == "prefill" else b""

    def _forget(self, names: list[bytes]) -> None:
        """Blocks out of every tier (their rounds are sent, not waited for)."""
        for ix in self._tiers() + [x for x in (self._states, self._disk_states) if x is not None]:
            ix.discard(names)
        self._kv_send("drop", self._kv_msgs("drop", names))
        if self._disk is not None:
            self._unlink(names)

    def _snapshot(self, ids: np.ndarray, slot: int = 0, wait: bool = True) -> KvRound | None:
        """After a prefill of ids (in `slot`): its full blocks into the prefix cache (the ones not held yet), LRU
        evicting. wait False: the rounds are sent, not waited for -> the last one (None: none sent); the slot's
        rows [0, ids.size) must not be written again before it completes (another socket's chunk could reach a
        stage before the snapshot's note)."""
        if self._index is None or self.failure:
            return None
        B = self._block
        keys = prefix_cache.block_keys(ids, B)
        new, evicted = self._index.add(keys)
        kept = self._keep.pop(slot, None)
        gone: list[bytes] = []  # out of the disk tier
        if kept:  # the states its prefill kept (every stage has them by now, and writes their files with a disk
            # tier), the latest the most recent
            order = [kept[e] for e in sorted(kept)]
            for ix, out in ((self._states, evicted), (self._disk_states, gone)):
                if ix is not None:  # the rest: the stages hold them (host copies, files) but no index names them
                    _, dropped = ix.add(order[-ix.capacity:])
                    out += dropped + [k for k in order[:-ix.capacity] if k not in ix.lru]
        disk = self._disk
        if disk is not None:  # the blocks new there are snapped too (a stage writes a held block's file once)
            dnew, out = disk.add(keys)
            gone += out
            new = sorted(set(new) | set(dnew))
        names = [keys[j] for j in new]
        m = len(keys)
        if (self.cfg.prefix_reuse == "rows" and m < self._index.capacity and ids.size > m * B
                and (m + 1) * B <= self.plan.max_len and self._states is None):  # its last, partial block too (rows:
            # reused row by row; not with linear or window layers: their states stand only where they were kept)
            prev = keys[m - 1] if m else b""
            tail, more = self._index.add_tail(prev, ids[m * B:])
            evicted += more
            if disk is not None:
                dtail, dmore = disk.add_tail(prev, ids[m * B:])
                gone += dmore
                if dtail is not None:
                    self._tail_files.write(dtail, prev, ids[m * B:])
                tail = tail or dtail
            if tail is not None:
                new, names = new + [m], names + [tail]
        sent = []
        if evicted:
            sent.append(self._kv_send("drop", self._kv_msgs("drop", evicted)))
        if gone:
            sent.append(self._unlink(gone))
        if new:
            sent.append(self._kv_send("snap", self._kv_msgs("snap", names, new, slot=slot),
                                      lambda r: self._snapped(r, names)))
        if wait:
            self._kv_wait(sent)
        return sent[-1] if sent else None

    def _snapped(self, r: KvRound, names: list[bytes]) -> None:
        """A snapshot round's answers: a block a stage could not copy is not cached, anywhere; one snapped for the
        disk alone leaves the host (its writer keeps the rows until the file is written)."""
        failed = self._kv_errors(r.done)
        if failed:  # e.g. no host memory left
            log.warning("prefix cache: snapshot failed (%s); dropping its blocks", "; ".join(failed))
            self._forget(names)
            return
        host_not = [k for k in names if k not in self._index.lru]
        if host_not:
            self._kv_send("drop", self._kv_msgs("drop", host_not))

    def _kv_file_refusals(self, what: str, slot: bool = False) -> None:
        """What kv_save and kv_load refuse before anything runs. slot: a load into a free slot and from there into the
        prefix cache (max_seqs > 1: SlotDriver.load)."""
        n = self.cfg.max_seqs
        if n > 1 and what == "kv_save":
            raise kv_file.KvFileError(f"kv_save: not with max_seqs {n} (a KV file holds one sequence; the slots' "
                                      "sequences have no current one): use max_seqs 1")
        if n > 1 and not slot:
            raise kv_file.KvFileError(f"kv_load: with max_seqs {n} the slot driver loads a KV file "
                                      "(PipelineEngine.kv_load, SlotDriver.load), among the slots' sequences")
        if n > 1 and self.prefix_cache_off:
            raise kv_file.KvFileError(f"kv_load: with max_seqs {n} a KV file's rows go into the prefix cache, and it "
                                      f"is off ({self.prefix_cache_off})")
        why = prefix_cache.supported(self.plan.args, files=True)
        if why:
            raise kv_file.KvFileError(f"{what}: not for this model: {why}")
        remote = [st.index for st in self.stages if st.host is not None]
        if remote:
            raise kv_file.KvFileError(f"{what}: stage {remote[0]} runs on another host (KV files are read and written "
                                      "by the stages, on this machine)")

    def _kv_file_checks(self, what: str, slot: bool = False) -> int:
        """Refusals common to kv_save and kv_load; -> bytes of one layer's position (k and v)."""
        self._kv_file_refusals(what, slot)
        if self.plan.kv_pool:  # (kv_bytes counts the pool, not max_seqs x max_len positions)
            from .attention import kv_dtype_of
            kv = kv_dtype_of(self.cfg.kv_dtype, getattr(torch, self.cfg.dtype))
            per_layer = {prefix_cache.row_bytes_of(self.plan.args, [0], kv)}
        else:
            per_layer = {st.kv_bytes // self.cfg.max_seqs // self.plan.max_len // (st.layers[1] - st.layers[0])
                         for st in self.stages}  # (kv_bytes: every slot's cache)
        if len(per_layer) != 1:
            raise kv_file.KvFileError(f"{what}: the layers' caches differ in width ({sorted(per_layer)} bytes a row)")
        return per_layer.pop()

    def _kv_offsets(self, data_at: int, tokens: int, layer_row_bytes: int) -> dict[int, int]:
        return {st.index: data_at + tokens * layer_row_bytes * st.layers[0] for st in self.stages}

    def kv_save(self, path: str | os.PathLike) -> dict:
        """Write the KV the stages hold for the current prompt (and its answer so far) with its token ids to `path`
        (strata/kv_file.py: a JSON header fingerprinting the model and rig, raw rows; no pickle). -> facts of it."""
        self._refuse_if_closed()
        self._kv_file_refusals("kv_save")  # before "nothing to save": with several slots nothing is the kept one
        n = self._kept_n
        if not self.started or n == 0:
            raise kv_file.KvFileError("kv_save: nothing to save: no prompt has been prefilled on this pipeline")
        lrb = self._kv_file_checks("kv_save")
        path = Path(path)
        t0 = time.perf_counter()
        split = [list(st.layers) for st in self.stages]
        with kv_file.replacing(path) as tmp:
            data_at = kv_file.create(tmp, kv_file.rig_fingerprint(self.cfg, self.plan), self._kept[:n], lrb, split)
            done = self._kv_all("save", path=str(tmp.resolve()), offsets=self._kv_offsets(data_at, n, lrb), tokens=n)
            bad = [f"stage {i}: {d.error}" for i, d in done.items() if d.error]
            if bad:
                raise kv_file.KvFileError(f"kv_save: cannot write {path}: {bad[0]}")
        return {"path": str(path), "tokens": n, "bytes": path.stat().st_size, "seconds": time.perf_counter() - t0}

    def kv_load(self, path: str | os.PathLike) -> dict:
        """Load a KV file into the stages (refused in one line unless it was saved for this model and rig): its
        ids become what the stages hold, so a prompt that begins with them prefills only the rest (up to a chunk
        boundary of its cold schedule: see `live_prefix`). -> {"ids", "tokens", "bytes", "seconds"} (seconds: the
        stages' reads, not their start)."""
        self._refuse_if_closed()
        self._kv_file_refusals("kv_load")
        h, ids, data_at = kv_file.read_header(path)
        fp = kv_file.rig_fingerprint(self.cfg, self.plan)
        kv_file.check(path, h, fp, h["layer_row_bytes"], self.max_context, self.plan.args.vocab_size, ids)
        self.start()  # refused before any stage starts; the rows' width needs the stages' caches
        lrb = self._kv_file_checks("kv_load")
        kv_file.check(path, h, fp, lrb, self.max_context, self.plan.args.vocab_size, ids)
        t0 = time.perf_counter()
        n = ids.size
        self._kept_n = 0  # the live KV is about to be overwritten
        done = self._kv_all("load", path=str(Path(path).resolve()), offsets=self._kv_offsets(data_at, n, lrb),
                            tokens=n)
        bad = [f"stage {i}: {d.error}" for i, d in done.items() if d.error]
        if bad:
            raise kv_file.KvFileError(f"kv_load: cannot read {path}: {bad[0]}")
        self._kept[:n] = ids
        self._kept_n = n
        self._loaded = True
        self._buffers.ids[:n] = torch.from_numpy(ids)
        seconds = time.perf_counter() - t0
        self._snapshot(ids)  # and into the prefix cache, which outlives the live KV
        return {"ids": ids, "tokens": n, "bytes": os.path.getsize(path), "seconds": seconds}

    def load_slot_check(self, path: str | os.PathLike) -> tuple[np.ndarray, int, int]:
        """kv_load's checks of a file for a load into a slot (max_seqs > 1; any thread: reads the file's header and
        the plan) -> (its ids, its rows' offset, bytes of one layer's position)."""
        self._refuse_if_closed()
        self._kv_file_refusals("kv_load", slot=True)
        h, ids, data_at = kv_file.read_header(path)
        lrb = self._kv_file_checks("kv_load", slot=True)
        kv_file.check(path, h, kv_file.rig_fingerprint(self.cfg, self.plan), lrb, self.max_context,
                      self.plan.args.vocab_size, ids)
        return ids, data_at, lrb

    def load_slot_begin(self, slot: int, path: str | os.PathLike, ids: np.ndarray, data_at: int,
                        lrb: int) -> KvRound:
        """A checked KV file's rows into `slot` on every stage, the round sent, not waited for (the driver's thread;
        the slot holds no sequence). Its answers name any stage's read error (_kv_errors)."""
        return self._kv_send("load", self._kv_msgs("load", path=str(Path(path).resolve()),
                                                   offsets=self._kv_offsets(data_at, ids.size, lrb), tokens=ids.size,
                                                   slot=slot))

    def _put_ids(self, ids: np.ndarray, start: int) -> None:
        self._buffers.ids[start:ids.size] = torch.from_numpy(np.ascontiguousarray(ids[start:]))
        if self.stages[0].host is not None:  # a remote stage 0 has its own copy of the ids
            step = 65536                     # ~330 KB of msgpack ints: well under a frame's limit
            for a in range(start, ids.size, step):
                self._wire.send(0, M.Ids(pos=a, ids=ids[a:a + step].tolist()))

    # -- prefill, score and generate: one sequence through the request loop --------------------------
    def score(self, prompt: str | list[int] | np.ndarray, start: int = 1,
              top: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """log p(ids[i] | ids[:i]) for i in [start, n), by the last stage's head in each prefill chunk (the rows of
        the perplexity), and the `top` (<= 20) likeliest tokens there -> (log-probabilities (n - start,) float32,
        top ids (n - start, top) int32, their log-probabilities (n - start, top) float32). A prefix the stages
        hold is reused up to start - 1; the prompt stays cached for what follows (a generate after it). Runs
        through the request loop (strata/slots.py) as one sequence, as the server's scoring does."""
        ids = self._prompt_here(prompt)
        return self._loop().score(ids, start, top)

    def prefill(self, prompt: str | list[int] | np.ndarray | None = None) -> Result:
        """Prefill the prompt (None: the rig's; text or ids, up to max_context, any number of times: a prefix
        shared with what the stages hold is not computed again), then the rig's greedy continuation
        (`generate`). Returns the report."""
        from .sampling import SamplingParams
        return self.generate(prompt, SamplingParams(max_tokens=self.cfg.generate))

    def generate(self, prompt: str | list[int] | np.ndarray | None = None, params=None,
                 on_token: Callable[[int], bool | None] | None = None) -> Result:
        """Prefill the prompt (with prefix reuse), then decode up to params.max_tokens tokens (default: the
        rig's `generate`, greedy). Per token one id goes down and one residual row crosses each boundary;
        the head samples the last stage's logits row. Stops at EOS (not included), at a stop string (text cut
        before it), when on_token(id) returns False, or at max_context. The sequence runs through the request
        loop (strata/slots.py: SlotDriver) on this thread, the loop the server's engine runs on its own."""
        from .sampling import Detokenizer, SamplingParams, StopMatcher
        params = params if params is not None else SamplingParams(max_tokens=self.cfg.generate)
        ids = self._prompt_here(prompt)
        self.generations += 1
        stop = StopMatcher(params.stop) if params.stop else None
        detok = Detokenizer(self.tokenizer.decode, context=ids.tolist()) if stop else None
        parts: list[str] = []

        def each(tok: int) -> bool | None:  # a stop string ends it before the caller sees the token (as EOS does)
            if stop is not None:
                parts.append(stop.feed(detok.add(tok)))
                if stop.stopped:
                    return False
            return on_token(tok) if on_token is not None else None

        def text(out: list[int]) -> str | None:  # (in the loop, before the report: it carries the text)
            if stop is not None:
                return "".join(parts) + (stop.feed(detok.flush()) + stop.flush() if not stop.stopped else "")
            return self.text_of(out)
        run = self._loop().generate(ids, params, each, text=text, progress=self.cfg.progress and self.console)
        self.steps = run.steps
        return replace(run.result, end_token=run.end_token)

    def _prompt_here(self, prompt) -> np.ndarray:
        """A prompt for this thread's request loop: the pipeline open, started, and driven by no engine's loop."""
        self._refuse_if_closed()
        if self.driver is not None:
            raise ConfigError("this pipeline is driven by its engine's request loop (PipelineEngine): "
                              "call the engine's generate / score / kv_load")
        ids = self.prompt_ids(prompt)
        self.start()
        return ids

    def _loop(self):
        """The request loop (strata/slots.py) on the caller's thread, for one call."""
        from .slots import SlotDriver
        return SlotDriver(self, self.cfg.max_seqs, threaded=False)

    def text_of(self, out: list[int]) -> str | None:
        """The generated ids' text (None: none, or no tokenizer)."""
        if not out:
            return None
        try:
            return self.tokenizer.decode(out)
        except Exception:  # noqa: BLE001 - synthetic models have no tokenizer
            return None

    # -- one sequence alone in the pipeline (max_seqs 1): the request loop's decode ring ---------------------------
    def live_prefix(self, ids: np.ndarray, cap: int) -> int:
        """Positions of ids[:cap] whose KV the stages hold live from the last sequence (max_seqs 1: its one slot
        keeps the last prompt and answer); after a kv_load, up to a chunk boundary of the prompt's cold schedule
        (prefix_reuse chunks), so the rest is computed in the cold prefill's own chunks (the saved rows' bits,
        the same answer). Past the returned positions the live KV is about to be overwritten."""
        live = min(self._reusable(ids), cap)
        if self._loaded and live and self.cfg.prefix_reuse == "chunks":
            live = max(q for q, _ in self.plan.schedule_for(0, ids.size) if q <= live)
        self._loaded = False
        self._kept_n = min(self._kept_n, live)
        return live

    def hold_live(self, ids: np.ndarray, n: int) -> None:
        """Every stage's slot 0 holds the KV of ids[:n] (what live_prefix and kv_save read)."""
        self._kept[:n] = ids[:n]
        self._kept_n = n

    def begin_decode(self) -> float:
        """A lone sequence's decode phase (max_seqs 1): chunk indices from 0, steps on the ring (no "taken"),
        by bell after the first. -> its t0."""
        self._new_phase("decode")
        self._decode_wait_s = 0.0  # waiting on the stages; the rest of decode_s is the head's own time
        self._bell_results = 0
        return time.perf_counter()

    def end_phase(self, phase: str) -> None:
        """A lone sequence's phase is over: each stage's timing of it (one round trip, for the report)."""
        self._collect_stats(phase)

    def send_step(self, pos: int, tok: int, t0: float) -> int:
        """A lone sequence's decode step (max_seqs 1, after begin_decode): its token at `pos` of slot 0's ids, one
        note to stage 0 (its bell after the phase's first step). -> its chunk index (wait_step)."""
        self._buffers.ids[pos] = tok
        if self.stages[0].host is not None:  # stage 0 is remote: it has its own copy of the ids
            self._wire.send(0, M.Token(pos=pos, id=tok))
        k = self._sent
        bells = self._buffers.bells
        if bells is not None and k > 0:  # a phase's first step goes by ZeroMQ: it wakes a stage not yet spinning
            bells.ring(0, k, pos, argmax=tok, t0=t0)  # the id too: a step queued ahead copies it from the bell
        else:
            self._wire.send(0, M.Chunk(k=k, pos=pos, n=1, phase="decode", t0=t0, tokens=pos + 1, score=-1))
        self._sent += 1
        return k

    def wait_step(self, k: int) -> M.ChunkResult:
        """Step k's result (send_step's): spinning on the head's bell without sleeping, the sockets and the stages'
        liveness looked at every BELL_CHECK_S, under stall_timeout_s. Its logits row is `result_row` until the next
        step goes down."""
        bells = self._buffers.bells
        t_wait = time.perf_counter()
        deadline = time.monotonic() + self.cfg.stall_timeout_s
        # all stages on GPUs: the head polls without sleeping for a while (as their stages do, DECODE_SPIN_S in
        # workers/stage.py): a token is back within milliseconds and a sleeping head wakes late on every one
        now = time.perf_counter()
        spin_end = now + (HEAD_SPIN_S if self.all_cuda else 0.0)
        checked = now
        while self._got < self._sent:
            if bells is not None:
                if self._take_bell():
                    continue
                now = time.perf_counter()
                if now < spin_end and now - checked < BELL_CHECK_S:
                    continue  # the bell alone; sockets and the stages' liveness every BELL_CHECK_S
                checked = now
                self._receive(0 if now < spin_end else 1)
            else:
                self._receive(0 if time.perf_counter() < spin_end else 200)
            if time.monotonic() > deadline:
                self._stalled()
        self._decode_wait_s += time.perf_counter() - t_wait
        return self._results.pop(k)

    def hold_token(self, pos: int, tok: int) -> None:
        """A lone sequence's step at `pos` is back: every stage's slot 0 holds its token's KV there."""
        self._kept[pos] = tok
        self._kept_n = pos + 1

    @property
    def result_row(self) -> torch.Tensor:
        """The last stage's logits row of the latest result (slot 0's)."""
        return self._result_row

    def lone_result(self, pre: dict, out: list[int], text, finish: str, decode_s: float, steps: int,
                    ttft) -> Result:
        """A lone sequence's Result and report (the loop calls it before the next sequence's phases begin)."""
        return self._result(pre, out, text, finish, decode_s, steps, ttft)

    def _result(self, pre: dict, out: list[int], text, finish: str, decode_s: float, steps: int, ttft) -> Result:
        from .report import build_report
        ppl = math.exp(pre["nll"] / pre["count"]) if pre["count"] else None
        cache = self.prefix_cache_stats()
        decode = {"decode_tokens": len(out), "decode_steps": steps, "decode_s": decode_s,
                  "decode_head_s": decode_s - self._decode_wait_s if steps else 0.0,
                  "decode_bell_steps": self._bell_results,
                  "decode_tok_s": steps / decode_s if decode_s > 0 and steps else 0.0,
                  "ttft_s": ttft, "finish_reason": finish,
                  # restored_tokens: of reused_tokens, those copied back from snapshots (the rest: the live KV)
                  "prefix_cache": {"restored_tokens": pre["restored"], "blocks": cache.blocks,
                                   "capacity_blocks": cache.capacity_blocks, "block_tokens": self._block,
                                   "off": self.prefix_cache_off}}
        report = build_report(self, pre["seconds"], ppl, out, text, ids=pre["ids"], schedule=pre["schedule"],
                              reused=pre["reused"], perplexity_tokens=pre["count"], decode=decode)
        return Result(report, out, text, ppl, pre["logits"], finish_reason=finish, prompt_tokens=int(pre["ids"].size),
                      reused_tokens=pre["reused"], prefill_s=pre["seconds"], decode_s=decode_s, ttft_s=ttft)

    def progress_bar(self, total: int):
        """The prefill's progress bar (the rig's `progress` on a console) -> (update(tokens through the last stage),
        close), or None."""
        if not (self.cfg.progress and self.console):
            return None
        from tqdm import tqdm
        bar = tqdm(total=total, unit="tok", unit_scale=True, desc="prefill", leave=False, dynamic_ncols=True)
        done = [0]

        def update(tokens: int) -> None:  # and which chunk each stage is on
            if tokens != done[0]:
                bar.update(tokens - done[0])
                done[0] = tokens
            bar.set_postfix_str(" ".join(f"s{s.index}:c{max(s.chunk, 0)}" for s in self.stages), refresh=False)
        return update, bar.close
