"""strata.quant.rows: a decode batch's K-quant products on tensor cores (kernels.gemv_rows: mma-float), x as it is
against the weights dequantized in float, held to the float64 product of x and dequantize (bit-exact with gguf-py).

In float32 (the CPU) only the float32 sums' order differs, so the product is held to 1e-5; in bf16 (the GPU) the
weights are rounded to bf16 on the way in (2^-9 each). On the CPU the kernels run under Triton's interpreter in a
subprocess (as tests/test_quant_gemv.py's); the gpu tests take 8B shapes."""

import pytest
import torch
from interpreted_checks import module_results, run_checks

pytest.importorskip("triton")


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def _reference(x, parts):
    """x times each dequantized matrix in float64, side by side."""
    from strata.quant import dequantize
    return torch.cat([x.double().cpu() @ dequantize(b.cpu(), q).double().T for b, q in parts], dim=1)


# -- under the interpreter (in the subprocess) --------------------------------------------------------------------
def check_rows_match_reference():
    """Each type, rows past the tile's padding (5, 16, 19: a tile of 16 and one of 32) and past ROWS_MAX (in two
    launches), matrices whose rows are not a multiple of the tile (16, 32, 64 weight rows), split K (1, 2, 3) and
    side by side parts, into float32 and into x's dtype."""
    from strata.quant import random_blocks, rows
    g = torch.Generator().manual_seed(11)
    for qtype, n, cols in (("Q4_K", 37, 512), ("Q5_K", 33, 256), ("Q6_K", 45, 768)):
        blocks = random_blocks(qtype, n, cols, g)
        for m, split, block_n in ((5, 1, 32), (16, 2, 64), (19, 3, 16), (19, 1, 64)):  # 768 columns: 3 blocks a
            x = torch.randn(m, cols, generator=g)                                         # row, cut 2 + 1 by split 2
            got = rows.quant_matmul_rows(x, [(blocks, qtype)], cols, split=split, block_n=block_n)
            want = _reference(x, [(blocks, qtype)])
            assert got.shape == (m, n) and rel(got, want) < 1e-5, (qtype, m, split, block_n, rel(got, want))
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
    try:
        rows.quant_matmul_rows(x, [(random_blocks("Q8_0", 8, 512, g), "Q8_0")], 512)
        raise AssertionError("Q8_0 was taken")
    except ValueError as e:
        assert "quant_matmul_rows takes Q4_K, Q5_K, Q6_K, got Q8_0" in str(e)


def check_resident_batch_takes_rows():
    """A resident head on 6 rows: with kernels.gemv_rows mma-float (the default) quant_matmul_rows is what runs
    (counted), to float32 sums of the float64 product; with dp4a, the dp4a kernels (4 rows, then 2). More rows than
    ROWS_MAX (a scoring prefill's) take the vocabulary slices. Where the kernel fails, the holder falls back to
    dp4a (rows.product answers None: the caller's dp4a launches)."""
    from strata.config import KernelSpec
    from strata.quant import gemv, random_blocks, rows
    from strata.models.resident import Head, Packed
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
        assert k.rows == rows.ARM and rows.takes(k, 6, ["Q4_K", "Q6_K"]) and rows.takes(k, 4, ["Q4_K"])
        assert not rows.takes(k, 3, ["Q4_K"])
        assert not rows.takes(k, 6, ["Q4_K", "IQ3_S"])
        for blocks, qtype in parts:
            got = Head(Packed(blocks, qtype, 256, torch.float32), rows=16, kernels=k)(x)
            assert rel(got, _reference(x, [(blocks, qtype)])) < 1e-5, qtype
        assert len(calls) == 2
        d = gemv.GemvKernels()
        d.choose(KernelSpec(gemv_rows="dp4a"))
        assert not rows.takes(d, 6, ["Q4_K"])
        for blocks, qtype in parts:  # (as batch_graphs calls a dp4a head: DECODE_T rows at a time)
            head = Head(Packed(blocks, qtype, 256, torch.float32), rows=16, kernels=d)
            want = gemv.quant_matmul(x, blocks, qtype, 256, out=torch.empty(6, blocks.shape[0]))
            assert rel(torch.cat([head(x[:4]), head(x[4:])]), want) < 1e-5
        assert len(calls) == 2

        class Slices:  # the one scratch method the head's vocabulary slices call
            def rows(self, n, cols):
                return torch.empty(n, cols)
        saved = rows.ROWS_MAX
        rows.ROWS_MAX = 4  # 6 rows: more than one launch takes, as a scoring prefill's are: the slices instead
        try:
            blocks, qtype = parts[1]
            got = Head(Packed(blocks, qtype, 256, torch.float32), rows=16, scratch=Slices(), kernels=k)(x)
            assert len(calls) == 2 and rel(got, _reference(x, [(blocks, qtype)])) < 1e-5
        finally:
            rows.ROWS_MAX = saved

        def broken(*a, **kw):
            raise RuntimeError("no bf16 mma here")
        rows.quant_matmul_rows = broken  # a kernel that fails to build: this holder falls back to dp4a, once
        assert rows.product(k, x, parts[:1], 256) is None and k.rows == "dp4a"
        assert rows.product(k, x, parts[:1], 256) is None  # (not tried again)
    finally:
        rows.quant_matmul_rows = inner


