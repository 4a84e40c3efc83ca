"""DeepSeek V3.2 (deepseek32) and GLM-5 (glm-dsa) GGUF files as llama.cpp's own converter writes them, read by
Strata: the args are Strata's reading of the HF folder, every canonical tensor is the HF model's (kv_b put back from
attn_k_b + attn_v_b, the indexer's as stored), the logits transformers', and what is not implemented is refused in one
line naming file, key and value.

GLM-5's file is the converter's, unchanged, with SmolLM2's tokenizer plus GLM's special tokens (families_fixtures'
"smollm2-glm"). V3.2's converter (DeepseekV32Model.set_vocab) asserts add_bos_token, which no tokenizer available
offline gives it without breaking its pre-tokenizer hash (families_fixtures' docstring says why): that one job runs
with DeepseekV2Model's set_vocab (families_fixtures.VOCAB_PATCHES), every key and tensor still written by the
converter's own code."""
import os

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # llama.cpp's converter and tiny models end to end: the CI tier
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from families_fixtures import SMOLLM2_GLM_VOCAB, SMOLLM2_VOCAB, make_hf  # noqa: E402
from strata.errors import ModelError  # noqa: E402
from strata.models import deepseek  # noqa: E402
from strata.weights.checkpoint import model_args  # noqa: E402
from strata.weights.gguf_files import field_keys, field_value, open_gguf  # noqa: E402
from strata.weights.gguf_loader import check_tensors, gguf_slice_tensors, tensor_facts  # noqa: E402

# families_fixtures' DSA models (an indexer of 16 heads of 16 choosing 24 positions, shorter than the prompt; GLM-5's
# layer 2 sharing layer 1's selection), in SmolLM2's vocabulary (GLM's: with its 3 special tokens); V3.2's
# scoring_func as its released config spells it (the converter writes it as expert_gating_func, which llama.cpp's
# deepseek32 requires); -yarn: YaRN with V3.2's mscale / mscale_all_dim (1, 1), the softmax scale grown by it
_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 256,
         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
VARIANTS = {"deepseek_v32": ("deepseek_v32", dict(vocab_size=SMOLLM2_VOCAB, scoring_func="sigmoid")),
            "deepseek_v32-yarn": ("deepseek_v32", dict(vocab_size=SMOLLM2_VOCAB, scoring_func="sigmoid",
                                                       rope_parameters=_YARN)),
            "glm_moe_dsa": ("glm_moe_dsa", dict(vocab_size=SMOLLM2_GLM_VOCAB))}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Each variant: (the transformers model, its folder, its GGUF from convert_hf_to_gguf.py at F32), converted in
    one process."""
    from families_fixtures import ConversionError, convert_many, converter_skip_reason
    why = converter_skip_reason()
    if why:
        pytest.skip(why)
    base = tmp_path_factory.mktemp("dsa-gguf")
    made = {v: make_hf(base, fam, **kw) for v, (fam, kw) in VARIANTS.items()}
    files = convert_many([(d, base / f"{v}.gguf") for v, (_, d) in made.items()])
    out = {}
    for (v, (ref, d)), g in zip(made.items(), files):
        if isinstance(g, ConversionError):
            raise g
        out[v] = (ref, d, str(g))
    return out


def _summary(path):
    """({arch.* key: value}, {tensor name: shape in ggml order}): Strata's own index of the file."""
    r = open_gguf(path)
    arch = field_value(r, "general.architecture")
    return arch, {k[len(arch) + 1:]: field_value(r, k) for k in field_keys(r) if k.startswith(arch + ".")}, \
        {n: f.shape[::-1] for n, f in tensor_facts(path).items()}


