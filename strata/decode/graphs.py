"""CUDA graphs of a Transformer slice's one-token decode step, built from outside the model.

`GraphedDecode(model)` is what a stage (or a bench, or a test) holds beside its slice: its `decode_token` and
`decode_step` replay a graph where `graphable` says the slice can be captured, else run the slice's eager decode
path. The model knows nothing of graphs: this module reads it through its public names (the graphs' kernels from
`Transformer.kernels`, the rig's), and notices a replaced cache or weights by `Transformer.storage_version`. What
a graph captures is the model's own layer body (strata.models.layer.run_layers) with the fused kernels as its ops
(strata.decode.graph_ops.RowOps), not a second coding of the layer.
"""
from __future__ import annotations

import os

import torch

from strata.kernels.attention import Q8_0, rope_tables
from strata.decode.graph_ops import RowOps, fusable
from strata.models.layer import run_layers
from strata.models.model import Transformer
from strata.models.resident import DECODE_T, DenseMatrices, Packed, ResidentMatrices, fused_ok

GRAPH_MIN_BUCKET = 256
# the graphs' attention (kernels.graph_attention): "split-k" (strata/kernels/decode_attention.py, Triton; reads only the live
# keys) or "masked" (efficient attention over the whole bucket with an additive mask: no split over keys, slow past a
# few thousand); their norms and rope (kernels.graph_kernels): "triton" or "torch" ops (the A/B)


# what the graphs implement beyond the Llama core (ModelArgs.extras); windows need the split-K kernel
GRAPH_EXTRAS = {"qk_norm", "rope yarn", "rope linear", "sliding_window", "window_rope_theta", "post_norms",
                "activation gelu_tanh", "embed_scale", "attn_scale", "final_softcap", "norm_offset", "experts",
                "sinks", "o_bias", "partial rotary", "linear attention", "attention gate", "latent attention",
                "sparse attention"}


def covers(args, graph_attention: str = "split-k") -> bool:
    """Whether a model's one-token step can be captured: its variations are implemented here, and a window
    layer's ring is read by the split-K kernel (the masked path reads a contiguous prefix only). graph_attention:
    the rig's kernels.graph_attention."""
    if set(args.extras()) - GRAPH_EXTRAS:
        return False
    if args.sliding_window is not None or args.attn_sinks:  # (sinks: the split-K kernel's merge takes them)
        from strata.kernels import decode_attention
        hd = args.head_dim
        return decode_attention.available() and graph_attention == "split-k" and hd & (hd - 1) == 0
    return True


def graphable(m: Transformer, x: torch.Tensor) -> bool:
    """Whether m's one-token step on x can be captured: x on CUDA, no weight-only decode copies, the model's
    variations covered (`covers`), dense layers or resident ones the fused kernels multiply on their blocks
    (strata.quant.gemv), a resident head likewise. A resident embedding is gathered outside the graph. A linear-
    attention layer's step (strata.models.linear_attention: its convolution's state shift, the gates, the delta rule's
    step on its state in place) is captured beside the attention layers'."""
    if not x.is_cuda or m.decode_weights is not None:
        return False
    if not covers(m.args, m.kernels.graph_attention):
        return False
    if m.has_head and isinstance(m.head.weight, Packed) and not fused_ok(m.head.weight, x.device):
        return False
    return all((isinstance(b.weights, DenseMatrices) or b.weights.fused_decode_ok(x.device))
               and (not b.moe or b.mlp.resident is None or b.mlp.resident.graphable(x.device))
               and (not b.latent or all(w.fused_ok(x.device) for w in (b.attn.wq, b.attn.wq_a, b.attn.wq_b,
                                                                         b.attn.wkv_a, b.attn.wo) if w is not None))
               for b in m.layers.values())


