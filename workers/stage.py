"""The stage: layers [start, end) of the model on one device, serving chunks.

A chunk's path, top to bottom in `Stage.run_chunk`: wait for input -> copy it out of the
hand-off buffer and say "taken" upstream -> compute -> reap the chunk in flight below
(depth 1: wait until the stage below took it) -> copy into the hand-off buffer below and
notify. With depth 0 the stage then waits until the chunk has gone through the whole rest
of the pipeline (the old join) before it takes its next input.

Sockets are touched only here, in one thread; the model knows nothing of them. (A remote stage
also has a heartbeat thread with a socket of its own: strata/net.py.) The process around a Stage
(lifelines, logging, the failure report) is workers/bootstrap.py; a stage on another host joins
the head through workers/join.py, started as `python -m workers.join --join tcp://HEAD:PORT --key KEY`.

Across hosts the path is the same: a boundary whose ends are on different hosts is a `TcpLink`
instead of a `ShmLink` (strata/transport.py), the rows travelling with the note.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections import deque

import numpy as np
import torch
import zmq

import strata.attention
from strata import messages as M
from strata import net as N
from strata.args import ModelArgs
from strata.decode_graphs import GraphedDecode
from strata.model import Transformer
from strata import bells as bells_mod
from strata.bells import Bells
from strata.schedule import chunk_schedule
from strata.shm import Segment
from strata.transport import ShmLink, TcpLink
from strata.checkpoint import load_stage, weights_mode
from strata.config import kernel_spec

# A CUDA stage between decode steps polls its inbox without sleeping for this long (then sleeps in poll as
# always): a token comes back within a few ms, and a core that slept wakes late (a scheduler hop, a cold or
# down-clocked core) on every hop of every token. GPU hosts have cores to spare; CPU stages never spin.
DECODE_SPIN_S = 0.05


class StageFailed(RuntimeError):
    pass


class ResidualDump:
    """Residual rows after the last layer -> residual.npy (float32, exact for every dtype), off the chunk's path:
    on CUDA the rows are widened on the device and copied to a page-locked staging buffer on a stream of their
    own, and a thread waits for that copy and writes the file, while the next chunk computes."""

    def __init__(self, path: str, tokens: int, dim: int, max_chunk: int, device):
        self.file = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(tokens, dim))
        cuda = device.type == "cuda"
        self.staging = torch.empty((max_chunk, dim), dtype=torch.float32, pin_memory=cuda)
        self.stream = torch.cuda.Stream(device) if cuda else None
        self.writer: threading.Thread | None = None
        self.rows = None  # the widened rows of a copy in flight (held until it is done)

    def write(self, pos: int, h) -> None:
        self.wait()  # the staging buffer is free again
        n = h.shape[0]
        rows = self.staging[:n]
        if self.stream is None:
            rows.copy_(h)
            done = None
        else:
            # widen on the device (a widening copy runs on one CPU core: ~0.1 s for 10,240 x 4,096), after the
            # chunk's kernels, then the copy out on the dump's own stream: the stage syncs only its own stream
            self.rows = h.float()
            self.stream.wait_stream(torch.cuda.current_stream(h.device))
            with torch.cuda.stream(self.stream):
                rows.copy_(self.rows, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self.stream)
        self.writer = threading.Thread(target=self._write, args=(pos, rows.numpy(), done), daemon=True)
        self.writer.start()

    def _write(self, pos: int, rows: np.ndarray, done) -> None:
        if done is not None:
            done.synchronize()
        self.file[pos:pos + rows.shape[0]] = rows

    def wait(self) -> None:
        # no flush (msync) per chunk: it wrote each chunk's rows to disk inside the timed chunk (~0.15 s for
        # 10,240 x 4,096 on the GPU machine); the head reads the file through the same page cache
        if self.writer is not None:
            self.writer.join()
            self.writer = None
            self.rows = None


class Stage:
    bells: Bells | None = None  # set by _map_buffers when the run has decode doorbells
    bell_key: tuple | None = None

    def __init__(self, spec: M.StageJob, log: logging.Logger, ids: bytes | None = None, clock_offset: float = 0.0):
        """`ids` and `clock_offset`: a remote stage's prompt ids (they came with its spec) and the head's
        perf_counter minus this host's (0 on the same kernel)."""
        self.spec, self.log = spec, log
        self.i = spec.index
        self.n_stages = spec.n_stages
        self.first, self.last = self.i == 0, self.i == self.n_stages - 1
        self.depth = spec.depth
        self.device = torch.device(spec.device)
        self.dtype = getattr(torch, spec.dtype)
        self.net = spec.net  # None: every stage of the run is on this host
        self.clock_offset = clock_offset
        self.debug = spec.debug
        self.current_chunk = -1
        self.bad_frames = self.bad_frames_logged = 0
        t_load = time.perf_counter()
        self._use_device(spec)
        self.model, self.kv_bytes = self._load_model(spec)
        self.args = self.model.args
        # one-token decode steps: replayed from CUDA graphs where the rig asks for them on a GPU
        self.graphs = GraphedDecode(self.model) if spec.cuda_graphs and self.device.type == "cuda" else None
        self.decoder = self.graphs if self.graphs is not None else self.model  # what decode_token is asked of
        self.warm_s = self._warm_up(spec)
        self._map_buffers(spec, ids)
        self._open_sockets(spec)
        # -- state fed by the handlers
        self.inputs: deque = deque()     # chunk messages waiting to be processed
        self.taken_below: set[int] = set()
        self.done_below: set[int] = set()
        self.inflight: deque = deque()    # chunks handed below and not yet reaped (at most 1)
        self.phase_end: str | None = None
        self.phase_t0: float | None = None  # head's clock at the start of the phase being served
        self.stopping = False
        self.handlers = {M.Chunk: self.on_chunk, M.Taken: self.on_taken, M.Done: self.on_done, M.End: self.on_end,
                         M.Stop: self.on_stop, M.Peers: self.on_peers, M.Token: self.on_token, M.Ids: self.on_ids}
        self.load_s = time.perf_counter() - t_load
        self._reset_stats("prefill", time.perf_counter())
        if self.debug["fail_stage"] == self.i and self.debug["fail_phase"] == "load":
            self._injected_failure("while loading")

    def _use_device(self, spec: M.StageJob) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            if spec.cores:
                os.sched_setaffinity(0, spec.cores)
            else:
                self._near_gpu()
            if spec.memory:  # the plan's cap, enforced: an over-tight plan fails here, not on a bigger card's spare
                total = torch.cuda.get_device_properties(self.device).total_memory
                torch.cuda.set_per_process_memory_fraction(min(1.0, spec.memory / total), self.device)
        else:
            if spec.threads:
                torch.set_num_threads(spec.threads)
            if spec.cores:
                os.sched_setaffinity(0, spec.cores)

    def _near_gpu(self) -> None:
        """Run on the CPU cores of the GPU's own NUMA node (sysfs `local_cpulist`), kept within this process's
        allowed cores. An unpinned CUDA stage's thread may sleep between decode steps and wake on the far
        socket, where every kernel launch (a decode step is hundreds) crosses the socket link. Nothing known:
        nothing changes."""
        props = torch.cuda.get_device_properties(self.device)
        bus = getattr(props, "pci_bus_id", None)
        if bus is None:
            return
        path = (f"/sys/bus/pci/devices/{getattr(props, 'pci_domain_id', 0):04x}:{bus:02x}:"
                f"{getattr(props, 'pci_device_id', 0):02x}.0/local_cpulist")
        try:
            with open(path) as f:
                cores = parse_cpulist(f.read())
        except (OSError, ValueError):
            return
        cores &= os.sched_getaffinity(0)
        if cores and cores != os.sched_getaffinity(0):
            os.sched_setaffinity(0, cores)
            self.log.info("%s is local to cores %s: running there", self.device, sorted(cores))

    def _load_model(self, spec: M.StageJob) -> tuple[Transformer, int]:
        """This stage's slice (weights resident as GGUF blocks or dequantized) and its KV cache."""
        args = ModelArgs(**spec.args)
        self.weights = weights_mode(spec.model, self.device.type, spec.weights, args)
        cpu_decode = spec.decode_weights if spec.decode_weights != "none" and self.device.type == "cpu" else None
        if cpu_decode == "auto":
            from strata.attention import kv_dtype_of
            from strata.checkpoint import has_quantized
            from strata.cpu_decode import auto_kind
            kind, why = auto_kind(args, has_quantized(spec.model, args), self.weights,
                                  kv_dtype_of(spec.kv_dtype, self.dtype))
            self.log.info("decode_weights=auto: %s (%s)", kind, why)
            cpu_decode = None if kind == "none" else kind
        if cpu_decode == "blocks":
            from strata.cpu_decode import BuildError, library
            try:
                library()  # built once per machine; a machine without a C compiler decodes as before
            except BuildError as e:
                self.log.warning("decode_weights=blocks: %s; decoding with the dense weights", e)
                cpu_decode = None
            if cpu_decode and args.extras():  # the C decoder implements the Llama core only
                self.log.warning("decode_weights=blocks: not for %s (%s); decoding with the dense weights",
                                 args.arch, ", ".join(args.extras()))
                cpu_decode = None
        model = load_stage(spec.model, args, spec.start, spec.end, device=self.device, dtype=self.dtype,
                           seed=spec.seed, weights=self.weights, kv_dtype=spec.kv_dtype, max_len=spec.max_len,
                           decode_weights=cpu_decode, max_chunk=spec.max_chunk,
                           # the head's choices (the planner sized activations for the same attention path)
                           kernels=kernel_spec(spec.kernels), attention=spec.attention)
        # decode options: weight-only copies are a CPU kernel path, graphs a CUDA one
        if cpu_decode == "blocks":
            b = model._blocks
            self.log.info("decode_weights=blocks: %d matrices as stored, %d quantized to 8 bits, %.1f MB, %s build",
                          b.exact, b.requantized, b.nbytes / 1e6, "AVX-512 VNNI" if b.lib.strata_simd() else "portable")
        elif spec.decode_weights not in ("none", "auto") and self.device.type != "cpu":
            self.log.info("decode_weights=%s: CPU stages only; %s decodes with its own weights",
                          spec.decode_weights, self.device)
        return model, model.kv_bytes

    def _warm_up(self, spec: M.StageJob) -> float:
        """CUDA: run the schedule's largest chunk twice (at position 0, then after a prefix: both attention
        branches) and build cuDNN's graphs of the later chunks' prefix lengths before saying ready, so one-time
        kernel set-up (cuDNN graphs, Triton compiles, cuBLAS workspaces) is paid at load and reported there
        (`warm_s`, inside `load_s`), never inside a timed prefill. The KV rows it writes are overwritten by the
        prefill. CPU kernels need no set-up."""
        if self.device.type != "cuda":
            return 0.0
        t = time.perf_counter()
        mem = [torch.cuda.memory_allocated(self.device)]  # what each part of the warm-up leaves allocated
        n = max(1, min(spec.max_chunk, spec.max_len // 2))
        for pos in (0, n) if 2 * n <= spec.max_len else (0,):
            if self.first:
                x = torch.zeros(1, n, dtype=torch.long, device=self.device)
            else:
                x = torch.zeros(1, n, self.args.dim, dtype=self.dtype, device=self.device)
            h = self.model(x, pos, decode=False)
            if self.last:
                self.model.logits(h[0, -1])
                if spec.perplexity:
                    self.model.nll(h, torch.zeros(n, dtype=torch.long, device=self.device))
        # every later chunk meets a new cached-prefix length (and with dynamic chunks a new length of its own), and
        # cuDNN builds a graph per shape: build those of the schedule's chunks (the configured prompt's first, then
        # any prompt's up to max_len) now, not one per chunk in the first prefill; bounded by
        # strata.attention.WARM_CHUNKS shapes and WARM_BUDGET_S seconds
        shapes = []
        for tokens in (spec.tokens, spec.max_len):
            shapes += [c for c in chunk_schedule(tokens, n, spec.dynamic_chunks, self.args)
                       if c[0] > 0 and c not in shapes]
        mem.append(torch.cuda.memory_allocated(self.device))
        built = strata.attention.warm_chunk_attention(self.model, shapes)
        mem.append(torch.cuda.memory_allocated(self.device))
        if built:
            self.log.info("chunk attention warmed for %d of %d chunk shapes (chunk %d)", built, len(shapes), n)
        # the decode step too (its kernels, cuBLAS's one-row GEMM set-up, the head's argmax), else the first
        # answer pays it; with cuda_graphs, every bucket of cache positions is captured now, not mid-answer
        x1 = (torch.zeros(1, 1, dtype=torch.long, device=self.device) if self.first
              else torch.zeros(1, 1, self.args.dim, dtype=self.dtype, device=self.device))
        positions = [0]
        if self.graphs is not None and self.graphs.graphable(x1):
            g = self.graphs.decode_graphs()  # the set the steps below capture into
            positions = sorted({g.bucket(p) - 1 for p in range(0, spec.max_len, 256)} | {0})
            self.log.info("decode: CUDA graphs, %d buckets", len({g.bucket(p) for p in positions}))
        elif self.graphs is not None:
            self.log.info("decode: eager (the graphs do not cover %s)", ", ".join(self.args.extras()) or "these weights")
        for pos in positions:
            self.decoder.decode_token(x1, pos)
        mem.append(torch.cuda.memory_allocated(self.device))
        self.log.info("warm-up: GPU memory allocated %s bytes (loaded; after the chunks; after cuDNN's shapes; "
                      "after the decode steps)", " -> ".join(f"{m:,}" for m in mem))
        if "strata.decode_gemv" in sys.modules:  # the graphs' dense products: which kernel each shape measured faster
            self.log.info("decode GEMV: %s", sys.modules["strata.decode_gemv"].describe())
        torch.cuda.synchronize(self.device)
        return time.perf_counter() - t

    def _map_buffers(self, spec: M.StageJob, ids: bytes | None) -> None:
        # ids (all stages read it), input boundary, output boundary / result. A boundary
        # inside this host is a shared segment (ShmLink); one that crosses hosts is a buffer of this
        # process whose rows travel with the note over tcp (TcpLink)
        net = self.net
        tcp_in, tcp_out = bool(net and net.tcp_in), bool(net and net.tcp_out)
        segs = spec.segments
        self.segments = []

        def attach(key):
            name, nbytes = segs[key]
            seg = Segment.attach(name, nbytes)
            self.segments.append(seg)
            return seg

        # decode doorbells (strata/bells.py): every stage local and on a GPU (or forced for tests)
        self.bell_words = attach("bells").tensor(torch.int64, (spec.n_stages + 1, bells_mod.ROW)) if "bells" in segs else None
        self.bells = Bells(self.bell_words.numpy()) if self.bell_words is not None else None
        self.bell_key = None  # (k, t0) of the decode step that came by bell: its note goes on by bell too
        if ids is None:
            self.ids = attach("ids").tensor(torch.int32, (spec.max_len + 1,))
        else:  # decoded tokens reach a remote stage 0 as "token" notes
            self.ids = torch.zeros(spec.max_len + 1, dtype=torch.int32)
            self.ids[:spec.tokens] = torch.frombuffer(bytearray(ids), dtype=torch.int32)
        args = self.args
        dim, cmax = args.dim, spec.max_chunk
        pin = self.device.type == "cuda"
        self.inlink = None
        if not self.first:
            self.inlink = (TcpLink(self.dtype, (cmax, dim), pin=pin) if tcp_in
                           else ShmLink(attach(f"b{self.i - 1}").tensor(self.dtype, (cmax, dim))))
        if self.last:
            self.outlink = (TcpLink(torch.float32, (args.vocab_size,), pin=pin) if tcp_out
                            else ShmLink(attach("result").tensor(torch.float32, (args.vocab_size,))))
        else:
            self.outlink = (TcpLink(self.dtype, (cmax, dim), pin=pin) if tcp_out
                            else ShmLink(attach(f"b{self.i}").tensor(self.dtype, (cmax, dim))))
        self.inbuf = self.inlink.buf if self.inlink else None
        self.outbuf = self.outlink.buf
        self.pinned = False
        if self.device.type == "cuda":
            self.pinned = all(s.pin() for s in self.segments if s.name.split("-")[-1] != "ids")
        self._argmax_host = torch.empty((), dtype=torch.long, pin_memory=self.device.type == "cuda")
        self.ahead = None  # (k, pos) of the decode step queued behind a GPU wait on this stage's bell
        self.ahead_seq = None  # the device address of this stage's bell seq word, when it queues steps ahead
        graphs = self.graphs and self.graphs.graphs  # captured by the warm-up on a slice whose steps replay graphs
        if spec.decode_ahead and self.bells is not None and self.pinned and graphs is not None and graphs.graphs:
            from strata import stream_wait
            word = self.bell_words[self.i, bells_mod.SEQ]
            why = stream_wait.works(word, self.device)
            if why is None:
                self.ahead_seq = stream_wait.device_address(word)
            self.log.info("decode launch-ahead: %s", "on" if why is None else f"off ({why})")
        self.dump = None  # opened per prefill (each prompt has its own length): `_open_dump`

    def _open_sockets(self, spec: M.StageJob) -> None:
        net, log = self.net, self.log
        tcp_in, tcp_out = bool(net and net.tcp_in), bool(net and net.tcp_out)
        cmax = spec.max_chunk
        # one PULL in, PUSH to each neighbour and to the head. Across hosts also (or, for
        # a remote stage, only) a tcp PULL: a CURVE server that lets in the head and the neighbours only
        ctx = zmq.Context.instance()
        self.ctx = ctx
        self.inboxes, self.inbox_sock, self.tcp_inbox, self.gate = [], None, None, None
        if not (net and net.remote):
            self.inbox_sock = ctx.socket(zmq.PULL)
            self.inbox_sock.setsockopt(zmq.LINGER, 0)
            self.inbox_sock.setsockopt(zmq.MAXMSGSIZE, M.MAX_FRAME)
            self.inbox_sock.bind(spec.endpoints[self.i])
            self.inboxes.append(self.inbox_sock)
        if net and net.tcp_inbox:
            self.gate = N.Gate(ctx, net.allow, log)
            self.tcp_inbox = N.curve_server(ctx.socket(zmq.PULL), net.public, net.secret)
            self.tcp_inbox.setsockopt(zmq.LINGER, 0)
            self.tcp_inbox.setsockopt(zmq.MAXMSGSIZE, max(M.MAX_FRAME, cmax * self.inlink.row_bytes if tcp_in else 0))
            self.gate.watch(self.tcp_inbox, f"stage {self.i} inbox")
            self.tcp_endpoint = N.bind_tcp(self.tcp_inbox, net.bind or N.route_address(spec.head_endpoint))
            self.inboxes.append(self.tcp_inbox)

        def push(ep):
            s = ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 2000)  # long enough for a final "fail" to leave
            s.connect(ep)
            return s

        def tcp_push():  # a CURVE client; connected once the head says where the neighbour listens
            s = ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 2000)
            s.curve_publickey, s.curve_secretkey = net.public.encode(), net.secret.encode()
            return s

        self.to_head = head_push(ctx, spec)
        self.to_up = None if self.first else tcp_push() if tcp_in else push(spec.endpoints[self.i - 1])
        self.to_down = self.to_head if self.last else tcp_push() if tcp_out else push(spec.endpoints[self.i + 1])
        self.outlink.sock = self.to_down
        self.linked = not ((tcp_in and not self.first) or (tcp_out and not self.last))  # else: wait for "peers"
        self.poller = zmq.Poller()
        for s in self.inboxes:
            self.poller.register(s, zmq.POLLIN)
        for mon, _ in (self.gate.monitors if self.gate else ()):
            self.poller.register(mon, zmq.POLLIN)
        if self.tcp_inbox is not None:
            self.send(self.to_head, M.Bound(stage=self.i, endpoint=self.tcp_endpoint))

    # -- messages ------------------------------------------------------------------------------
    def send(self, sock, msg: M.Message) -> None:
        sock.send(M.encode(msg))

    def _dispatch(self, msg: dict, data=None) -> None:
        """One message (and, across hosts, the rows that came with a chunk note), by its type's handler."""
        handler = self.handlers.get(type(msg))
        if handler is None:
            raise M.BadMessage(f"{msg.TYPE}: not a message a stage accepts")
        if data is not None and not isinstance(msg, M.Chunk):
            raise M.BadMessage(f"{msg.TYPE}: unexpected data frame")
        handler(msg, data)

    def on_chunk(self, msg: M.Chunk, data) -> None:
        pos, n = msg.pos, msg.n  # k >= 0 and a known phase: checked by M.decode
        if not (0 <= pos and 1 <= n <= self.spec.max_chunk and pos + n <= self.spec.max_len
                and msg.tokens <= self.spec.max_len):
            raise M.BadMessage(f"chunk: rows [{pos}, {pos + n}) of a {msg.tokens}-token prompt do not fit the buffers")
        if self.inlink is not None and self.inlink.crosses_hosts:  # the rows came with the note
            if data is None:
                raise M.BadMessage("chunk: no rows with the note (across hosts they travel together)")
            self.inlink.land(n, data)
        elif data is not None:
            raise M.BadMessage("chunk: unexpected data frame")
        self.inputs.append(msg)

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

    def on_peers(self, msg: M.Peers, data) -> None:
        """The head says where this stage's neighbours across hosts listen: connect to them."""
        if self.linked:
            raise M.BadMessage("peers: not a message a stage accepts")
        want = [(self.to_up, msg.up, msg.up_key, self.net.tcp_in and not self.first),
                (self.to_down, msg.down, msg.down_key, self.net.tcp_out and not self.last)]
        for _, ep, key, needed in want:
            if needed and not (ep.startswith("tcp://") and len(key) == 40):
                raise M.BadMessage(f"peers: no tcp endpoint and key for a neighbour ({ep!r})")
        for sock, ep, key, needed in want:
            if needed:
                sock.curve_serverkey = key.encode("ascii")
                sock.connect(ep)
        self.linked = True

    def pump(self, timeout_ms: int) -> bool:
        """Receive and dispatch whatever arrives within timeout_ms (False: nothing did). Garbage is
        counted and dropped."""
        if not self.poller.poll(timeout_ms):
            return False
        for sock in self.inboxes:
            self._drain(sock)
        if self.gate is not None and self.gate.drain():  # refused handshakes on the tcp inbox
            self.send(self.to_head, M.Rejected(stage=self.i, count=self.gate.count, detail=self.gate.last[:500]))
        return True

    def _drain(self, sock) -> None:
        across = sock is self.tcp_inbox  # a note may come with its rows: one multipart message
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
            # with bells, a decode step can arrive without a frame: look again within a millisecond
            timeout = 1 if self.bells is not None and self.phase == "decode" else 100
            if not self.pump(timeout) and self.bad_frames != self.bad_frames_logged:
                # idle after garbage: one line with the running count (a flood is not one line per frame)
                self.bad_frames_logged = self.bad_frames
                self.log.info("inbox idle: %d frame(s) rejected so far", self.bad_frames)
        return time.perf_counter() - t

    def _take_bell(self) -> bool:
        """A decode step announced on this stage's bell, queued as its note would be (and checked as one)."""
        note = self.bells.take(self.i)
        if note is None:
            return False
        k, pos, _, t0 = note
        try:
            self.on_chunk(M.Chunk(k=k, pos=pos, n=1, phase="decode", t0=t0, tokens=pos + 1, score=-1), None)
            self.bell_key = (k, t0)
        except M.BadMessage as e:
            self.bad_frames += 1
            self.log.warning("rejected decode bell: %s", e)
        return True

    # -- timing ---------------------------------------------------------------------------------
    def _reset_stats(self, phase: str, t0: float) -> None:
        self.phase, self.t0 = phase, t0
        self.work_s = self.handoff_wait_s = self.input_wait_s = self.copy_s = 0.0
        self.events: list[list] = []  # [k, work_start, work_end, handoff_done]
        self.last_handoff = t0
        self.nchunks = 0

    def report_stats(self) -> None:
        self.send(self.to_head, M.Stats(stage=self.i, phase=self.phase,
                         wall_s=max(0.0, self.last_handoff - self.t0), work_s=self.work_s,
                         handoff_wait_s=self.handoff_wait_s, input_wait_s=self.input_wait_s, copy_s=self.copy_s,
                         events=[[k, a + self.clock_offset, b + self.clock_offset, c + self.clock_offset]
                                 for k, a, b, c in self.events] if self.clock_offset else self.events,
                         chunks=self.nchunks, bad_frames=self.bad_frames))

    # -- the chunk path -------------------------------------------------------------------------
    def run_chunk(self, msg: M.Chunk) -> None:
        if msg.phase == "decode":
            return self.decode_step(msg)
        k, pos, n = msg.k, msg.pos, msg.n
        self.current_chunk = k
        self.send(self.to_head, M.Working(stage=self.i, k=k))

        # 1. input: ids for the first stage, else residual rows from the buffer above
        copy_start = time.perf_counter()
        if self.first:
            x = self.ids[pos:pos + n].to(self.device, dtype=torch.long).view(1, n)
        else:
            x = self.inlink.get(n).to(self.device, copy=True).view(1, n, self.args.dim)
            if self.device.type == "cuda":
                torch.cuda.current_stream().synchronize()  # the copy has left the buffer
            self.send(self.to_up, M.Taken(k=k))
        self.copy_s += time.perf_counter() - copy_start

        # 2. compute
        work_start = time.perf_counter()
        self._inject(k)
        h = self.model(x, pos, decode=False)  # a prefill chunk never takes the decode path
        nll, count, argmax, scores = 0.0, 0, -1, b""
        if self.last:
            if msg.phase == "prefill" and (self.spec.perplexity or msg.score >= 0):
                targets = self.ids[pos + 1: min(pos + n + 1, msg.tokens)].to(torch.long)
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
        work_end = time.perf_counter()
        self.work_s += work_end - work_start

        # 3. reap: the chunk in flight below must have left the buffer before we overwrite it
        self._reap()

        # 4. hand off
        copy_start = time.perf_counter()
        if self.last:
            self.outlink.put(logits, M.ChunkResult(k=k, nll=float(nll), count=count, argmax=argmax, scores=scores))
        else:
            self.outlink.put(h.view(n, self.args.dim), M.Chunk(k=k, pos=pos, n=n, phase=msg.phase, t0=msg.t0,
                                                               tokens=msg.tokens, score=msg.score))
        self.copy_s += time.perf_counter() - copy_start
        self.inflight.append(k)

        self._join(k)
        self.last_handoff = time.perf_counter()
        self.events.append([k, work_start, work_end, self.last_handoff])
        self.nchunks += 1

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

    def decode_step(self, msg: M.Chunk) -> None:
        """One decode step: the chunk path less what only a pipeline full of chunks needs, since a decode
        step is the only chunk in flight and every stage waits on the one above.

        - No "taken" or "done" notes, no chunk in flight to reap later: steps go round a ring (head -> stage
          0 -> ... -> last -> head) one token at a time, so the stage above writes its buffer again only after
          this step's result reached the head, long after this stage read it. Per token one note per hop.
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
            self._inject(k)
            # the GPU started it when the bell rang (its argmax, on the last stage, lands in _argmax_host): wait for
            # it, ring on, queue the next
            return self._decode_done(msg, self._argmax_host if self.last else None, work_start)
        t_in = time.perf_counter()
        if self.first:
            x = self.ids[pos:pos + n].to(self.device, dtype=torch.long).view(1, n)
        else:
            x = self.inlink.get(n).to(self.device, copy=True, non_blocking=cuda and self.pinned)
            x = x.view(1, n, self.args.dim)
        work_start = time.perf_counter()
        self.copy_s += work_start - t_in
        self._inject(k)
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
        self._reap()  # only the prefill's last chunk can still be in flight below
        self._copy_out(out, am)
        self._decode_done(msg, self._argmax_host if self.last and cuda else am, work_start)

    def _copy_out(self, out, am) -> None:
        """Queue the step's output into the hand-off buffer below (and the argmax into page-locked memory)."""
        cuda = self.device.type == "cuda"
        self.outlink.fill(out, non_blocking=cuda and self.pinned)
        if self.last and cuda:
            self._argmax_host.copy_(am, non_blocking=self.pinned)

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
            self.outlink.send(M.Chunk(k=k, pos=pos, n=n, phase=msg.phase, t0=msg.t0, tokens=msg.tokens, score=-1))
        self.copy_s += time.perf_counter() - work_end
        self.last_handoff = time.perf_counter()
        self.nchunks += 1
        if self.ahead_seq is not None and n == 1:
            self._queue_ahead(k + 1, pos + 1)

    def _queue_ahead(self, k: int, pos: int) -> None:
        """Queue decode step k at pos behind a GPU-side wait on this stage's bell (strata/stream_wait.py): when
        the hop above rings, the GPU copies the position and the token or residual row in from the page-locked
        bell and buffer and replays the step, and copies the output out, with no host step between the ring and
        the kernels. The host sees the same bell, checks it announces (k, pos), waits for the step and rings on.
        A step that does not come (the phase ends) is released by `_release_ahead`."""
        graphs = self.graphs.decode_graphs()
        if pos >= min(self.spec.max_len, graphs.cache_len) or not graphs.captured(pos):
            return
        from strata import stream_wait
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

    def _inject(self, k: int) -> None:
        d = self.debug
        delay = d["delay_s"] + self.i * d["delay_step_s"]
        if delay:
            time.sleep(delay)
        if d["fail_stage"] == self.i and d["fail_chunk"] == k and self.phase == d["fail_phase"]:
            self._injected_failure(f"at chunk {k}")

    def _injected_failure(self, where: str) -> None:
        mode = self.debug["fail_mode"]
        self.log.error("debug: injected failure (%s) %s", mode, where)
        for h in self.log.handlers:
            h.flush()
        if mode == "raise":
            raise StageFailed(f"injected failure {where}")
        if mode == "exit":
            os._exit(17)
        if mode == "kill":  # as if killed from outside: no message, no cleanup
            os.kill(os.getpid(), signal.SIGKILL)
        while True:  # hang: the watchdog (or the ready deadline) must notice
            time.sleep(1)

    def serve(self) -> None:
        self.send(self.to_head, M.Ready(stage=self.i, pid=os.getpid(), device=str(self.device),
                         layers=[self.spec.start, self.spec.end], mem_bytes=self._mem_bytes(),
                         kv_bytes=self.kv_bytes, pinned=self.pinned, load_s=self.load_s, weights=self.weights,
                         weight_bytes=self.model.weight_bytes, scratch_bytes=self.model.scratch_bytes,
                         warm_s=self.warm_s, state_bytes=self.model.state_bytes))
        if not self.linked:  # neighbours on other hosts: the head says where they listen once all are ready
            self.wait_until(lambda: self.linked)
        while True:
            t = time.perf_counter()
            self.wait_until(lambda: self.inputs or self.phase_end is not None,
                            DECODE_SPIN_S if self.phase == "decode" and self.device.type == "cuda" else 0.0)
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
        for s in self.inboxes:
            if not s.closed:
                s.close(linger=0)
        for s in (self.to_up, self.to_head, self.to_down):
            if s is not None and not s.closed:
                s.close(linger=linger_ms)
        if self.gate is not None:
            self.gate.stop()
        for seg in self.segments:
            seg.close()


def parse_cpulist(text: str) -> set[int]:
    """sysfs cpulist "0-15,32-47" -> {0, ..., 15, 32, ..., 47}."""
    cores: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        a, _, b = part.partition("-")
        cores.update(range(int(a), int(b or a) + 1))
    return cores


def head_push(ctx, spec: M.StageJob):
    """A PUSH to the head: its ipc socket, or (a remote stage) its tcp socket as a CURVE client."""
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.LINGER, 2000)  # long enough for a final "fail" to leave
    net = spec.net
    if net and net.remote:
        N.curve_client(s, net.public, net.secret, net.head_public)
    s.connect(spec.head_endpoint)
    return s


if __name__ == "__main__":  # the remote entry point was here: an old remote_command fails loudly, not silently
    sys.exit("error: a stage on another host starts with: python -m workers.join --join tcp://HEAD:PORT --key KEY")
