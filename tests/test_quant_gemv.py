"""strata.quant.gemv: the fused dequantize + matrix-vector kernels against dequantize + a float64 product.

On the CPU the kernels run under Triton's interpreter, which must be switched on before triton is
imported: the checks below run in one subprocess with TRITON_INTERPRET=1, each reporting ok or its
traceback, and every test asserts its own check. The gpu tests compare with the current CUDA path.

IQ3_S's dp4a kernels take x rounded to int8 with a float32 scale per 32 values (gemv.quantize_x): against
x itself they are held to DP4A_TOL (x's rounding error, at most s/2 per value with s = amax/127, is
~0.5% of x's norm for Gaussian x, and the product's relative error follows it: ~5e-3 measured on the
CPU, see check_iq3s_dp4a_matches_reference), and against the int8 x they multiply (q * s exactly in
float64) to float32 accumulation: that checks the integer data flow bit for bit up to the final sums."""
import sys

import pytest
import torch
from interpreted_checks import interpreted, module_results, run_checks

pytest.importorskip("triton")


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative error as a whole (norm), the measure that fp32 / bf16 accumulation bounds."""
    return float((got.double() - want.double()).norm() / want.double().norm())


DP4A_TOL = 1.5e-2  # int8 x: ~5e-3 measured (3x margin); float32 x in the float kernel: 1e-5
IQ3S_DP4A = ("dp4a", "dp4a-table", "dp4a-u16", "dp4a-smem")


def reference(x: torch.Tensor, blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """Independent: dequantize (bit-exact with gguf-py) then a float64 product, on the CPU."""
    from strata.quant import dequantize
    return x.cpu().double() @ dequantize(blocks.cpu(), qtype).double().T


def quantize_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 reference of gemv.quantize_x: per 32 values s = amax / 127, q = round half away from zero of x / s."""
    xd = x.cpu().double().reshape(x.shape[0], -1, 32)
    amax = xd.abs().amax(dim=2, keepdim=True)
    v = xd * torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    q = torch.sign(v) * torch.floor(v.abs() + 0.5)
    return q.reshape(x.shape), (amax / 127).reshape(x.shape[0], -1)


def kernels(**modes):
    """The kernels a call takes (strata.quant.gemv.GemvKernels: iq3s, kquant for Q4_K / Q5_K, q6k; the others the
    defaults), passed to it: nothing global to set or restore."""
    from strata.quant import gemv
    return gemv.GemvKernels(**modes)


# -- the checks run under the interpreter (in the subprocess) -----------------------------------------
def check_kernel_matches_reference():
    """Odd shapes (rows not a multiple of BLOCK_N, a ragged last step of blocks), M=1 and M=3, and M=6
    (two launches); fp32 x within fp32 accumulation, bf16 x (result rounded to bf16) within bf16."""
    from strata.quant import gemv, random_blocks
    g = torch.Generator().manual_seed(7)
    _check_float_kernels(gemv, random_blocks, g, kernels(iq3s="float", kquant="words", q8_0="bytes"))
    big = gemv.BIG_ROWS
    try:  # the big launches' shapes (gate/up, the head) on these small matrices: every launch counts as big
        gemv.BIG_ROWS = 1
        _check_float_kernels(gemv, random_blocks, g, kernels(kquant="words"), types=tuple(gemv.BIG_CONFIGS))
    finally:
        gemv.BIG_ROWS = big


def _check_float_kernels(gemv, random_blocks, g, k, types=None):
    for qtype, cols in (("IQ3_S", 256 * 3), ("Q8_0", 32 * 11), ("Q4_K", 256 * 3), ("Q5_K", 256 * 2), ("Q6_K", 256 * 3),
                        ("Q4_0", 32 * 5), ("Q4_1", 32 * 3), ("Q5_0", 32 * 5), ("Q5_1", 32 * 3)):
        if types is not None and qtype not in types:
            continue
        for rows, m in ((37, 1), (21, 3), (5, 6)):
            blocks = random_blocks(qtype, rows, cols, g)
            _check_float_x(gemv, torch.randn(m, cols, generator=g), blocks, qtype, k)


def _check_float_x(gemv, x, blocks, qtype, k):
    """A float-x kernel (of the kernels k): float32 x within float32 accumulation of the float64 product, bf16 x
    (the result in bf16) within bf16."""
    (m, cols), rows = x.shape, blocks.shape[0]
    y = gemv.quant_matmul(x, blocks, qtype, cols, kernels=k)
    assert y.shape == (m, rows) and y.dtype == torch.float32
    assert rel(y, reference(x, blocks, qtype)) < 1e-5, (qtype, rows, cols, m)
    xb = x.bfloat16()
    yb = gemv.quant_matmul(xb, blocks, qtype, cols, kernels=k)
    assert yb.dtype == torch.bfloat16
    assert rel(yb, reference(xb, blocks, qtype)) < 8e-3, (qtype, rows, cols, m)


def check_parts_side_by_side():
    """q/k/v-like parts of different rows and mixed types (four launches) into one float32 `out`."""
    from strata.quant import gemv, random_blocks
    g = torch.Generator().manual_seed(8)
    cols = 512
    parts = [(random_blocks(q, r, cols, g), q) for q, r in (("IQ3_S", 19), ("IQ3_S", 6), ("Q8_0", 11), ("IQ3_S", 9), ("Q4_K", 10),
                                                            ("Q6_K", 7))]
    x = torch.randn(3, cols, generator=g).bfloat16()
    want = torch.cat([reference(x, b, q) for b, q in parts], dim=1)
    for mode, tol in (("float", 1e-5),) + tuple((m, DP4A_TOL) for m in IQ3S_DP4A):
        out = torch.full((3, 62), float("nan"))
        int8 = "words" if mode == "float" else "dp4a"
        gemv.quant_matmul_parts(x, parts, cols, out=out, kernels=kernels(iq3s=mode, q6k=int8, kquant=int8,
                                                                          q8_0="bytes"))
        assert rel(out, want) < tol, (mode, rel(out, want))
        # the other types' columns are exact either way
        q8 = slice(25, 36)
        assert rel(out[:, q8], want[:, q8]) < 1e-5


