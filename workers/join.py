"""A stage on another host: join the head over tcp (CurveZMQ), get the spec, then run as a stage process.

    python -m workers.join --join tcp://HEAD:PORT --key KEY      (KEY: 192 hex digits, or - for stdin)

The entry point lives here, not in workers/stage.py: the stage process (workers/bootstrap.py) imports the
stage, and a stage that imported this module would close a circle.
"""
from __future__ import annotations

import argparse
import os
import sys

import zmq

from strata import messages as M
from strata import net as N


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
        key = N.parse_join_key(sys.stdin.readline() if a.key == "-" else a.key)
        if not a.join.startswith("tcp://"):
            raise ValueError(f"--join: {a.join!r} is not tcp://HOST:PORT")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        dealer, spec, ids, offset = N.join(zmq.Context.instance(), a.join, key, a.join_timeout)
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
    watch = N.HeadWatch(dealer, spec.index, net.heartbeat_s, net.heartbeat_timeout_s, sys.stderr.fileno())
    from .bootstrap import run_stage_process  # torch loads here, after the join: a bad key fails fast
    run_stage_process(spec, None, {"ids": ids, "clock_offset": offset, "watch": watch})
    return 0  # not reached: run_stage_process exits the process


if __name__ == "__main__":
    sys.exit(main())
