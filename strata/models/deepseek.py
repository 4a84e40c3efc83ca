"""DeepSeek V3 / R1 / Kimi K2 GGUF files (general.architecture deepseek2), and DeepSeek V3.2's (deepseek32) and
GLM-5's (glm-dsa), as llama.cpp's converter writes them: the {arch}.* keys to ModelArgs' latent-attention, indexer,
router and softmax-scale fields, and the layer tensors' names.

What the converter (llama.cpp's conversion/deepseek.py, DeepseekV2Model) writes and llama.cpp's deepseek2 loader
(src/models/deepseek2.cpp) reads:

* attention.kv_lora_rank, attention.q_lora_rank (left out where the HF q_lora_rank is null: one attn_q projection),
  rope.dimension_count (qk_rope_head_dim), attention.key_length_mla (qk_nope + qk_rope) and value_length_mla
  (v_head_dim). key_length / value_length describe the absorbed form llama.cpp computes (kv_lora_rank + rope and
  kv_lora_rank: one shared 576 / 512 head for V3), head_count_kv is 1 for the same reason.
* kv_b_proj split per head into attn_k_b (each head's nope-key rows, transposed: (heads, kv_lora_rank, nope)) and
  attn_v_b (each head's value rows: (heads, v_head_dim, kv_lora_rank)); put back together here as the canonical wkv_b.
  Files from before that split (April 2025: attn_kv_b whole, no *_mla keys) are refused.
* The roped rows of q and of kv_a as the HF checkpoint keeps them (adjacent pairs; llama.cpp's deepseek2 ropes pairs):
  rope_interleave.
* expert_gating_func from the HF scoring_func (2: sigmoid for V3; absent, llama.cpp takes softmax, DeepSeek V2's),
  expert_weights_scale (routed_scaling_factor; absent: 1), expert_weights_norm (written only when true),
  expert_group_count / expert_group_used_count, expert_shared_count, leading_dense_block_count; the choosing bias as
  exp_probs_b.bias.
* rope.scaling.yarn_log_multiplier: 0.1 x mscale_all_dim (llama.cpp divides the 0.1 back out and takes mscale equal to
  it). With YaRN, llama.cpp's softmax scale is (0.1 mscale_all_dim ln(factor) + 1)^2 / sqrt(head_dim) and its RoPE
  magnitude mscale / mscale_all_dim = 1: transformers' DeepSeek V3 (its yarn_get_mscale squared in the scale).
* No multi-token-prediction block (the converter skips it); a file that has one names it in nextn_predict_layers.

deepseek32 and glm-dsa (the converter's DeepseekV32Model and GlmMoeDsaModel, subclasses of DeepseekV2Model; read by
llama.cpp's src/models/deepseek32.cpp and glm-dsa.cpp) are deepseek2's keys and tensors plus DSA's lightning indexer:
* attention.indexer.head_count / key_length / top_k (index_n_heads, index_head_dim, index_topk), all required;
  q_lora_rank required too (the indexer reads q's low-rank residual).
* blk.N.indexer.attn_q_b (wq_b), attn_k (wk), k_norm.weight / .bias (the key's LayerNorm), proj (weights_proj), rows
  as HF keeps them: the converter permutes none. llama.cpp ropes the indexer's first rope.dimension_count values in
  halves for deepseek32 (NeoX, as transformers' V3.2) and in adjacent pairs for glm-dsa (as GLM-5); the main
  attention's rope in adjacent pairs for both. (Its Hadamard rotation of the indexer's q and k keeps their dot
  products: orthogonal.)
* glm-dsa: attention.indexer.types, one bool per layer (true: the layer has its own indexer; false: "shared", no
  indexer tensors, the selection of the last full layer before it). Absent, llama.cpp takes every layer full where
  context_length < 1,048,576 (GLM-5 / 5.1) and GLM-5.2's schedule (GLM_5_2_FULL) otherwise. expert_gating_func may be
  absent (sigmoid); llama.cpp's glm-dsa reads no YaRN log multiplier, so its rope scaling is refused here.
* deepseek32's YaRN: llama.cpp takes mscale = 1 for it (deepseek2: mscale_all_dim), which is transformers' only
  where mscale_all_dim is 1 (V3.2's released config): another value is refused.
"""
from __future__ import annotations

import math
from decimal import Decimal

import numpy as np
import torch

from strata.errors import ModelError
from strata.models.rope import scaling_from_gguf, yarn_attention_factor