def check_iq3s_dp4a_matches_reference():
    """The dp4a IQ3_S kernels (packed grid + sign bits, and the signed table), fresh random blocks, odd row
    counts, M = 1, 3 and 6 (two launches), float32 and bfloat16 x: within DP4A_TOL of the float64
    product with x, and to float32 accumulation of the float64 product with x's int8 rounding q * s."""
    from strata.quant import gemv, random_blocks
    g = torch.Generator().manual_seed(11)
    errs = []
    # (the interpreter is slow on the unrolled kernel: the table variants, same data flow but the lookup, once)
    for mode, shapes in (("dp4a", ((37, 768, 1), (21, 512, 3), (5, 1024, 6))), ("dp4a-table", ((21, 512, 3),)),
                         ("dp4a-u16", ((21, 512, 3),)), ("dp4a-smem", ((21, 512, 3),))):
        for rows, cols, m in shapes:
            blocks = random_blocks("IQ3_S", rows, cols, g)
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(m, cols, generator=g).to(dtype)
                xq = gemv.int8_x(*gemv.quantize_x(x))  # what it multiplies (quantize_x: check_quantize_x)
                k = kernels(iq3s=mode)
                y = gemv.quant_matmul(x, blocks, "IQ3_S", cols, out=torch.empty(m, rows), kernels=k)
                yx = gemv.quant_matmul(x, blocks, "IQ3_S", cols, kernels=k) if dtype != torch.float32 else y
                assert k.iq3s == mode  # no fallback to the float kernel
                want = reference(x, blocks, "IQ3_S")
                assert float(want.norm()) > 0 and float(y.norm()) > 0
                assert rel(y, reference(xq, blocks, "IQ3_S")) < 1e-5, (mode, rows, m, dtype)
                errs.append(rel(y, want))
                assert errs[-1] < DP4A_TOL, (mode, rows, m, dtype, errs[-1])
                assert yx.dtype == dtype and rel(yx, want) < DP4A_TOL + (8e-3 if dtype == torch.bfloat16 else 0)
    print(f"dp4a rel err vs float64 x: max {max(errs):.2e}, mean {sum(errs) / len(errs):.2e}", file=sys.stderr)


def check_q6_k_words_matches_reference():
    """Q6_K's int32-word kernel (two blocks a step; the odd block's words from two aligned loads; an odd block
    count a row one block a step, its parity per row): float x within float32 accumulation, int8 x (dp4a) to
    float32 accumulation of the product with x's int8 rounding and within DP4A_TOL of x's; odd row counts,
    M = 1, 3 and 6, both launch shapes (BIG_ROWS), bf16 x; odd block counts (3 and 5 a row, weighed-0 tail
    loads) on an even row count, and on an odd one (the matrix ends 2 bytes into a word: the byte kernel runs)."""
    from strata.quant import gemv, random_blocks
    g = torch.Generator().manual_seed(13)
    big = gemv.BIG_ROWS
    try:
        for big_rows in (big, 1):
            gemv.BIG_ROWS = big_rows
            for rows, cols, m in ((37, 512, 1), (21, 1024, 3), (5, 2048, 6), (9, 768, 1), (10, 768, 1),
                                  (6, 1280, 2)):
                blocks = random_blocks("Q6_K", rows, cols, g)
                x = torch.randn(m, cols, generator=g)
                want = reference(x, blocks, "Q6_K")
                _check_float_x(gemv, x, blocks, "Q6_K", kernels(q6k="words"))
                y = gemv.quant_matmul(x, blocks, "Q6_K", cols, kernels=kernels(q6k="dp4a"))
                if rows * cols // 256 % 2:  # an odd block count in all: the byte kernel, float x
                    assert rel(y, want) < 1e-5, ("dp4a", rows, cols, m, rel(y, want))
                else:
                    _check_int8_x(gemv, x, blocks, "Q6_K", y, want)
    finally:
        gemv.BIG_ROWS = big


def _check_int8_x(gemv, x, blocks, qtype, y, want):
    """A dp4a kernel's y: to float32 accumulation of the product with x's int8 rounding (`quantize_x`), and
    within DP4A_TOL of the product with x itself (`want`)."""
    assert rel(y, reference(gemv.int8_x(*gemv.quantize_x(x)), blocks, qtype)) < 1e-5, qtype
    assert rel(y, want) < DP4A_TOL, (qtype, rel(y, want))


def check_k45_words_matches_reference():
    """Q4_K and Q5_K's word kernel (1, 2 and 4 blocks of a row side by side a step; an odd count, 3, in steps
    of 4 whose tail is weighed 0) with float x (kquant words)
    and with int8 x (dp4a: two dp4a per word, one more for the min's sum of x) against the int8 x it
    multiplies and x itself; odd row counts, M = 1, 3 and 6, both launch shapes (BIG_ROWS), bf16 x; and
    blocks not 4-byte aligned (the byte kernel runs, float x)."""
    from strata.quant import gemv, random_blocks
    g = torch.Generator().manual_seed(14)
    big = gemv.BIG_ROWS
    k = kernels(kquant="dp4a")
    try:
        for big_rows in (big, 1):
            gemv.BIG_ROWS = big_rows
            for qtype in ("Q4_K", "Q5_K"):
                for rows, cols, m in ((37, 512, 1), (21, 768, 3), (5, 256, 6), (9, 2048, 2)):
                    blocks = random_blocks(qtype, rows, cols, g)
                    for x in (torch.randn(m, cols, generator=g), torch.randn(m, cols, generator=g).bfloat16()):
                        y = gemv.quant_matmul(x, blocks, qtype, cols, out=torch.empty(m, rows), kernels=k)
                        _check_int8_x(gemv, x, blocks, qtype, y, reference(x, blocks, qtype))
                    if cols in (2048, 768):  # 768: 3 blocks a row, the tail of a 4-block step weighed 0
                        _check_float_x(gemv, torch.randn(m, cols, generator=g), blocks, qtype, kernels(kquant="words"))
        size = blocks.shape[1]
        odd = torch.empty(rows * size + 1, dtype=torch.uint8)[1:].view(rows, size)
        odd.copy_(blocks)
        x = torch.randn(m, cols, generator=g)
        assert rel(gemv.quant_matmul(x, odd, qtype, cols, kernels=k), reference(x, blocks, qtype)) < 1e-5
    finally:
        gemv.BIG_ROWS = big


def check_dp4a_failure_falls_back_to_words():
    """Where a K-quant dp4a kernel cannot run (here: inline PTX under the interpreter), the product still comes,
    from the word kernel on float x, and later calls with the same kernels object take that kernel; the
    fallback is that object's, not the process's."""
    from strata.quant import gemv, random_blocks
    g = torch.Generator().manual_seed(15)
    parts = [(random_blocks(q, r, 512, g), q) for q, r in (("Q4_K", 9), ("Q6_K", 5), ("Q8_0", 3))]
    x = torch.randn(2, 512, generator=g)
    want = torch.cat([reference(x, b, q) for b, q in parts], dim=1)
    interp = gemv.INTERPRET
    try:
        k = kernels(kquant="dp4a", q6k="dp4a", q8_0="dp4a")
        gemv.INTERPRET = False  # the kernels get PTX=True: the interpreter cannot run inline assembly
        assert rel(gemv.quant_matmul_parts(x, parts, 512, kernels=k), want) < 1e-5
        assert k.kquant == "words" and k.q6k == "words" and k.q8_0 == "bytes"
        assert gemv.GemvKernels().kquant == "dp4a" and gemv.GemvKernels().q6k == "dp4a"
        assert gemv.GemvKernels().q8_0 == "dp4a"
    finally:
        gemv.INTERPRET = interp


