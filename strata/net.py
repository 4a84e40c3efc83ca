"""Stages on other hosts: keys, the head's listening side, joins, heartbeats, remote launch.

Only a run with a remote stage (`stages[i].host`) touches this module; everything else stays on
ipc sockets in a 0700 directory and /dev/shm segments.

Security. Every tcp socket is CurveZMQ, with keys made for this run: one keypair for the head, one
per stage. Whoever binds is the CURVE server, and a ZAP handler (`Gate`) lets in only the public
keys of the run's parties that may talk to that socket; a peer without such a key (a plain socket,
a wrong key, a wrong server key) fails the handshake and never gets a frame through. Refused
handshakes are counted from each socket's monitor and logged. The head binds only on the rig's
`listen` address; a remote stage binds on its address that routes to the head.

Joining. A remote stage is started as `python -m workers.join --join tcp://HEAD:PORT --key KEY`
(KEY: the head's public key and the stage's keypair, hex; `-` reads it from stdin). It connects a
DEALER to the head's control ROUTER, says `join`, and gets its spec (msgpack, validated) and the
prompt's token ids; the head knows which stage it is by the CURVE key it authenticated with.

Heartbeats. The same control sockets carry `hb` both ways every `heartbeat_s`, each end in a thread
of its own (a stage computing a long chunk still answers). A remote stage silent for
`heartbeat_timeout_s` fails the run naming its host; a stage whose head is silent that long exits.
"""
from __future__ import annotations

import logging
import os
import socket
import subprocess
import threading
import time
from dataclasses import replace
from pathlib import Path

import zmq
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from . import messages as M

ZAP_DOMAIN = "strata"
REFUSED = {zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake failed",
           zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "protocol or key mismatch",
           zmq.EVENT_HANDSHAKE_FAILED_AUTH: "key not allowed"}
log = logging.getLogger("strata.net")


# -- keys --------------------------------------------------------------------------------------------
def keypair() -> tuple[str, str]:
    """A fresh CURVE keypair, z85 text (public, secret)."""
    public, secret = zmq.curve_keypair()
    return public.decode("ascii"), secret.decode("ascii")


def join_key(head_public: str, public: str, secret: str) -> str:
    """What `--key` takes: the head's public key, then the stage's keypair, as 192 hex digits (no
    characters a shell or ssh would touch)."""
    return b"".join(z85.decode(k.encode("ascii")) for k in (head_public, public, secret)).hex()


def parse_join_key(text: str) -> tuple[str, str, str]:
    try:
        raw = bytes.fromhex(text.strip())
    except ValueError:
        raise ValueError("--key: not hex") from None
    if len(raw) != 96:
        raise ValueError(f"--key: {len(raw)} bytes, expected 96 (three CURVE keys)")
    return tuple(z85.encode(raw[i:i + 32]).decode("ascii") for i in (0, 32, 64))


def curve_server(sock: zmq.Socket, public: str, secret: str) -> zmq.Socket:
    sock.curve_server = True
    sock.curve_publickey = public.encode("ascii")
    sock.curve_secretkey = secret.encode("ascii")
    sock.zap_domain = ZAP_DOMAIN.encode()  # ZAP is asked for every handshake on this socket
    return sock


def curve_client(sock: zmq.Socket, public: str, secret: str, server_public: str) -> zmq.Socket:
    sock.curve_publickey = public.encode("ascii")
    sock.curve_secretkey = secret.encode("ascii")
    sock.curve_serverkey = server_public.encode("ascii")
    return sock


def boot_id() -> str:
    """Same kernel, same monotonic clock (network namespaces share it): no clock offset to estimate."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def route_address(endpoint: str) -> str:
    """This host's address on the route to `endpoint` (tcp://HOST:PORT): where its peers reach it."""
    host, port = endpoint.split("://", 1)[1].rsplit(":", 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, int(port)))  # no packet is sent: this only picks the route
        return s.getsockname()[0]


def bind_tcp(sock: zmq.Socket, address: str, port: int | None = None) -> str:
    sock.bind(f"tcp://{address}:{port or '*'}")
    ep = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    if ep.startswith("tcp://0.0.0.0:"):  # the rig asked for every interface: name this host instead
        ep = f"tcp://{socket.getfqdn()}:{ep.rsplit(':', 1)[1]}"
    return ep


