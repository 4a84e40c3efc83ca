"""Multimodal checkpoints (Qwen3.5, Qwen3.5-MoE, Gemma 3 *ForConditionalGeneration): their text model only, against
transformers' composite model on text ids (float32, 3 slices, an odd chunk: test_families.check_against). Over text
Qwen3.5's multimodal RoPE gives every axis the same position, so the plain RoPE Strata computes must equal it."""
import json
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from conftest import make_rig  # noqa: E402
from families_fixtures import make_hf, make_hf_multimodal  # noqa: E402
from strata.weights.checkpoint import ModelError, check_model_files, model_args  # noqa: E402
from test_bad_input import refuse  # noqa: E402
from test_families import PROMPT, check_against, load_slices, three_way  # noqa: E402

# Qwen3.5's rope_parameters as its config.json has them, at the fixture's size: rotary_dim 16 * 0.25 = 4, so the
# sections (time, height, width) cover its 2 frequencies
MROPE = {"rope_theta": 10000.0, "partial_rotary_factor": 0.25, "mrope_interleaved": True, "mrope_section": [1, 1, 0]}
# Qwen's long-context recipe (YaRN x4 over the original length) on those keys, the original short enough that the
# test's 71 + 16 positions pass it
YARN = {**MROPE, "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
# gemma3's softmax scale away from head_dim ** -0.5; no logit softcap (its composite refuses one: the last test)
GEMMA = dict(query_pre_attn_scalar=24, final_logit_softcapping=None)
# (text family, text_config overrides, top-level keys): transformers ties the head by the top-level
# tie_word_embeddings, so two of them set it against text_config's
CASES = {
    "qwen3_5": ("qwen3_5", dict(rope_parameters={"rope_type": "default", **MROPE}), dict(tie_word_embeddings=True)),
    "qwen3_5-yarn": ("qwen3_5", dict(max_position_embeddings=128, rope_parameters=YARN), {}),
    "qwen3_5_moe": ("qwen3_5_moe", dict(rope_parameters={"rope_type": "default", **MROPE}), {}),
    "gemma3": ("gemma3", GEMMA, {}),
    "gemma3-untied": ("gemma3", GEMMA, dict(tie_word_embeddings=False)),
}


def text_ids(vocab: int):
    return torch.randint(0, vocab, (1, PROMPT), generator=torch.Generator().manual_seed(7))


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_composite_text_matches_transformers(tmp_path, case):
    """Logits, NLL and 16 greedy tokens of the composite's text model equal transformers' composite model's; the
    head tied as transformers ties it (by the top-level key); YaRN over Qwen3.5's partial rotary."""
    fam, text, top = CASES[case]
    ref, d = make_hf_multimodal(tmp_path, fam, text=text, **top)
    args = model_args(d)
    tied = ref.lm_head.weight is ref.model.language_model.embed_tokens.weight
    assert args.tie_embeddings == tied == ref.config.tie_word_embeddings
    assert tied != ref.config.text_config.tie_word_embeddings or not top  # (where set, the two disagree)
    if fam.startswith("qwen3_5"):
        assert args.rotary_dim == 4 and (args.n_experts > 0) == (fam == "qwen3_5_moe")
    if case == "qwen3_5-yarn":
        assert args.rope_scaling["rope_type"] == "yarn" and args.rope_scaling["original_max_position_embeddings"] == 32
    check_against(ref, d, text_ids(ref.config.text_config.vocab_size), args.n_layers)


@pytest.mark.slow
def test_causal_lm_with_mrope_keys_matches_transformers(tmp_path):
    """A Qwen3_5ForCausalLM config.json whose rope_parameters carry the released checkpoint's mrope keys as they are
    (sections [11, 11, 10], more than this model's 2 frequencies: transformers' rotary takes them) reads as plain
    RoPE, and matches transformers (whose rotary applies the sections)."""
    ref, d = make_hf(tmp_path, "qwen3_5", rope_parameters={"rope_type": "default", **MROPE,
                                                           "mrope_section": [11, 11, 10]})
    assert ref.config.rope_parameters["mrope_section"] == [11, 11, 10]
    args = model_args(d)
    check_against(ref, d, text_ids(args.vocab_size), args.n_layers)


def add_tensors(d: str, new: dict) -> None:
    """Tensors appended to a fixture's one safetensors file."""
    from safetensors.torch import load_file, save_file
    f = Path(d) / "model.safetensors"
    save_file({**load_file(str(f)), **new}, str(f), metadata={"format": "pt"})


def test_composite_reads_its_text_tensors_only(tmp_path, monkeypatch):
    """Every tensor a slice reads is the text model's (model.language_model.*, lm_head.*): the vision tower and the
    multi-token-prediction block (mtp.*, as Qwen3.5's released files hold it) are never read, nor refused."""
    import safetensors
    ref, d = make_hf_multimodal(tmp_path, "qwen3_5", text=dict(rope_parameters={"rope_type": "default", **MROPE}))
    add_tensors(d, {"mtp.fc.weight": torch.randn(64, 128), "mtp.norm.weight": torch.ones(64)})
    real, read = safetensors.safe_open, []
    with real(str(Path(d) / "model.safetensors"), framework="pt") as f:
        stored = set(f.keys())
    assert {"model.visual.patch_embed.proj.weight", "mtp.fc.weight", "lm_head.weight"} <= stored

    class Spy:  # safe_open, noting each tensor read
        def __init__(self, *a, **kw):
            self.f = real(*a, **kw)

        def __enter__(self):
            self.h = self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.h.keys()

        def get_tensor(self, name):
            read.append(name)
            return self.h.get_tensor(name)

    monkeypatch.setattr(safetensors, "safe_open", Spy)
    check_model_files(d)
    args = model_args(d)
    load_slices(d, three_way(args.n_layers), PROMPT)
    text = {k for k in stored if k.startswith(("model.language_model.", "lm_head."))}
    assert sorted(read) == sorted(text)  # each text tensor once, nothing else


@pytest.mark.slow
def test_gemma3_sparse_text_config(tmp_path):
    """Gemma 3's released configs list in text_config only what differs from Gemma3TextConfig's defaults (their
    heads, rope_theta, the window pattern left out) and give a linear factor as rope_scaling: such a config.json reads
    as transformers reads it, and the model matches transformers' loaded from the same folder."""
    _, d = make_hf_multimodal(tmp_path, "gemma3", text={**GEMMA, "num_attention_heads": 8, "num_key_value_heads": 4})
    path = Path(d) / "config.json"
    cfg = json.loads(path.read_text())
    default = transformers.Gemma3TextConfig().to_dict()
    drop = {"layer_types", "rope_parameters"}  # (the fixture's are the defaults': every 6th layer global, 1e6 / 1e4)
    sparse = {k: v for k, v in cfg["text_config"].items()
              if k not in drop and not k.startswith("_") and (k not in default or v != default[k])}
    assert {"num_attention_heads", "num_key_value_heads", "rms_norm_eps", "hidden_activation"}.isdisjoint(sparse)
    cfg["text_config"] = {**sparse, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    path.write_text(json.dumps(cfg))
    ref = transformers.Gemma3ForConditionalGeneration.from_pretrained(d).eval()
    args = model_args(d)
    assert (args.rope_theta, args.window_rope_theta, args.rope_scaling) == (
        1e6, 1e4, {"rope_type": "linear", "factor": 8.0})
    assert (args.n_heads, args.n_kv_heads, args.window_layers) == (8, 4, (True,) * 5 + (False,))
    check_against(ref, d, text_ids(args.vocab_size), args.n_layers)


def test_gemma3_defaults_are_transformers():
    """The defaults Strata fills into a gemma3 text config are Gemma3TextConfig's."""
    from strata.models.families import _GEMMA3_DEFAULTS
    c = transformers.Gemma3TextConfig()
    rope = c.rope_parameters
    got = {**{k: getattr(c, k) for k in _GEMMA3_DEFAULTS if hasattr(c, k)},
           "rope_theta": rope["full_attention"]["rope_theta"],
           "rope_local_base_freq": rope["sliding_attention"]["rope_theta"]}
    assert got == _GEMMA3_DEFAULTS


def rename(d: str, old: str, new: str) -> None:
    from safetensors.torch import load_file, save_file
    f = Path(d) / "model.safetensors"
    w = load_file(str(f))
    save_file({(new + k[len(old):] if k.startswith(old) else k): v for k, v in w.items()}, str(f),
              metadata={"format": "pt"})


def edit_config(d: str, change) -> None:
    path = Path(d) / "config.json"
    cfg = json.loads(path.read_text())
    change(cfg)
    path.write_text(json.dumps(cfg))


def test_refused_in_one_line(tmp_path, capsys):
    """Through the launcher, before any process starts: a text-only checkpoint whose tensors carry the composite's
    names (the alias is the composites' only), a composite whose text_config lacks what the text model needs, an
    mrope_section transformers' rotary cannot index, and a Gemma 3 composite's final_logit_softcapping (which
    transformers' Gemma3ForConditionalGeneration leaves unapplied, its Gemma3ForCausalLM applies)."""
    _, plain = make_hf(tmp_path, "qwen3_5")
    rename(plain, "model.", "model.language_model.")
    _, lacking = make_hf_multimodal(tmp_path, "qwen3_5")
    edit_config(lacking, lambda c: c["text_config"].pop("num_attention_heads"))
    _, section = make_hf_multimodal(tmp_path, "qwen3_5", text=dict(rope_parameters={"rope_type": "default", **MROPE}))
    edit_config(section, lambda c: c["text_config"]["rope_parameters"].update(mrope_section=[2]))
    capped, gemma = make_hf_multimodal(tmp_path, "gemma3", text=dict(final_logit_softcapping=1.5))
    ids = text_ids(300)
    with torch.no_grad():
        assert torch.equal(capped(ids).logits, capped.lm_head(capped.model(ids).last_hidden_state))
    cases = [(plain, "tensors missing from the checkpoint: model.embed_tokens.weight"),
             (lacking, "config.json text_config: config lacks 'num_attention_heads'"),
             (section, "mrope_section = [2] is not implemented"),
             (gemma, "text_config final_logit_softcapping = 1.5 is not implemented for Gemma3ForConditionalGeneration")]
    capsys.readouterr()  # (the fixtures' progress lines)
    for i, (d, expect) in enumerate(cases):
        (tmp_path / f"r{i}").mkdir()
        line = refuse(tmp_path / f"r{i}", capsys, make_rig(model=d, tokens=32, chunk=16))
        assert d in line and expect in line, line
    with pytest.raises(ModelError, match="tensors missing"):
        check_model_files(plain)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_qwen35_layer_types_from_the_interval(family):
    """A Qwen3.5 config without layer_types: its layers from full_attention_interval (default 4) as transformers
    derives them; an interval that is not a positive integer refused in one line."""
    from strata.errors import ModelError
    from strata.models.families import hf_args
    from families_fixtures import _family_spec
    cls, model_cls, kw = _family_spec(family)
    kw = {k: v for k, v in kw.items() if k != "layer_types"}
    for extra in ({}, {"full_attention_interval": 3}):
        c = cls(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
                num_key_value_heads=2, **kw, **extra)
        cfg = {k: v for k, v in c.to_dict().items() if k != "layer_types"}
        cfg.update(extra, architectures=[model_cls.__name__])
        args = hf_args(cfg, "config.json")
        assert args.linear_layers == tuple(t == "linear_attention" for t in c.layer_types), (extra, c.layer_types)
    with pytest.raises(ModelError, match="full_attention_interval = 0"):
        hf_args({**cfg, "full_attention_interval": 0}, "config.json")


def test_gemma3_window_pattern_must_be_a_positive_integer():
    """Gemma 3's layer_types derived from sliding_window_pattern (the same derivation as Qwen3.5's): a pattern of 0
    is refused in one line (it divided by zero)."""
    from strata.errors import ModelError
    from strata.models.families import hf_args
    for bad in (0, 2.5):
        with pytest.raises(ModelError, match=f"sliding_window_pattern = {bad!r} is not implemented"):
            hf_args({"architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 6, "sliding_window_pattern": bad},
                    "config.json")