def check_q8_0_dp4a_matches_reference():
    """Q8_0's dp4a kernel (int16 loads, 8 dp4a a block): against the product with x's int8 rounding to float32
    accumulation and within DP4A_TOL of x's; a row of 11 blocks in steps of 8 (the tail weighed 0) and of 8
    blocks, M = 1, 3 and 6 (two launches), two matrices side by side; a big launch (a head) keeps the byte kernel."""
    from strata.quant import gemv, random_blocks
    g = torch.Generator().manual_seed(21)
    for cols, rows, m in ((32 * 11, 37, 1), (32 * 8, 21, 3), (32 * 11, 5, 6)):
        blocks = random_blocks("Q8_0", rows, cols, g)
        x = torch.randn(m, cols, generator=g)
        y = gemv.quant_matmul(x, blocks, "Q8_0", cols, kernels=kernels(q8_0="dp4a"))
        _check_int8_x(gemv, x, blocks, "Q8_0", y, reference(x, blocks, "Q8_0"))
    parts = [(random_blocks("Q8_0", r, 256, g), "Q8_0") for r in (9, 4)]
    x = torch.randn(2, 256, generator=g)
    y = gemv.quant_matmul_parts(x, parts, 256, kernels=kernels(q8_0="dp4a"))
    xi = gemv.int8_x(*gemv.quantize_x(x))
    assert rel(y, torch.cat([reference(xi, b, q) for b, q in parts], 1)) < 1e-5
    big = gemv.BIG_ROWS
    try:
        gemv.BIG_ROWS = 1
        assert torch.equal(gemv.quant_matmul_parts(x, parts, 256, kernels=kernels(q8_0="dp4a")),
                           gemv.quant_matmul_parts(x, parts, 256, kernels=kernels(q8_0="bytes")))
    finally:
        gemv.BIG_ROWS = big


def check_split_k_matches_reference():
    """Config.split: the word kernels' rows cut among 2 or 3 programs, partial sums added by _sum_splits: Q6_K in
    pairs and single blocks (an odd count), Q4_K with and without a weighed-0 tail, float x and int8 x, M = 1 and
    3; a split the row's steps cannot feed (MIN_SPLIT_STEPS each) is cut."""
    from strata.quant import gemv, random_blocks
    g = torch.Generator().manual_seed(22)
    for qtype, nb, split in (("Q6_K", 16, 2), ("Q6_K", 9, 2), ("Q4_K", 12, 3), ("Q4_K", 9, 2), ("Q4_K", 5, 4)):
        cols = 256 * nb
        blocks = random_blocks(qtype, 10, cols, g)  # (Q6_K's word kernels want an even block count a matrix)
        for m in (1, 3):
            x = torch.randn(m, cols, generator=g)
            want = reference(x, blocks, qtype)
            for mode in ("words", "dp4a"):
                k = kernels(q6k=mode, kquant=mode)
                y = gemv.quant_matmul(x, blocks, qtype, cols, config=gemv.Config(4, 1, 4, split=split), kernels=k)
                if mode == "words":
                    assert rel(y, want) < 1e-5, (qtype, nb, split, m, rel(y, want))
                else:
                    _check_int8_x(gemv, x, blocks, qtype, y, want)


def check_quantize_x():
    """gemv.quantize_x against its float64 reference: float32 and bfloat16 x with an all-zero group, an
    outlier and a row past one program's groups; scales to float32 rounding, q exact but at ties."""
    from strata.quant import gemv
    g = torch.Generator().manual_seed(12)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 32 * 37, generator=g)
        x[1, 64:96] = 0
        x[2, 5] = 300.0
        x = x.to(dtype)
        q, s = gemv.quantize_x(x)
        assert q.dtype == torch.int8 and s.dtype == torch.float32 and q.shape == x.shape and s.shape == (3, 37)
        q = gemv.int8_x(q, torch.ones_like(s))  # back to x's order: a wrong interleave fails against qr below
        qr, sr = quantize_ref(x)
        assert rel(s, sr) < 1e-7 and bool((s[1, 2] == 0).all()) and bool((q[1, 64:96] == 0).all())
        diff = (q.double() - qr).abs()
        v = (x.double().reshape(3, -1, 32) / sr[:, :, None]).reshape(x.shape).abs()  # x / s: ties at k + 1/2
        tie = ((v - v.floor()) - 0.5).abs() < 1e-5  # bf16 x has exact ties; float32's x * (127 / amax) rounds
        assert float(diff.max()) <= 1 and bool(tie[diff > 0].all()), int((diff > 0).sum())
        err = (q.double().reshape(3, -1, 32) * sr[:, :, None]).reshape(x.shape) - x.double()
        assert bool((err.abs().reshape(3, -1, 32) <= sr[:, :, None] * (0.5 + 1e-5)).all())


def _resident_and_dense(args, qtype: str):
    """A tiny synthetic model of `qtype` twice on the CPU: resident blocks, and the same weights dequantized."""
    from strata.weights.checkpoint import synthetic_tensors
    from strata.models.model import Transformer

    def build(resident: bool):
        with torch.device("meta"):
            m = Transformer(args)
        m.load_weights(synthetic_tensors(args, 0, args.n_layers, "cpu", torch.float32, seed=3, qtype=qtype,
                                         resident=resident), "cpu", torch.float32)
        m.setup_cache(args.max_seq_len)
        return m.eval()
    return build(True), build(False)


