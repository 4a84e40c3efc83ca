"""Resident quantized weights vs dequantized ones, KV dtypes, bytes as stored, quantized synthetic models, bad GGUFs."""
import hashlib
import inspect
import math
import typing

import gguf
import numpy as np
import pytest
import torch

from conftest import chained_prefill
from strata import quant
from strata.weights import checkpoint
from strata.models import model as M
from strata.models import resident
from strata.models.args import PRESETS
from strata.kernels.attention import to_cache
from strata.weights.checkpoint import check_model_files, load_stage, model_args, stage_bytes, weights_mode
from strata.errors import ModelError
from strata.text.tokenizer import Tokenizer

SLICES = [(0, 15), (15, 30)]
CHUNK, N_TOKENS, N_GEN = 64, 300, 6


@pytest.fixture(scope="module")
def args():
    try:
        checkpoint.smollm2_path()
    except ModelError as e:
        pytest.skip(str(e))
    return model_args("smollm2")


@pytest.fixture(scope="module")
def typing_ids():
    return Tokenizer.for_model("smollm2").encode(inspect.getsource(typing))


def stages(args, mode, max_len, kv="auto", bounds=SLICES):
    return [load_stage("smollm2", args, a, b, device="cpu", dtype=torch.float32, weights=mode, kv_dtype=kv,
                       max_len=max_len) for a, b in bounds]


def prefill(slices, ids, chunk=CHUNK):
    """Chunked prefill through chained slices: the last slice's residual (1, T, dim)."""
    return chained_prefill(slices, ids, chunk)


def greedy(slices, h, pos, n):
    nxt, out = int(slices[-1].logits(h[0, -1]).argmax()), []
    for _ in range(n):
        out.append(nxt)
        x = torch.tensor([[nxt]])
        for s in slices:
            x = s(x, pos)
        pos += 1
        nxt = int(slices[-1].logits(x[0, -1]).argmax())
    return out


def run(args, mode, ids, kv="auto"):
    slices = stages(args, mode, ids.shape[1] + N_GEN, kv)
    h = prefill(slices, ids)
    nll, n = slices[-1].nll(h[:, :-1], ids[0, 1:])
    return slices, hashlib.md5(h.numpy().tobytes()).hexdigest(), math.exp(nll / n), greedy(slices, h, ids.shape[1], N_GEN)


def test_auto_mode():
    # resident only where it pays: quantized tensors on CUDA
    assert weights_mode("smollm2", "cpu") == "dequantized"
    assert weights_mode("smollm2", "cuda") == "resident"
    assert weights_mode("synthetic:smoke", "cuda") == "dequantized"
    assert weights_mode("smollm2", "cpu", "resident") == "resident"
    with pytest.raises(ModelError, match="unknown weights mode"):
        weights_mode("smollm2", "cpu", "packed")


@pytest.mark.slow
def test_resident_equals_dequantized_on_cpu(args, typing_ids):
    ids = torch.tensor([typing_ids[:N_TOKENS]])
    res, md5_r, ppl_r, gen_r = run(args, "resident", ids)
    deq, md5_d, ppl_d, gen_d = run(args, "dequantized", ids)
    print(f"md5 {md5_r} / {md5_d}, perplexity {ppl_r:.6f} / {ppl_d:.6f}, greedy {gen_r} / {gen_d}")
    assert all(isinstance(b.weights, M.ResidentMatrices) for s in res for b in s.layers.values())
    assert all(isinstance(b.weights, M.DenseMatrices) for s in deq for b in s.layers.values())
    assert md5_r == md5_d
    assert ppl_r == ppl_d and 1 < ppl_r < 100
    assert gen_r == gen_d
    # far fewer bytes held: Q4_1 blocks are 5 bits a weight against 32
    wr, wd = sum(s.weight_bytes for s in res), sum(s.weight_bytes for s in deq)
    print(f"weights held: resident {wr / 2**20:.1f} MiB, dequantized {wd / 2**20:.1f} MiB")
    assert wr < 0.25 * wd
    assert all(s.scratch_bytes > 0 for s in res) and all(s.scratch_bytes == 0 for s in deq)


