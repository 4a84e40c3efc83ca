"""Gated DeltaNet (Qwen3.5's linear-attention layers): a short causal convolution over q, k, v, then the gated delta
rule over a fixed-size state per value head. A chunk starts from the state the previous chunk left (and the
convolution from its last kernel - 1 inputs), so chunked prefill equals one pass over the prompt; a state serves
only the position it was taken at.

The delta rule, per value head, with a_t = exp(g_t) and S (dk, dv) float32:
    S_t = a_t S_{t-1} + k_t d_t^T,   d_t = beta_t (v_t - a_t S_{t-1}^T k_t),   o_t = S_t^T q_t.
Three forms of it, all from and into the same state (nv, dk, dv) float32 (fla's [HV, K, V] too):
- `delta_rule_tokens`: token by token (the reference; its time is T small steps).
- `delta_rule_chunked`: chunks of 64 tokens: each chunk's corrections d solved at once from a unit lower-triangular
  system, then one state update per chunk (the prefill on CPU, and on CUDA where fla-core is absent).
- `delta_rule_fla`: fla-core's Triton kernel of the same chunked form (prefill on CUDA in bfloat16/float16).
One-token steps (`delta_step`) are the recurrence's body on the state in place: no host sync, graph-capturable.
"""
from __future__ import annotations

import logging
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("strata.models.linear_attention")
CHUNK = 64  # tokens per block of the chunked form (fla's too)


