"""strata.quant against gguf-py: bit-exact dequantization of Q4_0..Q8_0, K-quants, IQ4; random_blocks."""
from __future__ import annotations

import warnings

import gguf
import numpy as np
import pytest
import torch

import strata.quant as Q
from strata.quant import blocks, random as qrandom

MINE = tuple(blocks.DEQUANT)  # the types this module implements (the IQ grid types live in iq.py)
T = gguf.GGMLQuantizationType

# fp16 scale values that must poison or pass through exactly as in numpy: NaNs with payloads and
# either sign (quiet and signalling), infinities, a subnormal, signed zero, the largest finite.
SPECIAL_F16 = (0x7E01, 0xFD55, 0x7C01, 0xFC02, 0x7C00, 0xFC00, 0x0001, 0x83FF, 0x8000, 0x7BFF)


def gguf_ref(b: torch.Tensor, name: str) -> np.ndarray:
    with warnings.catch_warnings():  # NaN/inf scales make numpy warn
        warnings.simplefilter("ignore", RuntimeWarning)
        return gguf.quants.dequantize(b.numpy(), T[name])


def assert_bits_equal(got: torch.Tensor, ref: np.ndarray):
    assert got.dtype == torch.float32 and tuple(got.shape) == ref.shape
    g, r = got.numpy().view(np.uint32), np.ascontiguousarray(ref, dtype=np.float32).view(np.uint32)
    bad = np.flatnonzero(g != r)
    assert bad.size == 0, (f"{bad.size} of {g.size} weights differ, first at {bad[0]}: "
                           f"{g.flat[bad[0]]:#010x} != gguf {r.flat[bad[0]]:#010x}")


def with_special_scales(b: torch.Tensor, name: str) -> torch.Tensor:
    """Rows of blocks whose fp16 fields take each SPECIAL_F16 value, paired so both d and min vary."""
    b = b.clone().view(-1, Q.type_size(name))
    fields = [off for off, _ in qrandom._FIELDS[name]]
    for i, v in enumerate(SPECIAL_F16):
        for j, off in enumerate(fields):  # the min gets a different special than d
            w = SPECIAL_F16[(i + 3 * j) % len(SPECIAL_F16)]
            b[i, off], b[i, off + 1] = w & 0xFF, w >> 8
    return b


@pytest.mark.parametrize("name", MINE)
@pytest.mark.parametrize("lead", [(), (6,), (2, 3)])
def test_bit_exact_random_bytes(name, lead):
    g = torch.Generator().manual_seed(hash((name, lead)) % 2**31)
    ts = Q.type_size(name)
    n_rows = int(np.prod(lead)) if lead else 1
    per_row = 300 // n_rows
    b = torch.randint(0, 256, (n_rows * per_row, ts), generator=g, dtype=torch.uint8)
    b = with_special_scales(b, name).reshape(*lead, per_row * ts)
    ref = gguf_ref(b, name)
    assert np.isnan(ref).any() and np.isinf(ref).any(), "the input should exercise NaN and inf scales"
    got = Q.dequantize(b, name)
    assert_bits_equal(got, ref)
    assert Q.dequantize(b, Q.qtype_of(name)).view(torch.int32).equal(got.view(torch.int32))  # enum = name


@pytest.mark.parametrize("name", MINE)
def test_bit_exact_in_row_batches(name, monkeypatch):
    """Tensors bigger than one batch are cut in pieces; the seams must not show."""
    monkeypatch.setitem(Q._CHUNK_WEIGHTS, "cpu", 3 * Q.block_size(name))
    g = torch.Generator().manual_seed(1)
    b = torch.randint(0, 256, (5, 4 * Q.type_size(name)), generator=g, dtype=torch.uint8)
    assert_bits_equal(Q.dequantize(b, name), gguf_ref(b, name))


