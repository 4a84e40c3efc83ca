"""The head's stages as processes: spawned, made ready, watched, named in failures, stopped; and the wire to them.

`StageSet` owns what a run creates (strata/head/procs.py's `Resources`, released through `weakref.finalize`
however the run ends), the shared buffers, the head's wire (strata/head/wire.py) with its handler table, remote
stages (strata/head/remote.py), and the head's receive loop: it handles the messages about the stages themselves
(ready, bound, working, stats, failures, rejected handshakes) and hands the rest to the handlers its owner gives
`start` (the Pipeline's results, KvRounds' answers). It knows nothing of chunks or prompts beyond naming, in a
failure, the chunk each stage is on (`oldest`: the oldest chunk in flight, the owner's count).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from strata.comm import messages as M
from strata.errors import PipelineError
from strata.head.wire import HeadWire, poll_until
from strata.head.procs import Buffers, Resources, spawn_local, sweep_dead_ipc_dirs


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
    state_bytes: int = 0         # linear-attention states
    weight_bytes: int = 0
    scratch_bytes: int = 0
    weights: str = ""
    warm_s: float = 0.0
    pinned: bool = False
    load_s: float = 0.0
    chunk: int = -1            # the chunk it last said it started, this phase ("working"; a typed failure's)
    stats: dict = field(default_factory=dict)


class StageSet:
    """One run's stage processes and the head's wire to them.

    marks: the owner's start-up times (spawn, spawned, ready are written here); oldest: the oldest chunk the head
    sent and has not got back, -1 for none (a failure names the chunk each stage is on by it)."""

    def __init__(self, cfg, plan, out: Path, console: bool, run_id: str, marks: dict[str, float],
                 oldest: Callable[[], int]):
        self.cfg, self.plan, self.out, self.console, self.run_id = cfg, plan, out, console, run_id
        self._marks, self._oldest = marks, oldest
        self.res = Resources()
        self._finalizer = weakref.finalize(self, self.res.release, 1.0)
        self.stages = [StageInfo(s.index, s.device, (s.start, s.end), s.host) for s in plan.stages]
        self.all_cuda = plan.resolved.all_cuda  # (the head's spins read it)
        self.started = False
        self.closed = False
        self.failure: PipelineError | None = None
        self._signals: list[int] = []  # filled by `interrupt` (signal handlers), read at safe points
        self._signals_seen = 0
        self._ready: set[int] = set()
        self.wire: HeadWire | None = None
        self.buffers: Buffers | None = None
        self.result_rows: torch.Tensor | None = None  # the last stage's logits rows (max_seqs or 1, vocab)
        self._remote = None            # strata.head.remote.RemoteStages when a stage is remote
        self.boundaries: list[str] = []            # per boundary: "shm" or "tcp"

    # -- start ---------------------------------------------------------------------------------
    def start(self, handlers: dict[type, Callable]) -> None:
        """Spawn the stages and wait until each has loaded its slice and mapped its buffers. handlers: the owner's,
        by message type, beside this set's own (ChunkResult, KvDone)."""
        self._marks["spawn"] = time.perf_counter()
        sweep_dead_ipc_dirs()
        remote = [sp.host is not None for sp in self.plan.stages]
        across = [remote[i] or remote[i + 1] for i in range(len(remote) - 1)]  # boundary i leaves this host
        self.boundaries = ["tcp" if a else "shm" for a in across]
        self.buffers = Buffers(self.res, self.run_id, self.plan, remote, across)
        self.buffers.ids[: self.plan.ids.size] = torch.from_numpy(self.plan.ids.astype(np.int32))
        self.out.mkdir(parents=True, exist_ok=True)
        self.res.make_ipc_dir()
        self.wire = HeadWire(self.res, len(remote))
        if any(remote):
            from strata.head.remote import RemoteStages
            self._remote = RemoteStages(self.res, self.cfg, self.plan, remote, across)
        self.wire.connect(self._remote)
        self.wire.handlers = {M.Ready: self._on_ready, M.Bound: self._on_bound, M.Working: self._on_working,
                              M.Stats: self._on_stats, M.Fail: self._on_fail, M.Rejected: self._on_rejected,
                              **handlers}
        self.result_rows = self._result_buffer(remote[-1])
        for sp in self.plan.stages:
            self.stages[sp.index].pid = self._launch(sp, self._spec(sp))
        self.started = True
        self._marks["spawned"] = time.perf_counter()
        self._wait_ready()
        if self._remote:
            self._link_remote()
        self._marks["ready"] = time.perf_counter()

    def unlink_segments(self) -> None:
        """Every stage has mapped its buffers: unlink them now, so even SIGKILL leaks nothing."""
        for seg in self.res.segments:
            seg.unlink()

    def _result_buffer(self, remote_last: bool) -> torch.Tensor:
        """The last stage's logits rows: a shared segment, or (a remote last stage) a buffer its row lands in."""
        if not remote_last:
            return self.buffers.result
        from strata.comm.transport import TcpLink
        link = TcpLink(torch.float32, (self.plan.args.vocab_size,))
        self.wire.land_result = lambda frame: link.land(link.buf.numel(), frame)
        return link.buf.view(1, -1)

    def _spec(self, sp) -> M.StageJob:
        """What stage sp needs to build and serve its slice (validated again by a remote stage on arrival)."""
        plan, cfg, w = self.plan, self.cfg, self.wire
        return M.StageJob(
            index=sp.index, n_stages=len(plan.stages), device=sp.device, dtype=cfg.dtype,
            attention=plan.resolved.attention,
            weights=cfg.weights, kv_dtype=cfg.kv_dtype, memory=sp.memory, threads=sp.threads, cores=list(sp.cores), start=sp.start,
            end=sp.end, model=cfg.model, args={f: getattr(plan.args, f) for f in plan.args.__dataclass_fields__},
            seed=cfg.seed, max_len=plan.max_len, tokens=plan.tokens, max_chunk=plan.max_chunk,
            prefix_block=sp.prefix_block,
            dynamic_chunks=cfg.dynamic_chunks, depth=cfg.depth,
            max_seqs=cfg.max_seqs, kv_pool=plan.kv_pool, decode_batch=cfg.decode_batch,
            prefix_device_bytes=plan.planner.get("needs", [{}] * len(plan.stages))[sp.index].get("prefix_cache", 0),
            perplexity=cfg.perplexity, segments=self.buffers.names, endpoints=w.endpoints, head_endpoint=w.endpoint,
            log_file=str(self.out / f"stage-{sp.index}.log"), console=self.console,
            dump_residual=str(self.out / "residual.npy") if cfg.dump_residual else "",
            decode_weights=cfg.decode_weights, cuda_graphs=cfg.cuda_graphs,
            decode_ahead=plan.resolved.decode_ahead,
            # (slot_spin as the plan resolved it: only where every stage is on a GPU, as the head's loop spins: a
            # CUDA stage beside CPU ones would take a core from their threads; the bells' choices are the segments
            # and decode_ahead above)
            kernels={**{f: getattr(cfg.kernels, f) for f in cfg.kernels.__dataclass_fields__},
                     "slot_spin": plan.resolved.slot_spin},
            debug={f: getattr(cfg.debug, f) for f in cfg.debug.__dataclass_fields__},
            net=self._remote.stage_net(sp.index) if self._remote else None)

    def _launch(self, sp, spec: M.StageJob) -> int:
        if sp.host is None:
            return spawn_local(self.res, spec, sp.index)
        try:
            proc = self._remote.launch(sp, spec, self.out)
        except PipelineError as e:
            self.fail(str(e))
        self.res.procs.append(proc)
        return proc.pid

    def _wait_ready(self) -> None:
        if self._remote:
            self._remote.net.start()  # joins are served from here on
        n = len(self.stages)
        poll_until(lambda: len(self._ready) == n, self.cfg.ready_timeout_s, step=lambda: self.receive(200),
                   what=lambda: self.fail(f"stage(s) not ready within {self.cfg.ready_timeout_s:.0f}s: "
                                          + ", ".join(self.who(i) for i in range(n) if i not in self._ready)))

    def _link_remote(self) -> None:
        """Tell each stage with a neighbour across hosts where it listens; write net.json."""
        try:
            peers = self._remote.peers()
        except LookupError as e:
            self.fail(f"{self.who(e.args[0])} is ready but never said where it listens")
        for i, p in peers.items():
            self.wire.send(i, M.Peers(**p))
        self._remote.write_net_json(self.out / "net.json", self.boundaries)

    @property
    def bad_frames(self) -> int:
        """Frames the head rejected (garbled, unknown, out of range)."""
        return self.wire.bad_frames if self.wire else 0

    @property
    def rejected_connections(self) -> int:
        """Handshakes refused on this run's tcp sockets (no key, a wrong key): the head's and the stages'."""
        return self._remote.rejected_connections if self._remote else 0

    # -- stop ----------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop every stage and release everything; idempotent."""
        self.closed = True
        if self.res.procs and self.wire is not None:
            self.wire.stop_all()
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
        return max(self.stages[i].chunk, self._oldest())

    def who(self, i: int) -> str:
        """Stage i as a failure names it: device (and host), pid, the chunk it is on."""
        st = self.stages[i]
        where = f"{st.device} on {st.host}" if st.host else st.device
        return f"stage {i} ({where}, pid {st.pid}, chunk {self._chunk_of(i)})"

    def where(self) -> str:
        """Every stage with its device, pid and the chunk it is on."""
        return ", ".join(self.who(i) for i in range(len(self.stages)))

    def fail(self, why: str) -> None:
        """The run has failed (the first failure is the one kept): raise it."""
        self.failure = self.failure or PipelineError(why)
        raise self.failure

    def stalled(self) -> None:
        """No progress within stall_timeout_s: dump every stage's stacks into its log, then fail naming where each
        one was."""
        for p in self.res.procs:
            if p.is_alive() and isinstance(p, mp.process.BaseProcess):  # not a remote stage's ssh
                os.kill(p.pid, signal.SIGUSR1)
        time.sleep(0.5)
        self.fail(f"no progress for {self.cfg.stall_timeout_s:.0f}s (stacks dumped to the stage logs): "
                  f"{self.where()}")

    # -- receiving -----------------------------------------------------------------------------
    def send(self, i: int, msg: M.Message) -> None:
        """One message to stage i."""
        self.wire.send(i, msg)

    def receive(self, timeout_ms: int) -> None:
        """Handle what arrives within timeout_ms; a dead stage, a silent remote one or a typed failure raises."""
        if self.failure:
            raise self.failure
        self._check_interrupt()  # only here: never between receiving a message and handling it
        procs = self.res.procs
        fired = self.wire.poll(timeout_ms, [p.sentinel for p in procs if p.sentinel is not None])
        self.wire.take_all()
        for i, p in enumerate(procs):  # a stage started by hand has no sentinel: heartbeats watch it
            if (p.sentinel is not None and p.sentinel in fired) or not p.is_alive():
                p.join(0.1)
                if p.exitcode is None:
                    continue
                self.wire.drain(500, only=(M.Fail, M.Working))  # its typed failure may still be in flight
                code = p.exitcode
                how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
                self.fail(f"{self.who(i)} {how}")
        if self._remote is not None:
            pids: dict[int, int] = {}
            problem = self._remote.problem(pids)
            for i, pid in pids.items():
                self.stages[i].pid = pid
            if problem:
                i, why = problem
                self.fail(why if i is None else f"{self.who(i)} {why}")

    def wait_for(self, condition: Callable[[], bool]) -> None:
        """Receive and handle the stages' messages until condition() holds, under stall_timeout_s (KvRounds' wait for
        its rounds' answers: with several sequences other slots' results are kept for take_results meanwhile)."""
        poll_until(condition, self.cfg.stall_timeout_s, what=self.stalled, step=lambda: self.receive(100))

    # -- the handlers of messages about the stages themselves -----------------------------------------
    def _on_ready(self, msg: M.Ready, data) -> None:
        st = self.stages[msg.stage]
        st.mem_bytes, st.kv_bytes, st.pinned, st.load_s = msg.mem_bytes, msg.kv_bytes, msg.pinned, msg.load_s
        st.weights, st.weight_bytes, st.scratch_bytes = msg.weights, msg.weight_bytes, msg.scratch_bytes
        st.warm_s, st.state_bytes = msg.warm_s, msg.state_bytes
        self._ready.add(msg.stage)

    def _on_bound(self, msg: M.Bound, data) -> None:
        self._remote.on_bound(msg.stage, msg.endpoint, self.wire.push[msg.stage])

    def _on_working(self, msg: M.Working, data) -> None:
        self.stages[msg.stage].chunk = msg.k

    def _on_stats(self, msg: M.Stats, data) -> None:
        self.stages[msg.stage].stats[msg.phase] = msg

    def _on_fail(self, msg: M.Fail, data) -> None:
        st = self.stages[msg.stage]
        st.chunk = msg.chunk if msg.chunk >= 0 else st.chunk
        self.fail(f"{self.who(msg.stage)} failed: {msg.error}: {msg.message}")

    def _on_rejected(self, msg: M.Rejected, data) -> None:
        self._remote.on_rejected(msg.stage, msg.count, msg.detail)