class GatedDeltaNet(nn.Module):
    """wqkv (2 kdim + vdim, dim); wz (vdim, dim): the output gate; wb, wa (nv, dim): beta and the decay's input;
    conv (2 kdim + vdim, K); dt_bias, a_log (nv,); norm (dv,): plain RMSNorm weight; wo (dim, vdim)."""

    def __init__(self, args):
        super().__init__()
        self.nk, self.dk, self.nv, self.dv = args.lin_k_heads, args.lin_k_dim, args.lin_v_heads, args.lin_v_dim
        self.K, self.eps = args.lin_conv, args.norm_eps
        kdim, vdim = self.nk * self.dk, self.nv * self.dv
        self.conv_dim = 2 * kdim + vdim
        e = lambda *s: nn.Parameter(torch.empty(*s), requires_grad=False)  # noqa: E731
        self.wqkv, self.wz = e(self.conv_dim, args.dim), e(vdim, args.dim)
        self.wb, self.wa = e(self.nv, args.dim), e(self.nv, args.dim)
        self.conv, self.dt_bias, self.a_log = e(self.conv_dim, self.K), e(self.nv), e(self.nv)
        self.norm, self.wo = e(self.dv), e(args.dim, vdim)
        self.window, self.rope_kind = None, "global"  # (read where layers are asked for their attention's)
        self.k_cache = self.v_cache = None  # no KV cache: the state below
        self.conv_state: torch.Tensor | None = None  # (conv_dim, K - 1): the last inputs
        self.state: torch.Tensor | None = None       # (nv, dk, dv) float32
        self.state_pos = 0                           # the position the state continues from
        self.max_len = 0                             # positions the slice serves (Transformer.setup_cache)

    def setup_state(self, device, seqs: int = 1) -> int:
        """A state for each of `seqs` sequences (the rig's max_seqs: a slot each); slot 0's in use. Each kind of
        state of every slot in one tensor (slot s its [s]), so a decode batch reaches each row's by its slot
        (`mix_rows`)."""
        self._held, self._all, self.conv_state, self.state = None, (), None, None  # (the old states freed first)
        self._all = (torch.zeros(seqs, self.conv_dim, self.K - 1, device=device, dtype=self.conv.dtype),
                     torch.zeros(seqs, self.nv, self.dk, self.dv, device=device, dtype=torch.float32))
        self._held = [[self._all[0][s], self._all[1][s], 0] for s in range(seqs)]
        self.slot = -1
        self.use(0)
        return self.state_bytes

    def use(self, slot: int) -> None:
        """Sequence `slot`'s states from now on (Transformer.use_slot); the one in use keeps where it stands."""
        if slot == self.slot:
            return
        if self.slot >= 0:
            self._held[self.slot][2] = self.state_pos
        self.conv_state, self.state, self.state_pos = self._held[slot]
        self.slot = slot

    def held(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence `slot`'s states (conv, delta rule), in place: read or written without `use` (the prefix cache's
        copies, while another slot's chunk may be between two layers)."""
        return self._held[slot][0], self._held[slot][1]

    def slot_states(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every slot's states: the convolution's (seqs, conv_dim, K - 1), the delta rule's (seqs, nv, dk, dv)."""
        return self._all

    def position(self, slot: int) -> int:
        """Where sequence `slot`'s states stand."""
        return self.state_pos if slot == self.slot else self._held[slot][2]

    def begin_slot(self, slot: int, pos: int) -> None:
        """`begin` for sequence `slot` (in use or not): pos 0 zeroes its states, any other pos must be where they
        stand."""
        if pos == 0:
            for t in self.held(slot):
                t.zero_()
        elif pos != self.position(slot):
            raise ValueError(f"linear attention: slot {slot}'s state stands at position {self.position(slot)}, not "
                             f"{pos} (a recurrent state serves only the position it was taken at)")

    def begin_rows(self, slots: list[int], positions: list[int]) -> None:
        """`begin_slot` for each row of a decode batch (its slot, its position)."""
        for s, p in zip(slots, positions):
            self.begin_slot(s, p)

    def step_rows(self, slots: list[int], positions: list[int]) -> None:
        """After a decode batch stepped each row: its slot's states stand one past its position."""
        for s, p in zip(slots, positions):
            self.stand_at(s, p + 1)

    def stand_at(self, slot: int, pos: int) -> None:
        """Sequence `slot`'s states stand at `pos` (restored there)."""
        if slot == self.slot:
            self.state_pos = pos
        else:
            self._held[slot][2] = pos

    @property
    def state_bytes(self) -> int:
        """Every slot's states."""
        return sum(t.numel() * t.element_size() for t in getattr(self, "_all", ()))

    def products(self) -> "LinearProducts":
        """The layer's products on its own dense matrices (a resident layer's come from its ResidentMatrices)."""
        return LinearProducts(lambda h: F.linear(h, self.wqkv), lambda h: F.linear(h, self.wz),
                              lambda h: (F.linear(h, self.wb), F.linear(h, self.wa)), lambda y: F.linear(y, self.wo))

    def begin(self, pos: int) -> None:
        """Before T tokens at `pos`: pos 0 starts afresh (the states zeroed in place); any other pos must be where the
        state stands (the previous call's end). Host-side only: CUDA graphs of the step call it before a replay."""
        if self.state is None:
            raise RuntimeError("linear attention state not allocated: call Transformer.setup_cache first")
        if pos == 0:
            self.conv_state.zero_()
            self.state.zero_()
        elif pos != self.state_pos:
            raise ValueError(f"linear attention: its state stands at position {self.state_pos}, not {pos} "
                             "(a recurrent state serves only the position it was taken at)")

    def forward(self, x: torch.Tensor, w=None, pos: int = 0, cos=None, sin=None) -> torch.Tensor:
        """x (1, T, dim) at positions [pos, pos + T) -> (1, T, dim) (see `begin`). w: the block's matrices; a
        resident layer's (`linear()`, strata.models.resident.LazyMats) when it holds none of its own."""
        self.begin(pos)
        p = self.products() if self.wqkv is not None else w.linear()
        out = self.mix(x.reshape(-1, x.shape[-1]), p)
        self.state_pos = pos + x.shape[-2]
        return out.view(x.shape)

    def mix(self, h: torch.Tensor, p: "LinearProducts") -> torch.Tensor:
        """The layer on rows h (T, dim) from the states as they stand, left after the last row; products `p`.
        No host sync and no size read from the device: the CUDA decode graphs capture it for T = 1."""
        T = h.shape[0]
        mixed = torch.cat((self.conv_state, p.qkv(h).t()), 1)                  # (conv_dim, K - 1 + T)
        self.conv_state.copy_(mixed[:, -(self.K - 1):])
        if T == 1:  # one output of the depthwise convolution: a product and a sum (no conv kernel to plan)
            conv = (mixed.float() * self.conv.float()).sum(-1, keepdim=True).to(mixed.dtype)
        else:
            conv = F.conv1d(mixed[None], self.conv[:, None], groups=self.conv_dim)[0]
        qkv = F.silu(conv).t()                                                  # (T, conv_dim)
        kdim = self.nk * self.dk
        q = qkv[:, :kdim].reshape(T, self.nk, self.dk)
        k = qkv[:, kdim:2 * kdim].reshape(T, self.nk, self.dk)
        v = qkv[:, 2 * kdim:].reshape(T, self.nv, self.dv)
        b, a = p.ba(h)
        beta = b.sigmoid().float()                                              # (T, nv)
        g = -self.a_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        y = gated_delta_rule(self.state, q, k, v, g, beta)                      # (T, nv, dv) float32
        z = p.z(h).reshape(T, self.nv, self.dv)
        # a gated RMSNorm over each head's values: normed, the weight, times silu(z)
        yn = (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)).to(h.dtype)
        yn = (self.norm * yn).float() * F.silu(z.float())
        return p.o(yn.to(h.dtype).reshape(T, -1))


    def mix_rows(self, h: torch.Tensor, p: "LinearProducts", slots: torch.Tensor, live: torch.Tensor,
                 write: bool = True) -> torch.Tensor:
        """One token of each of r sequences (a decode batch: row t of h (r, dim) is slot slots[t]'s next token):
        `mix` of one row for each, from that slot's states, which are left after it. live (r,) bool: a row that is
        not live (a padding row, slots[t] repeating row 0's) writes row 0's new states again, so its slot's states
        are what row 0 left. write=False: nothing is written (a graph's warm-up run). Device ops only, sized by r:
        a CUDA graph captures it."""
        r = h.shape[0]
        conv_all, state_all = self._all
        mixed = torch.cat((conv_all.index_select(0, slots), p.qkv(h)[:, :, None].to(conv_all.dtype)), 2)
        conv = (mixed.float() * self.conv.float()).sum(-1).to(mixed.dtype)     # (r, conv_dim), as mix's one row
        qkv = F.silu(conv)
        kdim = self.nk * self.dk
        q = qkv[:, :kdim].reshape(r, self.nk, self.dk)
        k = qkv[:, kdim:2 * kdim].reshape(r, self.nk, self.dk)
        v = qkv[:, 2 * kdim:].reshape(r, self.nv, self.dv)
        b, a = p.ba(h)
        beta = b.sigmoid().float()
        g = -self.a_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        S = state_all.index_select(0, slots)                                   # (r, nv, dk, dv): each row's own
        y = delta_step_rows(S, *_heads(q, k, v), g, beta)
        if write:
            src = torch.where(live, torch.arange(r, device=h.device), torch.zeros_like(slots))
            state_all.index_copy_(0, slots, S.index_select(0, src))            # (a repeated slot: the same bytes)
            conv_all.index_copy_(0, slots, mixed[:, :, 1:].index_select(0, src))
        z = p.z(h).reshape(r, self.nv, self.dv)
        yn = (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)).to(h.dtype)
        yn = (self.norm * yn).float() * F.silu(z.float())
        return p.o(yn.to(h.dtype).reshape(r, -1))


