"""A stage's ZeroMQ sockets: its inbox (ipc, and across hosts a CURVE tcp one), PUSHes up, down and to the head."""
from __future__ import annotations

import logging

import zmq

from strata.comm import messages as M
from strata.comm.curve import Gate, bind_tcp, curve_client, curve_server, route_address


class StageSockets:
    """One PULL in, a PUSH to each neighbour and to the head. Across hosts also (or, for a remote stage, only)
    a tcp PULL: a CURVE server that lets in the head and the neighbours only; the PUSHes to neighbours on other
    hosts connect once the head says where they listen (`link`). Used from the stage's one thread."""

    def __init__(self, spec: M.StageJob, inlink, log: logging.Logger):
        """`inlink`: the input boundary (None on stage 0), whose rows across hosts come with their note."""
        net, i = spec.net, spec.index
        self.first, self.last = i == 0, i == spec.n_stages - 1
        self.net = net
        self.tcp_in, self.tcp_out = bool(net and net.tcp_in), bool(net and net.tcp_out)
        ctx = zmq.Context.instance()
        self.inboxes, self.inbox_sock, self.tcp_inbox, self.gate = [], None, None, None
        if not (net and net.remote):
            self.inbox_sock = ctx.socket(zmq.PULL)
            self.inbox_sock.setsockopt(zmq.LINGER, 0)
            self.inbox_sock.setsockopt(zmq.MAXMSGSIZE, M.MAX_FRAME)
            self.inbox_sock.bind(spec.endpoints[i])
            self.inboxes.append(self.inbox_sock)
        if net and net.tcp_inbox:
            self.gate = Gate(ctx, net.allow, log)
            self.tcp_inbox = curve_server(ctx.socket(zmq.PULL), net.public, net.secret)
            self.tcp_inbox.setsockopt(zmq.LINGER, 0)
            self.tcp_inbox.setsockopt(zmq.MAXMSGSIZE, max(M.MAX_FRAME, spec.max_chunk * inlink.row_bytes
                                                          if self.tcp_in else 0))
            self.gate.watch(self.tcp_inbox, f"stage {i} inbox")
            self.tcp_endpoint = bind_tcp(self.tcp_inbox, net.bind or route_address(spec.head_endpoint))
            self.inboxes.append(self.tcp_inbox)

        def push(ep):
            s = ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 2000)  # long enough for a final "fail" to leave
            s.connect(ep)
            return s

        def tcp_push():  # a CURVE client; connected once the head says where the neighbour listens
            s = ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 2000)
            s.curve_publickey, s.curve_secretkey = net.public.encode(), net.secret.encode()
            return s

        self.to_head = head_push(ctx, spec)
        self.to_up = None if self.first else tcp_push() if self.tcp_in else push(spec.endpoints[i - 1])
        self.to_down = self.to_head if self.last else tcp_push() if self.tcp_out else push(spec.endpoints[i + 1])
        self.linked = not ((self.tcp_in and not self.first) or (self.tcp_out and not self.last))  # else: `link`
        self.poller = zmq.Poller()
        for s in self.inboxes:
            self.poller.register(s, zmq.POLLIN)
        for mon, _ in (self.gate.monitors if self.gate else ()):
            self.poller.register(mon, zmq.POLLIN)
        if self.tcp_inbox is not None:
            self.to_head.send(M.encode(M.Bound(stage=i, endpoint=self.tcp_endpoint)))

    def link(self, msg: M.Peers) -> None:
        """The head says where this stage's neighbours across hosts listen: connect to them."""
        want = [(self.to_up, msg.up, msg.up_key, self.net.tcp_in and not self.first),
                (self.to_down, msg.down, msg.down_key, self.net.tcp_out and not self.last)]
        for _, ep, key, needed in want:
            if needed and not (ep.startswith("tcp://") and len(key) == 40):
                raise M.BadMessage(f"peers: no tcp endpoint and key for a neighbour ({ep!r})")
        for sock, ep, key, needed in want:
            if needed:
                sock.curve_serverkey = key.encode("ascii")
                sock.connect(ep)
        self.linked = True

    def close(self, linger_ms: int = 0) -> None:
        """Close the sockets (outgoing ones keep `linger_ms` to deliver what is queued) and the gate."""
        for s in self.inboxes:
            if not s.closed:
                s.close(linger=0)
        for s in (self.to_up, self.to_head, self.to_down):
            if s is not None and not s.closed:
                s.close(linger=linger_ms)
        if self.gate is not None:
            self.gate.stop()


def head_push(ctx, spec: M.StageJob):
    """A PUSH to the head: its ipc socket, or (a remote stage) its tcp socket as a CURVE client."""
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.LINGER, 2000)  # long enough for a final "fail" to leave
    net = spec.net
    if net and net.remote:
        curve_client(s, net.public, net.secret, net.head_public)
    s.connect(spec.head_endpoint)
    return s
