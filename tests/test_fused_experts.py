"""Qwen MoE checkpoints whose experts are stored fused, as released Qwen3.5 MoE checkpoints hold them and as
transformers 5 holds them in memory: mlp.experts.gate_up_proj (E, 2 * effn, dim; gate rows then up rows) and
mlp.experts.down_proj (E, dim, effn), with or without ".weight". Read as the per-expert ones transformers'
save_pretrained writes: against transformers (float32, 3 slices, test_families.check_against), planned, and refused in
one line where a layer's tensor is missing or the two spellings are mixed."""
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from conftest import make_rig  # noqa: E402
from families_fixtures import make_hf, make_hf_multimodal  # noqa: E402
from strata.weights.checkpoint import (ModelError, check_model_files, model_args, slice_tensors, stage_bytes,  # noqa: E402
                              storage)
from strata.models.model import Transformer  # noqa: E402
from test_bad_input import refuse  # noqa: E402
from test_families import PROMPT, check_against, load_slices, three_way  # noqa: E402

PER_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")
# (fixture, multimodal, config overrides): qwen3_moe without renormalizing, as test_families checks it
CASES = {"qwen3_5_moe": ("qwen3_5_moe", False, {}), "qwen3_5_moe-multimodal": ("qwen3_5_moe", True, {}),
         "qwen3_moe": ("qwen3_moe", False, dict(norm_topk_prob=False))}


def make(tmp_path, case: str):
    fam, multimodal, over = CASES[case]
    if multimodal:
        return make_hf_multimodal(tmp_path, fam, text=over)
    return make_hf(tmp_path, fam, **over)


def fuse(d: str, suffix: str = "", drop=()) -> dict:
    """The fixture's per-expert tensors replaced by each layer's two fused ones, stacked as transformers stacks them
    (its conversion_mapping's qwen2_moe: the experts' gates along dim 0, then [gate | up] along dim 1), named with
    `suffix`; the fused names in `drop` left out. Returns the fused tensors written."""
    from safetensors.torch import load_file, save_file
    f = Path(d) / "model.safetensors"
    kept, layers = {}, {}
    for k, v in load_file(str(f)).items():
        m = PER_EXPERT.fullmatch(k)
        if m:
            layers.setdefault(m[1], {})[int(m[2]), m[3]] = v
        else:
            kept[k] = v
    fused = {}
    for pre, w in layers.items():
        n = 1 + max(e for e, _ in w)

        def stack(part):
            return torch.stack([w[e, part] for e in range(n)])
        fused[f"{pre}.gate_up_proj{suffix}"] = torch.cat([stack("gate"), stack("up")], dim=1)
        fused[f"{pre}.down_proj{suffix}"] = stack("down")
    assert fused and not any(PER_EXPERT.fullmatch(k) for k in kept)
    save_file({**kept, **{k: v for k, v in fused.items() if k not in drop}}, str(f), metadata={"format": "pt"})
    return fused