def test_converter_writes_the_indexer(converted):
    """What the reader relies on, as the converter writes it: deepseek2's MLA keys and split kv_b, the indexer's three
    counts, its tensors as blk.N.indexer.* (q_b over q's rank, k over the model's width, a LayerNorm with a bias, the
    per-head weights), none in GLM-5's shared layer, whose place indexer.types marks; no gating key for GLM-5."""
    arch, m, t = _summary(converted["deepseek_v32"][2])
    assert arch == "deepseek32"
    assert (m["attention.indexer.head_count"], m["attention.indexer.key_length"], m["attention.indexer.top_k"]) == \
        (16, 16, 24)
    assert (m["attention.key_length"], m["attention.key_length_mla"], m["attention.head_count_kv"]) == (40, 24, 1)
    assert m["expert_gating_func"] == 2 and "attention.indexer.types" not in m
    for i in range(4):
        assert (t[f"blk.{i}.indexer.attn_q_b.weight"], t[f"blk.{i}.indexer.attn_k.weight"],
                t[f"blk.{i}.indexer.k_norm.weight"], t[f"blk.{i}.indexer.k_norm.bias"],
                t[f"blk.{i}.indexer.proj.weight"]) == ((24, 256), (64, 16), (16,), (16,), (64, 16))
    assert t["blk.0.attn_k_b.weight"] == (16, 32, 4) and "blk.0.attn_kv_b.weight" not in t
    arch, m, t = _summary(converted["glm_moe_dsa"][2])
    assert arch == "glm-dsa" and "expert_gating_func" not in m
    assert m["attention.indexer.types"] == [True, True, False, True]
    assert [any(n.startswith(f"blk.{i}.indexer.") for n in t) for i in range(4)] == [True, True, False, True]
    _, m, _ = _summary(converted["deepseek_v32-yarn"][2])
    assert m["rope.scaling.type"] == "yarn" and m["rope.scaling.yarn_log_multiplier"] == pytest.approx(0.1)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gguf_args_are_the_hf_folders(converted, variant):
    """model_args of the GGUF equals model_args of the HF folder, field by field (floats the file holds in float32:
    to its rounding): MLA, the indexer (its rope layout per family), GLM-5's shared layer, the router, the softmax
    scale and YaRN."""
    from dataclasses import fields
    _, d, g = converted[variant]
    want, got = model_args(d), model_args(g)
    assert got.index_topk == 24 and got.index_rope_interleave == (variant == "glm_moe_dsa")
    assert got.index_shared == ((False, False, True, False) if variant == "glm_moe_dsa" else None)
    for f in fields(want):
        a, b = getattr(want, f.name), getattr(got, f.name)
        if isinstance(a, float):
            assert b == pytest.approx(a, rel=1e-6), f.name
        elif isinstance(a, dict):  # rope_scaling
            assert b.keys() == a.keys(), f.name
            for k, v in a.items():
                assert b[k] == (pytest.approx(v, rel=1e-6) if isinstance(v, float) else v), (f.name, k)
        else:
            assert b == a, f.name


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gguf_tensors_are_the_hf_models(converted, variant):
    """Every canonical tensor read from the file equals the HF model's own (float32: bit for bit), the indexer's
    included: wkv_b is kv_b_proj put back together from attn_k_b and attn_v_b; the experts transformers holds fused
    are compared per part."""
    ref, _, g = converted[variant]
    a = model_args(g)
    check_tensors(g, a, 0, a.n_layers)
    got = gguf_slice_tensors(g, a, 0, a.n_layers)
    sd = ref.state_dict()
    effn = a.expert_ffn_dim
    attn = {"wq_a": "q_a_proj", "wq_b": "q_b_proj", "q_a_norm": "q_a_layernorm", "wkv_a": "kv_a_proj_with_mqa",
            "kv_a_norm": "kv_a_layernorm", "wkv_b": "kv_b_proj", "wo": "o_proj", "ix_wq_b": "indexer.wq_b",
            "ix_wk": "indexer.wk", "ix_k_norm": "indexer.k_norm", "ix_w": "indexer.weights_proj"}
    mlp = {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj", "router": "gate",
           "s_gate": "shared_experts.gate_proj", "s_up": "shared_experts.up_proj", "s_down": "shared_experts.down_proj"}

    def hf(canon):
        if canon in ("embed", "norm", "head"):
            glob = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight", "head": "lm_head.weight"}
            return sd[glob[canon]]
        _, i, s = canon.split(".")
        p = f"model.layers.{i}."
        if s in ("attn_norm", "mlp_norm"):
            return sd[p + ("input_layernorm" if s == "attn_norm" else "post_attention_layernorm") + ".weight"]
        if s == "ix_k_norm_b":
            return sd[p + "self_attn.indexer.k_norm.bias"]
        if s in attn:
            return sd[p + f"self_attn.{attn[s]}.weight"]
        if s in mlp:
            return sd[p + f"mlp.{mlp[s]}.weight"]
        if s == "router_bias":
            return sd[p + "mlp.gate.e_score_correction_bias"]
        gate_up, down = sd[p + "mlp.experts.gate_up_proj"], sd[p + "mlp.experts.down_proj"]
        return {"e_gate": gate_up[:, :effn], "e_up": gate_up[:, effn:], "e_down": down}[s]

    shorts = {c.split(".")[-1] for c in got}
    assert shorts >= {"wkv_b", "ix_wq_b", "ix_wk", "ix_k_norm", "ix_k_norm_b", "ix_w", "router_bias", "e_gate"}
    if variant == "glm_moe_dsa":
        assert not any(c.startswith("layers.2.ix_") for c in got)
    for canon, t in got.items():
        assert torch.equal(t, hf(canon)), canon


