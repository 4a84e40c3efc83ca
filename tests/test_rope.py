"""strata.models.rope against transformers' RoPE init functions, its refusals, and the GGUF path against what
llama.cpp's converter writes for the same HF config."""
import os

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding  # noqa: E402
from transformers.models.phi.modeling_phi import PhiRotaryEmbedding  # noqa: E402

from strata.errors import ModelError  # noqa: E402
from strata.models.rope import ROPE_TYPES, inv_frequencies, scaling_from_gguf, scaling_from_hf  # noqa: E402

RTOL = 1e-6


def hf_rope(rp, head_dim, theta, max_pos, partial=None, **top):
    """transformers' (inv_freq, attention factor) for rope parameters `rp` on a LlamaConfig."""
    params = {**rp, "rope_theta": theta}
    if partial is not None:
        params["partial_rotary_factor"] = partial
    cfg = transformers.LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                                   max_position_embeddings=max_pos, rope_parameters=params, **top)
    kind = cfg.rope_parameters["rope_type"]
    fn = LlamaRotaryEmbedding.compute_default_rope_parameters if kind == "default" else ROPE_INIT_FUNCTIONS[kind]
    return fn(cfg)


def ours(rp, head_dim, theta, max_pos, partial=None, **top):
    s = scaling_from_hf(dict(rp), "cfg", max_position_embeddings=max_pos,
                        original_max_position_embeddings=top.get("original_max_position_embeddings"))
    return inv_frequencies(head_dim, theta, s, None if partial is None else int(head_dim * partial))


def check(case):
    inv, att = ours(**case)
    ref, ref_att = hf_rope(**case)
    assert inv.dtype == torch.float64 and inv.device.type == "cpu" and inv.shape == ref.shape
    torch.testing.assert_close(inv, ref.double(), rtol=RTOL, atol=0)  # HF computes in float32
    assert att == pytest.approx(float(ref_att), rel=RTOL)
    return inv, att


def case(rp, head_dim=128, theta=10000.0, max_pos=8192, **kw):
    return dict(rp=rp, head_dim=head_dim, theta=theta, max_pos=max_pos, **kw)


DEFAULT = [case({"rope_type": "default"}), case({"rope_type": "default"}, head_dim=64, theta=500000.0),
           case({}, theta=1e6)]
LINEAR = [case({"rope_type": "linear", "factor": 2.0}), case({"type": "linear", "factor": 8.0}, theta=1e6),
          case({"rope_type": "linear", "factor": 4.0}, partial=0.25)]
LLAMA31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}
LLAMA3 = [case(LLAMA31, theta=500000.0, max_pos=131072),
          case({**LLAMA31, "factor": 32.0}, theta=500000.0, max_pos=131072),  # Llama-3.2
          case({"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
                "original_max_position_embeddings": 4096}, head_dim=64, max_pos=65536),
          case(LLAMA31, theta=500000.0, max_pos=131072, partial=0.5),
          # no original length in the dict: HF takes max_position_embeddings
          case({k: v for k, v in LLAMA31.items() if k != "original_max_position_embeddings"}, theta=5e5, max_pos=4096)]
