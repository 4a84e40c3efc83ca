"""bench/make_gguf.py's qwen35 (Qwen3.5) files: the names, shapes and keys llama.cpp's own converter writes for the
same model, the preset's args read back by Strata, and the file run through Strata on CPU (chunked prefill at odd
chunks equals one pass); synthetic:qwen3.5-27b's linear layers at small widths; the real preset's shape."""
import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from conftest import chained_prefill
from strata.models.args import PRESETS
from strata.weights.checkpoint import load_stage, model_args

ROOT = Path(__file__).resolve().parents[1]


def _make_gguf():
    spec = importlib.util.spec_from_file_location("make_gguf", ROOT / "bench" / "make_gguf.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["make_gguf"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def small(**over):
    """qwen3.5-27b at small widths, 4 layers (its pattern kept: three linear, then full attention)."""
    a = PRESETS["qwen3.5-27b"]
    a = dataclasses.replace(a, **{**dict(vocab_size=512, dim=256, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=512,
                                         rotary_dim=16, lin_k_heads=2, lin_v_heads=4, lin_k_dim=64, lin_v_dim=64),
                                  **over})
    return _make_gguf().with_layers(a, 4)


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_preset_is_qwen35_27b():
    a = PRESETS["qwen3.5-27b"]
    assert (a.dim, a.n_layers, a.n_heads, a.n_kv_heads, a.head_dim, a.ffn_dim, a.vocab_size) == \
        (5120, 64, 24, 4, 256, 17408, 248320)
    assert sum(a.linear_layers) == 48 and not any(a.linear_layers[3::4]) and a.rotary_dim == 64
    assert (a.lin_k_heads, a.lin_v_heads, a.lin_k_dim, a.lin_v_dim, a.max_seq_len) == (16, 48, 128, 128, 262144)


def test_with_layers_keeps_the_hybrid_pattern():
    mg = _make_gguf()
    assert mg.with_layers(PRESETS["qwen3.5-27b"], 8).linear_layers == (True, True, True, False) * 2
    odd = dataclasses.replace(small(), linear_layers=(True, False, False, True))
    with pytest.raises(ValueError, match="linear layers are not every p-th"):
        mg.with_layers(odd, 2)


def test_refuses_what_llamacpp_cannot_read(tmp_path):
    mg = _make_gguf()
    with pytest.raises(ValueError, match="value heads of the key heads' width"):
        mg.write(tmp_path / "x.gguf", small(lin_v_dim=32), "Q8_0")


@pytest.mark.slow
def test_names_and_keys_are_the_converters(tmp_path):
    """The tiny HF qwen3_5 through llama.cpp's convert_hf_to_gguf.py --no-mtp, and make_gguf's file of its args:
    the same tensor names and shapes, and every key the converter writes (but general.*) at its value."""
    from families_fixtures import SMOLLM2_VOCAB, convert_to_gguf, converter_skip_reason, gguf_summary, make_hf
    why = converter_skip_reason()
    if why:
        pytest.skip(why)
    _, d = make_hf(tmp_path, "qwen3_5", vocab_size=SMOLLM2_VOCAB)
    conv = gguf_summary(convert_to_gguf(d, tmp_path / "conv.gguf", extra_args=("--no-mtp",)))
    mine = tmp_path / "mine.gguf"
    _make_gguf().write(mine, model_args(d), "Q8_0")
    ours = gguf_summary(mine)
    assert ours["arch"] == conv["arch"] == "qwen35"
    assert {n: s for n, (s, _) in ours["tensors"].items()} == {n: s for n, (s, _) in conv["tensors"].items()}
    keys = [k for k in conv["meta"] if not k.startswith("general.")]
    assert {k: ours["meta"].get(k) for k in keys} == {k: conv["meta"][k] for k in keys}


def test_file_read_back_and_run(tmp_path):
    """Q4_K_M at small widths: Strata reads the preset's args back (the file's norms are stored as 1 + w: no
    offset) and runs it on two CPU slices; prefill in chunks of 13 equals one pass, and is finite."""
    args = small()
    out = tmp_path / "q35.gguf"
    _make_gguf().write(out, args, "Q4_K_M", seed=3)
    got = model_args(str(out))
    diff = {f.name for f in dataclasses.fields(args) if getattr(args, f.name) != getattr(got, f.name)}
    assert diff == {"norm_eps", "norm_offset"} and abs(got.norm_eps - args.norm_eps) < 1e-12
    ids = torch.randint(0, args.vocab_size, (1, 45), generator=torch.Generator().manual_seed(4))
    ms = [load_stage(str(out), got, a, b, device="cpu", dtype=torch.float32, max_len=64, max_chunk=45)
          for a, b in ((0, 2), (2, 4))]
    with torch.no_grad():
        chunked = ms[-1].logits(chained_prefill(ms, ids, 13)[0])
        one = ms[-1].logits(chained_prefill(ms, ids, 45)[0])
    assert torch.isfinite(chunked).all() and chunked.std() > 0
    assert rel(chunked, one) < 1e-5


def test_synthetic_hybrid_runs():
    """synthetic weights for the linear layers (A_log = log U(1, 16), dt_bias 1): finite logits in bfloat16."""
    from strata.weights.checkpoint import synthetic_tensors
    from strata.models.model import Transformer
    args = small()
    t = Transformer(args, 0, args.n_layers)
    t.load_weights(synthetic_tensors(args, 0, args.n_layers, "cpu", torch.bfloat16, 0), "cpu", torch.bfloat16)
    t.setup_cache(200, max_chunk=97)
    ids = torch.randint(0, args.vocab_size, (1, 200), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        h = chained_prefill([t], ids, 97)
    assert torch.isfinite(t.logits(h[0, -1]).float()).all()


def test_device_script_steps(tmp_path):
    """bench/device_qwen35.sh: an unknown step is refused (rc 2, naming the steps); steps past DEADLINE are skipped
    by name; prefill and decode without the GGUF say so. (No step here touches a GPU.)"""
    import os
    import subprocess
    env = dict(os.environ, OUT=str(tmp_path), Q35=str(tmp_path / "none.gguf"))
    run = lambda *steps, **e: subprocess.run(["bash", "bench/device_qwen35.sh", *steps], cwd=ROOT, text=True,  # noqa
                                             capture_output=True, env={**env, **e}, timeout=60)
    r = run("bogus")
    assert r.returncode == 2 and "unknown step bogus (setup build tests gguf prefill decode resident rdecode ldecode million)" in r.stdout
    r = run("tests", "gguf", DEADLINE="0")
    assert r.returncode == 0 and "SKIPPED tests" in r.stdout and "SKIPPED gguf qwen3.5-27b" in r.stdout
    r = run("prefill", "decode", "resident", "rdecode", "ldecode")
    assert r.stdout.count("(run the gguf step first)") == 5
    r = run("resident", "rdecode", "ldecode", "million", DEADLINE="0", Q35=__file__)  # (a file: the deadline decides)
    assert "SKIPPED resident: needs ~420 s" in r.stdout and "SKIPPED rdecode: needs ~300 s" in r.stdout
    assert "SKIPPED ldecode: needs ~260 s" in r.stdout and "SKIPPED million: needs ~420 s" in r.stdout
