"""The prefix cache: earlier prompts' KV rows kept by block, so a prompt that begins as one of them skips that prefill.

A prompt's ids are cut into blocks of `BLOCK` tokens; block j's key is a chain hash (blake2b of block j - 1's key
and block j's ids), so one key names the whole prefix up to the end of its block. With prefix_reuse rows its last,
partial block is kept too, under a key of its own (`tail_key`); the index keeps its ids, and a later prompt that
shares only its first c ids restores the block and uses its first c rows (a row depends only on the ids up to it). The head decides everything
(`PrefixIndex`, used by strata/head/kv_rounds.py): which blocks the stages hold, LRU within `prefix_cache_bytes` per
stage, and a new prompt's longest cached prefix. It tells every stage, by `KvOp` notes between prompts, to
snapshot a prompt's full blocks after its prefill, to restore a prefix into the live cache before the next one,
and to drop what it evicts. With several sequences (max_seqs > 1, strata/head/slots.py) a snapshot or restore names
a slot, one with nothing in flight, while other slots' micro-batches may be. A stage (`Snapshots`) keeps per block a copy of the block's rows of every layer it
holds, in host memory (pinned on a CUDA stage, whose copies out run asynchronously on a stream of their own and
are waited for on the device before the live cache is written again), and applies no policy of its own, but one:
a CUDA stage's device tier (`prefix_cache_device_bytes`, `DeviceTier`) keeps the blocks it snapped or restored
last in device memory too, LRU, a subset of what it holds; a restore reads those on the device. It changes where
a block is read from, never which blocks are held, so the head's index knows nothing of it.

With `kv_cache_dir` the host tier writes through to disk: every snapshot block is also written, by a thread of
the stage, to a file of its own under the stage's folder (`stage_folder`: the rig's model, dtype and kv_dtype
hashed, then the stage's layer range and device type), and a block the host evicted is restored from its file.
The head keeps a second LRU index for the disk within `kv_cache_dir_bytes` a stage, rebuilt at start from what
every stage lists (a block counts only where every stage has its file), and the last partial blocks' ids in its
own folder; so a later run of the same model and rig, another process, skips the prefill of a document it saw.

Rows are opaque: whatever a cache's dtype and last dimension (float, bfloat16, 8-bit codes, packed blocks), a
snapshot copies the rows of each (1, n_kv, rows, last) cache tensor along dim 2, byte for byte.

Blocks hold the global attention layers' rows. A linear-attention layer (Qwen3.5) keeps a fixed-size recurrent
state, and a window layer a ring of window + chunk - 1 rows; both are valid only at the exact position they were
taken. So beside the blocks, a stage keeps those layers' states at block boundaries: the linear layers' states
and each window layer's last window - 1 positions' rows, copied out right after a prefill chunk that ends on a
boundary (the head names the states' key in that chunk's note; it also cuts a prompt's chunk at its last boundary
before its last token). A later prompt restores its global rows up to a boundary whose states are held, and those
states; the rest is prefilled. With `kv_cache_dir` the states are written through to files too (a `states` folder
beside the blocks'). KV files hold every position's rows and are refused for such models.
"""
from __future__ import annotations

import hashlib
import heapq
import json
import os
import queue
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

BLOCK = 256      # tokens a block: the unit of hashing, snapshots and eviction
# bytes of blocks the head dropped from a stage's host tier while their disk writes were still queued (they stay in
# host memory until written): past this, the drop waits for the writer, so a disk slower than the prefills slows
# the snapshots instead of growing host memory past prefix_cache_bytes (an 8B's block is 32 MiB: 32 of them)
ORPHAN_BYTES = 1 << 30
KEY_BYTES = 16   # a block key: blake2b-128 of (the previous key, the block's ids as int32)


def supported(args, files: bool = False) -> str | None:
    """None when a prefix can be restored at a block boundary (a model with linear-attention or window layers:
    where their states were kept); else why not. files: KV files (kv_save / kv_load), which hold one prompt's KV
    rows only."""
    if files and hybrid(args):
        return "a KV file holds KV rows, not linear-attention layers' states"
    if files and any(args.window(i) for i in range(args.n_layers)):
        return "a KV file holds every position's rows, not a window layer's ring"
    if args.rope_scaling and args.rope_scaling.get("rope_type") == "dynamic":
        return "dynamic NTK rope: a prompt's keys past max_position_embeddings rotate by the prompt's length"
    return None


def hybrid(args) -> bool:
    """Whether the model has linear-attention layers (a recurrent state a layer, beside the attention layers' KV)."""
    return args.linear_layers is not None and any(args.linear_layers)


