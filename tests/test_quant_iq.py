"""strata.quant.iq: the IQ grid types dequantize bit for bit like gguf-py (CPU), and CUDA agrees."""
import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from strata.quant import iq  # noqa: E402
from strata.triton_state import TritonState  # noqa: E402

TYPES = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M")
# fp16 scales every block type must survive: NaNs of both signs with payloads, infinities, zeros,
# subnormals, the largest finite value
SPECIAL_F16 = (0x7E00, 0xFE00, 0x7C01, 0xFD55, 0x7FFF, 0x7C00, 0xFC00, 0x0000, 0x8000, 0x0001, 0x83FF, 0x7BFF)


def sizes(name: str) -> tuple[int, int]:
    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]


def random_blocks(name: str, n: int, seed: int) -> np.ndarray:
    """n fully random blocks; the first and the last few get a special fp16 scale planted (the ends
    of a tensor take different vectorized / scalar-tail code paths)."""
    _, ts = sizes(name)
    raw = np.random.default_rng(seed).integers(0, 256, size=(n, ts), dtype=np.uint8)
    for i, h in [*enumerate(SPECIAL_F16[:n]), *((n - 1 - j, h) for j, h in enumerate(SPECIAL_F16[:n]))]:
        if name == "IQ1_M":  # d is the top nibbles of the 4 uint16 scale words (bytes 48..55)
            for k in range(4):
                raw[i, 49 + 2 * k] = (raw[i, 49 + 2 * k] & 0x0F) | (((h >> (4 * k)) & 0xF) << 4)
        else:
            raw[i, 0], raw[i, 1] = h & 0xFF, h >> 8
    return raw


def reference(raw: np.ndarray, name: str) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):
        return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name])


def assert_bits_equal(got: torch.Tensor, want: np.ndarray) -> None:
    got = got.numpy()
    assert got.dtype == np.float32 and got.shape == want.shape
    diff = got.view(np.uint32) != want.view(np.uint32)
    assert not diff.any(), (f"{diff.sum()} of {diff.size} weights differ, first at {np.argwhere(diff)[0]}: "
                            f"got {got[diff][:4]} want {want[diff][:4]}")


def test_registry_holds_exactly_the_iq_types():
    assert set(iq.DEQUANT) == set(TYPES)
    for name in TYPES:
        assert iq._TYPES[name][0] == sizes(name)[1] and sizes(name)[0] == iq.QK_K


@pytest.mark.parametrize("name", TYPES)
def test_bit_exact_vs_gguf(name):
    raw = random_blocks(name, 300, seed=sum(map(ord, name)))
    want = reference(raw, name)
    assert np.isnan(want).any() and np.isinf(want).any()  # the special scales reached the output
    got = iq.DEQUANT[name](torch.from_numpy(raw))
    assert got.shape == (300, 256)
    assert_bits_equal(got, want)


@pytest.mark.parametrize("name", TYPES)
def test_leading_dims_and_batches(name, monkeypatch):
    """(a, b, k blocks of bytes) like a gguf tensor's rows, split over several internal batches."""
    _, ts = sizes(name)
    raw = random_blocks(name, 3 * 2 * 5, seed=7).reshape(3, 2, 5 * ts)
    monkeypatch.setattr(iq, "BATCH_BLOCKS", 4)
    got = iq.DEQUANT[name](torch.from_numpy(raw))
    assert got.shape == (3, 2, 5 * 256)
    assert_bits_equal(got, reference(raw, name))


@pytest.mark.parametrize("name", TYPES)
def test_float_row_gather_path(name, monkeypatch):
    """The gather CUDA uses (float32 rows, big steps), run on the CPU: same bits."""
    raw = random_blocks(name, 50, seed=11)
    monkeypatch.setattr(iq, "COMPLEX_ROW_DEVICES", set())
    assert_bits_equal(iq.DEQUANT[name](torch.from_numpy(raw)), reference(raw, name))


def test_rejects_bad_input():
    f = iq.DEQUANT["IQ3_S"]
    with pytest.raises(ValueError, match="multiple of 110"):
        f(torch.zeros(2, 111, dtype=torch.uint8))
    with pytest.raises(TypeError, match="uint8"):
        f(torch.zeros(2, 110, dtype=torch.int8))
    assert f(torch.zeros(0, 110, dtype=torch.uint8)).shape == (0, 256)


class _Launch:
    """Stands in for iq._iq3_s_triton: counts its calls; fails them where told, else fills `out` by the torch path."""

    def __init__(self, fail: bool):
        self.fail, self.calls = fail, 0

    def __call__(self, flat, out):
        self.calls += 1
        if self.fail:
            raise RuntimeError("this Triton cannot build it")
        iq._iq3_s(flat, iq._tables(flat.device), out)


def test_a_failed_iq3_s_kernel_falls_back_on_its_holder_only(monkeypatch, caplog):
    """IQ3_S's Triton fallback is state on the caller's TritonState: the holder whose kernel failed says so once and
    takes the torch path from then on (no more launches); another holder, and a call without one, still launch.
    Blocks pass for CUDA ones here (the kernel is tried on CUDA only) and the kernel is stood in for."""
    if iq.triton is None:
        pytest.skip("triton is not installed")
    raw = torch.from_numpy(random_blocks("IQ3_S", 40, seed=5))
    want = reference(raw.numpy(), "IQ3_S")
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    failing = _Launch(fail=True)
    monkeypatch.setattr(iq, "_iq3_s_triton", failing)
    a, b = TritonState(), TritonState()
    f = iq.DEQUANT["IQ3_S"]
    with caplog.at_level("WARNING", logger="strata.quant"):
        got = [f(raw, a), f(raw, a)]  # the second not tried again
    monkeypatch.undo()
    for g in got:
        assert_bits_equal(g, want)  # the torch path's bits
    assert failing.calls == 1 and not a.iq3s and a.kernels
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == ["IQ3_S Triton kernel failed"]
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    working = _Launch(fail=False)
    monkeypatch.setattr(iq, "_iq3_s_triton", working)
    got = [f(raw, b), f(raw), f(raw, a)]
    monkeypatch.undo()
    assert working.calls == 2 and b.iq3s and not a.iq3s  # b and no holder launch; a stays on the torch path
    for g in got:
        assert_bits_equal(g, want)


