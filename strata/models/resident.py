"""Weights as a layer asks for them: dense matrices, or GGUF blocks held as stored and dequantized into one shared
scratch just before their layer runs; the quantized embedding and the sliced head."""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from strata.models.args import ModelArgs
from strata.triton_state import TritonState
from strata.models.weight_only import Products

from strata.models.args import DECODE_T  # noqa: F401  (the decode path's row bound, also read from here)

# -- weights as a Block asks for them ---------------------------------------------------------
@dataclass
class Quantized:
    """A matrix in its GGUF block format: `blocks` uint8 (rows, bytes_per_row), `cols` weights per row."""
    blocks: torch.Tensor
    qtype: str
    cols: int
    # columns stored in another order than the canonical one (a qwen35 GGUF's ssm_out: value heads tiled): canonical
    # column j is stored column col_perm[j]; blocks cannot move columns, so the order is undone where it is read
    col_perm: torch.Tensor | None = None


class Mats(NamedTuple):
    """One layer's matrices in the compute dtype, fused: q/k/v in one GEMM, gate/up in one."""
    wqkv: torch.Tensor
    bqkv: torch.Tensor | None
    wo: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    bo: torch.Tensor | None = None  # gpt-oss's output projection bias


# strata.quant.dequantize returns float32; at most this many values at once bounds that transient (32 MiB)
DEQUANT_PIECE = 1 << 23
_ALIGN = 64  # scratch regions start on 256-byte (fp32) boundaries: GEMMs see the same alignment as a fresh tensor

def _matrix_shapes(args: ModelArgs) -> dict[str, tuple[int, int]]:
    hd = args.head_dim
    out = {"wq": (args.n_heads * hd, args.dim), "wk": (args.n_kv_heads * hd, args.dim),
           "wv": (args.n_kv_heads * hd, args.dim), "wo": (args.dim, args.n_heads * hd),
           "w_gate": (args.ffn_dim, args.dim), "w_up": (args.ffn_dim, args.dim), "w_down": (args.dim, args.ffn_dim)}
    if args.attn_gate:  # qwen3_5: the output gate's rows, after v's in the qkv product
        out["wg"] = (args.n_heads * hd, args.dim)
    if args.latent:  # MLA's projections held resident (strata.models.mla.LatentMatrix), each its own group
        nh, r = args.n_heads, args.kv_lora_rank
        out.update(wq_a=(args.q_lora_rank, args.dim), wq_b=(nh * args.head_dim, args.q_lora_rank or 1),
                   wkv_a=(r + args.qk_rope_dim, args.dim), wo=(args.dim, nh * args.v_head_dim),
                   wq=(nh * args.head_dim, args.dim))
    if _has_linear(args):  # Gated DeltaNet's matrices (strata.models.linear_attention); lin_out_t: lin_out as stored
        kdim, vdim, nv = args.lin_k_heads * args.lin_k_dim, args.lin_v_heads * args.lin_v_dim, args.lin_v_heads
        out.update(lin_qkv=(2 * kdim + vdim, args.dim), lin_z=(vdim, args.dim), lin_b=(nv, args.dim),
                   lin_a=(nv, args.dim), lin_out=(args.dim, vdim), lin_out_t=(args.dim, vdim))
    return out


def _has_linear(args: ModelArgs) -> bool:
    return args.linear_layers is not None and any(args.linear_layers)


# a resident MoE layer's prefill dequantizes its experts this many weights at a time (a group of whole experts,
# each group one grouped GEMM): 256 MiB of bfloat16, so the scratch does not hold a whole layer of experts
EXPERT_GROUP_ELEMS = 1 << 27