def stateful(args) -> bool:
    """Whether some layers hold what a block cannot: a linear layer's state, a window layer's ring (its last
    window - 1 positions): kept at chunk ends on block boundaries (Snapshots.keep_state), not snapshotted by block."""
    return hybrid(args) or any(args.window(i) for i in range(args.n_layers))


def row_bytes_of(args, layers, kv: torch.dtype) -> int:
    """Bytes of one position's K and V rows across these (attention) layers at storage dtype kv."""
    from strata.kernels.attention import cache_width
    return len(layers) * sum(h * cache_width(w, kv) for h, w in args.kv_rows()) * kv.itemsize


def kept_bytes(args, start: int, end: int, kv: torch.dtype) -> int:
    """The most bytes one kept state of layers [start, end) takes without the linear layers' (their size is the
    stage's): each window layer's last window - 1 positions' rows."""
    wins = [i for i in range(start, end) if args.window(i) and not args.is_linear(i)]
    return sum(row_bytes_of(args, [i], kv) * (args.window(i) - 1) for i in wins)


def state_key(key: bytes) -> bytes:
    """The key of the states kept at the end of the block keyed `key` (keep_state's; its own namespace: a drop of
    either never takes the other)."""
    return hashlib.blake2b(b"state" + key, digest_size=KEY_BYTES).digest()


def tail_key(prev: bytes, tail: np.ndarray) -> bytes:
    """The key of a prompt's last, partial block (its ids after its full blocks, whose last key is `prev`; b"" for
    none): a name of its own, never a full block's (the marker), so a chain of full blocks never reads it."""
    return hashlib.blake2b(prev + b"tail" + np.ascontiguousarray(tail, dtype="<i4").tobytes(),
                           digest_size=KEY_BYTES).digest()


