"""Decode doorbells: a decode step's note as a few words in shared memory, read by a spinning receiver.

A decode step is ~5 ms of GPU work on 2 GPUs, and its notes (head -> stage 0 -> ... -> head) cost ~0.15 ms a
hop through ZeroMQ: the sender's and the receiver's I/O threads each wake up once per message (BENCHMARKS.md).
With every stage on a GPU of this host the receivers spin anyway, so a hop can be one shared cache line:
the sender writes the note's fields, then bumps the line's sequence number; the receiver polls that number.

One bell per receiver (stage i: row i, the head: row n), one sender each (the hop above it) and at most one
note in flight per bell (the ring carries one token). Plain stores and loads are ordered on x86-64 (TSO), so
a receiver that sees the new number sees the fields written before it; elsewhere `supported()` is False and
the notes stay on ZeroMQ. The rows a note announces are in their page-locked buffers before the bell rings
(the sender synchronized its stream). Control (stop, end of phase, failures) stays on ZeroMQ, and so does
each phase's first step: a receiver that is not yet spinning wakes on its socket.
"""
from __future__ import annotations

import platform

import numpy as np

ROW = 8  # int64 words per bell: one 64-byte cache line (seq, k, pos, argmax, t0 as float64, 3 spare)
SEQ, K, POS, ARGMAX, T0 = range(5)


def supported() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def wanted(devices: list[str], any_remote: bool, mode: bool | str = "auto") -> bool:
    """Whether a run with stages on these devices rings bells for its decode steps. mode (the rig's
    kernels.decode_bells): "auto" when every stage is a local CUDA one (on 2 H200s, 8B, they took a token from 5.67
    to 5.16 ms, BENCHMARKS.md), False for ZeroMQ only (the A/B arm), True for any local stages (tests)."""
    if mode is False or any_remote or not supported():
        return False
    return mode is True or all(d.startswith("cuda") for d in devices)


def ahead_wanted(devices: list[str], mode: bool | str = "auto") -> bool:
    """Whether stages on these devices (a run that rings bells) queue their next decode step ahead. mode (the rig's
    kernels.decode_ahead): "auto" when every stage has a GPU of its own (each queues its next step behind a GPU-side
    wait on its bell, strata/comm/stream_wait.py), False to have the host launch each step once its note is in (the A/B
    arm). Stages sharing a GPU never queue ahead: a stream parked on a wait would hold the GPU's time slices from
    the others."""
    return mode is not False and all(d.startswith("cuda") for d in devices) and len(set(devices)) == len(devices)


def nbytes(n_stages: int) -> int:
    return (n_stages + 1) * ROW * 8


class Bells:
    """The bells of a run: `words`, an int64 (n_stages + 1, ROW) array over the shared segment."""

    def __init__(self, words: np.ndarray):
        self.words = words
        self.floats = self.words.view(np.float64)
        self.seen = 0  # the last sequence number this process took from its own bell

    def ring(self, row: int, k: int, pos: int, argmax: int = -1, t0: float = 0.0) -> None:
        w = self.words[row]
        w[K], w[POS], w[ARGMAX] = k, pos, argmax
        self.floats[row, T0] = t0
        w[SEQ] = w[SEQ] + 1  # last: the receiver reads the fields once it sees this change

    def release(self, row: int, pos: int) -> int:
        """Ring this process's own bell as if the hop above had, for a step queued behind a wait on it that will
        not come (end of phase): the queued step then runs at `pos` (token 0) and is dropped. Returns the new seq,
        which this process has then seen."""
        w = self.words[row]
        w[POS], w[ARGMAX] = pos, 0
        self.seen = int(w[SEQ]) + 1
        w[SEQ] = self.seen
        return self.seen

    def take(self, row: int) -> tuple[int, int, int, float] | None:
        """(k, pos, argmax, t0) of a new note on this bell, else None."""
        seq = int(self.words[row, SEQ])
        if seq == self.seen:
            return None
        self.seen = seq
        w = self.words[row]
        return int(w[K]), int(w[POS]), int(w[ARGMAX]), float(self.floats[row, T0])