class LinearProducts(NamedTuple):
    """A Gated DeltaNet layer's products on its rows: qkv (T, dim) -> (T, conv_dim); z -> (T, vdim); ba -> (beta's
    input, the decay's input), each (T, nv); o (T, vdim) -> (T, dim). Dense matrices, resident blocks dequantized
    into the scratch (prefill), or multiplied on the blocks (decode)."""
    qkv: Callable
    z: Callable
    ba: Callable
    o: Callable


def gated_delta_rule(S, q, k, v, g, beta, impl: str | None = None) -> torch.Tensor:
    """The gated delta rule over T tokens from the state S (nv, dk, dv) float32, left at the last token.
    q, k (T, nk, dk) before their L2 norm; v (T, nv, dv); g (log decay), beta (T, nv) float32 -> (T, nv, dv) float32.
    Value head h reads q/k head h // (nv // nk) (transformers' and fla's grouping). `impl` forces one form
    ("tokens", "chunked", "fla", "step"); by default a step for one token, else fla where it serves, else chunked."""
    if impl is None:
        impl = "step" if q.shape[0] == 1 else "fla" if _fla_serves(q) else "chunked"
    if impl == "fla":
        return delta_rule_fla(S, q, k, v, g, beta)
    forms = {"tokens": delta_rule_tokens, "chunked": delta_rule_chunked, "step": delta_step}
    if impl not in forms:
        raise ValueError(f"unknown delta rule form {impl!r} (tokens, chunked, fla, step)")
    return forms[impl](S, *_heads(q, k, v), g, beta)


