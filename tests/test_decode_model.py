"""The model's decode path (one token, T <= 4 rows) against the prefill path and transformers' generate;
the opt-in CPU weight-only decode kernels; the CPU fallback of decode_step."""
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from strata.weights.checkpoint import synthetic_tensors
from strata.models.args import PRESETS, ModelArgs
from strata.kernels.attention import decode_attention
from strata.models.model import Transformer
from strata.models.resident import DECODE_T
from strata.models.weight_only import WeightOnly

SMALL = ModelArgs(vocab_size=300, dim=128, n_layers=3, n_heads=8, n_kv_heads=2, head_dim=16, ffn_dim=192,
                  max_seq_len=4096)


def build(args: ModelArgs, max_len: int, kv_dtype="auto", start=0, end=None) -> Transformer:
    end = args.n_layers if end is None else end
    with torch.device("meta"):
        m = Transformer(args, start, end)
    m.load_weights(synthetic_tensors(args, start, end, "cpu", torch.float32, seed=4), "cpu", torch.float32)
    m.setup_cache(max_len, kv_dtype)
    return m.eval()


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.slow
@pytest.mark.parametrize("qkv_bias", [False, True])
@pytest.mark.parametrize("kv_dtype", ["auto", "bfloat16", "q8_0"])
def test_decode_path_matches_prefill_path(qkv_bias, kv_dtype):
    """Two models, same weights and prompt: one token at a time through the chunk path (decode=False)
    and through the decode path give the same residuals and logits within fp32 rounding. A q8_0 cache widens
    that: the two paths' keys differ in float32's last bits, and now and then one of them rounds to the next int8
    step (measured: one cached byte of 68 x 2 x 3 layers at positions 301 and 323, after which the residuals
    differ by up to 2.1e-5 on this repository's box, under 1e-5 on CI's), so its bound is 1e-4."""
    args = ModelArgs(**{**SMALL.__dict__, "qkv_bias": qkv_bias, "arch": "qwen2" if qkv_bias else "llama"})
    if kv_dtype == "q8_0":  # blocks of 32 values a row
        args = ModelArgs(**{**args.__dict__, "n_heads": 4, "head_dim": 32})
    old, new = build(args, 400, kv_dtype), build(args, 400, kv_dtype)
    ids = torch.randint(0, args.vocab_size, (1, 330), generator=torch.Generator().manual_seed(1))
    h_old, h_new = old(ids[:, :300], 0), new(ids[:, :300], 0)
    assert torch.equal(h_old, h_new)  # prefill (T > DECODE_T) takes one path, the same bits
    tol = 1e-4 if kv_dtype == "q8_0" else 1e-5
    for p in range(300, 330):
        a = old(ids[:, p:p + 1], p, decode=False)
        b = new(ids[:, p:p + 1], p)  # T == 1: the decode path by default
        assert rel(b, a) < tol, p
        assert rel(new.logits(b[0, -1]), old.logits(a[0, -1])) < tol, p


def test_bf16_cache_attention_close_to_widened(monkeypatch):
    """A bfloat16 cache read as is (bfloat16 GEMMs per kv head, float32 softmax; past BF16_ATTENTION_FROM
    positions) against the same cache widened for the float32 path: close, not the same bits."""
    import strata.models.layer as sm  # (the decode rows' attention: strata.models.layer.attend_rows)
    monkeypatch.setattr(sm, "BF16_ATTENTION_FROM", 1)
    old, new = build(SMALL, 200, "bfloat16"), build(SMALL, 200, "bfloat16")
    ids = torch.randint(0, SMALL.vocab_size, (1, 160), generator=torch.Generator().manual_seed(3))
    old(ids[:, :150], 0), new(ids[:, :150], 0)
    calls = []
    real = sm._bf16_cache_attention
    monkeypatch.setattr(sm, "_bf16_cache_attention", lambda *a: calls.append(1) or real(*a))
    for p in range(150, 160):
        a, b = old(ids[:, p:p + 1], p, decode=False), new(ids[:, p:p + 1], p)
        assert 0 < rel(b, a) < 2e-2, p
        assert rel(new.logits(b[0, -1]), old.logits(a[0, -1])) < 2e-2, p
    assert len(calls) == 10 * SMALL.n_layers  # the bfloat16 path ran, every layer of every step