@pytest.mark.parametrize("name", ["F32", "F16", "BF16"])
def test_plain_types_pass_through(name):
    g = torch.Generator().manual_seed(2)
    b = torch.randint(0, 256, (3, 64), generator=g, dtype=torch.uint8)
    if name == "F16":  # NaN payloads must survive the conversion
        b.view(torch.int16).view(-1)[:len(SPECIAL_F16)] = torch.tensor(SPECIAL_F16, dtype=torch.int32).to(torch.int16)
    ref = b.numpy().view(np.float32) if name == "F32" else gguf_ref(b, name)
    assert_bits_equal(Q.dequantize(b, name), ref)


def test_smollm2_every_tensor_bit_exact():
    from strata.weights.checkpoint import smollm2_path
    reader = gguf.GGUFReader(smollm2_path())
    kinds = set()
    prev = torch.get_num_threads()
    torch.set_num_threads(1)  # small tensors: thread hand-offs cost more than they save on a busy CI box
    try:
        for t in reader.tensors:
            raw = np.asarray(t.data).view(np.uint8)
            blocks_t = torch.from_numpy(raw.copy())
            ref = raw.view(np.float32) if t.tensor_type == T.F32 else gguf_ref(blocks_t, t.tensor_type.name)
            got = Q.dequantize(blocks_t, t.tensor_type)
            assert got.numel() == int(np.prod(t.shape)), t.name
            assert_bits_equal(got, ref)
            kinds.add(t.tensor_type.name)
    finally:
        torch.set_num_threads(prev)
    assert {"Q4_1", "Q8_0", "F32"} <= kinds


# -- the contract -----------------------------------------------------------------------------------
def test_sizes_and_names():
    for name in MINE + ("F16", "IQ3_S"):
        assert (Q.block_size(name), Q.type_size(name)) == gguf.constants.GGML_QUANT_SIZES[T[name]]
    assert Q.qtype_of("q4_k") is T.Q4_K and Q.qtype_of(T.Q6_K) is T.Q6_K and Q.qtype_of(int(T.Q8_0)) is T.Q8_0
    assert set(MINE) <= set(Q.SUPPORTED) and {"F32", "F16", "BF16"} <= set(Q.SUPPORTED)
    assert set(Q.SUPPORTED) == {"F32", "F16", "BF16"} | set(Q.DEQUANT)  # only what is registered
    from strata.quant import iq
    assert set(iq.DEQUANT) <= set(Q.SUPPORTED)


def test_errors():
    b = torch.zeros((2, 68), dtype=torch.uint8)
    with pytest.raises(ValueError, match="Q9_9"):
        Q.dequantize(b, "Q9_9")
    with pytest.raises(ValueError, match="unknown"):
        Q.qtype_of(12345)
    for unsupported in ("Q8_K", "TQ1_0", "I32"):
        with pytest.raises(ValueError, match=unsupported):
            Q.dequantize(b, unsupported)
    with pytest.raises(ValueError, match="multiple"):
        Q.dequantize(torch.zeros((2, 35), dtype=torch.uint8), "Q8_0")
    with pytest.raises(ValueError, match="uint8"):
        Q.dequantize(torch.zeros((2, 34), dtype=torch.int8), "Q8_0")
    assert Q.dequantize(b, "Q8_0").shape == (2, 64)
    assert Q.dequantize(torch.zeros((3, 0), dtype=torch.uint8), "Q4_K").shape == (3, 0)