def check_model_decode_fused():
    """A tiny IQ3_S resident model (q/k/v bias, untied IQ3_S head; wo's 128-wide rows fall back to Q8_0)
    decodes through the kernels, and its residuals and logits match the same weights dequantized
    (dense F.linear) at T=1 and T=3."""
    from strata.models.args import ModelArgs
    from strata.config import KernelSpec
    from strata.quant import gemv
    args = ModelArgs(arch="qwen2", qkv_bias=True, vocab_size=40, dim=256, n_layers=2, n_heads=2, n_kv_heads=1,
                     head_dim=64, ffn_dim=256, max_seq_len=64)
    fused, dense = _resident_and_dense(args, "IQ3_S")
    assert all(b.weights.fused_decode_ok("cpu") for b in fused.layers.values())
    assert {p.qtype for b in fused.layers.values() for p in b.weights.parts.values()} == {"IQ3_S", "Q8_0"}
    calls = []
    real, configs = gemv.quant_matmul_parts, gemv.CONFIGS
    gemv.quant_matmul_parts = lambda *a, **k: calls.append(1) or real(*a, **k)
    # the interpreter runs programs one by one: wider ones (another launch shape, also worth a check)
    gemv.CONFIGS = {"IQ3_S": gemv.Config(32, 1), "Q8_0": gemv.Config(32, 3)}
    try:
        ids = torch.randint(0, args.vocab_size, (1, 12), generator=torch.Generator().manual_seed(5))
        # the dp4a kernel (int8 x: the residual stream's error) for the T=3 step only, the slow one interpreted
        for mode, tol, steps in (("float", 1e-5, ((8, 1), (9, 3))), ("dp4a", DP4A_TOL, ((9, 3),))):
            # the rig's kernels.gemv_iq3s, as a stage passes it (wo's Q8_0 rows: float x with float, else dp4a)
            fused.set_kernels(KernelSpec(gemv_iq3s=mode, gemv_q8_0="bytes" if mode == "float" else "dp4a"))
            n = steps[0][0]
            assert rel(fused(ids[:, :n], 0), dense(ids[:, :n], 0)) < 1e-6  # prefill: the scratch path
            assert not calls
            for p, t in steps:
                a, b = fused(ids[:, p:p + t], p), dense(ids[:, p:p + t], p)
                assert rel(a, b) < tol, (mode, p, rel(a, b))
                la, lb = fused.logits(a[0]), dense.logits(b[0])
                assert la.dtype == torch.float32 and rel(la, lb) < tol, (mode, p, rel(la, lb))
            assert fused.gemv.iq3s == mode
            assert len(calls) == len(steps) * (2 * 4 + 1), len(calls)  # 4 products per layer, the head, per step
            calls.clear()
    finally:
        gemv.quant_matmul_parts, gemv.CONFIGS = real, configs


def check_model_decode_fused_q4_k_m():
    """A tiny Llama of the Q4_K_M mix (Q4_K matrices; Q6_K attn_v, ffn_down and head; wo's 128-wide rows in
    Q8_0) decodes every product through the kernels (a layer with one unfused part would dequantize the whole
    layer per token), and matches the same weights dequantized at T=1 and T=3."""
    from strata.models.args import ModelArgs
    from strata.config import KernelSpec
    from strata.quant import gemv
    args = ModelArgs(vocab_size=40, dim=256, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=64, ffn_dim=256,
                     max_seq_len=64)
    fused, dense = _resident_and_dense(args, "Q4_K_M")
    assert all(b.weights.fused_decode_ok("cpu") for b in fused.layers.values())
    assert {n: p.qtype for n, p in fused.layers["0"].weights.parts.items()} == {
        "wq": "Q4_K", "wk": "Q4_K", "wv": "Q6_K", "wo": "Q8_0", "w_gate": "Q4_K", "w_up": "Q4_K", "w_down": "Q6_K"}
    assert fused.head.weight.qtype == "Q6_K"
    calls = []
    real = gemv.quant_matmul_parts
    gemv.quant_matmul_parts = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        ids = torch.randint(0, args.vocab_size, (1, 12), generator=torch.Generator().manual_seed(6))
        assert rel(fused(ids[:, :8], 0), dense(ids[:, :8], 0)) < 1e-6  # prefill: the scratch path
        # each Q6_K and Q4_K kernel (dp4a: int8 x, the residual stream's error; its T=3 step only)
        for mode, tol, steps in (("bytes", 1e-5, ((8, 1), (9, 3))), ("words", 1e-5, ((8, 1),)),
                                 ("dp4a", DP4A_TOL, ((9, 3),))):
            q8 = "dp4a" if mode == "dp4a" else "bytes"
            fused.set_kernels(KernelSpec(gemv_q6k=mode, gemv_kquant=mode, gemv_q8_0=q8))
            for p, t in steps:
                a, b = fused(ids[:, p:p + t], p), dense(ids[:, p:p + t], p)
                assert rel(a, b) < tol, (mode, p, rel(a, b))
                assert rel(fused.logits(a[0]), dense.logits(b[0])) < tol, mode
            assert len(calls) == len(steps) * (2 * 4 + 1), len(calls)  # 4 products per layer and the head, per step
            calls.clear()
    finally:
        gemv.quant_matmul_parts = real


def check_graph_body_int8_x():
    """The decode graphs' step body on a Q4_K_M resident model with dp4a products: the norms, the attention's merge
    and the gated activation write x's int8 rounding for the product after them, so no launch of quantize_x is left
    in the step (four a layer before), and the step equals the eager decode path, which rounds x in quantize_x for
    every product (the same rounding: the residuals to 1e-6)."""
    from strata.models.args import ModelArgs
    from strata.config import KernelSpec
    from strata.decode.graphs import DecodeGraphs
    from strata.quant import gemv
    args = ModelArgs(vocab_size=40, dim=256, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=256,
                     max_seq_len=64)
    eager, body = _resident_and_dense(args, "Q4_K_M")[0], _resident_and_dense(args, "Q4_K_M")[0]
    for m in (eager, body):
        m.set_kernels(KernelSpec(gemv_q6k="dp4a", gemv_kquant="dp4a"))
    dg = DecodeGraphs(body)
    assert dg.fused and all(dg._int8_inputs(b.weights) == {"qkv": True, "wo": True, "w13": True, "w2": True}
                            for b in body.layers.values())
    ids = torch.randint(0, args.vocab_size, (1, 12), generator=torch.Generator().manual_seed(7))
    assert torch.equal(eager(ids[:, :8], 0), body(ids[:, :8], 0))
    rounded = []
    real = gemv.quantize_x
    gemv.quantize_x = lambda *a, **k: rounded.append(1) or real(*a, **k)
    try:
        with torch.inference_mode():
            for p in (8,):
                a = eager(ids[:, p:p + 1], p)
                n = len(rounded)
                dg.ids.copy_(ids[:, p:p + 1].reshape(-1))
                dg.pos.fill_(p)
                h, logits, _ = dg._body(dg.bucket(p))
                assert len(rounded) == n, len(rounded) - n  # (wo's x: from the split-K merge's launch)
                assert rel(h, a) < 1e-6, (p, rel(h, a))
                assert rel(logits, eager.logits(a[0, -1])) < 1e-6
        assert rounded  # the eager path did
    finally:
        gemv.quantize_x = real