def test_embedding_and_head_never_dequantized_whole(args, monkeypatch):
    s = load_stage("smollm2", args, 0, 30, device="cpu", dtype=torch.float32, weights="resident", max_len=16)
    rows = []
    real = resident._dequantize

    def spy(blocks, qtype, triton_state=None):
        rows.append(blocks.shape[0])
        assert triton_state is s.triton_state  # the slice's, where IQ3_S's kernel would fall back
        return real(blocks, qtype, triton_state)
    monkeypatch.setattr(resident, "_dequantize", spy)
    ids = torch.tensor([[1, 2, 3, 4, 5, 1]])
    s.embed(ids)
    assert rows == [6]  # exactly the prompt's rows
    rows.clear()
    s.logits(torch.randn(3, args.dim))
    assert max(rows) <= resident.head_rows(args) < args.vocab_size and sum(rows) == args.vocab_size


def test_scratch_holds_the_largest_group_not_the_layer(args, monkeypatch):
    """A resident layer dequantizes one group (wqkv, wo, w13, w2) just before its product: the scratch is the
    largest group's size, each group is written when read, and reading one group overwrites the one before."""
    from strata.models.args import PRESETS
    for name in ("qwen3-32b", "llama-3-8b"):
        a = PRESETS[name]
        groups = {"qkv": (a.n_heads + 2 * a.n_kv_heads) * a.head_dim * a.dim, "wo": a.dim * a.n_heads * a.head_dim,
                  "w13": 2 * a.ffn_dim * a.dim, "w2": a.dim * a.ffn_dim}
        assert resident.scratch_layout(a)[1] == max(groups.values()) < sum(groups.values()) * 0.6, name
    s = load_stage("smollm2", args, 0, 2, device="cpu", dtype=torch.float32, weights="resident", max_len=16)
    blk = s.layers["0"].weights
    w = blk.get()
    written = []
    real = resident.dequantize_into
    monkeypatch.setattr(resident, "dequantize_into", lambda out, *x: written.append(out.shape) or real(out, *x))
    qkv = w.wqkv.clone()
    assert len(written) == 3  # q, k, v, nothing else
    w13 = w.w13
    assert len(written) == 5 and w13.data_ptr() == s.scratch.buf.data_ptr()  # the same region as wqkv
    assert not torch.equal(s.scratch.buf[:qkv.numel()].view_as(qkv), qkv)  # which it overwrote
    assert torch.equal(w.wqkv, qkv)  # read again: dequantized again


@pytest.mark.slow
@pytest.mark.parametrize("mode,kv,bounds", [("resident", "auto", [(0, 30)]), ("dequantized", "float8_e4m3fn", [(0, 30)]),
                                            ("resident", "bfloat16", [(0, 10), (20, 30)]),
                                            ("dequantized", "float16", [(10, 20), (20, 30)])])
def test_stage_bytes_agree_with_loaded(args, mode, kv, bounds):
    for a, b in bounds:
        s = load_stage("smollm2", args, a, b, device="cpu", dtype=torch.float32, weights=mode, kv_dtype=kv,
                       max_len=200)
        want = stage_bytes("smollm2", args, a, b, torch.float32, mode, kv, 200, "cpu")
        assert (s.weight_bytes, s.scratch_bytes, s.kv_bytes) == want, (a, b)
    if mode == "resident":  # the counted weights are the file's own block bytes
        from strata.weights.gguf_loader import tensor_facts
        facts = tensor_facts(checkpoint.smollm2_path())
        w, _, _ = stage_bytes("smollm2", args, 0, 30, torch.float32, mode, kv, 200, "cpu")
        assert w == sum(f.needed() if f.quantized else math.prod(f.shape) * 4 for f in facts.values())


@pytest.mark.slow
def test_fp8_kv_cache_perplexity(args, typing_ids):
    ids = torch.tensor([typing_ids[:1000]])
    (s,) = stages(args, "dequantized", ids.shape[1], bounds=[(0, 30)])
    ppl = {}
    for kv in ("auto", "float8_e4m3fn"):  # one model, its cache re-made in each dtype
        s.setup_cache(ids.shape[1], kv)
        assert s.layers["0"].attn.k_cache.dtype == (torch.float32 if kv == "auto" else torch.float8_e4m3fn)
        nll, n = s.nll(prefill([s], ids, chunk=250)[:, :-1], ids[0, 1:])
        ppl[kv] = math.exp(nll / n)
    rel = abs(ppl["float8_e4m3fn"] - ppl["auto"]) / ppl["auto"]
    print(f"perplexity over {ids.shape[1]} tokens: kv float32 {ppl['auto']:.4f}, kv float8_e4m3fn "
          f"{ppl['float8_e4m3fn']:.4f} ({100 * rel:.3f}% relative)")
    assert ppl["float8_e4m3fn"] != ppl["auto"]  # the cache really is 8-bit
    assert rel < 0.02