# -- what is refused ------------------------------------------------------------------------------------------
def _rewrite(parts, dst, drop=(), keys=None, tensors=None) -> str:
    """test_families.gguf_parts' file written to dst without the metadata keys `drop`, with `keys` set and `tensors`
    added (test_deepseek_gguf's helper)."""
    from test_families import write_gguf
    arch, meta, ts = parts
    return write_gguf(dst, (arch, [m for m in meta if m[0] not in drop], ts), keys=keys or {}, tensors=tensors or {})


def test_what_dsa_refuses(converted, tmp_path):
    """Each refused in one line naming the file and the key (and its value): a key the family's loader does not read
    (GLM-5's indexer.types in a deepseek32 file, MSA's / GLM5-Next's indexer options, glm-dsa's rope scaling, which
    llama.cpp's glm-dsa computes without the YaRN log multiplier), a missing indexer count or gating function (llama.cpp
    requires them), deepseek32's YaRN with mscale_all_dim != 1 (llama.cpp takes mscale 1 there, transformers the
    config's), an indexer narrower than the rope part, indexer.types of the wrong length or whose first layer
    shares, softmax gating for GLM-5, indexer tensors in a shared layer (no layer reads them)."""
    from families_fixtures import import_gguf
    from test_families import gguf_parts
    T = import_gguf().GGUFValueType
    v32, glm, yarn = (gguf_parts(converted[v][2]) for v in ("deepseek_v32", "glm_moe_dsa", "deepseek_v32-yarn"))
    cases = [  # (file, keys to drop, keys to set, tensors to add, what the line says)
        (v32, (), {"deepseek32.attention.indexer.types": ([True] * 4, T.ARRAY, T.BOOL)}, {},
         "GGUF key deepseek32.attention.indexer.types = [True, True, True, True] is not implemented for deepseek32"),
        (v32, ("deepseek32.attention.indexer.top_k",), {}, {}, "lacks deepseek32.attention.indexer.top_k"),
        (v32, ("deepseek32.expert_gating_func",), {}, {}, "lacks deepseek32.expert_gating_func"),
        (v32, (), {"deepseek32.attention.indexer.key_length": (4, T.UINT32)}, {},
         "deepseek32.attention.indexer.key_length = 4 is shorter than rope.dimension_count"),
        (yarn, (), {"deepseek32.rope.scaling.yarn_log_multiplier": (0.0707, T.FLOAT32)}, {},
         "deepseek32.rope.scaling.yarn_log_multiplier = 0.0706"),  # (0.707 x 0.1 in float32: 0.07069999...)
        (glm, (), {"glm-dsa.attention.indexer.block_size": (64, T.UINT32)}, {},
         "GGUF key glm-dsa.attention.indexer.block_size = 64 is not implemented for glm-dsa"),
        (glm, (), {"glm-dsa.attention.indexer.kpool": (True, T.BOOL)}, {}, "GGUF key glm-dsa.attention.indexer.kpool"),
        (glm, (), {"glm-dsa.rope.scaling.type": ("yarn", T.STRING)}, {},
         "GGUF key glm-dsa.rope.scaling.type = 'yarn' is not implemented for glm-dsa"),
        (glm, (), {"glm-dsa.attention.indexer.types": ([False, True, True, True], T.ARRAY, T.BOOL)}, {},
         "glm-dsa.attention.indexer.types = [False, True, True, True] is not implemented (its first layer shares"),
        (glm, (), {"glm-dsa.attention.indexer.types": ([True, True, False], T.ARRAY, T.BOOL)}, {},
         "glm-dsa.attention.indexer.types = [True, True, False] is not implemented (a bool per layer, 4 layers)"),
        (glm, (), {"glm-dsa.expert_gating_func": (1, T.UINT32)}, {},
         "glm-dsa.expert_gating_func = 1 is not implemented"),
        (glm, (), {}, {"blk.2.indexer.attn_k.weight": np.zeros((16, 64), np.float32)},
         "tensor blk.2.indexer.attn_k.weight is not implemented for glm-dsa"),
    ]
    for i, (parts, drop, keys, tensors, expect) in enumerate(cases):
        bad = _rewrite(parts, tmp_path / f"bad{i}.gguf", drop, keys, tensors)
        with pytest.raises(ModelError) as e:
            model_args(bad)
        line = str(e.value)
        assert "\n" not in line and bad in line and expect in line, (i, line)
    # GLM-5's file without indexer.types: llama.cpp's every layer full (context_length < 1,048,576); gating 0: sigmoid
    a = model_args(_rewrite(glm, tmp_path / "notypes.gguf", ("glm-dsa.attention.indexer.types",),
                            {"glm-dsa.expert_gating_func": (0, T.UINT32)}))
    assert a.index_shared is None and a.router == "sigmoid"