# -- random_blocks ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(qrandom._FIELDS) + ["F32", "F16", "BF16", "MXFP4"])
def test_random_blocks_valid(name):
    bs = Q.block_size(name)
    rows, cols = 16, 4 * max(bs, 32)
    b = Q.random_blocks(name, rows, cols, torch.Generator().manual_seed(3), "cpu")
    assert b.dtype == torch.uint8 and tuple(b.shape) == (rows, cols // bs * Q.type_size(name))
    again = Q.random_blocks(name, rows, cols, torch.Generator().manual_seed(3), "cpu")
    assert b.equal(again)
    w = gguf_ref(b, name) if name not in ("F32",) else b.numpy().view(np.float32)  # gguf-py: every type
    assert w.shape == (rows, cols)
    assert np.isfinite(w).all()
    assert 1e-3 < float(w.std()) < 1e-1, float(w.std())
    assert abs(float(w.mean())) < 0.5 * float(w.std())
    if name in Q.SUPPORTED:
        assert_bits_equal(Q.dequantize(b, name), np.ascontiguousarray(w, dtype=np.float32))


def test_random_blocks_rejects_bad_columns():
    with pytest.raises(ValueError, match="multiple"):
        Q.random_blocks("Q4_K", 2, 100, torch.Generator(), "cpu")


# -- CUDA ------------------------------------------------------------------------------------------
# Math that is one multiply per weight (or two chained multiplies) is exact on any IEEE device;
# d*q + m may be fused into an FMA there, which rounds once instead of twice.
_FMA_FREE = {"Q4_0", "Q5_0", "Q8_0", "Q3_K", "Q6_K", "IQ4_NL", "IQ4_XS", "F32", "F16", "BF16"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", Q.SUPPORTED)
def test_cuda_matches_cpu(name):
    bs = Q.block_size(name)
    cols = 8 * max(bs, 32)
    b = Q.random_blocks(name, 64, cols, torch.Generator().manual_seed(4), "cpu")
    cpu = Q.dequantize(b, name)
    gpu = Q.dequantize(b.cuda(), name)
    assert gpu.device.type == "cuda" and gpu.dtype == torch.float32 and gpu.shape == cpu.shape
    gpu = gpu.cpu()
    if name in _FMA_FREE:
        assert gpu.view(torch.int32).equal(cpu.view(torch.int32))
    else:
        assert float((gpu - cpu).abs().max()) <= 1e-6 * float(cpu.abs().max())
    # random_blocks made on the device is valid there too
    g = torch.Generator(device="cuda").manual_seed(5)
    w = Q.dequantize(Q.random_blocks(name, 16, cols, g, "cuda"), name)
    assert bool(torch.isfinite(w).all()) and 1e-3 < float(w.std()) < 1e-1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ3_S", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4"])
def test_cuda_dequantize_into_matches_cpu(name):
    """The resident prefill's Triton dequantization (strata.quant.into) gives the CPU torch path's bits: float32
    (same operations, no contraction) and bfloat16 (one round to nearest even), at a 70B layer's width."""
    from strata.quant import into
    b = Q.random_blocks(name, 64, 8192, torch.Generator().manual_seed(6), "cpu")
    cpu = Q.dequantize(b, name)
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.empty(64, 8192, device="cuda", dtype=dtype)
        assert into.takes(name, out) and into.dequantize_into(out, b.cuda(), name)
        assert out.cpu().equal(cpu.to(dtype)), dtype