CHECKS = [check_rows_match_reference, check_resident_batch_takes_rows]


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
    assert kernel_spec({"gemv_rows": "dp4a"}).gemv_rows == "dp4a" and kernel_spec({}).gemv_rows == "mma-float"
    with pytest.raises(ConfigError, match="kernels.gemv_rows: 'mma' is not one of dp4a, mma-float"):
        kernel_spec({"gemv_rows": "mma"})  # the int8 arm, removed: slower and further from float32


def test_batch_rows_take_x_as_it_is():
    """A resident layer's products read x rounded to int8 on one to three rows (the dp4a kernels), and as it is on a
    batch of 4 rows or more with kernels.gemv_rows mma-float: the norm before them then writes no int8 rounding that nothing
    reads (batch_graphs asks int8_x with its row count)."""
    from strata.config import KernelSpec
    from strata.quant import gemv, random_blocks
    from strata.models.resident import PRODUCTS, Packed, ResidentMatrices
    g = torch.Generator().manual_seed(4)
    parts = {n: Packed(random_blocks(q, 32, 256, g), q, 256, torch.float32)
             for names, q in ((PRODUCTS["qkv"], "Q4_K"), (PRODUCTS["w2"], "Q6_K"), (PRODUCTS["lin_qkv"], "Q5_K"))
             for n in names}
    for arm, batch_int8 in (("mma-float", False), ("dp4a", True)):
        k = gemv.GemvKernels()
        k.choose(KernelSpec(gemv_rows=arm))
        w = ResidentMatrices(parts, None, None, kernels=k)
        assert w.int8_x("qkv") and w.int8_x("w2", 3) and w.linear_int8()
        assert w.int8_x("qkv", 4) == w.int8_x("w2", 16) == w.linear_int8(16) == batch_int8, arm
        assert not w.int8_x("wo", 16)  # (a product the layer does not have)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [(4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)])
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("m", [5, 16, 64])
def test_gpu_rows_8b_shapes(shape, qtype, m):
    """8B shapes (q, gate/up, down, the head), bf16 x against the float64 product: the weights rounded to bf16 on
    the way in (2^-9 each), float32 sums."""
    from strata.quant import dequantize, random_blocks, rows
    n, cols = shape
    g = torch.Generator(device="cuda").manual_seed(n + m)
    blocks = random_blocks(qtype, n, cols, g, device="cuda")
    x = torch.randn(m, cols, generator=g, device="cuda").bfloat16()
    y = rows.quant_matmul_rows(x, [(blocks, qtype)], cols, out=torch.empty(m, n, device="cuda"))
    assert rel(y, x.double() @ dequantize(blocks, qtype).double().T) < 4e-3
