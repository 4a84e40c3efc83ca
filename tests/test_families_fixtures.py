"""The family fixtures work: every family builds a tiny HF model, and llama.cpp's converter turns each
into a GGUF with the layout the GGUF readers rely on.  One converter process does all the conversions."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import families_fixtures as ff

ARCH = {"llama": "llama", "mistral": "llama", "llama-yarn": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
        "gemma3": "gemma3", "phi3": "phi3"}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {fam: ff.make_hf(root, fam) for fam in ff.DENSE_FAMILIES}


@pytest.fixture(scope="module")
def converted(built, tmp_path_factory):
    reason = ff.converter_skip_reason()
    if reason:
        pytest.skip(reason)
    out = tmp_path_factory.mktemp("gguf")
    jobs = [(d, out / f"{fam}.gguf") for fam, (_, d) in built.items()]
    # one model with the real (SmolLM2) tokenizer, which needs vocab_size 49152
    _, smol = ff.make_hf(out, "llama", vocab_size=ff.SMOLLM2_VOCAB, num_hidden_layers=2)
    jobs.append((smol, out / "llama-smollm2.gguf"))
    res = ff.convert_many(jobs)
    names = list(built) + ["llama-smollm2"]
    return dict(zip(names, res))


def _hf(model, name):
    return model.state_dict()[name].detach().numpy()


@pytest.mark.parametrize("family", ff.DENSE_FAMILIES)
def test_builds(built, family):
    model, d = built[family]
    assert (Path(d) / "model.safetensors").is_file() and (Path(d) / "config.json").is_file()
    cfg = model.config
    assert cfg.hidden_size == 64 and cfg.num_key_value_heads == 2 and cfg.max_position_embeddings >= 1024
    sd = model.state_dict()
    norms = [k for k in sd if "norm" in k]
    assert norms and all(not torch.allclose(sd[k], sd[k].flatten()[0].expand_as(sd[k])) for k in norms), \
        "norm weights got their noise"
    assert all(sd[k].abs().max() > 0 for k in sd if k.endswith(".bias"))
    with torch.no_grad():
        logits = model(torch.arange(40).remainder(cfg.vocab_size)[None]).logits
    assert logits.shape == (1, 40, cfg.vocab_size) and torch.isfinite(logits).all()
    if family == "mistral":
        assert cfg.sliding_window == 24
    if family == "gemma3":
        assert set(cfg.layer_types) == {"sliding_attention", "full_attention"} and cfg.tie_word_embeddings
    if family == "qwen3":
        assert "model.layers.0.self_attn.q_norm.weight" in sd
    if family == "llama-yarn":
        assert cfg.rope_parameters["rope_type"] == "yarn" and cfg.rope_parameters["factor"] == 4.0


def test_seeded(tmp_path):
    a, _ = ff.make_hf(tmp_path, "qwen2", seed=3)
    b, _ = ff.make_hf(tmp_path, "qwen2", seed=3)
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]), k


def test_smollm2_refused_where_it_cannot_work(tmp_path):
    _, d = ff.make_hf(tmp_path, "phi3")
    with pytest.raises(ff.ConversionError, match="sentencepiece"):
        ff.convert_to_gguf(d, tmp_path / "x.gguf", tokenizer="smollm2")


@pytest.mark.slow
@pytest.mark.parametrize("family", ff.DENSE_FAMILIES + ("llama-smollm2",))
def test_converts(converted, built, family):
    res = converted[family]
    if isinstance(res, Exception):
        raise res
    s = ff.gguf_summary(res)
    arch = ARCH[family.replace("-smollm2", "")]
    assert s["arch"] == arch
    meta, t = s["meta"], s["tensors"]
    if family == "llama-smollm2":
        assert meta["llama.vocab_size"] == ff.SMOLLM2_VOCAB and t["token_embd.weight"][0] == (64, ff.SMOLLM2_VOCAB)
        return
    model, _ = built[family]
    L = "model.layers.0."
    n_layers = model.config.num_hidden_layers
    assert meta[f"{arch}.block_count"] == n_layers
    assert t["token_embd.weight"] == ((64, model.config.vocab_size), "F32")
    assert ("output.weight" in t) == (not model.config.tie_word_embeddings)
    if family == "phi3":
        np.testing.assert_array_equal(ff.gguf_tensor(res, "blk.0.attn_qkv.weight"), _hf(model, L + "self_attn.qkv_proj.weight"))
        np.testing.assert_array_equal(ff.gguf_tensor(res, "blk.0.ffn_up.weight"), _hf(model, L + "mlp.gate_up_proj.weight"))
        assert "blk.0.ffn_gate.weight" not in t
        return
    q = ff.gguf_tensor(res, "blk.0.attn_q.weight")
    hq = _hf(model, L + "self_attn.q_proj.weight")
    if arch == "llama":   # the converter permutes q/k rows into GGML's interleaved rope order
        n = model.config.num_attention_heads
        hq = hq.reshape(n, 2, hq.shape[0] // n // 2, -1).swapaxes(1, 2).reshape(hq.shape)
    np.testing.assert_array_equal(q, hq)
    shift = 1.0 if family == "gemma3" else 0.0   # Gemma's (1 + w) norms are stored as 1 + w
    np.testing.assert_allclose(ff.gguf_tensor(res, "blk.0.attn_norm.weight"), _hf(model, L + "input_layernorm.weight") + shift, atol=1e-6)
    if family == "mistral":
        assert not any("sliding_window" in k for k in meta)   # the converter drops it
    if family == "gemma3":
        assert meta["gemma3.attention.sliding_window"] == 16 and meta["gemma3.rope.freq_base_swa"] == 10000.0
        assert meta["gemma3.final_logit_softcapping"] == 30.0
        assert {"blk.0.post_attention_norm.weight", "blk.0.post_ffw_norm.weight", "blk.0.attn_q_norm.weight"} <= set(t)
    if family == "qwen3":
        assert t["blk.0.attn_q_norm.weight"] == ((16,), "F32")
    if family == "llama-yarn":
        assert meta["llama.rope.scaling.type"] == "yarn" and meta["llama.rope.scaling.factor"] == 4.0
        assert meta["llama.rope.scaling.original_context_length"] == 256
