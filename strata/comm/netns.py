"""Several "hosts" on one Linux machine, for tests and benchmarks of stages across hosts: network
namespaces joined by a bridge. Needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN) and iproute2.

    with Netns(3) as ns:          # strata<pid>a (10.77.0.1, holds the bridge), ...b (.2), ...c (.3)
        subprocess.run(ns.exec(1) + ["python", ...])

Nothing is added to the root namespace: the bridge lives in the first namespace and each veth pair
is created straight between two namespaces, so every packet stays inside them and runs in
parallel (other pids) do not collide. Deleting a namespace deletes its interfaces; `down` also
kills what still runs inside. `sweep` removes namespaces left by a dead pid.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time

PREFIX = "strata"
SUBNET = "10.77.0"
_NAME = re.compile(rf"^{PREFIX}(\d+)([a-z])$")


class NetnsError(RuntimeError):
    pass


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if r.returncode:
        raise NetnsError(f"ip {' '.join(args)}: {r.stderr.strip() or r.returncode}")


def available() -> str | None:
    """None if namespaces can be made here, else why not."""
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    if os.geteuid() != 0:
        return "not root"
    name = f"{PREFIX}{os.getpid()}z"
    try:
        _ip("netns", "add", name)
    except (NetnsError, OSError) as e:
        return f"cannot make a network namespace: {e}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def listed() -> list[str]:
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return [line.split()[0] for line in r.stdout.splitlines() if line.strip()]


def sweep() -> list[str]:
    """Delete namespaces of ours whose creating process is dead."""
    gone = []
    for name in listed():
        m = _NAME.match(name)
        if m and not os.path.exists(f"/proc/{m[1]}"):
            kill_inside(name)
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            gone.append(name)
    return gone


def pids_inside(name: str) -> list[int]:
    r = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
    return [int(x) for x in r.stdout.split()]


def kill_inside(name: str) -> None:
    for pid in pids_inside(name):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


class Netns:
    """`n` namespaces on one bridge, 10.77.0.1 .. 10.77.0.n/24, loopback up in each."""

    def __init__(self, n: int = 3):
        self.names = [f"{PREFIX}{os.getpid()}{chr(ord('a') + k)}" for k in range(n)]

    def addr(self, k: int) -> str:
        return f"{SUBNET}.{k + 1}"

    def exec(self, k: int) -> list[str]:
        """argv prefix that runs a command in namespace k."""
        return ["ip", "netns", "exec", self.names[k]]

    def up(self) -> "Netns":
        sweep()
        try:
            for name in self.names:
                _ip("netns", "add", name)
                _ip("-n", name, "link", "set", "lo", "up")
            hub = self.names[0]
            _ip("-n", hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", hub, "addr", "add", f"{self.addr(0)}/24", "dev", "br0")
            _ip("-n", hub, "link", "set", "br0", "up")
            for k, name in enumerate(self.names[1:], start=1):
                port = f"p{k}"
                _ip("link", "add", port, "netns", hub, "type", "veth", "peer", "name", "eth0", "netns", name)
                _ip("-n", hub, "link", "set", port, "master", "br0")
                _ip("-n", hub, "link", "set", port, "up")
                _ip("-n", name, "addr", "add", f"{self.addr(k)}/24", "dev", "eth0")
                _ip("-n", name, "link", "set", "eth0", "up")
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        """Kill what still runs inside, then delete the namespaces (and with them every interface)."""
        for name in self.names:
            kill_inside(name)
        time.sleep(0.05)
        for name in self.names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)

    def __enter__(self) -> "Netns":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()
