"""The model families, each declared in one place: its tensor names in HF and GGUF files, and how its config
keys become `ModelArgs` (what the decoder core varies for it). A key that would change the arithmetic and is not
implemented is refused in one line naming the file, the key and the value; nothing is ignored silently."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace

import torch

from strata.models import deepseek
from strata.models.args import ModelArgs
from strata.errors import ModelError
from strata.models.rope import scaling_from_gguf, scaling_from_hf, yarn_positions

# canonical per-layer short name -> HF per-layer name (model.layers.N.<name>), the Llama layout
_HF_LLAMA = {"attn_norm": "input_layernorm.weight", "wq": "self_attn.q_proj.weight",
             "wk": "self_attn.k_proj.weight", "wv": "self_attn.v_proj.weight",
             "bq": "self_attn.q_proj.bias", "bk": "self_attn.k_proj.bias", "bv": "self_attn.v_proj.bias",
             "wo": "self_attn.o_proj.weight", "mlp_norm": "post_attention_layernorm.weight",
             "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight", "w_down": "mlp.down_proj.weight",
             "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
             # Mixtral's experts (the llama family with experts)
             "router": "block_sparse_moe.gate.weight", "e_gate": "block_sparse_moe.experts.{e}.w1.weight",
             "e_up": "block_sparse_moe.experts.{e}.w3.weight", "e_down": "block_sparse_moe.experts.{e}.w2.weight"}
# canonical per-layer short name -> GGUF per-layer name (blk.N.<name>), as llama.cpp's llama-arch.cpp names them
_GGUF_LLAMA = {"attn_norm": "attn_norm.weight", "wq": "attn_q.weight", "wk": "attn_k.weight",
               "wv": "attn_v.weight", "bq": "attn_q.bias", "bk": "attn_k.bias", "bv": "attn_v.bias",
               "wo": "attn_output.weight", "mlp_norm": "ffn_norm.weight", "w_gate": "ffn_gate.weight",
               "w_up": "ffn_up.weight", "w_down": "ffn_down.weight",
               "q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight",
               "router": "ffn_gate_inp.weight", "e_gate": "ffn_gate_exps.weight", "e_up": "ffn_up_exps.weight",
               "e_down": "ffn_down_exps.weight"}
# the DeepSeek line's layer in HF files: MLA's projections and norms, GLM-4.5's router and experts
_HF_DEEPSEEK = {**_HF_LLAMA, "wq_a": "self_attn.q_a_proj.weight", "q_a_norm": "self_attn.q_a_layernorm.weight",
                "wq_b": "self_attn.q_b_proj.weight", "wkv_a": "self_attn.kv_a_proj_with_mqa.weight",
                "kv_a_norm": "self_attn.kv_a_layernorm.weight", "wkv_b": "self_attn.kv_b_proj.weight",
                "router": "mlp.gate.weight", "router_bias": "mlp.gate.e_score_correction_bias",
                "e_gate": "mlp.experts.{e}.gate_proj.weight", "e_up": "mlp.experts.{e}.up_proj.weight",
                "e_down": "mlp.experts.{e}.down_proj.weight", "s_gate": "mlp.shared_experts.gate_proj.weight",
                "s_up": "mlp.shared_experts.up_proj.weight", "s_down": "mlp.shared_experts.down_proj.weight"}
_HF_INDEXER = {"ix_wq_b": "self_attn.indexer.wq_b.weight", "ix_wk": "self_attn.indexer.wk.weight",
               "ix_k_norm": "self_attn.indexer.k_norm.weight", "ix_k_norm_b": "self_attn.indexer.k_norm.bias",
               "ix_w": "self_attn.indexer.weights_proj.weight"}
HF_GLOBAL = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight", "head": "lm_head.weight"}
GGUF_GLOBAL = {"embed": "token_embd.weight", "norm": "output_norm.weight", "head": "output.weight"}

# {arch}.* keys every GGUF family's reader takes (strata.weights.gguf_loader.gguf_model_args), and strata.models.rope's
_GGUF_COMMON_KEYS = frozenset({"block_count", "context_length", "embedding_length", "feed_forward_length", "vocab_size",
                               "attention.head_count", "attention.head_count_kv", "attention.key_length",
                               "attention.value_length", "attention.layer_norm_rms_epsilon", "rope.freq_base"})
_GGUF_ROPE_SCALING_KEYS = frozenset({"rope.scale_linear"} | {"rope.scaling." + k for k in (
    "type", "factor", "original_context_length", "attn_factor", "alpha", "yarn_log_multiplier", "yarn_ext_factor",
    "yarn_attn_factor", "yarn_beta_fast", "yarn_beta_slow", "low_freq_factor", "high_freq_factor")})

ACTIVATION_OF = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


@dataclass(frozen=True)
class Family:
    name: str                                 # ModelArgs.arch
    hf_architectures: tuple[str, ...]         # config.json "architectures"
    gguf_arch: str                            # general.architecture ("": its GGUF files are not read yet)
    hf_layer: dict = field(default_factory=lambda: dict(_HF_LLAMA))
    gguf_layer: dict = field(default_factory=lambda: dict(_GGUF_LLAMA))
    # one file tensor holding several canonical ones, stacked by rows in this order (phi3's qkv, gate_up)
    hf_fused: dict = field(default_factory=dict)
    gguf_fused: dict = field(default_factory=dict)
    # canonical short name -> (HF per-layer name, how the canonical tensor comes from it): gpt-oss's experts
    hf_derived: dict = field(default_factory=dict)
    # the same for a GGUF's per-layer names (qwen35); a tuple of names: the canonical tensor made of those tensors,
    # decoded, fn(*tensors, args) (deepseek2's kv_b from attn_k_b and attn_v_b), held dense
    gguf_derived: dict = field(default_factory=dict)
    # a derived GGUF matrix whose derivation moves columns, which whole blocks cannot: short name -> the column
    # order (canonical column j is the file's column order[j]); held resident as stored, the order undone where read.
    # (Every other derivation moves whole rows, and applies to a resident matrix's block rows unchanged.)
    gguf_col_order: dict = field(default_factory=dict)
    gguf_permute_qk: bool = False             # llama.cpp's converter interleaves q/k rows of arch llama only
    qkv_bias: bool = False
    qk_norm: bool = False
    gemma: bool = False                       # (1 + w) norms, sandwich norms, sqrt(dim) embedding scale, GeGLU
    window_keys: bool = False                 # sliding_window applies to every layer (mistral, phi3)
    # the {arch}.* GGUF keys this family reads: any other is refused, and so is any tensor the file holds that a
    # slice would not read (None: neither is checked, the older families)
    gguf_keys: frozenset | None = None
    gguf_nextn: bool = False                  # the last {arch}.nextn_predict_layers blocks are MTP layers, skipped
    hf_fused_experts: bool = False            # its experts may be stored fused instead (hf_checkpoint_family)


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llama", ("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM"), "llama", gguf_permute_qk=True,
           window_keys=True),
    Family("qwen2", ("Qwen2ForCausalLM",), "qwen2", qkv_bias=True),
    Family("qwen3", ("Qwen3ForCausalLM",), "qwen3", qk_norm=True),
    Family("gemma3", ("Gemma3ForCausalLM",), "gemma3", qk_norm=True, gemma=True,
           hf_layer={**_HF_LLAMA, "attn_post_norm": "post_attention_layernorm.weight",
                     "mlp_norm": "pre_feedforward_layernorm.weight",
                     "mlp_post_norm": "post_feedforward_layernorm.weight"},
           gguf_layer={**_GGUF_LLAMA, "attn_post_norm": "post_attention_norm.weight",
                       "mlp_post_norm": "post_ffw_norm.weight"}),
    Family("qwen3_moe", ("Qwen3MoeForCausalLM",), "qwen3moe", qk_norm=True, hf_fused_experts=True,
           hf_layer={**_HF_LLAMA, "router": "mlp.gate.weight", "e_gate": "mlp.experts.{e}.gate_proj.weight",
                     "e_up": "mlp.experts.{e}.up_proj.weight", "e_down": "mlp.experts.{e}.down_proj.weight"}),
    Family("glm4_moe", ("Glm4MoeForCausalLM",), "glm4moe",
           hf_layer={**_HF_LLAMA, "router": "mlp.gate.weight", "router_bias": "mlp.gate.e_score_correction_bias",
                     "e_gate": "mlp.experts.{e}.gate_proj.weight", "e_up": "mlp.experts.{e}.up_proj.weight",
                     "e_down": "mlp.experts.{e}.down_proj.weight", "s_gate": "mlp.shared_experts.gate_proj.weight",
                     "s_up": "mlp.shared_experts.up_proj.weight", "s_down": "mlp.shared_experts.down_proj.weight"},
           # llama.cpp's glm4moe (gguf.constants MODEL_ARCH.GLM4_MOE): the MLP's norm is post_attention_norm, the
           # choosing bias exp_probs_b; q/k rows as HF's (its RoPE is NeoX: rotate-half, no permutation)
           gguf_layer={**_GGUF_LLAMA, "mlp_norm": "post_attention_norm.weight", "router_bias": "exp_probs_b.bias",
                       "s_gate": "ffn_gate_shexp.weight", "s_up": "ffn_up_shexp.weight",
                       "s_down": "ffn_down_shexp.weight"},
           gguf_keys=frozenset(_GGUF_COMMON_KEYS | _GGUF_ROPE_SCALING_KEYS | {
               "rope.dimension_count", "expert_count", "expert_used_count", "expert_feed_forward_length",
               "expert_shared_count", "expert_group_count", "expert_group_used_count", "expert_gating_func",
               "expert_weights_scale", "expert_weights_norm", "leading_dense_block_count", "nextn_predict_layers"}),
           gguf_nextn=True),
    Family("gpt_oss", ("GptOssForCausalLM",), "gpt-oss", qkv_bias=True,
           hf_layer={**_HF_LLAMA, "bo": "self_attn.o_proj.bias", "sinks": "self_attn.sinks",
                     "router": "mlp.router.weight", "router_bias": "mlp.router.bias"},
           # its experts: gate_up (E, dim, 2 effn) with gate and up interleaved by column, down (E, effn, dim)
           hf_derived={"e_gate": ("mlp.experts.gate_up_proj", lambda t, a: t[..., ::2].transpose(1, 2)),
                       "e_up": ("mlp.experts.gate_up_proj", lambda t, a: t[..., 1::2].transpose(1, 2)),
                       "e_down": ("mlp.experts.down_proj", lambda t, a: t.transpose(1, 2)),
                       "e_gate_b": ("mlp.experts.gate_up_proj_bias", lambda t, a: t[..., ::2]),
                       "e_up_b": ("mlp.experts.gate_up_proj_bias", lambda t, a: t[..., 1::2]),
                       "e_down_b": ("mlp.experts.down_proj_bias", lambda t, a: t)},
           gguf_layer={**_GGUF_LLAMA, "bo": "attn_output.bias", "sinks": "attn_sinks.weight",
                       "mlp_norm": "post_attention_norm.weight", "router_bias": "ffn_gate_inp.bias",
                       "e_gate_b": "ffn_gate_exps.bias", "e_up_b": "ffn_up_exps.bias",
                       "e_down_b": "ffn_down_exps.bias"}),
    Family("qwen3_5", ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"), "qwen35", qk_norm=True, hf_fused_experts=True,
           hf_layer={**_HF_LLAMA, "router": "mlp.gate.weight", "e_gate": "mlp.experts.{e}.gate_proj.weight",
                     "e_up": "mlp.experts.{e}.up_proj.weight", "e_down": "mlp.experts.{e}.down_proj.weight",
                     "s_gate": "mlp.shared_expert.gate_proj.weight", "s_up": "mlp.shared_expert.up_proj.weight",
                     "s_down": "mlp.shared_expert.down_proj.weight", "s_sig": "mlp.shared_expert_gate.weight",
                     "lin_qkv": "linear_attn.in_proj_qkv.weight", "lin_z": "linear_attn.in_proj_z.weight",
                     "lin_b": "linear_attn.in_proj_b.weight", "lin_a": "linear_attn.in_proj_a.weight",
                     "lin_dt": "linear_attn.dt_bias", "lin_alog": "linear_attn.A_log",
                     "lin_norm": "linear_attn.norm.weight", "lin_out": "linear_attn.out_proj.weight"},
           # q_proj holds each head's query then its output gate; conv1d's weight is (channels, 1, kernel)
           hf_derived={"wq": ("self_attn.q_proj.weight", lambda t, a: _per_head(t, a, 0)),
                       "wg": ("self_attn.q_proj.weight", lambda t, a: _per_head(t, a, 1)),
                       "lin_conv": ("linear_attn.conv1d.weight", lambda t, a: t[:, 0])},
           # llama.cpp's converter stores the value heads tiled (value head r of every k head, then r + 1) where
           # HF groups them by k head, A as -exp(A_log), and the (1 + w) norms as 1 + w: undone here
           gguf_layer={**_GGUF_LLAMA, "mlp_norm": "post_attention_norm.weight", "lin_norm": "ssm_norm.weight"},
           gguf_derived={"wq": ("attn_q.weight", lambda t, a: _per_head(t, a, 0)),
                         "wg": ("attn_q.weight", lambda t, a: _per_head(t, a, 1)),
                         "lin_qkv": ("attn_qkv.weight",
                                     lambda t, a: _untile_after(t, a, 2 * a.lin_k_heads * a.lin_k_dim)),
                         "lin_conv": ("ssm_conv1d.weight",
                                      lambda t, a: _untile_after(t, a, 2 * a.lin_k_heads * a.lin_k_dim)),
                         "lin_z": ("attn_gate.weight", lambda t, a: _untile(t, a, 0, a.lin_v_dim)),
                         "lin_b": ("ssm_beta.weight", lambda t, a: _untile(t, a, 0, 1)),
                         "lin_a": ("ssm_alpha.weight", lambda t, a: _untile(t, a, 0, 1)),
                         "lin_dt": ("ssm_dt.bias", lambda t, a: _untile(t, a, 0, 1)),
                         "lin_alog": ("ssm_a", lambda t, a: _untile((-t).log(), a, 0, 1)),
                         "lin_out": ("ssm_out.weight", lambda t, a: _untile(t, a, 1, a.lin_v_dim))},
           gguf_col_order={"lin_out": lambda a: _untile(torch.arange(a.lin_v_heads * a.lin_v_dim), a, 0, a.lin_v_dim)}),
    # DeepSeek V3 / R1 / V3.1 and Kimi K2 (model_type kimi_k2): MLA (strata.models.mla) and GLM-4.5's router; its
    # GGUF (deepseek2) read in strata.models.deepseek
    Family("deepseek_v3", ("DeepseekV3ForCausalLM",), deepseek.GGUF_ARCH, hf_fused_experts=True, hf_layer=_HF_DEEPSEEK,
           gguf_layer=dict(deepseek.GGUF_LAYER), gguf_derived=dict(deepseek.GGUF_DERIVED), gguf_keys=deepseek.GGUF_KEYS,
           gguf_nextn=True),
    # DeepSeek V3.2 and GLM-5: the same with DSA's lightning indexer (strata.models.dsa); their GGUF files
    # (deepseek32, glm-dsa: deepseek2's tensors and the blk.N.indexer.* ones) read in strata.models.deepseek too
    Family("deepseek_v32", ("DeepseekV32ForCausalLM",), deepseek.GGUF_ARCH_V32, hf_fused_experts=True,
           hf_layer={**_HF_DEEPSEEK, **_HF_INDEXER}, gguf_layer={**deepseek.GGUF_LAYER, **deepseek.GGUF_INDEXER},
           gguf_derived=dict(deepseek.GGUF_DERIVED), gguf_keys=deepseek.GGUF_KEYS_V32, gguf_nextn=True),
    Family("glm_moe_dsa", ("GlmMoeDsaForCausalLM",), deepseek.GGUF_ARCH_GLM, hf_fused_experts=True,
           hf_layer={**_HF_DEEPSEEK, **_HF_INDEXER}, gguf_layer={**deepseek.GGUF_LAYER, **deepseek.GGUF_INDEXER},
           gguf_derived=dict(deepseek.GGUF_DERIVED), gguf_keys=deepseek.GGUF_KEYS_GLM, gguf_nextn=True),
    Family("phi3", ("Phi3ForCausalLM",), "phi3", window_keys=True,
           hf_fused={"self_attn.qkv_proj.weight": ("wq", "wk", "wv"), "mlp.gate_up_proj.weight": ("w_gate", "w_up")},
           gguf_fused={"attn_qkv.weight": ("wq", "wk", "wv"), "ffn_up.weight": ("w_gate", "w_up")}),
)}
# the families whose attention is MLA (their GGUF's key / value lengths and head_count_kv are the absorbed form's)
LATENT_FAMILIES = ("deepseek_v3", "deepseek_v32", "glm_moe_dsa")
_BY_HF = {a: f for f in FAMILIES.values() for a in f.hf_architectures}
_BY_GGUF = {f.gguf_arch: f for f in FAMILIES.values() if f.gguf_arch}
_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
                "gemma3_text": "gemma3", "phi3": "phi3", "qwen3_moe": "qwen3_moe", "glm4_moe": "glm4_moe",
                "gpt_oss": "gpt_oss", "qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5",
                "deepseek_v3": "deepseek_v3", "kimi_k2": "deepseek_v3", "deepseek_v32": "deepseek_v32",
                "glm_moe_dsa": "glm_moe_dsa"}


def _per_head(t, a, part: int):
    """Rows (heads * 2 * hd, dim) holding each head's [query | gate] -> the `part` rows of every head."""
    return t.view(a.n_heads, 2, a.head_dim, -1)[:, part].reshape(a.n_heads * a.head_dim, -1)


