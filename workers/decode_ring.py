"""A stage's decode steps round the ring (head -> stage 0 -> ... -> last -> head), their bells, launch-ahead.

`DecodeRing` is mixed into `Stage` (workers/stage.py): a step reads the stage's links, model and stats as a
prefill chunk does, so these are its methods, kept apart from the prefill chunk's path.
"""
from __future__ import annotations

import time

import torch

from strata.comm import bells as bells_mod
from strata.comm import messages as M

from workers.faults import StageFailed


class DecodeRing:
    bells = None     # strata.comm.bells.Bells when the run has decode doorbells (set from the stage's buffers)
    bell_key = None  # (k, t0) of the decode step that came by bell: its note goes on by bell too
    ahead = None     # (k, pos) of the decode step queued behind a GPU wait on this stage's bell
    ahead_seq = None  # the device address of this stage's bell seq word, when it queues steps ahead

    def _init_ring(self, spec: M.StageJob) -> None:
        """Launch-ahead when the rig asks for it and this slice can: bells, page-locked buffers, captured graphs,
        and a GPU that waits on a word of host memory (the stage log says which)."""
        self.bell_key = self.ahead = self.ahead_seq = None
        graphs = self.graphs and self.graphs.graphs  # captured by the warm-up on a slice whose steps replay graphs
        if spec.decode_ahead and self.bells is not None and self.pinned and graphs is not None and graphs.graphs:
            from strata.comm import stream_wait
            word = self.bell_words[self.i, bells_mod.SEQ]
            why = (stream_wait.works(word, self.device) if graphs.queues_ahead
                   else "linear-attention layers: a released step would move their states")
            if why is None:
                self.ahead_seq = stream_wait.device_address(word)
            self.log.info("decode launch-ahead: %s", "on" if why is None else f"off ({why})")

    def _take_bell(self) -> bool:
        """A decode step announced on this stage's bell, queued as its note would be (and checked as one)."""
        note = self.bells.take(self.i)
        if note is None:
            return False
        k, pos, _, t0 = note
        try:
            self.on_chunk(M.Chunk(k=k, kind=M.Kind.STEP, pos=pos, n=1, t0=t0, tokens=pos + 1, score=-1), None)
            self.bell_key = (k, t0)
        except M.BadMessage as e:
            self.bad_frames += 1
            self.log.warning("rejected decode bell: %s", e)
        return True

    def decode_step(self, msg: M.Chunk) -> None:
        """One decode step: the chunk path less what only a pipeline full of chunks needs, since a decode
        step is the only chunk in flight and every stage waits on the one above.

        - No "taken" or "done" notes, no chunk in flight to reap later: steps go round a ring (head -> stage
          0 -> ... -> last -> head) one token at a time, so the stage above writes its buffer again only after
          this step's result reached the head, long after this stage read it. Per token one note per hop.
          With max_seqs > 1 other sequences' steps follow this one through the same buffers: then the step says
          "taken" upstream and is reaped before the next hand-off, as a prefill chunk is.
        - On CUDA one synchronize covers the queued copy in from the page-locked buffer, layers, head, argmax and
          the queued copy of the output (residual row, or logits row plus argmax) into page-locked memory; before
          it the notes (or bells) say nothing.
        - No "working" note, no per-step event (decode reports its sums only: a long answer must not grow
          the stats note), no residual dump, no nll."""
        k, pos, n = msg.k, msg.pos, msg.n
        self.current_chunk = k
        cuda = self.device.type == "cuda"
        if self.ahead is not None:
            if self.ahead != (k, pos) or self.bell_key != (k, msg.t0):
                # a bell always announces the step queued for it: anything else is a protocol bug, and the queued
                # step already ran on what the bell row held
                raise StageFailed(f"decode step {k} at {pos} arrived where step {self.ahead} was queued ahead")
            self.ahead = None
            work_start = time.perf_counter()
            self.faults.at_chunk(k, self.phase)
            # the GPU started it when the bell rang (its argmax, on the last stage, lands in argmax_host): wait for
            # it, ring on, queue the next
            return self._decode_done(msg, self.argmax_host if self.last else None, work_start)
        t_in = time.perf_counter()
        slotted = self.max_seqs > 1  # other sequences' steps in flight: the buffers' "taken" notes, as a chunk's
        if self.first:
            x = self.slot_ids(msg.slot)[pos:pos + n].to(self.device, dtype=torch.long).view(1, n)
        else:
            x = self.inlink.get(n).to(self.device, copy=True, non_blocking=cuda and self.pinned and not slotted)
            x = x.view(1, n, self.args.dim)
            if slotted:
                self.send(self.to_up, M.Taken(k=k))
        work_start = time.perf_counter()
        self.copy_s += work_start - t_in
        self.faults.at_chunk(k, msg.phase)
        if n == 1:  # with cuda_graphs: layers, head and argmax in one replay
            h, logits, am = self.decoder.decode_token(x, pos, fresh=False)  # copied out below, before the next step
        else:
            h = self.model(x, pos, decode=True)
            logits = self.model.logits(h[0, -1], decode=True) if self.last else None
            am = logits.argmax() if self.last else None
        if self.last:
            out = logits
        else:
            out = h.view(n, self.args.dim)
        self._reap()  # one sequence: only the prefill's last chunk can still be in flight below
        self._copy_out(out, am)
        self._decode_done(msg, self.argmax_host if self.last and cuda else am, work_start)
        if slotted:  # reaped before the next hand-off, as a prefill chunk is
            self.inflight.append(k)

    def decode_batch(self, msg: M.Chunk) -> None:
        """Several sequences' decode steps as one micro-batch (max_seqs > 1, strata/head/slots.py): row t is the token
        of the sequence in slot seqs[2t] at position seqs[2t + 1], read from and written to that slot's KV
        (Transformer.decode_seqs: each row the bits of its step alone). Like a slotted step it says "taken"
        upstream once its rows have left the buffer, and is reaped before the next hand-off. The last stage puts
        row t's logits in row t of the result buffer (where the head reads them: msg.rows) and every row's argmax in
        its note. msg.ahead (one stage): that many more steps follow on the batch's own argmaxes, each at the next
        positions, queued on the device with no host wait between them; the note carries every step's argmaxes."""
        k, m = msg.k, msg.n
        slots, positions = msg.seqs[0::2], msg.seqs[1::2]
        self.current_chunk = k
        cuda = self.device.type == "cuda"
        t_in = time.perf_counter()
        if self.first:
            at = torch.tensor([s * self.ids_stride + p for s, p in zip(slots, positions)])  # one gather, not m
            x = self.ids[at].to(self.device, dtype=torch.long)
        else:
            x = self._rows_from_above(k, m).view(m, self.args.dim)
        work_start = time.perf_counter()
        self.copy_s += work_start - t_in
        self.faults.at_chunk(k, msg.phase)
        if msg.ahead and not (self.first and self.last):
            raise StageFailed(f"decode batch {k}: ahead {msg.ahead} on a stage of several (the head sends it to one)")
        h, logits, am = self.decoder.decode_seqs(x, slots, positions)
        ams = [am]
        for j in range(1, msg.ahead + 1):  # the next steps on this one's argmaxes, queued with no wait for the head
            h, logits, am = self.decoder.decode_seqs(am.view(m).to(torch.long), slots, [p + j for p in positions])
            ams.append(am)
        self._reap()
        if not self.last:
            self.outlink.fill(h)
        elif msg.rows:  # (a greedy batch's rows are not read: only its argmaxes. Batches never cross hosts:
            self.outlink.fill(logits.reshape(-1))  # max_seqs > 1 refuses a remote stage)
        if cuda:
            torch.cuda.current_stream(self.device).synchronize()
        work_end = time.perf_counter()
        self.work_s += work_end - work_start
        if self.last:
            self.outlink.send(M.ChunkResult(k=k, nll=0.0, count=0, argmax=-1, scores=b"",
                                            argmaxes=[int(a) for a in torch.cat([a.view(m) for a in ams]).tolist()]))
        else:
            self.outlink.send(M.Chunk(k=k, kind=msg.kind, pos=msg.pos, n=m, t0=msg.t0, tokens=msg.tokens,
                                      score=-1, seqs=msg.seqs, rows=msg.rows))
        self.copy_s += time.perf_counter() - work_end
        self.last_handoff = time.perf_counter()
        self.inflight.append(k)
        self.nchunks += 1

    def _copy_out(self, out, am) -> None:
        """Queue the step's output into the hand-off buffer below (and the argmax into page-locked memory)."""
        cuda = self.device.type == "cuda"
        self.outlink.fill(out, non_blocking=cuda and self.pinned)
        if self.last and cuda:
            self.argmax_host.copy_(am, non_blocking=self.pinned)

    def _decode_done(self, msg: M.Chunk, am, work_start: float) -> None:
        """A decode step's end: wait for its queued work, pass the note on (by bell when it came by one), and
        with launch-ahead queue the next step behind a wait on this stage's bell."""
        k, pos, n = msg.k, msg.pos, msg.n
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        work_end = time.perf_counter()
        self.work_s += work_end - work_start
        if self.bell_key == (k, msg.t0):  # it came by bell: the next hop's bell (its rows are in the buffer)
            self.bells.ring(self.i + 1, k, pos, argmax=int(am) if self.last else -1, t0=msg.t0)
        elif self.last:
            self.outlink.send(M.ChunkResult(k=k, nll=0.0, count=0, argmax=int(am), scores=b""))
        else:
            self.outlink.send(M.Chunk(k=k, kind=msg.kind, pos=pos, n=n, t0=msg.t0, tokens=msg.tokens, score=-1,
                                      slot=msg.slot))
        self.copy_s += time.perf_counter() - work_end
        self.last_handoff = time.perf_counter()
        self.nchunks += 1
        if self.ahead_seq is not None and n == 1:
            self._queue_ahead(k + 1, pos + 1)

    def _queue_ahead(self, k: int, pos: int) -> None:
        """Queue decode step k at pos behind a GPU-side wait on this stage's bell (strata/comm/stream_wait.py): when
        the hop above rings, the GPU copies the position and the token or residual row in from the page-locked
        bell and buffer and replays the step, and copies the output out, with no host step between the ring and
        the kernels. The host sees the same bell, checks it announces (k, pos), waits for the step and rings on.
        A step that does not come (the phase ends) is released by `_release_ahead`."""
        graphs = self.graphs.decode_graphs()
        if pos >= min(self.spec.max_len, graphs.cache_len) or not graphs.captured(pos):
            return
        from strata.comm import stream_wait
        stream = torch.cuda.current_stream(self.device)
        stream_wait.wait_geq(stream, self.ahead_seq, self.bells.seen + 1)
        row = self.bell_words[self.i]
        h, logits, am = graphs.replay_queued(
            pos, row[bells_mod.POS], token_src=row[bells_mod.ARGMAX] if self.first else None,
            row_src=None if self.first else self.inlink.buf[0])
        out = logits if self.last else h.view(1, self.args.dim)
        self._copy_out(out, am)
        self.ahead = (k, pos)

    def _release_ahead(self) -> None:
        """Let a step queued ahead that will not come run and finish (the phase ended, or a new one starts):
        it computes token 0 at its own position, the first one past the kept KV, and its output is dropped."""
        if self.ahead is None:
            return
        _, pos = self.ahead
        self.ahead = None
        self.bells.release(self.i, pos)
        torch.cuda.current_stream(self.device).synchronize()
