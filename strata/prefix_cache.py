"""The prefix cache: earlier prompts' KV rows kept by block, so a prompt that begins as one of them skips that prefill.

A prompt's ids are cut into blocks of `BLOCK` tokens; block j's key is a chain hash (blake2b of block j - 1's key
and block j's ids), so one key names the whole prefix up to the end of its block. With prefix_reuse rows its last,
partial block is kept too, under a key of its own (`tail_key`); the index keeps its ids, and a later prompt that
shares only its first c ids restores the block and uses its first c rows (a row depends only on the ids up to it). The head decides everything
(`PrefixIndex`, used by strata/pipeline.py): which blocks the stages hold, LRU within `prefix_cache_bytes` per
stage, and a new prompt's longest cached prefix. It tells every stage, by `KvOp` notes between prompts, to
snapshot a prompt's full blocks after its prefill, to restore a prefix into the live cache before the next one,
and to drop what it evicts. With several sequences (max_seqs > 1, strata/slots.py) a snapshot or restore names
a slot, one with nothing in flight, while other slots' micro-batches may be. A stage (`Snapshots`) keeps per block a copy of the block's rows of every layer it
holds, in host memory (pinned on a CUDA stage, whose copies out run asynchronously on a stream of their own and
are waited for on the device before the live cache is written again), and applies no policy of its own.

Rows are opaque: whatever a cache's dtype and last dimension (float, bfloat16, 8-bit codes, packed blocks), a
snapshot copies the rows of each (1, n_kv, rows, last) cache tensor along dim 2, byte for byte.

Only models whose every layer is full attention: a window layer's cache is a ring of window + chunk - 1 rows and a
linear-attention layer a fixed-size state, both valid only at the exact position they were taken. For such
models the prefix cache is off (`supported` says why; the head logs it once) and only the live KV is reused, as
before (Pipeline._reusable's exact-or-nothing rules).
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

BLOCK = 256      # tokens a block: the unit of hashing, snapshots and eviction
KEY_BYTES = 16   # a block key: blake2b-128 of (the previous key, the block's ids as int32)


def supported(args) -> str | None:
    """None when a prefix can be restored at any block boundary; else why not (window or linear layers)."""
    if args.linear_layers is not None and any(args.linear_layers):
        return "linear-attention layers hold a fixed-size state valid only where it was taken"
    if any(args.window(i) for i in range(args.n_layers)):
        return "window layers keep a ring of window + chunk - 1 rows, valid only where it was taken"
    if args.rope_scaling and args.rope_scaling.get("rope_type") == "dynamic":
        return "dynamic NTK rope: a prompt's keys past max_position_embeddings rotate by the prompt's length"
    return None


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

    def discard(self, keys: list[bytes]) -> None:
        for k in keys:
            self.lru.pop(k, None)
            self._forget_tail(k)


def layer_caches(model, slot: int | None = None) -> list[torch.Tensor]:
    """A slice's cache tensors, k then v of each layer, in layer order (read at each use: setup_cache replaces them).
    slot: that sequence's caches (Transformer.setup_cache's seqs), read without `use_slot`, which re-points the
    layers and the C decoder while the stage may be between two parts of another slot's micro-batch; None: the
    caches in use."""
    if slot is not None and not 0 <= slot < len(getattr(model, "_slots", ())):
        raise ValueError(f"slot {slot} outside the {len(getattr(model, '_slots', ()))} sequence caches")
    out = []
    for i, blk in model.layers.items():
        a = blk.attn
        if getattr(blk, "linear", False) or a.k_cache is None:
            raise ValueError("the prefix cache and KV files need a KV cache on every layer (no linear-attention layers)")
        out += [a.k_cache, a.v_cache] if slot is None else list(model._slots[slot][i])
    return out


def row_bytes(caches: list[torch.Tensor]) -> int:
    """Bytes of one position's rows across these caches (n_kv x last dim x element size each)."""
    return sum(c.shape[1] * c.shape[3] * c.element_size() for c in caches)


def _views(buf: torch.Tensor, caches: list[torch.Tensor], rows: int) -> list[torch.Tensor]:
    """buf (uint8) cut into one (1, n_kv, rows, last) tensor per cache, in the cache's dtype."""
    out, off = [], 0
    for c in caches:
        n = c.shape[1] * rows * c.shape[3] * c.element_size()
        out.append(buf[off:off + n].view(c.dtype).view(1, c.shape[1], rows, c.shape[3]))
        off += n
    return out


class Snapshots:
    """A stage's snapshots: per block key, one host buffer with the block's rows of every cache of its slice."""

    def __init__(self, model, device: torch.device):
        self.model = model
        self.cuda = device.type == "cuda"
        self.device = device
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.pending = None      # the last copy out's event (CUDA): the live cache is not written before it
        self.blocks: dict[bytes, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.blocks.values())

    def snap(self, keys: list[bytes], blocks: list[int], block: int, slot: int | None = None) -> None:
        """Copy rows [j * block, (j + 1) * block) of every cache (of `slot`: layer_caches) out under keys[i]
        (j = blocks[i])."""
        caches = layer_caches(self.model, slot)
        size = row_bytes(caches) * block
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # after the prefill's kernels
        for key, j in zip(keys, blocks):
            if key in self.blocks:
                continue
            buf = torch.empty(size, dtype=torch.uint8, pin_memory=self.cuda)
            with torch.cuda.stream(self.stream) if self.cuda else _nothing():
                for dst, c in zip(_views(buf, caches, block), caches):
                    dst.copy_(c[:, :, j * block:(j + 1) * block], non_blocking=self.cuda)
            self.blocks[key] = buf
        if self.cuda:
            self.pending = torch.cuda.Event()
            self.pending.record(self.stream)

    def restore(self, keys: list[bytes], blocks: list[int], block: int, slot: int | None = None) -> None:
        """Copy the snapshots back into the live cache (of `slot`: layer_caches) at their blocks' rows (on the
        compute stream: the chunks that follow are ordered after it)."""
        missing = [k.hex() for k in keys if k not in self.blocks]
        if missing:
            raise KeyError(f"restore: no snapshot of block(s) {', '.join(missing[:3])}")
        self.before_write()
        caches = layer_caches(self.model, slot)
        for key, j in zip(keys, blocks):
            for src, c in zip(_views(self.blocks[key], caches, block), caches):
                c[:, :, j * block:(j + 1) * block].copy_(src, non_blocking=self.cuda)

    def drop(self, keys: list[bytes]) -> None:
        for k in keys:
            self.blocks.pop(k, None)

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