def _untile(t, a, dim: int, hd: int):
    """Value heads along `dim` from llama.cpp's tiled order (r, k head, hd) back to HF's grouped (k head, r, hd)."""
    nk, rep = a.lin_k_heads, a.lin_v_heads // a.lin_k_heads
    if rep == 1:
        return t
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], rep, nk, hd, *shape[dim + 1:]).transpose(dim, dim + 1)
    return t.reshape(shape)


def _untile_after(t, a, first: int):
    """Rows [first:) (the value part of a q/k/v stack) untiled, the rows before as they are."""
    return torch.cat((t[:first], _untile(t[first:], a, 0, a.lin_v_dim)))


def family(arch: str) -> Family:
    return FAMILIES[arch]


# -- a Qwen MoE checkpoint's experts: per expert or fused --------------------------------------------------------
# transformers 5 holds a Qwen MoE layer's experts (qwen3_moe, qwen3_5) as two 3D parameters: mlp.experts.gate_up_proj
# (E, 2 * effn, dim), every expert's gate rows then its up rows (its conversion_mapping's qwen2_moe concatenates them
# so, and the forward chunks them so), and mlp.experts.down_proj (E, dim, effn). Its save_pretrained splits them per
# expert (the names hf_layer maps); a checkpoint written from the fused form keeps them fused, named with or without
# ".weight" (llama.cpp's converter takes all three). A checkpoint holds one spelling: read as it holds it.
def _fused(t, a, rows: int, cols: int, part: slice = slice(None)):
    """A fused experts tensor, checked against the config's (E, rows, cols) (a transposed stack would be read as
    another matrix), then its rows `part`."""
    if tuple(t.shape) != (a.n_experts, rows, cols):
        raise ModelError(f"fused experts tensor of shape {tuple(t.shape)}: the config implies "
                         f"{(a.n_experts, rows, cols)}")
    return t[:, part]


