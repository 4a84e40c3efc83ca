"""GGUF loading and tokenization against transformers' own GGUF reader (SmolLM2-135M, CPU)."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import inspect
import math
import random
import typing

import gguf
import numpy as np
import pytest
import torch

from strata.weights import checkpoint
from strata.weights.gguf_loader import gguf_model_args, gguf_slice_tensors
from strata.models.model import Transformer
from strata.text.tokenizer import Tokenizer
from strata.weights.checkpoint import ModelError

transformers = pytest.importorskip("transformers")

PROMPT_LEN = 600
CHUNK = 128
N_GEN = 8
SLICES = [(0, 10), (10, 20), (20, 30)]

TEXTS = [
    "Hello world",
    "The capital of France is",
    "  leading spaces\n\n\ttabs   and   runs    \n",
    "x = 12345 + 3.14159e-10; y=0xFF  # 2024-01-31",
    "héllo wörld \u2014 ünïcödé \u2713 日本語のテキスト 🚀🎉 emoji \u00a0nbsp",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "don't I'll we've HE'S they'RE",
    "\r\n\r\n   \n\n\n\n        return None\n",
    "",
    " ",
    "a" * 200,
]


# -- fixtures ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gguf_path():
    try:
        return checkpoint.smollm2_path()
    except ModelError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def typing_source():
    return inspect.getsource(typing)


@pytest.fixture(scope="module")
def ref_tok(gguf_path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


@pytest.fixture(scope="module")
def tok(gguf_path):
    return Tokenizer.for_model("smollm2")


@pytest.fixture(scope="module")
def ref_model(gguf_path):
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)
    return m.eval()


@pytest.fixture(scope="module")
def args(gguf_path):
    return checkpoint.model_args("smollm2")


@pytest.fixture(scope="module")
def engine(args):
    m = Transformer(args)
    m.load_weights(checkpoint.slice_tensors("smollm2", args, 0, args.n_layers), "cpu", torch.float32)
    return m


@pytest.fixture(scope="module")
def prompt(tok, typing_source):
    ids = tok.encode(typing_source)
    assert len(ids) >= PROMPT_LEN
    return torch.tensor([ids[:PROMPT_LEN]])


def prefill(stages, ids, chunk=CHUNK, extra=0):
    """Run the prompt through the slices in chunks; returns the last slice's residual (1, T, dim)."""
    for s in stages:
        s.setup_cache(ids.shape[1] + extra)
    out = []
    for pos in range(0, ids.shape[1], chunk):
        x = ids[:, pos:pos + chunk]
        for s in stages:
            x = s.forward(x, pos)
        out.append(x)
    return torch.cat(out, dim=1)


@pytest.fixture(scope="module")
def engine_logits(engine, prompt):
    return engine.logits(prefill([engine], prompt))[0]


@pytest.fixture(scope="module")
def ref_logits(ref_model, prompt):
    with torch.no_grad():
        return ref_model(prompt).logits[0].float()


# -- tokenizer -----------------------------------------------------------------------------------
@pytest.mark.parametrize("i", range(len(TEXTS)))
def test_token_ids_match_transformers(tok, ref_tok, i):
    text = TEXTS[i]
    assert tok.encode(text) == ref_tok(text).input_ids


@pytest.fixture(scope="module")
def orig_tok(ref_tok):
    """transformers' GGUF tokenizer with SmolLM2's original pre-tokenizer (Digits, then ByteLevel).

    tokenizer.ggml.pre = 'smollm' means: split every digit off, then apply the GPT-2 regex (llama.cpp's
    llama-vocab.cpp; SmolLM2's own tokenizer.json does the same with a Digits pre-tokenizer).
    transformers' GGUF converter ignores 'smollm' and applies the GPT-2 regex alone. The two differ
    only where a run of whitespace precedes a digit (newline + 4 spaces + "1" in a docstring: the
    GPT-2 regex alone leaves the last space to join the digit's chunk); we follow llama.cpp.
    """
    from tokenizers import pre_tokenizers
    fixed = ref_tok.backend_tokenizer.__class__.from_str(ref_tok.backend_tokenizer.to_str())
    fixed.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return lambda text: fixed.encode(text, add_special_tokens=False).ids


def test_typing_source_ids_match_transformers(tok, ref_tok, orig_tok, typing_source):
    head = typing_source[:20000]  # no whitespace run before a digit here
    assert tok.encode(head) == ref_tok(head).input_ids
    for chunk in (typing_source[:60000], typing_source[-8000:]):
        assert tok.encode(chunk) == orig_tok(chunk)