YARN = [
    case({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, theta=1e6, max_pos=131072),
    # DeepSeek-style mscale pair (a ratio), and an equal pair (ratio 1)
    case({"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
          "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 1.0}, head_dim=64, max_pos=163840),
    case({"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
          "mscale_all_dim": 1.0}, head_dim=64, max_pos=163840),
    # only one mscale: HF ignores it
    case({"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 4096, "mscale": 0.5},
         max_pos=65536),
    # gpt-oss: no truncation of the correction range
    case({"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
          "beta_slow": 1.0, "truncate": False}, head_dim=64, theta=150000.0, max_pos=131072),
    # an explicit None truncate is falsy in HF: not truncated either
    case({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192, "truncate": None},
         head_dim=96, max_pos=32768),
    case({"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192, "beta_fast": 16,
          "beta_slow": 2, "attention_factor": 0.8}, theta=500000.0, max_pos=65536),
    # factor None: HF derives it from the two lengths
    case({"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 16384}, theta=1e6, max_pos=131072),
    # old spelling, no original length: HF takes max_position_embeddings
    case({"type": "yarn", "factor": 2.0}, max_pos=8192),
    # a top-level original_max_position_embeddings (Phi-3) wins over the dict's
    case({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}, max_pos=32768,
         original_max_position_embeddings=4096),
    case({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}, max_pos=32768, partial=0.5),
    case({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096, "truncate": False},
         head_dim=80, max_pos=32768, partial=0.4),
]


@pytest.mark.parametrize("c", DEFAULT + LINEAR + LLAMA3 + YARN, ids=lambda c: str(c["rp"]))
def test_matches_transformers(c):
    check(c)


@pytest.mark.parametrize("head_dim,theta,max_pos,factor,partial", [(128, 10000.0, 4096, 2.0, None),
                                                                    (64, 1e6, 2048, 4.0, None),
                                                                    (96, 10000.0, 1024, 2.0, 0.5)])
def test_dynamic_ntk_matches_transformers(head_dim, theta, max_pos, factor, partial):
    """Dynamic NTK: plain RoPE within max_position_embeddings (inv_frequencies), beyond it the base grown for the
    sequence's length, as transformers' _compute_dynamic_ntk_parameters for that seq_len (the frequencies really
    move with the length)."""
    from strata.models.rope import dynamic_inv_frequencies
    rp = {"rope_type": "dynamic", "factor": factor}
    c = case(rp, head_dim=head_dim, theta=theta, max_pos=max_pos, partial=partial)
    inv, att = check(c)  # at init transformers takes seq_len = max_position_embeddings: plain RoPE
    assert att == 1.0
    sc = scaling_from_hf(dict(rp), "cfg", max_position_embeddings=max_pos)
    params = {**rp, "rope_theta": theta, **({} if partial is None else {"partial_rotary_factor": partial})}
    cfg = transformers.LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                                   max_position_embeddings=max_pos, rope_parameters=params)
    rot = None if partial is None else int(head_dim * partial)
    prev = None
    for seq in (max_pos // 2, max_pos, max_pos + 1, 3 * max_pos):
        got = dynamic_inv_frequencies(head_dim, theta, sc, seq, rot)
        ref, _ = ROPE_INIT_FUNCTIONS["dynamic"](cfg, seq_len=seq)
        torch.testing.assert_close(got, ref.double(), rtol=RTOL, atol=0)
        if seq <= max_pos:
            assert torch.equal(got, inv)
        else:
            assert not torch.allclose(got, prev)
        prev = got


def test_yarn_cases_really_differ():
    # the parameter sets exercise different branches: none of them collapses to another's result
    got = [ours(**c) for c in YARN[:8]]
    for i in range(len(got)):
        for j in range(i + 1, len(got)):
            a, b = got[i], got[j]
            assert a[0].shape != b[0].shape or not torch.allclose(a[0], b[0]) or a[1] != b[1]
    assert ours(**YARN[0])[1] == pytest.approx(1 + 0.1 * np.log(4.0))
    assert ours(**YARN[2])[1] == 1.0


def test_partial_default_matches_phi():
    cfg = transformers.PhiConfig(hidden_size=2560, num_attention_heads=32, partial_rotary_factor=0.4,
                                 rope_theta=10000.0)
    ref, att = PhiRotaryEmbedding.compute_default_rope_parameters(cfg)
    inv, a = inv_frequencies(80, 10000.0, None, rotary_dim=32)
    assert inv.shape == (16,) and a == att == 1.0
    torch.testing.assert_close(inv, ref.double(), rtol=RTOL, atol=0)


def test_llama3_matches_existing_rope_frequencies():
    from strata.models.model import ModelArgs, rope_frequencies
    args = ModelArgs(head_dim=128, rope_theta=500000.0, n_heads=1, n_kv_heads=1,
                     rope_scaling={k: v for k, v in LLAMA31.items() if k != "rope_type"})
    inv, _ = inv_frequencies(128, 500000.0, scaling_from_hf(LLAMA31, "cfg"))
    torch.testing.assert_close(inv.float(), rope_frequencies(args), rtol=0, atol=0)


def test_cpu_float64_inside_meta_build():
    with torch.device("meta"):
        inv, _ = inv_frequencies(128, 1e6, scaling_from_hf(YARN[0]["rp"], "cfg"))
    assert inv.device.type == "cpu" and inv.dtype == torch.float64


def test_normalized_dicts():
    assert scaling_from_hf(None, "c") is None and scaling_from_hf({}, "c") is None
    assert scaling_from_hf({"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.0,
                            "original_max_position_embeddings": 4096}, "c") is None
    assert scaling_from_hf({"type": "linear", "factor": 2, "rope_theta": 1e4}, "c") == {"rope_type": "linear",
                                                                                        "factor": 2.0}
    assert scaling_from_hf({"rope_type": "llama3", "factor": 8, "low_freq_factor": 1, "high_freq_factor": 4},
                           "c", max_position_embeddings=8192) == {**LLAMA31, "factor": 8.0}
    y = scaling_from_hf({"rope_type": "yarn", "factor": 4.0, "low_freq_factor": None}, "c",
                        max_position_embeddings=32768)
    assert y == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "beta_fast": 32.0,
                 "beta_slow": 1.0, "mscale": None, "mscale_all_dim": None,
                 "attention_factor": pytest.approx(1 + 0.1 * np.log(4.0)), "truncate": True}
    assert scaling_from_hf({"rope_type": "dynamic", "factor": 2, "rope_theta": 1e4}, "c",
                           max_position_embeddings=2048) == {"rope_type": "dynamic", "factor": 2.0,
                                                             "max_position_embeddings": 2048}
    assert set(ROPE_TYPES) == {"llama3", "yarn", "linear", "dynamic"}


def one_line_error(fn, *a, **kw) -> str:
    with pytest.raises(ModelError) as e:
        fn(*a, **kw)
    msg = str(e.value)
    assert "\n" not in msg and msg.strip() == msg
    return msg


@pytest.mark.parametrize("rs,kw,want", [
    ({"rope_type": "dynamic", "factor": 2.0}, {}, "dynamic rope_scaling needs max_position_embeddings"),
    ({"rope_type": "dynamic"}, {"max_position_embeddings": 4096}, "dynamic rope_scaling lacks 'factor'"),
    ({"rope_type": "dynamic", "factor": 2.0, "low_freq_factor": 1.0}, {"max_position_embeddings": 4096},
     "key 'low_freq_factor' = 1.0 is not implemented"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 64, "long_factor": [2.0] * 64,
      "original_max_position_embeddings": 4096}, {}, "'longrope' is not supported: its frequencies change"),
    ({"rope_type": "proportional", "partial_rotary_factor": 0.25}, {},
     "'proportional' is not implemented (implemented: llama3, yarn, linear, dynamic)"),
    ({"type": "su"}, {}, "'su' is not implemented (implemented: llama3, yarn, linear, dynamic)"),
    ({**LLAMA31, "attention_factor": 0.5}, {}, "cfg: rope_scaling key 'attention_factor' = 0.5 is not implemented"),
    ({"type": "linear", "factor": 2.0, "beta_fast": 4}, {}, "key 'beta_fast' = 4 is not implemented"),
    ({"rope_type": "default", "factor": 2.0}, {}, "key 'factor' = 2.0 is not implemented"),
    ({"rope_type": "yarn", "factor": 4.0, "low_freq_factor": 1.0}, {"max_position_embeddings": 4096},
     "key 'low_freq_factor' = 1.0 is not implemented"),
    ({"rope_type": "yarn", "factor": 4.0, "partial_rotary_factor": 0.5}, {"max_position_embeddings": 4096},
     "key 'partial_rotary_factor' = 0.5 is not implemented"),
    ({"rope_type": "default", "mrope_section": [16, 24, 24]}, {}, "key 'mrope_section' = [16, 24, 24]"),
    ({k: v for k, v in LLAMA31.items() if k != "high_freq_factor"}, {}, "llama3 rope_scaling lacks 'high_freq_factor'"),
    ({k: v for k, v in LLAMA31.items() if k != "original_max_position_embeddings"}, {},
     "llama3 rope_scaling lacks 'original_max_position_embeddings'"),
    ({"rope_type": "linear"}, {}, "linear rope_scaling lacks 'factor'"),
    ({"rope_type": "yarn", "original_max_position_embeddings": 4096}, {}, "yarn rope_scaling lacks 'factor'"),
    ({"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 4096}, {},
     "factor None and no max_position_embeddings"),
])
def test_hf_refusals(rs, kw, want):
    msg = one_line_error(scaling_from_hf, rs, "cfg", **kw)
    assert msg.startswith("cfg: ") and want in msg


@pytest.mark.parametrize("rotary_dim", [0, 7, 130])
def test_bad_rotary_dim(rotary_dim):
    assert "rotary_dim" in one_line_error(inv_frequencies, 128, 1e4, None, rotary_dim)


def test_unknown_scaling_dict():
    assert "'ntk'" in one_line_error(inv_frequencies, 128, 1e4, {"rope_type": "ntk"})
    # model.py's presets today: llama3 parameters without a rope_type
    assert "None" in one_line_error(inv_frequencies, 128, 1e4, {k: v for k, v in LLAMA31.items() if k != "rope_type"})


# -- GGUF ----------------------------------------------------------------------------------------------------
def f32(x):
    return float(np.float32(x))


def converter_metadata(rp: dict, max_pos: int) -> dict:
    """The {arch}.* keys llama.cpp's convert_hf_to_gguf.py writes for HF rope parameters `rp` (base.py's
    set_gguf_parameters), as the GGUF stores them: floats as float32, lengths as uint32."""
    meta = {"context_length": max_pos}
    kind = rp.get("rope_type", rp.get("type"))
    factor = rp.get("factor")
    if kind == "linear" and factor is not None:
        meta.update({"rope.scaling.type": "linear", "rope.scaling.factor": f32(factor)})
    elif kind == "yarn" and factor is not None:
        meta.update({"rope.scaling.type": "yarn", "rope.scaling.factor": f32(factor),
                     "rope.scaling.original_context_length": int(rp["original_max_position_embeddings"])})
        for hf_key, key in (("extrapolation_factor", "yarn_ext_factor"), ("attention_factor", "yarn_attn_factor"),
                            ("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
            if rp.get(hf_key) is not None:
                meta[f"rope.scaling.{key}"] = f32(rp[hf_key])
    return meta


def getter(meta):
    return lambda key, default=None: meta.get(key, default)


# what the converter carries over: not mscale/mscale_all_dim (commented out there) nor truncate=False
GGUF_YARN = [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192, "beta_fast": 16, "beta_slow": 2,
     "attention_factor": 0.8},
    {"rope_type": "yarn", "factor": 2.5, "original_max_position_embeddings": 4096, "extrapolation_factor": None},
    {"type": "linear", "factor": 4.0},
]


@pytest.mark.parametrize("rp", GGUF_YARN, ids=str)
def test_gguf_round_trip(rp):
    max_pos = 131072
    meta = converter_metadata(rp, max_pos)
    g = scaling_from_gguf(getter(meta), "llama", "m.gguf")
    h = scaling_from_hf(rp, "cfg", max_position_embeddings=max_pos)
    assert g.keys() == h.keys() and g["rope_type"] == h["rope_type"]
    for k in g:
        assert g[k] == (pytest.approx(h[k], rel=RTOL) if isinstance(h[k], float) else h[k]), k
    for theta, head_dim in ((1e6, 128), (10000.0, 64)):
        gi, ga = inv_frequencies(head_dim, theta, g)
        hi, ha = inv_frequencies(head_dim, theta, h)
        torch.testing.assert_close(gi, hi, rtol=RTOL, atol=0)
        assert ga == pytest.approx(ha, rel=RTOL)
        if theta == 1e6 and head_dim == 128:  # and both equal transformers'
            check(case({k: v for k, v in rp.items() if v is not None}, head_dim, theta, max_pos))


def test_gguf_no_scaling():
    assert scaling_from_gguf(getter({}), "llama", "m.gguf") is None
    assert scaling_from_gguf(getter({"rope.scaling.type": "none", "rope.scaling.factor": 4.0}), "llama", "m") is None
    assert scaling_from_gguf(getter({"rope.scaling.type": "linear", "rope.scaling.factor": 0.0}), "llama", "m") is None
    # neutral values of the keys that would otherwise be refused
    meta = {"rope.scaling.type": "none", "rope.scaling.attn_factor": 1.0, "rope.scaling.yarn_ext_factor": -1.0,
            "rope.scaling.yarn_log_multiplier": 0.0, "rope.scaling.yarn_attn_factor": 1.0}
    assert scaling_from_gguf(getter(meta), "llama", "m") is None


def test_gguf_linear_spellings():
    want = {"rope_type": "linear", "factor": 4.0}
    assert scaling_from_gguf(getter({"rope.scaling.factor": 4.0}), "llama", "m") == want  # llama.cpp: no type = linear
    assert scaling_from_gguf(getter({"rope.scale_linear": 4.0}), "llama", "m") == want   # the old key


def test_gguf_yarn_defaults():
    # no original length: llama.cpp's training context; ext_factor 1 is yarn's own
    meta = {"context_length": 32768, "rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
            "rope.scaling.yarn_ext_factor": 1.0}
    assert scaling_from_gguf(getter(meta), "qwen2", "m") == scaling_from_hf(
        {"rope_type": "yarn", "factor": 4.0}, "cfg", max_position_embeddings=32768)


def test_gguf_llama3():
    meta = {"rope.scaling.type": "llama3", "rope.scaling.factor": 8.0, "rope.scaling.low_freq_factor": 1.0,
            "rope.scaling.high_freq_factor": 4.0, "rope.scaling.original_context_length": 8192}
    assert scaling_from_gguf(getter(meta), "llama", "m.gguf") == LLAMA31
    del meta["rope.scaling.high_freq_factor"]
    assert "llama.rope.scaling.high_freq_factor" in one_line_error(scaling_from_gguf, getter(meta), "llama", "m.gguf")


@pytest.mark.parametrize("meta,want", [
    ({"rope.scaling.type": "longrope"}, "'longrope' is not supported: its frequencies change"),
    ({"rope.scaling.type": "su"}, "'su' is not implemented (implemented: llama3, yarn, linear, dynamic)"),
    ({"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "context_length": 4096,
      "rope.scaling.yarn_ext_factor": 0.5}, "GGUF key llama.rope.scaling.yarn_ext_factor = 0.5 is not implemented"),
    ({"rope.scaling.type": "linear", "rope.scaling.factor": 2.0, "rope.scaling.yarn_ext_factor": 1.0},
     "llama.rope.scaling.yarn_ext_factor = 1.0"),
    ({"rope.scaling.type": "yarn", "rope.scaling.factor": 40.0, "context_length": 4096,
      "rope.scaling.yarn_log_multiplier": 0.1}, "llama.rope.scaling.yarn_log_multiplier = 0.1"),
    ({"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "context_length": 4096,
      "rope.scaling.attn_factor": 0.9}, "llama.rope.scaling.attn_factor = 0.9"),
    ({"rope.scaling.type": "linear", "rope.scaling.factor": 2.0, "rope.scaling.yarn_attn_factor": 0.9},
     "llama.rope.scaling.yarn_attn_factor = 0.9"),
    ({"rope.scaling.alpha": 1000.0}, "llama.rope.scaling.alpha = 1000.0"),
    ({"rope.scaling.type": "linear", "rope.scaling.factor": 8.0, "rope.scaling.low_freq_factor": 1.0},
     "llama.rope.scaling.low_freq_factor = 1.0"),
    ({"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0}, "lacks GGUF key llama.rope.scaling.original_context"),
])
def test_gguf_refusals(meta, want):
    msg = one_line_error(scaling_from_gguf, getter(meta), "llama", "m.gguf")
    assert msg.startswith("m.gguf: ") and want in msg


@pytest.mark.parametrize("fam,cfg,want", [
    # Qwen3's model card: YaRN x4 over 32,768 added to a config whose max_position_embeddings stays 40,960
    ("qwen3", dict(max_position_embeddings=40960, rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 32768}), 131072),
    # Qwen3.5's: x4 over its 262,144, the M-RoPE keys kept
    ("qwen3_5", dict(max_position_embeddings=262144, rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e7, "factor": 4.0, "original_max_position_embeddings": 262144,
        "partial_rotary_factor": 0.25, "mrope_interleaved": True, "mrope_section": [11, 11, 10]}), 1048576),
    ("qwen3", dict(max_position_embeddings=40960, rope_parameters={"rope_type": "default", "rope_theta": 1e6}), 40960),
    # no original length given: transformers 5 takes max_position_embeddings as the original (and saves it so)
    ("qwen3", dict(max_position_embeddings=8192, rope_parameters={"rope_type": "yarn", "rope_theta": 1e6,
                                                                  "factor": 2.0}), 16384),
])
def test_yarn_config_takes_the_stretched_context(tmp_path, fam, cfg, want):
    """A model whose config.json adds YaRN takes factor x its original length (the context the stretch is for), as
    strata.models.rope.yarn_positions says; other scalings keep max_position_embeddings."""
    from families_fixtures import make_hf
    from strata.weights.checkpoint import model_args
    _, d = make_hf(tmp_path, fam, **cfg)
    assert model_args(d).max_seq_len == want