_HF_FUSED_EXPERTS = {
    "e_gate": ("mlp.experts.gate_up_proj",
               lambda t, a: _fused(t, a, 2 * a.expert_ffn_dim, a.dim, slice(None, a.expert_ffn_dim))),
    "e_up": ("mlp.experts.gate_up_proj",
             lambda t, a: _fused(t, a, 2 * a.expert_ffn_dim, a.dim, slice(a.expert_ffn_dim, None))),
    "e_down": ("mlp.experts.down_proj", lambda t, a: _fused(t, a, a.dim, a.expert_ffn_dim))}
_EXPERT_SPELLINGS = {"per expert": re.compile(r"model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight"),
                     "fused": re.compile(r"model\.layers\.\d+\.mlp\.experts\.(gate_up|down)_proj"),
                     "fused .weight": re.compile(r"model\.layers\.\d+\.mlp\.experts\.(gate_up|down)_proj\.weight")}


def hf_checkpoint_family(fam: Family, stored, where: str) -> Family:
    """`fam` as a checkpoint holding the tensors `stored` (names as its map looks them up) spells it: a family whose
    experts may be fused (hf_fused_experts) reads them fused where the checkpoint holds them so (else per expert: what
    is missing is named then); a checkpoint holding two spellings is refused."""
    if not fam.hf_fused_experts:
        return fam
    found: dict[str, str] = {}
    for name in stored:
        for spelling, pattern in _EXPERT_SPELLINGS.items():
            if pattern.fullmatch(name):
                found.setdefault(spelling, name)
    if len(found) > 1:
        (a, x), (b, y) = sorted(found.items())[:2]
        raise ModelError(f"{where}: the experts are stored both {a} ({x}) and {b} ({y})")
    if "fused" not in found and "fused .weight" not in found:
        return fam
    suffix = ".weight" if "fused .weight" in found else ""
    return replace(fam, hf_derived={**fam.hf_derived,
                                    **{s: (n + suffix, f) for s, (n, f) in _HF_FUSED_EXPERTS.items()}})


