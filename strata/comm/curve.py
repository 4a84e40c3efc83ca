"""CurveZMQ for stages on other hosts, both ends: keys, secured sockets, the ZAP gate, tcp binding.

Only a run with a remote stage (`stages[i].host`) touches this module and its two sides (the head's:
strata/head/net.py; the stage's: workers/join.py, workers/sockets.py); everything else stays on ipc
sockets in a 0700 directory and /dev/shm segments.

Security. Every tcp socket is CurveZMQ, with keys made for this run: one keypair for the head, one
per stage. Whoever binds is the CURVE server, and a ZAP handler (`Gate`) lets in only the public
keys of the run's parties that may talk to that socket; a peer without such a key (a plain socket,
a wrong key, a wrong server key) fails the handshake and never gets a frame through. Refused
handshakes are counted from each socket's monitor and logged. The head binds only on the rig's
`listen` address; a remote stage binds on its address that routes to the head.
"""
from __future__ import annotations

import logging
import socket
from pathlib import Path

import zmq
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

ZAP_DOMAIN = "strata"
REFUSED = {zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake failed",
           zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "protocol or key mismatch",
           zmq.EVENT_HANDSHAKE_FAILED_AUTH: "key not allowed"}
log = logging.getLogger("strata.comm.curve")


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