def test_small_chunks_and_position_zero():
    """T = 2..DECODE_T through the decode path (split attention, fused ops) and a first token at pos 0."""
    old, new = build(SMALL, 64), build(SMALL, 64)
    ids = torch.randint(0, SMALL.vocab_size, (1, 1 + 2 + 3 + 4), generator=torch.Generator().manual_seed(2))
    pos = 0
    for T in (1, 2, 3, DECODE_T):
        a = old(ids[:, pos:pos + T], pos, decode=False)
        b = new(ids[:, pos:pos + T], pos)
        assert rel(b, a) < 1e-5, T
        pos += T


def test_decode_attention_is_grouped_query_attention():
    """Against an explicit softmax over every key with each kv head repeated for its query heads."""
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(1, 8, 1, 16, generator=g), torch.randn(1, 2, 77, 16, generator=g), torch.randn(1, 2, 77, 16, generator=g)
    kr, vr = k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1)
    ref = torch.softmax(q @ kr.transpose(-1, -2) / 4.0, dim=-1) @ vr
    assert rel(decode_attention(q, k, v), ref) < 1e-5


def test_sliced_decode_matches_whole():
    """Stages' decode: the residual row crosses slices; equals the whole model's decode step."""
    whole = build(SMALL, 64)
    parts = [build(SMALL, 64, start=0, end=1), build(SMALL, 64, start=1, end=3)]
    ids = torch.randint(0, SMALL.vocab_size, (1, 40), generator=torch.Generator().manual_seed(5))
    whole(ids[:, :32], 0)
    h = ids[:, :32]
    for t in parts:
        h = t(h, 0)
    for p in range(32, 40):
        a = whole(ids[:, p:p + 1], p)
        b = ids[:, p:p + 1]
        for t in parts:
            b = t.decode_step(b, p)  # CPU: the eager decode path
        assert rel(b, a) < 1e-6


def test_greedy_matches_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    from strata.weights.checkpoint import model_args, slice_tensors
    torch.manual_seed(1)
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                                   rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=5000.0)
    ref = transformers.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():  # sharper logits than the default init, so greedy is not decided by rounding
        for n, p in ref.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
            elif n == "lm_head.weight":
                p.mul_(20)
            elif n.endswith(("q_proj.weight", "k_proj.weight", "o_proj.weight", "v_proj.weight")):
                p.mul_(6)  # attention that matters: a wrong key or position changes the tokens
    ref.save_pretrained(tmp_path / "m", safe_serialization=True)
    d = str(tmp_path / "m")
    args = model_args(d)
    m = Transformer(args)
    m.load_weights(slice_tensors(d, args, 0, args.n_layers), "cpu", torch.float32)
    ids = torch.randint(0, 300, (1, 50), generator=torch.Generator().manual_seed(0))
    N = 40
    m.setup_cache(ids.shape[1] + N)
    with torch.no_grad():
        want = ref.generate(ids, max_new_tokens=N, do_sample=False, min_new_tokens=N,
                            pad_token_id=0)[0, ids.shape[1]:].tolist()
    tok = int(m.logits(m(ids, 0)[0, -1]).argmax())
    got = [tok]
    for p in range(ids.shape[1], ids.shape[1] + N - 1):
        tok = int(m.logits(m(torch.tensor([[tok]]), p)[0, -1]).argmax())
        got.append(tok)
    assert got == want