def supported_hf() -> str:
    return ", ".join(sorted(_BY_HF))


def supported_gguf() -> str:
    return ", ".join(sorted(_BY_GGUF))


# -- multimodal checkpoints: their text model only -------------------------------------------------------------
# transformers' multimodal classes whose text model is a family here -> that text model's architecture (its reader
# takes the config's text_config) and the composite's tie_word_embeddings default: transformers 5.25 ties the
# composite's lm_head by the top-level key (the class that holds the head has the composite config), not text_config's.
HF_COMPOSITES = {"Qwen3_5ForConditionalGeneration": ("Qwen3_5ForCausalLM", False),
                 "Qwen3_5MoeForConditionalGeneration": ("Qwen3_5MoeForCausalLM", False),
                 "Gemma3ForConditionalGeneration": ("Gemma3ForCausalLM", True)}
# where a composite's safetensors keep its text model's tensors -> the names a text-only checkpoint gives them (what
# the families' maps look up): transformers 5 writes model.language_model.X; Gemma 3's released files (and
# transformers' save of that class) language_model.model.X and language_model.lm_head.weight. Anything else (the
# vision tower, Qwen3.5's mtp.*) is never read. Composites only: a text-only checkpoint's names are taken as stored,
# so a model.language_model.* tensor there never stands in for one its map names.
HF_TEXT_PREFIXES = {"model.language_model.": "model.", "language_model.model.": "model.",
                    "language_model.lm_head.": "lm_head.", "lm_head.": "lm_head."}
# text_config keys a composite class (transformers 5.25) leaves unapplied though its text-only class applies them:
# Gemma3ForConditionalGeneration returns lm_head's logits uncapped. Refused where set, as either reading would be a
# guess (the released Gemma 3 configs have none)
_COMPOSITE_UNAPPLIED = {"Gemma3ForConditionalGeneration": ("final_logit_softcapping",)}


def hf_text_name(arch: str | None, stored: str) -> str | None:
    """A checkpoint's tensor name as the family's map looks it up (None: not the text model's), for a checkpoint
    whose config.json names `arch`."""
    if arch not in HF_COMPOSITES:
        return stored
    for prefix, plain in HF_TEXT_PREFIXES.items():
        if stored.startswith(prefix):
            return plain + stored[len(prefix):]
    return None


def _hf_text_config(cfg: dict, where: str) -> dict:
    """A multimodal config.json -> the config its text model's reader takes: text_config, as the text architecture,
    tied as transformers ties the composite."""
    arch = cfg["architectures"][0]
    text, tie = HF_COMPOSITES[arch]
    sub = cfg.get("text_config")
    if not isinstance(sub, dict):
        raise ModelError(f"{where}: {arch} config lacks 'text_config'")
    for key in _COMPOSITE_UNAPPLIED.get(arch, ()):
        if sub.get(key) is not None:
            raise ModelError(f"{where}: text_config {key} = {sub[key]!r} is not implemented for {arch} "
                             f"(transformers' {arch} does not apply it, its {text} does)")
    return {**sub, "architectures": [text], "tie_word_embeddings": cfg.get("tie_word_embeddings", tie)}


# -- HF config.json ------------------------------------------------------------------------------------------
# the partial rotary factor transformers' config classes assume where config.json has none (Glm4MoeConfig 0.5, and
# llama.cpp's converter too; Qwen3_5TextConfig and its MoE 0.25): RoPE over all of a head would be another model
_PARTIAL_ROTARY_DEFAULT = {"glm4_moe": 0.5, "qwen3_5": 0.25}
# Gemma3TextConfig's defaults (transformers 5.25) for the keys that change the arithmetic or the shapes: the released
# Gemma 3 checkpoints' text_config lists only what differs from them (gemma-3-4b-it's not even its heads), and
# transformers takes these for the rest (rope_theta: the global layers' base where rope_parameters gives none)
_GEMMA3_DEFAULTS = {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256,
                    "sliding_window": 4096, "rope_theta": 1e6, "rope_local_base_freq": 10000.0,
                    "bos_token_id": 2, "eos_token_id": 1}
# Glm4MoeConfig's defaults for its router keys (transformers 5.25): a config.json without n_shared_experts has one
# shared expert, without first_k_dense_replace one dense first layer
_GLM4_MOE_DEFAULTS = {"n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
                      "norm_topk_prob": True, "routed_scaling_factor": 1.0}


def hf_args(cfg: dict, where: str) -> ModelArgs:
    """config.json -> ModelArgs, or ModelError naming the key and value that cannot be honoured. A multimodal
    config (HF_COMPOSITES): its text model's, from text_config."""
    archs = cfg.get("architectures") or [cfg.get("model_type", "?")]
    if archs[0] in HF_COMPOSITES:
        cfg, where = _hf_text_config(cfg, where), f"{where} text_config"
        archs = cfg["architectures"]
    fam = _BY_HF.get(archs[0]) or FAMILIES.get(_MODEL_TYPES.get(cfg.get("model_type"), ""))
    if fam is None:
        raise ModelError(f"{where}: unsupported architecture {archs[0]!r} (supported: {supported_hf()})")
    cfg = _gemma3_text(cfg, where) if fam.gemma else cfg
    q = cfg.get("quantization_config")
    if q:  # (DeepSeek V3's released weights: fp8 blocks with weight_scale_inv beside them; read as plain floats they
        # would be another model)
        method = q.get("quant_method") if isinstance(q, dict) else q
        raise ModelError(f"{where}: quantization_config (quant_method {method!r}) is not implemented: use the bf16 "
                         "weights or a GGUF")
    try:
        if fam.name in ("deepseek_v3", "deepseek_v32", "glm_moe_dsa"):
            return _hf_deepseek_v3(cfg, where, fam.name)
        return _hf_family_args(cfg, fam, archs[0], where)
    except KeyError as e:  # a key read before ModelArgs is built; one the config has is this code's bug: raised as is
        if e.args and e.args[0] in cfg:
            raise
        raise ModelError(f"{where}: config lacks {e.args[0]!r}") from None


def _gemma3_text(cfg: dict, where: str) -> dict:
    """A gemma3 text config as transformers completes it: Gemma3TextConfig's defaults for absent keys, and without
    layer_types every sliding_window_pattern-th layer (6) global."""
    cfg = {**_GEMMA3_DEFAULTS, **cfg}
    if cfg.get("layer_types") is None:
        cfg["layer_types"] = _every_nth_full(cfg, "sliding_window_pattern", 6, "sliding_attention", where)
    return cfg


def _every_nth_full(cfg: dict, key: str, default: int, other: str, where: str) -> list[str]:
    """layer_types as transformers derives them where a config lists none: every cfg[key]-th layer (default)
    "full_attention", the others `other`; a period that is not a positive integer refused in one line."""
    every = cfg.get(key, default)
    if type(every) is not int or every < 1:
        raise ModelError(f"{where}: {key} = {every!r} is not implemented (a positive integer)")
    return [other if (i + 1) % every else "full_attention" for i in range(cfg["num_hidden_layers"])]