def check_dequantize_into():
    """strata.quant.into (the resident prefill's dequantization straight into the scratch): float32 out equals
    the torch path bit for bit (same float32 operations, contraction off); bfloat16 out within one bfloat16
    step of it (the interpreter truncates where the GPU rounds to nearest even: test_quant.py checks the GPU
    bit for bit); Packed.into takes it for these types, odd row counts and a row range included."""
    from strata.models.resident import Packed
    from strata.quant import dequantize, into, random_blocks
    g = torch.Generator().manual_seed(12)
    for qtype, cols in (("Q8_0", 96), ("Q4_K", 512), ("Q5_K", 256), ("Q6_K", 512), ("IQ3_S", 256), ("Q4_0", 64),
                        ("Q4_1", 96), ("Q5_0", 64), ("Q5_1", 96)):
        for rows in (1, 7):
            b = random_blocks(qtype, rows, cols, g)
            want = dequantize(b, qtype)
            out = torch.full((rows, cols), float("nan"))
            assert into.takes(qtype, out) and into.dequantize_into(out, b, qtype)
            assert torch.equal(out, want), qtype
            out16 = torch.full((rows, cols), float("nan"), dtype=torch.bfloat16)
            assert into.dequantize_into(out16, b, qtype)
            assert bool(((out16.float() - want).abs() <= want.abs() * 2.0 ** -7).all()), qtype
        p = Packed(b, qtype, cols, torch.bfloat16)
        calls, real = [], into.dequantize_into
        into.dequantize_into = lambda *a: calls.append(a[2]) or real(*a)
        try:
            dst = torch.empty(4, cols, dtype=torch.bfloat16)
            p.into(dst, 2, 6)
        finally:
            into.dequantize_into = real
        assert calls == [qtype]
        assert bool(((dst.float() - want[2:6]).abs() <= want[2:6].abs() * 2.0 ** -7).all()), qtype
    assert not into.takes("Q2_K", torch.empty(1)) and not into.takes("Q4_K", torch.empty(4, 4).t())