def expert_group(args: ModelArgs) -> int:
    """Experts per prefill group of a resident MoE layer (see EXPERT_GROUP_ELEMS)."""
    return min(args.n_experts, max(1, EXPERT_GROUP_ELEMS // (3 * args.dim * args.expert_ffn_dim)))


def scratch_layout(args: ModelArgs) -> tuple[dict[str, tuple[int, int, int]], int]:
    """Where each matrix of a layer lands in the scratch: name -> (offset, rows, cols); and the total elements.

    A layer's products read their matrices one group at a time (LazyMats), so every group starts at 0 and the
    scratch holds the largest group, not the layer (Qwen3-32B: gate and up, 0.49 of a layer's 0.91 GiB in
    bfloat16). Within a group the matrices are adjacent: q, k, v (and qwen3_5's output gate: one wqkv view), gate
    and up (one w13 view), a group of experts' gate/up ("e13") and down ("e2"), which one grouped GEMM after the
    other reads; a linear-attention layer's q/k/v, z, beta and decay, out (and out as stored, where its columns are
    stored in another order). A dense MLP only where some layer has one; experts only where layers have them."""
    sh = _matrix_shapes(args)
    groups = ([("wq",), ("wq_a",), ("wq_b",), ("wkv_a",), ("wo",)] if args.latent
              else [("wq", "wk", "wv") + (("wg",) if args.attn_gate else ()), ("wo",)])
    if not all(args.is_moe(i) for i in range(args.n_layers)):
        groups += [("w_gate", "w_up"), ("w_down",)]
    if _has_linear(args):  # a linear layer's products in turn (GatedDeltaNet.mix); lin_out beside its stored order
        groups += [("lin_qkv",), ("lin_z",), ("lin_b", "lin_a"), ("lin_out", "lin_out_t")]
    if args.n_experts:
        g = expert_group(args)
        sh = dict(sh, e13=(g * 2 * args.expert_ffn_dim, args.dim), e2=(g * args.dim, args.expert_ffn_dim))
        groups += [("e13", "e2")]
    out, total = {}, 0
    for group in groups:
        off = 0
        for n in group:
            off = -(-off // _ALIGN) * _ALIGN
            r, c = sh[n]
            out[n] = (off, r, c)
            off += r * c
        total = max(total, off)
    return out, total


def head_rows(args: ModelArgs) -> int:
    """Vocabulary rows per head slice, in both load modes (the same slicing gives the same logits bits)."""
    _, total = scratch_layout(args)
    return max(1, min(args.vocab_size, total // args.dim))


def dequant_piece_bytes(args: ModelArgs) -> int:
    """Largest float32 transient strata.quant.dequantize returns while a resident slice runs."""
    sh = dict(_matrix_shapes(args), head=(args.vocab_size, args.dim))
    if args.n_experts:
        sh.update(e13=(2 * args.expert_ffn_dim, args.dim), e2=(args.dim, args.expert_ffn_dim))
    return max(min(r, max(1, DEQUANT_PIECE // c)) * c * 4 for r, c in sh.values())



def _dequantize(blocks: torch.Tensor, qtype: str, triton_state: TritonState | None = None) -> torch.Tensor:
    from strata.quant import dequantize
    return dequantize(blocks, qtype, triton_state)


def dequantize_into(out: torch.Tensor, blocks: torch.Tensor, qtype: str, cols: int,
                    triton_state: TritonState | None = None, slab: int = 0) -> torch.Tensor:
    """GGUF blocks (..., bytes a row) dequantized into `out` (rows, cols), in pieces that bound the float32
    transient; on CUDA one Triton kernel per type straight into out's dtype where strata.quant.into has one.
    triton_state: the caller's (a Packed's), on which a Triton kernel that fails falls back. slab: MXFP4 experts in
    strata.quant.mxfp4's split layout, this many blocks an expert (whole experts only); 0: the file's layout."""
    rb = blocks.shape[-1]
    blocks = blocks.reshape(-1, rb)
    if out.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":  # Triton imported only where it can run
        from strata.quant import into
        if into.takes(qtype, out, triton_state) and into.dequantize_into(out, blocks, qtype, triton_state, slab):
            return out
    step = max(1, DEQUANT_PIECE // cols)
    if slab:  # an expert at a time back in the file's layout (its bytes: a transient), then as below
        from strata.quant.mxfp4 import from_split
        per = slab * 17 // rb  # rows an expert
        for e0 in range(0, blocks.shape[0], per):
            fb = from_split(blocks[e0:e0 + per].reshape(1, per, rb))[0]
            for a in range(0, per, step):
                out[e0 + a:e0 + min(per, a + step)].copy_(_dequantize(fb[a:a + step], qtype, triton_state))
        return out
    for a in range(0, blocks.shape[0], step):
        out[a:a + step].copy_(_dequantize(blocks[a:a + step], qtype, triton_state))
    return out


class Scratch:
    """ONE buffer in the compute dtype that each resident layer is dequantized into just before it runs.

    Every layer (and the head, slice by slice) reuses it, so a stage holds its weights as stored plus
    one layer dense. A prefill chunk of thousands of tokens amortizes the dequantization."""

    def __init__(self, args: ModelArgs, device, dtype: torch.dtype):
        self.layout, total = scratch_layout(args)
        self.buf = torch.empty(total, device=device, dtype=dtype)
        self.piece_bytes = dequant_piece_bytes(args)

    def view(self, name: str) -> torch.Tensor:
        off, r, c = self.layout[name]
        return self.buf[off:off + r * c].view(r, c)

    def span(self, first: str, last: str) -> torch.Tensor:
        """Adjacent matrices first..last as one (rows, cols) view (wqkv, w13)."""
        off, _, c = self.layout[first]
        o2, r2, _ = self.layout[last]
        return self.buf[off:o2 + r2 * c].view(-1, c)

    def rows(self, n: int, cols: int) -> torch.Tensor:
        return self.buf[:n * cols].view(n, cols)

    @property
    def nbytes(self) -> int:
        """The buffer plus the bounded float32 transient of the dequantizer."""
        return self.buf.numel() * self.buf.element_size() + self.piece_bytes


class Packed(nn.Module):
    """One matrix as stored: GGUF blocks (uint8, rows of whole blocks) or, for F32/F16 tensors, dense in the compute dtype.
    triton_state: its slice's (Transformer.triton_state), on which its dequantization's Triton kernels fall back."""

    def __init__(self, data: torch.Tensor, qtype: str | None, cols: int, dtype: torch.dtype,
                 triton_state: TritonState | None = None, col_perm: torch.Tensor | None = None):
        super().__init__()
        self.register_buffer("data", data)
        self.qtype, self.cols, self.out_dtype = qtype, cols, dtype
        self.triton_state = triton_state
        self.split = False  # an MXFP4 expert stack re-laid by ResidentExperts (strata.quant.mxfp4.to_split)
        # Quantized.col_perm (canonical column j is stored column col_perm[j]) and its inverse, for x's order
        # (plain attributes, not counted in weight_bytes: 16 bytes a column, vdim of them)
        self.col_perm = self.col_inv = None
        if col_perm is not None:
            self.col_perm = col_perm.to(data.device)
            self.col_inv = _inverse(self.col_perm)

    @property
    def slab(self) -> int:
        """Blocks an expert where the stack is in MXFP4's split layout (the dequantizers' `slab`), else 0."""
        return self.data.shape[1] * (self.data.shape[2] // 17) if self.split else 0

    @property
    def n_rows(self) -> int:
        return self.data.shape[0]

    def into(self, out: torch.Tensor, r0: int = 0, r1: int | None = None,
             stored: torch.Tensor | None = None) -> torch.Tensor:
        """Rows [r0, r1) dequantized into `out` (r1 - r0, cols), in pieces that bound the float32 transient. With
        columns stored in another order (col_perm), dequantized into `stored` (out's shape) first, then gathered
        into out in the canonical order (the same values as a dense load's, so the same products)."""
        r1 = self.n_rows if r1 is None else r1
        if self.col_perm is not None:
            if stored is None:
                raise ValueError("a matrix with permuted columns dequantizes through a buffer of its own (stored)")
            self._into(stored, r0, r1)
            return torch.index_select(stored, 1, self.col_perm, out=out)
        return self._into(out, r0, r1)

    def _into(self, out: torch.Tensor, r0: int, r1: int) -> torch.Tensor:
        if self.qtype is None:
            return out.copy_(self.data[r0:r1])
        return dequantize_into(out, self.data[r0:r1], self.qtype, self.cols, self.triton_state, self.slab)

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (any shape) only: the embedding never dequantizes its whole table."""
        if self.qtype is None:
            return F.embedding(ids, self.data)
        rows = _dequantize(self.data[ids.reshape(-1)], self.qtype, self.triton_state)
        return rows.to(self.out_dtype).view(*ids.shape, self.cols)


@functools.lru_cache(maxsize=8)
def _inverse(perm: torch.Tensor) -> torch.Tensor:
    """The inverse of a column order (one for the matrices that share the order tensor)."""
    return torch.argsort(perm)


class _Linear(nn.Linear):
    """nn.Linear without its random initialisation: every weight comes from a checkpoint (or the synthetic
    generator), and initialising on the meta device imports torch's compiler for the random ops (~1 s of each
    stage's start-up on a 2-core box)."""

    def reset_parameters(self) -> None:
        pass


class DenseMatrices(nn.Module):
    """A layer's matrices held dense in the compute dtype (q/k/v and gate/up fused at load)."""

    def __init__(self, args: ModelArgs, mlp: bool = True, attn: bool = True):
        super().__init__()
        hd = args.head_dim
        # q, k, v (and the output gate's rows, attn_gate) in one GEMM; a linear-attention layer holds its own
        rows = (2 * args.n_heads + 2 * args.n_kv_heads if args.attn_gate else args.n_heads + 2 * args.n_kv_heads) * hd
        self.wqkv = _Linear(args.dim, rows, bias=args.qkv_bias) if attn else None
        self.wo = _Linear(args.n_heads * hd, args.dim, bias=args.o_bias) if attn else None
        # an MoE layer's experts live in its strata.models.moe.MoE
        self.w13 = _Linear(args.dim, 2 * args.ffn_dim, bias=False) if mlp else None
        self.w2 = _Linear(args.ffn_dim, args.dim, bias=False) if mlp else None

    def get(self) -> Mats:
        if self.wqkv is None:
            return Mats(None, None, None, self.w13 and self.w13.weight, self.w2 and self.w2.weight)
        return Mats(self.wqkv.weight, self.wqkv.bias, self.wo.weight, self.w13 and self.w13.weight,
                    self.w2 and self.w2.weight, self.wo.bias)


class LazyMats:
    """A resident layer's matrices by Mats' names, each group dequantized into the shared scratch when it is read
    (wqkv, wo, w13, w2), valid until the scratch is next written (the next group's read, any layer's): read each
    one just before its product, as the layers do. On CUDA the dequantization and the product are ordered on
    one stream, so the next group's dequantization starts after the product that reads this one."""

    def __init__(self, r: "ResidentMatrices"):
        self._r = r

    bqkv = property(lambda self: self._r.bqkv)
    bo = property(lambda self: self._r.bo)
    wqkv = property(lambda self: self._r.fetch(PRODUCTS["qkv"]))
    wo = property(lambda self: self._r.fetch(("wo",)))
    w13 = property(lambda self: self._r.fetch(("w_gate", "w_up")))
    w2 = property(lambda self: self._r.fetch(("w_down",)))

    def linear(self):
        """A linear-attention layer's products (strata.models.linear_attention.LinearProducts), each group of matrices
        dequantized into the scratch just before its product."""
        from strata.models.linear_attention import LinearProducts
        r = self._r
        f = lambda p: (lambda x: F.linear(x, r.fetch(PRODUCTS[p])))  # noqa: E731

        def ba(x):
            w = r.fetch(PRODUCTS["lin_ba"])
            return F.linear(x, w[:w.shape[0] // 2]), F.linear(x, w[w.shape[0] // 2:])
        return LinearProducts(f("lin_qkv"), f("lin_z"), ba, f("lin_o"))


# Products' parts (a name the layer lacks is left out: wg, qwen3_5's output gate); then a linear-attention layer's
PRODUCTS = {"qkv": ("wq", "wk", "wv", "wg"), "wo": ("wo",), "w13": ("w_gate", "w_up"), "w2": ("w_down",),
            "lin_qkv": ("lin_qkv",), "lin_z": ("lin_z",), "lin_ba": ("lin_b", "lin_a"), "lin_o": ("lin_out",)}


class ResidentMatrices(nn.Module):
    """A layer's matrices as stored; `get` gives them as LazyMats, each group dequantized into the shared scratch
    when it is read."""

    def __init__(self, parts: dict[str, Packed], bqkv: torch.Tensor | None, scratch: Scratch,
                 bo: torch.Tensor | None = None, kernels=None):
        super().__init__()
        self.parts = nn.ModuleDict(parts)
        self.kernels = kernels  # strata.quant.gemv.GemvKernels of the decode products (None: the defaults)
        self.bqkv = None if bqkv is None else nn.Parameter(bqkv, requires_grad=False)
        self.bo = None if bo is None else nn.Parameter(bo, requires_grad=False)  # gpt-oss's output bias
        self.scratch = scratch
        self._fused: dict[torch.device, bool] = {}

    def get(self) -> "LazyMats":
        return LazyMats(self)

    def fetch(self, names: tuple[str, ...]) -> torch.Tensor | None:
        """The matrices `names` (adjacent in the scratch) dequantized into it, as one (rows, cols) view; None for
        matrices the layer does not have (an MoE layer's dense MLP)."""
        names = tuple(n for n in names if n in self.parts)
        if not names:
            return None
        s = self.scratch
        for n in names:
            p = self.parts[n]
            p.into(s.view(n), stored=s.view(n + "_t") if p.col_perm is not None else None)
        return s.span(names[0], names[-1]) if len(names) > 1 else s.view(names[0])

    def fused_decode_ok(self, device) -> bool:
        """Whether decode can multiply on the blocks themselves (strata.quant.gemv) on `device`: every
        part quantized in a type the fused kernel takes. Then `products` replaces `get` for few rows."""
        device = torch.device(device)
        if device not in self._fused:  # asked once per layer per token: answered once per device
            self._fused[device] = all(fused_ok(p, device) for p in self.parts.values())
        return self._fused[device]

    def products(self) -> Products:
        """The layer's four products computed on the blocks (fused_decode_ok must hold): no scratch."""
        return Products(functools.partial(self._matmul, PRODUCTS["qkv"], bias=self.bqkv),
                        functools.partial(self._matmul, PRODUCTS["wo"], bias=self.bo),
                        functools.partial(self._matmul, PRODUCTS["w13"]),
                        functools.partial(self._matmul, PRODUCTS["w2"]))

    def int8_x(self, product: str, rows: int = 1) -> bool:
        """Whether `products`' `product` (qkv, wo, w13, w2) on `rows` rows of x reads them rounded to int8; then it
        takes the rounding as xq, where a kernel before it wrote it. A decode batch's rows on tensor cores
        (kernels.gemv_rows mma-float) read x as it is."""
        from strata.quant import rows as qrows
        from strata.quant.gemv import wants_int8_x
        qtypes = [self.parts[n].qtype for n in PRODUCTS[product] if n in self.parts]
        return bool(qtypes) and not qrows.takes(self.kernels, rows, qtypes) and wants_int8_x(qtypes, self.kernels)

    def linear(self):
        """A linear-attention layer's products on its blocks (fused_decode_ok must hold): LinearProducts whose
        callables take xq as `products`' do."""
        from strata.models.linear_attention import LinearProducts
        f = lambda p: functools.partial(self._matmul, PRODUCTS[p])  # noqa: E731
        both = f("lin_ba")

        def ba(x, **kw):
            y = both(x, **kw)
            return y.split(y.shape[-1] // 2, dim=-1)
        return LinearProducts(f("lin_qkv"), f("lin_z"), ba, f("lin_o"))

    LINEAR_INPUTS = ("lin_qkv", "lin_z", "lin_ba")

    def linear_int8(self, rows: int = 1) -> bool:
        """Whether one of a linear-attention layer's input products on `rows` rows reads x rounded to int8 (the norm
        before them then writes the rounding)."""
        return any(self.int8_x(p, rows) for p in self.LINEAR_INPUTS)

    def linear_taking(self, xq: dict, rows: int = 1):
        """`linear`, with the norm's int8 rounding of x ({} or {"xq": ...}) bound to the input products that read it
        on `rows` rows (the decode graphs' one row, and the batch graphs' rows)."""
        lp = self.linear()
        take = {p: functools.partial(f, **xq) if xq and self.int8_x(p, rows) else f
                for p, f in zip(self.LINEAR_INPUTS, (lp.qkv, lp.z, lp.ba))}
        return lp._replace(qkv=take["lin_qkv"], z=take["lin_z"], ba=take["lin_ba"])

    def _matmul(self, names: tuple[str, ...], x: torch.Tensor, bias: torch.Tensor | None = None,
                xq: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        from strata.quant import rows
        from strata.quant.gemv import quant_matmul_parts
        parts = [self.parts[n] for n in names if n in self.parts]
        if parts[0].col_perm is not None:  # (a single part): x in the stored column order instead
            x, xq = x.index_select(-1, parts[0].col_inv), None
        x2, mats = x.reshape(-1, x.shape[-1]), [(p.data, p.qtype) for p in parts]
        y = rows.product(self.kernels, x2, mats, parts[0].cols)  # kernels.gemv_rows mma-float: a batch in one launch
        if y is None:
            y = quant_matmul_parts(x2, mats, parts[0].cols, kernels=self.kernels, xq=xq)
        y = y.view(*x.shape[:-1], y.shape[-1])
        return y if bias is None else y + bias


class ResidentExperts(nn.Module):
    """An MoE layer's experts as stored: each expert's gate then up blocks in one (E, 2 effn, bytes) tensor, down
    in (E, dim, bytes). Prefill dequantizes them a group of whole experts at a time into the shared scratch;
    decode reads only the chosen experts' blocks (strata.models.moe multiplies on them where strata.quant.gemv can)."""

    def __init__(self, w13: Packed, w2: Packed, scratch: Scratch, kernels=None):
        super().__init__()
        self.w13, self.w2, self.scratch = w13, w2, scratch
        self.kernels = kernels  # strata.quant.gemv.GemvKernels of the decode products (None: the defaults)
        self.per_group = scratch.layout["e13"][1] // w13.data.shape[1]
        self._fused: dict[torch.device, bool] = {}
        self._direct: dict[torch.device, bool] = {}
        for p in (w13, w2):
            _split_mxfp4(p)

    def group(self, g0: int, g1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Experts [g0, g1) (at most per_group) dense in the scratch: (w13 (G, 2 effn, dim), w2 (G, dim, effn)),
        valid until the scratch is written again."""
        s, n = self.scratch, g1 - g0
        r13, r2 = self.w13.data.shape[1], self.w2.data.shape[1]
        w13 = s.view("e13")[:n * r13]
        w2 = s.view("e2")[:n * r2]
        self.w13.into(w13, g0, g1)
        self.w2.into(w2, g0, g1)
        return w13.view(n, r13, -1), w2.view(n, r2, -1)

    def chosen(self, e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts `e` (n,) dense in the compute dtype, fresh tensors (a decode step's few)."""
        out = []
        for p in (self.w13, self.w2):
            b = p.data.index_select(0, e)
            w = torch.empty(*b.shape[:-1], p.cols, device=b.device, dtype=p.out_dtype)
            dequantize_into(w.view(-1, p.cols), b, p.qtype, p.cols, p.triton_state, p.slab)
            out.append(w)
        return out[0], out[1]

    def direct(self, device) -> bool:
        """Whether strata.quant.gemv's experts kernels take both stacks on `device` (ids read on the device)."""
        device = torch.device(device)
        if device not in self._direct:
            from strata.quant import gemv
            self._direct[device] = gemv.available(device) and all(
                gemv.experts_ok(p.qtype, p.cols, p.data.shape[1]) and p.data.data_ptr() % 4 == 0
                for p in (self.w13, self.w2))
        return self._direct[device]

    def fused_ok(self, device) -> bool:
        """Whether decode multiplies on the chosen experts' blocks (strata.quant.gemv) on `device`: the experts
        kernels, or each expert's blocks gathered for the matrix-vector kernel."""
        device = torch.device(device)
        if device not in self._fused:
            self._fused[device] = self.direct(device) or (fused_ok(self.w13, device) and fused_ok(self.w2, device))
        return self._fused[device]

    def graphable(self, device) -> bool:
        """Whether a decode step's expert products can be captured in a CUDA graph: on the blocks, or the chosen
        experts dequantized by strata.quant.into's kernels (no host sync; MXFP4's way)."""
        if self.fused_ok(device):
            return True
        if torch.device(device).type != "cuda":
            return False
        from strata.quant import into
        probe = torch.empty(0, device=device, dtype=self.w13.out_dtype)
        return (into.takes(self.w13.qtype, probe, self.w13.triton_state)
                and into.takes(self.w2.qtype, probe, self.w2.triton_state))


def _split_mxfp4(p: Packed) -> None:
    """An MXFP4 expert stack re-laid in place into strata.quant.mxfp4's split layout (an expert at a time: its bytes
    the only transient), where the experts kernels run on its device (strata.quant.gemv reads it in aligned words)
    and its shape takes it; p.split says so to every reader. Elsewhere it stays as the file has it."""
    if p.qtype != "MXFP4" or p.data.dim() != 3 or p.split:
        return
    from strata.quant import gemv, mxfp4
    if not (gemv.available(p.data.device) and mxfp4.split_ok(p.data.shape[1], p.cols)):
        return
    for e in range(p.data.shape[0]):
        p.data[e:e + 1] = mxfp4.to_split(p.data[e:e + 1])
    p.split = True


class QuantEmbedding(nn.Module):
    """Token embedding kept as stored: a chunk's rows are gathered from their blocks and dequantized."""

    def __init__(self, table: Packed):
        super().__init__()
        self.table = table

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table.gather(ids)


def fused_ok(p: Packed, device) -> bool:
    from strata.quant import gemv
    return p.qtype is not None and gemv.supports(p.qtype) and gemv.available(device)


class Head(nn.Module):
    """Output projection to float32 logits, computed in vocabulary slices of `rows`.

    Dense: slices of the weight. Resident: each slice dequantized into the scratch in turn, so the
    whole head never exists dense. Both modes slice alike, so their logits are the same bits."""

    def __init__(self, weight: nn.Parameter | Packed, rows: int, scratch: Scratch | None = None, kernels=None):
        super().__init__()
        self.weight = weight
        self.rows, self.scratch = rows, scratch
        self.kernels = kernels  # strata.quant.gemv.GemvKernels of a resident head's decode rows (None: the defaults)

    def int8_x(self, device) -> bool:
        """Whether a decode row's product reads x rounded to int8 (then forward takes the rounding as xq)."""
        from strata.quant.gemv import wants_int8_x
        w = self.weight
        return isinstance(w, Packed) and fused_ok(w, device) and wants_int8_x([w.qtype], self.kernels)

    def forward(self, x: torch.Tensor, xq: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        w = self.weight
        vocab = w.n_rows if isinstance(w, Packed) else w.shape[0]
        out = torch.empty(*x.shape[:-1], vocab, device=x.device, dtype=torch.float32)
        n = x.reshape(-1, x.shape[-1]).shape[0]
        if isinstance(w, Packed) and fused_ok(w, x.device):
            from strata.quant import rows
            # a decode batch's rows in one launch (kernels.gemv_rows mma-float); more rows (a scoring prefill's)
            # take the slices below: each launch of ROWS_MAX rows would read the whole head again
            if n <= rows.ROWS_MAX and rows.product(self.kernels, x.reshape(-1, w.cols), [(w.data, w.qtype)], w.cols,
                                                   out=out.view(-1, vocab)) is not None:
                return out
            if n <= DECODE_T:
                from strata.quant.gemv import quant_matmul  # decode: one pass over the blocks, float32 logits directly
                quant_matmul(x.reshape(-1, w.cols), w.data, w.qtype, w.cols, out=out.view(-1, vocab),
                             kernels=self.kernels, xq=xq)
                return out
        for s in range(0, vocab, self.rows):
            e = min(vocab, s + self.rows)
            if isinstance(w, Packed):
                ws = w.into(self.scratch.rows(e - s, w.cols), s, e)
            else:
                ws = w[s:e]
            out[..., s:e] = F.linear(x, ws)
        return out
