"""Shared-memory segments for hand-off buffers: one owner (the head), named after the run and
the owner's pid so a later start can remove the segments of a dead owner; unlinked as soon as
every stage has mapped them, so even SIGKILL leaks nothing. GPU stages pin their mapping in
place with cudaHostRegister (pin_memory() would copy)."""
from __future__ import annotations

import mmap
import os
import re
import shutil
from pathlib import Path

import torch

SHM_DIR = Path("/dev/shm")
PREFIX = "strata-"
_NAME = re.compile(r"^strata-(?P<run>[0-9a-z]+)-(?P<pid>\d+)-(?P<what>[0-9a-z]+)$")


def segment_name(run_id: str, what: str, owner_pid: int | None = None) -> str:
    return f"{PREFIX}{run_id}-{owner_pid or os.getpid()}-{what}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_dead() -> list[str]:
    """Remove segments whose owning head is dead (left by a crash of an older Strata)."""
    removed = []
    if not SHM_DIR.is_dir():
        return removed
    for p in SHM_DIR.iterdir():
        m = _NAME.match(p.name)
        if m and not _alive(int(m["pid"])):
            try:
                p.unlink()
                removed.append(p.name)
            except FileNotFoundError:
                pass
    return removed


def run_segments(run_id: str) -> list[str]:
    if not SHM_DIR.is_dir():
        return []
    return sorted(p.name for p in SHM_DIR.iterdir() if p.name.startswith(f"{PREFIX}{run_id}-"))


def check_room(nbytes: int) -> None:
    """A full /dev/shm gives SIGBUS at first touch, not an error: check before creating."""
    free = shutil.disk_usage(SHM_DIR).free
    if nbytes > free:
        raise OSError(f"/dev/shm has {free:,} bytes free but the hand-off buffers need {nbytes:,}")


class Segment:
    """A mapped /dev/shm file. `create` (owner) or `attach` (stages), then `tensor` views."""

    def __init__(self, name: str, nbytes: int, create: bool):
        self.name, self.nbytes, self.owner = name, nbytes, create
        path = SHM_DIR / name
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, nbytes)
                # reserve the pages now: a full /dev/shm fails here, not as SIGBUS mid-run
                os.posix_fallocate(fd, 0, nbytes)
            elif os.fstat(fd).st_size < nbytes:
                raise OSError(f"segment {name} is smaller than expected")
            self.mm = mmap.mmap(fd, nbytes)
        except BaseException:
            os.close(fd)
            if create:
                _unlink(path)
            raise
        os.close(fd)
        self._base = torch.frombuffer(self.mm, dtype=torch.uint8)
        self._pinned = False

    @classmethod
    def create(cls, name: str, nbytes: int) -> "Segment":
        return cls(name, nbytes, create=True)

    @classmethod
    def attach(cls, name: str, nbytes: int) -> "Segment":
        return cls(name, nbytes, create=False)

    def tensor(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        n = 1
        for s in shape:
            n *= s
        return self._base[: n * torch.empty((), dtype=dtype).element_size()].view(dtype).view(shape)

    def pin(self) -> bool:
        """Page-lock this mapping for fast async copies to and from the GPU (after CUDA is up)."""
        if self._pinned or self.nbytes == 0 or not torch.cuda.is_available():
            return self._pinned
        err = torch.cuda.cudart().cudaHostRegister(self._base.data_ptr(), self.nbytes, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of {self.name} ({self.nbytes:,} bytes) failed: {err}")
        self._pinned = True
        return True

    def unlink(self) -> None:
        _unlink(SHM_DIR / self.name)

    def close(self) -> None:
        if self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self._base.data_ptr())
            self._pinned = False
        self._base = None
        try:
            self.mm.close()
        except BufferError:
            pass  # a view still alive; the mapping goes with the process


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
