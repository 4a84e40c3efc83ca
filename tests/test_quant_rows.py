"""strata.quant.rows: a decode batch's K-quant products on int8 tensor cores (kernels.gemv_rows: mma), against
dequantize (bit-exact with gguf-py) times x's own int8 rounding in float64, and against the dp4a kernels.

The integer products are exact; only float32 sums differ in order, so the product with x's int8 rounding
(gemv.int8_x) is held to 1e-5. On the CPU the kernels run under Triton's interpreter in a subprocess (as
tests/test_quant_gemv.py's); the gpu tests take 8B shapes."""

import pytest
import torch
from interpreted_checks import module_results, run_checks

pytest.importorskip("triton")


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def _reference(x, parts):
    """x's int8 rounding (quantize_x, read back in float64) times each dequantized matrix, side by side."""
    from strata.quant import dequantize, gemv
    xr = gemv.int8_x(*gemv.quantize_x(x)).cpu()
    return torch.cat([xr @ dequantize(b.cpu(), q).double().T for b, q in parts], dim=1)


# -- under the interpreter (in the subprocess) --------------------------------------------------------------------
def check_rows_match_reference():
    """Each type, rows past the tile's padding (5, 16, 19: a tile of 16 and one of 32) and past ROWS_MAX (in two
    launches), a matrix whose rows are not a multiple of BLOCK_N, split K (1, 3) and side by side parts."""
    from strata.quant import random_blocks, rows
    g = torch.Generator().manual_seed(11)
    for qtype, n, cols in (("Q4_K", 37, 512), ("Q5_K", 33, 256), ("Q6_K", 45, 768)):
        blocks = random_blocks(qtype, n, cols, g)
        for m in (5, 16, 19):
            x = torch.randn(m, cols, generator=g)
            want = _reference(x, [(blocks, qtype)])
            for split in (1, 2, 3):  # 768 columns: 3 blocks a row, cut 2 + 1 by split 2
                got = rows.quant_matmul_rows(x, [(blocks, qtype)], cols, split=split)
                assert got.shape == (m, n) and rel(got, want) < 1e-5, (qtype, m, split, rel(got, want))
    saved = rows.ROWS_MAX
    try:
        rows.ROWS_MAX = 16  # 19 rows: two launches (16 and 3, padded to 16)
        blocks = random_blocks("Q4_K", 40, 256, g)
        x = torch.randn(19, 256, generator=g)
        assert rel(rows.quant_matmul_rows(x, [(blocks, "Q4_K")], 256), _reference(x, [(blocks, "Q4_K")])) < 1e-5
    finally:
        rows.ROWS_MAX = saved
    parts = [(random_blocks("Q4_K", 24, 512, g), "Q4_K"), (random_blocks("Q4_K", 8, 512, g), "Q4_K"),
             (random_blocks("Q6_K", 8, 512, g), "Q6_K")]
    x = torch.randn(6, 512, generator=g)
    got = rows.quant_matmul_rows(x, parts, 512, out=torch.empty(6, 40, dtype=torch.float32))
    assert rel(got, _reference(x, parts)) < 1e-5


def check_float_rows_match_reference():
    """arith "float": float32 x (no int8 rounding) times the dequantized weights, each type, split K, tiles of 16
    and 64 weight rows, the nibbles to float by their bits (magic) or a conversion, one dot of 64 or two of 32 (pair),
    side by side parts: to float32 sums of the float64 product."""
    from strata.quant import dequantize, random_blocks, rows
    g = torch.Generator().manual_seed(12)
    for qtype, n, cols in (("Q4_K", 37, 512), ("Q5_K", 33, 256), ("Q6_K", 45, 768)):
        blocks = random_blocks(qtype, n, cols, g)
        want_w = dequantize(blocks, qtype).double()
        for m, split, block_n, magic, pair in ((5, 1, 32, False, True), (19, 3, 16, True, True),
                                               (16, 2, 64, False, False), (7, 1, 32, True, False)):
            x = torch.randn(m, cols, generator=g)
            got = rows.quant_matmul_rows(x, [(blocks, qtype)], cols, split=split, arith="float", block_n=block_n,
                                         magic=magic, pair=pair)
            assert rel(got, x.double() @ want_w.T) < 1e-5, (qtype, m, split, block_n, magic, pair)
    parts = [(random_blocks("Q4_K", 24, 512, g), "Q4_K"), (random_blocks("Q6_K", 8, 512, g), "Q6_K")]
    x = torch.randn(6, 512, generator=g)
    got = rows.quant_matmul_rows(x, parts, 512, arith="float")
    want = torch.cat([x.double() @ dequantize(b, q).double().T for b, q in parts], dim=1)
    assert rel(got, want) < 1e-5
    try:
        rows.quant_matmul_rows(x, parts, 512, arith="fp8")
        raise AssertionError("arith fp8 was taken")
    except ValueError as e:
        assert "arith is one of int8, float" in str(e)


