"""DeepSeek sparse attention (DSA: DeepSeek V3.2, GLM-5) on top of MLA: the lightning indexer and the top-k attention.

The indexer gives every query row a score for each position it may see: its heads' queries (from q's low-rank
residual) against one key per position (a projection of the layer's input, LayerNorm-ed), ReLU, weighted by the
row's per-head weights, summed. Each row then attends to its index_topk best positions only. The indexer's key is
cached beside the latent (the K row is [latent | roped key | index key]), so the prefix cache and KV files carry it;
a chunked prefill sees exactly the positions one pass over the prompt does. Where a row sees no more positions than
index_topk, its selection is all of them: plain causal MLA. GLM-5's "shared" layers take the layer before's
selection (a stage never starts on one: ModelArgs.stage_start_refusal).

The selected positions' latents are gathered and attended in MLA's absorbed form (one shared key head): a sparse
row's cost no longer grows with the prompt.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from strata.kernels.attention import rope_rows

INDEX_NORM_EPS = 1e-6  # the reference indexer's LayerNorm(index_head_dim, eps=1e-6)
# values made at once: float32 scores (rows x heads x positions) while scoring the prefix, and gathered latents (rows x
# top-k x width) attended; a GPU's (the planner counts them) are larger: fewer, larger launches
BUDGET = {"cpu": 1 << 24, "cuda": 1 << 28}


def budget(device: torch.device) -> int:
    return BUDGET.get(device.type, BUDGET["cpu"])


class Indexer(nn.Module):
    """A layer's lightning indexer: wq_b (heads * dim, q_lora_rank), wk (dim, model dim), the key's LayerNorm
    (k_norm_w, k_norm_b), w (heads, model dim). Rows are held with the roped values in halves order."""

    def __init__(self, args):
        super().__init__()
        self.heads, self.dim, self.rope, self.topk = (args.index_heads, args.index_head_dim, args.qk_rope_dim,
                                                      args.index_topk)
        self.scale = self.dim ** -0.5
        self.wq_b = self.wk = self.k_norm_w = self.k_norm_b = self.w = None

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The rows' index keys (T, dim): wk, LayerNorm, its first `rope` values roped."""
        k = F.layer_norm(F.linear(x, self.wk), (self.dim,), self.k_norm_w, self.k_norm_b, INDEX_NORM_EPS)
        return rope_rows(k[:, None], cos, sin)[:, 0]

    def queries(self, q_resid: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """The rows' index queries (T, heads, dim) and their head weights (T, heads), float32."""
        q = rope_rows(F.linear(q_resid, self.wq_b).view(-1, self.heads, self.dim), cos, sin)
        return q, F.linear(x, self.w).float() * self.heads ** -0.5


def select(ix: Indexer, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, pos: int) -> torch.Tensor | None:
    """The top-k positions of each of n rows at [pos, pos + n) over keys (pos + n, dim) -> (n, k) int64, or None
    where every row may see no more than k positions (the selection is all of them). A row that sees fewer than k
    takes some it may not see: `sparse_attention` masks those."""
    n, L = q.shape[0], keys.shape[0]
    if L <= ix.topk:
        return None
    qf, kf = q.float(), keys.float()
    scores = torch.empty(n, L, dtype=torch.float32, device=q.device)
    step = max(1, budget(q.device) // max(1, n * ix.heads))
    for lo in range(0, L, step):
        s = torch.einsum("thd,ld->thl", qf, kf[lo:lo + step]) * ix.scale
        scores[:, lo:lo + step] = torch.einsum("th,thl->tl", w, F.relu(s))
    future = torch.arange(L, device=q.device)[None] > (pos + torch.arange(n, device=q.device))[:, None]
    return scores.masked_fill_(future, float("-inf")).topk(ix.topk, -1).indices


def sparse_attention(a, q_nope, q_rot, cached, pos: int, idx: torch.Tensor) -> torch.Tensor:
    """MLA's absorbed form over each row's selected positions: q_nope through kv_b's key rows, scores against the
    gathered [latent | roped key] rows (those past the row's position masked), the softmax in float32, the latents
    weighted, then kv_b's value rows -> (n, nh * vd)."""
    n = q_nope.shape[0]
    wk, wv = a.kv_b()
    width = a.rank + a.rope
    kv = cached[0, 0, :, :width]
    q = torch.cat((torch.einsum("thd,hdr->thr", q_nope, wk), q_rot), -1)  # (n, nh, width)
    out = torch.empty(n, a.nh, a.rank, dtype=q.dtype, device=q.device)
    step = max(1, budget(q.device) // (idx.shape[1] * width))
    for lo in range(0, n, step):
        sel = idx[lo:lo + step]
        g = kv[sel]  # (r, k, width)
        s = torch.einsum("rhw,rkw->rhk", q[lo:lo + step], g).float() * a.scale
        late = sel > (pos + lo + torch.arange(sel.shape[0], device=sel.device))[:, None]
        p = s.masked_fill_(late[:, None], float("-inf")).softmax(-1).to(q.dtype)
        out[lo:lo + step] = torch.einsum("rhk,rkc->rhc", p, g[..., :a.rank])
    return torch.einsum("thr,hvr->thv", out, wv).reshape(n, a.nh * a.vd)
