"""The quantized-weight Triton kernels compile for an H100/H200 (sm_90) on a machine without a GPU: Triton's
interpreter (test_quant_gemv.py) checks what they compute, not that the compiler takes them (a constexpr branch or
a cast the interpreter allows can fail there). The resident prefill's dequantization must also round to bf16 to
nearest even with no fused multiply-add, so that it gives the torch path's bits."""
import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

SM90 = GPUTarget("cuda", 90, 32)
GEMV_SIG = {"x_ptr": "*bf16", "out_ptr": "*fp32", "grid_ptr": "*i32", "a0": "*u8", "a1": "*u8", "a2": "*u8",
            "n0": "i32", "n1": "i32", "n2": "i32", "p0": "i32", "p1": "i32", "nb": "i32", "cols": "i32",
            "out_stride": "i32", "M": "constexpr", "BLOCK_N": "constexpr", "SB": "constexpr"}


def ptx(fn, signature: dict, constexprs: dict, **options) -> str:
    try:
        return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=SM90,
                              options=options).asm["ptx"]
    except FileNotFoundError as e:  # a Triton wheel without its bundled ptxas
        pytest.skip(f"no CUDA toolchain in this Triton: {e}")


@pytest.mark.parametrize("name", ["_iq3_s_gemv", "_q8_0_gemv", "_q4_k_gemv", "_q5_k_gemv", "_q6_k_gemv"])
@pytest.mark.parametrize("m", [1, 4])
def test_decode_gemv_kernels_compile_for_sm90(name, m):
    from strata.quant import gemv
    code = ptx(getattr(gemv, name), GEMV_SIG, {"M": m, "BLOCK_N": 8, "SB": 2})
    assert ".target sm_90" in code and "ld.global" in code


@pytest.mark.parametrize("name,extra", [("_q8_0_into", {}), ("_k45_into", {"FIVE": False}),
                                        ("_k45_into", {"FIVE": True}), ("_q6_k_into", {})])
@pytest.mark.parametrize("out", ["*bf16", "*fp32"])
def test_prefill_dequant_kernels_compile_round_to_nearest_without_fma(name, extra, out):
    from strata.quant import into
    sig = {"b_ptr": "*u8", "out_ptr": out, "n_blocks": "i32", **{k: "constexpr" for k in extra}, "BLOCKS": "constexpr"}
    code = ptx(getattr(into, name), sig, {"BLOCKS": 4, **extra}, enable_fp_fusion=False)
    assert "fma.rn.f32" not in code
    casts = {line.split()[0] for line in code.splitlines() if "cvt" in line and "bf16.f32" in line}
    assert casts == ({"cvt.rn.bf16.f32"} if out == "*bf16" else set())


def test_iq3s_dequant_kernel_stores_bf16_rounded_to_nearest():
    from strata.quant import iq
    sig = {"blocks_ptr": "*u8", "grid_ptr": "*fp32", "out_ptr": "*bf16", "n_blocks": "i32", "BLOCKS": "constexpr"}
    code = ptx(iq._iq3_s_kernel, sig, {"BLOCKS": 4}, enable_fp_fusion=False)
    assert "fma.rn.f32" not in code and "cvt.rn.bf16.f32" in code
