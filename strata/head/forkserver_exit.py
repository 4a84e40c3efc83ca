"""Imported by the fork server only (stage_procs.PRELOAD): its socket's pymp-* directory goes with it.

Python's fork server listens on a unix socket in a `pymp-*` directory that the head creates and removes at its
own exit. A head killed by SIGKILL removes nothing; its fork server sees its pipe close and exits normally, so
an exit hook here removes the socket and that directory (only those: a `listener-*` socket in a `pymp-*` dir).
Forked stages leave through os._exit, which runs no exit hooks, and the hook checks its pid anyway.
"""
from __future__ import annotations

import atexit
import os
import socket
import stat


def _listener_paths() -> list[str]:
    paths = []
    for name in os.listdir("/proc/self/fd"):
        try:
            fd = int(name)
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            s = socket.socket(fileno=os.dup(fd))
        except (OSError, ValueError):
            continue
        with s:
            addr = s.getsockname() if s.family == socket.AF_UNIX else None
        if isinstance(addr, str) and os.path.basename(addr).startswith("listener-") \
                and os.path.basename(os.path.dirname(addr)).startswith("pymp-"):
            paths.append(addr)
    return paths


def _remove(pid: int, paths: list[str]) -> None:
    if os.getpid() != pid:
        return
    for p in paths:
        for step in (os.unlink, lambda q: os.rmdir(os.path.dirname(q))):
            try:
                step(p)
            except OSError:
                pass


try:
    atexit.register(_remove, os.getpid(), _listener_paths())
except OSError:  # no /proc: nothing to remove later
    pass
