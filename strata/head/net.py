"""The head's side of stages on other hosts: its tcp listener (joins, heartbeats) and the remote stages' launchers.

Joining. A remote stage is started as `python -m workers.join --join tcp://HEAD:PORT --key KEY`
(KEY: the head's public key and the stage's keypair, hex; `-` reads it from stdin). It connects a
DEALER to the head's control ROUTER, says `join`, and gets its spec (msgpack, validated) and the
prompt's token ids; the head knows which stage it is by the CURVE key it authenticated with.

Heartbeats. The same control sockets carry `hb` both ways every `heartbeat_s`, each end in a thread
of its own (a stage computing a long chunk still answers). A remote stage silent for
`heartbeat_timeout_s` fails the run naming its host; a stage whose head is silent that long exits
(`workers.join.HeadWatch`).
"""
from __future__ import annotations

import logging
import os
import subprocess
import threading
import time
from dataclasses import replace
from pathlib import Path

import zmq

from strata.comm import messages as M
from strata.comm.curve import Gate, bind_tcp, boot_id, curve_server, keypair


class HeadNet:
    """The head's tcp side when a stage is remote: a PULL for the stages' notes (and the last stage's
    logits) and a control ROUTER for joins and heartbeats, both CURVE servers on `listen`.

    The control socket and every monitor belong to a thread (`_serve`); the main thread owns `pull`.
    """

    def __init__(self, ctx: zmq.Context, listen: tuple[str, int | None], stage_keys: dict[int, tuple[str, str]],
                 remote: set[int], max_frame: int, heartbeat_s: float, timeout_s: float, logger: logging.Logger):
        self.public, self.secret = keypair()
        self.stage_keys = stage_keys
        self.remote = set(remote)
        self.heartbeat_s, self.timeout_s = heartbeat_s, timeout_s
        self.log = logger
        self.thread: threading.Thread | None = None
        self.stopping = threading.Event()
        self.stage_of = {stage_keys[i][0]: i for i in self.remote}
        self.gate = Gate(ctx, self.stage_of, logger)  # only remote stages connect to the head over tcp
        address, port = listen
        self.pull = curve_server(ctx.socket(zmq.PULL), self.public, self.secret)
        self.pull.setsockopt(zmq.MAXMSGSIZE, max(M.MAX_FRAME, max_frame))
        self.pull.setsockopt(zmq.LINGER, 0)
        self.control = curve_server(ctx.socket(zmq.ROUTER), self.public, self.secret)
        self.control.setsockopt(zmq.MAXMSGSIZE, M.MAX_FRAME)
        self.control.setsockopt(zmq.LINGER, 0)
        try:
            self.gate.watch(self.pull, "notes")
            self.pull_endpoint = bind_tcp(self.pull, address)
            self.gate.watch(self.control, "join")
            self.join_endpoint = bind_tcp(self.control, address, port)
        except zmq.ZMQError as e:
            self.stop()
            raise OSError(f"listen: cannot bind tcp on {address}{':' + str(port) if port else ''}: {e}") from None
        self.offers: dict[int, tuple[dict, bytes]] = {}
        self.joined: dict[int, dict] = {}    # stage -> {pid, host, ident, t}; read by the main thread
        self.last_seen: dict[int, float] = {}
        self.lock = threading.Lock()
        self.error = ""  # set if the thread died: the main thread fails the run with it

    def offer(self, i: int, spec: M.StageJob, ids: bytes) -> None:
        """What stage i gets when it joins (its spec, the prompt's ids); before `start`."""
        self.offers[i] = (spec, ids)

    def start(self) -> None:
        self.thread = threading.Thread(target=self._serve, name="head-net", daemon=True)
        self.thread.start()

    def silent(self) -> list[tuple[int, float]]:
        """Joined remote stages not heard from within the timeout: (stage, seconds silent)."""
        now = time.monotonic()
        with self.lock:
            return [(i, now - t) for i, t in self.last_seen.items() if now - t > self.timeout_s]

    def joins(self) -> dict[int, dict]:
        with self.lock:
            return dict(self.joined)

    def _serve(self) -> None:
        try:
            self._loop()
        except Exception as e:  # noqa: BLE001 - reported to the main thread, which fails the run
            self.error = f"{type(e).__name__}: {e}"
            self.log.exception("the head's network thread failed")

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.control, zmq.POLLIN)
        for mon, _ in self.gate.monitors:
            poller.register(mon, zmq.POLLIN)
        next_beat = time.monotonic()
        while not self.stopping.is_set():
            poller.poll(max(0, min(100, int((next_beat - time.monotonic()) * 1000))))
            self.gate.drain()
            while True:
                try:
                    parts = self.control.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self._control(parts)
            if time.monotonic() >= next_beat:
                next_beat = time.monotonic() + self.heartbeat_s
                with self.lock:
                    idents = [(i, j["ident"]) for i, j in self.joined.items()]
                for i, ident in idents:
                    try:
                        self.control.send_multipart([ident, M.encode(M.Heartbeat(stage=i))], zmq.NOBLOCK)
                    except zmq.ZMQError:
                        pass  # gone: its silence is noticed on this side too

    def _control(self, parts) -> None:
        if len(parts) != 2:
            self.log.warning("control: dropped a message of %d frames", len(parts))
            return
        ident, frame = parts[0].bytes, parts[1]
        i = self.stage_of.get(frame.get("User-Id"))  # the CURVE key it authenticated with
        try:
            msg = M.decode(frame.bytes)
        except M.BadMessage as e:
            self.log.warning("control: rejected frame from stage %s: %s", i, e)
            return
        if i is None:
            return
        if isinstance(msg, M.Heartbeat):
            with self.lock:
                if self.joined.get(i, {}).get("ident") == ident:
                    self.last_seen[i] = time.monotonic()
            return
        if not isinstance(msg, M.Join):
            self.log.warning("control: stage %d sent %r", i, msg.TYPE)
            return
        with self.lock:
            again = i in self.joined
        if again:  # one join per stage and run: a second (a copy of the key) is refused
            self.log.warning("control: stage %d joined already; refused a second join from %s", i, msg.host)
            return
        spec, ids = self.offers[i]
        spec = replace(spec, net=replace(spec.net, head_clock=time.perf_counter(), boot_id=boot_id()))
        self.control.send_multipart([ident, M.encode_spec(spec), ids])
        with self.lock:
            self.joined[i] = {"pid": msg.pid, "host": msg.host, "ident": ident, "t": time.monotonic()}
            self.last_seen[i] = time.monotonic()
        self.log.info("stage %d joined from %s (pid %d)", i, msg.host, msg.pid)

    def stop(self) -> None:
        """Stop the thread and close the control socket, the notes socket and the gate."""
        self.stopping.set()
        if self.thread is not None and self.thread.is_alive():
            self.thread.join(5.0)
        for s in (self.control, self.pull):
            if not s.closed:
                s.close(linger=0)
        self.gate.stop()



