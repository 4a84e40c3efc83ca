"""The head's request loop: every sequence, at every max_seqs, goes through `SlotDriver`.

The server's engine runs it on its own thread (`generate`, `score`, `load`, `save` from any thread); Pipeline's
generate / prefill / score run it on the caller's thread for one call (`threaded=False`). Each admitted sequence
holds one KV slot on every stage.

A lone sequence (one slot, max_seqs 1; or the caller's thread: one call, one sequence, whatever max_seqs) keeps what
it had before there was one loop: its prompt reuses the KV its slot holds live from the last sequence
(`Pipeline.live_prefix`; kv_load and kv_save read and write that live KV, as jobs of the loop: `call`), its prefill
and its decode are each a phase of the stages' timing (the report), and its decode steps go round the ring (head ->
stage 0 -> ... -> head), by doorbell after the first (strata/comm/bells.py; with max_seqs 1), the loop spinning on the
head's bell (`Pipeline.wait_step`). Its tokens go to the caller as each is decided, before the next step is sent (a
caller that says stop wastes no step), and its prompt's blocks go to the prefix cache after its answer.

Several slots: the loop keeps up to n_stages + 1 micro-batches in flight: a sequence's prefill chunk, or a decode
batch, the next step of several sequences at once (each sequence has at most one step in flight: a step needs the token before it).
The decoding sequences are spread over n_stages batches of about equal size, so that while stage 1 computes one
batch stage 0 computes the next, and each stage reads its weights once for a whole batch. Prefill chunks go
round-robin between the batches, one sequence's chunk a turn, so a long prompt's chunks take turns with the
others' steps instead of holding them up for its whole prefill. A stage takes its micro-batches in arrival
order; each says "taken" when it has left a hand-off buffer, as a prefill chunk always has (at most one chunk
in flight below a stage, seed-761).

Exactness: a sequence is prefilled in the chunks of its cold schedule and decoded one token a step, in its own
slot. A CPU stage decoding in C gives each row of a batch the bits of its step alone (Transformer.decode_seqs), and
CPU stages prefill each chunk alone by default, so there a sequence's tokens do not depend on what else runs. Through
torch's products (every GPU stage, decode_batch rows) a batch's rows, and a prefill group's (prefill_groups, on GPU
stages by default: several sequences' last chunks as one micro-batch), are within rounding of each alone, so a near
tie may pick another token; decode_batch steps keeps each sequence's bits its own.

The prefix cache (strata/kvcache/prefix_cache.py): on admission a sequence's prompt is looked up in the head's index and
the longest cached prefix is restored into its slot on every stage; its first chunk goes once every stage has
answered the restore (a chunk reaches stage i over another socket than the head's note). After its last prefill
chunk its prompt's full blocks are snapshotted from its slot, and the slot goes to no other sequence before every
stage has answered that. A KV file (`load`) goes the same way: its rows into a free slot, then its blocks into the
prefix cache, where later prompts find them. The driver sends these KV rounds and does not wait for them: other sequences' chunks and
steps go on meanwhile (a long document's restore from disk holds up nobody's tokens but its own). A scored sequence (`score`) is a prefill whose chunks the last stage scores, as Pipeline.score's.

Callers (the server's worker threads) block in `generate`; `on_token` runs on the driver's thread. A failure of the
pipeline fails every admitted and waiting sequence with the same PipelineError; the driver then stops. On the
caller's thread (`threaded=False`) a failure or a signal (Interrupted) propagates to the caller, after the chunks in
flight are joined (Pipeline.guard: the head never returns with chunks in flight).
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from strata.comm import messages as M
from strata.errors import PipelineError
from strata.head.wire import HEAD_SPIN_S
from strata.plan.planner import POOL_GRAIN

log = logging.getLogger("strata.head.slots")

IDLE_WAIT_S = 0.1      # an idle driver wakes this often to look for a stop (a submission wakes it at once)
POLL_MS = 5            # with sequences running, the driver looks for new ones at least this often


def scored_chunks(schedule, top: int) -> list[tuple[int, int]]:
    """A scored prefill's chunks: `schedule`'s, cut so that each one's scores (a float32 log-probability and `top`
    int32 ids and float32 log-probabilities a row) fit its result note."""
    rows = max(1, M.SCORED_BYTES // (4 * (1 + 2 * top)))
    return [(p + a, min(rows, m - a)) for p, m in schedule for a in range(0, m, rows)]


def unpack_scores(raws: list[bytes], top: int, n: int, reused: int,
                  start: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The scored chunks' ChunkResult.scores, in order, of an n-token prompt prefilled from `reused` -> the rows
    of positions [start, n): (log-probabilities (m,), top ids (m, top), their log-probabilities (m, top))."""
    lp, ti, tl = [], [], []
    for raw in raws:
        rows = len(raw) // (4 * (1 + 2 * top))
        lp.append(np.frombuffer(raw, np.float32, rows))
        if top:
            ti.append(np.frombuffer(raw, np.int32, rows * top, 4 * rows).reshape(rows, top))
            tl.append(np.frombuffer(raw, np.float32, rows * top, 4 * rows * (1 + top)).reshape(rows, top))
    lp = np.concatenate(lp)  # a prefill has a chunk at least: its prompt's last position is always computed
    ti = np.concatenate(ti) if top else np.zeros((lp.size, 0), np.int32)
    tl = np.concatenate(tl) if top else np.zeros((lp.size, 0), np.float32)
    first = reused + 1  # the position the first scored row predicts
    if lp.size != n - first:
        raise RuntimeError(f"scoring gave {lp.size} rows for positions {first}..{n - 1}")
    cut = start - first
    return lp[cut:], ti[cut:], tl[cut:]