def _drop_mrope(rs: dict, where: str) -> dict:
    """Qwen3.5's rope dict without its multimodal RoPE keys. M-RoPE splits the rotary dims among a time, a height and
    a width position (mrope_section; mrope_interleaved: by turns); transformers gives a text token its position on
    all three, so over text it is plain RoPE. A section transformers' rotary cannot index (3 ints) is refused."""
    sec = rs.get("mrope_section")
    if sec is not None and not (isinstance(sec, list) and len(sec) >= 3
                                and all(isinstance(n, int) and not isinstance(n, bool) for n in sec)):
        raise ModelError(f"{where}: rope_parameters mrope_section = {sec!r} is not implemented "
                         "(at least an int for each of time, height and width)")
    return {k: v for k, v in rs.items() if k not in ("mrope_section", "mrope_interleaved")}


def _hf_family_args(cfg: dict, fam: Family, arch: str, where: str) -> ModelArgs:
    """hf_args for a text model's config of family `fam` (config.json's architecture `arch`)."""
    def refuse(key, why="is not implemented"):
        raise ModelError(f"{where}: {key} = {cfg.get(key)!r} {why}")

    # keys that change the arithmetic, accepted only at the value the core implements
    act_key = "hidden_activation" if fam.gemma else "hidden_act"
    act = ACTIVATION_OF.get(cfg.get(act_key) or ("gelu_pytorch_tanh" if fam.gemma else "silu"))
    if act is None or (act == "gelu_tanh") != fam.gemma:
        refuse(act_key)
    if cfg.get("mlp_bias"):
        refuse("mlp_bias")
    glm = fam.name == "glm4_moe"  # its attention_bias is q/k/v's only, and it may norm q and k
    oss = fam.name == "gpt_oss"   # biases on q/k/v/o, sinks
    q35 = fam.name == "qwen3_5"   # linear-attention layers, gated full attention, partial rotary
    if cfg.get("attention_bias") and not (glm or oss):
        refuse("attention_bias", "is not implemented (biases on q/k/v/o)")
    if oss and not cfg.get("attention_bias", True):
        refuse("attention_bias", "is not implemented for gpt_oss (its checkpoints have them)")
    if cfg.get("attn_logit_softcapping") is not None:
        refuse("attn_logit_softcapping")
    if cfg.get("use_bidirectional_attention"):
        refuse("use_bidirectional_attention")
    rp0 = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    prf = float(cfg.get("partial_rotary_factor") or rp0.get("partial_rotary_factor")
                or _PARTIAL_ROTARY_DEFAULT.get(fam.name, 1.0))
    # (transformers' Llama-style families ignore it at the default rope, Phi honours it)
    if prf != 1.0 and not (glm or q35):
        refuse("partial_rotary_factor")
    experts = _hf_experts(cfg, arch, where, refuse)
    for key in ("attention_chunk_size", "no_rope_layers"):
        if cfg.get(key):
            refuse(key)

    nh = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // nh
    rp = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else None
    window_theta = None
    if fam.gemma and rp is not None and "full_attention" in rp:  # per layer type (transformers 5)
        full, local = rp.get("full_attention") or {}, rp.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise ModelError(f"{where}: rope_parameters.sliding_attention.rope_type = {local.get('rope_type')!r} "
                             "is not implemented")
        window_theta = float(local.get("rope_theta", cfg.get("rope_local_base_freq", 10000.0)))
        rp = full
    elif fam.gemma:
        window_theta = float(cfg.get("rope_local_base_freq", 10000.0))
    rs = cfg.get("rope_scaling") or rp
    if rs and "partial_rotary_factor" in rs:  # read above, as rotary_dim
        rs = {k: v for k, v in rs.items() if k != "partial_rotary_factor"}
    if rs and q35:
        rs = _drop_mrope(rs, where)
    theta = float((rp or {}).get("rope_theta") or cfg.get("rope_theta") or 10000.0)
    scaling = scaling_from_hf(rs, where, max_position_embeddings=cfg.get("max_position_embeddings"),
                              original_max_position_embeddings=cfg.get("original_max_position_embeddings"))

    window, window_layers = _hf_window(cfg, fam, where)
    extra = _hf_linear(cfg, where) if q35 else {}
    if fam.gemma:
        extra = dict(norm_offset=True, post_norms=True, activation="gelu_tanh",
                     embed_scale=float(cfg["hidden_size"]) ** 0.5,
                     attn_scale=float(cfg.get("query_pre_attn_scalar", head_dim)) ** -0.5,
                     final_softcap=cfg.get("final_logit_softcapping"),
                     window_rope_theta=window_theta if window is not None else None)
    elif cfg.get("final_logit_softcapping") is not None:
        refuse("final_logit_softcapping")
    eos = cfg.get("eos_token_id")
    try:
        return ModelArgs(arch=fam.name, vocab_size=cfg["vocab_size"], dim=cfg["hidden_size"],
                         n_layers=cfg["num_hidden_layers"], n_heads=nh, n_kv_heads=cfg.get("num_key_value_heads") or nh,
                         head_dim=head_dim, ffn_dim=cfg.get("intermediate_size") or cfg["moe_intermediate_size"],
                         norm_eps=cfg.get("rms_norm_eps", 1e-6 if fam.gemma else 1e-5),
                         rope_theta=theta, rope_scaling=scaling,
                         tie_embeddings=bool(cfg.get("tie_word_embeddings", fam.gemma)),
                         qkv_bias=fam.qkv_bias or (glm and bool(cfg.get("attention_bias"))),
                         qk_norm=fam.qk_norm or (glm and bool(cfg.get("use_qk_norm"))),
                         rotary_dim=int(head_dim * prf) if prf != 1.0 else None,
                         max_seq_len=_max_positions(cfg, scaling),
                         sliding_window=window, window_layers=window_layers,
                         bos_id=cfg.get("bos_token_id"), eos_id=eos[0] if isinstance(eos, list) else eos,
                         **experts, **extra)
    except KeyError as e:
        raise ModelError(f"{where}: config lacks {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise ModelError(f"{where}: {e}") from None


# DeepseekV3Config's defaults (transformers 5.25) for the keys a config.json may leave out
_DEEPSEEK_V3_DEFAULTS = {"n_shared_experts": 1, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
                         "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
                         "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
                         "norm_topk_prob": True, "rms_norm_eps": 1e-6, "rope_interleave": True, "hidden_act": "silu",
                         "max_position_embeddings": 4096, "bos_token_id": 0, "eos_token_id": 1}
# keys of DeepSeek's own configs (trust_remote_code era) at the only value transformers' DeepseekV3 computes
_DEEPSEEK_V3_FIXED = {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1,
                      "attention_bias": False, "mlp_bias": False}


# DeepseekV32Config's and GlmMoeDsaConfig's defaults (transformers 5.25) where they differ from V3's
_DSA_DEFAULTS = {"deepseek_v32": {"max_position_embeddings": 163840, "index_topk": 2048, "index_head_dim": 128,
                                  "index_n_heads": 64},
                 "glm_moe_dsa": {"vocab_size": 154880, "n_group": 1, "topk_group": 1, "q_lora_rank": 2048,
                                 "v_head_dim": 256, "qk_nope_head_dim": 192, "rms_norm_eps": 1e-5,
                                 "max_position_embeddings": 202752, "index_topk": 2048, "index_head_dim": 128,
                                 "index_n_heads": 32}}


def _hf_deepseek_v3(cfg: dict, where: str, arch: str = "deepseek_v3") -> ModelArgs:
    """DeepSeek V3 / R1 / V3.1 and Kimi K2 from config.json, as transformers' DeepseekV3 computes them: MLA (q
    through q_lora_rank or not, the latent of kv_lora_rank, qk_nope + qk_rope q/k heads, v_head_dim values, the
    rope layout by rope_interleave), the softmax scale with YaRN's mscale_all_dim folded in twice (transformers'
    yarn_apply_mscale), sigmoid routing with the correction bias in n_group groups, routed_scaling_factor, shared
    experts, the first first_k_dense_replace layers dense. Multi-token-prediction layers (past num_hidden_layers)
    are never read."""
    cfg = {**_DEEPSEEK_V3_DEFAULTS, **_DSA_DEFAULTS.get(arch, {}),
           **{k: v for k, v in cfg.items() if v is not None or k == "q_lora_rank"}}
    dense = int(cfg["first_k_dense_replace"])
    sparse = _dsa(cfg, where, arch, dense) if arch != "deepseek_v3" else {}
    for key, value in _DEEPSEEK_V3_FIXED.items():
        if cfg.get(key, value) != value:
            raise ModelError(f"{where}: {key} = {cfg[key]!r} is not implemented (DeepSeek V3: {value!r})")
    if cfg["hidden_act"] != "silu":
        raise ModelError(f"{where}: hidden_act = {cfg['hidden_act']!r} is not implemented")
    if cfg.get("num_key_value_heads") not in (None, cfg["num_attention_heads"]):
        raise ModelError(f"{where}: num_key_value_heads = {cfg['num_key_value_heads']!r} is not implemented for MLA "
                         f"(its {cfg['num_attention_heads']} heads share one latent)")
    rs = cfg.get("rope_scaling") or (cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict)
                                     else None)
    theta = float((rs or {}).get("rope_theta") or cfg.get("rope_theta") or 10000.0)
    scaling = scaling_from_hf(rs, where, max_position_embeddings=cfg.get("max_position_embeddings"),
                              original_max_position_embeddings=cfg.get("original_max_position_embeddings"))
    if scaling and scaling["rope_type"] not in ("yarn", "linear", "llama3"):
        raise ModelError(f"{where}: rope type {scaling['rope_type']!r} is not implemented for MLA")
    rope, nope = int(cfg["qk_rope_head_dim"]), int(cfg["qk_nope_head_dim"])
    scale = (nope + rope) ** -0.5
    if scaling and scaling["rope_type"] == "yarn" and scaling.get("mscale_all_dim"):
        m = 0.1 * float(scaling["mscale_all_dim"]) * math.log(scaling["factor"]) + 1.0 \
            if scaling["factor"] > 1 else 1.0
        scale *= m * m
    n, shared = int(cfg["n_routed_experts"]), int(cfg["n_shared_experts"] or 0)
    eos = cfg.get("eos_token_id")
    return ModelArgs(arch=arch, vocab_size=cfg["vocab_size"], dim=cfg["hidden_size"],
                     n_layers=cfg["num_hidden_layers"], n_heads=cfg["num_attention_heads"],
                     n_kv_heads=cfg["num_attention_heads"], head_dim=nope + rope, ffn_dim=cfg["intermediate_size"],
                     norm_eps=cfg["rms_norm_eps"], rope_theta=theta, rope_scaling=scaling,
                     tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                     max_seq_len=_max_positions(cfg, scaling), bos_id=cfg.get("bos_token_id"),
                     eos_id=eos[0] if isinstance(eos, list) else eos, attn_scale=scale,
                     kv_lora_rank=int(cfg["kv_lora_rank"]), q_lora_rank=int(cfg["q_lora_rank"] or 0),
                     qk_rope_dim=rope, v_head_dim=int(cfg["v_head_dim"]),
                     rope_interleave=bool(cfg["rope_interleave"]) or arch != "deepseek_v3", **sparse,
                     n_experts=n, n_experts_used=int(cfg["num_experts_per_tok"]),
                     expert_ffn_dim=int(cfg["moe_intermediate_size"]), router="sigmoid",
                     router_renorm=bool(cfg["norm_topk_prob"]), router_groups=int(cfg["n_group"]),
                     router_groups_used=int(cfg["topk_group"]), routed_scale=float(cfg["routed_scaling_factor"]),
                     shared_ffn_dim=int(cfg["moe_intermediate_size"]) * shared,
                     first_dense_layers=dense)


