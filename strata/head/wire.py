"""The head's wire: its inbox (ipc, and tcp when a stage is remote), a PUSH to each stage, and the one
place a frame from a stage is accepted: decoded, checked, dispatched through the head's handler table,
or counted and dropped.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import zmq

from strata.comm import messages as M

HEAD_SPIN_S = 0.05  # the head's spin per decode step with GPU stages (a CPU rig has no core to spare)

HEAD_ACCEPTS = (M.Ready, M.Working, M.ChunkResult, M.Stats, M.Fail, M.KvDone)
NET_ACCEPTS = (M.Bound, M.Rejected)  # only while a stage is remote
log = logging.getLogger("strata.head.pipeline")


def poll_until(condition: Callable[[], bool], timeout_s: float, what: Callable[[], None], step: Callable[[], None],
               progress: Callable[[], object] | None = None) -> None:
    """Run `step` (receive and handle, bounded) until `condition()` holds. If `timeout_s` passes first
    (since the start, or since `progress()` last changed) `what()` is called: it raises, naming what
    did not happen. Every wait of the head for the stages' messages is this loop, except a decode step's
    (Pipeline.wait_step spins on the doorbell)."""
    deadline = time.monotonic() + timeout_s
    last = progress() if progress else None
    while not condition():
        step()
        if progress is not None and progress() != last:
            last, deadline = progress(), time.monotonic() + timeout_s
        elif time.monotonic() > deadline:
            what()


class HeadWire:
    def __init__(self, res, n_stages: int):
        self.n = n_stages
        self.ctx = res.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.MAXMSGSIZE, M.MAX_FRAME)
        res.socks.append(self.pull)
        self.endpoint = f"ipc://{res.ipc_dir}/head"
        self.pull.bind(self.endpoint)
        self.endpoints = [f"ipc://{res.ipc_dir}/s{i}" for i in range(n_stages)]
        self.res = res
        self.push: list[zmq.Socket] = []
        self.remote = None                   # strata.head.remote.RemoteStages when a stage is remote
        self.accepts = HEAD_ACCEPTS
        self.handlers: dict[type, Callable] = {}  # message type -> the head's handler (msg, data frame or None)
        self.land_result: Callable | None = None  # a remote last stage: lands the logits row sent with "result"
        self.bad_frames = 0                  # frames rejected (garbled, unknown, out of range)

    def connect(self, remote) -> None:
        """A PUSH to each stage: its ipc inbox, or a remote stage's tcp inbox once it says where (`bound`)."""
        self.remote = remote
        if remote is not None:
            self.accepts = HEAD_ACCEPTS + NET_ACCEPTS
        for i, ep in enumerate(self.endpoints):
            s = self.ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 0)
            if remote is not None and remote.remote[i]:
                remote.secure(s, i)
            else:
                s.connect(ep)
            self.res.socks.append(s)
            self.push.append(s)

    # -- out ----------------------------------------------------------------------------------------
    def send(self, i: int, msg: M.Message) -> None:
        self.push[i].send(M.encode(msg))

    def broadcast(self, msg: M.Message) -> None:
        for i in range(len(self.push)):
            self.send(i, msg)

    def stop_all(self) -> None:
        """Tell every stage to stop; a dead peer cannot be told, and that is fine."""
        for s in self.push:
            try:
                s.send(M.encode(M.Stop()), flags=zmq.NOBLOCK)
            except Exception:  # noqa: BLE001
                pass

    # -- in -----------------------------------------------------------------------------------------
    def poll(self, timeout_ms: int, sentinels: list) -> set:
        """Wait up to timeout_ms for a frame or a stage's exit; the sentinels that fired."""
        poller = zmq.Poller()
        poller.register(self.pull, zmq.POLLIN)
        if self.remote is not None:
            poller.register(self.remote.pull, zmq.POLLIN)
        for s in sentinels:
            poller.register(s, zmq.POLLIN)
        return {s for s, _ in poller.poll(timeout_ms) if not isinstance(s, zmq.Socket)}

    def take_all(self, only: tuple[type, ...] | None = None) -> None:
        """Accept every frame waiting (ipc, then tcp); `only`: handle just these types (the rest is read
        and dropped uncounted: a failure is being collected)."""
        while True:
            try:
                frame = self.pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            self.accept(frame, only=only)
        while self.remote is not None:
            try:
                parts = self.remote.pull.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            self.accept(parts[0].bytes, parts[1:], only=only)

    def drain(self, ms: int, only: tuple[type, ...]) -> None:
        """A stage has died: its typed failure (and its last working note) may still be in flight."""
        if self.pull.poll(ms, zmq.POLLIN):
            self.take_all(only)

    def accept(self, frame: bytes, data: list = (), only: tuple[type, ...] | None = None) -> None:
        """One frame: decoded and checked, then handled by its type's handler. Anything malformed, of a type
        the head does not take, naming a stage or chunk that does not exist, or (over tcp) with the wrong
        data frames is counted, logged and dropped, never acted on."""
        try:
            msg = M.decode(frame)
            t = type(msg)
            if t not in self.accepts:
                raise M.BadMessage(f"{msg.TYPE}: not a message the head accepts")
            stage = getattr(msg, "stage", None)
            if stage is not None and not 0 <= stage < self.n:
                raise M.BadMessage(f"{msg.TYPE}: no stage {stage}")
            if only is not None and t not in only:
                return
            with_rows = t is M.ChunkResult and self.land_result is not None
            if len(data) != with_rows:
                raise M.BadMessage(f"{msg.TYPE}: {len(data)} data frame(s)")
            self.handlers[t](msg, data[0] if with_rows else None)
        except M.BadMessage as e:
            self.bad_frames += 1
            if self.bad_frames <= 10 or self.bad_frames % 1000 == 0:
                log.warning("head rejected frame #%d: %s", self.bad_frames, e)