def common_length(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading ids a and b share."""
    m = min(a.size, b.size)
    diff = np.flatnonzero(np.asarray(a[:m]) != np.asarray(b[:m]))
    return int(diff[0]) if diff.size else m


def block_keys(ids: np.ndarray, block: int = BLOCK) -> list[bytes]:
    """Chain-hash keys of the full blocks of ids (a tail shorter than a block has none)."""
    ids = np.ascontiguousarray(ids, dtype="<i4")
    keys, prev = [], b""
    for j in range(ids.size // block):
        prev = hashlib.blake2b(prev + ids[j * block:(j + 1) * block].tobytes(), digest_size=KEY_BYTES).digest()
        keys.append(prev)
    return keys


@dataclass(frozen=True)
class PrefixCacheStats:
    """The prefix cache's figures for the server's /metrics (all 0: no prefix cache, or it is off)."""

    lookups: int = 0          # prefills that looked their prompt up in the index
    hits: int = 0             # of them, those it held a usable prefix of (whole blocks up to a chunk boundary)
    blocks: int = 0           # blocks held now (the same ones on every stage)
    capacity_blocks: int = 0  # the most it holds: each stage's prefix_cache_bytes in blocks, the smallest
    block_tokens: int = 0     # tokens a block (BLOCK)
    disk_blocks: int = 0      # blocks whose files every stage holds under kv_cache_dir (0: no disk tier)
    disk_capacity_blocks: int = 0  # the most it keeps there: kv_cache_dir_bytes in blocks
    device_blocks: int = 0    # blocks a CUDA stage's device tier holds (prefix_cache_device_bytes), the fewest of any
    device_hits: int = 0      # blocks restored from a device tier so far, the fewest of any such stage


class PrefixIndex:
    """The head's view of the blocks every stage holds: LRU, at most `capacity` blocks.

    A prompt's blocks are touched deepest first, so its block 0 is the most recent of them and eviction takes the
    deepest blocks of the oldest prompt first: a chain is never left without its head while its tail stays."""

    def __init__(self, capacity: int):
        self.capacity = max(0, capacity)
        self.lru: OrderedDict[bytes, None] = OrderedDict()   # least recently used first (full blocks and tails)
        # a prompt's last, partial block: under the key of the full blocks before it (b"" for none), its tail key ->
        # its ids. Rows are causal, so a later prompt that shares only the first c of those ids may restore the
        # block and use its first c rows.
        self.tails: dict[bytes, dict[bytes, np.ndarray]] = {}
        self._parent: dict[bytes, bytes] = {}  # tail key -> the key it hangs under

    def __len__(self) -> int:
        return len(self.lru)

    def longest(self, keys: list[bytes]) -> int:
        """How many leading blocks of `keys` are held."""
        m = 0
        while m < len(keys) and keys[m] in self.lru:
            m += 1
        return m

    def touch(self, keys: list[bytes]) -> None:
        for k in reversed(keys):
            if k in self.lru:
                self.lru.move_to_end(k)

    def best_tail(self, prev: bytes, ids: np.ndarray) -> tuple[bytes | None, int]:
        """The held tail under `prev` that shares the most leading ids with `ids` -> (its key, how many; (None, 0)
        for none)."""
        best, c = None, 0
        for key, tail in self.tails.get(prev, {}).items():
            n = common_length(tail, ids)
            if n > c:
                best, c = key, n
        return best, c

    def add_tail(self, prev: bytes, tail: np.ndarray) -> tuple[bytes | None, list[bytes]]:
        """A prompt's last, partial block after its prefill -> (its key if it is to be snapshotted now, else None;
        keys evicted to make room). Touched as the prompt's newest block."""
        if not self.capacity or not tail.size:
            return None, []
        key = tail_key(prev, tail)
        new = key not in self.lru
        self.lru[key] = None
        self.lru.move_to_end(key)
        if new:
            self.tails.setdefault(prev, {})[key] = np.array(tail, dtype=np.int32)
            self._parent[key] = prev
        evicted = self._evict()
        return (key if new and key not in evicted else None), [k for k in evicted if k != key]

    def _evict(self) -> list[bytes]:
        evicted = []
        while len(self.lru) > self.capacity:
            k = self.lru.popitem(last=False)[0]
            self._forget_tail(k)
            evicted.append(k)
        return evicted

    def _forget_tail(self, key: bytes) -> None:
        prev = self._parent.pop(key, None)
        if prev is not None:
            self.tails[prev].pop(key, None)
            if not self.tails[prev]:
                del self.tails[prev]

    def add(self, keys: list[bytes]) -> tuple[list[int], list[bytes]]:
        """A prompt's full blocks, after its prefill -> (indices of the blocks to snapshot now, keys evicted to make
        room). A prompt longer than the capacity keeps its first `capacity` blocks."""
        keys = keys[:self.capacity]
        new = [j for j, k in enumerate(keys) if k not in self.lru]
        for j in new:
            self.lru[keys[j]] = None
        self.touch(keys)
        return new, self._evict()

    def load(self, keys: list[bytes], tails: dict[bytes, tuple[bytes, np.ndarray]]) -> list[bytes]:
        """What an earlier run left (the disk tier): keys oldest first, tails' key -> (the key they hang under,
        their ids) -> the keys evicted to fit the capacity (the oldest)."""
        for k in keys:
            self.lru[k] = None
            if k in tails:
                prev, ids = tails[k]
                self.tails.setdefault(prev, {})[k] = np.asarray(ids, dtype=np.int32)
                self._parent[k] = prev
        return self._evict()

    def discard(self, keys: list[bytes]) -> None:
        for k in keys:
            self.lru.pop(k, None)
            self._forget_tail(k)


def held_prefix(indexes: list[PrefixIndex], keys: list[bytes]) -> int:
    """How many leading blocks of keys some tier holds (a restore reads each block from where it is)."""
    m = 0
    while m < len(keys) and any(keys[m] in ix.lru for ix in indexes):
        m += 1
    return m


def best_tail(indexes: list[PrefixIndex], prev: bytes, ids: np.ndarray) -> tuple[bytes | None, int]:
    """PrefixIndex.best_tail over the tiers."""
    return max((ix.best_tail(prev, ids) for ix in indexes), key=lambda t: t[1], default=(None, 0))


class TailFiles:
    """The disk tier's last partial blocks' ids, in the head's folder under kv_cache_dir: file <key hex> holds the
    key they hang under (16 bytes, zeros for none) then the ids (int32 LE)."""

    def __init__(self, folder: Path):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)

    def read(self) -> dict[bytes, tuple[bytes, np.ndarray]]:
        out = {}
        for e in os.scandir(self.folder):
            try:
                key = bytes.fromhex(e.name)
                raw = Path(e.path).read_bytes()
            except (ValueError, OSError):
                continue
            if len(key) != KEY_BYTES or len(raw) < KEY_BYTES or (len(raw) - KEY_BYTES) % 4:
                continue
            prev = raw[:KEY_BYTES]
            out[key] = (b"" if prev == bytes(KEY_BYTES) else prev, np.frombuffer(raw[KEY_BYTES:], dtype="<i4"))
        return out

    def write(self, key: bytes, prev: bytes, ids: np.ndarray) -> None:
        part = self.folder / (key.hex() + ".part")
        part.write_bytes((prev or bytes(KEY_BYTES)) + np.ascontiguousarray(ids, dtype="<i4").tobytes())
        os.replace(part, self.folder / key.hex())

    def remove(self, keys: list[bytes]) -> None:
        for k in keys:
            (self.folder / k.hex()).unlink(missing_ok=True)


