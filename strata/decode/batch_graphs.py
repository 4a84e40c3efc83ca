"""CUDA graphs of a decode batch: several sequences' one-token steps in one replay, each row its own slot and position.

A stage with several KV slots (max_seqs > 1) decodes a micro-batch of sequences at once (strata/head/slots.py). Eager,
each layer costs a few launches per row for the attention alone; graphed, one replay runs the batch's layers, head
and argmax. Row t reads and writes the cache of slot slots[t] at position positions[t]: the slots of a layer are one
tensor (Transformer.slot_caches), and the rope-and-store and split-K attention kernels take the row's slot and
position from the device (strata.kernels.decode_kernels.rope_store_rows, SplitKAttention.rows_call), so one graph serves
every choice of slots and positions. A global layer of a KV pool (kv_pool) is the pool, and a row's slot there is
its extent's first position (`base`, from Transformer.slot_base). The graph captures the model's one layer body
(strata.models.layer.run_layers) with the batch's fused kernels as its ops (strata.decode.graph_ops.BatchOps).

Graphs are captured per (rows, bucket of cache positions): rows a power of two up to `max_rows` (a batch of 3 takes
the graph of 4; its padding rows repeat row 0's inputs and write nothing), the bucket that holds the batch's
furthest position (DecodeGraphs.bucket). Each row is within rounding of its step alone (a product's kernel may sum in
another order for another row count), as `Transformer.decode_seqs`' torch path is.

What it covers (`batch_refusal`): what DecodeGraphs captures, with the split-K and Triton norm / rope kernels, a cache of
bfloat16, float16, float32 or q8_0; no dynamic NTK rope. Partial rotary and an output gate (qwen3_5, glm4_moe) take
torch's rope and an indexed store of the rows. A linear-attention layer (qwen3_5) steps each row from its slot's
states and writes them back (GatedDeltaNet.mix_rows); the host checks each slot's state stands at its row's position.
A mixture-of-experts layer's rows take its few-rows path: all of them where its experts' kernels read their blocks in
place, else at most GATHER_PAIRS / k rows a replay (a larger batch is replayed in groups).
"""
from __future__ import annotations

import torch

from strata.kernels.attention import Q8_0, rope_tables
from strata.decode.graph_ops import BatchOps, fusable
from strata.models.layer import run_layers
from strata.models.model import Transformer
from strata.models.resident import Packed

CACHE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, Q8_0)


def batch_refusal(m: Transformer, x: torch.Tensor) -> str | None:
    """Why m's decode batches on x's device cannot be captured beyond what the one-token graphs refuse
    (strata.decode.graphs.graphable, which GraphedDecode asks too); None: they can."""
    from strata.kernels import decode_attention
    from strata.kernels import decode_kernels
    if not (decode_attention.available() and decode_kernels.available()):
        return "no Triton"
    if m.kernels.graph_attention != "split-k" or m.kernels.graph_kernels != "triton":
        return "kernels.graph_attention split-k and graph_kernels triton only"
    if m.rope_dynamic is not None:
        return "dynamic NTK rope: each step its own frequencies"
    for blk in m.layers.values():
        if blk.linear:
            continue
        if blk.latent:  # (its rows take the eager decode batch: strata.models.mla over each row's segment)
            return "latent attention (MLA) in a batch"
        a = blk.attn
        if a.hd & (a.hd - 1):
            return f"head dim {a.hd} is not a power of two"
        if a.k_cache.dtype not in CACHE_DTYPES:
            return f"a {a.k_cache.dtype} cache"
    return None