class Extents:
    """The head's allocator of every stage's KV pool (the rig's kv_pool): first fit over the free gaps, a freed
    extent merged with its neighbours. The stages' pools are the same size, and each sequence holds the same extent
    on every stage, so the head alone keeps the books."""

    def __init__(self, size: int):
        self.size = size
        self.gaps: list[list[int]] = [[0, size]] if size else []  # [offset, positions], by offset

    @property
    def free(self) -> int:
        return sum(n for _, n in self.gaps)

    def take(self, n: int) -> int | None:
        """The offset of n free positions, now taken, or None (no gap holds n: the caller waits)."""
        for g in self.gaps:
            if g[1] >= n:
                off = g[0]
                g[0], g[1] = g[0] + n, g[1] - n
                if not g[1]:
                    self.gaps.remove(g)
                return off
        return None

    def give(self, off: int, n: int) -> None:
        """Positions [off, off + n) free again."""
        if not n:
            return
        at = next((i for i, g in enumerate(self.gaps) if g[0] > off), len(self.gaps))
        if (at and self.gaps[at - 1][0] + self.gaps[at - 1][1] > off) or (at < len(self.gaps)
                                                                           and off + n > self.gaps[at][0]):
            raise ValueError(f"extent [{off}, {off + n}) is partly free already")
        self.gaps.insert(at, [off, n])
        if at + 1 < len(self.gaps) and off + n == self.gaps[at + 1][0]:
            self.gaps[at][1] += self.gaps.pop(at + 1)[1]
        if at and self.gaps[at - 1][0] + self.gaps[at - 1][1] == off:
            self.gaps[at - 1][1] += self.gaps.pop(at)[1]


@dataclass(eq=False)  # compared by identity: list.remove must not compare two prompts' arrays
class SlotRun:
    """One sequence on its way through the driver: what the caller gave, and where it stands."""
    ids: np.ndarray
    params: object                      # strata.text.sampling.SamplingParams
    on_token: Callable[[int], bool | None]
    score: int = -1                     # >= 0: a scored prefill (Chunk.score: the likeliest tokens a row)
    start: int = 1                      # a scored prefill: the first position whose log-probability is wanted
    scores: dict = field(default_factory=dict)  # a scored prefill: each chunk's ChunkResult.scores, by chunk
    live: int = 0                       # prompt positions whose KV the slot held live (one slot: the last
                                        # sequence's), not prefilled
    reused: int = 0                     # prompt positions not prefilled: live ones, then restored ones
    restored: int = 0                   # ... of them restored from the prefix cache
    kv: object = None                   # its restore round still in flight (strata.head.kv_rounds.KvRound), else None
    snap: object = None                 # its snapshot's last round, until complete: its slot is not reused before
    slot: int = -1
    schedule: list = field(default_factory=list)  # prefill chunks [(pos, n)]
    sent_chunks: int = 0
    in_flight: int = 0                  # its chunks or step in the pipeline now
    last_k: int = -1                    # its last prefill chunk's index (its result holds the first token's logits)
    pending: int | None = None          # a token whose decode step is still to be sent
    closing: bool = False               # its last token is decided (the limit, an end token): no step follows
    step_mark: int = -1                 # decoding: the driver's prefill micro-batches sent when its last step went
                                        # (or its first token came): the count since then is what it waited
    ready_at: int = 0                   # when `pending` was set (the driver's result count): oldest steps go first
    out: list = field(default_factory=list)
    finish: str = "length"
    limit: int = 0
    sampler: object = None
    t_submit: float = 0.0
    t_first: float | None = None        # the first token (prefill done)
    t_end: float = 0.0
    error: BaseException | None = None
    end_token: int | None = None        # the end token that ended it (one of SlotDriver.ends), else None
    extent: tuple | None = None         # kv_pool: its (offset, positions) of every stage's pool while it holds a slot
    pool_waited: bool = False           # kv_pool: its admission waited for room (counted once)
    load: tuple | None = None           # a KV file's rows into the slot, then into the prefix cache: (path, its
                                        # rows' offset, bytes a layer's position), Pipeline.load_slot_check's
    done: threading.Event = field(default_factory=threading.Event)
    prefill_s: float = 0.0              # one slot: its prefill phase; several: submission to first token
    decode_s: float = 0.0
    # one slot only (the report that Pipeline.generate returns, and the engine's last_report)
    nll: float = 0.0                    # the prefill chunks' summed NLL and its targets (the rig's perplexity)
    count: int = 0
    through: int = 0                    # prompt positions through the last stage (the progress bar)
    taken: int = 0                      # prefill chunks whose result came back
    logits: object = None               # the prompt's last row (numpy), a lone sequence's
    steps: int = 0                      # its decode steps
    step: tuple | None = None           # (pos, token) of its step on the ring now
    t_decode: float = 0.0               # its decode phase's start
    progress: bool = False              # a progress bar for its prefill (Pipeline.progress_bar)
    bar: tuple | None = None            # ... (update, close) while it prefills
    text: Callable | None = None        # out -> the answer's text for its report (default: Pipeline.text_of)
    result: object = None               # its strata.head.pipeline.Result, when it ends


