"""decode_weights: blocks — CPU decode steps in C on 4/8-bit blocks (strata/kernels/cpu_decode.py, strata/kernels/csrc/cpu_decode.c):
the product against its integer formula and gguf-py's dequantization, the vector build against the plain C one,
whole decode steps against transformers and the float32 path, and a two-stage pipeline against one process."""
import os

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

cd = pytest.importorskip("strata.kernels.cpu_decode")
try:
    cd.library()
except cd.BuildError as e:  # no C compiler: the option reports it at load (test_no_compiler_is_one_line)
    pytest.skip(str(e), allow_module_level=True)

from strata.weights.checkpoint import load_stage, model_args  # noqa: E402
from strata.models.args import ModelArgs  # noqa: E402
from strata.models.model import Transformer  # noqa: E402


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


def quantized_x(x):
    """The kernel's input rounding, in torch: 8 bits per 32 with scale max|x| / 127."""
    g = x.double().view(-1, 32)
    d = (g.abs().amax(-1).float() / 127).double()
    q = torch.round(g / torch.where(d > 0, d, 1)[:, None]).clamp(-127, 127)
    return (q * d[:, None]).view(-1)


def test_product_is_the_integer_formula_and_both_builds_agree():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(200, 576, generator=g)  # 200 rows: the last group of 16 is partial
    x = torch.randn(576, generator=g) * 3
    p = cd.from_dense(w)
    # the weights as packed, dequantized in torch: d * u + m with 8-bit u = q + 128
    blocks = w.view(200, 18, 32)
    d = (blocks.abs().amax(-1) / 127).half().double()
    wq = (torch.round(blocks.double() / torch.where(d > 0, d, 1)[..., None]).clamp(-127, 127) * d[..., None]).view(200, 576)
    y = cd.matvec(p, x)
    assert y.shape == (200,) and y.dtype == torch.float32
    assert rel(y.double(), wq @ quantized_x(x)) < 1e-6  # only float32 accumulation left
    assert 1e-4 < rel(y, w @ x) < 2e-2                # the 8-bit roundings of w and x, and nothing worse
    assert torch.equal(y, cd.matvec(p, x, portable=True))  # same arithmetic, same order: same bits