def check_resident_batch_takes_rows():
    """A resident layer's products and head on 6 rows: with kernels.gemv_rows mma, the same as the dp4a kernels
    (two launches of 4 and 2 rows) to float32 sums; quant_matmul_rows is what runs (counted). Where it fails, the
    holder falls back to dp4a (rows.product answers None: the caller's dp4a launches)."""
    from strata.config import KernelSpec
    from strata.quant import gemv, random_blocks, rows
    g = torch.Generator().manual_seed(3)
    calls = []
    inner = rows.quant_matmul_rows

    def counted(*a, **kw):
        calls.append(1)
        return inner(*a, **kw)
    rows.quant_matmul_rows = counted
    try:
        parts = [(random_blocks("Q4_K", 32, 256, g), "Q4_K"), (random_blocks("Q6_K", 16, 256, g), "Q6_K")]
        x = torch.randn(6, 256, generator=g)
        k = gemv.GemvKernels()
        k.choose(KernelSpec(gemv_rows="mma"))
        assert rows.takes(k, 6, ["Q4_K", "Q6_K"]) and not rows.takes(k, 4, ["Q4_K"])
        assert not rows.takes(gemv.GemvKernels(), 6, ["Q4_K"]) and not rows.takes(k, 6, ["Q4_K", "IQ3_S"])
        from strata.resident import Head, Packed
        for blocks, qtype in parts:
            head = Head(Packed(blocks, qtype, 256, torch.float32), rows=16, kernels=k)
            want = gemv.quant_matmul(x, blocks, qtype, 256, out=torch.empty(6, blocks.shape[0]))
            got = head(x)
            assert rel(got, want) < 1e-5, (qtype, rel(got, want))
        assert len(calls) == 2
        kf = gemv.GemvKernels()
        kf.choose(KernelSpec(gemv_rows="mma-float"))  # x as it is (float32 here), no int8 rounding
        assert rows.takes(kf, 6, ["Q4_K", "Q6_K"])
        from strata.quant import dequantize
        for blocks, qtype in parts:
            got = Head(Packed(blocks, qtype, 256, torch.float32), rows=16, kernels=kf)(x)
            assert rel(got, x.double() @ dequantize(blocks, qtype).double().T) < 1e-5, qtype
        assert len(calls) == 4

        class Slices:  # the one scratch method the head's vocabulary slices call
            def rows(self, n, cols):
                return torch.empty(n, cols)
        saved = rows.ROWS_MAX
        rows.ROWS_MAX = 4  # 6 rows: more than one launch takes, as a scoring prefill's are: the slices instead
        try:
            blocks, qtype = parts[1]
            got = Head(Packed(blocks, qtype, 256, torch.float32), rows=16, scratch=Slices(), kernels=kf)(x)
            assert len(calls) == 4 and rel(got, x.double() @ dequantize(blocks, qtype).double().T) < 1e-5
        finally:
            rows.ROWS_MAX = saved

        def broken(*a, **kw):
            raise RuntimeError("no int8 mma here")
        rows.quant_matmul_rows = broken  # a kernel that fails to build: this holder falls back to dp4a, once
        assert rows.product(k, x, parts[:1], 256) is None and k.rows == "dp4a"
        assert rows.product(k, x, parts[:1], 256) is None  # (not tried again)
    finally:
        rows.quant_matmul_rows = inner


CHECKS = [check_rows_match_reference, check_float_rows_match_reference, check_resident_batch_takes_rows]


def _run_checks() -> None:
    run_checks(CHECKS)


@pytest.fixture(scope="module")
def interpreted_results() -> dict:
    return module_results("test_quant_rows")


@pytest.mark.parametrize("name", [fn.__name__ for fn in CHECKS])
def test_interpreted(interpreted_results, name):
    assert interpreted_results[name] == "ok", interpreted_results[name]


def test_rows_arm_is_a_typed_kernel_key():
    from strata.config import ConfigError, kernel_spec
    assert kernel_spec({"gemv_rows": "mma"}).gemv_rows == "mma" and kernel_spec({}).gemv_rows == "dp4a"
    with pytest.raises(ConfigError, match="kernels.gemv_rows: 'tensor' is not one of dp4a, mma, mma-float"):
        kernel_spec({"gemv_rows": "tensor"})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [(4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)])
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("m", [5, 16, 64])
def test_gpu_rows_8b_shapes(shape, qtype, m):
    """8B shapes (q, gate/up, down, the head), bf16 x: to float32 sums of the product with x's int8 rounding, and
    as the dp4a kernels in launches of 4 rows."""
    from strata.quant import dequantize, gemv, random_blocks, rows
    n, cols = shape
    g = torch.Generator(device="cuda").manual_seed(n + m)
    blocks = random_blocks(qtype, n, cols, g, device="cuda")
    x = torch.randn(m, cols, generator=g, device="cuda").bfloat16()
    y = rows.quant_matmul_rows(x, [(blocks, qtype)], cols, out=torch.empty(m, n, device="cuda"))
    assert rel(y, gemv.int8_x(*gemv.quantize_x(x)) @ dequantize(blocks, qtype).double().T) < 1e-5
    dp4a = gemv.quant_matmul(x, blocks, qtype, cols, out=torch.empty(m, n, device="cuda"))
    assert rel(y, dp4a) < 1e-5
    # arith "float": bf16 x against weights rounded to bf16 (2^-9 each), float32 sums
    want = x.double() @ dequantize(blocks, qtype).double().T
    for magic, pair in ((False, True), (True, False)):
        f = rows.quant_matmul_rows(x, [(blocks, qtype)], cols, out=torch.empty(m, n, device="cuda"), arith="float",
                                   magic=magic, pair=pair)
        assert rel(f, want) < 4e-3, (magic, pair)
