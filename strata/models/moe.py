"""A mixture-of-experts MLP: a router (softmax top k, or sigmoid scores chosen with a bias in groups) and SwiGLU
experts, tokens grouped by expert, and a shared expert beside them where the family has one.

Prefill: the (token, choice) pairs are sorted by expert and each expert's rows multiplied at once: one grouped GEMM
on CUDA (torch._grouped_mm, where this torch has it and the shapes suit it), else one batched GEMM over the experts
with their rows padded to the busiest expert's count; no Python loop over experts or tokens. A few rows (decode):
only the chosen experts' matrices are gathered and multiplied, so a step reads k experts, not all of them.

Resident experts (GGUF blocks as stored, strata.models.resident.ResidentExperts): prefill dequantizes a group of whole
experts at a time into the scratch and multiplies that group's rows with one grouped GEMM (a few groups a
layer, not a loop over experts); decode multiplies on the chosen experts' blocks (strata.quant.gemv) where it
takes their type, else dequantizes only those.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# at most this many (token, choice) pairs take the gather path (each reads its expert's matrices)
GATHER_PAIRS = 16


class MoE(nn.Module):
    """router (E, dim); w13 (E, 2 * effn, dim): each expert's gate rows then up rows; w2 (E, dim, effn)."""

    def __init__(self, args):
        super().__init__()
        self.n, self.k, self.effn = args.n_experts, args.n_experts_used, args.expert_ffn_dim
        self.renorm, self.kind, self.scale = args.router_renorm, args.router, args.routed_scale
        self.groups, self.groups_used = args.router_groups, args.router_groups_used
        self.router = nn.Parameter(torch.empty(self.n, args.dim), requires_grad=False)  # float32 for sigmoid
        # sigmoid: added to the scores to choose, not to weigh; topk_softmax: added to the logits
        self.router_bias = (nn.Parameter(torch.empty(self.n), requires_grad=False) if args.router != "softmax"
                            else None)
        self.act, self.alpha, self.limit = args.expert_act, args.swiglu_alpha, args.swiglu_limit
        self.bias = args.expert_bias  # b13 (E, 2 effn): gate then up; b2 (E, dim)
        if self.bias:
            self.b13 = nn.Parameter(torch.empty(self.n, 2 * self.effn), requires_grad=False)
            self.b2 = nn.Parameter(torch.empty(self.n, args.dim), requires_grad=False)
        self.w13 = nn.Parameter(torch.empty(self.n, 2 * self.effn, args.dim), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(self.n, args.dim, self.effn), requires_grad=False)
        self.sffn = args.shared_ffn_dim
        if self.sffn:
            self.s13 = nn.Parameter(torch.empty(2 * self.sffn, args.dim), requires_grad=False)
            self.s2 = nn.Parameter(torch.empty(args.dim, self.sffn), requires_grad=False)
        self.s_sig = nn.Parameter(torch.empty(1, args.dim), requires_grad=False) if args.shared_gate else None
        self.resident = None  # a ResidentExperts in place of w13 / w2 (strata.models.model.Transformer.load_weights)
        # strata.triton_state.TritonState: the slice's (Transformer), on which the router's, the weighted sum's and
        # the gated activation's Triton kernels fall back (None: tried on every call)
        self.triton_state = None
        self._router_count: torch.Tensor | None = None

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h (N, dim) -> (weights (N, k) in float32, expert ids (N, k)). softmax: over every expert's logit, the
        top k, renormalized to sum 1 where the family says so (Mixtral, Qwen3-MoE's norm_topk_prob). sigmoid
        (GLM-4.5): float32 scores; the choice by score + bias, within the best groups (a group's worth: its two
        best); the weights the chosen scores, renormalized, times the routed scale."""
        if self.kind != "sigmoid" and h.is_cuda and h.shape[0] * self.k <= GATHER_PAIRS:  # decode: one launch
            from strata.kernels.fused import route, router
            count = self._count(h.device) if h.shape[0] == 1 else None
            if count is not None:  # the logits in the route's launch (a gemv and the route were 8.3 us a layer)
                fused = router(h[0], self.router, self.router_bias, count, self.k,
                               self.kind == "topk_softmax", self.renorm and self.kind == "softmax", self.triton_state)
                if fused is not None:
                    w, idx = fused
                    return (w * self.scale if self.scale != 1.0 else w), idx
            if h.shape[0] == 1:  # a matrix-vector product (cuBLAS gemv, ~2 us; F.linear's GEMM took 5)
                b = self.router_bias
                logits = (torch.mv(self.router, h[0]) if b is None else torch.addmv(b, self.router, h[0]))[None]
            else:
                logits = F.linear(h, self.router, self.router_bias)
            fused = route(logits, self.k, self.kind == "topk_softmax", self.renorm and self.kind == "softmax",
                          self.triton_state)
            if fused is not None:
                w, idx = fused
                return (w * self.scale if self.scale != 1.0 else w), idx
        if self.kind == "softmax":
            w, idx = F.linear(h, self.router).softmax(-1, dtype=torch.float32).topk(self.k, -1)
        elif self.kind == "topk_softmax":
            top, idx = F.linear(h, self.router, self.router_bias).topk(self.k, -1)
            w = top.softmax(-1).float()
        else:
            scores = F.linear(h.float(), self.router.float()).sigmoid()
            choice = scores + self.router_bias.float()
            if self.groups > 1:
                per = choice.view(-1, self.groups, self.n // self.groups)
                best = per.topk(2, -1)[0].sum(-1).topk(self.groups_used, -1)[1]
                keep = torch.zeros_like(per[..., 0]).scatter_(1, best, 1.0).bool()
                choice = per.masked_fill(~keep[..., None], float("-inf")).view(-1, self.n)
            idx = choice.topk(self.k, -1)[1]
            w = scores.gather(1, idx)
        if self.renorm:
            w = w / (w.sum(-1, keepdim=True) + (1e-20 if self.kind == "sigmoid" else 0.0))
        return (w * self.scale if self.scale != 1.0 else w), idx

    def _count(self, device) -> torch.Tensor | None:
        """strata.kernels.fused.router's launch counter for this layer on `device`: an int32 zero, which each launch leaves
        zero. Made outside any CUDA graph capture (the decode graphs' eager warm-up makes it): a zero made inside one
        would exist only in the graph's replays. None there (the two-launch route). The launches of one layer run
        on one stream, one after another, as a stage's do."""
        c = self._router_count
        if c is None or c.device != device:
            if torch.cuda.is_current_stream_capturing():
                return None
            c = self._router_count = torch.zeros(1, dtype=torch.int32, device=device)
        return c

    def int8_x(self, device) -> bool:
        """Whether a one-row step's gate/up experts kernel reads x rounded to int8 (then `forward` takes that
        rounding as xq, from the norm's launch before it: strata.decode.graphs)."""
        r = self.resident
        if r is None or not r.direct(device):
            return False
        from strata.quant import gemv
        return gemv.experts_int8(r.w13.qtype, r.kernels, r.w13.split)

    def unweighed(self, device) -> bool:
        """Whether `step_rows` serves a one-row step on `device`: the chosen experts' kernels on their blocks, and
        nothing added after their weighted sum (no shared expert)."""
        return self.resident is not None and self.resident.direct(device) and not self.sffn

    def step_rows(self, x: torch.Tensor, xq=None) -> tuple[torch.Tensor, torch.Tensor]:
        """One row x (1, dim) -> (its k experts' outputs (k, dim) in x's dtype, their float32 weights (1, k)): the
        step before its weighted sum, which the next norm's launch takes (strata.decode.graphs; `unweighed`)."""
        w, idx = self.route(x)
        return self._on_blocks(x, w, idx.reshape(-1), self.k, xq, weigh=False), w

    def gathers_any_rows(self, device) -> bool:
        """Whether the few-rows path serves any number of rows without copying experts: the chosen experts'
        kernels read their blocks in place (a decode batch then multiplies all its (row, expert) pairs in one launch,
        reading each pair's expert once, as that many separate steps would)."""
        return self.resident is not None and self.resident.direct(device)

    def forward(self, x: torch.Tensor, xq: tuple[torch.Tensor, torch.Tensor] | None = None,
                gather: bool = False) -> torch.Tensor:
        """x (..., dim) -> (..., dim). xq: one row's quantize_x rounding, where int8_x (else unused). gather: the
        few-rows path whatever the rows (a decode batch's, where `gathers_any_rows`; no host sync: graphs capture
        it)."""
        h = x.reshape(-1, x.shape[-1])
        w, idx = self.route(h)
        if gather or h.shape[0] * self.k <= GATHER_PAIRS:
            y = self._gathered(h, w, idx, xq if h.shape[0] == 1 else None)
        else:
            y = self._grouped(h, w, idx)
        if self.sffn:
            gu = F.linear(h, self.s13)
            s = F.linear(F.silu(gu[:, :self.sffn]) * gu[:, self.sffn:], self.s2)
            y = y + (s if self.s_sig is None else torch.sigmoid(F.linear(h, self.s_sig)) * s)
        return y.view(x.shape)

    def _gathered(self, h, w, idx, xq=None) -> torch.Tensor:
        """Few rows: each (row, choice) multiplies its expert's matrices, read for it alone."""
        n, k = idx.shape
        e = idx.reshape(-1)
        r = self.resident
        if r is not None and r.fused_ok(h.device):
            return self._on_blocks(h, w, e, k, xq)
        w13, w2 = r.chosen(e) if r is not None else (self.w13[e], self.w2[e])
        xs = h.repeat_interleave(k, 0).unsqueeze(-1)                     # (n*k, dim, 1)
        gu = torch.bmm(w13, xs).squeeze(-1)                              # (n*k, 2 effn)
        if self.bias:
            gu = gu + self.b13[e]
        y = torch.bmm(w2, self.gate(gu).unsqueeze(-1)).squeeze(-1)       # (n*k, dim)
        if self.bias:
            y = y + self.b2[e]
        return (y.float() * w.reshape(-1, 1)).view(n, k, -1).sum(1).to(h.dtype)

    def _on_blocks(self, h, w, e, k: int, xq=None, weigh: bool = True) -> torch.Tensor:
        """_gathered on the chosen experts' blocks, no dense copy of any expert. Where strata.quant.gemv has an
        experts kernel for both stacks' types: all (row, choice) gate/up products in one launch and all down
        products in another, the expert ids read on the device (only their blocks are read); x's int8 rounding
        from the caller (xq, one row) and the gated activation with its own rounding in one launch, where those
        kernels read int8. Else each expert's blocks are gathered first: a row's gate/up in one launch, each
        (row, choice)'s down in one."""
        from strata.quant import gemv
        p13, p2 = self.resident.w13, self.resident.w2
        kern = self.resident.kernels  # the slice's GemvKernels: which K-quant kernel, and its fallback
        n = h.shape[0]
        direct = self.resident.direct(h.device)
        if direct:  # x one row for all k slots of a token, else a row per slot
            gu = gemv.quant_matmul_experts(h if n == 1 else h.repeat_interleave(k, 0), p13.data, e, p13.qtype,
                                           p13.cols, kern, xq=xq if n == 1 else None, split=p13.split)
        else:
            b13, b2 = p13.data.index_select(0, e), p2.data.index_select(0, e)  # (n*k, rows, bytes)
            gu = torch.cat([gemv.quant_matmul(h[i:i + 1], b13[i * k:(i + 1) * k].view(-1, b13.shape[-1]), p13.qtype,
                                              p13.cols, kernels=kern) for i in range(n)]).view(n * k, -1)  # (n*k, 2 effn)
        if self.bias:
            gu = gu + self.b13[e]
        zq = None
        if direct and self.act == "silu" and self.effn % 32 == 0 and gemv.experts_int8(p2.qtype, kern, p2.split):
            from strata.kernels.decode_kernels import act_mul_rows  # the down products read z in int8: its rounding in this launch
            z, zq = act_mul_rows(gu.contiguous(), "silu", int8=True)
        else:
            z = self.gate(gu)
        if direct:
            y = gemv.quant_matmul_experts(z, p2.data, e, p2.qtype, p2.cols, kern, xq=zq, split=p2.split)  # (n*k, dim)
        else:
            y = torch.cat([gemv.quant_matmul(z[j:j + 1], b2[j], p2.qtype, p2.cols, kernels=kern) for j in range(n * k)])
        if self.bias:
            y = y + self.b2[e]
        if not weigh:  # (the caller sums them: step_rows)
            return y
        return weighed_sum(y, w, self.triton_state, h.dtype)

    def _grouped(self, h, w, idx) -> torch.Tensor:
        n, k = idx.shape
        flat = idx.reshape(-1)
        order = flat.argsort(stable=True)                                # pairs by expert
        tok = order // k
        counts = torch.bincount(flat, minlength=self.n)
        xs = h[tok]                                                      # (n*k, dim), expert-sorted
        b13, b2 = (self.b13, self.b2) if self.bias else (None, None)
        if self.resident is None:
            ys = _grouped_experts(xs, counts, self.w13, self.w2, self.gate, b13, b2)
        else:  # a group of experts at a time, dequantized into the scratch: their rows are adjacent in xs
            g, ends = self.resident.per_group, counts.cumsum(0).tolist()
            parts = []
            for g0 in range(0, self.n, g):
                g1 = min(self.n, g0 + g)
                a, b = (ends[g0 - 1] if g0 else 0), ends[g1 - 1]
                if a == b:
                    continue
                w13, w2 = self.resident.group(g0, g1)
                parts.append(_grouped_experts(xs[a:b], counts[g0:g1], w13, w2, self.gate,
                                              None if b13 is None else b13[g0:g1], None if b2 is None else b2[g0:g1]))
            ys = torch.cat(parts)
        ys = ys.float() * w.reshape(-1)[order, None]
        out = torch.zeros(n, h.shape[1], dtype=torch.float32, device=h.device)
        return out.index_add_(0, tok, ys).to(h.dtype)


    def gate(self, gu: torch.Tensor) -> torch.Tensor:
        """(..., 2 effn) gate then up -> (..., effn): silu(gate) * up, or gpt-oss's clamped form."""
        g, up = gu[..., :self.effn], gu[..., self.effn:]
        if self.act == "silu":
            if gu.is_cuda and gu.dim() == 2:  # one launch, rounded once (the dense MLP's kernel)
                from strata.kernels.fused import gated
                y = gated(g[None], up[None], "silu", self.triton_state)
                if y is not None:
                    return y[0]
            return F.silu(g) * up
        g = g.clamp(max=self.limit)
        return g * torch.sigmoid(g * self.alpha) * (up.clamp(-self.limit, self.limit) + 1)


def weighed_sum(y: torch.Tensor, w: torch.Tensor, state=None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Each token's k experts' outputs y (n * k, dim) summed with their float32 weights w (n, k), float32 inside,
    rounded to y's dtype -> (n, dim): strata.kernels.fused.weigh's one launch on CUDA, else (or where it failed) torch's,
    rounded to `dtype` (default y's)."""
    if y.is_cuda:
        from strata.kernels.fused import weigh
        out = weigh(y, w, state)
        if out is not None:
            return out
    n, k = w.shape
    return torch.bmm(w.view(n, 1, k), y.float().view(n, k, -1)).view(n, -1).to(dtype or y.dtype)


def _grouped_experts(xs: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, gate,
                     b13: torch.Tensor | None, b2: torch.Tensor | None) -> torch.Tensor:
    """Rows xs (N, dim) sorted by expert, counts[e] of them each -> each row's expert output (N, dim)."""
    E, N = counts.shape[0], xs.shape[0]
    e_of = torch.repeat_interleave(torch.arange(E, device=xs.device), counts, output_size=N)
    if xs.is_cuda and xs.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
        try:
            offs = counts.cumsum(0).to(torch.int32)
            gu = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs)
            if b13 is not None:
                gu = gu + b13[e_of]
            y = torch._grouped_mm(gate(gu).contiguous(), w2.transpose(1, 2), offs=offs)
            return y if b2 is None else y + b2[e_of]
        except (RuntimeError, TypeError):  # shapes or alignment it refuses: the padded batch below
            pass
    m = int(counts.max())
    start = counts.cumsum(0) - counts
    slot = torch.arange(N, device=xs.device) - start[e_of]               # each row's place in its expert's batch
    buf = xs.new_zeros(E, m, xs.shape[1])
    buf[e_of, slot] = xs
    gu = torch.bmm(buf, w13.transpose(1, 2))                             # (E, m, 2 effn)
    if b13 is not None:
        gu = gu + b13[:, None]
    y = torch.bmm(gate(gu), w2.transpose(1, 2))                          # (E, m, dim)
    if b2 is not None:
        y = y + b2[:, None]
    return y[e_of, slot]