def ids_for(ref):
    cfg = getattr(ref.config, "text_config", ref.config)
    return torch.randint(0, cfg.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(7))


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_fused_matches_transformers(tmp_path, case):
    """Strata's logits, NLL and greedy tokens from the fused checkpoint equal the reference model's; and the layout is
    transformers' own: transformers loads the fused file (every key, none missing) into the same model, its experts'
    gate_up_proj / down_proj parameters equal to the fused tensors."""
    ref, d = make(tmp_path, case)
    fused = fuse(d)
    args = model_args(d)
    assert args.n_experts == 8
    check_against(ref, d, ids_for(ref), args.n_layers)
    cls = type(ref)
    loaded, info = cls.from_pretrained(d, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    params = dict(loaded.named_parameters())
    assert all(torch.equal(params[k], v) for k, v in fused.items())
    ids = ids_for(ref)
    with torch.no_grad():  # (the same model: a misplaced expert or half is O(0.1) off; transformers' loaded copy of
        # qwen3_5_moe computes 6e-8 apart from the one it saved on this AVX-512 box, 0 on the others: an ulp, not layout)
        torch.testing.assert_close(loaded.eval()(ids).logits, ref(ids).logits, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_fused_weight_suffix_reads_the_same(tmp_path):
    """The fused tensors named with ".weight" (llama.cpp's converter takes that spelling too; transformers 5.25 does
    not load it) read as the same tensors: every slice equal to the unsuffixed checkpoint's."""
    ref, d = make(tmp_path, "qwen3_5_moe-multimodal")
    plain = str(tmp_path / "plain")
    shutil.copytree(d, plain)
    fuse(plain)
    fuse(d, ".weight")
    args = model_args(d)
    bounds = three_way(args.n_layers)
    for x, y in zip(load_slices(d, bounds, PROMPT), load_slices(plain, bounds, PROMPT)):
        sx, sy = x.state_dict(), y.state_dict()
        assert sx.keys() == sy.keys() and all(torch.equal(sx[k], sy[k]) for k in sx)
    check_against(ref, d, ids_for(ref), args.n_layers)


def test_fused_plans_as_loaded(tmp_path):
    """The bytes planned from the headers of a fused checkpoint (stage_bytes, storage) are what its stages hold once
    loaded, and the per-expert checkpoint's."""
    _, d = make(tmp_path, "qwen3_5_moe")
    per = str(tmp_path / "per")
    shutil.copytree(d, per)
    fuse(d)
    args = model_args(d)
    for a, b in three_way(args.n_layers):
        t = Transformer(args, a, b)
        t.load_weights(slice_tensors(d, args, a, b), "cpu", torch.float32)
        got = stage_bytes(d, args, a, b, torch.float32)
        assert got == stage_bytes(per, args, a, b, torch.float32)
        assert got[0] == t.weight_bytes
    assert storage(d, args, torch.float32) == storage(per, args, torch.float32)


def test_fused_refused_in_one_line(tmp_path, capsys):
    """Before any process starts (check_model_files, the launcher) and where a slice is read: a fused checkpoint
    whose layer 1 lacks its down_proj, named; one holding both spellings (a layer fused, the others per expert), both
    named."""
    _, lacking = make(tmp_path, "qwen3_5_moe-multimodal")
    fuse(lacking, drop=("model.language_model.layers.1.mlp.experts.down_proj",))
    _, mixed = make(tmp_path, "qwen3_moe")
    from safetensors.torch import load_file, save_file
    f = Path(mixed) / "model.safetensors"
    w = load_file(str(f))
    layer0 = {k: v for k, v in w.items() if k.startswith("model.layers.0.mlp.experts.")}
    e = max(int(PER_EXPERT.fullmatch(k)[2]) for k in layer0) + 1
    w = {k: v for k, v in w.items() if k not in layer0}
    w["model.layers.0.mlp.experts.gate_up_proj"] = torch.cat([torch.stack(
        [layer0[f"model.layers.0.mlp.experts.{i}.{p}_proj.weight"] for i in range(e)]) for p in ("gate", "up")], 1)
    w["model.layers.0.mlp.experts.down_proj"] = torch.stack(
        [layer0[f"model.layers.0.mlp.experts.{i}.down_proj.weight"] for i in range(e)])
    save_file(w, str(f), metadata={"format": "pt"})
    cases = [(lacking, "tensors missing from the checkpoint: model.layers.1.mlp.experts.down_proj"),
             (mixed, "the experts are stored both fused (model.layers.0.mlp.experts.")]
    capsys.readouterr()  # (the fixtures' progress lines)
    for i, (d, expect) in enumerate(cases):
        with pytest.raises(ModelError, match=re.escape(expect)):
            check_model_files(d)
        args = model_args(d)
        with pytest.raises(ModelError, match=re.escape(expect)):
            slice_tensors(d, args, 0, args.n_layers)
        (tmp_path / f"r{i}").mkdir()
        line = refuse(tmp_path / f"r{i}", capsys, make_rig(model=d, tokens=32, chunk=16))
        assert d in line and expect in line, line
    assert "per expert (model.layers.1.mlp.experts." in line, line
    slice_tensors(lacking, model_args(lacking), 0, 1)  # (a stage without layer 1 reads what it needs)


def test_fused_of_another_shape_refused(tmp_path):
    """A fused gate_up_proj stored transposed, (E, dim, 2 x ffn) as other families lay it out, is refused in one line
    naming both shapes rather than sliced as if it were (E, 2 x ffn, dim)."""
    _, d = make(tmp_path, "qwen3_moe")
    fused = fuse(d)
    from safetensors.torch import load_file, save_file
    f = Path(d) / "model.safetensors"
    w = load_file(str(f))
    name = next(k for k in fused if k.endswith("gate_up_proj"))
    w[name] = w[name].transpose(1, 2).contiguous()
    save_file(w, str(f), metadata={"format": "pt"})
    args = model_args(d)
    want = (args.n_experts, 2 * args.expert_ffn_dim, args.dim)
    with pytest.raises(ModelError, match=re.escape(f"the config implies {want}")):
        slice_tensors(d, args, 0, args.n_layers)