# -- bench/make_gguf.py -------------------------------------------------------------------------------
def _make_gguf():
    import importlib.util
    import sys
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "bench" / "make_gguf.py"
    spec = importlib.util.spec_from_file_location("make_gguf", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["make_gguf"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
@pytest.mark.parametrize("preset,qtype,layers", [("smoke", "Q4_1", None), ("smoke", "IQ3_S", 2),
                                                  ("smoke-wide", "Q4_K", 1), ("smoke-wide", "Q4_K_M", 1)])
def test_make_gguf_file_loads(tmp_path, preset, qtype, layers):
    import dataclasses
    from strata.models.args import PRESETS
    from strata.weights.checkpoint import model_args, slice_tensors
    mg = _make_gguf()
    out = tmp_path / "m.gguf"
    argv = ["--preset", preset, "--qtype", qtype, "--out", str(out), "--seed", "7"]
    assert mg.main(argv + (["--layers", str(layers)] if layers else [])) == 0
    want = PRESETS[preset] if layers is None else dataclasses.replace(PRESETS[preset], n_layers=layers)

    reader = gguf.GGUFReader(out)
    got = {t.name: t for t in reader.tensors}
    planned = mg.plan(want, qtype)
    assert list(got) == [p.name for p in planned]
    assert f"blk.{want.n_layers - 1}.ffn_down.weight" in got and "output.weight" in got
    role = {"attn_v": "wv", "ffn_down": "w_down", "output": "head"}
    for p in planned:
        t = got[p.name]
        assert tuple(int(d) for d in reversed(t.shape.tolist())) == p.shape, p.name  # GGUF dims are fastest-first
        # the type asked for (a mix: Q6_K for attn_v, ffn_down and the head) wherever whole blocks fit a row,
        # Q8_0 elsewhere; norms F32
        cols, q = p.shape[-1], Q.mix_type(qtype, role.get(p.name.split(".")[-2], ""))
        expect = "F32" if len(p.shape) == 1 else (q if cols % Q.block_size(q) == 0 else "Q8_0")
        assert t.tensor_type.name == expect, p.name
    down = Q.mix_type(qtype, "w_down")
    assert got["blk.0.ffn_down.weight"].tensor_type.name == down  # the type is really used
    if qtype in Q.MIXES:
        assert {t.tensor_type.name for t in reader.tensors} == {"F32", *Q.MIXES[qtype]}

    from strata.weights.gguf_loader import field_value
    assert field_value(reader, "tokenizer.ggml.model") == "none"  # llama.cpp: dummy tokens
    assert field_value(reader, "llama.vocab_size") == want.vocab_size
    assert field_value(reader, "tokenizer.ggml.tokens") is None

    args = model_args(str(out))  # Strata reads the shape back without a vocabulary
    for f in ("arch", "vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim",
              "rope_theta", "rope_scaling", "max_seq_len", "tie_embeddings", "qkv_bias"):
        assert getattr(args, f) == getattr(want, f), f
    assert args.norm_eps == pytest.approx(want.norm_eps)
    w = slice_tensors(str(out), args, 0, args.n_layers)  # and loads every tensor
    for name, x in w.items():
        assert bool(torch.isfinite(x).all()), name
        if not name.endswith("norm"):
            assert 5e-3 < float(x.std()) < 5e-2, name
    raw = torch.from_numpy(np.array(got["blk.0.ffn_down.weight"].data).view(np.uint8))
    if down in Q.SUPPORTED:  # Strata's torch path reads the same weights as its gguf-py path
        assert Q.dequantize(raw, down).equal(w["layers.0.w_down"])


@pytest.mark.slow
def test_make_gguf_with_a_vocabulary_takes_text(tmp_path):
    """--vocab: the random file takes SmolLM2's tokenizer, padded to the preset's vocabulary with <extra_N> tokens
    (here smoke-wide's 2,048 < 49,152 is refused in one line, as a file that is no GGUF or is missing, and --out is
    left as it was; llama-3-8b's 128,256 with one layer
    is 0.8 GiB, so the padding is checked on a vocabulary-only file, which --vocab-only writes and --vocab takes).
    Strata's tokenizer from the file encodes and decodes text as SmolLM2's own, and the chat template comes along."""
    from strata.weights.checkpoint import smollm2_path
    from strata.text.tokenizer import Tokenizer
    try:
        smollm2_path()
    except Exception as e:  # noqa: BLE001
        pytest.skip(str(e))
    mg = _make_gguf()
    (tmp_path / "kept.gguf").write_bytes(b"an earlier file")
    for bad in ("smollm2", str(tmp_path / "kept.gguf"), str(tmp_path / "none.gguf")):
        with pytest.raises(SystemExit):
            mg.main(["--preset", "smoke-wide", "--vocab", bad, "--out", str(tmp_path / "kept.gguf")])
    assert (tmp_path / "kept.gguf").read_bytes() == b"an earlier file"
    vocab = tmp_path / "vocab.gguf"
    assert mg.main(["--preset", "smoke", "--vocab", "smollm2", "--vocab-only", "--out", str(vocab)]) == 0
    assert vocab.stat().st_size < 4 << 20 and not gguf.GGUFReader(vocab).tensors
    w = gguf.GGUFWriter(str(tmp_path / "padded.gguf"), "llama")
    assert mg.add_vocab(w, vocab, 50_000) == 49_152
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    from strata.weights.gguf_loader import field_value
    tokens = field_value(gguf.GGUFReader(tmp_path / "padded.gguf"), "tokenizer.ggml.tokens")
    assert len(tokens) == 50_000 and tokens[49_152] == "<extra_49152>" and tokens[-1] == "<extra_49999>"
    mine, theirs = Tokenizer.from_gguf(tmp_path / "padded.gguf"), Tokenizer.for_model("smollm2")
    text = "def f(x):\n    return x * 2  # Ünïcödé"
    assert mine.encode(text) == theirs.encode(text) and mine.decode(mine.encode(text)) == text
    assert mine.decode([49_999]) == "<extra_49999>"
    assert field_value(gguf.GGUFReader(tmp_path / "padded.gguf"), "tokenizer.chat_template") == \
        field_value(gguf.GGUFReader(smollm2_path()), "tokenizer.chat_template")


def test_make_gguf_llama3_rope_freqs(tmp_path):
    """A preset with Llama-3 rope scaling gets llama.cpp's rope_freqs tensor, which Strata decodes back."""
    import dataclasses
    from strata.models.args import PRESETS
    from strata.weights.checkpoint import model_args
    mg = _make_gguf()
    scaling = PRESETS["llama-3-8b"].rope_scaling
    want = dataclasses.replace(PRESETS["smoke"], n_layers=1, rope_theta=500000.0, rope_scaling=scaling)
    out = tmp_path / "r.gguf"
    mg.write(out, want, "Q8_0", seed=1)
    assert model_args(str(out)).rope_scaling == scaling


def test_make_gguf_70b_plan_size():
    """The 70B plan: 80 layers of the right widths, about 3.4 bits per weight in IQ3_S (~28 GiB)."""
    from strata.models.args import PRESETS
    mg = _make_gguf()
    args = PRESETS["llama-3-70b"]
    planned = mg.plan(args, "IQ3_S")
    assert len(planned) == 2 + 1 + 9 * 80 + 1  # embed, rope_freqs, layers, norm, head
    weights = sum(int(np.prod(p.shape)) for p in planned)
    assert 70.4e9 < weights < 70.7e9  # Llama-3-70B: 70.6 B parameters
    size = sum(mg.nbytes(p) for p in planned)
    assert 26 * 2**30 < size < 30 * 2**30, size / 2**30


def test_mxfp4_bit_exact_against_gguf_py():
    """gpt-oss's MXFP4 blocks: random nibbles under every exponent byte (0 and 1: ggml's subnormal halves; 255),
    in one call and cut in row batches: gguf-py's bits."""
    g = torch.Generator().manual_seed(17)
    b = torch.randint(0, 256, (512, 17), generator=g, dtype=torch.uint8)
    b[:256, 0] = torch.arange(256, dtype=torch.uint8)
    ref = gguf_ref(b.view(8, -1), "MXFP4")
    assert_bits_equal(Q.dequantize(b.view(8, -1), "MXFP4"), ref)
    ref3 = gguf_ref(b.view(2, 4, -1), "MXFP4")  # an expert stack: (experts, rows, bytes)
    assert_bits_equal(Q.dequantize(b.view(2, 4, -1), "MXFP4"), ref3)


def test_mxfp4_split_layout_bit_exact_against_gguf_py():
    """The split layout the resident MXFP4 stacks are re-laid into (strata.quant.mxfp4.to_split): the same byte
    count (the nibbles and the exponents moved, not changed), the file's back from it, and its values gguf-py's
    bits, every exponent byte included; the torch dequantization of a split stack (strata.models.resident.dequantize_into's
    path where no kernel runs, an expert at a time and in row pieces) too; shapes split_ok refuses."""
    from strata.quant import mxfp4
    from strata.models import resident
    g = torch.Generator().manual_seed(23)
    b = torch.randint(0, 256, (3 * 32 * 3, 17), generator=g, dtype=torch.uint8)  # 3 experts, 32 rows of 3 blocks
    b[:256, 0] = torch.arange(256, dtype=torch.uint8)
    st = b.view(3, 32, 51)
    sp = mxfp4.to_split(st)
    assert sp.shape == st.shape and not torch.equal(sp, st)
    nibbles = lambda t: torch.cat((t & 15, t >> 4)).sort()[0]  # noqa: E731
    assert torch.equal(nibbles(sp[1].flatten()[:16 * 96]), nibbles(st[1].reshape(96, 17)[:, 1:].flatten()))
    assert torch.equal(sp[1].flatten()[16 * 96:], st[1].reshape(96, 17)[:, 0])  # the exponents after the nibbles
    assert torch.equal(mxfp4.from_split(sp), st)
    ref = gguf_ref(st, "MXFP4")
    assert_bits_equal(mxfp4.mxfp4_split(sp), ref)
    out = torch.empty(64, 96)
    old = resident.DEQUANT_PIECE
    resident.DEQUANT_PIECE = 5 * 96  # 5 rows a piece: pieces within an expert of 32 rows
    try:
        resident.dequantize_into(out, sp[1:], "MXFP4", 96, slab=96)
    finally:
        resident.DEQUANT_PIECE = old
    assert_bits_equal(out.view(2, 32, 96), ref[1:])
    assert mxfp4.split_ok(12, 96) and mxfp4.split_ok(2880, 2880) and not mxfp4.split_ok(3, 96)
    assert not mxfp4.split_ok(4, 48)


INTO_MXFP4 = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
import strata.quant as Q
from strata.quant import into
b = Q.random_blocks("MXFP4", 6, 256, torch.Generator().manual_seed(6), "cpu")
b[0, 0] = 0  # the subnormal exponents
b[1, 17] = 1
cpu = Q.dequantize(b, "MXFP4")
out = torch.empty(6, 256, dtype=torch.float32)  # (the interpreter truncates to bfloat16: that is the GPU test's)
assert into.takes("MXFP4", out) and into.dequantize_into(out, b, "MXFP4")
assert out.view(torch.int32).equal(cpu.view(torch.int32))
sp = Q.mxfp4.to_split(b.view(3, 2, -1))  # 3 experts of 2 rows (16 blocks an expert), split: the same values
out.fill_(float("nan"))
assert into.dequantize_into(out, sp, "MXFP4", slab=16)
assert out.view(torch.int32).equal(cpu.view(torch.int32))
print("ok")
"""


def test_mxfp4_into_kernel_interpreted():
    """The Triton MXFP4 dequantization (gpt-oss's experts into the scratch), under Triton's interpreter on CPU:
    the torch path's float32 bits (which are gguf-py's), subnormal exponents included; from the split layout too."""
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-c", INTO_MXFP4, str(root)], env=dict(os.environ, TRITON_INTERPRET="1"),
                       capture_output=True, text=True, timeout=300, cwd=root)
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stdout + r.stderr[-3000:]


class _Launch:
    """Stands in for a jitted strata.quant.into kernel (`kernel[grid](blocks, out, n, ...)`): counts its launches,
    fails them where told, else writes the torch path's values."""

    def __init__(self, fail: bool, qtype: str):
        self.fail, self.qtype, self.launches = fail, qtype, 0

    def __getitem__(self, grid):
        def launch(flat, out, n, **kw):
            self.launches += 1
            if self.fail:
                raise RuntimeError("this Triton cannot build it")
            out.view(-1).copy_(Q.dequantize(flat, self.qtype).view(-1))
        return launch


def test_a_failed_into_kernel_falls_back_on_its_holder_only(monkeypatch, caplog):
    """strata.quant.into's fallback is state on the caller's TritonState: the holder whose kernel failed says so
    once, its `takes` say no from then on and strata.models.resident.dequantize_into takes the torch path (the same
    values); another holder, and a call without one, still launch. The kernels run on CPU tensors as under the
    interpreter, stood in for."""
    pytest.importorskip("triton")
    from strata.models import resident
    from strata.quant import into
    from strata.triton_state import TritonState
    monkeypatch.setattr(into, "INTERPRET", True)  # takes() accepts CPU tensors
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # and strata.models.resident asks it
    b = Q.random_blocks("Q8_0", 6, 64, torch.Generator().manual_seed(8))
    want = Q.dequantize(b, "Q8_0")
    failing = _Launch(fail=True, qtype="Q8_0")
    monkeypatch.setattr(into, "_q8_0_into", failing)
    a, c = TritonState(), TritonState()
    out = torch.full((6, 64), float("nan"))
    with caplog.at_level("WARNING", logger="strata.quant"):
        assert into.takes("Q8_0", out, a) and not into.dequantize_into(out, b, "Q8_0", a)
        assert resident.dequantize_into(out, b, "Q8_0", 64, a) is out and torch.equal(out, want)  # not tried again
    assert failing.launches == 1 and not a.into and a.kernels and a.iq3s
    assert not into.takes("Q8_0", out, a) and not into.takes("Q4_K", out, a)  # every type, for this holder
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == ["Q8_0 dequantization kernel failed"]
    working = _Launch(fail=False, qtype="Q8_0")
    monkeypatch.setattr(into, "_q8_0_into", working)
    for holder in (c, None):
        out = torch.full((6, 64), float("nan"))
        assert into.takes("Q8_0", out, holder) and resident.dequantize_into(out, b, "Q8_0", 64, holder) is out
        assert torch.equal(out, want)
    assert working.launches == 2 and c.into
    resident.dequantize_into(torch.empty(6, 64), b, "Q8_0", 64, a)
    assert working.launches == 2  # a stays on the torch path


INTO_TAILS = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
import strata.quant as Q
from strata.quant import into
g = torch.Generator().manual_seed(9)
cases = [("Q8_0", 3, 1120), ("Q4_0", 3, 224), ("Q4_1", 3, 224), ("Q5_0", 3, 224), ("Q5_1", 3, 224),
         ("Q4_K", 3, 1536), ("Q5_K", 3, 1536), ("Q6_K", 3, 1536), ("MXFP4", 5, 224)]
for name, rows, cols in cases:
    per = into.BLOCKS_OF.get(name, into.BLOCKS)
    b = Q.random_blocks(name, rows, cols, g, "cpu")
    n = b.numel() // Q.type_size(name)
    assert n > per and n % per, (name, n, per)  # several programs, the last part-filled
    out = torch.full((rows, cols), float("nan"))
    assert into.takes(name, out) and into.dequantize_into(out, b, name)
    assert out.view(torch.int32).equal(Q.dequantize(b, name).view(torch.int32)), name
# MXFP4's split layout: 3 experts of 16 blocks, so a program's blocks cross slabs, and its last is part-filled
b = Q.random_blocks("MXFP4", 6, 256, g, "cpu")
assert 48 > into.BLOCKS_OF["MXFP4"] and 48 % into.BLOCKS_OF["MXFP4"]
out = torch.full((6, 256), float("nan"))
assert into.dequantize_into(out, Q.mxfp4.to_split(b.view(3, 2, -1)).view(6, -1), "MXFP4", slab=16)
assert out.view(torch.int32).equal(Q.dequantize(b, "MXFP4").view(torch.int32))
print("ok")
"""


def test_into_kernels_fill_a_last_program_in_part_interpreted():
    """strata.quant.into at its blocks per program (BLOCKS, BLOCKS_OF), every type it takes but IQ3_S (its own
    kernel): several programs, the last part-filled (its masked lanes write nothing out of place), MXFP4's split
    layout with slabs across programs; the torch path's float32 bits."""
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-c", INTO_TAILS, str(root)], env=dict(os.environ, TRITON_INTERPRET="1"),
                       capture_output=True, text=True, timeout=600, cwd=root)
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stdout + r.stderr[-3000:]