def check_mxfp4_dp4a_experts():
    """MXFP4 experts on int8 x (kernels.gemv_mxfp4: dp4a, the stack in strata.quant.mxfp4's split layout; the prmt
    and dp4a emulated as the interpreter must) against float64 products of the dequantized experts: with x's int8
    rounding to float32 summation, with x itself within DP4A_TOL; the float kernel on both layouts to 1e-5. Odd
    shapes: rows not a multiple of the program's, a single expert, 1, 3 and 10 blocks a row (a step's tail
    weighed 0), x of one row for every slot or a row a slot, repeated ids, bf16 x, two launch shapes; the caller's
    xq gives the same bits as the rounding made inside; a dp4a launch that fails leaves the float kernel on the
    holder; a file-layout stack is refused by the dp4a path's checks where it claims to be split."""
    from strata.quant import dequantize, gemv, mxfp4, random_blocks
    g = torch.Generator().manual_seed(21)
    default = gemv.MXFP4_DP4A
    try:
        for cfg, E, rows, cols, ids in ((default, 5, 20, 256, [3, 0, 4, 3]), (default, 1, 12, 96, [0]),
                                        (default, 4, 37 * 4, 320, [2, 1]), (gemv.Config(4, 2, 1), 3, 4, 32, [1, 1, 2]),
                                        (gemv.Config(4, 2, 1), 2, 10, 320, [1, 0])):
            gemv.MXFP4_DP4A = cfg
            st = random_blocks("MXFP4", E * rows, cols, g).view(E, rows, -1).contiguous()
            sp = mxfp4.to_split(st)
            w = dequantize(st.view(E * rows, -1), "MXFP4").view(E, rows, cols).double()
            idt = torch.tensor(ids)
            for xr, dt in ((1, torch.float32), (len(ids), torch.float32), (len(ids), torch.bfloat16)):
                x = torch.randn(xr, cols, generator=g).to(dt)
                xq = gemv.quantize_x(x)
                xi = gemv.int8_x(*xq)
                want = torch.stack([w[e] @ x[min(j, xr - 1)].double() for j, e in enumerate(ids)])
                wq = torch.stack([w[e] @ xi[min(j, xr - 1)] for j, e in enumerate(ids)])
                k = kernels()
                y = gemv.quant_matmul_experts(x, sp, idt, "MXFP4", cols, kernels=k, split=True)
                assert y.dtype == x.dtype and tuple(y.shape) == (len(ids), rows) and k.mxfp4 == "dp4a"
                tol = 1e-5 if x.dtype == torch.float32 else 8e-3  # bf16 out: its own rounding
                assert rel(y, wq) < tol, ("int8 x", cfg, rows, cols, xr, x.dtype, rel(y, wq))
                assert rel(y, want) < DP4A_TOL, ("x", cfg, rows, cols, xr, rel(y, want))
                y2 = gemv.quant_matmul_experts(x, sp, idt, "MXFP4", cols, kernels=k, xq=xq, split=True)
                assert torch.equal(y, y2)
                for stack, split in ((sp, True), (st, False)):
                    yf = gemv.quant_matmul_experts(x.float(), stack, idt, "MXFP4", cols,
                                                   kernels=kernels(mxfp4="float"), split=split)
                    assert rel(yf, want) < 1e-5, (split, rows, cols, rel(yf, want))
    finally:
        gemv.MXFP4_DP4A = default
    # a dp4a launch that fails (e.g. a Triton that cannot build the inline PTX): the float kernel, on this holder
    real, k = gemv._mxfp4_dp4a, kernels()
    gemv._mxfp4_dp4a = None  # not subscriptable: the launch raises
    try:
        y = gemv.quant_matmul_experts(x.float(), sp, idt, "MXFP4", cols, kernels=k, split=True)
    finally:
        gemv._mxfp4_dp4a = real
    assert k.mxfp4 == "float" and rel(y, want) < 1e-5
    from strata.models import resident  # a resident stack re-laid where the kernels run (here: the interpreter
    p = resident.Packed(st.clone(), "MXFP4", cols, torch.float32)
    resident._split_mxfp4(p)
    assert p.split and torch.equal(p.data, sp) and p.slab == rows * (cols // 32)
    out = torch.empty((E - 1) * rows, cols)
    p.into(out, 1, E)  # strata.quant.into's kernel on the split layout (prefill's group of experts)
    assert torch.equal(out, dequantize(st[1:].reshape(-1, st.shape[-1]), "MXFP4"))
    try:
        gemv.quant_matmul_experts(x, sp[:, :3].contiguous(), idt, "MXFP4", cols, split=True)
        raise AssertionError("a stack of 3 rows of one block (not whole words an expert) was taken as split")
    except ValueError:
        pass


CHECKS = [check_kernel_matches_reference, check_q6_k_words_matches_reference, check_k45_words_matches_reference,
          check_dp4a_failure_falls_back_to_words,
          check_parts_side_by_side, check_model_decode_fused,
          check_model_decode_fused_q4_k_m, check_iq3s_dp4a_matches_reference, check_q8_0_dp4a_matches_reference,
          check_split_k_matches_reference, check_quantize_x,
          check_dequantize_into]


def _run_checks() -> None:
    run_checks(CHECKS)


@pytest.fixture(scope="module")
def interpreted_results() -> dict:
    return module_results("test_quant_gemv")


@pytest.mark.slow
@pytest.mark.parametrize("name", [fn.__name__ for fn in CHECKS])
def test_interpreted(interpreted_results, name):
    assert interpreted_results[name] == "ok", interpreted_results[name]


@pytest.mark.slow
def test_mxfp4_dp4a_experts_interpreted():
    """check_mxfp4_dp4a_experts in a process of its own (run alone: pytest -k mxfp4)."""
    p = interpreted("import test_quant_gemv as t; t.check_mxfp4_dp4a_experts(); print('ok')")
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stderr[-4000:]


@pytest.mark.slow
def test_graph_body_int8_x_interpreted():
    """check_graph_body_int8_x in a process of its own (the shared fixture's has no time left for it)."""
    p = interpreted("import test_quant_gemv as t; t.check_graph_body_int8_x(); print('ok')", timeout=400)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stderr[-4000:]


@pytest.mark.slow
def test_supports():
    from strata.quant import gemv
    assert gemv.supports("IQ3_S") and gemv.supports("iq3_s") and gemv.supports("Q8_0") and gemv.supports("Q4_K")
    assert gemv.supports("Q6_K") and gemv.supports("Q5_K") and all(gemv.supports(q) for q in ("Q4_0", "Q4_1", "Q5_0",
                                                                                           "Q5_1"))
    assert not gemv.supports("Q3_K") and not gemv.supports("F16") and not gemv.supports("nonsense")
    assert not gemv.available("cpu") or gemv.INTERPRET


@pytest.mark.slow
def test_iq3s_sign_trick_on_the_grid():
    """The dp4a kernel's sign step on every (grid entry, sign nibble): (g ^ mask) + lsb on the packed word
    gives the signed table's word (each byte negated as int8 where its bit is set), which holds because
    the grid's bytes are nonzero (odd, 1..15): no byte carries into the next. And the uint16 nibble table
    spreads back to the packed word."""
    from strata.quant import gemv
    g = gemv.iq3_s_words("cpu", 0).long() & 0xFFFFFFFF  # (512,)
    b = torch.stack([(g >> (8 * t)) & 255 for t in range(4)], dim=1)
    assert bool(((b >= 1) & (b <= 15) & (b % 2 == 1)).all())
    nib = torch.arange(16)
    lsb = (nib * 0x204081) & 0x01010101
    w = ((g[:, None] ^ (lsb * 255)[None]) + lsb[None]) & 0xFFFFFFFF  # (512, 16), int32 wraparound as on the GPU
    signed = gemv.iq3_s_words("cpu", 1).long() & 0xFFFFFFFF
    assert torch.equal(w.reshape(-1), signed)
    e = gemv.iq3_s_words("cpu", 2).to(torch.int32).long() & 0xFFFF
    e = (e | (e << 8)) & 0x00FF00FF
    assert torch.equal((e | (e << 4)) & 0x0F0F0F0F, g)


@pytest.mark.slow
def test_bad_blocks_refused():
    from strata.quant import gemv
    with pytest.raises(ValueError):
        gemv.quant_matmul(torch.zeros(1, 256), torch.zeros(4, 109, dtype=torch.uint8), "IQ3_S", 256)
    with pytest.raises(ValueError):
        gemv.quant_matmul(torch.zeros(1, 128), torch.zeros(4, 110, dtype=torch.uint8), "IQ3_S", 128)
    with pytest.raises(ValueError):
        gemv.quant_matmul(torch.zeros(1, 256), torch.zeros(4, 110, dtype=torch.uint8), "Q3_K", 256)
    with pytest.raises(ValueError):
        gemv.quant_matmul(torch.zeros(1, 256), torch.zeros(4, 209, dtype=torch.uint8), "Q6_K", 256)


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows,xr", [(5760, 1), (2880, 4)])  # gpt-oss-20b's gate/up (x one row) and down
def test_gpu_mxfp4_dp4a_experts(rows, xr):
    """CUDA (PTX prmt and dp4a): the MXFP4 dp4a experts kernel at gpt-oss-20b's shapes (4 of 32 experts, 2,880
    columns: 90 blocks a row) against the float kernel on the file's layout: to float32 summation with x's int8
    rounding as its x, within DP4A_TOL with x itself; the dp4a kernel stays chosen (no fallback), and a CUDA graph
    of it (xq given, and made inside) replays the eager bits."""
    from strata.quant import gemv, mxfp4, random_blocks
    cols, g = 2880, torch.Generator().manual_seed(31)
    st = random_blocks("MXFP4", 32 * rows, cols, g).view(32, rows, -1).contiguous().cuda()
    sp = mxfp4.to_split(st)
    ids = torch.tensor([7, 30, 2, 7]).cuda()  # a repeated expert too
    x = torch.randn(xr, cols, generator=g).cuda()
    xq = gemv.quantize_x(x)
    k, fl = kernels(), kernels(mxfp4="float")
    y = gemv.quant_matmul_experts(x, sp, ids, "MXFP4", cols, kernels=k, split=True)
    assert k.mxfp4 == "dp4a"
    want = gemv.quant_matmul_experts(x, st, ids, "MXFP4", cols, kernels=fl)
    wq = gemv.quant_matmul_experts(gemv.int8_x(*xq).float(), st, ids, "MXFP4", cols, kernels=fl)
    assert rel(y, wq) < 1e-5, rel(y, wq)
    assert rel(y, want) < DP4A_TOL, rel(y, want)
    assert rel(gemv.quant_matmul_experts(x, sp, ids, "MXFP4", cols, kernels=fl, split=True), want) < 1e-6
    yb = gemv.quant_matmul_experts(x.bfloat16(), sp, ids, "MXFP4", cols, kernels=k, split=True)
    assert yb.dtype == torch.bfloat16 and rel(yb, want) < DP4A_TOL
    for given in (xq, None):
        out = {}

        def fn():
            out["y"] = gemv.quant_matmul_experts(x, sp, ids, "MXFP4", cols, kernels=k, xq=given, split=True)
        fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out["y"], y)


