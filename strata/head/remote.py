"""The head's side of stages on other hosts: keys, the tcp listener, launching, linking, watching.

Only a run with a remote stage (`stages[i].host`) makes a `RemoteStages`; everything here is what
the head does for it on top of a local run (strata/head/net.py holds the sockets and the protocol).
"""
from __future__ import annotations

import json
import logging
import sys
from dataclasses import replace
from pathlib import Path

import zmq

from strata.comm import messages as M
from strata.config import RigConfig, split_listen
from strata.errors import PipelineError
from strata.comm.curve import curve_client, join_key, keypair
from strata.head.net import HeadNet, PrintedStage, RemoteProc, remote_argv, stage_command

ROOT = Path(__file__).resolve().parents[1]  # the checkout: a remote stage runs `-m workers.join` from here
log = logging.getLogger("strata.head.pipeline")


class RemoteStages:
    def __init__(self, res, cfg: RigConfig, plan, remote: list[bool], across: list[bool]):
        self.cfg, self.plan, self.remote, self.across = cfg, plan, remote, across
        n = len(remote)
        self.keys = {i: keypair() for i in range(n)}  # this run's: nobody outside it holds one
        try:
            self.net = res.net = HeadNet(res.ctx, split_listen(cfg.listen), self.keys,
                                         {i for i in range(n) if remote[i]}, plan.args.vocab_size * 4,
                                         cfg.heartbeat_s, cfg.heartbeat_timeout_s, log)
        except OSError as e:
            raise PipelineError(str(e)) from None
        self.bound: dict[int, str] = {}           # stage -> its tcp inbox
        self.stage_rejected: dict[int, int] = {}  # stage -> handshakes its tcp inbox refused

    @property
    def pull(self) -> zmq.Socket:
        return self.net.pull

    def secure(self, sock: zmq.Socket, i: int) -> None:
        """The head's PUSH to remote stage i: a CURVE client, connected once the stage says where ("bound")."""
        curve_client(sock, self.net.public, self.net.secret, self.keys[i][0])

    def stage_net(self, i: int) -> M.StageNet:
        """What stage i needs to know about the network (its spec's `net`): which of its boundaries cross
        hosts, its keypair, who may connect to its tcp inbox, the head's tcp side, the heartbeats."""
        remote, across, keys, net = self.remote, self.across, self.keys, self.net
        n = len(remote)
        tcp_in = i > 0 and across[i - 1]
        tcp_out = across[i] if i < n - 1 else remote[i]  # a remote last stage sends its logits over tcp
        allow = [keys[j][0] for j in (i - 1, i + 1) if 0 <= j < n and (remote[i] or remote[j])]
        if remote[i]:
            allow.append(net.public)
        return M.StageNet(host=self.plan.stages[i].host or "local", remote=remote[i],
                          bind="" if remote[i] else split_listen(self.cfg.listen)[0],
                          tcp_in=tcp_in, tcp_out=tcp_out, tcp_inbox=remote[i] or tcp_in or (i < n - 1 and across[i]),
                          public=keys[i][0], secret="" if remote[i] else keys[i][1],  # a remote stage brings its own
                          head_public=net.public, allow=allow, head_tcp=net.pull_endpoint,
                          heartbeat_s=self.cfg.heartbeat_s, heartbeat_timeout_s=self.cfg.heartbeat_timeout_s,
                          head_clock=0.0, boot_id="")  # both filled in when it joins

    def launch(self, sp, spec: M.StageJob, out: Path):
        """Offer stage sp's spec for its join, then start it through `remote_command` (or print how)."""
        net, i = self.net, sp.index
        spec = replace(spec, segments={}, endpoints=[], head_endpoint=net.pull_endpoint, log_file="", console=False)
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
            return RemoteProc(argv, key, out / f"stage-{i}.log", cwd=str(ROOT))
        except OSError as e:
            raise PipelineError(f"stage {i} ({sp.device} on {sp.host}): remote_command {argv[0]!r} did not start: "
                                f"{e}") from None

    def on_bound(self, i: int, endpoint: str, push: zmq.Socket) -> None:
        """Stage i's tcp inbox: remembered for its neighbours; the head's own PUSH connects if it is remote."""
        if i in self.bound or not endpoint.startswith("tcp://"):
            return
        self.bound[i] = endpoint
        if self.remote[i]:
            push.connect(endpoint)

    def peers(self) -> dict[int, dict]:
        """Every stage has bound and is ready: for each one with a neighbour across hosts, where they listen.
        Raises (naming the stage) LookupError for a neighbour that never said."""
        n, across, keys, out = len(self.remote), self.across, self.keys, {}
        for i in range(n):
            up = i > 0 and across[i - 1]
            down = i < n - 1 and across[i]
            if not (up or down):
                continue
            missing = [j for j, want in ((i - 1, up), (i + 1, down)) if want and j not in self.bound]
            if missing:
                raise LookupError(missing[0])
            out[i] = dict(up=self.bound[i - 1] if up else "", up_key=keys[i - 1][0] if up else "",
                          down=self.bound[i + 1] if down else "", down_key=keys[i + 1][0] if down else "")
        return out

    def write_net_json(self, path: Path, boundaries: list[str]) -> None:
        """Where everything listens, with public keys only: for operators (and the tests' intruders)."""
        n = len(self.remote)
        path.write_text(json.dumps({
            "listen": self.cfg.listen, "join": self.net.join_endpoint, "notes": self.net.pull_endpoint,
            "head_public": self.net.public, "boundaries": boundaries,
            "stages": [{"index": i, "host": self.plan.stages[i].host or "local", "endpoint": self.bound.get(i, ""),
                        "public": self.keys[i][0]} for i in range(n)]}, indent=1))

    def on_rejected(self, i: int, count: int, detail: str) -> None:
        self.stage_rejected[i] = max(count, self.stage_rejected.get(i, 0))
        log.warning("stage %d refused a connection (%d so far): %s", i, count, detail)

    @property
    def rejected_connections(self) -> int:
        return self.net.gate.count + sum(self.stage_rejected.values())

    def problem(self, pids: dict[int, int]) -> tuple[int | None, str] | None:
        """Remote stages: fill in their pids once joined (into `pids`); (stage or None, why) if the run must
        fail: the network thread failed, or a stage went silent past the deadline."""
        if self.net.error:
            return None, f"the head's network thread failed: {self.net.error}"
        for i, j in self.net.joins().items():
            pids[i] = j["pid"]
        silent = self.net.silent()
        if silent:
            i, age = silent[0]
            return i, (f"went silent: no heartbeat for {age:.1f}s "
                       f"(heartbeat_timeout_s {self.cfg.heartbeat_timeout_s:g})")
        return None
