"""Canonical tensor names of a slice and their spellings in HF and GGUF files (each family's: strata.models.families).

Canonical names (HF layout): embed (vocab, dim); layers.{i}.{attn_norm, wq, wk, wv, [bq, bk, bv], wo,
mlp_norm, w_gate, w_up, w_down, [q_norm, k_norm], [attn_post_norm, mlp_post_norm]}; norm (dim,); head (vocab, dim),
absent when tied to the embedding.
"""
from __future__ import annotations

from strata.models.families import GGUF_GLOBAL, HF_GLOBAL, family

PER_LAYER = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")
BIASES = ("bq", "bk", "bv")
QK_NORMS = ("q_norm", "k_norm")
POST_NORMS = ("attn_post_norm", "mlp_post_norm")
MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
MLP = ("w_gate", "w_up", "w_down")
EXPERTS = ("router", "e_gate", "e_up", "e_down")  # an MoE layer's, in place of MLP: stacked over the experts
SHARED = ("s_gate", "s_up", "s_down")            # its shared expert (glm4_moe)
EXPERT_BIASES = ("e_gate_b", "e_up_b", "e_down_b")  # gpt-oss
ATTENTION = ("wq", "wk", "wv", "wo", "bq", "bk", "bv", "q_norm", "k_norm", "bo", "sinks", "wg")
LATENT = ("wq_a", "q_a_norm", "wq_b", "wkv_a", "kv_a_norm", "wkv_b")  # MLA's (deepseek_v3; wq where q is not low-rank)
INDEXER = ("ix_wq_b", "ix_wk", "ix_k_norm", "ix_k_norm_b", "ix_w")  # DSA's lightning indexer (not in a shared layer)
LINEAR = ("lin_qkv", "lin_z", "lin_b", "lin_a", "lin_conv", "lin_dt", "lin_alog", "lin_norm", "lin_out")  # qwen3_5


def short(canon: str) -> str:
    """'layers.3.wq' -> 'wq'; 'embed' -> 'embed'."""
    return canon.rsplit(".", 1)[-1]


def layer_of(canon: str) -> int | None:
    return int(canon.split(".")[1]) if canon.startswith("layers.") else None


def wanted_names(args, start: int, end: int) -> list[str]:
    """Canonical names the slice [start, end) of a model with `args` (a ModelArgs) needs."""
    names = ["embed"] if start == 0 else []
    per_layer = (list(PER_LAYER) + (list(BIASES) if args.qkv_bias else []) + (list(QK_NORMS) if args.qk_norm else [])
                 + (list(POST_NORMS) if args.post_norms else []) + (["bo"] if args.o_bias else [])
                 + (["sinks"] if args.attn_sinks else []) + (["wg"] if args.attn_gate else []))
    moe = ([n for n in per_layer if n not in MLP] + list(EXPERTS)
           + (["router_bias"] if args.router != "softmax" else [])
           + (list(SHARED) if args.shared_ffn_dim else []) + (["s_sig"] if args.shared_gate else [])
           + (list(EXPERT_BIASES) if args.expert_bias else []))
    for i in range(start, end):
        layer = moe if args.is_moe(i) else per_layer
        if args.is_linear(i):  # Gated DeltaNet in place of attention
            layer = [n for n in layer if n not in ATTENTION] + list(LINEAR)
        elif args.latent:  # MLA: its own projections and norms, and wo
            q = list(LATENT[:3]) if args.q_lora_rank else ["wq"]
            layer = [n for n in layer if n not in ATTENTION] + q + list(LATENT[3:]) + ["wo"]
            if args.index_topk and not (args.index_shared and args.index_shared[i]):
                layer += list(INDEXER)
        names += [f"layers.{i}.{n}" for n in layer]
    if end == args.n_layers:
        names += ["norm"] + ([] if args.tie_embeddings else ["head"])
    if end == args.n_layers and args.tie_embeddings and start != 0:
        names.append("embed")  # the head reuses it
    return names


def shapes(args) -> dict[str, tuple[int, ...]]:
    """Short name -> the HF-layout shape the metadata implies."""
    d, hd = args.dim, args.head_dim
    return {"embed": (args.vocab_size, d), "head": (args.vocab_size, d), "norm": (d,),
            "attn_norm": (d,), "mlp_norm": (d,), "wq": (args.n_heads * hd, d),
            "wk": (args.n_kv_heads * hd, d), "wv": (args.n_kv_heads * hd, d),
            "wo": (d, args.n_heads * hd), "w_gate": (args.ffn_dim, d),
            "w_up": (args.ffn_dim, d), "w_down": (d, args.ffn_dim),
            "bq": (args.n_heads * hd,), "bk": (args.n_kv_heads * hd,), "bv": (args.n_kv_heads * hd,),
            "q_norm": (hd,), "k_norm": (hd,), "attn_post_norm": (d,), "mlp_post_norm": (d,),
            "router": (args.n_experts, d), "e_gate": (args.n_experts, args.expert_ffn_dim, d),
            "e_up": (args.n_experts, args.expert_ffn_dim, d), "e_down": (args.n_experts, d, args.expert_ffn_dim),
            "router_bias": (args.n_experts,), "s_gate": (args.shared_ffn_dim, d), "s_up": (args.shared_ffn_dim, d),
            "s_down": (d, args.shared_ffn_dim), "s_sig": (1, d), "bo": (d,), "sinks": (args.n_heads,),
            "e_gate_b": (args.n_experts, args.expert_ffn_dim), "e_up_b": (args.n_experts, args.expert_ffn_dim),
            "e_down_b": (args.n_experts, d), "wg": (args.n_heads * hd, d),
            **_linear_shapes(args), **(_latent_shapes(args) if args.latent else {})}


