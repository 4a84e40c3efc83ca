"""Gated DeltaNet (Qwen3.5's linear-attention layers): a short causal convolution over q, k, v, then the gated delta
rule over a fixed-size state per value head. A chunk starts from the state the previous chunk left (and the
convolution from its last kernel - 1 inputs), so chunked prefill equals one pass over the prompt; a state serves
only the position it was taken at.

CPU reference: the delta rule token by token in float32, batched over heads (correct; its time grows with the
tokens, one small step each). The CUDA path of the issue (a chunked kernel library) is not here yet.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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

    def setup_state(self, device) -> int:
        self.conv_state = torch.zeros(self.conv_dim, self.K - 1, device=device, dtype=self.wqkv.dtype)
        self.state = torch.zeros(self.nv, self.dk, self.dv, device=device, dtype=torch.float32)
        self.state_pos = 0
        return self.state_bytes

    @property
    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv_state, self.state) if t is not None)

    def forward(self, x: torch.Tensor, w=None, pos: int = 0, cos=None, sin=None) -> torch.Tensor:
        """x (1, T, dim) at positions [pos, pos + T) -> (1, T, dim). pos 0 starts afresh; any other pos must be
        where the state stands (the previous call's end)."""
        if self.state is None:
            raise RuntimeError("linear attention state not allocated: call Transformer.setup_cache first")
        if pos == 0:
            self.conv_state.zero_()
            self.state.zero_()
        elif pos != self.state_pos:
            raise ValueError(f"linear attention: its state stands at position {self.state_pos}, not {pos} "
                             "(a recurrent state serves only the position it was taken at)")
        h = x.reshape(-1, x.shape[-1])
        T = h.shape[0]
        mixed = torch.cat((self.conv_state, F.linear(h, self.wqkv).t()), 1)    # (conv_dim, K - 1 + T)
        self.conv_state.copy_(mixed[:, -(self.K - 1):])
        qkv = F.silu(F.conv1d(mixed[None], self.conv[:, None], groups=self.conv_dim)[0]).t()  # (T, conv_dim)
        kdim = self.nk * self.dk
        q = qkv[:, :kdim].reshape(T, self.nk, self.dk)
        k = qkv[:, kdim:2 * kdim].reshape(T, self.nk, self.dk)
        v = qkv[:, 2 * kdim:].reshape(T, self.nv, self.dv)
        beta = F.linear(h, self.wb).sigmoid().float()                         # (T, nv)
        g = -self.a_log.float().exp() * F.softplus(F.linear(h, self.wa).float() + self.dt_bias.float())
        y = self._delta_rule(q, k, v, g, beta)                                # (T, nv, dv) float32
        z = F.linear(h, self.wz).reshape(T, self.nv, self.dv)
        # a gated RMSNorm over each head's values: normed, the weight, times silu(z)
        yn = (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        yn = (self.norm * yn).float() * F.silu(z.float())
        self.state_pos = pos + T
        return F.linear(yn.to(x.dtype).reshape(T, -1), self.wo).view(x.shape)

    def _delta_rule(self, q, k, v, g, beta) -> torch.Tensor:
        """The gated delta rule from the state, token by token in float32; leaves the state at the last token."""
        rep = self.nv // self.nk  # each q/k head serves rep consecutive value heads
        q, k = _l2norm(q.float()), _l2norm(k.float())
        q, k = q.repeat_interleave(rep, 1) * self.dk ** -0.5, k.repeat_interleave(rep, 1)  # (T, nv, dk)
        v = v.float()
        S = self.state
        out = torch.empty(q.shape[0], self.nv, self.dv, dtype=torch.float32, device=q.device)
        for t in range(q.shape[0]):
            S.mul_(g[t].exp()[:, None, None])
            mem = torch.einsum("hkv,hk->hv", S, k[t])
            delta = (v[t] - mem) * beta[t][:, None]
            S.add_(k[t][:, :, None] * delta[:, None, :])
            out[t] = torch.einsum("hkv,hk->hv", S, q[t])
        return out


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)
