"""The head's KV policy: which prefix-cache blocks and states every stage keeps, restores and drops, and KV files.

Everything here reaches the stages as rounds of `KvOp` notes (one a stage) that each stage answers with `KvDone`.
`KvRounds` decides and keeps the books (strata/kvcache/prefix_cache.py's indexes: host, disk, the states kept at block
boundaries); it is handed the means to send a note and to wait (`KvLink`), and the head's wire hands it the
answers (`on_done`). It knows nothing of chunks, phases or slots' sequences: the Pipeline and the slot driver
(strata/head/slots.py) ask it what to restore, what a chunk keeps, and to snapshot a prefilled prompt.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Mapping

import numpy as np
import torch

from strata.kvcache import kv_file
from strata.comm import messages as M
from strata.kvcache import prefix_cache
from strata.plan.schedule import cut_at, kept_state_cut

log = logging.getLogger("strata.head.pipeline")  # (the head's lines keep one logger name, as strata/head/wire.py's do)


@dataclass(frozen=True)
class KvLink:
    """What KvRounds is handed to reach the stages (the Pipeline's wire and its receive loop)."""
    send: Callable[[int, M.KvOp], None]           # one note to stage i
    wait: Callable[[Callable[[], bool]], None]     # receive and handle the stages' messages until the condition
                                                   # holds (the stall deadline: a stall raises, naming the stages)
    who: Callable[[int], str]                      # stage i as an error names it (device, pid, chunk)
    failed: Callable[[], bool]                     # the run has failed: no state is kept, no prompt snapshotted


class KvRound:
    """KvOp notes sent to stages, and their answers (KvDone) as they come."""

    def __init__(self, what: str, waiting: set, then=None):
        self.what, self.waiting, self.then = what, waiting, then
        self.done: dict[int, M.KvDone] = {}
        self.failed = False  # a restore round whose `then` found an error

    @property
    def complete(self) -> bool:
        return not self.waiting


class KvRounds:
    """The prefix cache's policy and KV files on the head, and the KV rounds in flight.

    stages: the Pipeline's StageInfo list (layers, device, host, kv_bytes, state_bytes; read once they are ready);
    spans: each slot's extent of the stages' KV pools (kv_pool; Pipeline.place_slot fills it, read here)."""

    def __init__(self, cfg, plan, stages: list, spans: Mapping[int, tuple[int, int]], link: KvLink):
        self.cfg, self.plan, self.stages, self.spans, self.link = cfg, plan, stages, spans, link
        # the prefix cache (strata/kvcache/prefix_cache.py): which blocks of earlier prompts every stage holds a snapshot of
        self._index: prefix_cache.PrefixIndex | None = None
        self._disk: prefix_cache.PrefixIndex | None = None   # the disk tier's blocks (kv_cache_dir), every stage's
        self._tail_files: prefix_cache.TailFiles | None = None
        # the states of linear-attention and window layers kept at block boundaries (their state_key), every stage's;
        # and per slot, the prefill chunk ends (block boundaries) after which the stages keep them: end -> its key
        self._states: prefix_cache.PrefixIndex | None = None
        self._disk_states: prefix_cache.PrefixIndex | None = None  # ... and those whose files every stage holds
        self._keep: dict[int, dict[int, bytes]] = {}
        self.block = prefix_cache.BLOCK
        self._rounds: list[KvRound] = []          # KvOp rounds sent and not yet answered by every stage, oldest first
        self._device_tiers: dict[int, tuple[int, int]] = {}  # stage -> its device tier's (blocks, hits), last said
        self.answers = 0                           # KvDone notes received (the slot driver's watchdog: progress)
        self.restored = 0                          # the last `restore`'s prompt positions restored from snapshots
        self._lookups = self._hits = 0             # prefix-cache lookups, and those that found a usable prefix
        self.prefix_cache_off: str | None = None   # why the prefix cache is off (None: on)

    # -- rounds: KvOp notes out, KvDone answers in -------------------------------------------------
    def on_done(self, msg: M.KvDone, data) -> None:
        """The head's handler of KvDone. A stage answers its KvOps in the order they came (one socket from the
        head): the oldest round that waits on it is the one answered."""
        r = next((r for r in self._rounds if msg.stage in r.waiting), None)
        if r is None:
            raise M.BadMessage(f"kv_done: stage {msg.stage} has no KV operation in flight")
        self.answers += 1
        self._device_tiers[msg.stage] = (msg.device_blocks, msg.device_hits)
        r.waiting.discard(msg.stage)
        r.done[msg.stage] = msg
        if not r.waiting:
            self._rounds.remove(r)
            if r.then is not None:
                r.then(r)

    @property
    def in_flight(self) -> int:
        """KV rounds in flight (the slot driver's watchdog)."""
        return len(self._rounds)

    def errors(self, done: dict[int, M.KvDone]) -> list[str]:
        """A round's errors, one "stage i: error" each."""
        return [f"{self.link.who(i)}: {d.error}" for i, d in done.items() if d.error]

    def _send(self, what: str, msgs: dict[int, M.KvOp], then=None) -> KvRound:
        """Send each stage its KvOp; the round completes when every one has answered (the head's receive takes the
        answers, whatever thread waits; `then(round)` runs then)."""
        r = KvRound(what, set(msgs), then=then)
        self._rounds.append(r)
        for i, msg in msgs.items():
            self.link.send(i, msg)
        return r

    def _wait(self, rounds: list[KvRound]) -> None:
        """Until these rounds are complete. With several sequences other slots' micro-batches may be in flight: the
        head's receive keeps their results for take_results."""
        self.link.wait(lambda: all(not r.waiting for r in rounds))

    def _round(self, what: str, msgs: dict[int, M.KvOp]) -> dict[int, M.KvDone]:
        """Send each stage its KvOp and wait for every answer (a stage does one at once, in order)."""
        r = self._send(what, msgs)
        self._wait([r])
        return r.done

    def _msgs(self, op: str, keys=(), blocks=(), path: str = "", offsets=None, tokens: int = 0,
              slot: int = 0) -> dict[int, M.KvOp]:
        span = list(self.spans.get(slot, ())) if op in ("snap", "restore", "load") else []
        return {i: M.KvOp(op=op, keys=list(keys), blocks=list(blocks), block=self.block, path=path,
                          offset=offsets[i] if offsets else 0, tokens=tokens, slot=slot, span=span)
                for i in range(len(self.stages))}

    def _round_all(self, op: str, keys=(), blocks=(), path: str = "", offsets=None, tokens: int = 0, slot: int = 0):
        return self._round(op, self._msgs(op, keys, blocks, path, offsets, tokens, slot))

    # -- the prefix cache: sizing and the disk tier ------------------------------------------------
    def start(self) -> None:
        """Once every stage is ready: how many blocks each stage's `prefix_cache_bytes` holds (the head's index
        decides for all of them, so the smallest budget in blocks is the index's capacity)."""
        budget = self.cfg.prefix_cache_bytes
        why = prefix_cache.supported(self.plan.args)
        if not budget:
            why = "prefix_cache_bytes is 0"
        elif self.cfg.dump_residual:
            why = "dump_residual prefills every prompt from position 0"
        args = self.plan.args
        stateful = prefix_cache.stateful(args)
        from strata.kernels.attention import kv_dtype_of
        kv = kv_dtype_of(self.cfg.kv_dtype, getattr(torch, self.cfg.dtype))
        # a block: one position's rows in the global attention layers (not the stage's kv_bytes over max_len, which
        # counts every slot's cache: max_seqs 4 held a quarter of the blocks the budget pays for)
        per_block = max(prefix_cache.row_bytes_of(args, [i for i in range(*st.layers) if not args.is_linear(i)
                                                         and not args.window(i)], kv) for st in self.stages) * self.block
        per_state = 0
        if stateful:  # the states kept at boundaries too: the linear layers', and the window layers' last window - 1
            # positions
            per_state = max(st.state_bytes // self.cfg.max_seqs + prefix_cache.kept_bytes(args, *st.layers, kv)
                            for st in self.stages)
            per_block, per_state = max(per_block, 1), max(per_state, 1)  # (a stage of window layers alone: no rows)
        if stateful and why is None:  # half the budget for the blocks, half for the states kept beside them
            if budget // 2 < per_state or budget // 2 < per_block:
                why = (f"prefix_cache_bytes {budget}: half of it holds no block of {self.block} tokens ({per_block} "
                       f"bytes a stage) or no state kept at a boundary ({per_state} bytes a stage: linear-attention "
                       "layers' states, window layers' last rows)")
            else:
                self._states = prefix_cache.PrefixIndex(budget // 2 // per_state)
                budget //= 2
        if why is None and budget < per_block:
            why = f"prefix_cache_bytes {budget} holds no block of {self.block} tokens ({per_block} bytes a stage)"
        self.prefix_cache_off = why
        if self.cfg.max_seqs > 1:  # one line for what several slots turn off (README, Serving)
            log.info("max_seqs %d: %d sequences' KV on every stage; off with it: reuse of the live KV between "
                     "requests (the prefix cache's blocks still are), kv_save / kv_load, decode bells",
                     self.cfg.max_seqs, self.cfg.max_seqs)
        if why is None:
            self._index = prefix_cache.PrefixIndex(budget // per_block)
            log.info("prefix cache: %d blocks of %d tokens (%.1f MB a stage)%s", self._index.capacity, self.block,
                     self._index.capacity * per_block / 1e6,
                     f", and the states at {self._states.capacity} block boundaries (linear layers', window rows) "
                     f"({self._states.capacity * per_state / 1e6:.1f} MB a stage)" if self._states else "")
            if self.cfg.kv_cache_dir is not None:
                self._open_disk_tier(per_block, per_state)
        elif budget:
            log.info("prefix cache off: %s; only the last prompt's KV is reused", why)

    def _open_disk_tier(self, per_block: int, per_state: int = 0) -> None:
        """kv_cache_dir: every stage opens its folder and lists the blocks it holds; those every stage holds are
        the disk index (oldest first), the rest are removed, and the index is cut to kv_cache_dir_bytes (with linear
        or window layers: half of it, the other half for the kept states' files, listed and kept alike)."""
        root = os.path.abspath(os.path.expanduser(self.cfg.kv_cache_dir))
        rig = prefix_cache.rig_folder(kv_file.rig_fingerprint(self.cfg, self.plan))
        msgs = {i: replace(m, path=prefix_cache.stage_folder(root, rig, *st.layers, torch.device(st.device).type))
                for (i, m), st in zip(self._msgs("open").items(), self.stages)}
        done = self._round("open", msgs)
        failed = self.errors(done)
        if failed:
            log.warning("prefix cache on disk off: %s", "; ".join(failed))
            return
        common = set.intersection(*(set(d.keys) for d in done.values()))
        states = set.intersection(*(set(d.states) for d in done.values()))
        for i, d in done.items():  # a block not every stage has (a write cut short, another split's run)
            stray = [k for k in d.keys if k not in common] + [k for k in d.states if k not in states]
            if stray:  # (the stage's writer removes them in order; nothing waits for it)
                self._send("unlink", {i: self._msgs("unlink", stray)[i]})
        self._tail_files = prefix_cache.TailFiles(Path(root) / rig / "tails")
        tails = self._tail_files.read()
        self._tail_files.remove([k for k in tails if k not in common])
        tails = {k: t for k, t in tails.items() if k in common}
        budget = self.cfg.kv_cache_dir_bytes
        if self._states is not None:  # linear or window layers: half for the states kept at boundaries
            budget //= 2
            self._disk_states = prefix_cache.PrefixIndex(max(1, budget // per_state))
            self._unlink(self._disk_states.load([k for k in done[0].states if k in states], {}))
        self._disk = prefix_cache.PrefixIndex(budget // per_block)
        evicted = self._disk.load([k for k in done[0].keys if k in common], tails)
        self._unlink(evicted)
        log.info("prefix cache on disk: %s, %d of %d blocks held (%.1f GB a stage)", Path(root) / rig,
                 len(self._disk), self._disk.capacity, self._disk.capacity * per_block / 1e9)

    def _unlink(self, keys: list[bytes]) -> KvRound | None:
        """Out of the disk tier: every stage's files (its writer removes them in order with the writes queued
        before; the round is sent, not waited for) and the head's tail files of these blocks."""
        if not keys:
            return None
        self._tail_files.remove(keys)
        return self._send("unlink", self._msgs("unlink", keys))

    def _tiers(self) -> list[prefix_cache.PrefixIndex]:
        return [self._index] + ([self._disk] if self._disk is not None else [])

    def stats(self) -> prefix_cache.PrefixCacheStats:
        """Read-only figures of the head's index (safe from another thread: plain reads, no stage touched)."""
        index = self._index
        if index is None:
            return prefix_cache.PrefixCacheStats(self._lookups, self._hits)
        disk = self._disk
        tiers = [self._device_tiers.get(i, (0, 0)) for i, n in enumerate(self.plan.planner.get("needs", ()))
                 if n.get("prefix_cache")]  # the CUDA stages with a device tier
        return prefix_cache.PrefixCacheStats(self._lookups, self._hits, len(index), index.capacity, self.block,
                                             len(disk) if disk else 0, disk.capacity if disk else 0,
                                             min((b for b, _ in tiers), default=0), min((h for _, h in tiers), default=0))

    # -- what a prompt reuses ------------------------------------------------------------------------
    def reusable(self, ids: np.ndarray, kept: np.ndarray) -> int:
        """Leading positions whose KV the stages already hold for these ids, where the live KV holds `kept` (the
        ids of its positions [0, kept.size)); the last prompt token is always recomputed (its logits give the first
        generated token). None with dump_residual (every row dumped)."""
        if self.cfg.dump_residual:
            return 0
        kept_n = kept.size
        m = min(kept_n, ids.size)
        diff = np.flatnonzero(kept[:m] != ids[:m])
        common = int(diff[0]) if diff.size else m
        a = self.plan.args
        rings = [a.kv_positions(i, self.plan.max_len, self.plan.max_chunk) for i in range(a.n_layers) if a.window(i)]
        start = min(common, ids.size - 1)
        if a.linear_layers is not None and any(a.linear_layers) and start != kept_n:
            return 0  # a linear-attention state serves only the position it stands at: the end of what is kept
        if rings and kept_n > min(rings) and start + 1 - a.sliding_window < kept_n - min(rings):
            return 0  # a window layer's ring no longer holds the keys a restart at `start` would read
        sc = a.rope_scaling
        if sc and sc.get("rope_type") == "dynamic" and max(kept_n, ids.size) > sc["max_position_embeddings"]:
            return 0  # dynamic NTK: keys past max_position_embeddings rotate by their prompt's length, not this one's
        return start

    def restore(self, ids: np.ndarray, live: int, cap: int, slot: int = 0) -> int:
        """The positions to reuse: `live` (what the live KV holds), or a longer prefix of snapshots, restored into
        `slot`'s cache now (every stage has answered when this returns; `restored` says how many came from
        snapshots). prefix_reuse rows: every held row of ids[:cap] (whole blocks, then the first rows of an earlier
        prompt's last block that this one shares); chunks: up to a chunk boundary of the prompt's cold schedule, so
        the rest is computed in the cold prefill's own chunks (the same bits as a cold prefill, when the snapshots
        were)."""
        self.restored = 0
        p, r = self.restore_begin(ids, live, cap, slot)
        if r is None:
            return p
        self._wait([r])
        if r.failed:
            return live
        self.restored = p - live
        return p

    def restore_begin(self, ids: np.ndarray, live: int, cap: int, slot: int = 0) -> tuple[int, KvRound | None]:
        """`restore`'s lookup, and its restore round sent, not waited for -> (the positions the slot will hold, the
        round: None when nothing is restored). The slot's first chunk waits until the round is complete. A round
        that fails (`failed`: a block file gone from kv_cache_dir, say) leaves the positions at `live`: the blocks
        are forgotten everywhere and those positions prefilled (the rows a restore of the same ids' blocks may have
        rewritten keep their meaning)."""
        if self._index is None:
            return live, None
        B = self.block
        keys = prefix_cache.block_keys(ids[:cap], B)
        tiers = self._tiers()
        m = prefix_cache.held_prefix(tiers, keys)
        for ix in tiers:
            ix.touch(keys[:m])
        tail, c, state = None, 0, b""
        if self._states is not None:  # linear or window layers: the last boundary whose states are held too
            p, state = self._state_point(ids, keys, m)
        elif self.cfg.prefix_reuse == "chunks":
            p = max((q for q, _ in self.plan.schedule_for(0, ids.size) if q <= m * B), default=0)
        else:
            tail, c = prefix_cache.best_tail(tiers, keys[m - 1] if m else b"", ids[m * B:cap])
            if tail is not None:
                for ix in tiers:
                    ix.touch([tail])
            p = m * B + c
        # a hit whether the live KV already holds those rows or they are restored: the cache would serve them
        self._lookups += 1
        self._hits += p > 0
        if p <= live:
            return live, None
        blocks = list(range(live // B, -(-p // B)))
        names = [keys[j] if j < m else tail for j in blocks]  # block m: the tail's (rows past c: never read)

        def then(r: KvRound) -> None:
            failed = self.errors(r.done)
            if failed:
                r.failed = True
                log.warning("prefix cache: restore failed (%s); prefilling those positions", "; ".join(failed))
                self._hits -= 1
                self._forget(names + ([state] if state else []))
        msgs = self._msgs("restore", names, blocks, slot=slot, tokens=p if state else 0)
        if state:
            msgs = {i: replace(mg, state=state) for i, mg in msgs.items()}
        return p, self._send("restore", msgs, then)

    def _state_point(self, ids: np.ndarray, keys: list[bytes], m: int) -> tuple[int, bytes]:
        """Linear or window layers: the last of the m held blocks' boundaries whose states are held too (prefix_reuse
        chunks: a chunk boundary of the cold schedule) -> (its position, the states' key; (0, b"") for none)."""
        B = self.block
        cold = {q for q, _ in self.plan.schedule_for(0, ids.size)} if self.cfg.prefix_reuse == "chunks" else None
        held = [self._states] + ([self._disk_states] if self._disk_states is not None else [])
        j = next((j for j in range(m, 0, -1) if any(prefix_cache.state_key(keys[j - 1]) in ix.lru for ix in held)
                  and (cold is None or j * B in cold)), 0)
        state = b""
        if j:
            state = prefix_cache.state_key(keys[j - 1])
            for ix in held:
                ix.touch([state])
        return j * B, state

    # -- what a prefill keeps --------------------------------------------------------------------------
    def keep_states(self, slot: int, ids: np.ndarray, start: int, schedule) -> list[tuple[int, int]]:
        """A prefill of ids from `start` in `schedule`'s chunks, of a model with linear-attention or window layers:
        the stages keep those layers' states (a window layer's: its last window - 1 rows) after the last chunks
        (as many as the index holds) that end on a block boundary, and at the prompt's last block boundary before its
        last token, its chunk cut there (prefix_reuse chunks: only boundaries of the cold schedule, uncut), so a
        later prompt sharing those blocks restores them: the chunk's note names the states' key. -> the schedule;
        the keys join the index at the prompt's snapshot."""
        self._keep.pop(slot, None)
        if self._states is None or self.link.failed():
            return list(schedule)
        B, n = self.block, ids.size
        last = kept_state_cut(n, B)
        if self.cfg.prefix_reuse == "chunks":  # (a restore point must be a chunk boundary of the cold schedule)
            cold = {p + m for p, m in self.plan.schedule_for(0, n)}
            last = next((q for q in range(last, start, -B) if q in cold), 0)
        if last > start:
            schedule = cut_at(schedule, last)
        # the last ones the index holds: a stage copies no more than that out (a Gemma-3-27B state is ~0.4 GB)
        ends = sorted(p + m for p, m in schedule if (p + m) % B == 0 and start < p + m <= last)[-self._states.capacity:]
        if not ends:
            return list(schedule)
        keys = prefix_cache.block_keys(ids[:ends[-1]], B)
        self._keep[slot] = {e: prefix_cache.state_key(keys[e // B - 1]) for e in ends}
        return list(schedule)

    def keep_after(self, slot: int, end: int, phase: str) -> bytes:
        """The state key a prefill chunk of `slot` ending at `end` carries (b"": none)."""
        return self._keep.get(slot, {}).get(end, b"") if phase == "prefill" else b""

    def _forget(self, names: list[bytes]) -> None:
        """Blocks out of every tier (their rounds are sent, not waited for)."""
        for ix in self._tiers() + [x for x in (self._states, self._disk_states) if x is not None]:
            ix.discard(names)
        self._send("drop", self._msgs("drop", names))
        if self._disk is not None:
            self._unlink(names)

    def snapshot(self, ids: np.ndarray, slot: int = 0, wait: bool = True) -> KvRound | None:
        """After a prefill of ids (in `slot`): its full blocks into the prefix cache (the ones not held yet), LRU
        evicting (their rows are final: a sequence's decode steps write later positions). wait False: the rounds
        are sent, not waited for -> the last one (None: none sent); the slot's rows [0, ids.size) must not be
        written again (nor the slot given to another sequence) before it completes (another socket's chunk could
        reach a stage before the snapshot's note)."""
        if self._index is None or self.link.failed():
            return None
        B = self.block
        keys = prefix_cache.block_keys(ids, B)
        new, evicted = self._index.add(keys)
        gone = self._keep_kept(slot, evicted)  # out of the disk tier
        disk = self._disk
        if disk is not None:  # the blocks new there are snapped too (a stage writes a held block's file once)
            dnew, out = disk.add(keys)
            gone += out
            new = sorted(set(new) | set(dnew))
        names = [keys[j] for j in new]
        m = len(keys)
        if (self.cfg.prefix_reuse == "rows" and m < self._index.capacity and ids.size > m * B
                and (m + 1) * B <= self.plan.max_len and self._states is None):  # its last, partial block too (rows:
            # reused row by row; not with linear or window layers: their states stand only where they were kept)
            tail = self._add_tail(keys[m - 1] if m else b"", ids[m * B:], evicted, gone)
            if tail is not None:
                new, names = new + [m], names + [tail]
        sent = []
        if evicted:
            sent.append(self._send("drop", self._msgs("drop", evicted)))
        if gone:
            sent.append(self._unlink(gone))
        if new:
            sent.append(self._send("snap", self._msgs("snap", names, new, slot=slot),
                                   lambda r: self._snapped(r, names)))
        if wait:
            self._wait(sent)
        return sent[-1] if sent else None

    def _keep_kept(self, slot: int, evicted: list[bytes]) -> list[bytes]:
        """The states the slot's prefill kept into the state indexes (every stage has them by now, and writes their
        files with a disk tier), the latest the most recent; what leaves the host index joins `evicted` -> what
        leaves the disk one."""
        kept = self._keep.pop(slot, None)
        gone: list[bytes] = []
        if kept:
            order = [kept[e] for e in sorted(kept)]
            for ix, out in ((self._states, evicted), (self._disk_states, gone)):
                if ix is not None:  # the rest: the stages hold them (host copies, files) but no index names them
                    _, dropped = ix.add(order[-ix.capacity:])
                    out += dropped + [k for k in order[:-ix.capacity] if k not in ix.lru]
        return gone

    def _add_tail(self, prev: bytes, tail_ids: np.ndarray, evicted: list[bytes], gone: list[bytes]) -> bytes | None:
        """A prompt's last, partial block into the host index (and the disk's, with its tail file); what they evict
        joins `evicted` and `gone` -> its key if it is to be snapshotted now, else None."""
        tail, more = self._index.add_tail(prev, tail_ids)
        evicted += more
        disk = self._disk
        if disk is not None:
            dtail, dmore = disk.add_tail(prev, tail_ids)
            gone += dmore
            if dtail is not None:
                self._tail_files.write(dtail, prev, tail_ids)
            tail = tail or dtail
        return tail

    def _snapped(self, r: KvRound, names: list[bytes]) -> None:
        """A snapshot round's answers: a block a stage could not copy is not cached, anywhere; one snapped for the
        disk alone leaves the host (its writer keeps the rows until the file is written)."""
        failed = self.errors(r.done)
        if failed:  # e.g. no host memory left
            log.warning("prefix cache: snapshot failed (%s); dropping its blocks", "; ".join(failed))
            self._forget(names)
            return
        host_not = [k for k in names if k not in self._index.lru]
        if host_not:
            self._send("drop", self._msgs("drop", host_not))

    # -- KV files ------------------------------------------------------------------------------------
    def _file_refusals(self, what: str, slot: bool = False) -> None:
        """What kv_save and kv_load refuse before anything runs. slot: a load into a free slot and from there into the
        prefix cache (max_seqs > 1: SlotDriver.load)."""
        n = self.cfg.max_seqs
        if n > 1 and what == "kv_save":
            raise kv_file.KvFileError(f"kv_save: not with max_seqs {n} (a KV file holds one sequence; the slots' "
                                      "sequences have no current one): use max_seqs 1")
        if n > 1 and not slot:
            raise kv_file.KvFileError(f"kv_load: with max_seqs {n} the slot driver loads a KV file "
                                      "(PipelineEngine.kv_load, SlotDriver.load), among the slots' sequences")
        if n > 1 and self.prefix_cache_off:
            raise kv_file.KvFileError(f"kv_load: with max_seqs {n} a KV file's rows go into the prefix cache, and it "
                                      f"is off ({self.prefix_cache_off})")
        why = prefix_cache.supported(self.plan.args, files=True)
        if why:
            raise kv_file.KvFileError(f"{what}: not for this model: {why}")
        remote = [st.index for st in self.stages if st.host is not None]
        if remote:
            raise kv_file.KvFileError(f"{what}: stage {remote[0]} runs on another host (KV files are read and written "
                                      "by the stages, on this machine)")

    def _file_checks(self, what: str, slot: bool = False) -> int:
        """Refusals common to kv_save and kv_load; -> bytes of one layer's position (k and v)."""
        self._file_refusals(what, slot)
        if self.plan.kv_pool:  # (kv_bytes counts the pool, not max_seqs x max_len positions)
            from strata.kernels.attention import kv_dtype_of
            kv = kv_dtype_of(self.cfg.kv_dtype, getattr(torch, self.cfg.dtype))
            per_layer = {prefix_cache.row_bytes_of(self.plan.args, [0], kv)}
        else:
            per_layer = {st.kv_bytes // self.cfg.max_seqs // self.plan.max_len // (st.layers[1] - st.layers[0])
                         for st in self.stages}  # (kv_bytes: every slot's cache)
        if len(per_layer) != 1:
            raise kv_file.KvFileError(f"{what}: the layers' caches differ in width ({sorted(per_layer)} bytes a row)")
        return per_layer.pop()

    def _offsets(self, data_at: int, tokens: int, layer_row_bytes: int) -> dict[int, int]:
        return {st.index: data_at + tokens * layer_row_bytes * st.layers[0] for st in self.stages}

    def _check_file(self, path, h: dict, ids: np.ndarray, layer_row_bytes: int) -> None:
        kv_file.check(path, h, kv_file.rig_fingerprint(self.cfg, self.plan), layer_row_bytes, self.plan.max_len,
                      self.plan.args.vocab_size, ids)

    def save(self, path: str | os.PathLike, kept: np.ndarray | None) -> dict:
        """Pipeline.kv_save: the live KV, whose ids are `kept` (None: no stage runs), with those ids to `path`."""
        self._file_refusals("kv_save")  # before "nothing to save": with several slots nothing is the kept one
        if kept is None or kept.size == 0:
            raise kv_file.KvFileError("kv_save: nothing to save: no prompt has been prefilled on this pipeline")
        n = kept.size
        lrb = self._file_checks("kv_save")
        path = Path(path)
        t0 = time.perf_counter()
        split = [list(st.layers) for st in self.stages]
        with kv_file.replacing(path) as tmp:
            data_at = kv_file.create(tmp, kv_file.rig_fingerprint(self.cfg, self.plan), kept, lrb, split)
            done = self._round_all("save", path=str(tmp.resolve()), offsets=self._offsets(data_at, n, lrb), tokens=n)
            bad = [f"stage {i}: {d.error}" for i, d in done.items() if d.error]
            if bad:
                raise kv_file.KvFileError(f"kv_save: cannot write {path}: {bad[0]}")
        return {"path": str(path), "tokens": n, "bytes": path.stat().st_size, "seconds": time.perf_counter() - t0}

    def load_header(self, path: str | os.PathLike) -> tuple[dict, np.ndarray, int]:
        """Pipeline.kv_load before any stage starts: the refusals, and the file's header checked against this rig with
        its own rows' width -> (its header, its ids, its rows' offset)."""
        self._file_refusals("kv_load")
        h, ids, data_at = kv_file.read_header(path)
        self._check_file(path, h, ids, h["layer_row_bytes"])
        return h, ids, data_at

    def load_width(self, path: str | os.PathLike, h: dict, ids: np.ndarray) -> int:
        """Pipeline.kv_load once the stages run: the file's rows' width checked against their caches -> bytes of one
        layer's position."""
        lrb = self._file_checks("kv_load")
        self._check_file(path, h, ids, lrb)
        return lrb

    def load_rows(self, path: str | os.PathLike, ids: np.ndarray, data_at: int, lrb: int) -> None:
        """Pipeline.kv_load's round: every stage reads its layers' rows of the file into its live cache."""
        n = ids.size
        done = self._round_all("load", path=str(Path(path).resolve()), offsets=self._offsets(data_at, n, lrb),
                               tokens=n)
        bad = [f"stage {i}: {d.error}" for i, d in done.items() if d.error]
        if bad:
            raise kv_file.KvFileError(f"kv_load: cannot read {path}: {bad[0]}")

    def load_check(self, path: str | os.PathLike) -> tuple[np.ndarray, int, int]:
        """kv_load's checks of a file for a load into a slot (max_seqs > 1; any thread: reads the file's header and
        the plan) -> (its ids, its rows' offset, bytes of one layer's position)."""
        self._file_refusals("kv_load", slot=True)
        h, ids, data_at = kv_file.read_header(path)
        lrb = self._file_checks("kv_load", slot=True)
        self._check_file(path, h, ids, lrb)
        return ids, data_at, lrb

    def load_begin(self, slot: int, path: str | os.PathLike, ids: np.ndarray, data_at: int, lrb: int) -> KvRound:
        """A checked KV file's rows into `slot` on every stage, the round sent, not waited for (the driver's thread;
        the slot holds no sequence). Its answers name any stage's read error (`errors`)."""
        return self._send("load", self._msgs("load", path=str(Path(path).resolve()),
                                             offsets=self._offsets(data_at, ids.size, lrb), tokens=ids.size,
                                             slot=slot))
