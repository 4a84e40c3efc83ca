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
import re
import shutil
import signal
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import zmq

from . import messages as M
from .config import PromptSpec, RigConfig, check_run_dir, from_dict
from .errors import ConfigError, PipelineError
from .plan import Plan, build_plan

PAGE = 4096
IPC_PREFIX = "strata-ipc-"          # + head pid + "-": a later start removes the dirs of dead heads
HEAD_ACCEPTS = ("ready", "working", "result", "stats", "fail")
NET_ACCEPTS = ("bound", "rejected")  # only while a stage is remote
ROOT = Path(__file__).resolve().parents[1]  # the checkout: a remote stage runs `-m workers.stage` from here
log = logging.getLogger("strata.pipeline")


class Interrupted(BaseException):
    """SIGINT / SIGTERM to the head, raised at a safe point of the head's loop (see `interrupt`)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def sweep_dead_ipc_dirs() -> list[str]:
    """Remove per-run ipc directories left by heads that died without cleaning up (SIGKILL)."""
    removed = []
    base = Path(tempfile.gettempdir())
    pat = re.compile(rf"^{IPC_PREFIX}(\d+)-")
    try:
        entries = list(base.iterdir())
    except OSError:
        return removed
    for d in entries:
        m = pat.match(d.name)
        if not m:
            continue
        try:
            if d.stat().st_uid != os.getuid() or not d.is_dir():
                continue
            os.kill(int(m[1]), 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d.name)
        except OSError:
            continue
    return removed


def check_model_files(model: str) -> None:
    """Open every safetensors header before any process starts: a truncated or corrupt file, or one
    that lacks a tensor, is refused here in one line rather than in a stage. (GGUF files are checked
    tensor by tensor when their metadata is read; synthetic models have no files.)"""
    from .weights import ModelError, hf_name, model_args, resolve, wanted_names
    kind, loc = resolve(model)
    if kind != "hf":
        return
    from safetensors import SafetensorError, safe_open
    d = Path(loc)
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise ModelError(f"{d}: no *.safetensors files (pickled .bin checkpoints are refused)")
    keys: set[str] = set()
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                keys.update(sf.keys())
        except (SafetensorError, OSError) as e:
            raise ModelError(f"{f}: corrupt or truncated safetensors file ({e})") from None
    args = model_args(model)
    missing = [h for h in (hf_name(c) for c in wanted_names(args, 0, args.n_layers)) if h not in keys]
    if missing:
        raise ModelError(f"{d}: tensors missing from the checkpoint: {', '.join(missing[:3])}")


@dataclass
class StageInfo:
    index: int
    device: str
    layers: tuple[int, int]
    host: str | None = None    # None: this machine
    pid: int = 0
    mem_bytes: int = 0
    kv_bytes: int = 0
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
        self.net = None            # strata.net.HeadNet when a stage is remote

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
        if self.net is not None:
            self.net.stop()  # its thread, its sockets, the ZAP handler: before the context ends
            self.net = None
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
        check_model_files(self.cfg.model)
        self.out = Path(out or self.cfg.out or Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
        check_run_dir(self.out)
        self.console = console
        self.run_id = f"{os.getpid():x}{int(time.time() * 1000) % 0xFFFFFF:x}"
        self._res = _Resources()
        self._finalizer = weakref.finalize(self, self._res.release, 1.0)
        self.stages = [StageInfo(s.index, s.device, (s.start, s.end), s.host) for s in self.plan.stages]
        self.started = False
        self.closed = False
        self.failure: PipelineError | None = None
        self.bad_frames = 0            # frames the head rejected (garbled, unknown, out of range)
        self._signals: list[int] = []  # filled by `interrupt` (signal handlers), read at safe points
        self._signals_seen = 0
        self._sent = self._got = 0
        self._results: dict[int, dict] = {}
        self._last_logits = None
        self._net = None               # strata.net.HeadNet when a stage is remote
        self._accepts = HEAD_ACCEPTS
        self._bound: dict[int, str] = {}           # stage -> its tcp inbox
        self._stage_rejected: dict[int, int] = {}  # stage -> handshakes its tcp inbox refused
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

        from . import shm
        from workers.bootstrap import run_stage_process

        plan, cfg = self.plan, self.cfg
        shm.sweep_dead()
        sweep_dead_ipc_dirs()
        n = len(plan.stages)
        remote = [sp.host is not None for sp in plan.stages]
        across = [remote[i] or remote[i + 1] for i in range(n - 1)]  # boundary i (stage i -> i+1) leaves this host
        self.boundaries = ["tcp" if a else "shm" for a in across]
        sizes = {"ids": _page((plan.max_len + 1) * 4), "result": _page(plan.args.vocab_size * 4)}
        if remote[-1]:
            del sizes["result"]  # the last stage's logits come over tcp
        for i in range(n - 1):
            if not across[i]:
                sizes[f"b{i}"] = _page(plan.handoff_bytes())
        try:
            shm.check_room(sum(sizes.values()))
        except OSError as e:
            raise PipelineError(str(e)) from None
        self.out.mkdir(parents=True, exist_ok=True)
        res = self._res
        # mode 0700: only this user reaches the sockets (messages are validated, not authenticated)
        res.ipc_dir = tempfile.mkdtemp(prefix=f"{IPC_PREFIX}{os.getpid()}-")
        segs = {}
        for what, nbytes in sizes.items():
            seg = shm.Segment.create(shm.segment_name(self.run_id, what), nbytes)
            res.segments.append(seg)
            segs[what] = (seg.name, nbytes)
        self._ids = res.segments[0].tensor(torch.int32, (plan.max_len + 1,))
        from .transport import TcpLink
        self._result_link = TcpLink(torch.float32, (plan.args.vocab_size,)) if remote[-1] else None
        self._result_buf = (self._result_link.buf if remote[-1] else
                            res.segments[1].tensor(torch.float32, (plan.args.vocab_size,)))
        self._write_ids(plan.ids)

        res.ctx = zmq.Context()
        self._pull = res.ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.MAXMSGSIZE, M.MAX_FRAME)
        res.socks.append(self._pull)
        head_ep = f"ipc://{res.ipc_dir}/head"
        self._pull.bind(head_ep)
        endpoints = [f"ipc://{res.ipc_dir}/s{i}" for i in range(n)]
        if any(remote):
            from .config import split_listen
            from .net import HeadNet, curve_client, keypair
            keys = {i: keypair() for i in range(n)}  # this run's: nobody outside it holds one
            try:
                self._net = res.net = HeadNet(res.ctx, split_listen(cfg.listen), keys, {i for i in range(n) if remote[i]},
                                              plan.args.vocab_size * 4, cfg.heartbeat_s, cfg.heartbeat_timeout_s, log)
            except OSError as e:
                raise PipelineError(str(e)) from None
            self._accepts = HEAD_ACCEPTS + NET_ACCEPTS
        self._push = []
        for i, ep in enumerate(endpoints):
            s = res.ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 0)
            if remote[i]:  # its tcp inbox, once it says where that is ("bound")
                curve_client(s, self._net.public, self._net.secret, keys[i][0])
            else:
                s.connect(ep)
            res.socks.append(s)
            self._push.append(s)

        ctx = mp.get_context("spawn")  # not fork: CUDA cannot survive a fork
        args_dict = {f: getattr(plan.args, f) for f in plan.args.__dataclass_fields__}
        for sp in plan.stages:
            spec = dict(index=sp.index, n_stages=n, device=sp.device, dtype=cfg.dtype, attention=cfg.attention,
                        weights=cfg.weights, kv_dtype=cfg.kv_dtype, threads=sp.threads,
                        cores=list(sp.cores), start=sp.start, end=sp.end, model=cfg.model, args=args_dict,
                        seed=cfg.seed, max_len=plan.max_len, tokens=plan.tokens, max_chunk=plan.max_chunk,
                        depth=cfg.depth, perplexity=cfg.perplexity, segments=segs, endpoints=endpoints,
                        head_endpoint=head_ep, log_file=str(self.out / f"stage-{sp.index}.log"),
                        console=self.console,
                        dump_residual=str(self.out / "residual.npy") if cfg.dump_residual else "",
                        debug={f: getattr(cfg.debug, f) for f in cfg.debug.__dataclass_fields__})
            spec["net"] = self._stage_net(sp.index, remote, across, keys) if self._net else None
            if remote[sp.index]:
                res.procs.append(self._launch_remote(sp, spec))
                self.stages[sp.index].pid = res.procs[-1].pid
                continue
            parent_end, child_end = ctx.Pipe(duplex=False)  # EOF on child_end's peer = head gone
            proc = ctx.Process(target=run_stage_process, args=(spec, parent_end), name=f"strata-stage-{sp.index}",
                               daemon=True)
            proc.start()
            parent_end.close()
            res.procs.append(proc)
            res.conns.append(child_end)
            self.stages[sp.index].pid = proc.pid
        self.started = True
        if self._net:
            self._net.start()  # joins are served from here on
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
                elif msg["t"] == "bound" and msg["stage"] not in self._bound and msg["endpoint"].startswith("tcp://"):
                    self._bound[msg["stage"]] = msg["endpoint"]
                    if remote[msg["stage"]]:
                        self._push[msg["stage"]].connect(msg["endpoint"])
        if self._net:
            self._send_peers(remote, across, keys)
            # where everything listens, with public keys only: for operators (and the tests' intruders)
            import json
            (self.out / "net.json").write_text(json.dumps({
                "listen": cfg.listen, "join": self._net.join_endpoint, "notes": self._net.pull_endpoint,
                "head_public": self._net.public, "boundaries": self.boundaries,
                "stages": [{"index": i, "host": self.plan.stages[i].host or "local", "endpoint": self._bound.get(i, ""),
                            "public": keys[i][0]} for i in range(n)]}, indent=1))
        # every stage has mapped its buffers: unlink now, so even SIGKILL leaks nothing
        for seg in res.segments:
            seg.unlink()

    # -- stages on other hosts -----------------------------------------------------------------
    def _stage_net(self, i: int, remote: list[bool], across: list[bool], keys: dict) -> dict:
        """What stage i needs to know about the network (spec["net"]): which of its boundaries cross
        hosts, its keypair, who may connect to its tcp inbox, the head's tcp side, the heartbeats."""
        from .config import split_listen
        n, net = len(remote), self._net
        tcp_in = i > 0 and across[i - 1]
        tcp_out = across[i] if i < n - 1 else remote[i]  # a remote last stage sends its logits over tcp
        allow = [keys[j][0] for j in (i - 1, i + 1) if 0 <= j < n and (remote[i] or remote[j])]
        if remote[i]:
            allow.append(net.public)
        return {"host": self.plan.stages[i].host or "local", "remote": remote[i],
                "bind": "" if remote[i] else split_listen(self.cfg.listen)[0],
                "tcp_in": tcp_in, "tcp_out": tcp_out, "tcp_inbox": remote[i] or tcp_in or (i < n - 1 and across[i]),
                "public": keys[i][0], "secret": "" if remote[i] else keys[i][1],  # a remote stage brings its own
                "head_public": net.public, "allow": allow, "head_tcp": net.pull_endpoint,
                "heartbeat_s": self.cfg.heartbeat_s, "heartbeat_timeout_s": self.cfg.heartbeat_timeout_s,
                "head_clock": 0.0, "boot_id": ""}  # both filled in when it joins

    def _launch_remote(self, sp, spec: dict):
        """Offer stage sp's spec for its join, then start it through `remote_command` (or print how)."""
        from .net import PrintedStage, RemoteProc, join_key, remote_argv, stage_command
        net, i = self._net, sp.index
        spec.update(segments={}, endpoints=[], head_endpoint=net.pull_endpoint, log_file="", console=False)
        net.offer(i, spec, self.plan.ids.astype("<i4").tobytes())
        key = join_key(net.public, *net.stage_keys[i])
        if self.cfg.remote_command == "print":
            print(f"stage {i} runs on {sp.host}: start it there (from a checkout of Strata at {ROOT}) within "
                  f"{self.cfg.ready_timeout_s:.0f}s with\n  {stage_command(sys.executable, net.join_endpoint, key)}",
                  file=sys.stderr, flush=True)
            return PrintedStage()
        argv = remote_argv(self.cfg.remote_command, dict(host=sp.host, python=sys.executable, cwd=str(ROOT),
                                                         join=net.join_endpoint, key="-", stage=i))
        log.info("stage %d on %s: %s", i, sp.host, " ".join(argv))
        try:
            return RemoteProc(argv, key, self.out / f"stage-{i}.log", cwd=str(ROOT))
        except OSError as e:
            self._fail(f"stage {i} ({sp.device} on {sp.host}): remote_command {argv[0]!r} did not start: {e}")

    def _send_peers(self, remote: list[bool], across: list[bool], keys: dict) -> None:
        """Every stage has bound and is ready: tell each one with a neighbour across hosts where it listens."""
        n = len(remote)
        for i in range(n):
            up = i > 0 and across[i - 1]
            down = i < n - 1 and across[i]
            if not (up or down):
                continue
            missing = [j for j, want in ((i - 1, up), (i + 1, down)) if want and j not in self._bound]
            if missing:
                self._fail(f"{self._who(missing[0])} is ready but never said where it listens")
            self._send(i, "peers", up=self._bound[i - 1] if up else "", up_key=keys[i - 1][0] if up else "",
                       down=self._bound[i + 1] if down else "", down_key=keys[i + 1][0] if down else "")

    def _recv_tcp(self) -> list[dict]:
        """Notes from remote stages (already authenticated); a result comes with the last row's logits."""
        out = []
        while True:
            try:
                parts = self._net.pull.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return out
            msg = self._accept(parts[0].bytes)
            if msg is None:
                continue
            try:
                with_rows = msg["t"] == "result" and self._result_link is not None
                if len(parts) != 1 + with_rows:
                    raise M.BadMessage(f"{msg['t']}: {len(parts) - 1} data frame(s)")
                if with_rows:
                    self._result_link.land(self._result_buf.numel(), parts[1])
            except M.BadMessage as e:
                self.bad_frames += 1
                log.warning("head rejected frame #%d: %s", self.bad_frames, e)
                continue
            out.append(msg)

    def _check_remote(self) -> None:
        """Remote stages: their pids once joined; one silent past the deadline fails the run."""
        if self._net.error:
            self._fail(f"the head's network thread failed: {self._net.error}")
        for i, j in self._net.joins().items():
            self.stages[i].pid = j["pid"]
        silent = self._net.silent()
        if silent:
            i, age = silent[0]
            self._fail(f"{self._who(i)} went silent: no heartbeat for {age:.1f}s "
                       f"(heartbeat_timeout_s {self.cfg.heartbeat_timeout_s:g})")

    @property
    def rejected_connections(self) -> int:
        """Handshakes refused on this run's tcp sockets (no key, a wrong key): the head's and the stages'."""
        return (self._net.gate.count if self._net else 0) + sum(self._stage_rejected.values())

    def _refuse_if_closed(self) -> None:
        if self.closed:
            raise PipelineError("this pipeline is closed (its stages have stopped): make a new Pipeline")

    def close(self) -> None:
        """Stop every stage and release everything; idempotent."""
        self.closed = True
        if self._res.procs:
            for s in getattr(self, "_push", []):
                try:
                    s.send(M.encode("stop"), flags=zmq.NOBLOCK)
                except Exception:  # noqa: BLE001 - a dead peer cannot be told
                    pass
        self._finalizer()

    def interrupt(self, signum: int) -> None:
        """Ask the head to stop (safe from a signal handler: it only records the signal). The head
        raises `Interrupted` at its next safe point, within ~0.2 s, then joins chunks in flight."""
        self._signals.append(signum)

    def _check_interrupt(self) -> None:
        if len(self._signals) > self._signals_seen:
            self._signals_seen = len(self._signals)
            raise Interrupted(self._signals[-1])

    # -- messages ----------------------------------------------------------------------------
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
        """Every stage with its device, pid and the chunk it last started."""
        return ", ".join(self._who(i) for i in range(len(self.stages)))

    def _fail(self, why: str) -> None:
        self.failure = self.failure or PipelineError(why)
        raise self.failure

    def _recv(self, timeout_ms: int) -> list[dict]:
        """Messages that arrive within timeout_ms; a dead stage or a typed failure raises."""
        if self.failure:
            raise self.failure
        self._check_interrupt()  # only here: never between receiving a message and handling it
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        if self._net is not None:
            poller.register(self._net.pull, zmq.POLLIN)
        for p in self._res.procs:
            if p.sentinel is not None:  # a stage started by hand has none: heartbeats watch it
                poller.register(p.sentinel, zmq.POLLIN)
        events = dict(poller.poll(timeout_ms))
        out = []
        while True:
            try:
                frame = self._pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            msg = self._accept(frame)
            if msg is not None:
                out.append(msg)
        if self._net is not None:
            out += self._recv_tcp()
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
        if self._net is not None:
            self._check_remote()
        return out

    def _accept(self, frame: bytes) -> dict | None:
        """One frame from the head's socket: a typed failure fails the run; a working note moves the
        stage's chunk; anything malformed, of a type the head does not take, or naming a stage or
        chunk that does not exist is counted, logged and dropped (never acted on)."""
        try:
            msg = M.decode(frame)
            t = msg["t"]
            if t not in self._accepts:
                raise M.BadMessage(f"{t}: not a message the head accepts")
            if "stage" in msg and not 0 <= msg["stage"] < len(self.stages):
                raise M.BadMessage(f"{t}: no stage {msg['stage']}")
            if t == "result" and not (0 <= msg["k"] < self._sent and msg["k"] not in self._results):
                raise M.BadMessage(f"result: chunk {msg['k']} is not in flight")
        except M.BadMessage as e:
            self.bad_frames += 1
            if self.bad_frames <= 10 or self.bad_frames % 1000 == 0:
                log.warning("head rejected frame #%d: %s", self.bad_frames, e)
            return None
        if t == "fail":
            st = self.stages[msg["stage"]]
            st.chunk = msg["chunk"] if msg["chunk"] >= 0 else st.chunk
            self._fail(f"{self._who(msg['stage'])} failed: {msg['error']}: {msg['message']}")
        if t == "working":
            self.stages[msg["stage"]].chunk = msg["k"]
        if t == "rejected":
            self._stage_rejected[msg["stage"]] = max(msg["count"], self._stage_rejected.get(msg["stage"], 0))
            log.warning("stage %d refused a connection (%d so far): %s", msg["stage"], msg["count"], msg["detail"])
        return msg

    def _drain_for_failure(self, ms: int) -> None:
        """A stage has died: its typed failure (and its last working note) may still be in flight."""
        if self._pull.poll(ms, zmq.POLLIN):
            while True:
                try:
                    frame = self._pull.recv(zmq.NOBLOCK)
                except zmq.Again:
                    return
                self._accept(frame)

    def _send(self, i: int, type_: str, **fields) -> None:
        self._push[i].send(M.encode(type_, **fields))

    def _broadcast(self, type_: str, **fields) -> None:
        for i in range(len(self._push)):
            self._send(i, type_, **fields)

    def _write_ids(self, ids: np.ndarray) -> None:
        self._ids[: ids.size] = torch.from_numpy(ids.astype(np.int32))

    # -- the run -----------------------------------------------------------------------------
    def _handle(self, msg: dict) -> None:
        if msg["t"] == "result":
            self._results[msg["k"]] = msg
            self._last_logits = self._result_buf.numpy().copy()
            self._send(len(self.stages) - 1, "taken", k=msg["k"])
            self._got += 1
        elif msg["t"] == "stats":
            self.stages[msg["stage"]].stats[msg["phase"]] = msg

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
            if p.is_alive() and isinstance(p, mp.process.BaseProcess):  # not a remote stage's ssh
                os.kill(p.pid, signal.SIGUSR1)
        time.sleep(0.5)
        where = ", ".join(self._who(i) for i in range(len(self.stages)))
        self._fail(f"no progress for {self.cfg.stall_timeout_s:.0f}s (stacks dumped to the stage logs): {where}")

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
        try:
            deadline = time.monotonic() + self.cfg.stall_timeout_s
            while self._got < len(schedule):
                while self._sent < len(schedule) and self._sent - self._got < window:
                    pos, m = schedule[self._sent]
                    self._send(0, "chunk", k=self._sent, pos=pos, n=m, phase=phase, t0=t0)
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
            # (a second SIGINT/SIGTERM through `interrupt` raises Interrupted here and abandons the join)
            if not self.failure:
                try:
                    self.finish()
                except KeyboardInterrupt:
                    self._fail("interrupted while joining chunks in flight")
        seconds = time.perf_counter() - t0
        if phase != "prefill":  # only the prefill's timing is reported; a decode step needs no round trip
            return seconds
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
            if self.stages[0].host is not None:  # stage 0 is remote: it has its own copy of the ids
                self._send(0, "token", pos=pos, id=tok)
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