def test_decode_round_trips(tok, ref_tok, typing_source):
    for text in TEXTS + [typing_source[:20000]]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert tok.decode(ids) == ref_tok.decode(ids)


def test_smollm_pre_tokenizer_isolates_digits(tok, ref_tok, orig_tok):
    rng = random.Random(0)
    pool = [lambda: chr(rng.randint(32, 126)), lambda: chr(rng.randint(0xA0, 0x2FFF)), lambda: " ",
            lambda: "\n", lambda: str(rng.randint(0, 9)), lambda: "  "]
    for _ in range(20):
        text = "".join(rng.choice(pool)() for _ in range(400))
        assert tok.encode(text) == orig_tok(text)
        assert tok.decode(tok.encode(text)) == text
    # the known divergence from transformers' GGUF tokenizer: a whitespace run, then a digit
    assert tok.encode("x\n  2") == orig_tok("x\n  2") != ref_tok("x\n  2").input_ids
    assert tok.encode("x 2") == ref_tok("x 2").input_ids  # one space: identical either way


def test_tokenizer_attributes(tok, args):
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (1, 2, 49152) == (args.bos_id, args.eos_id, args.vocab_size)
    ids = tok.encode("Hi")
    assert ids[0] != tok.bos_id  # SmolLM2's GGUF says add_bos_token = false
    assert tok.encode("Hi", add_bos=True) == [tok.bos_id] + ids
    assert tok.encode("<|im_end|>") == [2]  # control tokens stay whole


def test_tokenizer_from_hf_dir(ref_tok, tok, tmp_path, typing_source):
    ref_tok.save_pretrained(str(tmp_path))
    hf = Tokenizer.from_hf_dir(tmp_path)
    text = typing_source[:5000] + TEXTS[4] + TEXTS[5]
    assert hf.encode(text) == tok.encode(text)
    assert (hf.bos_id, hf.eos_id) == (1, 2)
    assert hf.decode(hf.encode(text)) == text


def test_synthetic_model_has_no_tokenizer():
    with pytest.raises(ModelError, match="ids|random"):
        Tokenizer.for_model("synthetic:smoke")