class GraphedDecode:
    """A slice's one-token decode steps, replayed from CUDA graphs where `graphable`, else by the slice's eager
    decode path. The graphs (a `DecodeGraphs`) are made on the first graph step and made anew after the slice's
    cache or weights were replaced (they address the old ones)."""

    def __init__(self, m: Transformer):
        self.m = m
        self._graphs: DecodeGraphs | None = None
        self._version = -1  # the slice's storage_version the graphs were made for
        self._batch = None  # strata.decode.batch_graphs.BatchGraphs: a slice with several slots replays its batches there
        self._batch_version = -1
        self._refusal: tuple[int, str | None] | None = None  # (storage_version, batch_refusal's answer)

    @property
    def graphs(self) -> DecodeGraphs | None:
        """The current graphs: None before the first graph step, or after the cache or weights changed."""
        return self._graphs if self._version == self.m.storage_version else None

    def decode_graphs(self) -> DecodeGraphs:
        """The current graphs, made (nothing captured yet) if there are none."""
        if self.graphs is None:
            self._graphs, self._version = DecodeGraphs(self.m), self.m.storage_version
        return self._graphs

    def graphable(self, x: torch.Tensor) -> bool:
        """Whether one-token steps replay the one-sequence graphs: a slice with one slot (several slots: `batchable`)."""
        return self.m.n_slots <= 1 and graphable(self.m, x)

    @property
    def q8_fallback(self) -> str | None:
        """Why the graphs' split-K reads a q8_0 cache widened instead of kernels.q8_attention's int8 arm (None: it
        does not, or nothing was captured yet)."""
        one = self.graphs if self.graphs is not None else (
            self._batch.one if self._batch is not None and self._batch_version == self.m.storage_version else None)
        return None if one is None else one.q8_fallback

    def batch_refusal(self, x: torch.Tensor) -> str | None:
        """Why a slice with several slots does not replay its decode batches (and its one-token steps, as batches of
        one) from strata.decode.batch_graphs' graphs; None: it does."""
        if self.m.n_slots <= 1:
            return "one slot: the one-sequence graphs"
        if self._refusal is None or self._refusal[0] != self.m.storage_version:
            from strata.decode.batch_graphs import batch_refusal
            why = batch_refusal(self.m, x)
            if why is None and not graphable(self.m, x):
                why = "the one-token graphs do not cover this slice" + ("" if x.is_cuda else " (CPU)")
            self._refusal = (self.m.storage_version, why)
        return self._refusal[1]

    def batchable(self, x: torch.Tensor) -> bool:
        return x.device.type == self.m.device_dtype()[0].type and self.batch_refusal(x) is None

    def batch_graphs(self):
        """The current strata.decode.batch_graphs.BatchGraphs, made (nothing captured yet) if there are none or the slice's
        cache or weights changed."""
        if self._batch is None or self._batch_version != self.m.storage_version:
            from strata.decode.batch_graphs import BatchGraphs
            self._batch, self._batch_version = BatchGraphs(self.m, DecodeGraphs(self.m)), self.m.storage_version
        return self._batch

    @torch.inference_mode()
    def __call__(self, x: torch.Tensor, pos: int, decode: bool | None = None) -> torch.Tensor:
        """The slice's forward, with one-token decode steps replayed from the graphs."""
        T = x.shape[1]
        if (T <= DECODE_T if decode is None else decode) and T == 1 and (self.graphable(x) or self.batchable(x)):
            return self.decode_step(x, pos)
        return self.m(x, pos, decode)

    @torch.inference_mode()
    def decode_step(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        """One token at `pos` -> residual (1, 1, dim): a replay of the graph of the bucket of cache positions that
        holds pos (captured on its first use), or Transformer.decode_step."""
        if x.shape[1] == 1 and self.graphable(x):
            return self.decode_graphs().step(x, pos)
        if x.shape[1] == 1 and self.batchable(x):
            return self.decode_token(x, pos)[0]
        return self.m.decode_step(x, pos)

    @torch.inference_mode()
    def decode_token(self, x: torch.Tensor, pos: int,
                     fresh: bool = True) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Transformer.decode_token's (residual, logits, argmax), all three from one replay where graphable.
        fresh=False returns the graph's own output tensors, valid until the next step (a caller that copies them
        out at once: three kernels fewer per token). A slice with several slots: the slot in use (use_slot) as a
        batch of one."""
        if self.graphable(x):
            return self.decode_graphs().step_all(x, pos, fresh)
        if self.batchable(x):
            h, logits, am = self.batch_graphs().step(x.reshape(1, *x.shape[2:]), [self.m.slot], [pos], fresh)
            return h.view(1, 1, -1), None if logits is None else logits[0], None if am is None else am[0]
        return self.m.decode_token(x, pos)

    @torch.inference_mode()
    def decode_seqs(self, x: torch.Tensor, slots: list[int],
                    positions: list[int]) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Transformer.decode_seqs' batch (row t: slot slots[t]'s token at positions[t]), replayed from the batch
        graphs where `batchable`: all rows in one replay (the rig's decode_batch rows: each row within rounding of
        its step alone), or with decode_batch steps one replay a row (each row its step alone, bit for bit)."""
        if not self.batchable(x):
            return self.m.decode_seqs(x, slots, positions)
        g = self.batch_graphs()
        if self.m.batch_rows:
            return g.step(x, slots, positions)
        parts = [g.step(x[t:t + 1], [s], [p]) for t, (s, p) in enumerate(zip(slots, positions))]
        return tuple(None if p[0] is None else torch.cat(p) for p in zip(*parts))