def test_a_models_resident_blocks_share_its_triton_state():
    """Every resident matrix (strata.models.resident.Packed: layers, head, embedding) of a slice holds the slice's
    TritonState, where its dequantization's kernels fall back; another slice holds its own."""
    from strata.models.args import PRESETS
    from strata.weights.checkpoint import synthetic_tensors
    from strata.models.model import Transformer
    from strata.models.resident import Packed
    args = PRESETS["smoke"]
    models = []
    for start in (0, 1):
        with torch.device("meta"):
            m = Transformer(args, start)
        m.load_weights(synthetic_tensors(args, start, args.n_layers, "cpu", torch.float32, seed=0, qtype="IQ3_S",
                                         resident=True), "cpu", torch.float32)
        models.append(m)
    for m in models:
        packed = [p for p in m.modules() if isinstance(p, Packed) and p.qtype is not None]
        assert len(packed) >= 2 * (m.end - m.start) and all(p.triton_state is m.triton_state for p in packed)
    assert models[0].triton_state is not models[1].triton_state


def assert_close_on_gpu(gpu: torch.Tensor, cpu: torch.Tensor) -> None:
    """CUDA vs CPU: same NaN and inf positions (NaN payloads may differ), finite values within FMA rounding."""
    assert gpu.is_cuda and gpu.dtype == torch.float32 and gpu.shape == cpu.shape
    gpu = gpu.cpu()
    nan, fin = torch.isnan(cpu), torch.isfinite(cpu)
    assert torch.equal(torch.isnan(gpu), nan)
    assert torch.equal(gpu[~fin & ~nan], cpu[~fin & ~nan])  # the infinities
    assert (gpu[fin] - cpu[fin]).abs().max() <= 1e-6 * cpu[fin].abs().max()


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("name", TYPES)
def test_cuda_matches_cpu(name, monkeypatch):
    """The torch path on CUDA (IQ3_S's Triton kernel off for the holder), several steps of blocks."""
    monkeypatch.setattr(iq, "BATCH_BLOCKS", 16)  # 512 blocks per CUDA step
    raw = torch.from_numpy(random_blocks(name, 2000, seed=3))
    off = TritonState(iq3s=False)
    assert_close_on_gpu(iq.DEQUANT[name](raw.cuda(), off), iq.DEQUANT[name](raw))


@pytest.mark.gpu
@cuda
def test_iq3_s_triton_kernel_matches_cpu():
    """IQ3_S's fused Triton kernel, called directly (no fallback), and through DEQUANT."""
    if iq.triton is None:
        pytest.skip("triton is not installed")
    raw = torch.from_numpy(random_blocks("IQ3_S", 2001, seed=4))  # not a multiple of the program's blocks
    cpu = iq.DEQUANT["IQ3_S"](raw)
    out = torch.full((2001, 256), 7.0, device="cuda")
    iq._iq3_s_triton(raw.cuda(), out)
    assert_close_on_gpu(out, cpu)
    st = TritonState()
    assert_close_on_gpu(iq.DEQUANT["IQ3_S"](raw.reshape(3, 667 * 110).cuda(), st).reshape(2001, 256), cpu)
    assert st.iq3s


@pytest.mark.gpu
@cuda
def test_cuda_iq3_s_failure_in_one_model_leaves_another_on_its_kernel(monkeypatch):
    """Two resident IQ3_S slices in one process on CUDA: the first's IQ3_S kernel fails as its embedding rows are
    dequantized, and it takes the torch path (the same rows, to rounding) from then on; the second still launches
    the kernel."""
    if iq.triton is None:
        pytest.skip("triton is not installed")
    from strata.models.args import PRESETS
    from strata.weights.checkpoint import synthetic_tensors
    from strata.models.model import Transformer
    args = PRESETS["smoke-wide"]
    models = []
    for _ in range(2):
        with torch.device("meta"):
            m = Transformer(args, 0, 1)
        m.load_weights(synthetic_tensors(args, 0, 1, "cuda", torch.bfloat16, seed=0, qtype="IQ3_S", resident=True),
                       "cuda", torch.bfloat16)
        models.append(m)
    assert models[0].embed.table.qtype == "IQ3_S"
    ids = torch.arange(64, device="cuda")[None]
    real, calls = iq._iq3_s_triton, []

    def failing(flat, out):
        calls.append("failed")
        raise RuntimeError("this Triton cannot build it")

    def counted(flat, out):
        calls.append("ran")
        real(flat, out)

    monkeypatch.setattr(iq, "_iq3_s_triton", failing)
    broken = models[0].embed(ids)
    assert calls == ["failed"] and not models[0].triton_state.iq3s
    monkeypatch.setattr(iq, "_iq3_s_triton", counted)
    fine, again = models[1].embed(ids), models[0].embed(ids)
    assert calls == ["failed", "ran"] and models[1].triton_state.iq3s  # the first model no longer tries it
    torch.testing.assert_close(broken, fine, equal_nan=True)  # (bits: test_iq3_s_triton_kernel_matches_cpu)
    torch.testing.assert_close(again, fine, equal_nan=True)