# -- weight-only kernels ---------------------------------------------------------------------------
def _grid_matrix(n, k, g):
    """A matrix on an int4 group-32 grid whose scales and zeros are exact in bfloat16 (like GGUF Q4_1)."""
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15  # each group spans the grid, so min/max re-quantization finds it again
    d = torch.rand(n, k // 32, 1, generator=g).bfloat16().float() * 0.1 + 0.01
    m = (-8 * d).bfloat16().float() + torch.randn(n, k // 32, 1, generator=g).bfloat16().float() * 0.01
    return (d * q + m).view(n, k)


@pytest.mark.parametrize("kind", ["int4", "int8", "float16"])
def test_weight_only_product(kind):
    g = torch.Generator().manual_seed(6)
    w = _grid_matrix(96, 256, g) if kind == "int4" else torch.randn(96, 256, generator=g)
    x = torch.randn(3, 256, generator=g)
    wo = WeightOnly(w, kind)
    y = wo(x)
    assert y.shape == (3, 96) and y.dtype == torch.float32
    if kind == "float16":
        assert rel(y, x.half().float() @ w.half().float().T) < 2e-3
        assert rel(y, x @ w.T) < 3e-3
        return
    # the kernels round x to bfloat16; against that, only int8's rounding of w and the output's remain
    ref = x.bfloat16().float() @ w.T
    assert rel(y, ref) < (2e-2 if kind == "int8" else 8e-3)
    assert rel(y, x @ w.T) < 3e-2


def test_weight_only_decode_leaves_prefill_alone():
    args = PRESETS["smoke"]
    plain, wq = build(args, 200), build(args, 200)
    extra = wq.set_decode_weights("int4")
    assert extra > 0 and wq.decode_weights == "int4"
    ids = torch.randint(0, args.vocab_size, (1, 150), generator=torch.Generator().manual_seed(7))
    assert torch.equal(plain(ids[:, :140], 0), wq(ids[:, :140], 0))  # prefill: the dense path, same bits
    for p in range(140, 150):
        a, b = plain(ids[:, p:p + 1], p), wq(ids[:, p:p + 1], p)
        la, lb = plain.logits(a[0, -1]), wq.logits(b[0, -1], decode=True)
        assert 0 < rel(lb, la) < 0.1  # different kernels (not silently the dense path), close logits
    assert wq.set_decode_weights(None) == 0 and wq.decode_weights is None
    with pytest.raises(ValueError, match="unknown decode_weights"):
        wq.set_decode_weights("int3")


def test_weight_only_refuses_resident():
    args = PRESETS["smoke"]
    with torch.device("meta"):
        m = Transformer(args)
    m.load_weights(synthetic_tensors(args, 0, args.n_layers, "cpu", torch.float32, seed=0, qtype="Q4_0",
                                     resident=True), "cpu", torch.float32)
    with pytest.raises(ValueError, match="dense"):
        m.set_decode_weights("int8")


# -- GGUF loading through strata.quant ---------------------------------------------------------------
def test_gguf_tensors_bit_exact_with_gguf_py():
    """SmolLM2's GGUF tensors (two layers, the embedding, the norm) decode to gguf-py's float32 bits (the
    residual md5s rely on it). The whole file takes gguf-py ~15 s."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    from strata.weights.gguf_files import open_gguf
    from strata.weights.gguf_loader import _decode
    from strata.weights.checkpoint import smollm2_path
    path = smollm2_path()
    reader = open_gguf(path)
    types = set()
    for t in reader.tensors:
        if not t.name.startswith(("blk.0.", "blk.29.", "token_embd", "output_norm")):
            continue
        ours = _decode(path, t).numpy()
        theirs = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32)
        assert ours.tobytes() == theirs.reshape(ours.shape).tobytes(), t.name
        types.add(t.tensor_type.name)
    assert types == {"F32", "Q4_1", "Q8_0"}  # every type the file holds went through it


# -- the CUDA graph step's arithmetic, run eagerly on CPU (the capture itself needs a GPU: tests/test_gpu.py)
@pytest.mark.slow
@pytest.mark.parametrize("start,end", [(0, 3), (1, 3)])
def test_graph_body_matches_decode_path(start, end):
    """DecodeGraphs' step body (bucketed cache with an additive mask, rope and cache write from a
    position tensor) equals the eager decode path, across bucket sizes and a cache of odd length."""
    from strata.decode.graphs import DecodeGraphs
    eager, body = build(SMALL, 600, start=start, end=end), build(SMALL, 600, start=start, end=end)
    dg = DecodeGraphs(body)
    assert [dg.bucket(p) for p in (0, 255, 256, 511, 512, 599)] == [256, 256, 512, 512, 600, 600]
    g = torch.Generator().manual_seed(8)
    if start == 0:
        xs = torch.randint(0, SMALL.vocab_size, (1, 560), generator=g)
    else:
        xs = torch.randn(1, 560, SMALL.dim, generator=g)
    assert torch.equal(eager(xs[:, :240], 0), body(xs[:, :240], 0))
    with torch.inference_mode():
        for p in list(range(240, 270)) + list(range(500, 520)):
            if p == 500:  # fill 270..499 in both caches alike
                eager(xs[:, 270:500], 270), body(xs[:, 270:500], 270)
            a = eager(xs[:, p:p + 1], p)
            (dg.ids if dg.ids is not None else dg.res).copy_(xs[:, p:p + 1].reshape(-1) if start == 0
                                                               else xs[:, p:p + 1])
            dg.pos.fill_(p)
            b = dg._body(dg.bucket(p))[0]
            assert rel(b, a) < 1e-5, p
            for blk_a, blk_b in zip(eager.layers.values(), body.layers.values()):
                assert rel(blk_b.attn.k_cache[:, :, p], blk_a.attn.k_cache[:, :, p]) < 1e-5


def test_load_stage_decode_weights():
    from strata.weights.checkpoint import load_stage, model_args
    args = model_args("synthetic:smoke")
    m = load_stage("synthetic:smoke", args, 0, 4, device="cpu", dtype=torch.float32, max_len=16, decode_weights="int8")
    assert m.decode_weights == "int8" and set(m._weight_only) == {"0", "1", "2", "3"}
    assert load_stage("synthetic:smoke", args, 4, 8, device="cpu", dtype=torch.float32, max_len=16).decode_weights is None


# -- resident layers made dense within a memory budget -------------------------------------------------
def test_densify_resident_layers_same_bits():
    import hashlib
    args = PRESETS["smoke"]

    def resident():
        with torch.device("meta"):
            m = Transformer(args)
        m.load_weights(synthetic_tensors(args, 0, args.n_layers, "cpu", torch.float32, seed=0, qtype="Q4_0",
                                         resident=True), "cpu", torch.float32)
        m.setup_cache(80)
        return m

    ids = torch.randint(0, args.vocab_size, (1, 80), generator=torch.Generator().manual_seed(9))

    def md5(m):
        h = torch.cat([m(ids[:, :64], 0), m(ids[:, 64:65], 64), m(ids[:, 65:80], 65)], dim=1)
        return hashlib.md5(h.numpy().tobytes()).hexdigest()

    ref = md5(resident())
    some, whole = resident(), resident()
    per = args.layer_param_count() * 4 - 2 * args.dim * 4
    assert some.densify(3 * per + 10) == 3
    assert [type(b.weights).__name__ for b in some.layers.values()].count("DenseMatrices") == 3
    assert whole.densify(1 << 40) == args.n_layers and whole.densify(1 << 40) == 0
    assert md5(some) == ref and md5(whole) == ref


def test_decode_rope_table_same_bits_as_rope():
    """The CPU decode path's rope rows come from a table grown by doubling: the bits rope(pos, T) makes."""
    from strata.kernels.attention import _signed_sin
    m = build(SMALL, 8)
    for dtype in (torch.float32, torch.bfloat16):
        for pos in (0, 1, 255, 256, 300, 4095, 70000):
            for T in (1, DECODE_T):
                cos, sin = m._decode_rope(pos, T, dtype, torch.device("cpu"))
                c2, s2 = m.rope(pos, T, dtype)
                assert torch.equal(cos, c2[:, None]) and torch.equal(sin, _signed_sin(s2[:, None])), (pos, T)
    assert m._rope_table[0].shape[0] == 1 << 17  # 70,004 positions: the next power of two


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp8_cache_widens_by_its_bits_to_the_cast(dtype):
    """strata.kernels.attention.from_cache on a CPU e4m3 cache: the bits of torch's cast for every code but NaN, on a
    narrowed (non-contiguous) view as attention reads the prefix."""
    from strata.kernels.attention import from_cache
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # S.1111.111 is e4m3fn's NaN, which to_cache never stores
    cache = codes.repeat(13)[: 2 * 192 * 8].view(1, 2, 192, 8).view(torch.float8_e4m3fn)  # every code, repeated
    view = cache[:, :, 5:150]
    assert not view.is_contiguous()
    got, want = from_cache(view, dtype), view.to(dtype)
    assert got.dtype == dtype and torch.equal(got.view(torch.int16 if dtype != torch.float32 else torch.int32),
                                              want.view(torch.int16 if dtype != torch.float32 else torch.int32))


def slotted_stages(d, args, prompts, **kw):
    """The model at d as two stages (layers [0, 2) and the rest), with a slot of 96 positions for each prompt,
    each prompt prefilled into its slot (also tests/test_gpu.py's, on CUDA)."""
    from strata.weights.checkpoint import load_stage
    s0, s1 = load_stage(d, args, 0, 2, max_len=96, **kw), load_stage(d, args, 2, args.n_layers, max_len=96, **kw)
    for s in (s0, s1):
        s.setup_cache(96, seqs=len(prompts))
    with torch.inference_mode():
        for slot, ids in enumerate(prompts):
            s0.use_slot(slot), s1.use_slot(slot)
            s1(s0(ids, 0), 0)
    return s0, s1


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "mistral", "gpt_oss", "qwen3_5", "qwen3_5_moe"])
def test_several_sequences_as_rows_match_each_step_alone(tmp_path, family):
    """Transformer.decode_seqs through torch (no C decoder): three sequences in their own slots at other positions,
    past the window where the family has one (a ring cache), as one batch of rows: each row within float32 rounding
    of its step alone, the same argmax; with batch_rows off (decode_batch: steps) each row is its step alone exactly.
    q/k norms, windows and their rope, sinks, experts and softcaps go through the same per-row attention; qwen3_5's
    linear layers step each row from its slot's states (GatedDeltaNet.mix_rows)."""
    from families_fixtures import make_hf
    from strata.weights.checkpoint import model_args
    _, d = make_hf(tmp_path, family)
    args = model_args(d)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, args.vocab_size, (1, n), generator=g) for n in (40, 9, 27)]  # 40, 27: past windows
    (b0, b1), (a0, a1), (e0, e1) = (slotted_stages(d, args, prompts, device="cpu", dtype=torch.float32)
                                    for _ in range(3))
    e0.batch_rows = e1.batch_rows = False
    assert "torch's products" in b1.decode_batch_kind() and "decode_batch: steps" in e1.decode_batch_kind()
    tok, pos = [5, 17, 101], [p.shape[1] for p in prompts]
    for order in ([0, 1, 2], [2, 0], [1, 2, 0], [0, 1, 2], [2, 1, 0]):
        x = torch.tensor([tok[s] for s in order])
        at = [pos[s] for s in order]
        with torch.inference_mode():
            h, _, _ = b0.decode_seqs(x, order, at)
            out, logits, am = b1.decode_seqs(h, order, at)
            he, _, _ = e0.decode_seqs(x, order, at)
            oute, logitse, ame = e1.decode_seqs(he, order, at)
            for t, s in enumerate(order):
                a0.use_slot(s), a1.use_slot(s)
                h1 = a0.decode_step(torch.tensor([[tok[s]]]), pos[s])
                o1, lg1, am1 = a1.decode_token(h1, pos[s])
                assert torch.equal(he[t], h1.view(-1)) and torch.equal(logitse[t], lg1), (family, order, t)
                assert torch.allclose(h[t], h1.view(-1), rtol=1e-4, atol=1e-4), (family, order, t)
                assert torch.allclose(logits[t], lg1, rtol=1e-4, atol=1e-4), (family, order, t)
                assert int(am[t]) == int(am1) == int(ame[t])
                tok[s], pos[s] = int(am1), pos[s] + 1


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "mistral", "gpt_oss", "qwen3_moe", "qwen3_5"])
def test_prefill_group_matches_each_chunk_alone(tmp_path, family):
    """Transformer.forward_group: three sequences' chunks (a first chunk, and later chunks past a window where the
    family has one) as one prefill group on two stages: each sequence's rows within float32 rounding of its chunk
    alone in its slot, its caches holding what the chunk alone writes, and the other slots' caches untouched.
    A hybrid model (qwen3_5) is refused in one line, nothing run."""
    from families_fixtures import make_hf
    from strata.weights.checkpoint import load_stage, model_args
    _, d = make_hf(tmp_path, family)
    args = model_args(d)
    if args.group_refusal() is not None:
        s0 = load_stage(d, args, 0, 2, max_len=96, device="cpu", dtype=torch.float32)
        s0.setup_cache(96, seqs=2)
        with pytest.raises(ValueError, match="a prefill group: linear-attention layers"):
            s0.forward_group(torch.zeros(1, 3, dtype=torch.long), [(0, 0, 2), (1, 0, 1)])
        return
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, args.vocab_size, (1, n), generator=g) for n in (40, 9, 27, 11)]
    (a0, a1), (b0, b1) = (slotted_stages(d, args, prompts[:3], device="cpu", dtype=torch.float32) for _ in range(2))
    # the group: slot 2's next 11 rows at 27, slot 0's 5 at 40, and slot 1 prefilled again from 0 (a first chunk)
    segs = [(2, 27, 11), (0, 40, 5), (1, 0, 9)]
    rows = [prompts[3][:, :11], prompts[3][:, :5], prompts[1]]
    with torch.inference_mode():
        h = b1.forward_group(b0.forward_group(torch.cat(rows, 1), segs), segs)
        o = 0
        for (slot, pos, n), x in zip(segs, rows):
            a0.use_slot(slot), a1.use_slot(slot)
            alone = a1(a0(x, pos), pos)
            assert torch.allclose(h[:, o:o + n], alone, rtol=1e-4, atol=1e-4), (family, slot)
            o += n
    for ma, mb in ((a0, b0), (a1, b1)):
        for slot in range(3):
            for i in ma.layers:
                for ca, cb in zip(ma._slots[slot][i], mb._slots[slot][i]):
                    assert torch.allclose(ca, cb, rtol=1e-4, atol=1e-4), (family, slot, i)
        assert ma.slot == 1 and mb.slot == 2  # (the group leaves the slot in use as it was)
    with pytest.raises(ValueError, match="outside its cache"):
        b0.forward_group(torch.zeros(1, 2, dtype=torch.long), [(0, 95, 2)])


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_linear_states_a_slot_each(tmp_path, family):
    """A hybrid model (Gated DeltaNet layers) with three slots: the prompts' chunks and then their decode steps
    taken in turns across the slots, on two stages split inside the model, give every sequence the bits it gets
    alone in a one-slot model: each slot keeps its own recurrent states (and where they stand), as its own KV."""
    from families_fixtures import make_hf
    from strata.weights.checkpoint import load_stage, model_args
    _, d = make_hf(tmp_path, family)
    args = model_args(d)
    assert any(args.linear_layers)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, args.vocab_size, (1, n), generator=g) for n in (21, 9, 30)]
    chunk, steps = 8, 5

    def stages(seqs):
        s = [load_stage(d, args, 0, 2, max_len=96, device="cpu", dtype=torch.float32),
             load_stage(d, args, 2, args.n_layers, max_len=96, device="cpu", dtype=torch.float32)]
        for m in s:
            m.setup_cache(96, seqs=seqs)
        return s

    def run(s, slot, x, pos):
        for m in s:
            m.use_slot(slot)
        with torch.inference_mode():
            return s[1](s[0](x, pos), pos)

    def first(s, h):  # the prompt's first token, from its last chunk's last row
        with torch.inference_mode():
            return int(s[1].logits(h[0, -1]).argmax())

    alone = []
    for ids in prompts:  # each in a fresh one-slot pair: its chunks, then its greedy steps
        s = stages(1)
        outs = [run(s, 0, ids[:, p:p + chunk], p) for p in range(0, ids.shape[1], chunk)]
        tok, pos = first(s, outs[-1]), ids.shape[1]
        for _ in range(steps):
            with torch.inference_mode():
                h, _, am = s[1].decode_token(s[0].decode_step(torch.tensor([[tok]]), pos), pos)
            outs.append(h)
            tok, pos = int(am), pos + 1
        alone.append(outs)
    s = stages(3)
    assert s[0].state_bytes == 3 * stages(1)[0].state_bytes > 0
    for m in s:  # (decode_batch steps: each row its step alone, bit for bit; rows: the test above, within rounding)
        m.batch_rows = False
    assert "decode_batch: steps" in s[1].decode_batch_kind()
    got = [[] for _ in prompts]
    at = [0] * len(prompts)
    while any(p < ids.shape[1] for p, ids in zip(at, prompts)):  # one chunk a slot a turn, the short prompt done first
        for slot, ids in enumerate(prompts):
            if at[slot] < ids.shape[1]:
                got[slot].append(run(s, slot, ids[:, at[slot]:at[slot] + chunk], at[slot]))
                at[slot] += chunk
    tok = [first(s, o[-1]) for o in got]
    pos = [ids.shape[1] for ids in prompts]
    order = [2, 0, 1]
    for _ in range(steps):  # a decode batch of the three, stepped one after another
        x, at = torch.tensor([tok[i] for i in order]), [pos[i] for i in order]
        with torch.inference_mode():
            h, _, am = s[1].decode_seqs(s[0].decode_seqs(x, order, at)[0], order, at)
        for t, slot in enumerate(order):
            got[slot].append(h[t].view(1, 1, -1))
            tok[slot], pos[slot] = int(am[t]), pos[slot] + 1
    for slot in range(len(prompts)):
        assert len(got[slot]) == len(alone[slot])
        for k, (a, b) in enumerate(zip(got[slot], alone[slot])):
            assert torch.equal(a[0, -1], b[0, -1]), (family, slot, k, a.shape, b.shape)
