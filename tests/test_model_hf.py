"""Engine vs transformers on tiny random llama / qwen2 models saved as safetensors (float32)."""
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from conftest import chained_prefill
from strata.models.model import Transformer
from strata.weights.checkpoint import ModelError, model_args, slice_tensors


def make_tiny(tmp_path, arch: str, seed: int = 1, **extra):
    torch.manual_seed(seed)
    common = {**dict(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=6,
                     num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                     rms_norm_eps=1e-6, tie_word_embeddings=False), **extra}
    if arch == "llama":
        cfg = transformers.LlamaConfig(rope_theta=5000.0, **common)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(rope_theta=10000.0, **common)
        model = transformers.Qwen2ForCausalLM(cfg)
    model = model.float().eval()
    with torch.no_grad():  # non-trivial norms and biases, so a mixed-up weight shows
        for n, p in model.named_parameters():
            if n.endswith("norm.weight") or n.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    path = tmp_path / arch
    model.save_pretrained(path, safe_serialization=True)
    return model, str(path)


def run_slices(model_dir, ids, bounds, chunk):
    args = model_args(model_dir)
    slices = []
    for a, b in bounds:
        t = Transformer(args, a, b)
        t.load_weights(slice_tensors(model_dir, args, a, b), "cpu", torch.float32)
        t.setup_cache(ids.shape[1])
        slices.append(t)
    return chained_prefill(slices, ids, chunk), slices[-1]


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_three_slices_chunked_match_transformers(tmp_path, arch):
    ref_model, d = make_tiny(tmp_path, arch)
    ids = torch.randint(0, 300, (1, 300), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = ref_model(ids, output_hidden_states=True)
    h, last = run_slices(d, ids, [(0, 2), (2, 4), (4, 6)], chunk=64)
    hidden = last.norm(h)  # transformers' last hidden state is after the final norm
    logits = last.logits(h)
    assert rel(hidden, ref.hidden_states[-1]) < 1e-4
    assert rel(logits, ref.logits) < 1e-4


def test_chunk_size_changes_nothing_beyond_rounding(tmp_path):
    _, d = make_tiny(tmp_path, "llama")
    ids = torch.randint(0, 300, (1, 200), generator=torch.Generator().manual_seed(3))
    whole, _ = run_slices(d, ids, [(0, 6)], chunk=200)
    for chunk in (1, 64):
        h, _ = run_slices(d, ids, [(0, 6)], chunk=chunk)
        assert rel(h, whole) < 1e-5


def test_slicing_is_bit_exact(tmp_path):
    _, d = make_tiny(tmp_path, "qwen2")
    ids = torch.randint(0, 300, (1, 130), generator=torch.Generator().manual_seed(4))
    one, _ = run_slices(d, ids, [(0, 6)], chunk=64)
    three, _ = run_slices(d, ids, [(0, 1), (1, 5), (5, 6)], chunk=64)
    assert torch.equal(one, three)


def test_llama3_rope_scaling_matches(tmp_path):
    ref_model, d = make_tiny(tmp_path, "llama", rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64))
    assert model_args(d).rope_scaling is not None
    ids = torch.randint(0, 300, (1, 200), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = ref_model(ids).logits
    h, last = run_slices(d, ids, [(0, 6)], chunk=50)
    assert rel(last.logits(h), ref) < 1e-4


def test_bad_inputs(tmp_path):
    _, d = make_tiny(tmp_path, "llama")
    with pytest.raises(ModelError, match="not found"):
        model_args(str(tmp_path / "nope"))
    args = model_args(d)
    with pytest.raises(ModelError, match="outside the model"):
        slice_tensors(d, args, 4, 9)
    # truncated safetensors
    import pathlib
    f = next(pathlib.Path(d).glob("*.safetensors"))
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelError, match="corrupt or truncated"):
        slice_tensors(d, args, 0, 6)
    # unsupported architecture
    (tmp_path / "gpt").mkdir()
    (tmp_path / "gpt" / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    with pytest.raises(ModelError, match="unsupported architecture"):
        model_args(str(tmp_path / "gpt"))
    # pickled checkpoints refused
    (tmp_path / "m.bin").write_bytes(b"x")
    with pytest.raises(ModelError, match="pickled"):
        model_args(str(tmp_path / "m.bin"))


def test_synthetic_slices_are_consistent():
    args = model_args("synthetic:smoke")
    full = slice_tensors("synthetic:smoke", args, 0, args.n_layers)
    part = slice_tensors("synthetic:smoke", args, 3, 5)
    for k, v in part.items():
        assert torch.equal(v, full[k]), k