@dataclass
class SlotStats:
    """What the driver did since it started (tests read it: overlap is a matter of structure, not of time)."""
    sequences: int = 0                  # admitted
    chunks: int = 0                     # prefill chunks sent
    steps: int = 0                      # decode steps sent (a batch of m sequences: m, times 1 + its batch_ahead)
    batches: int = 0                    # decode batches sent
    most_in_batch: int = 0              # the most steps in one batch
    most_in_flight: int = 0             # the most sequences with something in the pipeline at one time
    overlapped_sends: int = 0           # sends made while another sequence had something in the pipeline
    prefill_interleaved: int = 0        # decode steps sent while another sequence's prefill was not done
    most_chunks_between_steps: int = 0  # the most prefill micro-batches sent between two steps of a decoding
                                        # sequence (its step out or waiting): at most the window (_send_batch)
    restores: int = 0                   # sequences whose prompt began with blocks restored from the prefix cache
    restored_tokens: int = 0            # ... and the positions restored
    sends_during_kv: int = 0            # micro-batches sent while a prefix-cache round (restore, snapshot) was out
    loads_among_running: int = 0        # KV files admitted into a slot while another sequence was running
    pool_waits: int = 0                 # kv_pool: admissions put off because no gap of the pool held the sequence
    pool_most_used: int = 0             # kv_pool: the most positions its extents held at once
    # a decode step's round, summed over the batches: from a batch's send to its result taken (the stages' work,
    # their copies and the notes both ways, and any time the head was busy before taking it), and from the last
    # results taken before a batch's send to that send (the head's own turnaround: the sampling, the next note; the
    # callers' callbacks run after the send; not a wait for a batch to fill or for room in the window). With one
    # stage the GPU idles for the second, and for the first beyond its graph's time
    batch_trip_s: float = 0.0
    batch_turnaround_s: float = 0.0
    ring_steps: int = 0                 # one slot: a lone sequence's decode steps, round the ring
    prefill_groups: int = 0             # prefill groups sent: several sequences' last chunks as one micro-batch
    grouped_chunks: int = 0             # ... and the chunks in them


