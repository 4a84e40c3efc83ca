"""What a run leaves behind, looked up without psutil: its processes (/proc, pinned by start time),
the pids and times its stage logs record, its /dev/shm segments. Shared by the tests, bench/soak.py and
the launcher's exit (strata.head.procs.stop_forkserver).

A zombie counts as gone: it holds no memory and no device, and a SIGKILLed head's orphans may be
reaped late by the container's init.
"""
from __future__ import annotations

import re
import time
from pathlib import Path

SHM = Path("/dev/shm")
_SEG = re.compile(r"^strata-(?P<run>[0-9a-z]+)-(?P<pid>\d+)-(?P<what>[0-9a-z]+)$")


# -- processes -----------------------------------------------------------------------------------
def _stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in ticks) of a pid, or None if there is no such process."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    rest = raw[raw.rindex(")") + 2:].split()  # the command name may hold spaces and parentheses
    return rest[0], int(rest[19])


class Proc:
    """A process of a run, pinned by its start time (a pid alone may be reused)."""

    def __init__(self, pid: int, what: str = ""):
        st = _stat(pid)
        self.pid, self.what = pid, what or f"pid {pid}"
        self.start = st[1] if st else None

    def alive(self) -> bool:
        st = _stat(self.pid)
        return st is not None and st[0] not in ("Z", "X") and st[1] == self.start

    def __repr__(self) -> str:
        return f"<{self.what} pid {self.pid}>"


def descendants(pid: int) -> list[int]:
    """Every descendant of pid (children, their children, ...), from the parent pids in /proc."""
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                raw = (d / "stat").read_text()
            except OSError:
                continue
            kids.setdefault(int(raw[raw.rindex(")") + 2:].split()[1]), []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def wait_gone(procs, timeout: float) -> list:
    """Wait up to `timeout` s for every process to be gone; returns the ones still alive."""
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in procs if p.alive()]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def stage_pids(out: Path) -> dict[int, int]:
    """Stage index -> pid, from the first line each stage writes to its log."""
    pids = {}
    for f in sorted(Path(out).glob("stage-*.log")):
        m = re.search(r"\[stage (\d+)\] INFO pid (\d+),", f.read_text(errors="replace"))
        if m:
            pids[int(m[1])] = int(m[2])
    return pids


def log_time(out: Path, stage: int, text: str) -> float | None:
    """Wall-clock time (time.time()) of the first line of stage-<stage>.log containing `text`."""
    f = Path(out) / f"stage-{stage}.log"
    if not f.is_file():
        return None
    for line in f.read_text(errors="replace").splitlines():
        if text in line:
            m = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})", line)
            if m:
                return time.mktime(time.strptime(m[1], "%Y-%m-%d %H:%M:%S")) + int(m[2]) / 1000
    return None


def ready_count(out: Path) -> int:
    return sum("ready: loaded" in f.read_text(errors="replace") for f in Path(out).glob("stage-*.log"))


# -- shared memory -------------------------------------------------------------------------------
def segment_owner(name: str) -> tuple[str, int]:
    """(run id, head pid) of a Strata segment's name."""
    m = _SEG.match(name)
    return m["run"], int(m["pid"])


def segments(owner_pid: int | None = None, run_id: str | None = None) -> list[str]:
    """Strata segments in /dev/shm, optionally only those of one owner (head pid) or run id."""
    out = []
    for p in SHM.iterdir() if SHM.is_dir() else ():
        m = _SEG.match(p.name)
        if not m:
            continue
        if owner_pid is not None and int(m["pid"]) != owner_pid:
            continue
        if run_id is not None and m["run"] != run_id:
            continue
        out.append(p.name)
    return sorted(out)
