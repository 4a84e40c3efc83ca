"""Stages on several hosts, on one machine: network namespaces joined by a bridge (strata/comm/netns.py),
one CPU stage in each, the head in the first (so every packet stays inside the namespaces), remote
stages started through `remote_command: ip netns exec {host} ...` or by hand from the printed command.

Checks: the residual md5 equals the single-host run's (same model, chunking, both depths); a remote
stage killed (SIGKILL) or gone silent (SIGSTOP) fails the run within the deadline, naming host and
stage, leaving no process, segment or namespace behind; a remote stage exits when the head goes
silent; connections without the run's key (plain, wrong client key, wrong server key) are refused,
counted, and change nothing.

Needs root and iproute2; skipped (with the reason) where namespaces cannot be made.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import (PYTHON, REPO, Launched, Proc, log_time, make_rig, ready_count, segments, stage_pids, wait_gone,
                      write_rig)

from strata.comm import netns as NS

HEARTBEAT = dict(heartbeat_s=0.5, heartbeat_timeout_s=3.0)
EXIT_WITHIN = 10.0
REMOTE = "ip netns exec {host} {python} -m workers.join --join {join} --key {key}"


# -- fixtures -------------------------------------------------------------------------------------
@pytest.fixture
def ns():
    """Three namespaces (a: the head and stage 0, b, c), torn down after the test; nothing of them may remain."""
    why = NS.available()
    if why:
        pytest.skip(f"network namespaces unavailable: {why}")
    links_before = _root_links()
    n = NS.Netns(3).up()
    try:
        yield n
    finally:
        n.down()
        left = [x for x in NS.listed() if x in n.names]
        assert not left, f"namespaces left behind: {left}"
        assert _root_links() == links_before, "interfaces added to the root namespace"


def _root_links() -> set[str]:
    r = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True)
    return {line.split(":")[1].strip() for line in r.stdout.splitlines()}


def _rig(ns, hosts: str = "abc", **over) -> dict:
    """synthetic:smoke on one-thread CPU stages; stage i runs in namespace hosts[i] (a = the head's)."""
    rig = make_rig(len(hosts), tokens=512, chunk=64, dump_residual=True, **HEARTBEAT)
    for st, h in zip(rig["stages"], hosts):
        if h != "a":
            st["host"] = ns.names[ord(h) - ord("a")]
    rig.update(listen=ns.addr(0), remote_command=REMOTE)
    rig.update(over)
    return rig


def _single_host(rig: dict) -> dict:
    """The same rig with every stage on this host."""
    local = {k: v for k, v in rig.items() if k not in ("listen", "remote_command", "heartbeat_s", "heartbeat_timeout_s")}
    local["stages"] = [{k: v for k, v in st.items() if k != "host"} for st in rig["stages"]]
    return local


def _launch(ns, tmp: Path, rig: dict, name: str = "run") -> Launched:
    """`python launcher.py` inside the head's namespace (ip netns exec execs it: same pid)."""
    out = tmp / name
    cfg = write_rig(tmp / f"{name}.yaml", rig)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("STRATA_PF_DEPTH", None)
    p = subprocess.Popen(ns.exec(0) + [PYTHON, str(REPO / "launcher.py"), "--config", str(cfg), "--out", str(out),
                                       "--no-timeline"],
                         cwd=str(REPO), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    return Launched(p, out)


def _nothing_left(ns, run: Launched, extra_pids=()) -> None:
    """No process of the run (head, stages, by pid and start time), no segment of its head, nothing
    running in any of the namespaces."""
    procs = [run.head] + [Proc(pid, f"stage {i}") for i, pid in stage_pids(run.out).items()]
    procs += [Proc(pid) for pid in extra_pids]
    left = wait_gone(procs, 10.0)
    assert not left, f"processes left behind: {left}"
    assert segments(owner_pid=run.pid) == []
    inside = {name: NS.pids_inside(name) for name in ns.names}
    assert not any(inside.values()), f"processes still inside the namespaces: {inside}"


def _wait_ready(run: Launched, n: int, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while ready_count(run.out) < n or not (run.out / "net.json").is_file():
        if run.popen.poll() is not None:
            raise AssertionError(f"launcher exited ({run.popen.returncode}) early:\n{run.popen.stderr.read()}")
        assert time.monotonic() < deadline, f"{n} stages not ready within {timeout}s"
        time.sleep(0.05)


_REFERENCE: dict[str, dict] = {}


def _reference(tmp: Path, rig: dict, name: str) -> dict:
    """The single-host run's report (same rig, every stage here); once per rig and module."""
    from strata.head.pipeline import Pipeline
    local = _single_host(rig)
    local.pop("debug", None)  # delays change nothing computed
    key = json.dumps(local, sort_keys=True)
    if key not in _REFERENCE:
        with Pipeline(local, out=tmp / name, console=False) as p:
            _REFERENCE[key] = p.prefill().report
    return _REFERENCE[key]


def _reference_md5(tmp: Path, rig: dict, name: str) -> str:
    return _reference(tmp, rig, name)["residual_md5"]


# -- the residual is the single-host run's ---------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("hosts,depth,generate", [("abc", 1, 0), ("abc", 0, 0), ("aab", 1, 0), ("bca", 1, 3)],
                         ids=["3-hosts-depth1", "3-hosts-depth0", "shm+tcp-depth1", "remote-first-decode"])
def test_md5_equals_single_host(tmp_path, ns, hosts, depth, generate):
    """Same residual md5 (and perplexity, and greedy continuation) as with every stage on this host."""
    rig = _rig(ns, hosts, depth=depth, generate=generate)
    want = _reference(tmp_path, rig, "local")
    run = _launch(ns, tmp_path, rig)
    rc = run.wait(180)
    assert rc == 0, run.stderr
    rep = json.loads((run.out / "report.json").read_text())
    assert rep["residual_md5"] == want["residual_md5"]
    assert rep["perplexity"] == want["perplexity"] and rep["continuation_ids"] == want["continuation_ids"]
    assert len(rep["continuation_ids"]) == generate
    assert rep["depth"] == depth and rep["chunks"] == 8
    assert rep["boundaries"] == {"abc": ["tcp", "tcp"], "aab": ["shm", "tcp"], "bca": ["tcp", "tcp"]}[hosts]
    assert [s["host"] for s in rep["stages"]] == ["local" if h == "a" else ns.names[ord(h) - 97] for h in hosts]
    assert rep["rejected_connections"] == 0
    # tcp only on the rig's `listen` address and on each namespace's own address, never on every interface
    net = json.loads((run.out / "net.json").read_text())
    assert net["join"].startswith(f"tcp://{ns.addr(0)}:") and net["notes"].startswith(f"tcp://{ns.addr(0)}:")
    for st, h in zip(net["stages"], hosts):
        if st["endpoint"]:
            assert st["endpoint"].startswith(f"tcp://{ns.addr(ord(h) - 97)}:"), st
    _nothing_left(ns, run)


# -- deaths across hosts ---------------------------------------------------------------------------
def _wait_prefill_reached(run, stage: int, timeout: float = 60.0) -> None:
    """Until `stage` logs that it started the prefill (its first chunk): mid-run, by the stage's word."""
    deadline = time.monotonic() + timeout
    while log_time(run.out, stage, "prefill: started") is None:
        assert time.monotonic() < deadline and run.popen.poll() is None, f"the prefill never reached stage {stage}"
        time.sleep(0.02)


@pytest.mark.slow
def test_remote_stage_sigkill_fails_the_run(tmp_path, ns):
    """SIGKILL of the middle stage (in namespace b) mid-prefill: the head sees its launcher process die."""
    run = _launch(ns, tmp_path, _rig(ns, debug={"delay_s": 0.4}))
    _wait_ready(run, 3)
    _wait_prefill_reached(run, 1)
    pid = stage_pids(run.out)[1]
    os.kill(pid, signal.SIGKILL)
    t_kill = time.monotonic()
    rc = run.wait(60)
    took = time.monotonic() - t_kill
    assert rc == 1, run.stderr
    line = run.error_line()
    assert re.match(rf"error: stage 1 \(cpu on {ns.names[1]}, pid {pid}, chunk \d+\) killed by SIGKILL", line), line
    assert took < EXIT_WITHIN, took
    _nothing_left(ns, run)


@pytest.mark.slow
def test_remote_stage_silent_fails_within_heartbeat_deadline(tmp_path, ns):
    """SIGSTOP of the last stage (namespace c): alive but silent; its heartbeats stop and the run fails
    within heartbeat_timeout_s, naming host and stage; teardown kills the stopped process."""
    run = _launch(ns, tmp_path, _rig(ns, debug={"delay_s": 0.4}))
    _wait_ready(run, 3)
    _wait_prefill_reached(run, 2)
    pid = stage_pids(run.out)[2]
    os.kill(pid, signal.SIGSTOP)
    t_stop = time.monotonic()
    try:
        rc = run.wait(60)
        took = time.monotonic() - t_stop
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except OSError:
            pass
    assert rc == 1, run.stderr
    line = run.error_line()
    m = re.match(rf"error: stage 2 \(cpu on {ns.names[2]}, pid {pid}, chunk \d+\) went silent: no heartbeat for "
                 r"(\d+\.\d)s \(heartbeat_timeout_s 3\)", line)
    assert m, line
    # found within the deadline (the head checks every 0.1-0.2 s), then the usual teardown: `stop`,
    # 1 s, SIGTERM (held while the process is stopped), 2 s, SIGKILL
    limit = HEARTBEAT["heartbeat_timeout_s"]
    assert limit <= float(m[1]) < limit + 0.5 and took < limit + 5.0, (m[1], took)
    _nothing_left(ns, run)


def _wait_stderr(run: Launched, pattern: str, timeout: float) -> re.Match | None:
    """Read the launcher's stderr (unbuffered, straight from the pipe) until `pattern` matches what came
    so far; kept in run.early_stderr, and put back in front of run.stderr by `_finish`."""
    import select
    fd = run.popen.stderr.fileno()
    deadline = time.monotonic() + timeout
    run.early_stderr = getattr(run, "early_stderr", "")
    while time.monotonic() < deadline:
        m = re.search(pattern, run.early_stderr)
        if m:
            return m
        if select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            run.early_stderr += chunk.decode(errors="replace")
    return re.search(pattern, run.early_stderr)


def _finish(run: Launched, timeout: float) -> int:
    rc = run.wait(timeout)
    run.stderr = getattr(run, "early_stderr", "") + run.stderr
    return rc


@pytest.mark.slow
def test_remote_stages_exit_when_head_goes_silent(tmp_path, ns):
    """SIGSTOP of the head: the remote stages hear no heartbeat and exit within heartbeat_timeout_s."""
    run = _launch(ns, tmp_path, _rig(ns, debug={"delay_s": 0.4}))
    _wait_ready(run, 3)
    pids = stage_pids(run.out)
    os.kill(run.pid, signal.SIGSTOP)
    t_stop = time.monotonic()
    try:
        remote = [Proc(pids[1], "stage 1"), Proc(pids[2], "stage 2")]
        left = wait_gone(remote, HEARTBEAT["heartbeat_timeout_s"] + 2.0)
        took = time.monotonic() - t_stop
        assert not left, f"remote stages still running {took:.1f}s after the head went silent: {left}"
        for i in (1, 2):
            assert "head silent for 3s" in (run.out / f"stage-{i}.log").read_text()
    finally:
        os.kill(run.pid, signal.SIGKILL)  # stage 0 (local) follows by PDEATHSIG
        os.kill(run.pid, signal.SIGCONT)
    run.wait(30)
    _nothing_left(ns, run)


# -- nobody without the key gets in --------------------------------------------------------------------
INTRUDER = r'''
import json, sys, time, zmq
targets = json.loads(sys.argv[1])
ctx = zmq.Context()
socks = []
for t in targets:
    for how in ("plain", "wrong-client-key", "wrong-server-key"):
        s = ctx.socket(zmq.DEALER if t["kind"] == "join" else zmq.PUSH)
        s.linger = 0
        s.reconnect_ivl = -1  # one attempt each: the counts below are exact
        if how != "plain":
            pub, sec = zmq.curve_keypair()
            s.curve_publickey, s.curve_secretkey = pub, sec
            s.curve_serverkey = t["key"].encode() if how == "wrong-client-key" else zmq.curve_keypair()[0]
        s.connect(t["endpoint"])
        for frame in t["frames"]:  # well-formed: each would stop or fail the run if it got through
            try:
                s.send(bytes.fromhex(frame), zmq.NOBLOCK)
            except zmq.Again:
                pass
        socks.append(s)
time.sleep(1.5)
for s in socks:
    s.close(0)
ctx.term()
print("done", time.time())
'''


@pytest.mark.slow
def test_connections_without_the_key_are_refused_and_counted(tmp_path, ns):
    from strata.comm import messages as M
    rig = _rig(ns, debug={"delay_s": 0.7})
    want = _reference_md5(tmp_path, rig, "local")
    run = _launch(ns, tmp_path, rig)
    _wait_ready(run, 3)
    net = json.loads((run.out / "net.json").read_text())
    fail = M.encode(M.Fail(stage=1, pid=1, device="cpu", chunk=0, error="X", message="intruder", traceback="")).hex()
    stop = M.encode(M.Stop()).hex()
    join = M.encode(M.Join(pid=1, host="intruder", boot_id="", clock=0.0)).hex()
    targets = [{"kind": "notes", "endpoint": net["notes"], "key": net["head_public"], "frames": [fail]},
               {"kind": "join", "endpoint": net["join"], "key": net["head_public"], "frames": [join]},
               {"kind": "stage", "endpoint": net["stages"][1]["endpoint"], "key": net["stages"][1]["public"],
                "frames": [stop]}]
    # from namespace c: the intruder is on the run's network, it just lacks the key
    r = subprocess.run(ns.exec(2) + [PYTHON, "-c", INTRUDER, json.dumps(targets)], capture_output=True, text=True,
                       timeout=60, cwd=str(REPO))
    assert r.returncode == 0 and r.stdout.startswith("done"), r.stderr
    assert run.popen.poll() is None, "the run ended before the intruder was through: make debug.delay_s longer"
    rc = run.wait(120)
    assert rc == 0, run.stderr
    rep = json.loads((run.out / "report.json").read_text())
    assert rep["residual_md5"] == want  # nothing the intruder sent was acted on
    assert [s["chunks"] for s in rep["stages"]] == [8, 8, 8] and all(s["bad_frames"] == 0 for s in rep["stages"])
    # each of the 3 sockets refused each of the 3 intruders at least once (a wrong server key retries)
    assert rep["rejected_connections"] >= 9, rep["rejected_connections"]
    for what in ("notes", "join"):  # both of the head's sockets, both kinds of refusal, logged
        assert re.search(rf"refused connection #\d+ on {what} tcp://\S+: key not allowed", run.stderr), run.stderr
        assert re.search(rf"refused connection #\d+ on {what} tcp://\S+: protocol or key mismatch", run.stderr)
    assert re.search(r"refused connection #3 on stage 1 inbox", (run.out / "stage-1.log").read_text())
    _nothing_left(ns, run)


# -- a stage started by hand ---------------------------------------------------------------------------
@pytest.mark.slow
def test_remote_command_print(tmp_path, ns):
    """`remote_command: print`: the head prints the exact command; run by hand (here: in namespace b) it joins."""
    rig = _rig(ns, "ab", remote_command="print")
    want = _reference_md5(tmp_path, rig, "local")
    run = _launch(ns, tmp_path, rig)
    m = _wait_stderr(run, r"start it there.*\n  (.+)\n", 60)
    assert m, run.early_stderr
    argv = shlex.split(m[1])
    assert argv[:4] == [sys.executable, "-m", "workers.join", "--join"] and argv[5] == "--key", m[1]
    by_hand = subprocess.Popen(ns.exec(1) + argv, cwd=str(REPO), stdout=subprocess.DEVNULL,
                               stderr=open(tmp_path / "by-hand.log", "w"))
    try:
        rc = _finish(run, 120)
        assert rc == 0, run.stderr
        assert by_hand.wait(15) == 0
    finally:
        if by_hand.poll() is None:
            by_hand.kill()
    rep = json.loads((run.out / "report.json").read_text())
    assert rep["residual_md5"] == want
    _nothing_left(ns, run, [by_hand.pid])


# -- without namespaces: a "remote" stage over loopback ------------------------------------------------
@pytest.mark.slow
def test_remote_stage_over_loopback(tmp_path):
    """Runs anywhere (no root): stage 1 is "remote" on this machine, over 127.0.0.1 with CurveZMQ,
    started by a remote_command without ssh; same md5 as the single-host run. A remote_command that
    fails fails the run naming the stage and its host."""
    from strata.head.pipeline import Pipeline, PipelineError
    rig = make_rig(2, dump_residual=True, listen="127.0.0.1", **HEARTBEAT,
                   remote_command="{python} -m workers.join --join {join} --key {key}")
    rig["stages"][1]["host"] = "loopback"
    want = _reference_md5(tmp_path, rig, "local")
    with Pipeline(rig, out=tmp_path / "lo", console=False) as p:
        rep = p.prefill().report
        pids = [s.pid for s in p.stages]
    assert rep["residual_md5"] == want and rep["boundaries"] == ["tcp"]
    assert not wait_gone([Proc(x) for x in pids], 10.0) and segments(owner_pid=os.getpid()) == []
    with pytest.raises(PipelineError, match=r"^stage 1 \(cpu on loopback, pid \d+, chunk -1\) exited with code 1$"):
        with Pipeline(dict(rig, remote_command="false {join} {key}"), out=tmp_path / "f", console=False) as p:
            p.prefill()


# -- refusals before anything starts (no namespaces needed) -------------------------------------------
def test_remote_stage_needs_listen(tmp_path):
    from strata.config import ConfigError, from_dict
    rig = make_rig(2)
    rig["stages"][1]["host"] = "gpu-box-2"
    with pytest.raises(ConfigError, match=r"^listen: required when a stage is remote \(stage 1 runs on host "
                                          r"'gpu-box-2'\)"):
        from_dict(rig)
    with pytest.raises(ConfigError, match=r"remote_command: must pass \{join\} and \{key\}"):
        from_dict(dict(rig, listen="10.0.0.5", remote_command="ssh {host} python -m workers.join"))
    with pytest.raises(ConfigError, match=r"remote_command: unknown field \{hots\}"):
        from_dict(dict(rig, listen="10.0.0.5", remote_command="ssh {hots} {join} {key}"))
    assert from_dict(dict(rig, listen="10.0.0.5:7777")).stages[1].remote
    r = subprocess.run([PYTHON, str(REPO / "launcher.py"), "--config", str(write_rig(tmp_path / "r.yaml", rig)),
                        "--out", str(tmp_path / "o")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.startswith("error: listen: required") and len(r.stderr.splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_stage_join_refuses_a_bad_key():
    r = subprocess.run([PYTHON, "-m", "workers.join", "--join", "tcp://127.0.0.1:9", "--key", "abc"],
                       capture_output=True, text=True, timeout=60, cwd=str(REPO))
    assert r.returncode == 2 and "--key" in r.stderr


@pytest.mark.slow
def test_the_old_remote_entry_says_where_it_moved():
    """`-m workers.stage` (a rig's remote_command from before the move) exits with an error, not silently."""
    r = subprocess.run([PYTHON, "-m", "workers.stage", "--join", "tcp://127.0.0.1:9", "--key", "abc"],
                       capture_output=True, text=True, timeout=60, cwd=str(REPO))
    assert r.returncode == 1 and "python -m workers.join" in r.stderr