# -- CUDA -----------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [(5120, 2880), (2880, 4096), (50000, 2880), (4096, 14336), (8192, 28672)])
@pytest.mark.parametrize("m", [1, 3])
def test_gpu_q8_0_dp4a_shapes(shape, m):
    """Q8_0's dp4a kernel at gpt-oss-20b's shapes (90 blocks a row: steps with a weighed-0 tail; a big launch, which
    keeps the byte kernel) and 8B / 70B ones, bf16 x: to float32 accumulation of the product with x's int8
    rounding, within DP4A_TOL of x's, and the same bits in a CUDA graph's replay."""
    from strata.quant import gemv, random_blocks
    rows, cols = shape
    g = torch.Generator(device="cuda").manual_seed(rows + cols + m)
    blocks = random_blocks("Q8_0", rows, cols, g, device="cuda")
    x = torch.randn(m, cols, generator=g, device="cuda").bfloat16()
    y = gemv.quant_matmul(x, blocks, "Q8_0", cols, out=torch.empty(m, rows, device="cuda"),
                          kernels=kernels(q8_0="dp4a")).cpu()  # float32: the accumulation, not bf16's rounding
    want = reference(x, blocks, "Q8_0")
    if rows >= gemv.BIG_ROWS:  # the byte kernel on float x
        assert rel(y, want) < 8e-3
    else:
        assert rel(y, reference(gemv.int8_x(*gemv.quantize_x(x)), blocks, "Q8_0")) < 1e-5
        assert rel(y, want) < DP4A_TOL, rel(y, want)
    _check_graph_replay(gemv, [(blocks, "Q8_0")], cols, g, kernels(q8_0="dp4a"))


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [(8192, 8192), (28672, 8192), (8192, 28672)])
@pytest.mark.parametrize("qtype", ["IQ3_S", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q4_0", "Q5_1"])
@pytest.mark.parametrize("m", [1, 3])
def test_gpu_70b_shapes(shape, qtype, m):
    """At a 70B layer's shapes, bf16 x: the kernel agrees with dequantize + F.linear (bf16) and with float64
    (IQ3_S: the float kernel, Q6_K: the byte kernel, Q4_K and Q5_K: words; the others in
    test_gpu_iq3s_dp4a_70b_shapes and test_gpu_word_kernels_shapes)."""
    from strata.quant import dequantize, gemv, random_blocks
    # (the word kernels: test_gpu_word_kernels_shapes; Q8_0's dp4a: test_gpu_q8_0_dp4a_shapes)
    k = kernels(iq3s="float", q6k="bytes", kquant="words", q8_0="bytes")
    rows, cols = shape
    g = torch.Generator(device="cuda").manual_seed(rows + cols + m)
    blocks = random_blocks(qtype, rows, cols, g, device="cuda")
    x = torch.randn(m, cols, generator=g, device="cuda").bfloat16()
    y = gemv.quant_matmul(x, blocks, qtype, cols, kernels=k)
    w = dequantize(blocks, qtype)
    want = x.double() @ w.double().T
    current = torch.nn.functional.linear(x, w.bfloat16())
    assert rel(y, want) < 8e-3 and rel(y, current) < 1.2e-2, (rel(y, want), rel(current, want))
    y32 = gemv.quant_matmul(x.float(), blocks, qtype, cols, kernels=k)
    assert rel(y32, want) < 1e-5


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [(1024, 4096), (4096, 14336), (28672, 4096), (128256, 4096), (8192, 28672),
                                   (6144, 5376), (43008, 5376)])  # Gemma-3-27B's 21 blocks a row: a weighed-0 tail
@pytest.mark.parametrize("qtype", ["Q6_K", "Q4_K", "Q5_K"])
@pytest.mark.parametrize("mode", ["words", "dp4a"])
@pytest.mark.parametrize("m", [1, 3, 4])
def test_gpu_word_kernels_shapes(shape, qtype, mode, m):
    """The K-quants' int32-word kernels at 8B / 70B shapes, bf16 x: words within bf16 of float64 and with
    float32 x within float32 accumulation; dp4a to float32 accumulation of the product with x's int8 rounding
    and within DP4A_TOL of x's."""
    from strata.quant import dequantize, gemv, random_blocks
    k = kernels(**{"q6k" if qtype == "Q6_K" else "kquant": mode})
    rows, cols = shape
    g = torch.Generator(device="cuda").manual_seed(rows + cols + m)
    blocks = random_blocks(qtype, rows, cols, g, device="cuda")
    x = torch.randn(m, cols, generator=g, device="cuda").bfloat16()
    w = dequantize(blocks, qtype).double()
    want = x.double() @ w.T
    y = gemv.quant_matmul(x, blocks, qtype, cols, out=torch.empty(m, rows, device="cuda"), kernels=k)
    if mode == "words":
        assert rel(y, want) < 1e-5
        assert rel(gemv.quant_matmul(x.float(), blocks, qtype, cols, kernels=k), want) < 1e-5
    else:
        assert rel(y, gemv.int8_x(*gemv.quantize_x(x)) @ w.T) < 1e-5
        assert rel(y, want) < DP4A_TOL, rel(y, want)
    assert rel(gemv.quant_matmul(x, blocks, qtype, cols, kernels=k), want) < (DP4A_TOL if mode == "dp4a" else 0) + 8e-3


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [(5376, 21504), (5120, 25600)])
@pytest.mark.parametrize("qtype", ["Q6_K", "Q4_K"])
def test_gpu_split_k_down_shapes(shape, qtype):
    """ffn_down at Gemma-3-27B's and Qwen3-32B's shapes takes the split-K launch by default (Config.split): dp4a to
    float32 accumulation of the int8 x product, the bits of a CUDA graph's replay, and within 1e-6 of the unsplit
    launch (another summation order only)."""
    import dataclasses
    from strata.quant import dequantize, gemv, random_blocks
    rows, cols = shape
    k = kernels(q6k="dp4a", kquant="dp4a")
    cfg = gemv.Q6K_WORDS_CONFIGS["dp4a"][0] if qtype == "Q6_K" else gemv.KQ_WORDS
    assert cfg.split > 1
    g = torch.Generator(device="cuda").manual_seed(rows)
    blocks = random_blocks(qtype, rows, cols, g, device="cuda")
    x = torch.randn(1, cols, generator=g, device="cuda").bfloat16()
    y = gemv.quant_matmul(x, blocks, qtype, cols, out=torch.empty(1, rows, device="cuda"), kernels=k)
    assert rel(y, gemv.int8_x(*gemv.quantize_x(x)) @ dequantize(blocks, qtype).double().T) < 1e-5
    one = gemv.quant_matmul(x, blocks, qtype, cols, out=torch.empty(1, rows, device="cuda"), kernels=k,
                            config=dataclasses.replace(cfg, split=1))
    assert rel(y, one) < 1e-6 and not torch.equal(y, one)  # the split launch did run
    _check_graph_replay(gemv, [(blocks, qtype)], cols, g, k)


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["words", "dp4a"])
def test_gpu_q6_k_graph_capture(mode):
    """Q4_K + Q6_K parts (q/k and v of a Q4_K_M layer), M=2, captured in a CUDA graph: a replay with new x gives
    what an eager call gives (dp4a: x's quantization captured too)."""
    from strata.quant import gemv, random_blocks
    g = torch.Generator(device="cuda").manual_seed(2)
    cols = 1024
    parts = [(random_blocks(q, r, cols, g, device="cuda"), q) for q, r in (("Q4_K", 1024), ("Q4_K", 256), ("Q6_K", 256))]
    _check_graph_replay(gemv, parts, cols, g, kernels(q6k=mode, kquant=mode))


