"""Every HF config key the decoder core does not implement, at a value that would change the arithmetic: refused
through the launcher in one line naming the file, the key and the value, before any process starts. The keys a
reader honours (head_dim, tie_word_embeddings, the window keys, rope types) are checked for being read."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

from conftest import make_rig  # noqa: E402
from families_fixtures import make_hf  # noqa: E402
from strata.weights.checkpoint import model_args  # noqa: E402
from test_bad_input import refuse  # noqa: E402

# (family of the fixture, config.json changes, what the one line must say)
REFUSED = [
    ("llama", {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"},
     "unsupported architecture 'GPT2LMHeadModel'"),
    ("llama", {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2"},
     "unsupported architecture 'Gemma2ForCausalLM'"),
    ("llama", {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4"},
     "unsupported architecture 'DeepseekV4ForCausalLM'"),
    # a multimodal class whose text model is a family here is read from its text_config (tests/test_multimodal_text.py)
    ("llama", {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5"},
     "Qwen3_5ForConditionalGeneration config lacks 'text_config'"),
    ("llama", {"architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl"},
     "unsupported architecture 'Qwen3VLForConditionalGeneration'"),
    ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0, "beta_fast": 8.0}},
     "rope_scaling key 'beta_fast' = 8.0 is not implemented"),
    ("phi3", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                                  "long_factor": [1.0] * 8}}, "'longrope'"),
    ("llama", {"rope_parameters": {"rope_type": "su", "rope_theta": 10000.0}}, "'su'"),
    # multimodal RoPE's sections: plain RoPE over text for qwen3_5 only (its checkpoints carry them)
    ("qwen3", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 2, 2]}},
     "rope_scaling key 'mrope_section' = [4, 2, 2] is not implemented"),
    ("llama", {"attention_bias": True}, "attention_bias = True"),
    ("llama", {"mlp_bias": True}, "mlp_bias = True"),
    ("llama", {"hidden_act": "gelu"}, "hidden_act = 'gelu'"),
    ("gemma3", {"hidden_activation": "silu"}, "hidden_activation = 'silu'"),
    ("llama", {"partial_rotary_factor": 0.5}, "partial_rotary_factor = 0.5"),
    ("gemma3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping = 50.0"),
    ("llama", {"final_logit_softcapping": 30.0}, "final_logit_softcapping = 30.0"),
    ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention = True"),
    ("qwen3", {"layer_types": ["full_attention", "chunked_attention", "full_attention", "full_attention"],
               "use_sliding_window": True}, "layer_types 'chunked_attention'"),
    ("llama", {"num_local_experts": 8}, "num_local_experts = 8"),
    ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "mystery": 3}},
     "'mystery'"),
    # DeepSeek's own config keys at a value transformers' DeepseekV3 does not compute
    ("deepseek_v3", {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
     "quantization_config (quant_method 'fp8') is not implemented"),
    ("deepseek_v3", {"topk_method": "greedy"}, "topk_method = 'greedy' is not implemented"),
    ("deepseek_v3", {"scoring_func": "softmax"}, "scoring_func = 'softmax' is not implemented"),
    ("deepseek_v3", {"moe_layer_freq": 2}, "moe_layer_freq = 2 is not implemented"),
    ("deepseek_v3", {"attention_bias": True}, "attention_bias = True is not implemented"),
    ("deepseek_v3", {"num_key_value_heads": 2}, "num_key_value_heads = 2 is not implemented for MLA"),
    ("deepseek_v3", {"hidden_act": "gelu"}, "hidden_act = 'gelu' is not implemented"),
    ("deepseek_v3", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}},
     "rope type 'dynamic' is not implemented for MLA"),
]


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    """Each fixture family's saved model, made once: a refusal needs only its config.json changed."""
    base = tmp_path_factory.mktemp("families")
    return {f: make_hf(base, f)[1] for f in sorted({r[0] for r in REFUSED})}