def max_rows(m: Transformer) -> int:
    """The most rows one replay takes: the slots, rounded up to a power of two. A mixture-of-experts layer's rows
    take its few-rows path: any number where its experts' kernels read their blocks in place
    (MoE.gathers_any_rows), else GATHER_PAIRS (row, expert) pairs (each pair's expert copied first)."""
    from strata.models.moe import GATHER_PAIRS
    device = m.device_dtype()[0]
    cap = 1 << max(0, m.n_slots - 1).bit_length()
    for blk in m.layers.values():
        if blk.moe and not blk.mlp.gathers_any_rows(device):
            cap = min(cap, 1 << (max(1, GATHER_PAIRS // blk.mlp.k).bit_length() - 1))
    return max(1, cap)


class BatchGraphs:
    """A slice's decode batches replayed from CUDA graphs (`batch_refusal` must be None). `step` takes the batch;
    graphs are captured on first use of their (rows, bucket) and made anew by the holder (GraphedDecode) when the
    slice's cache or weights change. `one`: the slice's strata.decode.graphs.DecodeGraphs (nothing captured in it),
    whose buckets, split-K arm (and its fallback) and norms' checks the batches share."""

    def __init__(self, m: Transformer, one):
        self.m = m
        self.device, self.dtype = m.device_dtype()
        self.one = one
        self.max_rows = R = max_rows(m)
        dev = self.device
        # static inputs, R rows (a graph of r rows reads the first r): token ids or residual rows, positions, slots,
        # and which rows are real (a padding row writes no cache row)
        self.ids = torch.zeros(R, dtype=torch.long, device=dev) if m.has_embed else None
        self.res = None if m.has_embed else torch.zeros(R, m.args.dim, dtype=self.dtype, device=dev)
        self.pos = torch.zeros(R, dtype=torch.long, device=dev)
        self.slot = torch.zeros(R, dtype=torch.long, device=dev)
        self.base = torch.zeros(R, dtype=torch.long, device=dev)  # a pooled layer's index of the row's slot
        self.live = torch.zeros(R, dtype=torch.bool, device=dev)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, tuple]] = {}
        self.split_k: dict[tuple[int, int], object] = {}
        # every (bucket, rows) instance's partial results in one scratch (replays run one at a time): r rows take at
        # most max(r, 128) (row, range) pairs (`_attention`), so it never grows, and no captured graph outlives its
        # buffer
        a = self.one.attn0  # (None: linear layers only)
        pairs = 0 if a is None else max(R, 128) * a.nkv * max(16, 1 << (a.nh // a.nkv - 1).bit_length())  # (its gp)
        self.scratch = (torch.empty(pairs, dtype=torch.float32, device=dev),
                        torch.empty(pairs, dtype=torch.float32, device=dev),
                        torch.empty(pairs * (a.hd if a else 0), dtype=torch.float32, device=dev))
        self.rings = self.one.rings
        self.linear = self.one.linear  # linear-attention layers: their states stand where each slot left them
        self._write = True  # False during a capture's warm-up run: the linear layers' states are not advanced
        self._side = None
        self._pool = None

    @property
    def cache_len(self) -> int:
        return self.one.cache_len

    def bucket(self, pos: int) -> int:
        return self.one.bucket(pos)

    @staticmethod
    def rows_for(n: int) -> int:
        return 1 << max(0, n - 1).bit_length()

    def captured(self, rows: int, pos: int) -> bool:
        return (self.rows_for(rows), self.bucket(pos)) in self.graphs

    @torch.inference_mode()
    def step(self, x: torch.Tensor, slots: list[int], positions: list[int],
             fresh: bool = True) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Row t: sequence slots[t]'s token at positions[t] (x: ids (n,) or residual rows (n, dim)) -> (residual rows
        (n, dim), float32 logits (n, vocab), argmaxes (n,)); the last two only with the head. A batch over
        max_rows is replayed in groups. fresh=False (one group only): the graph's own outputs, valid until the next
        replay."""
        n = len(slots)
        if n != len(positions) or n < 1 or x.shape[0] != n:
            raise ValueError(f"a decode batch of {x.shape[0]} rows, {n} slots and {len(positions)} positions")
        if len(set(slots)) != n:
            raise ValueError(f"a decode batch names a slot twice: {slots}")
        for s, p in zip(slots, positions):
            if not 0 <= s < self.m.n_slots or not 0 <= p < min(self.cache_len, self.m.slot_positions(s)):
                held = f" (this slot: {self.m.slot_positions(s)})" if 0 <= s < self.m.n_slots else ""
                raise ValueError(f"slot {s} at position {p}: outside {self.m.n_slots} slots of {self.cache_len}{held}")
        if n > self.max_rows:
            parts = [self.step(x[i:i + self.max_rows], slots[i:i + self.max_rows], positions[i:i + self.max_rows])
                     for i in range(0, n, self.max_rows)]
            return tuple(None if p[0] is None else torch.cat(p) for p in zip(*parts))
        r = self.rows_for(n)
        with torch.cuda.device(self.device) if self.device.type == "cuda" else _nothing():
            pad = r - n
            static = self.ids if self.ids is not None else self.res
            xs = x.reshape(n, *static.shape[1:])
            static[:n].copy_(xs)
            static[n:r].copy_(xs[:1].expand(pad, *static.shape[1:]))
            base = [self.m.slot_base(t) for t in slots]
            meta = torch.tensor([positions + [positions[0]] * pad, slots + [slots[0]] * pad,
                                 [1] * n + [0] * pad, base + [base[0]] * pad], dtype=torch.long)
            if self.device.type == "cuda":  # from pageable memory the copy may wait for the stream; batch_ahead queues
                meta = meta.pin_memory()    # steps behind each other without a wait (the host allocator keeps the
            meta = meta.to(self.device, non_blocking=True)  # block until the copy is done)
            self.pos[:r].copy_(meta[0])
            self.slot[:r].copy_(meta[1])
            self.live[:r].copy_(meta[2].bool())
            self.base[:r].copy_(meta[3])
            for la in self.linear:  # each row's slot's states stand at its position (position 0: zeroed)
                la.begin_rows(slots, positions)
            key = (r, self.bucket(max(positions)))
            entry = self.graphs.get(key)
            if entry is None:
                entry = self.graphs[key] = self._capture(*key)
            entry[0].replay()
            for la in self.linear:
                la.step_rows(slots, positions)
            out = entry[1]
            if not fresh:
                return tuple(None if t is None else t[:n] for t in out)
            return tuple(None if t is None else t[:n].clone() for t in out)

    def _capture(self, r: int, b: int) -> tuple[torch.cuda.CUDAGraph, tuple]:
        """The graph of r rows in bucket b. Its warm-up runs the batch once outside the capture (each real row
        writes its cache row, which the replay writes again with the same values)."""
        if self._side is None:
            self._side, self._pool = torch.cuda.Stream(self.device), torch.cuda.graph_pool_handle()
        side = self._side
        side.wait_stream(torch.cuda.current_stream(self.device))
        self._write = False  # (the replay advances the linear layers' states, once)
        try:
            with torch.cuda.stream(side):
                self.body(r, b)
        finally:
            self._write = True
        torch.cuda.current_stream(self.device).wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self._pool, capture_error_mode="thread_local"):
            out = self.body(r, b)
        return g, out

    def _attention(self, keys: int, r: int):
        """The split-K instance for r rows over `keys` positions (its partial buffers serve every layer in turn).
        Fewer ranges per row the more rows: r rows of 128 / r ranges fill the GPU as one row of 128 does."""
        if (keys, r) not in self.split_k:
            from strata.kernels.decode_attention import SplitKAttention, n_splits
            # the q8 arm as the one-token graphs choose it: probed once, outside any capture (its fallback, if any)
            q8 = self.one._attention(self.bucket(0)).q8
            a = self.one.attn0
            self.split_k[keys, r] = SplitKAttention(a.nkv, a.nh // a.nkv, a.hd, keys, self.device,
                                                    splits=n_splits(keys, max(1, 128 // r)), q8=q8, rows=r,
                                                    scratch=self.scratch)
        return self.split_k[keys, r]

    def body(self, r: int, b: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The batch of r rows in bucket b, from the static inputs' first r rows: (residual (r, dim), logits
        (r, vocab) float32, argmaxes (r,)). What the graph captures; on CPU, Triton's interpreter runs it in tests."""
        m = self.m
        pos, slot, live = self.pos[:r], self.slot[:r], self.live[:r]
        if self.ids is not None:
            h = m.embed(self.ids[:r])
            if m.args.embed_scale != 1.0:
                h = h * torch.tensor(m.args.embed_scale, dtype=h.dtype)
        else:
            h = self.res[:r]
        tabs = {"global": self._rope(pos, m.inv_freq, m.rope_factor)}
        if m.inv_freq_window is not None:
            tabs["window"] = self._rope(pos, m.inv_freq_window, 1.0)
        nope = torch.full_like(pos, -1)
        rows = {None: torch.where(live, pos, nope)}  # the cache row each row writes (a padding row: none)
        rows.update({S: torch.where(live, pos % S, nope) for S in self.rings})  # a window layer's ring row
        # the one layer body (strata.models.layer), each row's slot and position read on the device by its ops
        h = run_layers(m.layers.values(), h, BatchOps(self, r, b, tabs, rows, pos + 1, slot, live))
        if not m.has_head:
            return h, None, None
        logits = self._logits(h, r)
        return h, logits, logits.argmax(-1)

    def _rope(self, pos: torch.Tensor, inv: torch.Tensor, f: float) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin (r, hd) of each row's position, as Transformer.rope (f: YaRN's attention factor)."""
        freqs = pos.to(torch.float32)[:, None] * inv[None]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = (emb.cos(), emb.sin()) if f == 1.0 else (emb.cos() * f, emb.sin() * f)
        c, s = rope_tables(cos.to(self.dtype), sin.to(self.dtype))
        return c[:, 0].contiguous(), s[:, 0].contiguous()

    def _logits(self, h: torch.Tensor, r: int) -> torch.Tensor:
        """The final norm and head of the rows: a resident head on its blocks, DECODE_T rows a launch, x's int8
        rounding from the norm's launch where it reads that; else Transformer.logits."""
        from strata.models.args import DECODE_T
        from strata.quant import rows
        m = self.m
        w = m.head.weight
        if not (isinstance(w, Packed) and m.head.int8_x(h.device) and m.decode_weights is None
                and fusable(m.norm, h) and h.is_contiguous()):
            return m.logits(h, decode=True)
        from strata.kernels.decode_kernels import rms_norm
        if rows.takes(m.head.kernels, r, [w.qtype]):  # kernels.gemv_rows mma-float: all at once, x as it is
            out = m.head(rms_norm(h, m.norm.weight, m.norm.eps, rows=r))
        else:
            x, (q, s) = rms_norm(h, m.norm.weight, m.norm.eps, int8=True, rows=r)
            out = torch.cat([m.head(x[j:j + DECODE_T], xq=(q[j:j + DECODE_T], s[j:j + DECODE_T]))
                             for j in range(0, r, DECODE_T)])
        c = m.args.final_softcap
        return out if c is None else torch.tanh(out / c) * c


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