@pytest.mark.parametrize("bits", [4, 8])
def test_products_at_the_integer_extremes(bits):
    """The largest weights (nibbles 15, bytes 255) against inputs quantized to +-127: where the AVX2 build's int16
    sums would saturate if they could (VPMADDUBSW does), the products are still the integer formula and the plain
    build's bits; rows of zeros between, a partial last group, signs mixed by block."""
    rows, cols = 40, 256
    J = cols // 32
    u = torch.full((rows, J, 16 if bits == 4 else 32), 255, dtype=torch.uint8)  # 4-bit: both nibbles 15
    u[1::3] = 0
    p = cd.Packed(u, torch.ones(rows, J, dtype=torch.float16), torch.zeros(rows, J, dtype=torch.float16), bits, cols)
    top = 15 if bits == 4 else 255
    for x in (torch.ones(cols), -torch.ones(cols), torch.tensor([1.0, -1.0]).repeat_interleave(32).repeat(J // 2)):
        y = cd.matvec(p, x)
        assert torch.equal(y, cd.matvec(p, x, portable=True))
        block = float(torch.tensor(1.0) / 127) * top * 127 * 32  # a block's term: dx (float32) * sum u xq
        want = torch.tensor([0.0 if r % 3 == 1 else block * float(x.view(J, 32)[:, 0].sum()) for r in range(rows)],
                            dtype=torch.float64)
        assert float((y.double() - want).abs().max()) < 1e-6 * block * J  # float32 sums of exact block terms


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_are_read_as_stored(qtype):
    """The file's own blocks, against gguf-py's quantization and dequantization (an independent reader)."""
    gguf = pytest.importorskip("gguf")
    rng = np.random.default_rng(1)
    w = rng.standard_normal((48, 256)).astype(np.float32)
    t = gguf.GGMLQuantizationType[qtype]
    raw = gguf.quants.quantize(w, t)
    wd = torch.from_numpy(gguf.quants.dequantize(raw, t).reshape(48, 256).astype(np.float64))
    p = cd.from_blocks(torch.from_numpy(raw), qtype, 256)
    assert p is not None and p.bits == (8 if qtype == "Q8_0" else 4)
    x = torch.from_numpy(rng.standard_normal(256).astype(np.float32))
    y = cd.matvec(p, x)
    assert rel(y.double(), wd @ quantized_x(x)) < 1e-6
    assert rel(y.double(), wd @ x.double()) < 2e-2
    assert torch.equal(y, cd.matvec(p, x, portable=True))
    assert cd.from_blocks(torch.from_numpy(raw), "Q6_K", 256) is None  # other types: the caller re-quantizes


# -- whole decode steps ------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("bits", [32, 16, 8])
def test_attention_against_float64(bits):
    """One kv head's decode attention (strata_attend): the grouped kernels (G query heads of 64 or 128 values,
    each cached row loaded once for the group; a bfloat16 row split into its even and odd values) and the
    general path (other shapes), both builds, against a float64 softmax(q k^T / sqrt(hd)) v over the same
    cache; lengths below one step of 4 and with a ragged tail."""
    g = torch.Generator().manual_seed(9)
    dtype = {32: torch.float32, 16: torch.bfloat16, 8: torch.float8_e4m3fn}[bits]
    for G, hd in ((1, 64), (2, 64), (3, 64), (4, 64), (8, 64), (5, 64), (7, 64), (1, 128), (2, 128), (3, 128), (8, 128), (2, 32)):
        for n in (1, 3, 7, 130):
            q = torch.randn(G, hd, generator=g) * 2
            k = (torch.randn(n, hd, generator=g) * 2).to(dtype)
            v = torch.randn(n, hd, generator=g).to(dtype)
            w = torch.softmax(q.double() @ k.double().T / hd ** 0.5, dim=-1)
            want = w @ v.double()  # (an e4m3 cache's values widened exactly: the table's)
            for portable in (False, True):
                got = cd.attend(q, k, v, portable)
                assert rel(got, want) < 1e-5, (G, hd, n, portable, rel(got, want))


def test_e4m3_store_is_torchs_cast():
    """strata_to_e4m3 (the C step's K/V row write) against strata.kernels.attention.to_cache (clamp, then torch's cast):
    the same byte for values across e4m3's range, its subnormals, exact ties between two codes, past +-448."""
    from strata.kernels.attention import to_cache
    lib = cd.library()
    codes = torch.arange(256, dtype=torch.uint8)
    vals = codes[(codes & 0x7F) < 0x7E].view(torch.float8_e4m3fn).float()  # every finite code below the max
    ties = (vals[:-1] + vals[1:]) / 2  # (mixed signs and the subnormal steps included)
    g = torch.Generator().manual_seed(4)
    xs = torch.cat([vals, ties, torch.randn(4000, generator=g) * 30, torch.randn(2000, generator=g) * 0.01,
                    torch.tensor([448.0, 460.0, 464.0, 1e6, -1e6, 0.0, -0.0, 2.0 ** -10, 2.0 ** -9 * 1.5])])
    want = to_cache(xs, torch.float8_e4m3fn).view(torch.uint8)
    got = torch.tensor([lib.strata_to_e4m3(float(x)) for x in xs], dtype=torch.uint8)
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, [(float(xs[i]), int(got[i]), int(want[i])) for i in bad[:5]]


def _tiny_hf(tmp_path, arch):
    pytest.importorskip("transformers")
    from test_model_hf import make_tiny
    # head_dim 64, 2 query heads a kv head: the decode attention's grouped kernel
    return make_tiny(tmp_path, arch, seed=2, hidden_size=256, intermediate_size=256, num_hidden_layers=4,
                     num_attention_heads=4, max_position_embeddings=512)


@pytest.mark.slow
@pytest.mark.parametrize("arch,kv_dtype", [("llama", "auto"), ("qwen2", "auto"), ("llama", "bfloat16"),
                                           ("llama", "float8_e4m3fn")])
def test_decode_steps_match_transformers(tmp_path, arch, kv_dtype):
    """Two slices of a transformers-made model (float32 safetensors: every matrix re-quantized to 8 bits), a
    prefill then one-token steps through the C path, against transformers' logits for the same tokens."""
    ref, d = _tiny_hf(tmp_path, arch)
    args = model_args(d)
    ids = torch.randint(0, 300, (1, 100), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = ref(ids).logits[0]
    kw = dict(device="cpu", dtype=torch.float32, max_len=128, kv_dtype=kv_dtype)
    s0, s1 = load_stage(d, args, 0, 2, decode_weights="blocks", **kw), load_stage(d, args, 2, 4, decode_weights="blocks", **kw)
    plain = load_stage(d, args, 2, 4, **kw)
    assert s0._blocks.requantized == 7 * 2 and s1._blocks.requantized == 7 * 2 + 1 and s0._blocks.exact == 0
    with torch.inference_mode():
        h = s0(ids[:, :80], 0)
        assert torch.equal(s1(h, 0), plain(h, 0))  # prefill keeps the dense path: same bits
        for p in range(80, 100):
            x = s0.decode_step(ids[:, p:p + 1], p)
            x_before = x.clone()
            out, logits, am = s1.decode_token(x, p)
            assert torch.equal(x, x_before)  # the stage's input row is not written in place
            assert logits.shape == (300,) and int(am) == int(logits.argmax())
            assert rel(logits, want[p]) < (6e-2 if kv_dtype == "float8_e4m3fn" else 3e-2), p
            assert rel(out[0, 0], plain.decode_step(x, p)[0, 0]) < 3e-2


@pytest.fixture(scope="module")
def smol_path():
    pytest.importorskip("gguf")
    from strata.weights.checkpoint import smollm2_path
    try:
        return str(smollm2_path())
    except Exception as e:  # noqa: BLE001
        pytest.skip(str(e))


TEXT = "The history of the Roman Empire spans many centuries. It began when Augustus became the first emperor, and"


def _greedy(m, ids, n):
    with torch.inference_mode():
        t = int(m.logits(m(ids, 0)[0, -1]).argmax())
        got = [t]
        for p in range(ids.shape[1], ids.shape[1] + n - 1):
            _, _, am = m.decode_token(torch.tensor([[t]]), p)
            t = int(am)
            got.append(t)
    return got


def _forced(m, ids, toks):
    """m's logits (float64, one row a step) for the prompt ids, then for each of toks fed in turn"""
    with torch.inference_mode():
        rows = [m.logits(m(ids, 0)[0, -1])]
        for i, t in enumerate(toks[:-1]):
            rows.append(m.decode_token(torch.tensor([[t]]), ids.shape[1] + i)[1])
    return torch.stack([r.reshape(-1).double() for r in rows])


@pytest.mark.slow
def test_smollm2_uses_the_file_blocks_and_keeps_the_float32_answer(smol_path):
    """SmolLM2's Q4_1 layers and Q8_0 (tied) head are read as stored; on real text, stepped along the float32 path's
    greedy answer, each step's logits are float32's within the 8-bit rounding of the products' inputs, and its
    choice is float32's wherever float32's top two are further apart than that rounding moves them.

    Not the greedy answers token for token: that held for the plain and AVX-512 builds by luck. The builds differ in
    last bits (vector sums, exp), and each product's 8-bit input turns such bits into logit differences of ~0.1-0.3
    (as the rounding itself does against float32), more than float32's own margin at some steps (0.13 at the 17th
    token of this text, where the AVX2 build takes the runner-up)."""
    from strata.text.tokenizer import Tokenizer
    args = model_args(smol_path)
    ids = torch.tensor([Tokenizer.from_gguf(smol_path).encode(TEXT)])
    kw = dict(device="cpu", dtype=torch.float32, max_len=ids.shape[1] + 32)
    fast = load_stage(smol_path, args, 0, args.n_layers, decode_weights="blocks", **kw)
    assert (fast._blocks.exact, fast._blocks.requantized) == (7 * 30 + 1, 0)
    want = _greedy(load_stage(smol_path, args, 0, args.n_layers, **kw), ids, 24)
    dense = _forced(load_stage(smol_path, args, 0, args.n_layers, **kw), ids, want)
    assert dense.argmax(1).tolist() == want
    got = _forced(fast, ids, want)
    top2 = dense.topk(2, dim=1).values
    clear = 0
    for i in range(len(want)):
        assert rel(got[i], dense[i]) < 5e-2, (i, rel(got[i], dense[i]))  # measured: 1.4e-2 .. 3.9e-2
        pick = int(got[i].argmax())
        assert dense[i, pick] > top2[i, 0] - 0.75, (i, pick, want[i])  # a float32 near-top token, at worst
        if top2[i, 0] - top2[i, 1] > 0.75:  # (errors at the top measured up to 0.32)
            assert pick == want[i], (i, pick, want[i])
            clear += 1
    assert clear >= 6, clear  # (9 of this text's 24 steps)
    # a new cache (another max_context) is picked up: the same logits again
    fast.setup_cache(ids.shape[1] + 40)
    assert torch.equal(_forced(fast, ids, want), got)


def _two_stages_and_one(smol_path, tmp_path, decode_weights: str | None, n: int, kv_dtype: str = "auto"):
    """SmolLM2 greedy on two CPU stages with `decode_weights` (None: the rig does not name it) -> (their Result,
    one process's tokens with the C steps, the stages' logs)."""
    from strata.head.pipeline import Pipeline
    from strata.text.sampling import SamplingParams
    args = model_args(smol_path)
    stages = [{"device": "cpu", "threads": 1}, {"device": "cpu", "threads": 1}]
    rig = dict(model="smollm2", stages=stages, chunk=64, max_context=256, progress=False, kv_dtype=kv_dtype)
    if decode_weights is not None:
        rig["decode_weights"] = decode_weights
    with Pipeline(rig, out=tmp_path / "p", console=False) as p:
        ids = p.prompt_ids(TEXT)
        got = p.generate(ids, SamplingParams(max_tokens=n))
    one = load_stage(smol_path, args, 0, args.n_layers, device="cpu", dtype=torch.float32, max_len=256,
                     decode_weights="blocks", kv_dtype=kv_dtype)
    logs = "".join(f.read_text() for f in (tmp_path / "p").rglob("*.log"))
    return got, _greedy(one, torch.tensor([ids.tolist()]), n), logs


@pytest.mark.slow
def test_two_stage_pipeline_gives_the_single_process_tokens(smol_path, tmp_path):
    """Stages hand the residual row between processes; the C steps on either side give one process's tokens."""
    import re
    got, want, logs = _two_stages_and_one(smol_path, tmp_path, "blocks", 16)
    assert got.continuation_ids == want
    assert got.report["decode_weights"] == "blocks"
    stored = [int(n) for n in re.findall(r"decode_weights=blocks: (\d+) matrices as stored, 0 quantized", logs)]
    # each stage its layers' matrices (the planner's split), the last one the head too
    assert len(stored) == 2 and sum(stored) == 7 * 30 + 1 and sorted(n % 7 for n in stored) == [0, 1]


@pytest.mark.slow
def test_default_rig_decodes_on_the_blocks(smol_path, tmp_path):
    """A rig that does not name decode_weights (auto) takes the C steps on a quantized Llama-core file: the blocks
    rig's tokens, the stage logs saying so; auto_kind names each reason it declines (a float model, resident
    weights, a family beyond the Llama core)."""
    import re
    got, want, logs = _two_stages_and_one(smol_path, tmp_path, None, 12)
    assert got.continuation_ids == want
    assert len(re.findall(r"decode_weights=auto: blocks \(the file's blocks in C\)", logs)) == 2
    assert len(re.findall(r"decode_weights=blocks: \d+ matrices as stored", logs)) == 2
    args = model_args(smol_path)
    assert cd.auto_kind(args, False, "dequantized") == ("none", "float weights (blocks would round them to 8 bits)")
    assert cd.auto_kind(args, True, "resident")[0] == "none"
    assert cd.auto_kind(args, True, "dequantized", torch.float16) == (
        "none", "kv_dtype float16 (the C decoder reads a float32, bfloat16 or float8_e4m3fn cache)")
    for kv in (torch.bfloat16, torch.float8_e4m3fn):
        assert cd.auto_kind(args, True, "dequantized", kv)[0] == "blocks"
    gemma = ModelArgs(arch="gemma3", vocab_size=64, dim=64, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=32,
                      ffn_dim=64, norm_offset=1.0)
    kind, why = cd.auto_kind(gemma, True, "dequantized")
    assert kind == "none" and why.startswith("the C decoder implements the Llama core; gemma3 uses")


@pytest.mark.slow
def test_default_rig_with_an_8_bit_cache_decodes_on_the_blocks(smol_path, tmp_path):
    """kv_dtype float8_e4m3fn and no decode_weights key: the C steps read and write the e4m3 cache (they failed at
    load before the C attention read it), two stages giving one process's tokens."""
    got, want, logs = _two_stages_and_one(smol_path, tmp_path, None, 8, "float8_e4m3fn")
    assert got.continuation_ids == want
    assert logs.count("decode_weights=auto: blocks (the file's blocks in C)") == 2


def test_refusals_are_one_line(monkeypatch):
    args = ModelArgs(vocab_size=64, dim=48, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=24, ffn_dim=64)
    with torch.device("meta"):
        m = Transformer(args)
    from strata.weights.checkpoint import synthetic_tensors
    m.load_weights(synthetic_tensors(args, 0, 1, "cpu", torch.float32, seed=0), "cpu", torch.float32)
    m.setup_cache(8)
    with pytest.raises(ValueError, match=r"^decode_weights=blocks needs widths in whole 32-blocks \(dim 48"):
        m.set_decode_weights("blocks")
    # no compiler: the build names what is missing
    monkeypatch.setattr(cd, "_libs", {})
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with pytest.raises(cd.BuildError, match="finds no C compiler"):
        cd.library()


def test_auto_takes_the_blocks_only_with_a_vector_path(monkeypatch):
    """`decode_weights: auto` takes the C decoder on a CPU with AVX-512 VNNI or AVX2 (strata_simd 1 or 2); with neither
    (0: the plain build, slower than the dense weights) it keeps the dense weights and says why. An explicit `blocks`
    there still runs the plain build: the same products, decode steps that match the vector build's."""
    args = ModelArgs(vocab_size=64, dim=64, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=32, ffn_dim=96)
    vector, plain = cd.library(), cd.library(portable=True)
    assert vector.strata_simd() in (0, 1, 2) and plain.strata_simd() == 0

    class Simd:  # the library, answering strata_simd as a CPU of that kind would
        def __init__(self, n):
            self.n = n

        def strata_simd(self):
            return self.n

    for n, kind in ((1, "blocks"), (2, "blocks"), (0, "none")):
        monkeypatch.setattr(cd, "library", lambda portable=False, n=n: Simd(n))
        got, why = cd.auto_kind(args, True, "dequantized")
        assert got == kind, (n, why)
    assert why.startswith("this CPU has neither AVX-512 VNNI nor AVX2 + FMA + F16C")

    from strata.weights.checkpoint import synthetic_tensors
    steps = []
    for lib in (plain, vector):
        monkeypatch.setattr(cd, "library", lambda portable=False, lib=lib: lib)
        with torch.device("meta"):
            m = Transformer(args)
        m.load_weights(synthetic_tensors(args, 0, 2, "cpu", torch.float32, seed=0), "cpu", torch.float32)
        m.setup_cache(16)
        m.set_decode_weights("blocks")
        assert m._blocks.lib.strata_simd() == lib.strata_simd()
        with torch.inference_mode():
            m(torch.tensor([[1, 2, 3, 4, 5]]), 0)
            steps.append(torch.stack([m.decode_token(torch.tensor([[t]]), 5 + i)[1].reshape(-1)
                                      for i, t in enumerate((6, 7, 8))]))
    assert rel(steps[0], steps[1]) < 3e-2


@pytest.mark.parametrize("kv_dtype", ["auto", "bfloat16", "float8_e4m3fn"])
def test_several_sequences_in_one_step_are_each_alone_bit_for_bit(tmp_path, kv_dtype):
    """`decode_seqs`: rows of three sequences (their own slots and positions, in any order, batches of 1 to 3
    rows) through the C products that read each block once for all rows give each row the bits of its step alone,
    on a first slice (ids) and a last one (residual rows in, logits out)."""
    ref, d = _tiny_hf(tmp_path, "llama")
    args = model_args(d)
    kw = dict(device="cpu", dtype=torch.float32, max_len=128, kv_dtype=kv_dtype, decode_weights="blocks")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 300, (1, n), generator=g) for n in (37, 80, 5)]
    runs = []
    for _ in range(2):  # one pair of slices batched, one stepped alone
        s0, s1 = load_stage(d, args, 0, 2, **kw), load_stage(d, args, 2, 4, **kw)
        for s in (s0, s1):
            s.setup_cache(128, kv_dtype, seqs=3)
        with torch.inference_mode():
            for slot, ids in enumerate(prompts):
                s0.use_slot(slot)
                s1.use_slot(slot)
                s1(s0(ids, 0), 0)
        runs.append((s0, s1))
    (b0, b1), (a0, a1) = runs
    tok = [7, 100, 299]
    pos = [p.shape[1] for p in prompts]
    for order in ([0, 1, 2], [2, 0], [1], [2, 1, 0], [0, 2, 1]):
        with torch.inference_mode():
            x = torch.tensor([tok[s] for s in order])
            h, no_logits, no_am = b0.decode_seqs(x, order, [pos[s] for s in order])
            assert no_logits is None and no_am is None and h.shape == (len(order), args.dim)
            h_in = h.clone()
            out, logits, am = b1.decode_seqs(h, order, [pos[s] for s in order])
            assert torch.equal(h, h_in)  # the caller's rows are not written in place
            for t, s in enumerate(order):
                a0.use_slot(s)
                a1.use_slot(s)
                h1 = a0.decode_step(torch.tensor([[tok[s]]]), pos[s])
                o1, lg1, am1 = a1.decode_token(h1, pos[s])
                assert torch.equal(h[t], h1.view(-1)), (order, t)
                assert torch.equal(out[t], o1.view(-1)) and torch.equal(logits[t], lg1), (order, t)
                assert int(am[t]) == int(am1)
                tok[s], pos[s] = int(am1), pos[s] + 1
    # and the rows stepped alone agree with transformers' logits for the same tokens (the batch is not merely
    # self-consistent): a fresh sequence through both models
    ids = torch.randint(0, 300, (1, 40), generator=g)
    with torch.no_grad():
        want = ref(ids).logits[0]
    with torch.inference_mode():
        b0.use_slot(1), b1.use_slot(1)
        b1(b0(ids[:, :30], 0), 0)
        for p in range(30, 40):
            h, _, _ = b0.decode_seqs(ids[0, p:p + 1], [1], [p])
            _, logits, _ = b1.decode_seqs(h, [1], [p])
            assert rel(logits[0], want[p]) < (6e-2 if kv_dtype == "float8_e4m3fn" else 3e-2), p