def mutated(configs, tmp_path: Path, fam: str, change: dict) -> Path:
    src = Path(configs[fam])
    d = tmp_path / "model"
    d.mkdir()
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            (d / f.name).symlink_to(f)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(change)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("fam, change, expect", REFUSED, ids=[f"{r[0]}-{next(iter(r[1]))}" for r in REFUSED])
def test_refused_in_one_line_before_any_process(tmp_path, capsys, configs, fam, change, expect):
    d = mutated(configs, tmp_path, fam, change)
    line = refuse(tmp_path, capsys, make_rig(model=str(d), tokens=32, chunk=16))
    assert str(d / "config.json") in line or str(d) in line, line
    assert expect in line, line


def test_honoured_keys_are_read(tmp_path, configs):
    """head_dim, tie_word_embeddings and the window keys change ModelArgs (a reader that dropped one would pass
    the refusal table silently)."""
    d = mutated(configs, tmp_path, "llama", {"head_dim": 8, "tie_word_embeddings": True, "sliding_window": 7,
                                             "architectures": ["MistralForCausalLM"], "model_type": "mistral"})
    a = model_args(str(d))
    assert (a.head_dim, a.tie_embeddings, a.sliding_window) == (8, True, 7)
    q = model_args(configs["qwen3"])
    assert q.qk_norm and q.sliding_window is None  # use_sliding_window is false by default


@pytest.mark.parametrize("fam", ["glm4_moe", "qwen3_5"])
def test_partial_rotary_default_when_config_has_none(tmp_path, fam):
    """A config.json without partial_rotary_factor: RoPE over the part of each head transformers' config class
    assumes (GLM-4.5 0.5, as llama.cpp's converter writes it; Qwen3.5 0.25), not over all of it."""
    import transformers
    _, d = make_hf(tmp_path, fam)
    cfg = json.loads((Path(d) / "config.json").read_text())
    cfg.pop("partial_rotary_factor", None)
    cfg.get("rope_parameters", {}).pop("partial_rotary_factor", None)
    (Path(d) / "config.json").write_text(json.dumps(cfg))
    want = transformers.AutoConfig.from_pretrained(d).rope_parameters["partial_rotary_factor"]
    a = model_args(str(d))
    assert want < 1 and a.rotary_dim == int(a.head_dim * want), (a.rotary_dim, a.head_dim, want)


def test_glm4_moe_router_defaults_when_config_has_none(tmp_path):
    """GLM-4.5's expert keys left out of config.json take Glm4MoeConfig's defaults, as transformers builds the model:
    one shared expert (not none, silently), one dense first layer, no groups, renormalized, unscaled."""
    import transformers
    _, d = make_hf(tmp_path, "glm4_moe")
    keys = ("n_shared_experts", "first_k_dense_replace", "n_group", "topk_group", "norm_topk_prob",
            "routed_scaling_factor")
    cfg = json.loads((Path(d) / "config.json").read_text())
    assert all(k in cfg for k in keys)
    (Path(d) / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k not in keys}))
    c = transformers.AutoConfig.from_pretrained(d)
    a = model_args(str(d))
    assert (a.shared_ffn_dim, a.first_dense_layers, a.router_groups, a.router_groups_used, a.router_renorm,
            a.routed_scale) == (c.moe_intermediate_size * c.n_shared_experts, c.first_k_dense_replace, c.n_group,
                                c.topk_group, c.norm_topk_prob, c.routed_scaling_factor)
    assert a.shared_ffn_dim > 0 and a.first_dense_layers == 1


def test_hf_repo_id_from_the_local_cache(tmp_path, monkeypatch, configs):
    """'Org/Name' resolves to its snapshot in the local HF cache (refs/main), never downloaded; absent: one line
    naming where it looked."""
    from strata.weights.checkpoint import ModelError, resolve
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelError, match=r"'Org/Tiny': not in the local cache .*models--Org--Tiny"):
        resolve("Org/Tiny")
    snap = tmp_path / "hub" / "models--Org--Tiny" / "snapshots" / "abc123"
    snap.parent.mkdir(parents=True)
    snap.symlink_to(Path(configs["qwen3"]))
    (tmp_path / "hub" / "models--Org--Tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--Org--Tiny" / "refs" / "main").write_text("abc123")
    assert resolve("Org/Tiny") == ("hf", str(snap))
    assert model_args("Org/Tiny").arch == "qwen3"
