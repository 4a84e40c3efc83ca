"""What a boundary across hosts costs: chunks of residual rows through `TcpLink` (note + rows, zero-copy
send, CurveZMQ); the receiver lands them in its own buffer, copies them out and answers "taken", as
a stage does. One chunk in flight, as at depth 1.

    sudo python bench/tcp_link.py --netns     # sender and receiver in two network namespaces (a bridge)
    python bench/tcp_link.py                  # both on 127.0.0.1

Prints, per chunk size, the median time from put() to "taken" (one hop) and the GB/s that makes.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import zmq  # noqa: E402

from strata.comm import messages as M  # noqa: E402
from strata.comm import curve  # noqa: E402
from strata.comm.transport import TcpLink  # noqa: E402


def receive(a, keys: dict) -> None:
    """The receiving stage: a CURVE server that lets in the sender's key only."""
    ctx = zmq.Context()
    gate = curve.Gate(ctx, [keys["send"][0]], curve.log)
    inbox = curve.curve_server(ctx.socket(zmq.PULL), *keys["recv"])
    inbox.setsockopt(zmq.MAXMSGSIZE, -1)
    print(curve.bind_tcp(inbox, a.recv_addr), flush=True)
    back = curve.curve_client(ctx.socket(zmq.PUSH), *keys["recv"], keys["send"][0])
    back.connect(sys.stdin.readline().strip())
    link = TcpLink(torch.float32, (max(a.rows), a.dim))
    while True:
        parts = inbox.recv_multipart(copy=False)
        msg = M.decode(parts[0].bytes)
        if isinstance(msg, M.Stop):
            break
        link.land(msg.n, parts[1])
        link.get(msg.n).clone()  # the copy out of the input buffer, as run_chunk makes it
        back.send(M.encode(M.Taken(k=msg.k)))
    for s in (inbox, back):
        s.close(0)
    gate.stop()
    ctx.term()


def send(a, keys: dict, receiver: subprocess.Popen) -> list[str]:
    ctx = zmq.Context()
    gate = curve.Gate(ctx, [keys["recv"][0]], curve.log)
    back = curve.curve_server(ctx.socket(zmq.PULL), *keys["send"])
    back_ep = curve.bind_tcp(back, a.send_addr)
    out = curve.curve_client(ctx.socket(zmq.PUSH), *keys["send"], keys["recv"][0])
    out.connect(receiver.stdout.readline().strip())
    receiver.stdin.write(back_ep + "\n")
    receiver.stdin.flush()
    link = TcpLink(torch.float32, (max(a.rows), a.dim), sock=out)
    lines, k = [], 0
    for n in a.rows:
        h = torch.randn(n, a.dim)
        times = []
        for _ in range(a.reps + 1):  # the first is a warm-up
            t = time.perf_counter()
            link.put(h, M.Chunk(k=k, kind=M.Kind.CHUNK, pos=0, n=n, t0=0.0, tokens=n, score=-1))
            M.decode(back.recv())
            times.append(time.perf_counter() - t)
            k += 1
        ms = statistics.median(times[1:]) * 1000
        mb = n * a.dim * 4 / 1e6
        lines.append(f"| {n:,} | {mb:.1f} | {ms:.2f} | {mb / ms:.2f} |")
    out.send(M.encode(M.Stop()))
    receiver.wait(30)
    for s in (out, back):
        s.close(0)
    gate.stop()
    ctx.term()
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--netns", action="store_true", help="sender and receiver in two network namespaces (root)")
    ap.add_argument("--dim", type=int, default=4096, help="row width (4096: an 8B model, 8192: a 70B)")
    ap.add_argument("--rows", default="256,1024,4096", help="chunk sizes in rows (tokens), comma-separated")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--send-addr", default="127.0.0.1", help=argparse.SUPPRESS)
    ap.add_argument("--recv-addr", default="127.0.0.1", help=argparse.SUPPRESS)
    ap.add_argument("--recv-prefix", default="", help=argparse.SUPPRESS)
    ap.add_argument("--keys", help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.rows = [int(x) for x in str(a.rows).split(",")]
    if a.keys:  # the receiving end
        receive(a, json.loads(a.keys))
        return 0
    if a.netns:  # run this again as the sender inside namespace 0, the receiver inside namespace 1
        from strata.comm.netns import Netns, available
        why = available()
        if why:
            print(f"error: --netns: {why}", file=sys.stderr)
            return 2
        with Netns(2) as ns:
            argv = [x for x in sys.argv[1:] if x != "--netns"]
            argv += ["--send-addr", ns.addr(0), "--recv-addr", ns.addr(1), "--recv-prefix", " ".join(ns.exec(1))]
            return subprocess.run(ns.exec(0) + [sys.executable, os.path.abspath(__file__), *argv]).returncode
    keys = {"send": curve.keypair(), "recv": curve.keypair()}
    me = [sys.executable, os.path.abspath(__file__), "--keys", json.dumps(keys), "--dim", str(a.dim),
          "--rows", ",".join(map(str, a.rows)), "--recv-addr", a.recv_addr]
    receiver = subprocess.Popen(a.recv_prefix.split() + me, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        lines = send(a, keys, receiver)
    finally:
        if receiver.poll() is None:
            receiver.kill()
    where = "two network namespaces on a bridge" if a.recv_prefix else "loopback"
    print(f"TcpLink, {where}: dim {a.dim}, float32, CurveZMQ, one chunk in flight; median of {a.reps}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}")
    print("| rows | MB | put -> taken ms | GB/s |\n|---:|---:|---:|---:|")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