def layer_caches(model, slot: int | None = None) -> list[torch.Tensor]:
    """A slice's cache tensors, k then v of each layer, in layer order (read at each use: setup_cache replaces them).
    slot: that sequence's caches (Transformer.setup_cache's seqs), read without `use_slot`, which re-points the
    layers and the C decoder while the stage may be between two parts of another slot's micro-batch; None: the
    caches in use."""
    if slot is not None and not 0 <= slot < len(getattr(model, "_slots", ())):
        raise ValueError(f"slot {slot} outside the {len(getattr(model, '_slots', ()))} sequence caches")
    out = []
    for i, blk in model.layers.items():
        if getattr(blk, "linear", False) or getattr(blk.attn, "window", None) is not None:
            continue  # a recurrent state, or a ring: kept at boundaries, not by block (Snapshots.keep_state)
        a = blk.attn
        if a.k_cache is None:
            raise ValueError("the prefix cache and KV files need a KV cache on every attention layer")
        out += [a.k_cache, a.v_cache] if slot is None else list(model._slots[slot][i])
    return out


def linear_layers(model) -> list:
    """A slice's linear-attention layers (strata.models.linear_attention.GatedDeltaNet), in layer order."""
    return [blk.attn for blk in model.layers.values() if getattr(blk, "linear", False)]


def _kept_parts(model, slot: int, end: int) -> list[torch.Tensor]:
    """What `slot` keeps at position `end` besides its blocks, as views in place: each linear-attention layer's
    states, then each window layer's K and V rows of positions [max(0, end - window + 1), end) in position order
    (one or two slices of its ring), what a chunk at `end` reads."""
    out = [t for la in linear_layers(model) for t in la.held(slot)]
    for i, blk in model.layers.items():
        a = blk.attn
        if getattr(blk, "linear", False) or getattr(a, "window", None) is None:
            continue
        first = max(0, end - a.window + 1)
        for c in model._slots[slot][i]:
            S = c.shape[2]
            a0, n = first % S, end - first
            out.append(c[0, :, a0:min(S, a0 + n)])
            if a0 + n > S:  # the ring wraps
                out.append(c[0, :, :a0 + n - S])
    return out


def row_bytes(caches: list[torch.Tensor]) -> int:
    """Bytes of one position's rows across these caches (n_kv x last dim x element size each)."""
    return sum(c.shape[1] * c.shape[3] * c.element_size() for c in caches)


def _views(buf: torch.Tensor, caches: list[torch.Tensor], rows: int) -> list[torch.Tensor]:
    """buf (uint8: one block's bytes, or (R, bytes) of R blocks, DeviceTier's segments) cut into one tensor per cache
    in the cache's dtype: (1, n_kv, rows, last), or (R, n_kv, rows, last)."""
    lead = tuple(buf.shape[:-1]) or (1,)
    out, off = [], 0
    for c in caches:
        n = c.shape[1] * rows * c.shape[3] * c.element_size()
        out.append(buf[..., off:off + n].view(c.dtype).view(*lead, c.shape[1], rows, c.shape[3]))
        off += n
    return out


DISK_VERSION = 1  # of a block file's bytes (the rows as Snapshots holds them) and of the folder names


def rig_folder(fingerprint: dict) -> str:
    """The folder under kv_cache_dir of one model and rig (kv_file's fingerprint without max_context: a block's
    rows do not depend on it)."""
    fp = {k: v for k, v in fingerprint.items() if k != "max_context"}
    text = json.dumps({"disk_version": DISK_VERSION, "block": BLOCK, **fp}, sort_keys=True)
    return "rig-" + hashlib.blake2b(text.encode(), digest_size=10).hexdigest()


def stage_folder(root: str, rig: str, start: int, end: int, device_type: str) -> str:
    """A stage's folder: its layers' rows, computed on its kind of device (a CPU prefill's rows are not a GPU's)."""
    return str(Path(root) / rig / f"layers-{start}-{end}-{device_type}")