def _spm_gguf(path, source: str):
    """A small sentencepiece-style ('llama') vocabulary: byte tokens, characters, frequent substrings."""
    import collections
    import re
    counts = collections.Counter()
    for word, n in collections.Counter(re.findall(r"\w+", source)).items():
        w = "\u2581" + word
        for i in range(len(w)):
            for j in range(i + 2, min(len(w), i + 8) + 1):
                counts[w[i:j]] += n
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0] * len(tokens)
    for c in sorted(set(source.replace(" ", "\u2581").replace("\n", ""))):
        if c not in tokens:
            tokens.append(c), types.append(1), scores.append(-1000.0)
    have = set(tokens)
    for rank, (piece, _) in enumerate(counts.most_common(600)):
        if piece not in have:
            tokens.append(piece), types.append(1), scores.append(-float(rank))
            have.add(piece)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("llama.block_count", 1)
    w.add_string("tokenizer.ggml.model", "llama")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.scores", scores)
    w.add_array("tokenizer.ggml.token_type", types)
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    w.add_uint32("tokenizer.ggml.unknown_token_id", 0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_sentencepiece_gguf_tokenizer_matches_transformers(tmp_path, typing_source):
    from transformers import AutoTokenizer
    _spm_gguf(tmp_path / "spm.gguf", typing_source[:20000])
    ours = Tokenizer.from_gguf(tmp_path / "spm.gguf")
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    for text in TEXTS + [typing_source[:3000], "<s>hi</s> there"]:
        assert ours.encode(text) == ref(text).input_ids, text
        assert ours.encode(text)[0] == 1  # llama.cpp adds BOS to sentencepiece vocabularies by default
        if "<s>" not in text and not text[:1].isspace():  # Metaspace adds no prefix to a leading space
            assert ours.decode(ours.encode(text, add_bos=False)) == text


# -- model ---------------------------------------------------------------------------------------
def test_model_args(args):
    assert (args.arch, args.n_layers, args.dim, args.n_heads, args.n_kv_heads, args.head_dim, args.ffn_dim) == \
        ("llama", 30, 576, 9, 3, 64, 1536)
    assert args.rope_theta == 100000.0 and args.rope_scaling is None
    assert args.tie_embeddings and not args.qkv_bias and args.max_seq_len == 8192
    assert math.isclose(args.norm_eps, 1e-5, rel_tol=1e-6)


@pytest.mark.slow
def test_weights_equal_transformers_dequantization(args, ref_model):
    t = checkpoint.slice_tensors("smollm2", args, 7, 8)
    layer = ref_model.model.layers[7]
    for ours, theirs in [("wq", layer.self_attn.q_proj), ("wk", layer.self_attn.k_proj),
                         ("wv", layer.self_attn.v_proj), ("wo", layer.self_attn.o_proj),
                         ("w_gate", layer.mlp.gate_proj), ("w_up", layer.mlp.up_proj), ("w_down", layer.mlp.down_proj)]:
        assert torch.equal(t[f"layers.7.{ours}"], theirs.weight.detach()), ours
    assert set(t) == set(checkpoint.wanted_names(args, 7, 8))


@pytest.mark.slow
def test_prefill_logits_match_transformers(engine_logits, ref_logits, prompt):
    assert engine_logits.shape == ref_logits.shape == (prompt.shape[1], 49152)
    diff = engine_logits - ref_logits
    rel = (diff.norm() / ref_logits.norm()).item()
    print(f"relative error {rel:.3g}, max abs diff {diff.abs().max().item():.3g}")
    assert rel < 1e-3
    assert diff.abs().max().item() < 1e-2 * ref_logits.abs().max().item()
    assert (engine_logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item() > 0.99


def greedy(stages, ids, n):
    h = prefill(stages, ids, extra=n)
    nxt, out, pos = int(stages[-1].logits(h[:, -1])[0].argmax()), [], ids.shape[1]
    for _ in range(n):
        out.append(nxt)
        x = torch.tensor([[nxt]])
        for s in stages:
            x = s.forward(x, pos)
        pos += 1
        nxt = int(stages[-1].logits(x[:, -1])[0].argmax())
    return out


@pytest.fixture(scope="module")
def engine_greedy(engine, prompt):
    return greedy([engine], prompt, N_GEN)


@pytest.mark.slow
def test_greedy_continuation_matches_transformers(engine_greedy, ref_model, prompt):
    ours = engine_greedy
    with torch.no_grad():
        theirs = ref_model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=N_GEN,
                                    do_sample=False, pad_token_id=2)[0, prompt.shape[1]:].tolist()
    assert ours == theirs


def test_capital_of_france(engine, tok):
    ids = torch.tensor([tok.encode("The capital of France is")])
    out = greedy([engine], ids, 4)
    assert tok.decode(out).startswith(" Paris")


@pytest.mark.slow
def test_three_slices_equal_single_slice_bitwise(args, engine_logits, engine_greedy, prompt):
    stages = []
    for a, b in SLICES:
        s = Transformer(args, a, b)
        t = checkpoint.slice_tensors("smollm2", args, a, b)
        assert set(t) == set(checkpoint.wanted_names(args, a, b))
        s.load_weights(t, "cpu", torch.float32)
        stages.append(s)
    assert "embed" in checkpoint.wanted_names(args, 20, 30)  # tied head on a last slice that is not first
    logits = stages[-1].logits(prefill(stages, prompt))[0]
    assert torch.equal(logits, engine_logits)
    assert greedy(stages, prompt, N_GEN) == engine_greedy


# -- tiny synthetic GGUFs: qwen2 (biases, no q/k permutation) and llama, several tensor types ----
def _llama_cpp_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The q/k row order llama.cpp's converter writes for llama: rotary pairs interleaved."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _write_gguf(path, arch, model, qtype, extra=None):
    c, sd = model.config, model.state_dict()
    w = gguf.GGUFWriter(str(path), arch)
    for key, val in [("block_count", c.num_hidden_layers), ("context_length", c.max_position_embeddings),
                     ("embedding_length", c.hidden_size), ("feed_forward_length", c.intermediate_size),
                     ("attention.head_count", c.num_attention_heads),
                     ("attention.head_count_kv", c.num_key_value_heads), ("vocab_size", c.vocab_size)]:
        w.add_uint32(f"{arch}.{key}", val)
    w.add_float32(f"{arch}.rope.freq_base", c.rope_parameters["rope_theta"])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    for key, val in (extra or {}).items():
        w.add_key_value(key, val[0], val[1])

    def put(name, t):
        a = t.detach().float().numpy()
        if a.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, a)
        elif qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, a.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)

    put("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(c.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        q, k = sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.k_proj.weight"]
        if arch == "llama":
            q, k = _llama_cpp_permute(q, c.num_attention_heads), _llama_cpp_permute(k, c.num_key_value_heads)
        put(b + "attn_norm.weight", sd[p + "input_layernorm.weight"])
        put(b + "attn_q.weight", q)
        put(b + "attn_k.weight", k)
        put(b + "attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        if arch == "qwen2":
            for n in "qkv":
                put(b + f"attn_{n}.bias", sd[p + f"self_attn.{n}_proj.bias"])
        put(b + "attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        put(b + "ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        put(b + "ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        put(b + "ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        put(b + "ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    put("output_norm.weight", sd["model.norm.weight"])
    if not c.tie_word_embeddings:
        put("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _tiny_hf(arch, tie):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=tie)
    torch.manual_seed(0)
    if arch == "qwen2":
        m = Qwen2ForCausalLM(Qwen2Config(**kw, rope_theta=10000.0))
    else:
        m = LlamaForCausalLM(LlamaConfig(**kw, rope_theta=50000.0))
    for p in m.parameters():
        p.data.normal_(0, 0.2)
    return m.eval()


@pytest.mark.parametrize("arch,qtype,tie", [("qwen2", "F32", False), ("qwen2", "Q8_0", True),
                                            ("llama", "F16", True), ("llama", "Q4_1", False)])
def test_tiny_gguf_matches_transformers(tmp_path, arch, qtype, tie):
    from transformers import AutoModelForCausalLM
    hf = _tiny_hf(arch, tie)
    _write_gguf(tmp_path / "tiny.gguf", arch, hf, gguf.GGMLQuantizationType[qtype])
    args = gguf_model_args(tmp_path / "tiny.gguf")
    assert (args.arch, args.qkv_bias, args.tie_embeddings, args.n_layers) == (arch, arch == "qwen2", tie, 3)
    ids = torch.randint(0, 256, (1, 50), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf", dtype=torch.float32).eval()
        want = ref(ids).logits[0]
        orig = hf(ids).logits[0]
    stages = []
    for a, b in [(0, 1), (1, 3)]:
        s = Transformer(args, a, b)
        s.load_weights(gguf_slice_tensors(tmp_path / "tiny.gguf", args, a, b), "cpu", torch.float32)
        stages.append(s)
    got = stages[-1].logits(prefill(stages, ids, chunk=16))[0]
    assert ((got - want).norm() / want.norm()).item() < 1e-5
    if qtype == "F32":
        assert ((got - orig).norm() / orig.norm()).item() < 1e-5


def _llama3_divisors(theta, head_dim, factor, lo, hi, old):
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old / hi:
            out.append(1.0)
        elif wavelen > old / lo:
            out.append(factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _meta_only_gguf(path, arch="llama", kv=None, tensors=None):
    w = gguf.GGUFWriter(str(path), arch)
    for key, val in [("block_count", 2), ("embedding_length", 256), ("feed_forward_length", 512),
                     ("attention.head_count", 2), ("attention.head_count_kv", 2), ("vocab_size", 100)]:
        w.add_uint32(f"{arch}.{key}", val)
    w.add_float32(f"{arch}.rope.freq_base", 500000.0)
    for key, (val, vtype) in (kv or {}).items():
        w.add_key_value(key, val, vtype)
    for name, arr in (tensors or {}).items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_llama3_rope_scaling_recognised_from_rope_freqs(tmp_path):
    div = _llama3_divisors(500000.0, 128, 8.0, 1.0, 4.0, 8192)
    p = _meta_only_gguf(tmp_path / "l3.gguf", tensors={"rope_freqs.weight": div})
    assert gguf_model_args(p).rope_scaling == dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                  original_max_position_embeddings=8192)
    p = _meta_only_gguf(tmp_path / "odd.gguf", tensors={"rope_freqs.weight": np.linspace(1, 3, 64, dtype=np.float32)})
    with pytest.raises(ModelError, match="unsupported rope scaling"):
        gguf_model_args(p)
    p = _meta_only_gguf(tmp_path / "yarn.gguf", kv={"llama.rope.scaling.type": ("yarn", gguf.GGUFValueType.STRING),
                                                    "llama.rope.scaling.factor": (4.0, gguf.GGUFValueType.FLOAT32)})
    with pytest.raises(ModelError, match="yarn rope scaling lacks GGUF key llama.rope.scaling.original_context_length"):
        gguf_model_args(p)  # YaRN is read (strata.models.rope), but not without the length it scales from
    p = _meta_only_gguf(tmp_path / "yarn2.gguf", kv={"llama.rope.scaling.type": ("yarn", gguf.GGUFValueType.STRING),
                                                     "llama.rope.scaling.factor": (4.0, gguf.GGUFValueType.FLOAT32),
                                                     "llama.rope.scaling.original_context_length":
                                                         (2048, gguf.GGUFValueType.UINT32)})
    sc = gguf_model_args(p).rope_scaling
    assert (sc["rope_type"], sc["factor"], sc["original_max_position_embeddings"]) == ("yarn", 4.0, 2048)


@pytest.mark.parametrize("ctx,factor,orig,want", [(40960, 4.0, 32768, 131072), (2048, 4.0, 2048, 8192),
                                                  (131072, 32.0, 4096, 131072), (200000, 4.0, 32768, 200000)])
def test_yarn_file_takes_the_stretched_context(tmp_path, ctx, factor, orig, want):
    """llama.cpp's converter writes max_position_embeddings as context_length: a Qwen3 with its model card's YaRN
    (x4 over 32,768; max_position_embeddings 40,960) takes 131,072 positions, gpt-oss (32 x 4,096) its 131,072."""
    p = _meta_only_gguf(tmp_path / "y.gguf", kv={"llama.context_length": (ctx, gguf.GGUFValueType.UINT32),
                                                 "llama.rope.scaling.type": ("yarn", gguf.GGUFValueType.STRING),
                                                 "llama.rope.scaling.factor": (factor, gguf.GGUFValueType.FLOAT32),
                                                 "llama.rope.scaling.original_context_length":
                                                     (orig, gguf.GGUFValueType.UINT32)})
    assert gguf_model_args(p).max_seq_len == want
    p = _meta_only_gguf(tmp_path / "n.gguf", kv={"llama.context_length": (ctx, gguf.GGUFValueType.UINT32)})
    assert gguf_model_args(p).max_seq_len == ctx  # no YaRN: the file's own length


# -- bad inputs ----------------------------------------------------------------------------------
@pytest.mark.parametrize("cut", ["half", "tail", "header"])
def test_truncated_gguf(gguf_path, tmp_path, cut):
    size = gguf_path.stat().st_size
    keep = {"half": size // 2, "tail": size - 1000, "header": 4096}[cut]
    bad = tmp_path / f"cut-{cut}.gguf"
    with open(gguf_path, "rb") as src, open(bad, "wb") as dst:
        dst.write(src.read(keep))
    with pytest.raises(ModelError, match=str(bad.name)) as e:
        checkpoint.model_args(str(bad))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("head", [b"", b"GGUF"])
def test_garbage_gguf(tmp_path, head):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(head + bytes(random.Random(0).randrange(256) for _ in range(100000)))
    with pytest.raises(ModelError, match="x.gguf") as e:
        checkpoint.model_args(str(bad))
    assert "\n" not in str(e.value)
    with pytest.raises(ModelError, match="x.gguf"):
        Tokenizer.from_gguf(bad)


def test_unsupported_architecture(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    w.add_uint32("gpt2.block_count", 2)
    w.add_tensor("token_embd.weight", np.zeros((10, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelError, match="unsupported architecture 'gpt2'"):
        checkpoint.model_args(str(tmp_path / "gpt2.gguf"))


def test_unsupported_tensor_type(tmp_path):
    hf = _tiny_hf("llama", True)
    _write_gguf(tmp_path / "t.gguf", "llama", hf, gguf.GGMLQuantizationType.F32)
    r = gguf.GGUFReader(tmp_path / "t.gguf")
    # rewrite with one weight stored as I8, which gguf-py cannot dequantize
    w = gguf.GGUFWriter(str(tmp_path / "i8.gguf"), "llama")
    for f in r.fields.values():
        if f.name.startswith("llama.") and f.name != "general.architecture":
            w.add_key_value(f.name, f.contents(), f.types[0])
    for t in r.tensors:
        arr = np.array(t.data).reshape(tuple(reversed(t.shape.tolist())))
        w.add_tensor(t.name, arr.astype(np.int8) if t.name == "blk.1.ffn_up.weight" else arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    args = gguf_model_args(tmp_path / "i8.gguf")
    gguf_slice_tensors(tmp_path / "i8.gguf", args, 0, 1)  # layer 0 is fine
    with pytest.raises(ModelError, match=r"blk\.1\.ffn_up\.weight.*I8"):
        gguf_slice_tensors(tmp_path / "i8.gguf", args, 1, 3)


def test_layer_range_outside_model(args, gguf_path):
    for a, b in [(25, 31), (-1, 3), (5, 5), (30, 31)]:
        with pytest.raises((ModelError, ValueError)):
            checkpoint.slice_tensors("smollm2", args, a, b)
        with pytest.raises((ModelError, ValueError)):
            gguf_slice_tensors(gguf_path, args, a, b)


def test_missing_file(tmp_path):
    with pytest.raises(ModelError, match="nope.gguf"):
        gguf_model_args(tmp_path / "nope.gguf")