def test_glm_dsa_indexer_schedule_without_types():
    """Where glm-dsa's indexer.types is absent, llama.cpp's schedule: every layer full below a context of 1,048,576
    (GLM-5, 5.1), GLM-5.2's above (layers 0, 1, then every 4th from 2 full; the others share)."""
    keys = {"attention.indexer.head_count": 32, "attention.indexer.key_length": 128, "attention.indexer.top_k": 2048,
            "attention.q_lora_rank": 2048, "context_length": 202752}

    def read(n_layers, **more):
        return deepseek.gguf_indexer(lambda k, d=None: {**keys, **more}.get(k, d), n_layers, 64, "m.gguf", "glm-dsa")

    assert read(78)["index_shared"] is None
    shared = read(78, context_length=1048576)["index_shared"]
    assert [i for i in range(78) if not shared[i]] == [0, 1] + list(range(2, 78, 4))
    assert read(4, **{"attention.indexer.types": True})["index_shared"] is None  # (one value for every layer)


# -- end to end -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gguf_logits_match_transformers(converted, variant):
    """The converter's file on 3 slices split mid-model, prefill in chunks that cut the prompt unevenly (the indexer's
    top 24 of a 71-token prompt: the selection matters): the last logits, every position's and the NLL within 1e-4 of
    transformers' (float32), and the greedy tokens after."""
    from test_families import PROMPT, check_against
    ref, _, g = converted[variant]
    ids = torch.randint(0, ref.config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(7))
    check_against(ref, g, ids, model_args(g).n_layers)