# -- launching remote stages --------------------------------------------------------------------------
class RemoteProc:
    """A remote stage's launcher process (`remote_command`: ssh, ip netns exec, ...), watched like a
    local stage: a pidfd is its sentinel; its stdout and stderr (the stage's log) go to `log_path`."""

    def __init__(self, argv: list[str], key: str, log_path: Path, cwd: str):
        self.log_file = open(log_path, "ab")
        # a session of its own: Ctrl-C at the terminal is the head's to handle, not ssh's
        self.popen = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=self.log_file, stderr=subprocess.STDOUT,
                                      cwd=cwd, start_new_session=True)
        self.pid = self.popen.pid
        try:
            self.popen.stdin.write((key + "\n").encode())
            self.popen.stdin.close()
        except OSError:
            pass  # it died already; the head sees the exit code
        try:
            self.sentinel = os.pidfd_open(self.pid)
        except (AttributeError, OSError):
            self.sentinel = None  # the head still polls is_alive() every loop

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        if self.popen.returncode is not None:
            self._close()

    def terminate(self) -> None:
        if self.is_alive():
            self.popen.terminate()

    def kill(self) -> None:
        if self.is_alive():
            self.popen.kill()

    def _close(self) -> None:
        if self.sentinel is not None:
            os.close(self.sentinel)
            self.sentinel = None
        self.log_file.close()


class PrintedStage:
    """A remote stage a person starts by hand (`remote_command: print`): nothing to watch but heartbeats."""

    sentinel = None
    exitcode = None
    pid = 0

    def is_alive(self) -> bool:
        return True

    def join(self, timeout: float | None = None) -> None:
        pass

    def terminate(self) -> None:
        pass

    def kill(self) -> None:
        pass


def remote_argv(template: str, fields: dict) -> list[str]:
    """`remote_command` -> argv: split like a shell line, then each word filled in (no shell runs it)."""
    import shlex
    return [w.format(**fields) for w in shlex.split(template)]


def stage_command(python: str, join_endpoint: str, key: str) -> str:
    """The exact command that starts a remote stage by hand."""
    import shlex
    return shlex.join([python, "-m", "workers.join", "--join", join_endpoint, "--key", key])