GGUF_ARCH = "deepseek2"
GGUF_ARCH_V32 = "deepseek32"  # DeepSeek V3.2
GGUF_ARCH_GLM = "glm-dsa"  # GLM-5

# canonical per-layer short name -> GGUF per-layer name (blk.N.<name>), as llama.cpp's llama-arch.cpp names them
GGUF_LAYER = {"attn_norm": "attn_norm.weight", "wq": "attn_q.weight", "wq_a": "attn_q_a.weight",
              "q_a_norm": "attn_q_a_norm.weight", "wq_b": "attn_q_b.weight", "wkv_a": "attn_kv_a_mqa.weight",
              "kv_a_norm": "attn_kv_a_norm.weight", "wo": "attn_output.weight", "mlp_norm": "ffn_norm.weight",
              "w_gate": "ffn_gate.weight", "w_up": "ffn_up.weight", "w_down": "ffn_down.weight",
              "router": "ffn_gate_inp.weight", "router_bias": "exp_probs_b.bias", "e_gate": "ffn_gate_exps.weight",
              "e_up": "ffn_up_exps.weight", "e_down": "ffn_down_exps.weight", "s_gate": "ffn_gate_shexp.weight",
              "s_up": "ffn_up_shexp.weight", "s_down": "ffn_down_shexp.weight"}


def kv_b_from_split(k_b: torch.Tensor, v_b: torch.Tensor, args) -> torch.Tensor:
    """attn_k_b (heads, kv_lora_rank, nope) and attn_v_b (heads, v_head_dim, kv_lora_rank) -> HF's kv_b_proj
    (heads * (nope + v_head_dim), kv_lora_rank): per head its nope-key rows, then its value rows."""
    nh, rank = args.n_heads, args.kv_lora_rank
    nope = args.head_dim - args.qk_rope_dim
    if tuple(k_b.shape) != (nh, rank, nope) or tuple(v_b.shape) != (nh, args.v_head_dim, rank):
        raise ModelError(f"attn_k_b {tuple(k_b.shape)} / attn_v_b {tuple(v_b.shape)}: the metadata implies "
                         f"{(nh, rank, nope)} / {(nh, args.v_head_dim, rank)}")
    return torch.cat((k_b.transpose(1, 2), v_b), 1).reshape(nh * (nope + args.v_head_dim), rank)


# a canonical tensor made of several file tensors: short name -> (their per-layer names, the derivation taking their
# float tensors in that order and the ModelArgs). Held dense: attn_k_b's rows run along a head's nope values, not
# along the latent as kv_b's, so its quantized blocks cannot become kv_b's.
GGUF_DERIVED = {"wkv_b": (("attn_k_b.weight", "attn_v_b.weight"), kv_b_from_split)}

# the deepseek2.* keys read here (any other is refused by families.check_gguf_keys)
GGUF_KEYS = frozenset({
    "block_count", "context_length", "embedding_length", "feed_forward_length", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.key_length", "attention.value_length",
    "attention.key_length_mla", "attention.value_length_mla", "attention.kv_lora_rank", "attention.q_lora_rank",
    "attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.dimension_count",
    "rope.scaling.type", "rope.scaling.factor", "rope.scaling.original_context_length",
    "rope.scaling.yarn_log_multiplier", "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow",
    "rope.scaling.yarn_ext_factor", "rope.scaling.yarn_attn_factor", "rope.scaling.attn_factor",
    "expert_count", "expert_used_count", "expert_feed_forward_length", "expert_shared_count", "expert_group_count",
    "expert_group_used_count", "expert_gating_func", "expert_weights_scale", "expert_weights_norm",
    "leading_dense_block_count", "nextn_predict_layers"})

# DSA's lightning indexer: canonical short name -> GGUF per-layer name (gguf-py's MODEL_TENSOR.INDEXER_*), in every
# layer of deepseek32, in glm-dsa's full layers only
GGUF_INDEXER = {"ix_wq_b": "indexer.attn_q_b.weight", "ix_wk": "indexer.attn_k.weight",
                "ix_k_norm": "indexer.k_norm.weight", "ix_k_norm_b": "indexer.k_norm.bias",
                "ix_w": "indexer.proj.weight"}
