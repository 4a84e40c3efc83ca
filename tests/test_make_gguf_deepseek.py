"""bench/make_gguf.py's deepseek2 (DeepSeek V3) files: the presets are DeepSeek V3's config read as transformers
reads it; the names, shapes and keys are what llama.cpp's own converter writes for the same model, the types what its
quantizer gives (attn_k_b's fallback, F32 router); smoke-deepseek's file read back by Strata and run on CPU (chunked
prefill on two slices equals one pass); bench/device_deepseek.sh's steps refused, skipped and run on CPU."""
import dataclasses
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # llama.cpp's converter and tiny models end to end: the CI tier
import torch

from conftest import chained_prefill
from strata.models.args import PRESETS
from strata.weights.checkpoint import load_stage, model_args

ROOT = Path(__file__).resolve().parents[1]

# deepseek-ai/DeepSeek-V3's config.json (R1's is the same shape) at the slice's 8 layers
V3_CONFIG = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
             "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 8,
             "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
             "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
             "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
             "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": True,
             "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
             "rope_theta": 10000, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                                   "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                                   "type": "yarn"},
             "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1}


def _make_gguf():
    spec = importlib.util.spec_from_file_location("make_gguf", ROOT / "bench" / "make_gguf.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["make_gguf"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_presets_are_deepseeks_configs():
    """deepseek-v3-slice is V3's config.json as Strata reads it (transformers' arithmetic: the softmax scale with
    YaRN's mscale_all_dim squared in, the RoPE's magnitude 1), its ids aside; deepseek-v32-slice V3.2's (+ DSA)."""
    from strata.models.families import hf_args
    want = dataclasses.replace(hf_args(V3_CONFIG, "V3"), bos_id=None, eos_id=None)
    assert PRESETS["deepseek-v3-slice"] == want
    v32 = {**V3_CONFIG, "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", "index_topk": 2048,
           "index_n_heads": 64, "index_head_dim": 128}
    assert PRESETS["deepseek-v32-slice"] == dataclasses.replace(hf_args(v32, "V3.2"), bos_id=None, eos_id=None)
    a = PRESETS["deepseek-v3-slice"]
    assert (a.first_dense_layers, a.n_layers, a.kv_rows()) == (3, 8, ((1, 576), (1, 0)))


def test_v3_slice_types_are_llamacpps_quantizers():
    """The real preset's Q4_K_M and IQ3_S plans (nothing written): attn_k_b's rows of 128 take llama.cpp's fallback
    (Q5_0, IQ4_NL), the router, its bias and the norms stay F32, the mix widens the head and every ffn_down (the
    experts' and the shared one's); ~37 GiB in Q4_K_M, ~25 in IQ3_S. V3.2 (deepseek32) is refused."""
    mg = _make_gguf()
    a = PRESETS["deepseek-v3-slice"]
    for qtype, want in (("Q4_K_M", {"attn_k_b": "Q5_0", "attn_v_b": "Q4_K", "attn_q_b": "Q4_K", "token_embd": "Q4_K",
                                    "output": "Q6_K", "ffn_down_exps": "Q6_K", "ffn_down_shexp": "Q6_K",
                                    "ffn_gate_exps": "Q4_K", "ffn_down": "Q6_K", "ffn_gate_inp": "F32",
                                    "exp_probs_b": "F32", "attn_kv_a_norm": "F32"}),
                        ("IQ3_S", {"attn_k_b": "IQ4_NL", "attn_v_b": "IQ3_S", "output": "IQ3_S",
                                   "ffn_down_exps": "IQ3_S", "ffn_gate_inp": "F32"})):
        tensors = mg.plan(a, qtype)
        types = {}
        for t in tensors:
            types.setdefault(t.name.split(".")[-2], set()).add(t.qtype)
        assert {k: types[k] for k in want} == {k: {v} for k, v in want.items()}, qtype
        size = sum(mg.nbytes(t) for t in tensors) / 2**30
        assert (36 < size < 38) if qtype == "Q4_K_M" else (24 < size < 25.5), (qtype, size)
    shapes = {t.name: t.shape for t in mg.plan(a, "Q4_K_M")}
    assert shapes["blk.0.attn_k_b.weight"] == (128, 512, 128) and shapes["blk.0.attn_v_b.weight"] == (128, 128, 512)
    assert shapes["blk.3.ffn_gate_exps.weight"] == (256, 2048, 7168) and "blk.2.ffn_gate_exps.weight" not in shapes
    with pytest.raises(ValueError, match="writes llama, .* not 'deepseek_v32'"):
        mg.plan(PRESETS["deepseek-v32-slice"], "Q4_K_M")
    with pytest.raises(ValueError, match="attn_scale"):
        mg.plan(dataclasses.replace(a, attn_scale=None), "Q4_K_M")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """test_deepseek_gguf's tiny DeepSeek V3 variants and the converter's F32 files of them."""
    from families_fixtures import ConversionError, convert_many, converter_skip_reason
    from test_deepseek_gguf import VARIANTS, make_deepseek
    why = converter_skip_reason()
    if why:
        pytest.skip(why)
    base = tmp_path_factory.mktemp("deepseek-make")
    made = {v: make_deepseek(base, v)[1] for v in VARIANTS}
    files = convert_many([(d, base / f"{v}.gguf") for v, d in made.items()])
    for g in files:
        if isinstance(g, ConversionError):
            raise g
    return {v: (d, g) for (v, d), g in zip(made.items(), files)}


@pytest.mark.parametrize("variant", ["yarn", "yarn-v3", "noqlora"])
def test_names_and_keys_are_the_converters(converted, tmp_path, variant):
    """make_gguf's file of the HF model's args against llama.cpp's convert_hf_to_gguf.py's of the model: the same
    tensor names and shapes (ggml order), and every key the converter writes (but general.*) at its value."""
    from families_fixtures import gguf_summary
    d, g = converted[variant]
    conv = gguf_summary(g)
    mine = tmp_path / "mine.gguf"
    _make_gguf().write(mine, model_args(d), "Q8_0")
    ours = gguf_summary(mine)
    assert ours["arch"] == conv["arch"] == "deepseek2"
    assert {n: s for n, (s, _) in ours["tensors"].items()} == {n: s for n, (s, _) in conv["tensors"].items()}
    mk = {k for k in ours["meta"] if not k.startswith("general.")}
    ck = {k for k in conv["meta"] if not k.startswith("general.")}
    assert mk == ck
    assert {k: ours["meta"][k] for k in ck} == {k: conv["meta"][k] for k in ck}


@pytest.mark.parametrize("qtype", ["Q4_K_M", "IQ3_S"])
def test_file_read_back_and_run(tmp_path, qtype):
    """smoke-deepseek (V3's structure at small widths) written as the device script writes the slice: Strata reads
    the preset's args back (the softmax scale and YaRN's mscale from the keys) and every tensor of a slice; two CPU
    slices (the dense layer, then the MoE ones) prefill in chunks of 13 as in one pass, finite."""
    from strata.weights.gguf_loader import check_tensors, gguf_slice_tensors
    args = PRESETS["smoke-deepseek"]
    out = tmp_path / "ds.gguf"
    _make_gguf().write(out, args, qtype, seed=3)
    got = model_args(str(out))
    diff = {f.name for f in dataclasses.fields(args) if getattr(args, f.name) != getattr(got, f.name)}
    assert diff == {"norm_eps"} and abs(got.norm_eps - args.norm_eps) < 1e-12
    check_tensors(str(out), got, 0, got.n_layers)
    t = gguf_slice_tensors(str(out), got, 1, got.n_layers)
    assert {"layers.1.wkv_b", "layers.1.router_bias", "layers.2.e_down", "layers.2.s_gate", "head"} <= set(t)
    assert tuple(t["layers.1.wkv_b"].shape) == (4 * (64 + 64), 256) and "embed" not in t
    ids = torch.randint(0, args.vocab_size, (1, 45), generator=torch.Generator().manual_seed(4))
    ms = [load_stage(str(out), got, a, b, device="cpu", dtype=torch.float32, max_len=64, max_chunk=45)
          for a, b in ((0, 1), (1, 3))]
    with torch.no_grad():
        chunked = ms[-1].logits(chained_prefill(ms, ids, 13)[0])
        one = ms[-1].logits(chained_prefill(ms, ids, 45)[0])
    assert torch.isfinite(chunked).all() and chunked.std() > 0
    assert ((chunked - one).norm() / one.norm()).item() < 1e-5


def _script(tmp_path, *steps, timeout=60, **env):
    e = {**os.environ, "OUT": str(tmp_path / "out"), "GGUF": str(tmp_path / "none.gguf"), "LL": str(tmp_path / "ll"),
         "PY": sys.executable, **env}
    return subprocess.run(["bash", "bench/device_deepseek.sh", *steps], cwd=ROOT, text=True, capture_output=True,
                          env=e, timeout=timeout)


def test_device_script_steps(tmp_path):
    """bench/device_deepseek.sh: an unknown step is refused (rc 2, naming the steps); steps past DEADLINE are skipped
    by name; llama, strata without the GGUF say so. (No step here touches a GPU.)"""
    r = _script(tmp_path, "bogus")
    assert r.returncode == 2 and "unknown step bogus (setup build gguf llama strata table llama-short" in r.stdout
    r = _script(tmp_path, "gguf", DEADLINE="0")
    assert r.returncode == 0 and "SKIPPED gguf deepseek-v3-slice" in r.stdout, r.stdout + r.stderr
    r = _script(tmp_path, "llama", "strata", "llama-long", "strata-decode")
    assert r.stdout.count("(run the gguf step first)") == 4, r.stdout + r.stderr
    r = _script(tmp_path, "strata-long", "llama-decode", DEADLINE="0", GGUF=__file__)  # (a file: the deadline decides)
    assert "SKIPPED strata prefill 131072: needs ~200 s" in r.stdout, r.stdout + r.stderr
    assert "no llama-bench" in r.stdout and "SKIPPED llama.cpp decode" not in r.stdout, r.stdout + r.stderr


def test_device_script_runs_on_cpu(tmp_path):
    """The script's own commands on CPU at smoke-deepseek's widths (its gguf, strata and table steps with a short
    prompt, no llama.cpp): the file is written, Strata's prefill and decode rows land in $OUT and the table shows
    them, KV bytes per token included."""
    r = _script(tmp_path, "gguf", "strata", "table", timeout=600, PRESET="smoke-deepseek", DEVICE="cpu",
                LENGTHS="96,160", DEPTHS="64", DECODE_TOKENS="4", CHUNK="64", PYTHONPATH=str(ROOT))
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    logs = tmp_path / "out"
    assert (logs / "strata-prefill-96.json").exists() and (logs / "strata-prefill-160.json").exists(), out[-3000:]
    assert (logs / "strata-decode.json").exists(), out[-3000:]
    assert "| prefill 160 |" in out and "| decode after 64 |" in out, out[-3000:]
    per_token = 3 * (256 + 32) * 2  # 3 layers of [latent | roped key] in bfloat16
    assert f"{per_token:,} B" in out, out[-3000:]