class DeviceTier:
    """The prefix cache's device tier: copies of the blocks a stage snapped or restored last, in its own device
    memory, LRU within `budget` bytes. Always a subset of what the stage holds on the host or disk (a drop takes
    both), kept by the stage alone: it changes where a restore reads a block from, never which blocks are held,
    so the head's index knows nothing of it.

    Blocks live in rows of a few large segments (allocated as the tier fills, so a device with less room than the
    plan counted shrinks the tier instead of failing). A segment seen as one (rows, n_kv, block, last) tensor per
    cache lets a restore of a whole document be one copy per cache (a gather where its rows are not in order),
    not one per cache and block: a 16k-token document of an 8B was 4,096 copies, ~110 ms of the host's time."""

    SEGMENTS = 4  # the budget is allocated in this many parts at most

    def __init__(self, budget: int, device: torch.device):
        self.budget, self.device = budget, device
        self.lru: OrderedDict[bytes, tuple[int, int]] = OrderedDict()  # key -> (segment, row)
        self.size = 0        # a block's bytes (the first block's: every block of a stage has the same)
        self.segs: list[torch.Tensor] = []  # (rows, stride) uint8 each; never freed while the stage runs, so a row
        # is reused only through new(), after the waits of Snapshots.snap / restore
        self.free: list[tuple[int, int]] = []  # a heap: the lowest row first, so a document's blocks run in order
        self._views: dict = {}
        self.hits = 0       # blocks a restore read from here
        self.misses = 0     # ... from the host or disk (then copied here)
        self.shrunk = False  # an allocation failed: the budget became what it held then

    @property
    def nbytes(self) -> int:
        return len(self.lru) * self.size

    def capacity(self, size: int) -> int:
        return self.budget // size

    def get(self, key: bytes) -> tuple[int, int] | None:
        loc = self.lru.get(key)
        if loc is not None:
            self.lru.move_to_end(key)
        return loc

    def row(self, loc: tuple[int, int]) -> torch.Tensor:
        return self.segs[loc[0]][loc[1], :self.size]

    def new(self, key: bytes, size: int, keep=frozenset()) -> tuple[int, int] | None:
        """A row for `key`'s block: a free one, or the least recently used block's not in `keep` (blocks whose
        copies are still to be queued). None: a block larger than the budget, or no row to give."""
        if size > self.budget or (self.size and size != self.size):
            return None
        self.size = size
        if len(self.lru) >= self.capacity(size):
            victim = next((k for k in self.lru if k not in keep), None)
            if victim is None:
                return None
            loc = self.lru.pop(victim)
        elif self.free:
            loc = heapq.heappop(self.free)
        else:
            loc = self._grow()
            if loc is None:
                return None
        self.lru[key] = loc
        return loc

    def _grow(self) -> tuple[int, int] | None:
        cap = self.capacity(self.size)
        n = min(max(1, -(-cap // self.SEGMENTS)), cap - sum(s.shape[0] for s in self.segs))
        if n <= 0:
            return None
        stride = -(-self.size // 256) * 256  # rows aligned: a cache's part of a row can be seen in its own dtype
        try:
            seg = torch.empty((n, stride), dtype=torch.uint8, device=self.device)
        except torch.OutOfMemoryError:  # the device has less room than the plan counted: the tier shrinks to what it
            self.budget = self.nbytes      # holds (a snapshot or restore goes on through the host, never fails)
            self.shrunk = True
            return None
        self.segs.append(seg)
        s = len(self.segs) - 1
        for r in range(1, n):
            heapq.heappush(self.free, (s, r))
        return s, 0

    def drop(self, keys: list[bytes]) -> None:
        for k in keys:
            loc = self.lru.pop(k, None)
            if loc is not None:
                heapq.heappush(self.free, loc)

    def _cache_views(self, s: int, caches: list[torch.Tensor], block: int) -> list[torch.Tensor]:
        """Segment s as one (rows, n_kv, block, last) tensor per cache, in the cache's dtype (_views' layout)."""
        key = (s, block, tuple((c.shape[1], c.shape[3], c.dtype) for c in caches))
        if key not in self._views:
            self._views[key] = _views(self.segs[s], caches, block)
        return self._views[key]

    def copy(self, caches: list[torch.Tensor], block: int, placed: list[tuple[int, int, int]], out: bool) -> None:
        """Rows of blocks between the live caches and the tier, on the current stream. placed: (j, segment, row)
        for block j's rows [j * block, (j + 1) * block); out: live -> tier, else tier -> live. One copy per cache
        for each run of consecutive blocks in one segment; rows out of order go through index_copy_ /
        index_select."""
        runs: list[tuple[int, int, list[int]]] = []
        for j, s, r in sorted(placed):
            if runs and runs[-1][1] == s and j == runs[-1][0] + len(runs[-1][2]):
                runs[-1][2].append(r)
            else:
                runs.append((j, s, [r]))
        for j0, s, rows in runs:
            n = len(rows)
            in_order = rows == list(range(rows[0], rows[0] + n))
            idx = None if in_order else torch.tensor(rows, device=self.device)
            for c, held in zip(caches, self._cache_views(s, caches, block)):
                live = c[0, :, j0 * block:(j0 + n) * block].unflatten(1, (n, block)).transpose(0, 1)
                if in_order:
                    part = held[rows[0]:rows[0] + n]
                    if out:
                        part.copy_(live, non_blocking=True)
                    else:
                        live.copy_(part, non_blocking=True)
                elif out:
                    held.index_copy_(0, idx, live)
                else:
                    live.copy_(held.index_select(0, idx), non_blocking=True)


class Snapshots:
    """A stage's snapshots: per block key, one host buffer with the block's rows of every cache of its slice;
    with a disk folder (`open`), each also written to a file there by a writer thread, and read back when the
    host copy is gone. With a device tier (`device_bytes`, a CUDA stage's), the blocks snapped or restored last
    are also kept in device memory, and a restore of those is a copy on the device."""

    def __init__(self, model, device: torch.device, device_bytes: int = 0):
        self.model = model
        self.cuda = device.type == "cuda"
        self.device = device
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.tier = DeviceTier(device_bytes, device) if device_bytes > 0 else None
        self.pending = None      # the last copy out's event (CUDA): the live cache is not written before it
        self.blocks: dict[bytes, torch.Tensor] = {}
        self.states: dict[bytes, torch.Tensor] = {}  # state_key -> a kept state's bytes on the host (keep_state)
        self.folder: Path | None = None
        self.unwritten: dict[bytes, torch.Tensor] = {}  # queued for the disk: the writer drops each once its file is
        self._lock = threading.Condition()              # complete (so a block is always here or in its file)
        self.orphan_limit = ORPHAN_BYTES
        self._state_keys: set[bytes] = set()  # keys that name states (their files in the `states` folder)
        self._queue: queue.Queue | None = None
        self._writer: threading.Thread | None = None
        self.write_error: str | None = None  # the writer's first failure (later blocks are not written)

    # -- the disk tier -----------------------------------------------------------------------------------------
    def open(self, folder: str) -> tuple[list[bytes], list[bytes]]:
        """Write through to `folder` from now on -> (the blocks whose files it holds, the kept states whose files its
        `states` folder holds), oldest first. Leftovers of a write cut short (`*.part`) are
        removed."""
        f = Path(folder)
        (f / "states").mkdir(parents=True, exist_ok=True)
        lists = []
        for d in (f, f / "states"):
            found = []
            for e in os.scandir(d):
                if e.name.endswith(".part"):
                    os.unlink(e.path)
                elif len(e.name) == 2 * KEY_BYTES and e.is_file():
                    try:
                        found.append((e.stat().st_mtime_ns, bytes.fromhex(e.name)))
                    except ValueError:
                        continue
            lists.append([k for _, k in sorted(found)])
        self.folder = f
        if self._writer is None:
            self._queue = queue.Queue()
            self._writer = threading.Thread(target=self._write_loop, name="kv-disk", daemon=True)
            self._writer.start()
        return lists[0], lists[1]

    def _file(self, key: bytes) -> Path:
        """A block's file, or a kept state's (its own folder: the keys do not say which they are)."""
        return self.folder / ("states" if key in self._state_keys else "") / key.hex()

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            what, key, buf, event = item
            try:
                if what == "unlink":
                    (self.folder / key.hex()).unlink(missing_ok=True)
                    (self.folder / "states" / key.hex()).unlink(missing_ok=True)
                elif self.write_error is None and not self._file(key).exists():
                    if event is not None:
                        event.synchronize()  # the copy out of the device is done
                    part = self._file(key).with_suffix(".part")
                    with open(part, "wb") as fh:
                        fh.write(buf.numpy().data)
                    os.replace(part, self._file(key))
            except OSError as e:
                self.write_error = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            finally:
                with self._lock:
                    if what == "write" and self.unwritten.get(key) is buf:
                        del self.unwritten[key]
                    self._lock.notify_all()

    def unlink(self, keys: list[bytes]) -> None:
        """Remove these blocks' files (in order with the writes queued before), and their device copies (they may
        have been read from the files alone)."""
        if self.tier is not None:
            self.tier.drop(keys)
        if self.folder is None:
            return
        for k in keys:
            self._queue.put(("unlink", k, None, None))

    def close(self) -> None:
        """Finish the queued writes (a stage's end: no half-written file is left behind)."""
        if self._writer is not None:
            self._queue.put(None)
            self._writer.join()
            self._writer = None

    def flush(self) -> None:
        """Wait for the queued writes (tests)."""
        if self._writer is not None:
            self.close()
            self._queue = queue.Queue()
            self._writer = threading.Thread(target=self._write_loop, name="kv-disk", daemon=True)
            self._writer.start()

    def on_disk_only(self, keys: list[bytes]) -> list[bytes]:
        """The keys a restore would read from their files (neither on the host nor queued for the disk)."""
        if self.folder is None:
            return []
        with self._lock:
            return [k for k in keys if k not in self.blocks and k not in self.unwritten]

    def block_bytes(self, block: int, slot: int | None = None) -> int:
        return row_bytes(layer_caches(self.model, slot)) * block

    def read_files(self, keys: list[bytes], size: int) -> dict[bytes, torch.Tensor | Exception]:
        """The blocks' files (any thread: file reads alone): key -> its bytes, or the error reading it."""
        out: dict[bytes, torch.Tensor | Exception] = {}
        for key in keys:
            try:
                data = np.fromfile(self._file(key), dtype=np.uint8)
                if data.size != size:
                    raise ValueError(f"restore: the file of block {key.hex()} holds {data.size} bytes, not {size}")
                os.utime(self._file(key))  # recently used: a later run's LRU starts from the files' times
                out[key] = torch.from_numpy(data)
            except (OSError, ValueError) as e:
                out[key] = e
        return out

    def _held(self, key: bytes, size: int, fetched: dict | None = None) -> torch.Tensor | None:
        """A block's bytes: on the host, queued for the disk, read ahead (`fetched`), or read from its file now
        (None: nowhere)."""
        buf = self.blocks.get(key)
        if buf is not None:
            return buf
        with self._lock:
            buf = self.unwritten.get(key)
        if buf is not None or self.folder is None:
            return buf
        got = (fetched or {}).get(key)
        if got is None:
            got = self.read_files([key], size)[key]
        if isinstance(got, ValueError):
            raise got
        return None if isinstance(got, Exception) else got

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.blocks.values()) + sum(b.numel() for b in self.states.values())

    def keep_state(self, key: bytes, slot: int, end: int) -> None:
        """A copy of what `slot` needs at position `end` besides its blocks, as it stands right after a prefill chunk
        ending there, under `key`: the linear-attention layers' states, then each window layer's last window - 1
        positions' K and V rows (from its ring, in position order); their bytes, in layer order. With a disk
        folder, written to its file too."""
        parts = _kept_parts(self.model, slot, end)
        buf = torch.empty(sum(t.numel() * t.element_size() for t in parts), dtype=torch.uint8)
        at = 0
        for t in parts:  # one part at a time into the host buffer (no device copy of them all: memory the plan
            n = t.numel() * t.element_size()  # has not counted)
            buf[at:at + n].copy_(t.contiguous().view(-1).view(torch.uint8))
            at += n
        self.states[key] = buf
        self._state_keys.add(key)
        if self.folder is not None:
            with self._lock:
                self.unwritten[key] = buf
            self._queue.put(("write", key, buf, None))

    def restore_state(self, key: bytes, slot: int, pos: int) -> None:
        """`slot`'s linear-attention states and window layers' last rows from the copy under `key` (on the host, or
        its file), kept at `pos`: the linear layers' states stand there from now on."""
        held = _kept_parts(self.model, slot, pos)
        size = sum(t.numel() * t.element_size() for t in held)
        self._state_keys.add(key)
        buf = self._held(key, size) if key not in self.states else self.states[key]
        if buf is None:
            raise KeyError(f"restore: no state snapshot {key.hex()}")
        if buf.numel() != size:
            raise ValueError(f"restore: state snapshot {key.hex()} holds {buf.numel()} bytes, not {size}")
        self.before_write()
        at = 0
        for t in held:
            n = t.numel() * t.element_size()
            src = buf[at:at + n].to(t.device)
            t.copy_(src.view(t.dtype).view(t.shape) if t.dtype != torch.uint8 else src.view(t.shape))
            at += n
        for la in linear_layers(self.model):
            la.stand_at(slot, pos)

    def snap(self, keys: list[bytes], blocks: list[int], block: int, slot: int | None = None) -> None:
        """Copy rows [j * block, (j + 1) * block) of every cache (of `slot`: layer_caches) out under keys[i]
        (j = blocks[i])."""
        caches = layer_caches(self.model, slot)
        size = row_bytes(caches) * block
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # after the prefill's kernels
        todo = [(k, j) for k, j in zip(keys, blocks) if k not in self.blocks]
        tier = self.tier
        # with a device tier: the last blocks it has room for go into it on the device (one copy per cache), then
        # each to the host in one copy; the rest straight to the host, a copy per cache and block
        first = len(todo) - tier.capacity(size) if tier is not None else len(todo)
        keep = {k for k, _ in todo[max(0, first):]}
        placed, near = [], {}
        for i, (key, j) in enumerate(todo):
            loc = tier.new(key, size, keep) if tier is not None and i >= first else None
            if loc is not None:
                placed.append((j, *loc))
                near[key] = loc
        with torch.cuda.stream(self.stream) if self.cuda else _nothing():
            if placed:
                tier.copy(caches, block, placed, out=True)
            for key, j in todo:
                buf = torch.empty(size, dtype=torch.uint8, pin_memory=self.cuda)
                if key in near:
                    buf.copy_(tier.row(near[key]), non_blocking=self.cuda)
                else:
                    for dst, c in zip(_views(buf, caches, block), caches):
                        dst.copy_(c[:, :, j * block:(j + 1) * block], non_blocking=self.cuda)
                self.blocks[key] = buf
        if self.cuda:
            self.pending = torch.cuda.Event()
            self.pending.record(self.stream)
        if self.folder is not None:
            for key in keys:
                if key in self.blocks:
                    with self._lock:
                        self.unwritten[key] = self.blocks[key]
                    self._queue.put(("write", key, self.blocks[key], self.pending))

    def restore(self, keys: list[bytes], blocks: list[int], block: int, slot: int | None = None,
                fetched: dict | None = None) -> None:
        """Copy the snapshots back into the live cache (of `slot`: layer_caches) at their blocks' rows (on the
        compute stream: the chunks that follow are ordered after it). fetched: blocks read from their files ahead
        (read_files)."""
        caches = layer_caches(self.model, slot)
        size = row_bytes(caches) * block
        tier = self.tier
        near = [tier.get(k) if tier is not None else None for k in keys]
        held = [None if n is not None else self._held(k, size, fetched) for k, n in zip(keys, near)]
        missing = [k.hex() for k, n, b in zip(keys, near, held) if n is None and b is None]
        if missing:
            raise KeyError(f"restore: no snapshot of block(s) {', '.join(missing[:3])}")
        self.before_write()  # (also before a block goes into a tier row whose copy to the host may be queued)
        keep = set(keys)
        placed = []
        pairs: dict[bool, tuple[list, list]] = {False: ([], []), True: ([], [])}  # by non_blocking: (dsts, srcs)
        for key, buf, loc, j in zip(keys, held, near, blocks):
            if tier is not None:
                if loc is None:  # into the device tier first: one copy over the bus, then the copies on the device
                    tier.misses += 1
                    loc = tier.new(key, size, keep)
                    if loc is not None:
                        # (a block read from its file is pageable memory: this copy is synchronous, so it may go)
                        tier.row(loc).copy_(buf, non_blocking=self.cuda and buf.is_pinned())
                else:
                    tier.hits += 1
            if loc is not None:
                placed.append((j, *loc))
                continue
            dsts, srcs = pairs[self.cuda and buf.is_pinned()]
            for src, c in zip(_views(buf, caches, block), caches):
                dsts.append(c[:, :, j * block:(j + 1) * block])
                srcs.append(src)
        if placed:
            tier.copy(caches, block, placed, out=False)
        # the host's blocks: every block's layers in one call a kind (one Python copy_ each took ~20 us of the host)
        for non_blocking, (dsts, srcs) in pairs.items():
            if dsts:
                torch._foreach_copy_(dsts, srcs, non_blocking=non_blocking)

    def drop(self, keys: list[bytes]) -> None:
        """Out of the host tier. A block whose write is still queued stays in memory until written; while such
        blocks hold more than orphan_limit bytes, wait for the writer (it ends every wait: a failed write, too,
        leaves `unwritten`)."""
        for k in keys:
            self.blocks.pop(k, None)
            self.states.pop(k, None)
        if self.tier is not None:
            self.tier.drop(keys)
        if self._writer is None:
            return
        with self._lock:
            while self._writer.is_alive() and self.orphan_bytes() > self.orphan_limit:
                self._lock.wait(1.0)

    def orphan_bytes(self) -> int:
        """Bytes of blocks and kept states queued for the disk that the host tier no longer holds (call with the
        lock held)."""
        return sum(b.numel() for k, b in self.unwritten.items() if k not in self.blocks and k not in self.states)

    def before_write(self) -> None:
        """The live cache is about to be written (a chunk, a restore, a load): after the copies out, on the device."""
        if self.pending is not None:
            torch.cuda.current_stream(self.device).wait_event(self.pending)
            self.pending = None


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