def test_fp8_store_clamps():
    x = torch.tensor([1e4, -1e4, 1.0])
    assert to_cache(x, torch.float8_e4m3fn).float().tolist() == [448.0, -448.0, 1.0]


# -- quantized synthetic models ------------------------------------------------------------------
needs_random_blocks = pytest.mark.skipif(not hasattr(quant, "random_blocks"),
                                         reason="strata.quant.random_blocks not merged yet")


def test_synthetic_spec_refusals():
    for bad in ("synthetic:smoke@F16", "synthetic:smoke@Q9_X", "synthetic:nope@Q4_K"):
        with pytest.raises(ModelError):
            checkpoint.resolve(bad)
    assert checkpoint.resolve("synthetic:smoke@q4_k") == ("synthetic", "smoke@Q4_K")
    assert model_args("synthetic:smoke@Q4_K") == PRESETS["smoke"]


@needs_random_blocks
def test_synthetic_quantized_deterministic_and_modes_agree():
    a = model_args("synthetic:smoke@Q4_K")
    ids = torch.randint(0, a.vocab_size, (1, 96), generator=torch.Generator().manual_seed(0))
    outs = {}
    for mode in ("resident", "dequantized", "resident"):
        sl = [load_stage("synthetic:smoke@Q4_K", a, x, y, device="cpu", dtype=torch.float32, seed=3, weights=mode,
                         max_len=96) for x, y in [(0, 4), (4, 8)]]
        h = prefill(sl, ids, chunk=32)
        assert torch.isfinite(h).all()
        outs.setdefault(mode, []).append(hashlib.md5(h.numpy().tobytes()).hexdigest())
        w, sc, kv = stage_bytes("synthetic:smoke@Q4_K", a, 4, 8, torch.float32, mode, "auto", 96, "cpu")
        assert (sl[1].weight_bytes, sl[1].scratch_bytes, sl[1].kv_bytes) == (w, sc, kv)
    assert outs["resident"][0] == outs["resident"][1] == outs["dequantized"][0]
    assert weights_mode("synthetic:smoke@Q4_K", "cpu") == "dequantized"
    assert weights_mode("synthetic:smoke@Q4_K", "cuda") == "resident"


@pytest.mark.slow
def test_synthetic_q4_k_m_mix_resident_equals_dequantized():
    """The Q4_K_M mix (Q6_K for attn_v, ffn_down and the head, strata.quant.MIXES) held resident gives the
    dequantized model's residuals bit for bit, and the bytes the planner counts are the ones loaded."""
    spec = "synthetic:smoke-wide@Q4_K_M"
    a = model_args(spec)
    ids = torch.randint(0, a.vocab_size, (1, 64), generator=torch.Generator().manual_seed(1))
    outs = {}
    for mode in ("resident", "dequantized"):
        sl = [load_stage(spec, a, x, y, device="cpu", dtype=torch.float32, seed=3, weights=mode, max_len=64)
              for x, y in [(0, 4), (4, 8)]]
        outs[mode] = hashlib.md5(prefill(sl, ids, chunk=32).numpy().tobytes()).hexdigest()
        w, sc, kv = stage_bytes(spec, a, 4, 8, torch.float32, mode, "auto", 64, "cpu")
        assert (sl[1].weight_bytes, sl[1].scratch_bytes, sl[1].kv_bytes) == (w, sc, kv)
        if mode == "resident":
            parts = sl[1].layers["4"].weights.parts
            assert {n: parts[n].qtype for n in ("wq", "wv", "w_down")} == {"wq": "Q4_K", "wv": "Q6_K", "w_down": "Q6_K"}
            assert sl[1].head.weight.qtype == "Q6_K"
    assert outs["resident"] == outs["dequantized"]