def _heads(q, k, v):
    """q, k L2-normed (q also scaled by dk^-0.5), all float32; q/k heads stay shared (each form groups them)."""
    q, k = _l2norm(q.float()), _l2norm(k.float())
    return q * q.shape[-1] ** -0.5, k, v.float()


def delta_step(S, q, k, v, g, beta) -> torch.Tensor:
    """One token (T = 1) on S in place: q, k (1, nk, dk) as `_heads` makes them, v (1, nv, dv). Only device ops on
    the state and the inputs (no host sync, nothing sized by data), so a CUDA graph can capture it."""
    nk, dk = k.shape[1:]
    rep = S.shape[0] // nk  # (an expand, not repeat_interleave: nothing that could read a size back from the device)
    q, k = (x[0, :, None].expand(nk, rep, dk).reshape(-1, dk) for x in (q, k))  # (nv, dk)
    S.mul_(g[0].exp()[:, None, None])
    delta = (v[0] - torch.einsum("hkv,hk->hv", S, k)) * beta[0][:, None]
    S.add_(k[:, :, None] * delta[:, None, :])
    return torch.einsum("hkv,hk->hv", S, q)[None]


def delta_step_rows(S, q, k, v, g, beta) -> torch.Tensor:
    """delta_step for r sequences at once, each on its own state: S (r, nv, dk, dv) in place; q, k (r, nk, dk) as
    `_heads` makes them, v (r, nv, dv), g, beta (r, nv) -> (r, nv, dv)."""
    r, nk, dk = k.shape
    rep = S.shape[1] // nk
    q, k = (x[:, :, None].expand(r, nk, rep, dk).reshape(r, -1, dk) for x in (q, k))  # (r, nv, dk)
    S.mul_(g.exp()[:, :, None, None])
    delta = (v - torch.einsum("rhkv,rhk->rhv", S, k)) * beta[:, :, None]
    S.add_(k[:, :, :, None] * delta[:, :, None, :])
    return torch.einsum("rhkv,rhk->rhv", S, q)


def delta_rule_tokens(S, q, k, v, g, beta) -> torch.Tensor:
    """The reference: one step per token (q, k, v as `_heads` makes them)."""
    out = torch.empty(q.shape[0], *v.shape[1:], dtype=torch.float32, device=q.device)
    for t in range(q.shape[0]):
        out[t] = delta_step(S, q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1])[0]
    return out