class SlotDriver:
    """The request loop over a started Pipeline with max_seqs slots. threaded: on its own thread, which owns the
    Pipeline (`generate`, `score`, `load`, `save`, `stop` from any thread); else on the caller's, for one call."""

    def __init__(self, pipe, max_seqs: int, threaded: bool = True):
        self.pipe, self.max_seqs = pipe, max_seqs
        # a sequence alone in the pipeline (the ring, the live KV, phases: see above): with one slot, and on the
        # caller's thread (Pipeline.generate, prefill, score: one call, one sequence), whatever max_seqs
        self.lone = max_seqs == 1 or not threaded
        self.window = len(pipe.stages) + 1  # micro-batches in flight: enough to keep stage 0 busy
        self.groups = len(pipe.stages)      # decode batches the decoding sequences are spread over
        self.batch_cap = min(max_seqs, pipe.plan.max_chunk)  # rows a hand-off buffer holds
        # the rig's batch_ahead, slot_spin and prefill_groups as the plan resolved them (strata.plan.plan.Resolved)
        picked = pipe.plan.resolved
        self.ahead = picked.batch_ahead    # steps an all-greedy batch runs past its note (one stage only)
        self.spin = picked.slot_spin       # poll without sleeping while a micro-batch is in flight
        self.grouping = picked.prefill_groups  # sequences' last prefill chunks waiting at once go as one micro-batch
        self._groups: set[int] = set()     # the prefill groups in flight, by chunk index
        self._spin_until = 0.0
        self._batches = 0                   # decode batches in flight
        self._results = 0                   # results taken (the clock of `ready_at`)
        self._prefill_sent = 0              # prefill micro-batches (chunks, groups) sent (the clock of `step_mark`)
        # tokens decided but not yet handed to their callers: (run, token or None, its length of `out` then, the
        # finish that follows or None, the end token that ends it or None); handed over after the next micro-batches
        # are sent (`_deliver`)
        self._decided: list[tuple[SlotRun, int | None, int, str | None, int | None]] = []
        self.ends = pipe.end_ids  # the tokens that end a sequence (its eos, an instruct model's end of turn, ...)
        self.stats = SlotStats()
        self.failure: PipelineError | None = None
        self._cond = threading.Condition()
        self._queue: collections.deque[SlotRun] = collections.deque()
        self._stopping = False
        self._running: list[SlotRun] = []           # admitted, in slot order of admission (the round-robin)
        self._free = list(range(max_seqs - 1, -1, -1))
        # kv_pool: the stages' pools, an extent a sequence (None: each slot holds max_context positions)
        self.pool = Extents(pipe.plan.kv_pool) if pipe.plan.kv_pool else None
        self._freeing: list[SlotRun] = []           # finished, their slot held until their snapshot's round is done
        self._loading: list[SlotRun] = []           # KV files being read into their slots (`load`)
        self._answers = 0                           # the Pipeline's KvDone count at the last look (progress)
        self._by_k: dict[int, list[SlotRun]] = {}  # a micro-batch's sequences (a batch's in row order)
        self._sent_t: dict[int, float] = {}         # a decode batch's send time (SlotStats.batch_trip_s)
        self._result_t = time.perf_counter()        # when the driver last took results (none: still a time)
        self._turn = 0
        self._t0: float | None = None               # the busy period's phase clock (None: idle)
        self._progress_at = time.monotonic()        # the last result (or the last moment nothing was in flight)
        self._ring: int | None = None               # one slot: the chunk index of the decode step on the ring
        self._jobs: collections.deque = collections.deque()  # `call`s waiting for the loop to be idle
        self._thread = None
        if threaded:
            pipe.driver = self  # (Pipeline.generate and score refuse while this loop owns the pipeline)
            self._thread = threading.Thread(target=self._run, name="strata-slots", daemon=True)
            self._thread.start()

    # -- the callers' side --------------------------------------------------------------------------------
    def generate(self, ids: np.ndarray, params, on_token, text: Callable | None = None,
                 progress: bool = False) -> SlotRun:
        """Blocking: the sequence prefilled and decoded among the others; raises the pipeline's failure. One slot:
        text (out -> the answer's text) for its report (run.result); progress: a bar while it prefills."""
        return self._submit(SlotRun(ids=ids, params=params, on_token=on_token, text=text, progress=progress))

    def score(self, ids: np.ndarray, start: int, top: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Blocking: Pipeline.score's values (log p(ids[i] | ids[:i]) for i in [start, n), the `top` likeliest
        tokens there and theirs), the prompt prefilled as one sequence among the others."""
        from strata.errors import ConfigError
        from strata.comm.messages import MAX_SCORED_TOP
        from strata.text.sampling import SamplingParams
        if not 0 <= top <= MAX_SCORED_TOP:
            raise ConfigError(f"score: top must be in 0..{MAX_SCORED_TOP}, got {top}")
        if not 1 <= start <= ids.size:
            raise ConfigError(f"score: start {start} outside 1..{ids.size}")
        run = self._submit(SlotRun(ids=ids, params=SamplingParams(max_tokens=0), on_token=lambda t: None,
                                   score=top, start=start))
        # (chunk indices restart with each phase, but a scored sequence is one phase: sorted is their order)
        return unpack_scores([run.scores[k] for k in sorted(run.scores)], top, ids.size, run.reused, start)

    def load(self, path) -> dict:
        """Blocking: a KV file's rows (checked here first: a bad file is refused in one line, nothing sent) into a
        free slot, then its blocks into the prefix cache, as a prefill's are; a later prompt that begins with its ids
        restores them. -> {"ids", "tokens", "bytes", "seconds"}."""
        import os
        from strata.text.sampling import SamplingParams
        if self.lone:  # one slot: the file's rows become its live KV (Pipeline.kv_load), between sequences
            return self.call(self.pipe.kv_load, path)
        ids, data_at, lrb = self.pipe.load_slot_check(path)
        t0 = time.perf_counter()
        self._submit(SlotRun(ids=ids, params=SamplingParams(max_tokens=0), on_token=lambda t: None,
                             load=(path, data_at, lrb)))
        return {"ids": ids, "tokens": int(ids.size), "bytes": os.path.getsize(path),
                "seconds": time.perf_counter() - t0}

    def save(self, path) -> dict:
        """Blocking: the live KV of the last sequence into a KV file (Pipeline.kv_save), between sequences. Several
        slots hold no one sequence's: the pipeline refuses that at once, from the caller's thread (it reads only the
        rig)."""
        if not self.lone:
            return self.pipe.kv_save(path)
        return self.call(self.pipe.kv_save, path)

    def call(self, fn, *args):
        """Blocking: fn(*args) on the loop's thread once no sequence holds a slot (it may use the Pipeline) -> its
        value; it raises to the caller, and a failed pipeline fails the loop too."""
        if self._thread is None:
            return fn(*args)
        job = [fn, args, threading.Event(), None, None]  # (fn, args, done, value, error)
        with self._cond:
            if self.failure is not None or self._stopping:
                raise self.failure or PipelineError("the pipeline is stopping")
            self._jobs.append(job)
            self._cond.notify()
        job[2].wait()
        if job[4] is not None:
            raise job[4]
        return job[3]

    def _submit(self, run: SlotRun) -> SlotRun:
        run.t_submit = time.perf_counter()
        if self._thread is None:
            return self._drive(run)
        with self._cond:
            if self.failure is not None or self._stopping:
                raise self.failure or PipelineError("the pipeline is stopping")
            self._queue.append(run)
            self._cond.notify()
        run.done.wait()
        if run.error is not None:
            raise run.error
        return run

    def _drive(self, run: SlotRun) -> SlotRun:
        """The loop on the caller's thread until the run is over and its slot free (its snapshot answered). A
        failure or a signal leaves through here after the chunks in flight are joined."""
        self._queue.append(run)
        try:
            while not run.done.is_set() or self._freeing or self._loading:
                self._step()
        except BaseException:
            self.pipe.guard()  # never leave with chunks in flight (a known failure returns at once)
            raise
        finally:
            if run.bar is not None:
                run.bar[1]()
        if run.error is not None:
            raise run.error
        return run

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def stop(self) -> None:
        """Stop the driver (the sequences still running fail); idempotent; not from the driver's thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()

    # -- the driver's thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                self._step()
        except BaseException as e:  # noqa: BLE001 - every waiting caller gets it
            if not isinstance(e, PipelineError):
                log.exception("the slot driver failed")
            self._fail(e if isinstance(e, PipelineError) else PipelineError(f"{type(e).__name__}: {e}"))

    def _step(self) -> None:
        """One turn of the loop: admit what fits, send what may go, hand decided tokens over, take results."""
        with self._cond:
            while not (self._queue or self._running or self._freeing or self._loading or self._stopping
                       or self._jobs):
                self._cond.wait(IDLE_WAIT_S)
            if self._stopping:
                raise PipelineError("the pipeline was stopped while sequences ran")
        if self._jobs and not (self._running or self._freeing or self._loading):
            return self._job(self._jobs.popleft())
        while self._free:
            with self._cond:
                if not self._queue or not self._place(self._queue[0]):
                    break  # (a sequence the pool has no room for waits, and those behind it)
                run = self._queue.popleft()
            self._admit(run)  # (running from its start: a failure of its restore fails it too)
        if self._send():
            self._spin_until = time.perf_counter() + HEAD_SPIN_S
        if self._decided:  # (after the send: the stages work while the callers' callbacks run)
            self._deliver()
            self._release()
            if self._queue and self._free:
                return  # (a slot came free: the next sequence is admitted now, not after a poll)
        results = self._take()
        for k, res, row in results:
            self._on_result(k, res, row)
        self._loaded()
        self._release()
        answers = self.pipe.kv.answers
        self._watch(bool(results) or answers != self._answers)
        self._answers = answers
        if not self._running and not self._freeing:
            self._t0 = None  # the next busy period starts a fresh phase on the stages

    def _take(self) -> list:
        """The results that came: a lone step's by its own wait (the ring's spin on the bell), else what the
        sockets hold within a poll (none while spinning)."""
        if self._ring is not None:
            k, self._ring = self._ring, None
            return [(k, self.pipe.wait_step(k), None)]
        busy = self._running or self._freeing or self._loading
        spinning = self.spin and self.pipe.in_flight and time.perf_counter() < self._spin_until
        results = self.pipe.take_results(0 if spinning else POLL_MS if busy else 0)
        self._result_t = time.perf_counter()
        if results and self.spin:
            self._spin_until = time.perf_counter() + HEAD_SPIN_S
        elif spinning:
            time.sleep(0)  # (the GIL to the server's threads between polls)
        return results

    def _job(self, job: list) -> None:
        """A `call`'s function, the loop idle: its value or error to its caller; a failed pipeline fails the loop."""
        fn, args, done = job[:3]
        try:
            job[3] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - the caller's to see
            job[4] = e
            if isinstance(e, PipelineError):
                done.set()
                raise
        done.set()

    def _place(self, run: SlotRun) -> bool:
        """kv_pool: an extent of the pool for the run's positions (its prompt and continuation, a KV file's rows),
        unless it has one -> whether it has one now (without a pool: always)."""
        if self.pool is None or run.extent is not None:
            return True
        if run.load is not None or run.score >= 0:
            need = run.ids.size
        else:
            need = run.ids.size + run.params.max_tokens
        need = min(-(-need // POOL_GRAIN) * POOL_GRAIN, self.pipe.max_context)
        off = self.pool.take(need)
        if off is None:
            if not run.pool_waited:
                run.pool_waited = True
                self.stats.pool_waits += 1
            return False
        run.extent = (off, need)
        self.stats.pool_most_used = max(self.stats.pool_most_used, self.pool.size - self.pool.free)
        return True

    def _free_slot(self, run: SlotRun) -> None:
        """The run's slot (and its extent of the pool) to the next sequence."""
        self._free.append(run.slot)
        self._give_extent(run)

    def _give_extent(self, run: SlotRun) -> None:
        if run.extent is not None:
            self.pool.give(*run.extent)
            run.extent = None

    def _release(self) -> None:
        """Slots whose sequence finished, with nothing of it in flight (a step sent before its caller said stop), and
        whose snapshot every stage has answered go back to the free list (a KV file's load is done then: its blocks
        are in the prefix cache)."""
        for run in [r for r in self._freeing if (r.snap is None or r.snap.complete) and not r.in_flight]:
            self._freeing.remove(run)
            run.snap = None
            self._free_slot(run)
            if run.load is not None:
                run.done.set()

    def _loaded(self) -> None:
        """KV files every stage has read into their slots: their blocks into the prefix cache next (a stage's read
        error fails the load, in one line, and frees the slot: the next sequence there overwrites what it holds)."""
        from strata.kvcache.kv_file import KvFileError
        for run in [r for r in self._loading if r.kv.complete]:
            self._loading.remove(run)
            bad = self.pipe.kv.errors(run.kv.done)
            run.kv = None
            if bad:
                run.error = KvFileError(f"kv_load: cannot read {run.load[0]}: {bad[0]}")
                self._free_slot(run)
                run.done.set()
                continue
            run.snap = self.pipe.kv.snapshot(run.ids, run.slot, wait=False)
            self._freeing.append(run)

    def _watch(self, progressed: bool) -> None:
        """The stall watchdog: micro-batches or KV rounds in flight and no result or answer for stall_timeout_s
        fails the run (stacks dumped to the stage logs), as a single sequence's wait does."""
        now = time.monotonic()
        if progressed or not (self.pipe.in_flight or self.pipe.kv.in_flight):
            self._progress_at = now
        elif now - self._progress_at > self.pipe.cfg.stall_timeout_s:
            self.pipe.procs.stalled()

    def _fail(self, e: PipelineError) -> None:
        """Every waiting caller gets e (tokens decided but not yet handed over are not: their sequences fail)."""
        with self._cond:
            self.failure = e
            runs = self._running + list(self._queue) + self._loading + [r for r in self._freeing if r.load is not None]
            self._running, self._queue, self._loading = [], collections.deque(), []
            jobs, self._jobs = list(self._jobs), collections.deque()
        for run in runs:
            run.error = e
            run.done.set()
        for job in jobs:
            job[4] = e
            job[2].set()
        if not self._stopping:
            log.error("sequences failed: %s", e)

    def _admit(self, run: SlotRun) -> None:
        from strata.text.sampling import Sampler
        if run.load is not None:  # a KV file: no chunk, no phase; its slot's rows from the file, then a snapshot
            run.slot = self._free.pop()
            if run.extent is not None:
                self.pipe.place_slot(run.slot, *run.extent)
            if self._running:
                self.stats.loads_among_running += 1
            run.kv = self.pipe.kv.load_begin(run.slot, run.load[0], run.ids, *run.load[1:])
            self._loading.append(run)
            return
        try:  # (a grammar that cannot be matched fails its own sequence, before it takes a slot)
            sampler = Sampler(run.params, self.pipe.tokenizer if run.params.grammar is not None else None, self.ends,
                              run.ids)
        except ValueError as e:
            run.error = e
            run.done.set()
            self._give_extent(run)
            return
        if self._t0 is None or self.lone:  # (one slot: each sequence's prefill is a phase of its own)
            self._t0 = self.pipe.begin_slots(keep_live=self.lone)
            self._by_k.clear()
            self._sent_t.clear()
            self._groups.clear()
            self._batches = 0
        run.slot = self._free.pop()
        if run.extent is not None:
            self.pipe.place_slot(run.slot, *run.extent)
        self._running.append(run)
        n = run.ids.size
        cap = n - 1 if run.score < 0 else min(n - 1, run.start - 1)  # the rows that must be computed come after
        run.live = self.pipe.live_prefix(run.ids, cap) if self.lone else 0
        run.reused, run.kv = self.pipe.kv.restore_begin(run.ids, run.live, cap, run.slot)
        run.sampler = sampler
        run.limit = min(run.params.max_tokens, self.pipe.max_context - n)
        self.pipe.put_slot_ids(run.slot, run.ids, run.live)  # (the segment already holds the live positions' ids)
        self.stats.sequences += 1
        if run.kv is None:
            self._restored(run)

    def _restored(self, run: SlotRun) -> None:
        """Its restore is done (or there was none): its chunks are planned and may go."""
        if run.kv is not None and run.kv.failed:
            run.reused = run.live  # the slot holds nothing restored: prefilled from its live positions
        run.kv = None
        run.restored = run.reused - run.live
        if self.lone:  # past these positions the live KV is about to be overwritten
            self.pipe.hold_live(run.ids, run.reused)
        # the cold prefill's own chunks (from the restored prefix on, which ends on one of their boundaries): its bits
        schedule = self.pipe.plan.schedule_for(run.reused, run.ids.size)
        schedule = scored_chunks(schedule, run.score) if run.score >= 0 else list(schedule)
        run.schedule = self.pipe.kv.keep_states(run.slot, run.ids, run.reused, schedule)  # (linear or window layers)
        if run.restored:
            self.stats.restores += 1
            self.stats.restored_tokens += run.restored
        if run.progress:
            run.bar = self.pipe.progress_bar(run.ids.size - run.reused)

    def _send(self) -> bool:
        """Decode batches and prefill chunks by turns while the window has room -> whether any went."""
        any_sent = False
        while self.pipe.in_flight < self.window and self._running:
            sent = self._send_step() if self.lone else self._send_batch()
            if self.pipe.in_flight < self.window and self._send_chunk():
                sent = True
            if not sent:
                return any_sent
            any_sent = True
        return any_sent

    def _send_step(self) -> bool:
        """One slot: its sequence's next decode step round the ring (Pipeline.send_step; `_take` waits for it)."""
        run = self._running[0]
        if run.pending is None or run.in_flight:
            return False
        pos = run.ids.size + len(run.out) - 1  # the pending token is out[-1]
        k = self.pipe.send_step(pos, run.pending, self._t0)
        run.step, run.pending = (pos, run.pending), None
        run.in_flight += 1
        self._by_k[k] = [run]
        self._ring = k
        self.stats.ring_steps += 1
        return True

    def _send_batch(self) -> bool:
        """The oldest ready steps as one batch, about 1/groups of the decoding sequences: sent when that many are
        ready, when no batch is in flight (nothing else would come back to fill it), or when a ready one has waited
        for window - 1 prefill chunks (so a long prompt holds no decoding sequence up by more than the window)."""
        ready = sorted((r for r in self._running if r.pending is not None and not r.in_flight),
                       key=lambda r: r.ready_at)
        if not ready:
            return False
        decoding = sum(1 for r in self._running if r.t_first is not None and not r.closing)
        size = min(self.batch_cap, -(-decoding // self.groups))
        # (a batch short of its size waits for the rest while another is in flight, but not past window - 1 prefill
        # chunks sent since one of its steps was ready: the same sequences would be left out again and again)
        waited = self._prefill_sent - min(r.step_mark for r in ready)
        if len(ready) < size and self._batches and waited < self.window - 1:
            return False
        batch = ready[:size]
        others = any(r.in_flight for r in self._running)
        seqs = []
        for run in batch:
            pos = run.ids.size + len(run.out) - 1  # the pending token is out[-1]
            self.pipe.put_slot_token(run.slot, pos, run.pending)
            seqs.append((run.slot, pos))
            run.pending = None
            run.in_flight += 1
            self.stats.most_chunks_between_steps = max(self.stats.most_chunks_between_steps,
                                                       self._prefill_sent - run.step_mark)
            run.step_mark = self._prefill_sent
        rows = any(r.params.needs_logits for r in batch)
        # steps past this one on the batch's own argmaxes: none that a row's token limit could not take (a row that
        # stops earlier, at EOS or by its caller, wastes the rest; its slot's later rows are never read)
        ahead = 0 if rows else max(0, min([self.ahead] + [r.limit - len(r.out) - 1 for r in batch]))
        k = self.pipe.send_batch(seqs, self._t0, rows=rows, ahead=ahead)
        self._by_k[k] = batch
        now = self._sent_t[k] = time.perf_counter()
        self.stats.batch_turnaround_s += now - self._result_t
        self._batches += 1
        st = self.stats
        st.steps += len(batch) * (1 + ahead)
        st.batches += 1
        st.most_in_batch = max(st.most_in_batch, len(batch))
        if any(r.sent_chunks < len(r.schedule) or r.last_k >= 0 and r.t_first is None for r in self._running):
            st.prefill_interleaved += 1
        self._sent_one(others)
        return True

    def _send_chunk(self) -> bool:
        """The next prefill chunk of the sequences still prefilling, one sequence a turn (once its restore is
        done)."""
        for r in self._running:
            if r.kv is not None and r.kv.complete:
                self._restored(r)
        filling = [r for r in self._running if r.kv is None and r.sent_chunks < len(r.schedule)]
        if not filling:
            return False
        run = filling[self._turn % len(filling)]
        if self.grouping and len(filling) > 1:
            group = self._group(filling)
            if run in group and len(group) > 1:  # (on a member's turn: a long prompt's chunks keep theirs)
                return self._send_group(group)
        self._turn += 1
        others = any(r.in_flight for r in self._running if r is not run)
        pos, n = run.schedule[run.sent_chunks]
        last = run.sent_chunks == len(run.schedule) - 1
        # (the last chunk's logits row: a sampled first token's, and a lone sequence's report's last_logits)
        k = self.pipe.send_slot(run.slot, pos, n, "prefill", run.ids.size, self._t0,
                                row=last and (run.params.needs_logits or self.lone), score=run.score)
        run.sent_chunks += 1
        if last:
            run.last_k = k
        self.stats.chunks += 1
        self._by_k[k] = [run]
        run.in_flight += 1
        self._prefill_sent += 1
        self._sent_one(others)
        return True

    def _group(self, filling: list[SlotRun]) -> list[SlotRun]:
        """The sequences (from this turn's on) whose next prefill chunk is their last, unscored and `groupable`, as
        many as the hand-off buffers' rows hold. The driver sends them on the turn of the first one, so sequences
        whose chunks are not their last keep their turns between groups."""
        group, rows = [], 0
        for i in range(len(filling)):
            run = filling[(self._turn + i) % len(filling)]
            if run.sent_chunks != len(run.schedule) - 1 or run.score >= 0:
                continue
            pos, n = run.schedule[-1]
            if rows + n <= self.pipe.plan.max_chunk and self.pipe.groupable(run.slot, pos, n):
                group.append(run)
                rows += n
        return group

    def _send_group(self, group: list[SlotRun]) -> bool:
        """Their last chunks as one prefill group (Pipeline.send_group): each one's first token comes with its
        result."""
        others = any(r.in_flight for r in self._running if r not in group)
        segs = [(run.slot, *run.schedule[-1]) for run in group]
        k = self.pipe.send_group(segs, max(r.ids.size for r in group), self._t0,
                                 rows=any(r.params.needs_logits for r in group))
        for run in group:
            run.sent_chunks += 1
            run.last_k = k
            run.in_flight += 1
        self._turn += 1
        self._by_k[k] = group
        self._groups.add(k)
        self.stats.chunks += len(group)
        self.stats.prefill_groups += 1
        self.stats.grouped_chunks += len(group)
        self._prefill_sent += 1
        self._sent_one(others)
        return True

    def _sent_one(self, others: bool) -> None:
        if others:
            self.stats.overlapped_sends += 1
        if self.pipe.kv.in_flight:
            self.stats.sends_during_kv += 1
        self.stats.most_in_flight = max(self.stats.most_in_flight, sum(1 for r in self._running if r.in_flight))

    def _on_result(self, k: int, res, rows) -> None:
        runs = self._by_k.pop(k)
        self._results += 1
        if runs[0].step is not None:  # one slot: its step round the ring
            return self._on_step(runs[0], res)
        if k in self._groups:  # a prefill group: row t is runs[t]'s last row
            self._groups.discard(k)
            now = time.perf_counter()
            for t, run in enumerate(runs):
                run.in_flight -= 1
                run.t_first = now
                self._advance(run, res.argmaxes[t], None if rows is None else rows[t])
            self._deliver(runs)  # the first tokens to the callers before the snapshots' rounds
            for run in runs:
                run.snap = self.pipe.kv.snapshot(run.ids, run.slot, wait=False)
            return
        if res.argmaxes:  # a decode batch: row t is runs[t]'s, step after step (batch_ahead)
            self._batches -= 1
            self.stats.batch_trip_s += self._result_t - self._sent_t.pop(k)
            m = len(runs)
            for run in runs:
                run.in_flight -= 1
            for j in range(len(res.argmaxes) // m):
                for t, run in enumerate(runs):
                    if run in self._running and not run.closing:  # (not ended at an earlier step of this batch)
                        self._advance(run, res.argmaxes[j * m + t], None if rows is None else rows[t])
            return
        run = runs[0]  # a prefill chunk
        run.in_flight -= 1
        if run.score >= 0:
            run.scores[k] = res.scores
        run.nll += res.nll
        run.count += res.count
        run.through += run.schedule[run.taken][1]  # (a sequence's chunks come back in order)
        run.taken += 1
        if run.bar is not None:
            run.bar[0](run.through)
        if k != run.last_k:
            return  # a chunk before the last
        run.t_first = time.perf_counter()
        if self.lone:
            self._prefilled(run, rows)
        self._advance(run, res.argmax, rows)
        self._deliver(runs)  # its first token to the caller before the snapshot's round
        if not self.lone:
            run.snap = self.pipe.kv.snapshot(run.ids, run.slot, wait=False)  # (its slot is not reused before it is done)
        elif run in self._running:  # it decodes: a phase of its own, its steps round the ring
            self._t0 = run.t_decode = self.pipe.begin_decode()
            self._by_k.clear()

    def _prefilled(self, run: SlotRun, rows) -> None:
        """One slot: its prefill phase is over (the stages' timing of it collected), the slot holds the prompt."""
        run.prefill_s = run.t_first - self._t0
        if run.bar is not None:
            run.bar, close = None, run.bar[1]
            close()
        self.pipe.end_phase("prefill")
        self.pipe.hold_live(run.ids, run.ids.size)
        run.logits = rows.numpy().copy()

    def _on_step(self, run: SlotRun, res) -> None:
        """One slot: its step is back (the slot holds its token's KV); the next token is decided and handed to the
        caller before the next step goes (a caller that says stop wastes none)."""
        run.in_flight -= 1
        (pos, tok), run.step = run.step, None
        self.pipe.hold_token(pos, tok)
        run.steps += 1
        # (its logits row: read before the next step goes down, which is the only thing that overwrites it)
        self._advance(run, res.argmax, self.pipe.result_row if run.params.needs_logits else None)
        self._deliver([run])

    def _advance(self, run: SlotRun, argmax: int, logits) -> None:
        """The next token from a step's (or the prompt's last chunk's) result, as Pipeline.generate takes it: decided
        here (its next step may go at once), handed to the caller by `_deliver`."""
        if run.step_mark < 0:  # its first token: it decodes from here on
            run.step_mark = self._prefill_sent
        then = "length" if len(run.out) >= run.limit else None
        tok = end = None
        if then is None:
            tok = run.sampler.next(logits) if run.params.needs_logits else argmax
            if tok in self.ends:
                end, tok, then = tok, None, "stop"
            else:
                run.out.append(tok)
                then = "length" if len(run.out) == run.limit else None
        self._decided.append((run, tok, len(run.out), then, end))
        # (a batch's steps ahead decide several tokens of a run at once: the last one's step is the one to send)
        run.pending, run.closing = (tok, False) if then is None else (None, True)
        run.ready_at = self._results

    def _deliver(self, runs: list[SlotRun] | None = None) -> None:
        """The decided tokens (of `runs` only, if given) to their callers, in order. A caller that says stop (or
        raises) ends its sequence there: the tokens decided after it are dropped, and a step already sent on them is
        wasted (its slot waits for it: `_release`)."""
        if runs is None:
            decided, self._decided = self._decided, []
        else:
            decided = [d for d in self._decided if d[0] in runs]
            self._decided = [d for d in self._decided if d[0] not in runs]
        for run, tok, n, then, end in decided:
            if run not in self._running:
                continue  # (ended by its caller at an earlier token)
            if tok is not None:
                try:
                    keep = run.on_token(tok)
                except Exception as e:  # noqa: BLE001 - the caller's callback: its own sequence fails, not the others
                    run.error, keep = e, False
                if keep is False:
                    del run.out[n:]
                    self._finish(run, "stop")
                    continue
            if end is not None:
                run.end_token = end
            if then is not None:
                self._finish(run, then)

    def _finish(self, run: SlotRun, why: str) -> None:
        run.finish, run.t_end, run.pending = why, time.perf_counter(), None
        self._running.remove(run)
        if self.lone:
            self._lone_end(run)
        else:
            run.prefill_s = (run.t_first or run.t_end) - run.t_submit
            run.decode_s = run.t_end - (run.t_first or run.t_end)
        self._freeing.append(run)  # (its snapshot may still be in flight: _release frees the slot after it)
        run.done.set()

    def _lone_end(self, run: SlotRun) -> None:
        """One slot: its decode phase's timing, its Result and report, then its prompt's snapshot (after the answer:
        the blocks' copies are not on the way to its tokens)."""
        if run.steps:
            run.decode_s = run.t_end - run.t_decode
            self.pipe.end_phase("decode")
        pre = {"ids": run.ids, "reused": run.reused, "restored": run.restored, "schedule": run.schedule,
               "seconds": run.prefill_s, "logits": run.logits, "nll": run.nll, "count": run.count}
        ttft = run.t_first - run.t_submit if run.limit > 0 else None
        text = run.text(run.out) if run.text is not None else self.pipe.text_of(run.out)
        run.result = self.pipe.lone_result(pre, run.out, text, run.finish, run.decode_s, run.steps, ttft)
        run.snap = self.pipe.kv.snapshot(run.ids, run.slot, wait=False)