def _dsa(cfg: dict, where: str, arch: str, dense: int) -> dict:
    """DSA's keys (DeepSeek V3.2, GLM-5) as transformers computes them: every layer "indexed_attention"; the MLP
    dense for the first first_k_dense_replace layers (mlp_layer_types may only say that); the indexer's heads and
    top k; its rope in halves (V3.2) or adjacent pairs (GLM-5, whose main attention is interleaved too); GLM-5's
    indexer_types: a "shared" layer takes the layer before's selection."""
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is not None and set(types) != {"indexed_attention"}:
        raise ModelError(f"{where}: layer_types {sorted(set(types) - {'indexed_attention'})!r} is not implemented")
    mlp = cfg.get("mlp_layer_types")
    if mlp is not None and list(mlp) != ["dense"] * min(dense, n) + ["sparse"] * max(0, n - dense):
        raise ModelError(f"{where}: mlp_layer_types = {mlp!r} is not implemented (the first "
                         f"first_k_dense_replace = {dense} layers dense, then experts)")
    if not cfg.get("q_lora_rank"):
        raise ModelError(f"{where}: q_lora_rank = {cfg.get('q_lora_rank')!r}: the indexer reads q's low-rank residual")
    shared = None
    if arch == "glm_moe_dsa":
        kinds = cfg.get("indexer_types")
        if kinds is None:  # GlmMoeDsaConfig's schedule where the config lists none
            freq, offset = max(int(cfg.get("index_topk_freq", 1)), 1), int(cfg.get("index_skip_topk_offset", 2))
            kinds = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
        if len(kinds) != n or set(kinds) - {"full", "shared"} or kinds[0] != "full":
            raise ModelError(f"{where}: indexer_types = {kinds!r} is not implemented (full or shared per layer, the "
                             "first full)")
        shared = tuple(k == "shared" for k in kinds)
    return dict(index_topk=int(cfg["index_topk"]), index_heads=int(cfg["index_n_heads"]),
                index_head_dim=int(cfg["index_head_dim"]), index_rope_interleave=arch == "glm_moe_dsa",
                index_shared=shared if shared is not None and any(shared) else None)


def _hf_linear(cfg: dict, where: str) -> dict:
    """qwen3_5's hybrid: which layers are Gated DeltaNet, their widths; (1 + w) norms; the gated full attention."""
    types = cfg.get("layer_types")
    if types is None:  # as transformers' Qwen3.5 configs: every full_attention_interval-th layer (4) full attention
        types = _every_nth_full(cfg, "full_attention_interval", 4, "linear_attention", where)
    bad = sorted(set(types) - {"linear_attention", "full_attention"})
    if bad or len(types) != cfg["num_hidden_layers"]:
        raise ModelError(f"{where}: layer_types {bad[0] if bad else types!r} is not implemented")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelError(f"{where}: hidden_act = {cfg.get('hidden_act')!r} is not implemented")
    return dict(linear_layers=tuple(t == "linear_attention" for t in types),
                lin_k_heads=int(cfg["linear_num_key_heads"]), lin_k_dim=int(cfg["linear_key_head_dim"]),
                lin_v_heads=int(cfg["linear_num_value_heads"]),
                lin_v_dim=int(cfg["linear_value_head_dim"]), lin_conv=int(cfg.get("linear_conv_kernel_dim", 4)),
                attn_gate=True, norm_offset=True)