def _latent_shapes(args) -> dict[str, tuple[int, ...]]:
    nh, r, qr, d = args.n_heads, args.kv_lora_rank, args.q_lora_rank, args.dim
    return {"wq_a": (qr, d), "q_a_norm": (qr,), "wq_b": (nh * args.head_dim, qr),
            "wkv_a": (r + args.qk_rope_dim, d), "kv_a_norm": (r,),
            "wkv_b": (nh * (args.head_dim - args.qk_rope_dim + args.v_head_dim), r), "wo": (d, nh * args.v_head_dim),
            "ix_wq_b": (args.index_heads * args.index_head_dim, qr), "ix_wk": (args.index_head_dim, d),
            "ix_k_norm": (args.index_head_dim,), "ix_k_norm_b": (args.index_head_dim,), "ix_w": (args.index_heads, d)}


def _linear_shapes(args) -> dict[str, tuple[int, ...]]:
    kdim, vdim, nv = args.lin_k_heads * args.lin_k_dim, args.lin_v_heads * args.lin_v_dim, args.lin_v_heads
    conv = 2 * kdim + vdim
    return {"lin_qkv": (conv, args.dim), "lin_z": (vdim, args.dim), "lin_b": (nv, args.dim), "lin_a": (nv, args.dim),
            "lin_conv": (conv, args.lin_conv), "lin_dt": (nv,), "lin_alog": (nv,), "lin_norm": (args.lin_v_dim,),
            "lin_out": (args.dim, vdim)}


def _split(canon: str) -> tuple[str, str]:
    _, i, s = canon.split(".")
    return i, s


def hf_names(canon: str, args, fam=None) -> list[str]:
    """The HF tensors that hold `canon`: one, or an expert stack's one per expert (stacked in order)."""
    name = hf_name(canon, args, fam)
    if "{e}" not in name:
        return [name]
    return [name.format(e=e) for e in range(args.n_experts)]


def hf_name(canon: str, args=None, fam=None) -> str:
    """Canonical tensor name -> its name in an HF checkpoint of `args`' family (default llama), or of `fam` (the
    family as one checkpoint spells it: families.hf_checkpoint_family). A tensor the family keeps fused with
    others: the fused tensor's name (see `fused_rows`); an expert stack: a template with {e} for the expert (see
    `hf_names`)."""
    return _file_name(canon, args, gguf=False, fam=fam)


def gguf_name(canon: str, args=None) -> str:
    """Canonical tensor name -> the name llama.cpp gives it in a GGUF file of `args`' family (default llama)."""
    return _file_name(canon, args, gguf=True)


def _file_name(canon: str, args, gguf: bool, fam=None) -> str:
    """hf_name / gguf_name: a global name, or the layer's name in the family's map (fused, derived, or its own)."""
    glob = GGUF_GLOBAL if gguf else HF_GLOBAL
    if canon in glob:
        return glob[canon]
    i, s = _split(canon)
    fam = fam or family(args.arch if args is not None else "llama")
    fused, derived, layer = ((fam.gguf_fused, fam.gguf_derived, fam.gguf_layer) if gguf
                             else (fam.hf_fused, fam.hf_derived, fam.hf_layer))
    prefix = f"blk.{i}." if gguf else f"model.layers.{i}."
    for name, parts in fused.items():
        if s in parts:
            return prefix + name
    if s in derived:
        src = derived[s][0]
        return prefix + (src[0] if isinstance(src, tuple) else src)  # (several: the first, gguf_names lists them)
    return prefix + layer[s]


def gguf_names(canon: str, args) -> tuple[str, ...]:
    """The GGUF tensors `canon` is read from: gguf_name's one, or each of the tensors a derivation takes several of
    (deepseek2's wkv_b from attn_k_b and attn_v_b)."""
    if canon not in GGUF_GLOBAL:
        i, s = _split(canon)
        src = family(args.arch).gguf_derived.get(s, ("",))[0]
        if isinstance(src, tuple):
            return tuple(f"blk.{i}.{n}" for n in src)
    return (gguf_name(canon, args),)


def fused_rows(canon: str, args, gguf: bool) -> tuple[int, int, int] | None:
    """For a tensor its family stores fused with others (phi3's qkv, gate_up): (first row, last row + 1, the fused
    tensor's rows); None for a tensor stored alone."""
    if canon in HF_GLOBAL:
        return None
    s = short(canon)
    fam = family(args.arch)
    sh = shapes(args)
    for parts in (fam.gguf_fused if gguf else fam.hf_fused).values():
        if s in parts:
            r0 = sum(sh[p][0] for p in parts[:parts.index(s)])
            return r0, r0 + sh[s][0], sum(sh[p][0] for p in parts)
    return None