_INDEXER_KEYS = frozenset({"attention.indexer.head_count", "attention.indexer.key_length", "attention.indexer.top_k"})
# deepseek32.* keys read (deepseek2's and the indexer's); glm-dsa.*: the same and indexer.types, without rope scaling
# (llama.cpp's glm-dsa reads no YaRN log multiplier: its YaRN is not transformers')
GGUF_KEYS_V32 = GGUF_KEYS | _INDEXER_KEYS
GGUF_KEYS_GLM = frozenset(k for k in GGUF_KEYS | _INDEXER_KEYS | {"attention.indexer.types"}
                          if not k.startswith("rope.scaling."))
# llama.cpp's glm-dsa without indexer.types where context_length >= 1,048,576 (GLM-5.2, its 78 layers): full at
# layers 0, 1 and every 4th from 2; shared elsewhere, layers past 78 too (GLM_5_2_DEFAULT_INDEXER_TYPES)
GLM_5_2_FULL = tuple(i < 2 or (i < 78 and (i - 2) % 4 == 0) for i in range(512))
GLM_5_2_CONTEXT = 1048576

GATING_SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID (1: softmax, 3: sqrt-softplus)


def gguf_args(get, n_layers: int, names, where: str, arch: str = GGUF_ARCH) -> dict:
    """The ModelArgs fields of a deepseek2 / deepseek32 / glm-dsa GGUF beyond the common keys (read with get(key,
    default), the arch prefix implied): head_dim and n_kv_heads (in place of the absorbed form's key_length and
    head_count_kv), the latent attention's ranks and widths, rope_scaling and the softmax scale, the experts, DSA's
    indexer (gguf_indexer); names: the file's tensor names."""
    def refuse(key, why="is not implemented"):
        raise ModelError(f"{where}: GGUF key {arch}.{key} = {get(key)!r} {why}")

    for key in ("attention.head_count", "attention.kv_lora_rank", "attention.q_lora_rank", "rope.dimension_count",
                "attention.key_length_mla", "attention.value_length_mla", "expert_feed_forward_length",
                "expert_shared_count", "leading_dense_block_count"):
        if isinstance(get(key), list):
            refuse(key, "(a value per layer) is not implemented")
    if get("attention.key_length_mla") is None or get("attention.value_length_mla") is None or \
            any(n.endswith(".attn_kv_b.weight") for n in names):
        raise ModelError(f"{where}: a {arch} GGUF with kv_b whole (attn_kv_b, no attention.key_length_mla / "
                         "value_length_mla: llama.cpp's converter before April 2025) is not implemented: convert the "
                         "model again with a current convert_hf_to_gguf.py")
    for key in ("attention.kv_lora_rank", "rope.dimension_count"):
        if get(key) is None:
            raise ModelError(f"{where}: GGUF metadata lacks {arch}.{key}")
    n_heads, rank, rope = int(get("attention.head_count")), int(get("attention.kv_lora_rank")), \
        int(get("rope.dimension_count"))
    head_dim, v_dim = int(get("attention.key_length_mla")), int(get("attention.value_length_mla"))
    # the absorbed form's lengths: one shared head of [latent | roped key], its value the latent
    if get("attention.key_length", rank + rope) != rank + rope:
        refuse("attention.key_length", f"is not kv_lora_rank + rope.dimension_count ({rank} + {rope})")
    if get("attention.value_length", rank) != rank:
        refuse("attention.value_length", f"is not kv_lora_rank ({rank})")
    if get("attention.head_count_kv", 1) not in (1, n_heads):
        refuse("attention.head_count_kv", "is not 1 (latent attention as llama.cpp's converter writes it)")
    scaling, attn_scale = _rope_and_scale(get, head_dim, where, arch)
    sparse = {} if arch == GGUF_ARCH else gguf_indexer(get, n_layers, rope, where, arch)
    return dict(head_dim=head_dim, n_kv_heads=n_heads, kv_lora_rank=rank,
                q_lora_rank=int(get("attention.q_lora_rank") or 0), qk_rope_dim=rope, v_head_dim=v_dim,
                rope_interleave=True, rope_scaling=scaling, attn_scale=attn_scale,
                **_experts(get, n_layers, refuse, where, arch), **sparse)


