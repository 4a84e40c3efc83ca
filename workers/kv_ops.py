"""The stage's KV operations between prompts: prefix-cache snapshots (strata/kvcache/prefix_cache.py) and KV files
(strata/kvcache/kv_file.py), one `KvOp` note from the head each, answered by one `KvDone`.

The head decides what to snapshot, restore, drop, save and load; the stage only checks that the rows asked for
are inside its cache and does it. With one sequence no chunk is in flight while one runs (the head sends them
between prompts and waits for every answer). With several (max_seqs > 1) a snapshot or restore names a slot
that has nothing in flight (the head waits for every stage's answer to a restore before the slot's first chunk,
and snapshots a prompt's blocks after its last chunk, rows its decode steps never write) while other slots'
chunks may be queued or half done here: so it reads and writes that slot's tensors directly, never through
`use_slot`. On CUDA every later chunk waits on the device for the snapshots' copies out (`before_write`), and
a restore's copies in go on the compute stream, after what is queued there.
"""
from __future__ import annotations

import collections
import os
import threading
import time

from strata.kvcache import kv_file
from strata.comm import messages as M
from strata.kvcache.prefix_cache import Snapshots, layer_caches


class StageKv:
    def __init__(self, model, device, max_len: int, log, answer, stage: int, device_bytes: int = 0):
        """answer(KvDone): how the stage sends an op's answer to the head. device_bytes: the prefix cache's device
        tier (a CUDA stage's)."""
        self.model, self.max_len, self.log = model, max_len, log
        self.answer, self.stage = answer, stage
        self.snapshots = Snapshots(model, device, device_bytes if device.type == "cuda" else 0)
        if self.snapshots.tier is not None:
            log.info("prefix cache: a device tier of %d bytes", device_bytes)
        self._told = False  # the disk writer's failure was logged
        # ops answered in the order they came (the head matches answers so); a restore whose blocks are on disk
        # alone waits at the front while a thread reads the files, and the stage's chunks go on meanwhile
        self._ops: collections.deque[M.KvOp] = collections.deque()
        self._reader: threading.Thread | None = None
        self._box: dict = {}  # what the reader read: key -> its bytes, or the error
        self._fetched: dict | None = None

    @property
    def waiting(self) -> bool:
        """An op waits for its files: the stage should look again soon (advance)."""
        return self._reader is not None

    def submit(self, msg: M.KvOp) -> None:
        self._ops.append(msg)
        self.advance()

    def advance(self) -> None:
        """Do the ops that can be done now, in order, answering each."""
        while self._ops:
            msg = self._ops[0]
            if msg.op == "restore" and self._fetched is None:
                if self._reader is None:
                    try:
                        self._check(msg)
                        keys = self.snapshots.on_disk_only(msg.keys)
                        size = self.snapshots.block_bytes(msg.block, msg.slot)
                    except (ValueError, KeyError, RuntimeError):
                        keys = []  # (handle answers the error)
                    if keys:
                        self._box = {}
                        self._reader = threading.Thread(
                            target=lambda: self._box.update(self.snapshots.read_files(keys, size)),
                            name="kv-read", daemon=True)
                        self._reader.start()
                        return
                    self._fetched = {}
                elif self._reader.is_alive():
                    return
                else:
                    self._fetched, self._reader = self._box, None
            self._ops.popleft()
            fetched, self._fetched = self._fetched, None
            self.answer(self.handle(msg, self.stage, fetched))

    def before_write(self) -> None:
        """Call before a chunk writes the live cache."""
        self.snapshots.before_write()

    def handle(self, msg: M.KvOp, stage: int, fetched: dict | None = None) -> M.KvDone:
        """Do msg; an error is the answer's one line (the head decides what it means), never this stage's end."""
        try:
            self._check(msg)
            keys, states = [], []
            if msg.op == "open":  # the disk tier's folder (kv_cache_dir): the keys it already holds
                keys, states = self.snapshots.open(msg.path)
                self.log.info("prefix cache on disk: %s, %d blocks%s", msg.path, len(keys),
                              f", {len(states)} kept states" if states else "")
            elif msg.op == "unlink":
                self.snapshots.unlink(msg.keys)
            elif msg.op == "snap":
                t = time.perf_counter()
                self.snapshots.snap(msg.keys, msg.blocks, msg.block, msg.slot)
                # (a CUDA stage's new blocks are pinned host memory: the first ones cost a cudaHostAlloc each)
                self.log.info("prefix cache: %d blocks snapped in %.1f ms of the host's time (the copies queued)",
                              len(msg.keys), 1e3 * (time.perf_counter() - t))
            elif msg.op == "restore":
                t = time.perf_counter()
                self.snapshots.restore(msg.keys, msg.blocks, msg.block, msg.slot, fetched)
                if msg.state:  # linear or window layers: their states kept at the restored boundary
                    self.snapshots.restore_state(msg.state, msg.slot, msg.tokens)
                self.log.info("prefix cache: %d blocks restored in %.1f ms of the host's time (the copies queued)",
                              len(msg.keys), 1e3 * (time.perf_counter() - t))
            elif msg.op == "drop":
                self.snapshots.drop(msg.keys)
            elif msg.op == "save":
                self.snapshots.before_write()  # not needed for a read, but a save must see the rows as of now
                kv_file.write_rows(msg.path, msg.offset, msg.tokens, layer_caches(self.model))
            else:  # load: into msg.slot's caches (with max_seqs > 1 a free slot, snapshotted into the prefix cache next)
                self.snapshots.before_write()
                kv_file.read_rows(msg.path, msg.offset, msg.tokens, layer_caches(self.model, msg.slot))
            error = ""
        except (OSError, ValueError, KeyError, RuntimeError) as e:  # RuntimeError: torch (no pinned memory left)
            error = f"{type(e).__name__}: {e}".splitlines()[0][:500]
            keys, states = [], []
            self.log.warning("kv %s: %s", msg.op, error)
        if self.snapshots.write_error and not self._told:
            self._told = True
            self.log.warning("prefix cache on disk: a block's write failed (%s); no more are written",
                             self.snapshots.write_error)
        t = self.snapshots.tier
        return M.KvDone(stage=stage, op=msg.op, error=error, held_bytes=self.snapshots.nbytes,
                        device_blocks=len(t.lru) if t is not None else 0, device_hits=t.hits if t is not None else 0,
                        keys=keys,
                        states=states)

    def close(self) -> None:
        """The stage's end: the disk writes queued so far are finished (never a half-written block file)."""
        if self._reader is not None:
            self._reader.join()
        t = self.snapshots.tier
        if t is not None:
            self.log.info("prefix cache, device tier: %d blocks restored from it, %d from the host or disk; %d held "
                          "(%d bytes)%s", t.hits, t.misses, len(t.lru), t.nbytes,
                          f"; shrunk to {t.budget} bytes when the device had no room" if t.shrunk else "")
        self.snapshots.close()

    def _check(self, msg: M.KvOp) -> None:
        if msg.op in ("snap", "restore") and any((j + 1) * msg.block > self.max_len for j in msg.blocks):
            raise ValueError(f"{msg.op}: a block past the cache's {self.max_len} positions")
        if msg.op == "open" and not os.path.isabs(msg.path):
            raise ValueError(f"open: not an absolute path: {msg.path!r}")
        if msg.op in ("save", "load"):
            if not (1 <= msg.tokens <= self.max_len):
                raise ValueError(f"{msg.op}: {msg.tokens} rows for a cache of {self.max_len}")
            if not os.path.isabs(msg.path):
                raise ValueError(f"{msg.op}: not an absolute path: {msg.path!r}")