def _hf_experts(cfg: dict, arch: str, where: str, refuse) -> dict:
    """ModelArgs' expert fields from config.json: Mixtral (renormalized top k) and Qwen3-MoE (norm_topk_prob);
    experts anywhere else, or in a layout the core does not implement, refused."""
    n = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts") or 0
    if arch == "Qwen3_5MoeForCausalLM":  # every layer's MLP: experts (renormalized top k) and a gated shared one
        return dict(n_experts=int(n), n_experts_used=int(cfg["num_experts_per_tok"]),
                    expert_ffn_dim=int(cfg["moe_intermediate_size"]), router_renorm=True,
                    shared_ffn_dim=int(cfg.get("shared_expert_intermediate_size") or 0),
                    shared_gate=bool(cfg.get("shared_expert_intermediate_size")))
    if arch == "GptOssForCausalLM":
        return dict(n_experts=int(n), n_experts_used=int(cfg["num_experts_per_tok"]),
                    expert_ffn_dim=int(cfg["intermediate_size"]), router="topk_softmax", expert_bias=True,
                    expert_act="clamped", swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
                    swiglu_limit=float(cfg.get("swiglu_limit", 7.0)), attn_sinks=True, o_bias=True)
    if arch == "Glm4MoeForCausalLM":
        def glm(key):  # a key config.json leaves out (or null) takes Glm4MoeConfig's default, as transformers does
            return _GLM4_MOE_DEFAULTS[key] if cfg.get(key) is None else cfg[key]
        return dict(n_experts=int(n), n_experts_used=int(cfg["num_experts_per_tok"]),
                    expert_ffn_dim=int(cfg["moe_intermediate_size"]), router="sigmoid",
                    router_renorm=bool(glm("norm_topk_prob")), router_groups=int(glm("n_group")),
                    router_groups_used=int(glm("topk_group")), routed_scale=float(glm("routed_scaling_factor")),
                    shared_ffn_dim=int(cfg["moe_intermediate_size"]) * int(glm("n_shared_experts")),
                    first_dense_layers=int(glm("first_k_dense_replace")))
    if arch not in ("MixtralForCausalLM", "Qwen3MoeForCausalLM"):
        if n:
            refuse("num_local_experts" if cfg.get("num_local_experts") else "num_experts",
                   "is not implemented for this architecture")
        return {}
    if cfg.get("mlp_only_layers"):
        refuse("mlp_only_layers")
    if cfg.get("decoder_sparse_step", 1) != 1:
        refuse("decoder_sparse_step")
    if cfg.get("shared_expert_intermediate_size"):
        refuse("shared_expert_intermediate_size")
    mixtral = arch == "MixtralForCausalLM"
    return dict(n_experts=int(n), n_experts_used=int(cfg["num_experts_per_tok"]),
                expert_ffn_dim=int(cfg["intermediate_size"] if mixtral else cfg["moe_intermediate_size"]),
                router_renorm=True if mixtral else bool(cfg.get("norm_topk_prob", False)))


def _max_positions(cfg: dict, scaling: dict | None) -> int:
    """The positions a model takes: max_position_embeddings; with dynamic NTK rope, factor times it (the length
    the factor is set for: transformers itself sets no bound, its frequencies keep growing with the sequence); with
    YaRN at least factor times its original length (strata.models.rope.yarn_positions; where the config states none, the
    original is max_position_embeddings, as transformers 5 takes it and writes it into a config it saves)."""
    n = cfg.get("max_position_embeddings", 8192)
    if scaling and scaling["rope_type"] == "dynamic":
        return int(scaling["factor"] * n)
    return yarn_positions(n, scaling)


def _hf_window(cfg: dict, fam: Family, where: str) -> tuple[int | None, tuple | None]:
    """(sliding_window, window_layers) as transformers applies them: per `layer_types` where the config lists
    them, else every layer for mistral/phi3, and qwen's only with use_sliding_window (from max_window_layers)."""
    w = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    n = cfg["num_hidden_layers"]
    if fam.name in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        w = None
    if types is not None and (fam.gemma or fam.name in ("qwen2", "qwen3", "gpt_oss")):
        bad = sorted(set(types) - {"full_attention", "sliding_attention"})
        if bad:
            raise ModelError(f"{where}: layer_types {bad[0]!r} is not implemented")
        if len(types) != n:
            raise ModelError(f"{where}: layer_types lists {len(types)} layers, num_hidden_layers is {n}")
        flags = tuple(t == "sliding_attention" for t in types)
        if not any(flags) or w is None:
            return None, None
        return int(w), flags
    if fam.name in ("qwen2", "qwen3") and w is not None:
        first = cfg.get("max_window_layers", n)
        flags = tuple(i >= first for i in range(n))
        return (int(w), flags) if any(flags) else (None, None)
    if w is None or not fam.window_keys:
        return None, None
    return int(w), None


# -- GGUF metadata --------------------------------------------------------------------------------------------
def check_gguf_keys(fam: Family, keys, get, where: str) -> None:
    """Refuse, in one line, an {arch}.* key that a family listing its keys (Family.gguf_keys) does not read: a key
    llama.cpp honours and Strata ignored would be a variation computed without it."""
    if fam.gguf_keys is None:
        return
    pre = fam.gguf_arch + "."
    bad = sorted(k for k in keys if k.startswith(pre) and k[len(pre):] not in fam.gguf_keys)
    if bad:
        raise ModelError(f"{where}: GGUF key {bad[0]} = {get(bad[0][len(pre):])!r} is not implemented for "
                         f"{fam.gguf_arch}")


def gguf_trunk_layers(fam: Family, get, block_count: int, where: str) -> int:
    """The model's own layers: block_count less the multi-token-prediction (nextn) blocks llama.cpp's converter
    appends to a family that has them (glm4moe: {arch}.nextn_predict_layers, counted in block_count). Those
    blocks draft tokens for speculative decoding; llama.cpp skips them for inference (its loader marks them
    TENSOR_SKIP unless asked to load the MTP head), and so does Strata: no slice reads them."""
    if not fam.gguf_nextn:
        return block_count
    nextn = get("nextn_predict_layers") or 0
    if isinstance(nextn, list) or not 0 <= int(nextn) < block_count:
        raise ModelError(f"{where}: GGUF key {fam.gguf_arch}.nextn_predict_layers = {nextn!r} does not fit "
                         f"block_count {block_count}")
    return block_count - int(nextn)


