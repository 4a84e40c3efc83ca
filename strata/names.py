"""Canonical tensor names of a Llama-family slice and their HF and GGUF spellings (a leaf: imports nothing of Strata's).

Canonical names (HF layout): embed (vocab, dim); layers.{i}.{attn_norm, wq, wk, wv, [bq, bk, bv], wo,
mlp_norm, w_gate, w_up, w_down}; norm (dim,); head (vocab, dim), absent when tied to the embedding.
"""
from __future__ import annotations

PER_LAYER = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")
BIASES = ("bq", "bk", "bv")
MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")

# canonical per-layer short name -> HF per-layer name (model.layers.N.<name>)
HF_LAYER = {"attn_norm": "input_layernorm.weight", "wq": "self_attn.q_proj.weight",
            "wk": "self_attn.k_proj.weight", "wv": "self_attn.v_proj.weight",
            "bq": "self_attn.q_proj.bias", "bk": "self_attn.k_proj.bias", "bv": "self_attn.v_proj.bias",
            "wo": "self_attn.o_proj.weight", "mlp_norm": "post_attention_layernorm.weight",
            "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight", "w_down": "mlp.down_proj.weight"}
HF_GLOBAL = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight", "head": "lm_head.weight"}

# canonical per-layer short name -> GGUF per-layer name (blk.N.<name>)
GGUF_LAYER = {"attn_norm": "attn_norm.weight", "wq": "attn_q.weight", "wk": "attn_k.weight",
              "wv": "attn_v.weight", "bq": "attn_q.bias", "bk": "attn_k.bias", "bv": "attn_v.bias",
              "wo": "attn_output.weight", "mlp_norm": "ffn_norm.weight", "w_gate": "ffn_gate.weight",
              "w_up": "ffn_up.weight", "w_down": "ffn_down.weight"}
GGUF_GLOBAL = {"embed": "token_embd.weight", "norm": "output_norm.weight", "head": "output.weight"}


def short(canon: str) -> str:
    """'layers.3.wq' -> 'wq'; 'embed' -> 'embed'."""
    return canon.rsplit(".", 1)[-1]


def layer_of(canon: str) -> int | None:
    return int(canon.split(".")[1]) if canon.startswith("layers.") else None


def wanted_names(args, start: int, end: int) -> list[str]:
    """Canonical names the slice [start, end) of a model with `args` (a ModelArgs) needs."""
    names = ["embed"] if start == 0 else []
    per_layer = list(PER_LAYER) + (list(BIASES) if args.qkv_bias else [])
    names += [f"layers.{i}.{n}" for i in range(start, end) for n in per_layer]
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
            "bq": (args.n_heads * hd,), "bk": (args.n_kv_heads * hd,), "bv": (args.n_kv_heads * hd,)}


def _split(canon: str) -> tuple[str, str]:
    _, i, s = canon.split(".")
    return i, s


def hf_name(canon: str) -> str:
    """Canonical tensor name -> its name in an HF Llama/Qwen2 checkpoint."""
    if canon in HF_GLOBAL:
        return HF_GLOBAL[canon]
    i, s = _split(canon)
    return f"model.layers.{i}.{HF_LAYER[s]}"


def gguf_name(canon: str) -> str:
    """Canonical tensor name -> the name llama.cpp gives it in a GGUF file."""
    if canon in GGUF_GLOBAL:
        return GGUF_GLOBAL[canon]
    i, s = _split(canon)
    return f"blk.{i}.{GGUF_LAYER[s]}"


_HF_BACK = {v: k for k, v in HF_LAYER.items()}
_GGUF_BACK = {v: k for k, v in GGUF_LAYER.items()}


def from_hf(name: str) -> str | None:
    """HF name -> canonical (None for tensors Strata does not use)."""
    for c, h in HF_GLOBAL.items():
        if h == name:
            return c
    parts = name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in _HF_BACK:
        return f"layers.{parts[2]}.{_HF_BACK[parts[3]]}"
    return None


def from_gguf(name: str) -> str | None:
    """GGUF name -> canonical (None for tensors Strata does not use)."""
    for c, g in GGUF_GLOBAL.items():
        if g == name:
            return c
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _GGUF_BACK:
        return f"layers.{parts[1]}.{_GGUF_BACK[parts[2]]}"
    return None