@pytest.mark.parametrize("qtype,bytes_per_256", [("Q4_K", 144), ("IQ3_S", 110)])
def test_synthetic_70b_bytes(qtype, bytes_per_256):
    if qtype not in getattr(quant, "SUPPORTED", ()):
        pytest.skip(f"strata.quant does not dequantize {qtype} on this branch")
    spec = f"synthetic:llama-3-70b@{qtype}"
    a = model_args(spec)
    assert weights_mode(spec, "cuda") == "resident" and weights_mode(spec, "cpu") == "dequantized"
    w, sc, kv = stage_bytes(spec, a, 0, 80, "bfloat16", "resident", "float8_e4m3fn", 8192, "cuda")
    # every matrix's rows are whole 256-blocks in this shape: bytes = parameters * type bytes / 256 (+ bf16 norms)
    want = (a.param_count(0, 80) - (2 * 80 + 1) * a.dim) * bytes_per_256 // 256 + (2 * 80 + 1) * a.dim * 2
    assert w == want
    assert kv == 2 * 80 * 8 * 8192 * 128
    assert sc > scratch_elems(a) * 2
    print(f"70B {qtype}: weights {w / 2**30:.1f} GiB, scratch {sc / 2**30:.2f} GiB, fp8 KV@8192 {kv / 2**30:.2f} GiB")


def scratch_elems(a):
    return resident.scratch_layout(a)[1]


# -- bad GGUFs, refused by check_model_files before any stage starts -----------------------------
def _tiny_gguf(path, bad=None):
    """A 2-layer llama GGUF with Q8_0 matrices; `bad` = (tensor name, 'I8' | 'short')."""
    rng = np.random.default_rng(0)
    dim, ffn, vocab = 64, 128, 96
    w = gguf.GGUFWriter(str(path), "llama")
    for key, val in [("block_count", 2), ("context_length", 256), ("embedding_length", dim),
                     ("feed_forward_length", ffn), ("attention.head_count", 4), ("attention.head_count_kv", 2),
                     ("vocab_size", vocab)]:
        w.add_uint32(f"llama.{key}", val)
    shapes = {"token_embd.weight": (vocab, dim), "output_norm.weight": (dim,)}
    for i in range(2):
        shapes.update({f"blk.{i}.attn_norm.weight": (dim,), f"blk.{i}.attn_q.weight": (dim, dim),
                       f"blk.{i}.attn_k.weight": (32, dim), f"blk.{i}.attn_v.weight": (32, dim),
                       f"blk.{i}.attn_output.weight": (dim, dim), f"blk.{i}.ffn_norm.weight": (dim,),
                       f"blk.{i}.ffn_gate.weight": (ffn, dim), f"blk.{i}.ffn_up.weight": (ffn, dim),
                       f"blk.{i}.ffn_down.weight": (dim, ffn)})
    for name, shape in shapes.items():
        a = rng.standard_normal(shape).astype(np.float32) * 0.1
        if len(shape) == 1:
            w.add_tensor(name, a)
        elif bad == (name, "I8"):
            w.add_tensor(name, (a * 100).astype(np.int8))
        else:
            q = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
            if bad == (name, "short"):  # the header says the full shape; one row of blocks is missing
                w.add_tensor(name, np.ascontiguousarray(q[:-1]), raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            else:
                w.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_good_tiny_gguf_passes_and_runs(tmp_path):
    p = _tiny_gguf(tmp_path / "ok.gguf")
    check_model_files(p)
    a = model_args(p)
    ids = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(0))
    md5 = {}
    for mode in ("resident", "dequantized"):
        sl = [load_stage(p, a, x, y, device="cpu", dtype=torch.float32, weights=mode, max_len=40) for x, y in [(0, 1), (1, 2)]]
        md5[mode] = hashlib.md5(sl[-1].logits(prefill(sl, ids, chunk=16)).numpy().tobytes()).hexdigest()
    assert md5["resident"] == md5["dequantized"]


@pytest.mark.parametrize("bad,match", [(("blk.1.ffn_up.weight", "I8"), r"blk\.1\.ffn_up\.weight has type I8, which strata\.quant"),
                                       (("blk.0.attn_q.weight", "short"), r"blk\.0\.attn_q\.weight \(Q8_0\) holds \d+ bytes.*needs"),
                                       (("token_embd.weight", "short"), r"token_embd\.weight \(Q8_0\) holds")])
def test_bad_tensor_refused_in_one_line(tmp_path, bad, match):
    p = _tiny_gguf(tmp_path / "bad.gguf", bad)
    with pytest.raises(ModelError, match=match) as e:
        check_model_files(p)
    assert "bad.gguf" in str(e.value) and "\n" not in str(e.value)