def _gguf_glm4moe(get, head_dim: int, names, where: str) -> dict:
    """GLM-4.5's MoE as llama.cpp's converter writes it and llama.cpp's glm4moe loader reads it: sigmoid scores
    chosen by score + exp_probs_b (within the best expert_group_used_count of expert_group_count groups, which
    llama.cpp applies to any arch), the chosen scores renormalized where expert_weights_norm says, times
    expert_weights_scale; a shared expert of expert_shared_count widths; the first leading_dense_block_count layers
    dense; RoPE over the first rope.dimension_count values of a head; q/k norms where the file has them."""
    def refuse(key, why="is not implemented"):
        raise ModelError(f"{where}: GGUF key glm4moe.{key} = {get(key)!r} {why}")

    for key in ("feed_forward_length", "expert_feed_forward_length", "expert_used_count", "expert_shared_count",
                "leading_dense_block_count", "rope.dimension_count"):
        if isinstance(get(key), list):
            refuse(key, "(a value per layer) is not implemented")
    n, used = int(get("expert_count") or 0), int(get("expert_used_count") or 0)
    if not n or not used:
        refuse("expert_count" if not n else "expert_used_count", "is not a glm4moe model (llama.cpp asserts experts)")
    if get("expert_gating_func") not in (None, 0, 2):  # llama.cpp: absent or none (0) is sigmoid (2)
        refuse("expert_gating_func", "is not implemented (glm4moe: 2, sigmoid)")
    if get("expert_shared_count") is None:  # (llama.cpp requires the key)
        raise ModelError(f"{where}: GGUF metadata lacks glm4moe.expert_shared_count")
    # llama.cpp's fallback: the dense width over the experts used
    effn = int(get("expert_feed_forward_length") or 0) or int(get("feed_forward_length")) // used
    groups = int(get("expert_group_count") or 0)
    scale = get("expert_weights_scale")
    rot = get("rope.dimension_count")
    return dict(n_experts=n, n_experts_used=used, expert_ffn_dim=effn, router="sigmoid",
                router_renorm=bool(get("expert_weights_norm", False)),  # llama.cpp's default for the key: false
                router_groups=groups if groups > 1 else 1,
                router_groups_used=int(get("expert_group_used_count") or 0) if groups > 1 else 1,
                routed_scale=1.0 if not scale else float(scale),  # llama.cpp: 0 (unset) scales by 1
                shared_ffn_dim=effn * int(get("expert_shared_count")),
                first_dense_layers=int(get("leading_dense_block_count") or 0),
                rotary_dim=None if rot is None or int(rot) == head_dim else int(rot),
                qk_norm="blk.0.attn_q_norm.weight" in names)


def gguf_args_extra(fam: Family, get, n_layers: int, dim: int, n_heads: int, head_dim: int, where: str,
                    names=frozenset()) -> dict:
    """The ModelArgs fields a GGUF family sets beyond the common keys, read with get(key) (arch prefix implied);
    names: the file's tensor names (glm4moe's optional q/k norms)."""
    if fam.name in LATENT_FAMILIES:  # (its rope scaling too: llama.cpp's deepseek2 reads its own YaRN key)
        return deepseek.gguf_args(get, n_layers, names, where, fam.gguf_arch)
    scaling = scaling_from_gguf(get, fam.gguf_arch, where)
    extra: dict = {"rope_scaling": scaling} if scaling is not None else {}
    if fam.name == "glm4_moe":
        return {**extra, **_gguf_glm4moe(get, head_dim, names, where)}
    n = get("expert_count") or 0
    window = get("attention.sliding_window") or None  # phi3's converter writes 0 for none
    if fam.name == "qwen3_5":  # its hybrid as llama.cpp's converter writes it (norms stored as 1 + w)
        flags = get("attention.recurrent_layers")
        inner, nv = get("ssm.inner_size"), get("ssm.time_step_rank")
        if flags is None or None in (inner, nv, get("ssm.group_count"), get("ssm.state_size")):
            raise ModelError(f"{where}: qwen35 GGUF lacks its ssm.* or attention.recurrent_layers keys")
        extra.update(linear_layers=tuple(bool(f) for f in flags), lin_k_heads=int(get("ssm.group_count")),
                     lin_k_dim=int(get("ssm.state_size")), lin_v_heads=int(nv), lin_v_dim=int(inner) // int(nv),
                     lin_conv=int(get("ssm.conv_kernel", 4)), attn_gate=True, rotary_dim=get("rope.dimension_count"))
        return extra
    if fam.name == "gpt_oss":
        # llama.cpp's gpt-oss: its clamped SwiGLU's alpha and limit, the router's softmax over the top k and the
        # window on every other layer (the first windowed) are the architecture's, not keys of the file
        extra.update(n_experts=int(n), n_experts_used=int(get("expert_used_count")),
                     expert_ffn_dim=int(get("expert_feed_forward_length")), router="topk_softmax", expert_bias=True,
                     expert_act="clamped", attn_sinks=True, o_bias=True)
        if window is not None:
            extra.update(sliding_window=int(window), window_layers=tuple(i % 2 == 0 for i in range(n_layers)))
        return extra
    if n:
        if fam.name not in ("llama", "qwen3_moe"):
            raise ModelError(f"{where}: {fam.gguf_arch}.expert_count = {n}: experts are not implemented for this "
                             "architecture")
        for key, neutral in (("expert_shared_count", 0), ("expert_weights_scale", 1.0), ("expert_gating_func", 1),
                             ("expert_group_count", 0)):
            v = get(key)
            if v not in (None, neutral):
                raise ModelError(f"{where}: {fam.gguf_arch}.{key} = {v} is not implemented")
        # llama.cpp renormalizes the chosen experts' weights for both (llama: Mixtral; qwen3moe)
        extra.update(n_experts=int(n), n_experts_used=int(get("expert_used_count")),
                     expert_ffn_dim=int(get("expert_feed_forward_length") or get("feed_forward_length")),
                     router_renorm=bool(get("expert_weights_norm", True)))
    if get("attn_logit_softcapping") is not None:
        raise ModelError(f"{where}: {fam.gguf_arch}.attn_logit_softcapping = {get('attn_logit_softcapping')} "
                         "is not implemented")
    if fam.gemma:
        # llama.cpp's gemma3: every 6th layer global, the others windowed with base 10000 unless the file says;
        # its norms are stored as (1 + w) already; the 27B (62 layers) scales by dim / heads, others by head_dim
        pattern = get("attention.sliding_window_pattern", 6)
        if isinstance(pattern, list):
            flags = tuple(bool(p) for p in pattern)
        elif int(pattern) == 0:  # llama.cpp: every layer windowed
            flags = (True,) * n_layers
        else:
            flags = tuple((i + 1) % int(pattern) != 0 for i in range(n_layers))
        scale = (dim / n_heads) ** -0.5 if n_layers == 62 else head_dim ** -0.5
        extra.update(post_norms=True, activation="gelu_tanh", embed_scale=float(dim) ** 0.5, attn_scale=scale,
                     final_softcap=get("final_logit_softcapping"))
        if window is not None and any(flags):
            extra.update(sliding_window=int(window), window_layers=flags,
                         window_rope_theta=float(get("rope.freq_base_swa", 10000.0)))
        return extra
    if get("final_logit_softcapping") is not None:
        raise ModelError(f"{where}: {fam.gguf_arch}.final_logit_softcapping is not implemented for this family")
    if window is not None and fam.window_keys:
        extra["sliding_window"] = int(window)
    elif window is not None:
        raise ModelError(f"{where}: {fam.gguf_arch}.attention.sliding_window = {window} is not implemented "
                         "for this architecture")
    return extra
