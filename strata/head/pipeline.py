"""The head's side of a run: spawn one process per stage, feed chunks, collect results, tear down.

    with strata.Pipeline(config) as p:
        result = p.prefill("some long text")   # or token ids; None = the rig's prompt
        answer = p.generate("same long text, then a question?", SamplingParams(max_tokens=64))

Buffers and every stage's KV cache are sized once for `max_context`: any number of prompts up to it run on
the same stages, and the prefix a prompt shares with what the stages hold (the last prompt and its
answer) is not prefilled again.

`prefill` has a guard on every return path (normal, exception, Ctrl-C) that calls `finish()`:
the head never returns while chunks are in flight. The Pipeline feeds chunks and decode steps and reads their
results; two parts it holds do the rest. `procs` (strata/head/stage_set.py, `StageSet`) owns the stage processes and
the wire: everything the run creates (processes, sockets, the ipc directory, shared memory) is released by
`close()`, reached through `weakref.finalize` too, however the run ends. `kv` (strata/head/kv_rounds.py, `KvRounds`)
decides the prefix cache and KV files.

Stages on other hosts (`stages[i].host`): the head also listens on tcp (`listen`) with CurveZMQ,
starts each remote stage through `remote_command` (or prints the command), serves its join and
watches it by heartbeats as well as by its launcher process (strata/head/remote.py over strata/head/net.py);
boundaries that cross hosts carry their rows over tcp (strata/comm/transport.py).
"""
from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from strata.comm import messages as M
from strata.weights.checkpoint import check_model_files
from strata.config import RigConfig, check_run_dir, from_dict
from strata.errors import ConfigError, PipelineError
from strata.head.wire import HEAD_SPIN_S, HeadWire, poll_until
from strata.head.kv_rounds import KvLink, KvRounds
from strata.plan.plan import Plan, build_plan
from strata.head.procs import Buffers, start_method
from strata.head.stage_set import StageSet

log = logging.getLogger("strata.head.pipeline")


BELL_CHECK_S = 0.0005  # spinning on a decode bell, the head still reads its socket and watches the stages this often


@dataclass
class Result:
    report: dict
    continuation_ids: list[int]      # generated tokens (an end-of-sequence token is not one of them)
    continuation: str | None         # their text (cut before a stop string); None without a tokenizer
    perplexity: float | None         # over the prompt positions computed this time (not a reused prefix)
    last_logits: np.ndarray          # the prompt's last row
    finish_reason: str = "length"    # "stop": EOS, a stop string or on_token said stop; "length": out of tokens
    prompt_tokens: int = 0
    reused_tokens: int = 0           # prompt positions whose KV the stages already held (not prefilled)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    ttft_s: float | None = None      # from the call to the first generated token (prefill included)
    end_token: int | None = None     # the end token that ended it (one of Pipeline.end_ids), else None