class DecodeGraphs:
    """CUDA graphs of a Transformer slice's one-token step (dense layers, or resident ones multiplied on their
    blocks by strata.quant.gemv), one per bucket of cache positions.

    A graph's kernels keep their shapes while pos moves: its attention covers the first `bucket` cache
    positions and reads the live count (pos + 1) on the device. With Triton that is the split-K kernel
    (strata/kernels/decode_attention.py), which reads only the live keys; buckets double, so their ranges stay at
    least half live. Without it, efficient attention with an additive mask over the whole bucket, which
    costs in proportion to the bucket: buckets then grow by a quarter past 4 * GRAPH_MIN_BUCKET. The token
    (ids or residual row) and pos are copied into static inputs before a replay; rope, mask and cache
    write read pos on the device. Captured lazily on a bucket's first use (the stage captures all at
    load); GraphedDecode makes them anew when the slice's cache or weights change."""

    def __init__(self, m: Transformer):
        self.m = m
        self.device, self.dtype = m.device_dtype()
        dev = self.device
        # the token id in, its embedding row gathered in the graph (a resident embedding's row dequantized there too:
        # eager, its ~30 small launches sat between a launch-ahead step's bell and its replay)
        self.ids = torch.zeros(1, 1, dtype=torch.long, device=dev) if m.has_embed else None
        self.res = None if self.ids is not None else torch.zeros(1, 1, m.args.dim, dtype=self.dtype, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.cache_len = max(b.attn.max_len for b in m.layers.values())  # positions (a window layer's ring is shorter)
        # linear-attention layers (a state each, advanced in place by a replay; see `step_all`), and the first
        # attention layer (None: a slice of linear layers only), whose head shape the attention kernels take
        self.linear = [b.attn for b in m.layers.values() if b.linear]
        self.attn0 = next((b.attn for b in m.layers.values() if not b.linear), None)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple]] = {}  # bucket -> (graph, its static outputs)
        # one warm-up stream and one memory pool for every bucket's capture: cuBLAS keeps a workspace (32 MiB on
        # Hopper) per stream it meets, and each graph would keep a pool of its own; a stream and a pool per bucket
        # held ~37 MB a bucket that the planner never counted (smoke-wide, 10 buckets: 375 MB). Sharing the pool is
        # safe because replays run one at a time on one stream and a step's outputs are read before the next one.
        self._side: torch.cuda.Stream | None = None
        self._pool = None
        self.kernels = m.kernels  # the rig's: the graphs' attention, norm / rope kernels and dense products
        from strata.kernels import decode_attention  # imports Triton
        a = self.attn0
        self.rings = sorted({b.attn.k_cache.shape[2] for b in m.layers.values() if b.attn.window is not None})
        # (on CPU the body runs eagerly in tests only: the masked path, or split-K under Triton's interpreter);
        # the split-K kernel takes power-of-two head dims only: other models take the masked path
        self.use_split_k = (decode_attention.available() and self.kernels.graph_attention == "split-k"
                            and (a is None or getattr(a, "latent", False) or a.hd & (a.hd - 1) == 0)
                            and (dev.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"))
        self.split_k: dict[int, "decode_attention.SplitKAttention"] = {}
        self.q8_fallback: str | None = None  # why kernels.q8_attention's int8 arm gave way to "widen" (None: it runs)
        # the masked path's positions, compared with pos on the device (split-K reads the live count instead)
        self.ar = None if self.use_split_k else torch.arange(self.cache_len, device=dev)
        # with split-K, also the Triton norm and rope-and-store kernels (strata/kernels/decode_kernels.py); not for a
        # float8 cache (its stores clamp first); a q8_0 one's are quantized in the store
        self.fused = (self.use_split_k and self.kernels.graph_kernels == "triton"
                      and (a is None or a.k_cache.dtype in (torch.bfloat16, torch.float16, torch.float32, Q8_0)))

    def bucket(self, pos: int) -> int:
        if self.attn0 is None:  # linear layers only: nothing grows with pos, one graph serves every position
            return self.cache_len
        b, m = GRAPH_MIN_BUCKET, GRAPH_MIN_BUCKET
        while b < pos + 1:
            b = 2 * b if self.use_split_k or b < 4 * m else -(-(b * 5 // 4) // m) * m
        return min(b, self.cache_len)

    def step(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        return self.step_all(x, pos)[0]

    def step_all(self, x: torch.Tensor, pos: int,
                 fresh: bool = True) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(residual, logits, argmax) of one replay; logits and argmax only on a slice with the head. fresh=False:
        the static outputs themselves, which the next replay overwrites."""
        if not 0 <= pos < self.cache_len:
            raise ValueError(f"position {pos} is outside the KV cache ({self.cache_len})")
        with torch.cuda.device(self.device):
            static = self.ids if self.ids is not None else self.res
            static.copy_(x.reshape(static.shape))
            self.pos.fill_(pos)
            b = self.bucket(pos)
            for la in self.linear:  # its state must stand at pos (pos 0: zeroed), as the eager step checks
                la.begin(pos)
            entry = self.graphs.get(b)
            if entry is None:
                entry = self.graphs[b] = self._capture(b)
            entry[0].replay()  # a fresh capture has only recorded: this replay computes the step
            for la in self.linear:
                la.state_pos = pos + 1
            if not fresh:
                return entry[1]
            # the static outputs are overwritten by the next replay
            return tuple(t.clone() if t is not None else None for t in entry[1])

    @property
    def queues_ahead(self) -> bool:
        """Whether steps may be queued ahead (`replay_queued`): not with linear-attention layers (their states move
        with every step that runs, and a released step runs)."""
        return not self.linear

    def captured(self, pos: int) -> bool:
        return self.bucket(pos) in self.graphs

    def replay_queued(self, pos: int, pos_src: torch.Tensor, token_src: torch.Tensor | None = None,
                      row_src: torch.Tensor | None = None) -> tuple:
        """Queue the step at `pos` with its inputs copied from page-locked host memory by the stream itself:
        the position (pos_src, one int64 word that must hold pos when the copy runs) and the token id
        (token_src, one int64 word; a slice with the embedding) or residual row (row_src). For a stream told to
        wait for those words first (launch-ahead). pos's bucket must be captured already (a capture would run its
        warm-up on inputs not there yet). Returns the static outputs (residual, logits, argmax). Not for a slice
        with linear-attention layers: a queued step that does not come still runs, and would advance their states
        past the kept positions (`queues_ahead`)."""
        if not self.queues_ahead:
            raise RuntimeError("decode graphs: a queued step would advance the linear-attention states unasked")
        b = self.bucket(pos)
        entry = self.graphs[b]
        with torch.cuda.device(self.device):
            self.pos.copy_(pos_src.view(1), non_blocking=True)
            if self.ids is not None:
                self.ids.view(1).copy_(token_src.view(1), non_blocking=True)
            else:
                self.res.view(-1).copy_(row_src.reshape(-1), non_blocking=True)
            entry[0].replay()
        return entry[1]

    def _capture(self, b: int) -> tuple[torch.cuda.CUDAGraph, tuple]:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        # without Triton: efficient attention takes the additive mask at a fixed length; its kernels do not
        # depend on the mask's contents (cuDNN would also do, but flash takes no mask)
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            if self._side is None:
                self._side, self._pool = torch.cuda.Stream(self.device), torch.cuda.graph_pool_handle()
            side = self._side
            # the warm-up advances the linear layers' states in place (an attention layer's rewrites its cache row
            # with the same values): kept aside and put back, so the step runs once, at the first replay
            saved = [(la.conv_state.clone(), la.state.clone()) for la in self.linear]
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # warm-up outside the capture (lazy cuBLAS/workspace init)
                self._body(b)
            torch.cuda.current_stream(self.device).wait_stream(side)
            for la, (c, st) in zip(self.linear, saved):
                la.conv_state.copy_(c)
                la.state.copy_(st)
            del saved
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self._pool, capture_error_mode="thread_local"):
                out = self._body(b)
        return g, out

    def _attention(self, b: int):
        """The bucket's split-K attention (its partial-result buffers serve every layer: they run in turn); for a
        window layer, b is the keys it reads: min(bucket, window)."""
        if b not in self.split_k:
            a = self.attn0
            from strata.kernels.decode_attention import SplitKAttention
            q8 = self.kernels.q8_attention
            if (a.k_cache.dtype == Q8_0 and q8 != "widen" and self.q8_fallback is None
                    and not (self.device.type == "cuda" and torch.cuda.is_current_stream_capturing())):
                # the int8 arms lean on Triton's int8 tensor-core dots, which another Triton may refuse to build
                # (3.6 did, until the dots named their int32 result): compile once here, outside any capture,
                # and take the widening arm for this slice if it fails (workers/load.py logs why)
                try:
                    SplitKAttention(a.nkv, a.nh // a.nkv, a.hd, 64, self.device, q8=q8).probe(a.k_cache.dtype)
                except Exception as e:  # noqa: BLE001 (Triton's compile errors have no common public base)
                    self.q8_fallback = f"{q8} failed to build ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
            if self.q8_fallback is not None:
                q8 = "widen"
            self.split_k[b] = SplitKAttention(a.nkv, a.nh // a.nkv, a.hd, b, self.device, q8=q8)
        return self.split_k[b]

    def _body(self, b: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        m, dt = self.m, self.dtype
        h = m.embed(self.ids) if self.ids is not None else self.res
        if self.ids is not None and m.args.embed_scale != 1.0:
            h = h * torch.tensor(m.args.embed_scale, dtype=h.dtype)  # as Transformer._run
        tabs = {"global": self._rope(m.inv_freq, m.rope_factor)}
        if m.inv_freq_window is not None:
            tabs["window"] = self._rope(m.inv_freq_window, 1.0)
        ring_pos = {S: self.pos % S for S in self.rings}  # a window layer's row for pos
        if self.use_split_k:
            mask = self.pos + 1  # the live keys, read on the device by the split-K kernel
        else:
            mask = torch.zeros(b, dtype=dt, device=self.device).masked_fill(self.ar[:b] > self.pos, float("-inf"))
            mask = mask.view(1, 1, 1, b)
        # the one layer body (strata.models.layer) with the fused kernels as its ops: each layer's last product, and the norm
        # it still takes (gemma3's post-MLP norm), added to the residual by the next norm's launch
        h = run_layers(m.layers.values(), h, RowOps(self, tabs, mask, b, ring_pos))
        if not m.has_head:
            return h, None, None
        logits = self._logits(h[0, -1])  # the head in the graph too: eager, its launches cost more than its GEMV
        if self.fused:
            from strata.kernels.decode_kernels import argmax
            return h, logits, argmax(logits)
        return h, logits, logits.argmax()

    def _rope(self, inv: torch.Tensor, f: float) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin (1, 1, hd) of pos, as Transformer.rope (f: YaRN's attention factor)."""
        freqs = self.pos.to(torch.float32)[:, None] * inv[None]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = (emb.cos(), emb.sin()) if f == 1.0 else (emb.cos() * f, emb.sin() * f)
        return rope_tables(cos.to(self.dtype), sin.to(self.dtype))

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """The final norm and head of one row; a dense head by strata.kernels.decode_gemv like the layers' products."""
        m = self.m
        w = m.head.weight
        if not self.fused or m.decode_weights is not None or not fusable(m.norm, h):
            return m.logits(h, decode=True)  # (its final softcap included)
        from strata.kernels.decode_kernels import rms_norm
        if isinstance(w, Packed):  # on its blocks, with x's int8 rounding from the norm's launch where it reads that
            if not m.head.int8_x(h.device):
                return m.logits(h, decode=True)
            x, xq = rms_norm(h, m.norm.weight, m.norm.eps, int8=True)
            out = m.head(x.view(1, -1), xq=xq)[0]
        else:
            from strata.kernels.decode_gemv import matvec
            out = matvec(rms_norm(h, m.norm.weight, m.norm.eps), w, mode=self.kernels.decode_gemv).float()
        c = m.args.final_softcap
        return out if c is None else torch.tanh(out / c) * c

    def _int8_inputs(self, r) -> dict[str, bool]:
        """Per product of a layer (qkv, wo, w13, w2): whether its kernel reads x rounded to int8 (RowOps.products)."""
        want = self.fused and isinstance(r, ResidentMatrices)
        return {p: want and r.int8_x(p) for p in ("qkv", "wo", "w13", "w2")}