# -- the gate: ZAP + counting refused handshakes ----------------------------------------------------
class Gate:
    """ZAP handler for one ZeroMQ context: CURVE clients get in only with an allowed public key.
    `watch` a server socket to count its refused handshakes; `drain` from the thread that polls."""

    def __init__(self, ctx: zmq.Context, allowed, logger: logging.Logger):
        from zmq.auth.thread import ThreadAuthenticator
        self.allowed = set(allowed)
        self.log = logger
        self.count = 0
        self.last = ""
        self.monitors: list[tuple[zmq.Socket, str]] = []
        self.auth = ThreadAuthenticator(ctx, log=logging.getLogger("strata.zap"))
        self.auth.start()
        self.auth.configure_curve_callback(ZAP_DOMAIN, self)

    def callback(self, domain: str, key: bytes) -> bool:  # the ZAP thread asks
        ok = key.decode("ascii", "replace") in self.allowed
        if not ok:
            self.log.warning("refused a CURVE client with a key not in this run: %s", key.decode("ascii", "replace"))
        return ok

    def watch(self, sock: zmq.Socket, what: str) -> zmq.Socket:
        mon = sock.get_monitor_socket(sum(REFUSED))
        mon.setsockopt(zmq.LINGER, 0)
        self.monitors.append((mon, what))
        return mon

    def drain(self) -> int:
        """Count the refused handshakes reported since the last call; returns how many."""
        new = 0
        for mon, what in self.monitors:
            while True:
                try:
                    ev = parse_monitor_message(mon.recv_multipart(zmq.NOBLOCK))
                except zmq.Again:
                    break
                why = REFUSED.get(ev["event"])
                if why is None:
                    continue
                new += 1
                self.count += 1
                self.last = f"{what} {ev['endpoint'].decode(errors='replace')}: {why}"
                if self.count <= 10 or self.count % 100 == 0:
                    self.log.warning("refused connection #%d on %s", self.count, self.last)
        return new

    def stop(self) -> None:
        for mon, _ in self.monitors:
            mon.close(linger=0)
        self.monitors = []
        self.auth.stop()


# -- the head's side ----------------------------------------------------------------------------------
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


# -- the stage's side ---------------------------------------------------------------------------------
def join(ctx: zmq.Context, endpoint: str, key: tuple[str, str, str], timeout_s: float):
    """Connect to the head's control socket, say join, return (dealer, spec, ids bytes, clock offset).

    The offset turns the head's perf_counter into this host's (0 on the same kernel)."""
    head_public, public, secret = key
    dealer = curve_client(ctx.socket(zmq.DEALER), public, secret, head_public)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.MAXMSGSIZE, -1)
    dealer.connect(endpoint)
    sent = time.perf_counter()
    dealer.send(M.encode(M.Join(pid=os.getpid(), host=socket.gethostname(), boot_id=boot_id(), clock=sent)))
    if not dealer.poll(int(timeout_s * 1000)):
        dealer.close(linger=0)
        raise TimeoutError(f"no answer from the head at {endpoint} within {timeout_s:.0f}s (unreachable, "
                           "a wrong or stale --key, or that stage joined already)")
    parts = dealer.recv_multipart()
    got = time.perf_counter()
    if len(parts) != 2:
        raise M.BadMessage(f"join reply of {len(parts)} frames")
    spec = M.decode_spec(parts[0])
    net = spec.net
    same_clock = net.boot_id and net.boot_id == boot_id()
    offset = 0.0 if same_clock else net.head_clock - (sent + got) / 2
    if len(parts[1]) != 4 * spec.tokens:
        raise M.BadMessage(f"join reply: {len(parts[1])} bytes of ids for {spec.tokens} tokens")
    return dealer, spec, parts[1], offset


class HeadWatch:
    """A remote stage's heartbeat: a thread that owns the join DEALER, says `hb` every heartbeat_s and
    exits the process when the head has been silent for heartbeat_timeout_s."""

    def __init__(self, dealer: zmq.Socket, stage: int, heartbeat_s: float, timeout_s: float, log_fd: int | None):
        self.dealer, self.stage = dealer, stage
        self.heartbeat_s, self.timeout_s, self.log_fd = heartbeat_s, timeout_s, log_fd
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="head-watch", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        heard = time.monotonic()
        hb = M.encode(M.Heartbeat(stage=self.stage))
        while not self.stopping.is_set():
            try:
                self.dealer.send(hb, zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            deadline = time.monotonic() + self.heartbeat_s
            while (left := deadline - time.monotonic()) > 0 and not self.stopping.is_set():
                if self.dealer.poll(int(left * 1000) + 1):
                    try:
                        M.decode(self.dealer.recv())
                        heard = time.monotonic()
                    except (M.BadMessage, zmq.ZMQError):
                        pass
            if time.monotonic() - heard > self.timeout_s and not self.stopping.is_set():
                if self.log_fd is not None:  # a raw write: no logging lock the main thread might hold
                    try:
                        os.write(self.log_fd, f"head silent for {self.timeout_s:g}s: stage {self.stage} "
                                 f"(pid {os.getpid()}) exits\n".encode())
                    except OSError:
                        pass
                os._exit(3)

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(self.heartbeat_s + 1.0)
        if not self.dealer.closed:
            self.dealer.close(linger=0)


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
