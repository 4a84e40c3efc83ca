"""The stage: layers [start, end) of the model on one device, serving chunks; its message loop.

A chunk's path, top to bottom in `Stage.run_chunk`: wait for input -> copy it out of the
hand-off buffer and say "taken" upstream -> compute -> reap the chunk in flight below
(depth 1: wait until the stage below took it) -> copy into the hand-off buffer below and
notify. With depth 0 the stage then waits until the chunk has gone through the whole rest
of the pipeline (the old join) before it takes its next input. A decode step takes the ring
instead (workers/decode_ring.py).

Sockets are touched only from this one thread; the model knows nothing of them. (A remote stage
also has a heartbeat thread with a socket of its own: workers/join.py.) The process around a Stage
(lifelines, logging, the failure report) is workers/bootstrap.py; a stage on another host joins
the head through workers/join.py, started as `python -m workers.join --join tcp://HEAD:PORT --key KEY`.
What a Stage is built from: workers/placement.py (device, cores), workers/load.py (the slice, its
warm-up), workers/buffers.py (ids, hand-off links, bells), workers/sockets.py, workers/faults.py
(the rig's `debug`), workers/residual_dump.py, workers/kv_ops.py (prefix-cache snapshots, KV files).

Across hosts the path is the same: a boundary whose ends are on different hosts is a `TcpLink`
instead of a `ShmLink` (strata/comm/transport.py), the rows travelling with the note.
"""
from __future__ import annotations

import itertools
import logging
import os
import sys
import time
from collections import deque

import torch
import zmq

from workers import memory_trace
from strata.comm import messages as M
from strata.decode.graphs import GraphedDecode

from workers.buffers import StageBuffers
from workers.decode_ring import DecodeRing
from workers.faults import Faults
from workers.kv_ops import StageKv
from workers.load import load_slice, warm_up
from workers.placement import use_device
from workers.residual_dump import ResidualDump
from workers.sockets import StageSockets

# A CUDA stage between decode steps polls its inbox without sleeping for this long (then sleeps in poll as
# always): a token comes back within a few ms, and a core that slept wakes late (a scheduler hop, a cold or
# down-clocked core) on every hop of every token. GPU hosts have cores to spare; CPU stages never spin.
DECODE_SPIN_S = 0.05