def gguf_indexer(get, n_layers: int, rope: int, where: str, arch: str) -> dict:
    """DSA's ModelArgs fields from a deepseek32 / glm-dsa GGUF, as llama.cpp reads them: the indexer's heads, their
    width (its first rope.dimension_count values roped: in halves for deepseek32, in pairs for glm-dsa) and top k;
    glm-dsa's shared layers (attention.indexer.types false, or GLM-5.2's schedule where it is absent)."""
    for key in sorted(_INDEXER_KEYS):
        v = get(key)
        if v is None:  # (llama.cpp requires each)
            raise ModelError(f"{where}: GGUF metadata lacks {arch}.{key}")
        if isinstance(v, list) or int(v) <= 0:
            raise ModelError(f"{where}: GGUF key {arch}.{key} = {v!r} is not implemented (one count > 0)")
    if not get("attention.q_lora_rank"):
        raise ModelError(f"{where}: GGUF metadata lacks {arch}.attention.q_lora_rank (the indexer reads q's low-rank "
                         "residual; llama.cpp requires it)")
    width = int(get("attention.indexer.key_length"))
    if rope > width:
        raise ModelError(f"{where}: GGUF key {arch}.attention.indexer.key_length = {width} is shorter than "
                         f"rope.dimension_count ({rope}): the indexer's head holds its roped part")
    shared = None
    if arch == GGUF_ARCH_GLM:
        types = get("attention.indexer.types")
        if types is None:
            full = GLM_5_2_FULL[:n_layers] if int(get("context_length") or 0) >= GLM_5_2_CONTEXT else (True,) * n_layers
        else:  # one per trunk layer (llama.cpp refuses another length), or one for all
            full = tuple(types) if isinstance(types, list) else (types,) * n_layers
            if len(full) != n_layers or not all(t in (0, 1) for t in full):
                raise ModelError(f"{where}: GGUF key {arch}.attention.indexer.types = {types!r} is not implemented "
                                 f"(a bool per layer, {n_layers} layers)")
            full = tuple(bool(t) for t in full)
        if not full[0]:
            raise ModelError(f"{where}: GGUF key {arch}.attention.indexer.types = {types!r} is not implemented (its "
                             "first layer shares: no selection before it)")
        shared = tuple(not f for f in full)
    return dict(index_topk=int(get("attention.indexer.top_k")), index_heads=int(get("attention.indexer.head_count")),
                index_head_dim=width, index_rope_interleave=arch == GGUF_ARCH_GLM,
                index_shared=shared if shared is not None and any(shared) else None)


def _experts(get, n_layers: int, refuse, where: str, arch: str) -> dict:
    """The router and experts as llama.cpp's deepseek2 reads them: sigmoid scores chosen by score + exp_probs_b within
    the best expert_group_used_count of expert_group_count groups (a group's two best scores), renormalized where
    expert_weights_norm says (absent: not), times expert_weights_scale (absent or 0: 1); a shared expert of
    expert_shared_count widths; the first leading_dense_block_count layers dense (every layer: no experts)."""
    dense = int(get("leading_dense_block_count") or 0)
    if dense >= n_layers:
        return {}
    n, used = int(get("expert_count") or 0), int(get("expert_used_count") or 0)
    if not n or not used:  # (llama.cpp refuses the file so)
        refuse("expert_count" if not n else "expert_used_count", "leaves the MoE layers without experts")
    gating = get("expert_gating_func")
    if gating in (None, 0) and arch == GGUF_ARCH_GLM:  # (llama.cpp's glm-dsa: absent or none is sigmoid)
        gating = GATING_SIGMOID
    if gating is None:
        raise ModelError(f"{where}: GGUF metadata lacks {arch}.expert_gating_func: llama.cpp then routes by "
                         "softmax (DeepSeek V2's), which is not implemented (DeepSeek V3's files say 2, sigmoid)")
    if gating != GATING_SIGMOID:
        refuse("expert_gating_func", f"is not implemented ({GATING_SIGMOID}, sigmoid: DeepSeek V3's)")
    for key in ("expert_feed_forward_length", "expert_shared_count"):
        if get(key) is None:  # (llama.cpp requires both)
            raise ModelError(f"{where}: GGUF metadata lacks {arch}.{key}")
    effn, groups = int(get("expert_feed_forward_length")), int(get("expert_group_count") or 0)
    scale = get("expert_weights_scale")
    return dict(n_experts=n, n_experts_used=used, expert_ffn_dim=effn, router="sigmoid",
                router_renorm=bool(get("expert_weights_norm", False)),
                router_groups=groups if groups > 1 else 1,
                router_groups_used=int(get("expert_group_used_count") or 0) if groups > 1 else 1,
                routed_scale=float(scale) if scale else 1.0,
                shared_ffn_dim=effn * int(get("expert_shared_count")), first_dense_layers=dense)


