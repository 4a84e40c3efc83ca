"""DeepSeek V3 GGUF files (deepseek2) as llama.cpp's own converter writes them, read by Strata: the args are the
transformers config's, every canonical tensor is the HF model's (kv_b put back from attn_k_b + attn_v_b), and what is
not implemented is refused in one line naming file, key and value."""
import os
from dataclasses import replace

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # llama.cpp's converter and tiny models end to end: the CI tier
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from families_fixtures import SMOLLM2_VOCAB, _perturb  # noqa: E402
from strata.errors import ModelError  # noqa: E402
from strata.models.rope import inv_frequencies  # noqa: E402
from strata.weights.checkpoint import model_args  # noqa: E402
from strata.weights.gguf_files import field_keys, field_value, open_gguf  # noqa: E402
from strata.weights.gguf_loader import check_tensors, gguf_slice_tensors, tensor_facts  # noqa: E402

# DeepSeek V3's shape in small: q through a rank (or directly), a latent of 32 and a shared roped key of 8, value heads
# narrower than q/k's; sigmoid routing in 4 groups (the best 2 kept) with a shared expert, the first layer dense.
# scoring_func / topk_method as DeepSeek's released config.json files spell them: transformers' config keeps them and
# the converter writes scoring_func as expert_gating_func (without it llama.cpp routes by softmax, DeepSeek V2's)
_BASE = dict(vocab_size=SMOLLM2_VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
             num_experts_per_tok=2, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
             first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16,
             v_head_dim=24, max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=False,
             bos_token_id=1, eos_token_id=2, scoring_func="sigmoid", topk_method="noaux_tc")
_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 256,
         "beta_fast": 32.0, "beta_slow": 1.0}
VARIANTS = {
    # DeepSeek V2's mscale (0.707 for both): the softmax scale grows by (0.1 * 0.707 * ln 4 + 1)^2
    "yarn": dict(rope_parameters={**_YARN, "mscale": 0.707, "mscale_all_dim": 0.707}),
    # V3 / R1 / Kimi K2's (1.0 for both), and no renormalization of the chosen experts' weights
    "yarn-v3": dict(rope_parameters={**_YARN, "mscale": 1.0, "mscale_all_dim": 1.0}, norm_topk_prob=False),
    # q_lora_rank null: one q projection (attn_q); plain RoPE; no groups
    "noqlora": dict(q_lora_rank=None, n_group=1, topk_group=1,
                    rope_parameters={"rope_type": "default", "rope_theta": 50000.0}),
}