class Stage(DecodeRing):
    """One stage process's slice, buffers and sockets; `serve` runs its loop until the head says stop."""

    def __init__(self, spec: M.StageJob, log: logging.Logger, ids: bytes | None = None, clock_offset: float = 0.0):
        """`ids` and `clock_offset`: a remote stage's prompt ids (they came with its spec) and the head's
        perf_counter minus this host's (0 on the same kernel)."""
        self.spec, self.log = spec, log
        self.i = spec.index
        self.n_stages = spec.n_stages
        self.first, self.last = self.i == 0, self.i == self.n_stages - 1
        self.depth = spec.depth
        self.max_seqs = spec.max_seqs  # KV slots; > 1: several sequences' chunks and steps in flight (`slotted`)
        self.ids_stride = spec.max_len + 1  # a slot's ids start at slot x this in the ids segment
        self.device = torch.device(spec.device)
        self.dtype = getattr(torch, spec.dtype)
        self.net = spec.net  # None: every stage of the run is on this host
        self.clock_offset = clock_offset
        self.faults = Faults(spec.debug, self.i, log)
        self.current_chunk = -1
        self.bad_frames = self.bad_frames_logged = 0
        t_load = time.perf_counter()
        use_device(spec, self.device, log)
        trace = bool(spec.debug.get("memory_trace")) and self.device.type == "cuda"
        if trace:
            memory_trace.start()
        self.model, self.weights = load_slice(spec, self.device, self.dtype, log)
        self.kv_bytes = self.model.kv_bytes
        if spec.max_seqs > 1:  # several sequences at once (strata/head/slots.py): a cache each
            self.model.batch_rows = spec.decode_batch == "rows"
            kind = self.model.decode_batch_kind()
            if spec.cuda_graphs and self.device.type == "cuda":
                kind = f"in CUDA graphs where they cover the slice (the decode line below says), else {kind}"
            held = (f"one pool of {spec.kv_pool:,} positions for their global layers ({self.kv_bytes:,} bytes in all)"
                    if spec.kv_pool else f"{self.kv_bytes // spec.max_seqs:,} bytes each")
            log.info("KV slots: %d sequences, %s; decode batches %s", spec.max_seqs, held, kind)
        if self.device.type == "cuda":  # what the planner counted against what is held
            m, held = self.model, torch.cuda.memory_allocated(self.device)
            log.info("GPU memory at load: %s bytes allocated = weights %s + scratch %s + KV %s + other %s", f"{held:,}",
                     f"{m.weight_bytes:,}", f"{m.scratch_bytes:,}", f"{m.kv_bytes:,}",
                     f"{held - m.weight_bytes - m.scratch_bytes - m.kv_bytes:,}")
        if trace:
            for line in memory_trace.summary():
                log.info("memory_trace: %s", line)
        self.args = self.model.args
        # one-token decode steps: replayed from CUDA graphs where the rig asks for them on a GPU
        # (several slots: decode batches, and each one-token step as a batch of one, from strata.decode.batch_graphs)
        self.graphs = GraphedDecode(self.model) if spec.cuda_graphs and self.device.type == "cuda" else None
        self.decoder = self.graphs if self.graphs is not None else self.model  # what decode_token is asked of
        self.warm_s = warm_up(spec, self.model, self.graphs, log)
        self.buffers = b = StageBuffers(spec, self.args, ids)
        self.ids, self.inlink, self.outlink, self.pinned = b.ids, b.inlink, b.outlink, b.pinned
        self.bells, self.bell_words, self.argmax_host = b.bells, b.bell_words, b.argmax_host
        self._init_ring(spec)
        self.dump = None  # opened per prefill (each prompt has its own length): `_open_dump`
        self.kv = StageKv(self.model, self.device, spec.max_len, log,  # prefix-cache snapshots, KV files
                          lambda done: self.send(self.to_head, done), self.i, spec.prefix_device_bytes)
        self.wire = StageSockets(spec, self.inlink, log)
        self.to_head, self.to_up = self.wire.to_head, self.wire.to_up
        self.outlink.sock = self.wire.to_down
        # -- state fed by the handlers
        self.inputs: deque = deque()     # chunk messages waiting to be processed
        self.taken_below: set[int] = set()
        self.done_below: set[int] = set()
        self.inflight: deque = deque()    # chunks handed below and not yet reaped (at most 1)
        self.phase_end: str | None = None
        self.phase_t0: float | None = None  # head's clock at the start of the phase being served
        self.stopping = False
        self.handlers = {M.Chunk: self.on_chunk, M.Taken: self.on_taken, M.Done: self.on_done, M.End: self.on_end,
                         M.Stop: self.on_stop, M.Peers: self.on_peers, M.Token: self.on_token, M.Ids: self.on_ids,
                         M.KvOp: self.on_kv}
        self.load_s = time.perf_counter() - t_load
        self._reset_stats("prefill", time.perf_counter())
        self.faults.at_load()

    # -- the loop: wait for a message or a bell, dispatch it by its type --------------------------
    def serve(self) -> None:
        self.send(self.to_head, M.Ready(stage=self.i, pid=os.getpid(), device=str(self.device),
                         layers=[self.spec.start, self.spec.end], mem_bytes=self._mem_bytes(),
                         kv_bytes=self.kv_bytes, pinned=self.pinned, load_s=self.load_s, weights=self.weights,
                         weight_bytes=self.model.weight_bytes, scratch_bytes=self.model.scratch_bytes,
                         warm_s=self.warm_s, state_bytes=self.model.state_bytes))
        if not self.wire.linked:  # neighbours on other hosts: the head says where they listen once all are ready
            self.wait_until(lambda: self.wire.linked)
        while True:
            t = time.perf_counter()
            if self.kv.waiting:
                self.kv.advance()  # between chunks too: a busy stage would not look otherwise
            self.wait_until(lambda: self.inputs or self.phase_end is not None, self.spin_s)
            if self.inputs:
                front = self.inputs[0]
                if front.t0 != self.phase_t0:  # the first chunk of a new phase
                    self._release_ahead()
                    self.phase_t0 = front.t0
                    self._reset_stats(front.phase, self.phase_t0 - self.clock_offset)
                    if front.phase == "prefill":  # tests (and people) wait on this line, not on a sleep
                        self.log.info("prefill: started (chunk %d)", front.k)
                        self._open_dump(front.tokens)
                if self.nchunks:  # before the first chunk a stage waits for the pipeline to fill
                    self.input_wait_s += time.perf_counter() - t
                else:
                    self.input_wait_s += time.perf_counter() - max(t, self.t0)
                self.run_chunk(self.inputs.popleft())
            else:
                self._release_ahead()
                if self.dump is not None:
                    self.dump.wait()  # the head hashes the file once every stage has reported
                self.report_stats()
                self.phase_end = None

    @property
    def spin_s(self) -> float:
        """How long a CUDA stage polls without sleeping for its next input: a decode step's (DECODE_SPIN_S), and
        with several sequences (whose busy period is one "prefill" phase) any micro-batch's when kernels.slot_spin
        asks for it, as the head's driver then polls."""
        spin = self.phase == "decode" or (self.max_seqs > 1 and self.spec.kernels.get("slot_spin", False))
        return DECODE_SPIN_S if spin and self.device.type == "cuda" else 0.0

    def wait_until(self, cond, spin_s: float = 0.0) -> float:
        """Block (dispatching messages) until cond() holds; returns seconds waited. spin_s: poll without
        sleeping for that long first (see DECODE_SPIN_S)."""
        t = time.perf_counter()
        spin_end = t + spin_s
        while not cond():
            if self.stopping:
                raise SystemExit(0)
            if self.bells is not None and self._take_bell():
                continue
            if spin_s and time.perf_counter() < spin_end:
                self.pump(0)
                continue
            # with bells, a decode step can arrive without a frame: look again within a millisecond; a KV op
            # waiting for its files: within a few
            timeout = 1 if self.bells is not None and self.phase == "decode" else 5 if self.kv.waiting else 100
            if not self.pump(timeout) and self.bad_frames != self.bad_frames_logged:
                # idle after garbage: one line with the running count (a flood is not one line per frame)
                self.bad_frames_logged = self.bad_frames
                self.log.info("inbox idle: %d frame(s) rejected so far", self.bad_frames)
        return time.perf_counter() - t

    def pump(self, timeout_ms: int) -> bool:
        """Receive and dispatch whatever arrives within timeout_ms (False: nothing did). Garbage is
        counted and dropped."""
        if self.kv.waiting:
            self.kv.advance()  # a restore whose files were being read: done now?
        if not self.wire.poller.poll(timeout_ms):
            return False
        gate = self.wire.gate
        for sock in self.wire.inboxes:
            self._drain(sock)
        if gate is not None and gate.drain():  # refused handshakes on the tcp inbox
            self.send(self.to_head, M.Rejected(stage=self.i, count=gate.count, detail=gate.last[:500]))
        return True

    def _drain(self, sock) -> None:
        across = sock is self.wire.tcp_inbox  # a note may come with its rows: one multipart message
        while True:
            try:
                if across:
                    parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                else:
                    frame = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                if across:
                    if len(parts) > 2:
                        raise M.BadMessage(f"a message of {len(parts)} frames")
                    self._dispatch(M.decode(parts[0].bytes), parts[1] if len(parts) == 2 else None)
                else:
                    self._dispatch(M.decode(frame))
            except M.BadMessage as e:
                self.bad_frames += 1
                if self.bad_frames <= 10 or self.bad_frames % 1000 == 0:
                    self.log.warning("rejected frame #%d: %s", self.bad_frames, e)

    def send(self, sock, msg: M.Message) -> None:
        sock.send(M.encode(msg))

    def _dispatch(self, msg: M.Message, data=None) -> None:
        """One message (and, across hosts, the rows that came with a chunk note), by its type's handler."""
        handler = self.handlers.get(type(msg))
        if handler is None:
            raise M.BadMessage(f"{msg.TYPE}: not a message a stage accepts")
        if data is not None and not isinstance(msg, M.Chunk):
            raise M.BadMessage(f"{msg.TYPE}: unexpected data frame")
        handler(msg, data)

    # -- handlers ---------------------------------------------------------------------------------
    def on_chunk(self, msg: M.Chunk, data) -> None:
        pos, n = msg.pos, msg.n  # k >= 0 and a known phase: checked by M.decode
        if not (0 <= pos and 1 <= n <= self.spec.max_chunk and pos + n <= self.spec.max_len
                and msg.tokens <= self.spec.max_len):
            raise M.BadMessage(f"chunk: rows [{pos}, {pos + n}) of a {msg.tokens}-token prompt do not fit the buffers")
        if msg.slot >= self.max_seqs:
            raise M.BadMessage(f"chunk: slot {msg.slot} of {self.max_seqs}")
        if msg.kind == M.Kind.GROUP:
            self._check_group(msg)
        elif msg.kind == M.Kind.BATCH and not (n <= self.max_seqs
                                               and all(s < self.max_seqs for s in msg.seqs[0::2])
                                               and all(p < self.spec.max_len for p in msg.seqs[1::2])):
            raise M.BadMessage(f"chunk: a decode batch outside the {self.max_seqs} slots of {self.spec.max_len} "
                               "positions")
        elif msg.kind == M.Kind.BATCH and self.model.pool and any(p + msg.ahead >= self.model.slot_positions(sl)
                                                  for sl, p in zip(msg.seqs[0::2], msg.seqs[1::2])):
            raise M.BadMessage("chunk: a decode batch's row outside its slot's extent of the KV pool")
        elif msg.kind != M.Kind.BATCH:
            self.place(msg.slot, msg.span, "chunk")
        if self.inlink is not None and self.inlink.crosses_hosts:  # the rows came with the note
            if data is None:
                raise M.BadMessage("chunk: no rows with the note (across hosts they travel together)")
            self.inlink.land(n, data)
        elif data is not None:
            raise M.BadMessage("chunk: unexpected data frame")
        self.inputs.append(msg)

    def _check_group(self, msg: M.Chunk) -> None:
        """A prefill group's sequences: each in a slot of this stage, its rows inside its slot's positions (its
        extent of the KV pool, placed here as a chunk's span is), and a model whose layers can take a group."""
        why = self.args.group_refusal() if self.max_seqs > 1 else "one KV slot"
        if why is not None:
            raise M.BadMessage(f"chunk: a prefill group on this stage: {why}")
        segs = list(zip(msg.seqs[0::2], msg.seqs[1::2], msg.lens))
        if any(s >= self.max_seqs or p + m > self.spec.max_len for s, p, m in segs):
            raise M.BadMessage(f"chunk: a prefill group outside the {self.max_seqs} slots of {self.spec.max_len} "
                               "positions")
        spans = [msg.span[2 * t:2 * t + 2] for t in range(len(segs))]
        for (s, p, m), span in zip(segs, spans):  # every one checked before any slot moves
            held = span[1] if span else self.model.slot_positions(s)
            if p + m > held or (span and span[0] + span[1] > self.model.pool):
                raise M.BadMessage("chunk: a prefill group's rows outside their slot's extent of the KV pool")
        for (s, _, _), span in zip(segs, spans):
            self.place(s, span, "chunk")

    def on_taken(self, msg: M.Taken, data) -> None:
        self.taken_below.add(msg.k)

    def on_done(self, msg: M.Done, data) -> None:
        self.done_below.add(msg.k)

    def on_end(self, msg: M.End, data) -> None:
        self.phase_end = msg.phase

    def on_stop(self, msg: M.Stop, data) -> None:
        self.stopping = True

    def on_token(self, msg: M.Token, data) -> None:
        """Decode on a remote stage 0: the head's next token (the ids segment is not shared across hosts)."""
        if not (self.first and self.net is not None and self.net.remote):
            raise M.BadMessage("token: not a message a stage accepts")
        if not (0 <= msg.pos < self.spec.max_len and 0 <= msg.id < self.args.vocab_size):
            raise M.BadMessage(f"token: {msg.id} at {msg.pos} out of range")
        self.ids[msg.pos] = msg.id

    def on_ids(self, msg: M.Ids, data) -> None:
        """A new prompt on a remote stage 0: its ids from `pos` on (a local stage reads the shared ids segment)."""
        if not (self.first and self.net is not None and self.net.remote):
            raise M.BadMessage("ids: not a message a stage accepts")
        ids = msg.ids
        if not (0 <= msg.pos and msg.pos + len(ids) <= self.spec.max_len
                and all(type(t) is int and 0 <= t < self.args.vocab_size for t in ids)):
            raise M.BadMessage(f"ids: {len(ids)} ids at {msg.pos} out of range")
        self.ids[msg.pos:msg.pos + len(ids)] = torch.tensor(ids, dtype=torch.int32)

    def on_kv(self, msg: M.KvOp, data) -> None:
        """A prefix-cache or KV-file operation: between prompts, or (max_seqs > 1) on a slot with nothing in flight
        while other slots' chunks may be; answered in order, a restore of blocks on disk alone once a thread has
        read their files (workers/kv_ops.py)."""
        self.place(msg.slot, msg.span, "kv")
        self.kv.submit(msg)

    def place(self, slot: int, span: list, what: str) -> None:
        """A slot's extent of the KV pool (kv_pool), as the head's allocator gave it to the slot's new sequence: it
        comes with the sequence's first message on whichever path (a restore or load from the head, its first
        chunk from upstream), and the same with each later one. Nothing else is in flight on that slot then."""
        if not span:
            return
        if not self.model.pool or slot >= self.max_seqs or span[0] + span[1] > self.model.pool:
            raise M.BadMessage(f"{what}: slot {slot} at {span} outside the KV pool ({self.model.pool} positions)")
        self.model.place_slot(slot, *span)

    def on_peers(self, msg: M.Peers, data) -> None:
        """The head says where this stage's neighbours across hosts listen: connect to them."""
        if self.wire.linked:
            raise M.BadMessage("peers: not a message a stage accepts")
        self.wire.link(msg)

    # -- the chunk path ---------------------------------------------------------------------------
    def run_chunk(self, msg: M.Chunk) -> None:
        self.kv.before_write()  # a snapshot's copies out of the live cache go first (CUDA: on the device)
        if msg.kind == M.Kind.GROUP:
            return self.run_group(msg)
        if msg.kind == M.Kind.BATCH:
            return self.decode_batch(msg)
        self.model.set_prompt_length(msg.tokens)  # (dynamic NTK rope's length: the prompt's, or a decode step's p + 1)
        self.model.use_slot(msg.slot)  # the sequence's own KV (max_seqs > 1)
        if msg.kind == M.Kind.STEP:
            return self.decode_step(msg)
        k, pos, n = msg.k, msg.pos, msg.n
        self.current_chunk = k
        self.send(self.to_head, M.Working(stage=self.i, k=k))

        # 1. input: ids for the first stage, else residual rows from the buffer above
        copy_start = time.perf_counter()
        ids = self.slot_ids(msg.slot)
        if self.first:
            x = ids[pos:pos + n].to(self.device, dtype=torch.long).view(1, n)
        else:
            x = self._rows_from_above(k, n).view(1, n, self.args.dim)
        self.copy_s += time.perf_counter() - copy_start

        # 2. compute
        work_start = time.perf_counter()
        self.faults.at_chunk(k, msg.phase)
        h = self.model(x, pos, decode=False)  # a prefill chunk never takes the decode path
        nll, count, argmax, scores = 0.0, 0, -1, b""
        if self.last:
            if msg.phase == "prefill" and (self.spec.perplexity or msg.score >= 0):
                targets = ids[pos + 1: min(pos + n + 1, msg.tokens)].to(torch.long)
                if self.spec.perplexity and targets.numel():
                    nll, count = self.model.nll(h, targets)
                if msg.score >= 0:
                    scores = self.model.score(h, targets, msg.score)
            logits = self.model.logits(h[0, -1])
            argmax = int(logits.argmax())
            if self.dump is not None:
                self.dump.write(pos, h[0])
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # not the dump's copy (its own stream)
        if msg.keep:  # the prefix cache: the linear and window layers' states where this chunk leaves them
            try:
                self.kv.snapshots.keep_state(msg.keep, msg.slot, pos + n)
            except RuntimeError as e:  # (no host memory left): a later restore of it fails into a prefill
                self.log.warning("prefix cache: the states after chunk %d not kept (%s)", msg.k, str(e).splitlines()[0])
        work_end = time.perf_counter()
        self.work_s += work_end - work_start

        # 3. reap: the chunk in flight below must have left the buffer before we overwrite it
        self._reap()

        # 4. hand off
        copy_start = time.perf_counter()
        if self.last:
            self.outlink.put(logits, M.ChunkResult(k=k, nll=float(nll), count=count, argmax=argmax, scores=scores))
        else:
            self.outlink.put(h.view(n, self.args.dim), M.Chunk(k=k, kind=msg.kind, pos=pos, n=n, t0=msg.t0,
                                                               tokens=msg.tokens, score=msg.score, slot=msg.slot,
                                                               keep=msg.keep, span=msg.span))
        self.copy_s += time.perf_counter() - copy_start
        self._handed_off(k, work_start, work_end)

    def run_group(self, msg: M.Chunk) -> None:
        """A prefill group (strata/head/slots.py): several sequences' chunks as one micro-batch, each in its own slot
        (Transformer.forward_group), down the chunk path's steps. The last stage's result is each sequence's last
        row: its argmax in the note and, with msg.rows, its logits in row t of the result buffer, each computed as
        its chunk alone's last row is."""
        k, n = msg.k, msg.n
        segs = list(zip(msg.seqs[0::2], msg.seqs[1::2], msg.lens))
        self.current_chunk = k
        self.send(self.to_head, M.Working(stage=self.i, k=k))
        cuda = self.device.type == "cuda"

        copy_start = time.perf_counter()
        if self.first:
            x = torch.cat([self.slot_ids(s)[p:p + m] for s, p, m in segs]).to(self.device, dtype=torch.long)
            x = x.view(1, n)
        else:
            x = self._rows_from_above(k, n).view(1, n, self.args.dim)
        self.copy_s += time.perf_counter() - copy_start

        work_start = time.perf_counter()
        self.faults.at_chunk(k, msg.phase)
        h = self.model.forward_group(x, segs)
        if self.last:
            ends = [e - 1 for e in itertools.accumulate(msg.lens)]
            logits = torch.stack([self.model.logits(h[0, e]) for e in ends])
            argmaxes = [int(a) for a in logits.argmax(-1).tolist()]
        if cuda:
            torch.cuda.current_stream(self.device).synchronize()
        work_end = time.perf_counter()
        self.work_s += work_end - work_start

        self._reap()
        copy_start = time.perf_counter()
        if self.last:
            if msg.rows:
                self.outlink.fill(logits.reshape(-1))
            self.outlink.send(M.ChunkResult(k=k, nll=0.0, count=0, argmax=-1, scores=b"", argmaxes=argmaxes))
        else:
            self.outlink.put(h.view(n, self.args.dim), M.Chunk(
                k=k, kind=msg.kind, pos=msg.pos, n=n, t0=msg.t0, tokens=msg.tokens, score=-1, seqs=msg.seqs,
                rows=msg.rows, span=msg.span, lens=msg.lens))
        self.copy_s += time.perf_counter() - copy_start
        self._handed_off(k, work_start, work_end)

    def _rows_from_above(self, k: int, n: int) -> torch.Tensor:
        """Micro-batch k's n residual rows, copied out of the buffer above (CUDA: the copy waited for), then
        "taken" upstream: the stage above may write the buffer again."""
        x = self.inlink.get(n).to(self.device, copy=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the copy has left the buffer
        self.send(self.to_up, M.Taken(k=k))
        return x

    def _handed_off(self, k: int, work_start: float, work_end: float) -> None:
        """Chunk k is in the buffer below: in flight there until reaped (depth 0: joined now), and timed."""
        self.inflight.append(k)
        self._join(k)
        self.last_handoff = time.perf_counter()
        self.events.append([k, work_start, work_end, self.last_handoff])
        self.nchunks += 1

    def slot_ids(self, slot: int) -> torch.Tensor:
        """The ids of the sequence in `slot` (the whole segment's first max_len + 1 with one slot)."""
        return self.ids[slot * self.ids_stride:(slot + 1) * self.ids_stride]

    def _reap(self) -> None:
        """Depth 1: the chunk in flight below must have left the output buffer before we overwrite it."""
        if self.depth == 1:
            while self.inflight:
                below = self.inflight[0]
                self.handoff_wait_s += self.wait_until(lambda: below in self.taken_below)
                self.taken_below.discard(below)
                self.inflight.popleft()

    def _join(self, k: int) -> None:
        """Depth 0: the old join; nothing new until chunk k is through the rest of the pipeline."""
        if self.depth == 0:
            done = self.taken_below if self.last else self.done_below  # the head's "taken" is its done
            self.handoff_wait_s += self.wait_until(lambda: k in done)
            done.discard(k)
            self.taken_below.discard(k)
            self.inflight.popleft()
            if not self.first:
                self.send(self.to_up, M.Done(k=k))

    # -- timing -----------------------------------------------------------------------------------
    def _reset_stats(self, phase: str, t0: float) -> None:
        self.phase, self.t0 = phase, t0
        self.work_s = self.handoff_wait_s = self.input_wait_s = self.copy_s = 0.0
        self.events: list[list] = []  # [k, work_start, work_end, handoff_done]
        self.last_handoff = t0
        self.nchunks = 0
        if self.device.type == "cuda":  # the phase's peak (Stats.peak_bytes), against the plan's need and the cap
            torch.cuda.reset_peak_memory_stats(self.device)

    def report_stats(self) -> None:
        self.send(self.to_head, M.Stats(stage=self.i, phase=self.phase,
                         wall_s=max(0.0, self.last_handoff - self.t0), work_s=self.work_s,
                         handoff_wait_s=self.handoff_wait_s, input_wait_s=self.input_wait_s, copy_s=self.copy_s,
                         events=[[k, a + self.clock_offset, b + self.clock_offset, c + self.clock_offset]
                                 for k, a, b, c in self.events] if self.clock_offset else self.events,
                         chunks=self.nchunks, bad_frames=self.bad_frames,
                         peak_bytes=int(torch.cuda.max_memory_allocated(self.device))
                         if self.device.type == "cuda" else 0))

    # -- the dump, memory, teardown ---------------------------------------------------------------
    def _open_dump(self, tokens: int) -> None:
        """residual.npy for this prefill's prompt (the head prefills from 0 when it is asked for)."""
        if self.last and self.spec.dump_residual:
            if self.dump is not None:
                self.dump.wait()
                self.dump = None  # its map goes before the file is made again
            self.dump = ResidualDump(self.spec.dump_residual, tokens, self.args.dim, self.spec.max_chunk, self.device)

    def _mem_bytes(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.memory_allocated(self.device))
        return self.model.weight_bytes + self.model.scratch_bytes + self.kv_bytes

    def close(self, linger_ms: int = 0) -> None:
        """Close the sockets (outgoing ones keep `linger_ms` to deliver what is queued) and unmap."""
        if getattr(self, "ahead", None) is not None:  # a stream parked on the bell: let it drain first
            try:
                self._release_ahead()
            except Exception:  # noqa: BLE001 - closing after a failure: the process goes anyway
                pass
        if getattr(self, "kv", None) is not None:
            self.kv.close()  # the prefix cache's queued disk writes end before the process does
        self.wire.close(linger_ms)
        self.buffers.close()


if __name__ == "__main__":  # the remote entry point was here: an old remote_command fails loudly, not silently
    sys.exit("error: a stage on another host starts with: python -m workers.join --join tcp://HEAD:PORT --key KEY")
