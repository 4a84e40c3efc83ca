"""A stage on another host: join the head over tcp (CurveZMQ), get the spec, then run as a stage process.

    python -m workers.join --join tcp://HEAD:PORT --key KEY      (KEY: 192 hex digits, or - for stdin)

This is the stage's side of the join and the heartbeats (the head's: strata/head/net.py). The entry point
lives here, not in workers/stage.py: the stage process (workers/bootstrap.py) imports the stage, and a stage
that imported this module would close a circle.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
import time

import zmq

from strata.comm import messages as M
from strata.comm.curve import boot_id, curve_client, parse_join_key


def main(argv: list[str] | None = None) -> int:
    """Join the head, get the spec, load the slice, serve (the process exits from run_stage_process)."""
    ap = argparse.ArgumentParser(prog="python -m workers.join", description="A Strata stage on another host: "
                                 "joins the head (CurveZMQ), gets its spec, loads its layers and serves chunks.")
    ap.add_argument("--join", required=True, metavar="tcp://HEAD:PORT", help="the head's join endpoint")
    ap.add_argument("--key", required=True, metavar="KEY", help="the run's key for this stage (printed by the head, "
                    "or given on stdin by its remote_command); - reads it from stdin")
    ap.add_argument("--bind", default="", metavar="ADDR", help="address the neighbours reach this stage at "
                    "(default: this host's address on the route to the head)")
    ap.add_argument("--join-timeout", type=float, default=60.0, metavar="S", help="give up joining after S seconds")
    a = ap.parse_args(argv)
    try:
        key = parse_join_key(sys.stdin.readline() if a.key == "-" else a.key)
        if not a.join.startswith("tcp://"):
            raise ValueError(f"--join: {a.join!r} is not tcp://HOST:PORT")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        dealer, spec, ids, offset = join(zmq.Context.instance(), a.join, key, a.join_timeout)
    except (TimeoutError, M.BadMessage, zmq.ZMQError) as e:
        print(f"error: could not join {a.join}: {e}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(2)  # no context teardown: a socket may still be connecting
    net = spec.net
    if net.public != key[1]:
        print("error: the head sent the spec of another stage", file=sys.stderr)
        os._exit(2)
    net.secret = key[2]
    if a.bind:
        net.bind = a.bind
    watch = HeadWatch(dealer, spec.index, net.heartbeat_s, net.heartbeat_timeout_s, sys.stderr.fileno())
    from workers.bootstrap import run_stage_process  # torch loads here, after the join: a bad key fails fast
    run_stage_process(spec, None, {"ids": ids, "clock_offset": offset, "watch": watch})
    return 0  # not reached: run_stage_process exits the process



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


if __name__ == "__main__":
    sys.exit(main())