def delta_rule_chunked(S, q, k, v, g, beta, C: int = CHUNK) -> torch.Tensor:
    """The same recurrence, C tokens at a time (q, k, v as `_heads` makes them).

    In a chunk starting from state S0, with G_t the cumulative log decay from the chunk's start (t = 1..C), the
    unrolled recurrence is S_t = e^{G_t} S0 + sum_{i<=t} e^{G_t - G_i} k_i d_i^T. Putting it into d_t's definition:
        d_t + beta_t sum_{i<t} e^{G_t - G_i} (k_t . k_i) d_i = beta_t v_t - beta_t e^{G_t} S0^T k_t,
    a unit lower-triangular system (I + A) d = U' - W' S0, so d = U - W S0 with U, W solved once per chunk,
    independent of S0 (all chunks at once). Then per chunk, in order:
        o_t = e^{G_t} S0^T q_t + sum_{i<=t} e^{G_t - G_i} (q_t . k_i) d_i,
        S_C = e^{G_C} S0 + sum_i e^{G_C - G_i} k_i d_i^T.
    Decays appear only as differences G_t - G_i with i <= t (<= 1, no overflow). The tail is padded with
    k = v = q = beta = g = 0: d = 0 there, and the state passes through unchanged. The products q.k and k.k are
    per q/k head, shared by its nv // nk value heads (broadcast, not repeated)."""
    T, nk, dk = k.shape
    nv, dv = v.shape[1:]
    n, pad = -(-T // C), -T % C
    # (reshape, not view: with no padding F.pad may hand back v itself, a strided view of the convolution's output)
    blk = lambda x: F.pad(x, (0, 0, 0, 0, 0, pad)).reshape(n, C, x.shape[1], -1).transpose(1, 2).contiguous()  # noqa
    q, k, v = blk(q), blk(k), blk(v)                                     # (n, heads, C, d)
    G = F.pad(g, (0, 0, 0, pad)).reshape(n, C, nv).transpose(1, 2).cumsum(-1).contiguous()  # (n, nv, C)
    b = F.pad(beta, (0, 0, 0, pad)).reshape(n, C, nv).transpose(1, 2).contiguous()[..., None]
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # (n, nv, C, C), 0 above
    group = lambda x: x.reshape(n, nk, -1, *x.shape[2:])                # noqa: E731 value heads by their q/k head
    shared = lambda x: x[:, :, None]                                     # noqa: E731 a q/k head's, to its group
    kk, qk = k @ k.transpose(-1, -2), q @ k.transpose(-1, -2)           # (n, nk, C, C)
    A = (group(b * decay) * shared(kk)).reshape(n, nv, C, C).tril(-1)
    A.diagonal(dim1=-2, dim2=-1).fill_(1.0)
    bk = (group(b * G.exp()[..., None]) * shared(k)).reshape(n, nv, C, dk)
    UW = torch.linalg.solve_triangular(A, torch.cat((b * v, bk), -1), upper=False, unitriangular=True)
    U, W = UW[..., :dv], UW[..., dv:]                                    # (n, nv, C, dv), (n, nv, C, dk)
    P = (group(decay) * shared(qk)).reshape(n, nv, C, C)                # q_t . k_i, i <= t, decayed
    qg = (group(G.exp()[..., None]) * shared(q)).reshape(n, nv, C, dk)
    kd = (group((G[..., -1:] - G).exp()[..., None]) * shared(k)).reshape(n, nv, C, dk)  # k_i decayed to the end
    gC = G[..., -1].exp()                                                # (n, nv)
    out = torch.empty(n, nv, C, dv, dtype=torch.float32, device=q.device)
    for j in range(n):
        d = U[j] - W[j] @ S                                              # (nv, C, dv)
        torch.baddbmm(qg[j] @ S, P[j], d, out=out[j])
        S.mul_(gC[j, :, None, None]).add_(kd[j].transpose(-1, -2) @ d)
    return out.transpose(1, 2).reshape(n * C, nv, dv)[:T]


def delta_rule_fla(S, q, k, v, g, beta) -> torch.Tensor:
    """fla-core's chunked kernel, q, k, v in their own dtype (L2 norms in the kernel, q/k heads shared by value
    heads there), from S and back into S in place. Its dots run in TF32 for float32 inputs (~1e-3)."""
    kernel = _fla_kernel()
    if kernel is None:
        raise RuntimeError("the delta rule's fla form needs fla-core (pip install 'strata[cuda]')")
    o, final = kernel(q[None], k[None], v[None], g[None], beta[None], scale=q.shape[-1] ** -0.5,
                      initial_state=S[None], output_final_state=True, use_qk_l2norm_in_kernel=True)
    S.copy_(final[0])
    return o[0].float()


_FLA: object = None  # fla's chunk_gated_delta_rule once looked up; False where it does not import


def _fla_kernel():
    global _FLA
    if _FLA is None:
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule
            _FLA = chunk_gated_delta_rule
        except ImportError as e:
            log.warning("fla-core not importable (%s): the delta rule's CUDA prefill runs the chunked torch form "
                        "(pip install 'strata[cuda]')", e)
            _FLA = False
    return _FLA or None


def _fla_serves(q: torch.Tensor) -> bool:
    """fla on CUDA for 16-bit inputs. A float32 model stays on the torch form: fla's TF32 dots (~1e-3) would
    hide what the float32 checks (1e-5 against the CPU path) are for."""
    return q.is_cuda and q.dtype != torch.float32 and _fla_kernel() is not None


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)