def _rope_and_scale(get, head_dim: int, where: str, arch: str) -> tuple[dict | None, float | None]:
    """(rope_scaling as strata.models.rope normalizes HF's, the softmax scale), as llama.cpp's
    deepseek2 graph computes them. Its YaRN: the RoPE magnitude mscale / mscale_all_dim with mscale taken equal to
    mscale_all_dim (so 1), and the scale (0.1 mscale_all_dim ln(factor) + 1)^2 / sqrt(head_dim): transformers'
    DeepSeek V3 where mscale == mscale_all_dim (every released config). The cases where llama.cpp's arithmetic
    and transformers' part (YaRN without mscale_all_dim, linear scaling: llama.cpp's graph squares the YaRN factor
    into the scale there too) are refused."""
    log_mul = get("rope.scaling.yarn_log_multiplier")
    att = get("rope.scaling.yarn_attn_factor")

    def plain_get(key, default=None):  # the generic reader, which knows no DeepSeek multiplier and reads att as HF's
        return default if key in ("rope.scaling.yarn_log_multiplier", "rope.scaling.yarn_attn_factor") \
            else get(key, default)

    scaling = scaling_from_gguf(plain_get, arch, where)
    kind = scaling["rope_type"] if scaling else None
    if kind is not None and kind != "yarn":
        raise ModelError(f"{where}: GGUF key {arch}.rope.scaling.type = {get('rope.scaling.type')!r} with factor "
                         f"{scaling.get('factor')} is not implemented for {arch} (llama.cpp folds the YaRN "
                         "factor into its softmax scale there, transformers does not)")
    if kind is None:
        if log_mul or att not in (None, 1.0):
            key = "rope.scaling.yarn_log_multiplier" if log_mul else "rope.scaling.yarn_attn_factor"
            raise ModelError(f"{where}: GGUF key {arch}.{key} = {get(key)!r} without YaRN is not implemented")
        return None, head_dim ** -0.5
    if not log_mul:
        raise ModelError(f"{where}: {arch} YaRN without GGUF key {arch}.rope.scaling.yarn_log_multiplier "
                         "(mscale_all_dim) is not implemented: llama.cpp squares the YaRN factor into its softmax "
                         "scale there, transformers does not")
    # the stored float32 0.1 x mscale_all_dim as its shortest decimal (what the converter was given), times 10 exactly:
    # the HF config's value (llama.cpp divides in float32: 0.70699996 for 0.707, within float32's rounding)
    mscale_all_dim = float(Decimal(str(np.float32(log_mul))) * 10)
    if arch == GGUF_ARCH_V32 and mscale_all_dim != 1.0:  # (llama.cpp takes mscale 1 for it, not mscale_all_dim)
        raise ModelError(f"{where}: GGUF key {arch}.rope.scaling.yarn_log_multiplier = {log_mul!r} (mscale_all_dim "
                         f"{mscale_all_dim}) is not implemented for {arch}: llama.cpp's RoPE magnitude there takes "
                         "mscale 1, transformers' the config's mscale (V3.2's: mscale_all_dim 1)")
    factor = scaling["factor"]
    rope_att = yarn_attention_factor(factor, mscale_all_dim, mscale_all_dim)
    if att is not None and not math.isclose(att, rope_att, rel_tol=1e-6):  # (llama.cpp ignores the key with YaRN)
        raise ModelError(f"{where}: GGUF key {arch}.rope.scaling.yarn_attn_factor = {att!r} is not implemented "
                         f"(llama.cpp's deepseek2 takes {rope_att} with YaRN)")
    scaling = {**scaling, "mscale": mscale_all_dim, "mscale_all_dim": mscale_all_dim, "attention_factor": rope_att}
    return scaling, softmax_scale(head_dim, scaling)


def softmax_scale(head_dim: int, scaling: dict | None) -> float:
    """The softmax scale of llama.cpp's deepseek2 graph (transformers' DeepSeek V3 where mscale = mscale_all_dim):
    head_dim^-0.5, with YaRN (scaling: strata.models.rope's normalized dict, mscale_all_dim set) times
    (0.1 mscale_all_dim ln(factor) + 1)^2."""
    if not scaling:
        return head_dim ** -0.5
    factor = scaling["factor"]
    m = 1.0 if factor <= 1 else 0.1 * scaling["mscale_all_dim"] * math.log(factor) + 1.0
    return head_dim ** -0.5 * m * m