class Pipeline:
    def __init__(self, config: RigConfig | dict, out: str | os.PathLike | None = None, console: bool = True,
                 marks: dict[str, float] | None = None, always_calibrate: bool = False, serving: bool = False):
        """marks: perf_counter times the caller knows (the launcher: `process` start, `imports` done); the
        start-up breakdown (`startup`, report.json's startup_s) counts from `process`, else from here.
        always_calibrate: the planner times identical stages too (build_plan; bench/split.py --calibrate).
        serving: a server's pipeline (max_seqs auto: several sequences, as memory holds; else one)."""
        self._marks = dict(marks or {})
        self._marks.setdefault("process", time.perf_counter())
        self._marks.setdefault("imports", self._marks["process"])
        self.startup: dict | None = None
        self.cfg = config if isinstance(config, RigConfig) else from_dict(config)
        self.plan: Plan = build_plan(self.cfg, always_calibrate, serving)
        self.cfg = self.plan.cfg  # (max_seqs auto resolved)
        check_model_files(self.cfg.model)
        self.out = Path(out or self.cfg.out or Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
        check_run_dir(self.out)
        self.console = console
        self.run_id = f"{os.getpid():x}{int(time.time() * 1000) % 0xFFFFFF:x}"
        # the stage processes and the wire to them (strata/head/stage_set.py); `stages` is its list
        procs = self.procs = StageSet(self.cfg, self.plan, self.out, console, self.run_id, self._marks,
                                      self._oldest_in_flight)
        self.stages = self.procs.stages
        self.all_cuda = self.procs.all_cuda  # (the head's spins read it)
        self._wire: HeadWire | None = None  # the stages' wire and buffers (StageSet's), once `start` made them
        self._buffers: Buffers | None = None
        self._end_ids: frozenset[int] | None = None  # end_ids, read at the first generation
        self._sent = self._got = 0     # chunks of the current phase sent to stage 0 / back from the last
        self._results: dict[int, M.ChunkResult] = {}
        self._bell_results = 0  # decode steps whose result came by bell (strata/comm/bells.py), not ZeroMQ
        self._decoding = False  # decode phase: the ring head -> stage 0 -> ... -> head carries no "taken" notes
        # the ids whose KV every stage holds: positions [0, _kept_n) (a decoded token is one write, not a copy)
        self._kept = np.zeros(self.plan.max_len, dtype=np.int32)
        self._kept_n = 0
        self._want_rows: set[int] = set()          # several sequences: chunks whose logits row the head keeps
        self._spans: dict[int, tuple[int, int]] = {}  # kv_pool: each slot's extent of the stages' pools (place_slot)
        self._rows: dict[int, torch.Tensor] = {}   # ... and those rows, by chunk
        self._loaded = False                       # the live KV is a kv_load's (no prefill since)
        # the prefix cache's policy and KV files (strata/head/kv_rounds.py), reaching the stages through StageSet alone
        self.kv = KvRounds(self.cfg, self.plan, self.stages, self._spans,
                           KvLink(send=procs.send, wait=procs.wait_for, who=procs.who,
                                  failed=lambda: procs.failure is not None))
        self._tokenizer = None
        self.driver = None             # the engine's request loop (a SlotDriver on its thread) that owns this
                                       # pipeline; None: generate / score run the loop on the caller's thread
        self._decode_wait_s = 0.0      # a lone sequence's decode: seconds waiting on the stages
        self.steps = 0                 # decode steps of the current (or last) generate; then `generations` counts it
        self.generations = 0
        self._marks["planned"] = time.perf_counter()

    # -- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        """Spawn the stages and wait until each has loaded its slice and mapped its buffers (StageSet.start), then
        size the prefix cache by what they hold."""
        self._refuse_if_closed()
        if self.started:
            return
        try:
            self.procs.start({M.ChunkResult: self._on_result, M.KvDone: self.kv.on_done})
        finally:  # (what a start cut short made stays reachable, as before the carve: finish and the guard read it)
            self._wire, self._buffers = self.procs.wire, self.procs.buffers
        self._result_rows = self.procs.result_rows  # (max_seqs or 1, vocab)
        self._result_row = self._result_rows[0]
        self.kv.start()
        self.procs.unlink_segments()

    @property
    def started(self) -> bool:
        """Whether the stages were spawned (a start that failed after spawning them counts: it is not retried)."""
        return self.procs.started

    @property
    def failure(self) -> PipelineError | None:
        """The run's failure, once known (the first; every later wait raises it)."""
        return self.procs.failure

    @property
    def boundaries(self) -> list[str]:
        """Per boundary between stages: "shm" or "tcp" (report.json)."""
        return self.procs.boundaries

    @property
    def bad_frames(self) -> int:
        """Frames the head rejected (garbled, unknown, out of range)."""
        return self.procs.bad_frames

    @property
    def rejected_connections(self) -> int:
        """Handshakes refused on this run's tcp sockets (no key, a wrong key): the head's and the stages'."""
        return self.procs.rejected_connections

    def _refuse_if_closed(self) -> None:
        if self.procs.closed:
            raise PipelineError("this pipeline is closed (its stages have stopped): make a new Pipeline")

    def close(self) -> None:
        """Stop every stage and release everything; idempotent."""
        self.procs.close()

    def interrupt(self, signum: int) -> None:
        """Ask the head to stop (safe from a signal handler: it only records the signal). The head
        raises `Interrupted` at its next safe point, within ~0.2 s, then joins chunks in flight."""
        self.procs.interrupt(signum)

    def where(self) -> str:
        """Every stage with its device, pid and the chunk it is on."""
        return self.procs.where()

    def _oldest_in_flight(self) -> int:
        """The oldest chunk of this phase sent to stage 0 and not back from the last (-1: none): every stage has
        started it or waits for it (StageSet names a failing stage's chunk by it)."""
        return self._got if self._got < self._sent else -1

    # -- the head's handler of results (StageSet handles the messages about the stages themselves) -------
    def _on_result(self, msg: M.ChunkResult, data) -> None:
        k = msg.k
        if not (0 <= k < self._sent and k not in self._results):
            raise M.BadMessage(f"result: chunk {k} is not in flight")
        if data is not None:
            self._wire.land_result(data)
        if k in self._want_rows:  # several sequences: the rows are copied before "taken" lets the next ones in
            self._want_rows.discard(k)
            self._rows[k] = (self._result_rows[:len(msg.argmaxes)] if msg.argmaxes else self._result_row).clone()
        self._results[k] = msg
        # a decode step's result is read before the next token goes down: nothing to free (but with max_seqs > 1 the
        # stages reap every step, one sequence's too)
        if not self._decoding or self.cfg.max_seqs > 1:
            self._wire.send(len(self.stages) - 1, M.Taken(k=k))
        self._got += 1

    # -- the run -----------------------------------------------------------------------------
    def finish(self) -> None:
        """Wait until every chunk sent has come out of the last stage, or a failure is known.

        Public and idempotent: a caller may join the pipeline early; the prefill guard calls it."""
        if self._wire is not None:
            bells = self._buffers.bells  # a decode step in flight may answer on its bell

            def step():
                if not (bells is not None and self._take_bell()):
                    self.procs.receive(200 if bells is None else 1)
            poll_until(lambda: self._got >= self._sent or self.failure is not None, self.cfg.stall_timeout_s,
                       what=self.procs.stalled, step=step, progress=lambda: self._got)
        if self.failure:
            raise self.failure

    def _take_bell(self) -> bool:
        """A decode step's result from the head's bell (strata/comm/bells.py), handled as its note would be."""
        note = self._buffers.bells.take(len(self.stages))
        if note is None:
            return False
        self._bell_results += 1
        try:
            self._on_result(M.ChunkResult(k=note[0], nll=0.0, count=0, argmax=note[2], scores=b""), None)
        except M.BadMessage as e:  # checked as a frame is: counted and dropped, never acted on
            self._wire.bad_frames += 1
            log.warning("head rejected a decode bell: %s", e)
        return True

    def _new_phase(self, phase: str) -> None:
        self._decoding = phase == "decode"
        self._results.clear()
        self._sent = self._got = 0
        for st in self.stages:  # a second prefill must wait for fresh timing, not find the last one's
            st.stats.pop(phase, None)
            st.chunk = -1       # notes of the last phase name none of this phase's chunks

    def guard(self) -> None:
        """Never leave with chunks in flight; a known failure returns at once (a second SIGINT/SIGTERM
        through `interrupt` raises Interrupted here and abandons the join)."""
        if not self.failure:
            try:
                self.finish()
            except KeyboardInterrupt:
                self.procs.fail("interrupted while joining chunks in flight")

    def _collect_stats(self, phase: str) -> None:
        """One round trip at the end of a phase (never per token): each stage's timing of it."""
        self._wire.broadcast(M.End(phase=phase))
        self.procs.wait_for(lambda: all(phase in st.stats for st in self.stages))

    def _startup_done(self) -> None:
        """The first chunk has left for stage 0: where the seconds since the process started went."""
        from strata.head.report import format_startup, startup_breakdown
        self._marks["first"] = time.perf_counter()
        self.startup = startup_breakdown(self._marks, self.plan.timings.get("tokenizer_s", 0.0),
                                         max((st.load_s for st in self.stages), default=0.0))
        local = [start_method(st.device) for st in self.stages if st.host is None]
        self.startup["stage_start"] = "forkserver" if "forkserver" in local else "spawn" if local else "remote"
        log.info(format_startup(self.startup))

    # -- several sequences at once (max_seqs > 1): strata/head/slots.py drives these --------------------------
    def begin_slots(self, keep_live: bool = False) -> float:
        """A busy period begins: chunk indices from 0 and one `t0` (the stages' timing phase) for all its chunks and
        steps. What the live KV of slot 0 held is forgotten (other sequences write there), unless keep_live: a lone
        sequence's loop keeps it up to date (live_prefix, hold_live). -> t0."""
        self._refuse_if_closed()
        self.start()
        self._new_phase("prefill")
        self._want_rows.clear()
        self._rows.clear()
        if not keep_live:
            self._kept_n = 0
        return time.perf_counter()

    def place_slot(self, slot: int, offset: int, positions: int) -> None:
        """The extent [offset, offset + positions) of every stage's KV pool (kv_pool) that `slot`'s next sequence
        holds: its chunks and KV rounds carry it to the stages (Transformer.place_slot)."""
        self._spans[slot] = (offset, positions)

    def put_slot_ids(self, slot: int, ids: np.ndarray, start: int = 0) -> None:
        """ids[start:] into `slot`'s part of the ids segment (stage 0 reads a chunk's ids there)."""
        if slot == 0:  # (a remote stage 0 has its own copy of the ids: only with max_seqs 1, so only slot 0)
            return self._put_ids(ids, start)
        base = slot * (self.plan.max_len + 1)
        self._buffers.ids[base + start:base + ids.size] = torch.from_numpy(np.ascontiguousarray(ids[start:]))

    def put_slot_token(self, slot: int, pos: int, token: int) -> None:
        """A decode step's token at `pos` of `slot`'s ids (through a numpy view made for the write: a torch item write
        takes ~4 us, a batch of 16 rows writes 16; no view is kept, which would hold the segment's mapping open)."""
        self._buffers.ids.numpy()[slot * (self.plan.max_len + 1) + pos] = token

    def send_slot(self, slot: int, pos: int, n: int, phase: str, tokens: int, t0: float, row: bool,
                  score: int = -1) -> int:
        """Rows [pos, pos + n) of the sequence in `slot` to stage 0 (a prefill chunk, or a decode step when phase is
        "decode"); row: keep its logits row (a sampled token); score >= 0: a scored prefill chunk (its rows fit its
        result: strata.head.slots.scored_chunks). -> its chunk index."""
        k = self._sent
        if row:
            self._want_rows.add(k)
        self._wire.send(0, M.Chunk(k=k, kind=M.Kind.STEP if phase == "decode" else M.Kind.CHUNK, pos=pos, n=n, t0=t0,
                                   tokens=tokens, score=score, slot=slot,
                                   keep=self.kv.keep_after(slot, pos + n, phase), span=list(self._spans.get(slot, ()))))
        self._sent += 1
        if self.startup is None:
            self._startup_done()
        return k

    def groupable(self, slot: int, pos: int, n: int) -> bool:
        """Whether rows [pos, pos + n) of `slot`'s prompt may go in a prefill group (send_group): the model's layers
        take groups, and no state is kept after them (a linear or window model's prefix-cache boundary)."""
        return self.plan.args.group_refusal() is None and not self.kv.keep_after(slot, pos + n, "prefill")

    def send_group(self, segs: list[tuple[int, int, int]], tokens: int, t0: float, rows: bool) -> int:
        """Several sequences' prefill chunks (slot, pos, n), each `groupable`, as one micro-batch (a prefill group,
        Transformer.forward_group); tokens: the longest prompt's length; rows: keep each one's last row's logits
        (row t of the result). Its result's argmaxes are each sequence's. -> its chunk index."""
        k = self._sent
        if rows:
            self._want_rows.add(k)
        span = [v for s, _, _ in segs for v in self._spans.get(s, ())]
        if span and len(span) != 2 * len(segs):
            raise ValueError(f"send_group: a sequence without its extent of the KV pool in {segs}")
        self._wire.send(0, M.Chunk(k=k, kind=M.Kind.GROUP, pos=0, n=sum(n for _, _, n in segs), t0=t0, tokens=tokens,
                                   score=-1, seqs=[v for s, p, _ in segs for v in (s, p)], rows=rows, span=span,
                                   lens=[n for _, _, n in segs]))
        self._sent += 1
        if self.startup is None:
            self._startup_done()
        return k

    def send_batch(self, seqs: list[tuple[int, int]], t0: float, rows: bool, ahead: int = 0) -> int:
        """One decode step of each sequence (slot, pos) as one micro-batch (its tokens already at pos of each
        slot's ids: put_slot_token); rows: keep its logits rows (a sampled token). ahead (one stage, no rows): that
        many more steps on the batch's own argmaxes, at pos + 1 ..., each row's in the result (step-major). -> its
        chunk index."""
        if ahead and (rows or len(self.stages) != 1):
            raise ValueError("send_batch: ahead needs one stage and greedy rows (no logits rows)")
        k = self._sent
        if rows:
            self._want_rows.add(k)
        top = max(pos for _, pos in seqs) + 1 + ahead
        self._wire.send(0, M.Chunk(k=k, kind=M.Kind.BATCH, pos=0, n=len(seqs), t0=t0, tokens=top, score=-1,
                                   seqs=[v for sp in seqs for v in sp], rows=rows, ahead=ahead))
        self._sent += 1
        return k

    def take_results(self, timeout_ms: int) -> list[tuple[int, M.ChunkResult, torch.Tensor | None]]:
        """What the last stage finished within timeout_ms: (chunk, result, its logits row or None), in order; a
        decode batch's result has its argmaxes, and its logits rows (m, vocab).
        A dead stage or a typed failure raises PipelineError."""
        self.procs.receive(timeout_ms)
        done = sorted(self._results)
        return [(k, self._results.pop(k), self._rows.pop(k, None)) for k in done]

    @property
    def in_flight(self) -> int:
        return self._sent - self._got

    # -- prompts -------------------------------------------------------------------------------
    @property
    def end_ids(self) -> frozenset[int]:
        """The tokens that end a generation (strata.weights.checkpoint.end_ids: the eos and every end the model's files
        declare, e.g. an instruct model's end of turn), read once."""
        if self._end_ids is None:
            from strata.weights.checkpoint import end_ids
            self._end_ids = end_ids(self.cfg.model, self.plan.args)
        return self._end_ids

    @property
    def max_context(self) -> int:
        """Prompt + generated tokens one prefill / generate may use (the stages' KV positions)."""
        return self.plan.max_len

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from strata.text.tokenizer import Tokenizer
            self._tokenizer = Tokenizer.for_model(self.cfg.model)  # ModelError for a model without one
        return self._tokenizer

    def prompt_ids(self, prompt: str | list[int] | np.ndarray | None) -> np.ndarray:
        """The prompt as int32 ids (None: the rig's), checked against the vocabulary and max_context."""
        if prompt is None:
            ids = self.plan.ids
        elif isinstance(prompt, str):
            if not prompt:
                raise ConfigError("prompt: the text is empty")
            ids = np.asarray(self.tokenizer.encode(prompt), dtype=np.int64)
        else:
            ids = np.asarray(prompt, dtype=np.int64).reshape(-1)
            if ids.size and (ids.min() < 0 or ids.max() >= self.plan.args.vocab_size):
                raise ConfigError(f"prompt: ids must be in [0, {self.plan.args.vocab_size})")
        if ids.size == 0:
            raise ConfigError("prompt: empty")
        if ids.size > self.max_context:
            raise ConfigError(f"prompt: {ids.size} tokens exceeds max_context of {self.max_context} tokens")
        return ids.astype(np.int32)

    # -- KV files and the prefix cache's figures (strata/head/kv_rounds.py decides) ---------------------------
    def prefix_cache_stats(self):
        """Read-only figures of the head's index, a PrefixCacheStats (safe from another thread)."""
        return self.kv.stats()

    def kv_save(self, path: str | os.PathLike) -> dict:
        """Write the KV the stages hold for the current prompt (and its answer so far) with its token ids to `path`
        (strata/kvcache/kv_file.py: a JSON header fingerprinting the model and rig, raw rows; no pickle). -> facts of it."""
        self._refuse_if_closed()
        return self.kv.save(path, self._kept[:self._kept_n] if self.started else None)

    def kv_load(self, path: str | os.PathLike) -> dict:
        """Load a KV file into the stages (refused in one line unless it was saved for this model and rig): its
        ids become what the stages hold, so a prompt that begins with them prefills only the rest (up to a chunk
        boundary of its cold schedule: see `live_prefix`). -> {"ids", "tokens", "bytes", "seconds"} (seconds: the
        stages' reads, not their start)."""
        self._refuse_if_closed()
        h, ids, data_at = self.kv.load_header(path)
        self.start()  # refused before any stage starts; the rows' width needs the stages' caches
        lrb = self.kv.load_width(path, h, ids)
        t0 = time.perf_counter()
        n = ids.size
        self._kept_n = 0  # the live KV is about to be overwritten
        self.kv.load_rows(path, ids, data_at, lrb)
        self._kept[:n] = ids
        self._kept_n = n
        self._loaded = True
        self._buffers.ids[:n] = torch.from_numpy(ids)
        seconds = time.perf_counter() - t0
        self.kv.snapshot(ids)  # and into the prefix cache, which outlives the live KV
        return {"ids": ids, "tokens": n, "bytes": os.path.getsize(path), "seconds": seconds}

    def load_slot_check(self, path: str | os.PathLike) -> tuple[np.ndarray, int, int]:
        """KvRounds.load_check on an open pipeline (SlotDriver.load: a KV file for a slot, checked before it is
        queued) -> (its ids, its rows' offset, bytes of one layer's position)."""
        self._refuse_if_closed()
        return self.kv.load_check(path)

    def _put_ids(self, ids: np.ndarray, start: int) -> None:
        self._buffers.ids[start:ids.size] = torch.from_numpy(np.ascontiguousarray(ids[start:]))
        if self.stages[0].host is not None:  # a remote stage 0 has its own copy of the ids
            step = 65536                     # ~330 KB of msgpack ints: well under a frame's limit
            for a in range(start, ids.size, step):
                self._wire.send(0, M.Ids(pos=a, ids=ids[a:a + step].tolist()))

    # -- prefill, score and generate: one sequence through the request loop --------------------------
    def score(self, prompt: str | list[int] | np.ndarray, start: int = 1,
              top: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """log p(ids[i] | ids[:i]) for i in [start, n), by the last stage's head in each prefill chunk (the rows of
        the perplexity), and the `top` (<= 20) likeliest tokens there -> (log-probabilities (n - start,) float32,
        top ids (n - start, top) int32, their log-probabilities (n - start, top) float32). A prefix the stages
        hold is reused up to start - 1; the prompt stays cached for what follows (a generate after it). Runs
        through the request loop (strata/head/slots.py) as one sequence, as the server's scoring does."""
        ids = self._prompt_here(prompt)
        return self._loop().score(ids, start, top)

    def prefill(self, prompt: str | list[int] | np.ndarray | None = None) -> Result:
        """Prefill the prompt (None: the rig's; text or ids, up to max_context, any number of times: a prefix
        shared with what the stages hold is not computed again), then the rig's greedy continuation
        (`generate`). Returns the report."""
        from strata.text.sampling import SamplingParams
        return self.generate(prompt, SamplingParams(max_tokens=self.cfg.generate))

    def generate(self, prompt: str | list[int] | np.ndarray | None = None, params=None,
                 on_token: Callable[[int], bool | None] | None = None) -> Result:
        """Prefill the prompt (with prefix reuse), then decode up to params.max_tokens tokens (default: the
        rig's `generate`, greedy). Per token one id goes down and one residual row crosses each boundary;
        the head samples the last stage's logits row. Stops at EOS (not included), at a stop string (text cut
        before it), when on_token(id) returns False, or at max_context. The sequence runs through the request
        loop (strata/head/slots.py: SlotDriver) on this thread, the loop the server's engine runs on its own."""
        from strata.text.sampling import Detokenizer, SamplingParams, StopMatcher
        params = params if params is not None else SamplingParams(max_tokens=self.cfg.generate)
        ids = self._prompt_here(prompt)
        self.generations += 1
        stop = StopMatcher(params.stop) if params.stop else None
        detok = Detokenizer(self.tokenizer.decode, context=ids.tolist()) if stop else None
        parts: list[str] = []

        def each(tok: int) -> bool | None:  # a stop string ends it before the caller sees the token (as EOS does)
            if stop is not None:
                parts.append(stop.feed(detok.add(tok)))
                if stop.stopped:
                    return False
            return on_token(tok) if on_token is not None else None

        def text(out: list[int]) -> str | None:  # (in the loop, before the report: it carries the text)
            if stop is not None:
                return "".join(parts) + (stop.feed(detok.flush()) + stop.flush() if not stop.stopped else "")
            return self.text_of(out)
        run = self._loop().generate(ids, params, each, text=text, progress=self.cfg.progress and self.console)
        self.steps = run.steps
        return replace(run.result, end_token=run.end_token)

    def _prompt_here(self, prompt) -> np.ndarray:
        """A prompt for this thread's request loop: the pipeline open, started, and driven by no engine's loop."""
        self._refuse_if_closed()
        if self.driver is not None:
            raise ConfigError("this pipeline is driven by its engine's request loop (PipelineEngine): "
                              "call the engine's generate / score / kv_load")
        ids = self.prompt_ids(prompt)
        self.start()
        return ids

    def _loop(self):
        """The request loop (strata/head/slots.py) on the caller's thread, for one call."""
        from strata.head.slots import SlotDriver
        return SlotDriver(self, self.cfg.max_seqs, threaded=False)

    def text_of(self, out: list[int]) -> str | None:
        """The generated ids' text (None: none, or no tokenizer)."""
        if not out:
            return None
        try:
            return self.tokenizer.decode(out)
        except Exception:  # noqa: BLE001 - synthetic models have no tokenizer
            return None

    # -- one sequence alone in the pipeline (max_seqs 1): the request loop's decode ring ---------------------------
    def live_prefix(self, ids: np.ndarray, cap: int) -> int:
        """Positions of ids[:cap] whose KV the stages hold live from the last sequence (max_seqs 1: its one slot
        keeps the last prompt and answer); after a kv_load, up to a chunk boundary of the prompt's cold schedule
        (prefix_reuse chunks), so the rest is computed in the cold prefill's own chunks (the saved rows' bits,
        the same answer). Past the returned positions the live KV is about to be overwritten."""
        live = min(self.kv.reusable(ids, self._kept[:self._kept_n]), cap)
        if self._loaded and live and self.cfg.prefix_reuse == "chunks":
            live = max(q for q, _ in self.plan.schedule_for(0, ids.size) if q <= live)
        self._loaded = False
        self._kept_n = min(self._kept_n, live)
        return live

    def hold_live(self, ids: np.ndarray, n: int) -> None:
        """Every stage's slot 0 holds the KV of ids[:n] (what live_prefix and kv_save read)."""
        self._kept[:n] = ids[:n]
        self._kept_n = n

    def begin_decode(self) -> float:
        """A lone sequence's decode phase (max_seqs 1): chunk indices from 0, steps on the ring (no "taken"),
        by bell after the first. -> its t0."""
        self._new_phase("decode")
        self._decode_wait_s = 0.0  # waiting on the stages; the rest of decode_s is the head's own time
        self._bell_results = 0
        return time.perf_counter()

    def end_phase(self, phase: str) -> None:
        """A lone sequence's phase is over: each stage's timing of it (one round trip, for the report)."""
        self._collect_stats(phase)

    def send_step(self, pos: int, tok: int, t0: float) -> int:
        """A lone sequence's decode step (max_seqs 1, after begin_decode): its token at `pos` of slot 0's ids, one
        note to stage 0 (its bell after the phase's first step). -> its chunk index (wait_step)."""
        self._buffers.ids[pos] = tok
        if self.stages[0].host is not None:  # stage 0 is remote: it has its own copy of the ids
            self._wire.send(0, M.Token(pos=pos, id=tok))
        k = self._sent
        bells = self._buffers.bells
        if bells is not None and k > 0:  # a phase's first step goes by ZeroMQ: it wakes a stage not yet spinning
            bells.ring(0, k, pos, argmax=tok, t0=t0)  # the id too: a step queued ahead copies it from the bell
        else:
            self._wire.send(0, M.Chunk(k=k, kind=M.Kind.STEP, pos=pos, n=1, t0=t0, tokens=pos + 1, score=-1))
        self._sent += 1
        return k

    def wait_step(self, k: int) -> M.ChunkResult:
        """Step k's result (send_step's): spinning on the head's bell without sleeping, the sockets and the stages'
        liveness looked at every BELL_CHECK_S, under stall_timeout_s. Its logits row is `result_row` until the next
        step goes down."""
        bells = self._buffers.bells
        t_wait = time.perf_counter()
        deadline = time.monotonic() + self.cfg.stall_timeout_s
        # all stages on GPUs: the head polls without sleeping for a while (as their stages do, DECODE_SPIN_S in
        # workers/stage.py): a token is back within milliseconds and a sleeping head wakes late on every one
        now = time.perf_counter()
        spin_end = now + (HEAD_SPIN_S if self.all_cuda else 0.0)
        checked = now
        while self._got < self._sent:
            if bells is not None:
                if self._take_bell():
                    continue
                now = time.perf_counter()
                if now < spin_end and now - checked < BELL_CHECK_S:
                    continue  # the bell alone; sockets and the stages' liveness every BELL_CHECK_S
                checked = now
                self.procs.receive(0 if now < spin_end else 1)
            else:
                self.procs.receive(0 if time.perf_counter() < spin_end else 200)
            if time.monotonic() > deadline:
                self.procs.stalled()
        self._decode_wait_s += time.perf_counter() - t_wait
        return self._results.pop(k)

    def hold_token(self, pos: int, tok: int) -> None:
        """A lone sequence's step at `pos` is back: every stage's slot 0 holds its token's KV there."""
        self._kept[pos] = tok
        self._kept_n = pos + 1

    @property
    def result_row(self) -> torch.Tensor:
        """The last stage's logits row of the latest result (slot 0's)."""
        return self._result_row

    def lone_result(self, pre: dict, out: list[int], text, finish: str, decode_s: float, steps: int,
                    ttft) -> Result:
        """A lone sequence's Result and report (the loop calls it before the next sequence's phases begin)."""
        return self._result(pre, out, text, finish, decode_s, steps, ttft)

    def _result(self, pre: dict, out: list[int], text, finish: str, decode_s: float, steps: int, ttft) -> Result:
        from strata.head.report import build_report
        ppl = math.exp(pre["nll"] / pre["count"]) if pre["count"] else None
        cache = self.prefix_cache_stats()
        decode = {"decode_tokens": len(out), "decode_steps": steps, "decode_s": decode_s,
                  "decode_head_s": decode_s - self._decode_wait_s if steps else 0.0,
                  "decode_bell_steps": self._bell_results,
                  "decode_tok_s": steps / decode_s if decode_s > 0 and steps else 0.0,
                  "ttft_s": ttft, "finish_reason": finish,
                  # restored_tokens: of reused_tokens, those copied back from snapshots (the rest: the live KV)
                  "prefix_cache": {"restored_tokens": pre["restored"], "blocks": cache.blocks,
                                   "capacity_blocks": cache.capacity_blocks, "block_tokens": self.kv.block,
                                   "off": self.kv.prefix_cache_off}}
        report = build_report(self, pre["seconds"], ppl, out, text, ids=pre["ids"], schedule=pre["schedule"],
                              reused=pre["reused"], perplexity_tokens=pre["count"], decode=decode)
        return Result(report, out, text, ppl, pre["logits"], finish_reason=finish, prompt_tokens=int(pre["ids"].size),
                      reused_tokens=pre["reused"], prefill_s=pre["seconds"], decode_s=decode_s, ttft_s=ttft)

    def progress_bar(self, total: int):
        """The prefill's progress bar (the rig's `progress` on a console) -> (update(tokens through the last stage),
        close), or None."""
        if not (self.cfg.progress and self.console):
            return None
        from tqdm import tqdm
        bar = tqdm(total=total, unit="tok", unit_scale=True, desc="prefill", leave=False, dynamic_ncols=True)
        done = [0]

        def update(tokens: int) -> None:  # and which chunk each stage is on
            if tokens != done[0]:
                bar.update(tokens - done[0])
                done[0] = tokens
            bar.set_postfix_str(" ".join(f"s{s.index}:c{max(s.chunk, 0)}" for s in self.stages), refresh=False)
        return update, bar.close