def make_deepseek(tmp_path, name: str, seed: int = 1):
    """A tiny random float32 DeepseekV3ForCausalLM of VARIANTS[name], its norms, router and choosing bias perturbed
    (families_fixtures' rule), saved under tmp_path: (model, dir as str)."""
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**{**_BASE, **VARIANTS[name]}))
    model = model.to(torch.float32).eval()
    _perturb(model, seed, 0.1)
    out = tmp_path / f"hf-{name}"
    model.save_pretrained(out, safe_serialization=True)
    return model, str(out)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Each variant and its GGUF from convert_hf_to_gguf.py at F32 (SmolLM2's tokenizer), converted in one process."""
    from families_fixtures import ConversionError, convert_many, converter_skip_reason
    why = converter_skip_reason()
    if why:
        pytest.skip(why)
    base = tmp_path_factory.mktemp("deepseek-gguf")
    made = {v: make_deepseek(base, v) for v in VARIANTS}
    files = convert_many([(d, base / f"{v}.gguf") for v, (_, d) in made.items()])
    out = {}
    for (v, (ref, d)), g in zip(made.items(), files):
        if isinstance(g, ConversionError):
            raise g
        out[v] = (ref, d, str(g))
    return out


def test_converter_writes_the_split_kv_b_and_mla_lengths(converted):
    """What the reader relies on, as the converter writes it: kv_b split per head into attn_k_b (transposed) and
    attn_v_b, the absorbed form's key/value lengths beside the *_mla ones, one kv head, attn_q without a q rank."""
    def summary(path):  # (Strata's own index: gguf-py's reader spends seconds on the tokenizer's arrays)
        r = open_gguf(path)
        return {k: field_value(r, k) for k in field_keys(r) if k.startswith("deepseek2.")}, \
            {n: f.shape[::-1] for n, f in tensor_facts(path).items()}

    g = converted["yarn"][2]
    m, t = summary(g)
    assert field_value(open_gguf(g), "general.architecture") == "deepseek2"
    assert (m["deepseek2.attention.key_length"], m["deepseek2.attention.value_length"]) == (32 + 8, 32)
    assert (m["deepseek2.attention.key_length_mla"], m["deepseek2.attention.value_length_mla"]) == (16 + 8, 24)
    assert m["deepseek2.attention.head_count_kv"] == 1 and m["deepseek2.expert_gating_func"] == 2
    assert m["deepseek2.rope.scaling.yarn_log_multiplier"] == pytest.approx(0.0707)
    assert t["blk.0.attn_k_b.weight"] == (16, 32, 4) and t["blk.0.attn_v_b.weight"] == (32, 24, 4)  # (ggml order)
    assert "blk.0.attn_kv_b.weight" not in t
    m, t = summary(converted["noqlora"][2])
    assert "blk.0.attn_q.weight" in t and "deepseek2.attention.q_lora_rank" not in m


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gguf_args_are_the_transformers_config(converted, variant):
    """The file's args against the transformers model itself: MLA's ranks and widths, the heads, the router, the
    softmax scale (transformers' attention.scaling, YaRN's mscale_all_dim folded in twice), the RoPE's frequencies
    and magnitude (its rotary embedding's inv_freq and attention_scaling) over the rope part."""
    ref, _, g = converted[variant]
    c, a = ref.config, model_args(g)
    assert a.arch == "deepseek_v3" and a.rope_interleave
    assert (a.dim, a.n_layers, a.vocab_size, a.ffn_dim) == (c.hidden_size, c.num_hidden_layers, c.vocab_size,
                                                            c.intermediate_size)
    assert (a.n_heads, a.n_kv_heads, a.head_dim) == (c.num_attention_heads, c.num_attention_heads, c.qk_head_dim)
    assert (a.kv_lora_rank, a.q_lora_rank, a.qk_rope_dim, a.v_head_dim) == (c.kv_lora_rank, c.q_lora_rank or 0,
                                                                            c.qk_rope_head_dim, c.v_head_dim)
    assert (a.n_experts, a.n_experts_used, a.expert_ffn_dim, a.shared_ffn_dim) == (
        c.n_routed_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.moe_intermediate_size * c.n_shared_experts)
    assert (a.router, a.router_groups, a.router_groups_used, a.router_renorm, a.first_dense_layers) == (
        "sigmoid", c.n_group, c.topk_group, c.norm_topk_prob, c.first_k_dense_replace)
    assert a.routed_scale == pytest.approx(c.routed_scaling_factor, rel=1e-6)
    assert a.norm_eps == pytest.approx(c.rms_norm_eps, rel=1e-6)
    assert a.attn_scale == pytest.approx(ref.model.layers[0].self_attn.scaling, rel=1e-6)
    rot = ref.model.rotary_emb
    inv, att = inv_frequencies(a.qk_rope_dim, a.rope_theta, a.rope_scaling)
    torch.testing.assert_close(inv.float(), rot.inv_freq.float(), rtol=1e-6, atol=0)
    assert att == pytest.approx(rot.attention_scaling, rel=1e-6)
    if variant.startswith("yarn"):  # the HF dict's mscale values, recovered from the file's 0.1 x mscale_all_dim
        rp = c.rope_parameters
        assert (a.rope_scaling["mscale"], a.rope_scaling["mscale_all_dim"]) == (rp["mscale"], rp["mscale_all_dim"])
        assert a.attn_scale != pytest.approx(a.head_dim ** -0.5)  # (the YaRN factor matters here)
    else:
        assert a.rope_scaling is None


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gguf_tensors_are_the_hf_models(converted, variant):
    """Every canonical tensor read from the file equals the HF model's own (float32: bit for bit): wkv_b is kv_b_proj
    put back together from attn_k_b and attn_v_b; the experts transformers holds fused are compared per part."""
    ref, _, g = converted[variant]
    a = model_args(g)
    check_tensors(g, a, 0, a.n_layers)
    got = gguf_slice_tensors(g, a, 0, a.n_layers)
    sd = ref.state_dict()
    effn = a.expert_ffn_dim
    attn = {"wq": "q_proj", "wq_a": "q_a_proj", "wq_b": "q_b_proj", "q_a_norm": "q_a_layernorm",
            "wkv_a": "kv_a_proj_with_mqa", "kv_a_norm": "kv_a_layernorm", "wkv_b": "kv_b_proj", "wo": "o_proj"}
    mlp = {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj", "router": "gate",
           "s_gate": "shared_experts.gate_proj", "s_up": "shared_experts.up_proj", "s_down": "shared_experts.down_proj"}

    def hf(canon):
        if canon in ("embed", "norm", "head"):
            return sd[{"embed": "model.embed_tokens.weight", "norm": "model.norm.weight", "head": "lm_head.weight"}[canon]]
        _, i, s = canon.split(".")
        p = f"model.layers.{i}."
        if s in ("attn_norm", "mlp_norm"):
            return sd[p + ("input_layernorm" if s == "attn_norm" else "post_attention_layernorm") + ".weight"]
        if s in attn:
            return sd[p + f"self_attn.{attn[s]}.weight"]
        if s in mlp:
            return sd[p + f"mlp.{mlp[s]}.weight"]
        if s == "router_bias":
            return sd[p + "mlp.gate.e_score_correction_bias"]
        gate_up, down = sd[p + "mlp.experts.gate_up_proj"], sd[p + "mlp.experts.down_proj"]
        return {"e_gate": gate_up[:, :effn], "e_up": gate_up[:, effn:], "e_down": down}[s]

    assert {c.split(".")[-1] for c in got} >= {"wkv_b", "wkv_a", "kv_a_norm", "router_bias", "e_gate", "s_up"}
    for canon, t in got.items():
        assert torch.equal(t, hf(canon)), canon


# -- what is refused ------------------------------------------------------------------------------------------
def _rewrite(parts, dst, drop=(), keys=None, tensors=None) -> str:
    """test_families.gguf_parts' file written to dst without the metadata keys `drop`, with `keys` set ({name:
    (value, GGUFValueType[, item type])}) and `tensors` added ({name: numpy array, rows first})."""
    from test_families import write_gguf
    arch, meta, ts = parts
    return write_gguf(dst, (arch, [m for m in meta if m[0] not in drop], ts), keys=keys or {}, tensors=tensors or {})


def test_what_deepseek2_refuses(converted, tmp_path):
    """Each refused in one line naming the file and the key (and its value): a key the reader does not know (Mistral
    Large's attention temperature), softmax routing (DeepSeek V2's; an absent expert_gating_func means it to
    llama.cpp), a per-layer expert width, absorbed-form lengths that do not fit the ranks, the legacy whole-kv_b
    layout, YaRN without its log multiplier (llama.cpp would square the YaRN factor into the scale, transformers
    not), linear scaling, a tensor no layer reads."""
    from families_fixtures import import_gguf
    from test_families import gguf_parts
    T = import_gguf().GGUFValueType
    g = converted["yarn"][2]
    parts = gguf_parts(g)
    cases = [  # (keys to drop, keys to set, tensors to add, what the line says)
        ((), {"deepseek2.attention.temperature_scale": (0.1, T.FLOAT32)}, {},
         "GGUF key deepseek2.attention.temperature_scale = 0.1"),
        ((), {"deepseek2.expert_gating_func": (1, T.UINT32)}, {}, "deepseek2.expert_gating_func = 1 is not implemented"),
        (("deepseek2.expert_gating_func",), {}, {}, "lacks deepseek2.expert_gating_func"),
        ((), {"deepseek2.expert_feed_forward_length": ([32, 32, 32], T.ARRAY, T.UINT32)}, {},
         "deepseek2.expert_feed_forward_length = [32, 32, 32] (a value per layer) is not implemented"),
        ((), {"deepseek2.attention.key_length": (24, T.UINT32)}, {},
         "deepseek2.attention.key_length = 24 is not kv_lora_rank + rope.dimension_count"),
        (("deepseek2.attention.key_length_mla", "deepseek2.attention.value_length_mla"), {}, {}, "kv_b whole"),
        ((), {}, {"blk.1.attn_kv_b.weight": np.zeros((160, 32), np.float32)}, "kv_b whole"),
        (("deepseek2.rope.scaling.yarn_log_multiplier",), {}, {}, "YaRN without GGUF key"),
        ((), {"deepseek2.rope.scaling.type": ("linear", T.STRING)}, {}, "deepseek2.rope.scaling.type = 'linear'"),
        ((), {}, {"blk.1.attn_q_norm.weight": np.ones(24, np.float32)}, "tensor blk.1.attn_q_norm.weight"),
    ]
    for i, (drop, keys, tensors, expect) in enumerate(cases):
        bad = _rewrite(parts, tmp_path / f"bad{i}.gguf", drop, keys, tensors)
        with pytest.raises(ModelError) as e:
            model_args(bad)
        line = str(e.value)
        assert "\n" not in line and bad in line and expect in line, (i, line)
    # the copy with nothing changed (and no tokenizer: no bos / eos) reads as the original
    a = model_args(g)
    assert model_args(_rewrite(parts, tmp_path / "same.gguf")) == replace(a, bos_id=None, eos_id=None)


# -- end to end -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gguf_logits_match_transformers(converted, variant):
    """The converter's file on 3 slices split mid-model (the dense layer, then one MoE layer each), prefill in
    chunks that cut the prompt unevenly: the last logits, every position's and the NLL within 1e-4 of transformers'
    (float32), and the greedy tokens after."""
    from test_families import PROMPT, check_against
    ref, _, g = converted[variant]
    ids = torch.randint(0, ref.config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(7))
    check_against(ref, g, ids, model_args(g).n_layers)


def test_a_split_copy_is_read_as_the_file(converted, tmp_path):
    """The converter's V3 file in three parts as gguf-split writes them, named by its first part: the same args and
    bit-identical logits through 3 slices as the file itself, and transformers' within 1e-4 (check_against)."""
    from pathlib import Path
    from conftest import chained_prefill
    from test_families import CHUNK, PROMPT, check_against, load_slices, three_way
    from test_gguf_split import split_gguf
    ref, _, g = converted["yarn"]
    n = len(tensor_facts(g))
    parts = split_gguf(Path(g), tmp_path, per_part=-(-n // 3))
    assert len(parts) == 3 and parts[0].name.endswith("-00001-of-00003.gguf")
    first = str(parts[0])
    assert model_args(first) == model_args(g)
    ids = torch.randint(0, ref.config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(7))
    n_layers = model_args(g).n_layers

    def logits(model):
        slices = load_slices(model, three_way(n_layers), PROMPT + 8)
        return slices[-1].logits(chained_prefill(slices, ids, CHUNK)[0])

    assert torch.equal(logits(first), logits(g))
    check_against(ref, first, ids, n_layers)


def test_quantized_projections_held_resident_equal_their_dense_load(converted, tmp_path):
    """The converter's V3 file with its 2-D matrices of whole blocks in Q8_0 (gguf-py's quantizer), read resident
    (MLA's q_a, kv_a and o as blocks, dequantized into the scratch for a chunk; the experts as blocks) and read dequantized
    (dense): the same prefill logits bit for bit, and decode steps after within float32 rounding (the CPU's decode
    dequantizes too)."""
    from families_fixtures import import_gguf
    from conftest import chained_prefill
    from test_families import CHUNK, PROMPT, gguf_parts, three_way
    from strata.models.mla import LatentMatrix
    from strata.models.model import Transformer
    gguf = import_gguf()
    ref, _, g = converted["yarn"]
    arch, meta, ts = gguf_parts(g)
    q8, out_ts = [], []
    for name, a in ts:  # (the per-head attn_k_b / attn_v_b and the router stay F32, as a quantizer keeps them)
        if a.ndim == 2 and a.shape[-1] % 32 == 0 and not any(k in name for k in ("norm", "_b.", "gate_inp")):
            a = gguf.quants.quantize(a.astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
            q8.append(name)
        out_ts.append((name, a))
    ts = out_ts
    path = tmp_path / "q8.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    for k, v, t, sub in meta:
        w.add_key_value(k, v, t, sub)
    for name, a in ts:
        w.add_tensor(name, a, raw_dtype=gguf.GGMLQuantizationType.Q8_0 if name in q8 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert any("attn_q_a." in n for n in q8) and any("attn_output" in n for n in q8)  # (q_b's 48 columns: F32)
    args = model_args(str(path))
    ids = torch.randint(0, ref.config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(7))
    out = {}
    for resident in (True, False):
        slices = []
        for s, e in three_way(args.n_layers):
            t = Transformer(args, s, e)
            t.load_weights(gguf_slice_tensors(str(path), args, s, e, resident=resident), "cpu", torch.float32)
            t.setup_cache(PROMPT + 4, max_chunk=CHUNK)
            slices.append(t)
        mats = [b.attn.wq_a for t in slices for b in t.layers.values()]
        assert all(isinstance(m, LatentMatrix) and m.resident == resident for m in mats)
        h = chained_prefill(slices, ids, CHUNK)
        x = torch.tensor([[5]])
        for t in slices:
            x = t(x, PROMPT)
        out[resident] = (slices[-1].logits(h[0]), slices[-1].logits(x[0, -1]))
    assert torch.equal(out[True][0], out[False][0])
    assert (out[True][1] - out[False][1]).abs().max() < 1e-4 * out[False][1].abs().max()