def _check_graph_replay(gemv, parts, cols, g, k, after_first=lambda: None):
    """quant_matmul_parts with M=2 (the kernels k) captured in a CUDA graph: a replay on new x gives an eager
    call's bits. after_first: a check once the first (eager) call has compiled and made the tables."""
    x = torch.randn(2, cols, generator=g, device="cuda").bfloat16()
    gemv.quant_matmul_parts(x, parts, cols, kernels=k)
    after_first()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = gemv.quant_matmul_parts(x, parts, cols, kernels=k)
    x.copy_(torch.randn(2, cols, generator=g, device="cuda"))
    graph.replay()
    assert torch.equal(y, gemv.quant_matmul_parts(x, parts, cols, kernels=k))


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [(8192, 8192), (28672, 8192), (8192, 28672), (128256, 8192)])
@pytest.mark.parametrize("mode", IQ3S_DP4A)
@pytest.mark.parametrize("m", [1, 3, 4])
def test_gpu_iq3s_dp4a_70b_shapes(shape, mode, m):
    """The dp4a IQ3_S kernels at a 70B model's shapes (head included), bf16 x: to float32 accumulation of
    the float64 product with x's int8 rounding (the PTX dp4a path, exact integer sums), within DP4A_TOL of
    the one with x, and the bf16 result within DP4A_TOL + bf16 rounding."""
    from strata.quant import dequantize, gemv, random_blocks
    k = kernels(iq3s=mode)
    rows, cols = shape
    g = torch.Generator(device="cuda").manual_seed(rows + cols + m)
    blocks = random_blocks("IQ3_S", rows, cols, g, device="cuda")
    x = torch.randn(m, cols, generator=g, device="cuda").bfloat16()
    q, s = gemv.quantize_x(x)
    qr, sr = quantize_ref(x)
    xq = gemv.int8_x(q, s)
    q = gemv.int8_x(q, torch.ones_like(s)).cpu()
    assert rel(s.cpu(), sr) < 1e-7 and float((q - qr).abs().max()) <= 1  # ties may round either way
    w = dequantize(blocks, "IQ3_S").double()
    y = gemv.quant_matmul(x, blocks, "IQ3_S", cols, out=torch.empty(m, rows, device="cuda"), kernels=k)
    assert k.iq3s == mode  # no fallback to the float kernel
    assert rel(y, xq @ w.T) < 1e-5
    want = x.double() @ w.T
    assert rel(y, want) < DP4A_TOL, rel(y, want)
    assert rel(gemv.quant_matmul(x, blocks, "IQ3_S", cols, kernels=k), want) < DP4A_TOL + 8e-3


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ("float",) + IQ3S_DP4A)
def test_gpu_block_decode_fused_vs_unfused(dtype, mode, monkeypatch):
    """synthetic:smoke-wide@IQ3_S resident on CUDA: decode steps with the kernels give the logits of the
    scratch path (dequantize + F.linear), and the fused path is the one taken."""
    from strata.models import model as M
    from strata.models import resident as R
    from strata.weights.checkpoint import load_stage, model_args
    from strata.config import KernelSpec
    model = "synthetic:smoke-wide@IQ3_S"
    args = model_args(model)

    def run(fused: bool) -> list[torch.Tensor]:
        if not fused:  # the layers and the head take the scratch path
            monkeypatch.setattr(R, "fused_ok", lambda p, device: False)  # (strata.models.model has no fused_ok)
        m = load_stage(model, args, 0, args.n_layers, device="cuda", dtype=dtype, weights="resident", max_len=64,
                       kernels=KernelSpec(gemv_iq3s=mode, gemv_q8_0="bytes" if mode == "float" else "dp4a"))
        blk = next(iter(m.layers.values()))
        assert isinstance(blk.weights, M.ResidentMatrices) and blk.weights.fused_decode_ok("cuda") == fused
        ids = torch.randint(0, args.vocab_size, (1, 20), generator=torch.Generator().manual_seed(0)).cuda()
        h = m(ids[:, :16], 0)
        out = [m.logits(h[0, -1:])]
        for p, t in ((16, 1), (17, 3)):
            out.append(m.logits(m(ids[:, p:p + t], p)[0]))
        monkeypatch.undo()
        return out

    tol = 1e-4 if dtype == torch.float32 and mode == "float" else 3e-2  # int8 x: ~DP4A_TOL per product
    for a, b in zip(run(True), run(False)):
        assert rel(a, b) < tol, rel(a, b)


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ("float",) + IQ3S_DP4A)
def test_gpu_graph_capture(mode):
    """quant_matmul_parts (q/k/v-like parts, M=2) captured in a CUDA graph: a replay with new x gives
    what an eager call gives (dp4a: x's quantization captured too)."""
    from strata.quant import gemv, random_blocks
    k = kernels(iq3s=mode)
    g = torch.Generator(device="cuda").manual_seed(1)
    cols = 1024
    parts = [(random_blocks("IQ3_S", r, cols, g, device="cuda"), "IQ3_S") for r in (1024, 256, 256)]

    def no_fallback():
        assert k.iq3s == mode  # the dp4a kernels did not fall back to the float one
    _check_graph_replay(gemv, parts, cols, g, k, no_fallback)
