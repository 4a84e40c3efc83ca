"""Strata's Triton kernels compile for an H100/H200 (sm_90) on a machine without a GPU, so CI catches what only
the compiler refuses: Triton's interpreter (the CPU tests of the kernels) checks what they compute, not that the
compiler takes them (a constexpr branch or a cast the interpreter allows can fail there). The resident prefill's
dequantization must also round to bf16 to nearest even with no fused multiply-add, to give the torch path's bits."""
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


@pytest.mark.parametrize("qtype", ["IQ3_S", "Q8_0", "Q6_K", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K/bytes", "Q5_K/bytes"])
@pytest.mark.parametrize("m", [1, 4])
def test_decode_gemv_kernels_compile_for_sm90(qtype, m):
    from strata.quant import gemv
    kernel, family = gemv._KERNELS[qtype.split("/")[0]]
    if qtype.endswith("/bytes"):  # the K-quants' byte-wise kernel (kernels.gemv_kquant: bytes, the A/B arm)
        kernel = gemv._k45_gemv
    sig = {**GEMV_SIG, **{k: "constexpr" for k in family}}
    code = ptx(kernel, sig, {"M": m, "BLOCK_N": 8, "SB": 2, **family})
    assert ".target sm_90" in code and "ld.global" in code


WORDS_SIG = {"x_ptr": "*bf16", "xq_ptr": "*i32", "xs_ptr": "*fp32", **{k: v for k, v in GEMV_SIG.items() if k not in (
    "x_ptr", "grid_ptr")}, "ids_ptr": "*i64", "estride": "i64", "xstep": "i32", "sstride": "i32",
    "SPLIT": "constexpr", "DP4A": "constexpr",
    "PTX": "constexpr", "EXPERTS": "constexpr"}
# (m, experts): the experts mode (strata.quant.gemv.quant_matmul_experts) takes one x row
WORD_CASES = [(1, False), (4, False), (1, True)]


@pytest.mark.parametrize("five,tail", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("dp4a", [False, True])
@pytest.mark.parametrize("m,experts", WORD_CASES)
def test_k45_words_kernel_compiles_for_sm90(five, tail, dp4a, m, experts):
    """Q4_K / Q5_K read in int32 words (kernels.gemv_kquant: words, float x; dp4a, int8 x and PTX dp4a), also in
    the experts mode (the expert ids read on the device), and with a weighed-0 tail (an odd block count a row)."""
    from strata.quant import gemv
    code = ptx(gemv._k45_words_gemv, {**WORDS_SIG, "FIVE": "constexpr", "TAIL": "constexpr"},
               {"M": m, "BLOCK_N": 8, "SB": 2, "FIVE": five, "DP4A": dp4a, "PTX": True, "EXPERTS": experts,
                "TAIL": tail, "SPLIT": 1})
    assert ".target sm_90" in code and "ld.global" in code and ("dp4a" in code) == dp4a


ROWS_SIG = {"x_ptr": "*bf16", "out_ptr": "*fp32", "a0": "*u8", "a1": "*u8", "a2": "*u8",
            **{k: "i32" for k in ("n0", "n1", "n2", "p0", "p1", "nb", "cols", "out_stride", "part_stride", "M")},
            "R": "constexpr", "BLOCK_N": "constexpr", "SPLIT": "constexpr"}


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("r,split", [(16, 1), (64, 3)])
def test_rows_kernels_compile_to_bf16_tensor_cores_for_sm90(qtype, r, split):
    """strata.quant.rows (kernels.gemv_rows: mma-float): bf16 x against dequantized weights compiles to bf16 mma
    instructions (warpgroup or mma.sync) accumulating in float32."""
    from strata.quant import rows
    kernel, family = rows._KERNELS[qtype]
    code = ptx(kernel, {**ROWS_SIG, **{k: "constexpr" for k in family}},
               {"R": r, "BLOCK_N": rows.BLOCK_N, "SPLIT": split, **family}, num_warps=4, num_stages=rows.STAGES)
    assert ".target sm_90" in code and "ld.global" in code
    assert ("mma" in code or "wgmma" in code) and ".bf16" in code, "the products are not on bf16 tensor cores"


@pytest.mark.parametrize("kernel", ["q6k_pairs", "q6k_odd", "k45", "k45_tail"])
def test_split_k_word_kernels_compile_for_sm90(kernel):
    """The word kernels' split-K launches (Config.split: partial rows, then _sum_splits) for sm_90."""
    from strata.quant import gemv
    extra = {"q6k_pairs": {"PAIRS": True}, "q6k_odd": {"PAIRS": False}, "k45": {"FIVE": False, "TAIL": False},
             "k45_tail": {"FIVE": False, "TAIL": True}}[kernel]
    fn = gemv._q6_k_words if kernel.startswith("q6k") else gemv._k45_words_gemv
    code = ptx(fn, {**WORDS_SIG, **{k: "constexpr" for k in extra}},
               {"M": 1, "BLOCK_N": 8, "SB": 2, "DP4A": True, "PTX": True, "EXPERTS": False, "SPLIT": 4, **extra})
    assert ".target sm_90" in code and "dp4a" in code
    code = ptx(gemv._sum_splits, {"part_ptr": "*fp32", "out_ptr": "*bf16", "n": "i32", "part_stride": "i32",
                                  "out_stride": "i32", "SPLIT": "constexpr", "BLOCK": "constexpr"},
               {"SPLIT": 4, "BLOCK": gemv.SUM_COLS})
    assert ".target sm_90" in code


@pytest.mark.parametrize("pairs", [True, False])
@pytest.mark.parametrize("dp4a", [False, True])
@pytest.mark.parametrize("m,experts", WORD_CASES)
def test_q6_k_words_kernel_compiles_for_sm90(dp4a, m, experts, pairs):
    """Q6_K read in int32 words (kernels.gemv_q6k: words, float x; dp4a, int8 x and PTX dp4a), and as experts;
    two blocks a step (an even count a row) or one, its parity per row (an odd count)."""
    from strata.quant import gemv
    code = ptx(gemv._q6_k_words, {**WORDS_SIG, "PAIRS": "constexpr"},
               {"M": m, "BLOCK_N": 4, "SB": 2, "DP4A": dp4a, "PTX": True, "EXPERTS": experts, "PAIRS": pairs,
                "SPLIT": 1})
    assert ".target sm_90" in code and "ld.global" in code and ("dp4a" in code) == dp4a


@pytest.mark.parametrize("tail", [False, True])
@pytest.mark.parametrize("m", [1, 4])
def test_q8_0_dp4a_kernel_compiles_for_sm90(m, tail):
    """Q8_0 on int8 x (kernels.gemv_q8_0: dp4a): int16 loads, PTX dp4a; with a weighed-0 tail."""
    from strata.quant import gemv
    sig = {"xq_ptr": "*i32", "xs_ptr": "*fp32", **{k: v for k, v in GEMV_SIG.items() if k not in ("x_ptr", "grid_ptr")},
           "PTX": "constexpr", "TAIL": "constexpr"}
    code = ptx(gemv._q8_0_dp4a, sig, {"M": m, "BLOCK_N": 8, "SB": 4, "PTX": True, "TAIL": tail})
    assert ".target sm_90" in code and "ld.global" in code and "dp4a" in code


@pytest.mark.parametrize("split", [False, True])
def test_mxfp4_experts_kernel_compiles_for_sm90(split):
    """The float MXFP4 experts kernel (kernels.gemv_mxfp4: float), on the file's layout and the split one."""
    from strata.quant import gemv
    sig = {"x_ptr": "*bf16", "out_ptr": "*bf16", "stack_ptr": "*u8", "ids_ptr": "*i64", "estride": "i64",
           "xstep": "i32", "rows": "i32", "nb": "i32", "per": "i32", "BLOCK_N": "constexpr", "SB": "constexpr",
           "SPLIT": "constexpr"}
    code = ptx(gemv._mxfp4_experts, sig, {"BLOCK_N": 4, "SB": 4, "SPLIT": split})
    assert ".target sm_90" in code and "ld.global" in code


@pytest.mark.parametrize("tail", [False, True])
def test_mxfp4_dp4a_experts_kernel_compiles_for_sm90(tail):
    """The MXFP4 experts on int8 x (kernels.gemv_mxfp4: dp4a): the nibbles by PTX prmt, dp4a; with a weighed-0
    tail (90 blocks a row in steps of 8), and the interpreter's emulation (PTX off) compiles too."""
    from strata.quant import gemv
    sig = {"xq_ptr": "*i64", "xs_ptr": "*fp32", "out_ptr": "*bf16", "stack_ptr": "*u8", "ids_ptr": "*i64",
           "estride": "i64", "xrow": "i32", "rows": "i32", "nb": "i32", "per": "i32", "BLOCK_N": "constexpr",
           "SB": "constexpr", "PTX": "constexpr", "TAIL": "constexpr"}
    cfg = gemv.MXFP4_DP4A
    code = ptx(gemv._mxfp4_dp4a, sig, {"BLOCK_N": cfg.block_n, "SB": cfg.sb, "PTX": True, "TAIL": tail},
               num_warps=cfg.num_warps)
    assert ".target sm_90" in code and "ld.global" in code and "prmt.b32" in code and "dp4a.s32.s32" in code
    code = ptx(gemv._mxfp4_dp4a, sig, {"BLOCK_N": 4, "SB": 2, "PTX": False, "TAIL": tail})
    assert "prmt.b32 " not in code and "dp4a.s32" not in code


@pytest.mark.parametrize("name,extra", [("_q8_0_into", {}), ("_k45_into", {"FIVE": False}),
                                        ("_k45_into", {"FIVE": True}), ("_q6_k_into", {}),
                                        ("_legacy_into", {"MIN": False, "FIVE": False}),
                                        ("_legacy_into", {"MIN": True, "FIVE": True}),
                                        ("_mxfp4_into", {"SPLIT": False}), ("_mxfp4_into", {"SPLIT": True})])
@pytest.mark.parametrize("out", ["*bf16", "*fp32"])
def test_prefill_dequant_kernels_compile_round_to_nearest_without_fma(name, extra, out):
    from strata.quant import into
    sig = {"b_ptr": "*u8", "out_ptr": out, "n_blocks": "i32", **({"per": "i32"} if name == "_mxfp4_into" else {}),
           **{k: "constexpr" for k in extra}, "BLOCKS": "constexpr"}
    code = ptx(getattr(into, name), sig, {"BLOCKS": 4, **extra}, enable_fp_fusion=False)
    assert "fma.rn.f32" not in code
    casts = {line.split()[0] for line in code.splitlines() if "cvt" in line and "bf16.f32" in line}
    assert casts == ({"cvt.rn.bf16.f32"} if out == "*bf16" else set())


def test_iq3s_dequant_kernel_stores_bf16_rounded_to_nearest():
    from strata.quant import iq
    sig = {"blocks_ptr": "*u8", "grid_ptr": "*fp32", "out_ptr": "*bf16", "n_blocks": "i32", "BLOCKS": "constexpr"}
    code = ptx(iq._iq3_s_kernel, sig, {"BLOCKS": 4}, enable_fp_fusion=False)
    assert "fma.rn.f32" not in code and "cvt.rn.bf16.f32" in code


# -- the prefill and decode-graph kernels at the 8B shape (32 heads, 8 KV heads, head dim 128, dim 4096) ----------
B16, F16, F32, I8, I32, I64 = "*bf16", "*fp16", "*fp32", "*i8", "i32", "*i64"


def _kernel_cases():
    from strata.kernels import decode_attention as da
    from strata.kernels import decode_gemv as dg
    from strata.kernels import decode_kernels as dk
    from strata.kernels import fused as k
    ints = lambda *names: {n: I32 for n in names}  # noqa: E731
    cases = {
        "lse_merge": (k._lse_merge_kernel, {"op": B16, "os_": B16, "lp": F32, "ls": F32, "out": B16,
                                            **ints("T", "sp_h", "sp_t", "ss_h", "ss_t", "slp_h", "slp_t", "sls_h",
                                                   "sls_t", "so_h", "so_t")},
                      {"D": 128, "ROWS": k.MERGE_ROWS, "BLOCK_D": 128}),
        "gated": (k._gated_kernel, {"g": B16, "u": B16, "out": B16, **ints("cols", "s_g", "s_u", "s_o")},
                  {"ACT": 1, "BLOCK": k.SILU_COLS}),
        "rope": (k._rope_kernel, {"x": B16, "cos": B16, "ssin": B16, "out": B16, **ints("T", "sx_t", "sc_t")},
                 {"H": 32, "D": 128, "ROWS": k.ROPE_ROWS}),
        "split_k_partial": (da._partial, {"q_ptr": B16, "k_ptr": B16, "v_ptr": B16, "ks_ptr": B16, "vs_ptr": B16,
                                          "len_ptr": I64, "m_ptr": F32,
                                          "l_ptr": F32, "acc_ptr": F32, **ints("sk_h", "sk_s", "sv_h", "sv_s", "span"),
                                          "scale": "fp32", **ints("window", "ring"), "slot_ptr": I64,
                                          **ints("sk_slot", "sv_slot")},
                            {"G": 4, "GP": 16, "HD": 128, "BLOCK": da.BLOCK_N, "PREC": "tf32", "Q8": False,
                             "INT8": 0, "PTX": True, "ROWS": False}),
        "split_k_partial_q8": (da._partial, {"q_ptr": B16, "k_ptr": I8, "v_ptr": I8, "ks_ptr": F16, "vs_ptr": F16,
                                             "len_ptr": I64, "m_ptr": F32, "l_ptr": F32, "acc_ptr": F32,
                                             **ints("sk_h", "sk_s", "sv_h", "sv_s", "span"), "scale": "fp32",
                                             **ints("window", "ring"), "slot_ptr": I64, **ints("sk_slot", "sv_slot")},
                               {"G": 4, "GP": 16, "HD": 128, "BLOCK": da.BLOCK_N, "PREC": "tf32", "Q8": True,
                                "INT8": 0, "PTX": True, "ROWS": False}),
        "q8_0_widen": (k._q8_0_widen_kernel, {"qs": I8, "ds": F16, "out": B16, **ints("T", "s_h", "s_t")},
                       {"HD": 128, "ROWS": k.ROPE_ROWS}),
        "split_k_merge": (da._merge, {"m_ptr": F32, "l_ptr": F32, "acc_ptr": F32, "o_ptr": B16, "sink_ptr": F32,
                                      "n_split": I32, "q_ptr": F32, "s_ptr": F32},
                          {"G": 4, "GP": 16, "HD": 128, "SP": 64, "SINKS": False, "ROWS": False, "INT8": False}),
        "split_k_merge_int8": (da._merge, {"m_ptr": F32, "l_ptr": F32, "acc_ptr": F32, "o_ptr": B16, "sink_ptr": F32,
                                           "n_split": I32, "q_ptr": I8, "s_ptr": F32},
                               {"G": 4, "GP": 16, "HD": 128, "SP": 64, "SINKS": False, "ROWS": False, "INT8": True}),
        "split_k_merge_sinks": (da._merge, {"m_ptr": F32, "l_ptr": F32, "acc_ptr": F32, "o_ptr": B16,
                                            "sink_ptr": F32, "n_split": I32, "q_ptr": F32, "s_ptr": F32},
                                {"G": 4, "GP": 16, "HD": 128, "SP": 64, "SINKS": True, "ROWS": False, "INT8": False}),
        "rms_norm": (dk._rms_norm, {"x_ptr": B16, "w_ptr": B16, "out_ptr": B16, "q_ptr": B16, "s_ptr": B16, "n": I32,
                                    "eps": "fp32"}, {"BLOCK": 4096, "INT8": False}),
        "rms_norm_upcast_int8": (dk._rms_norm, {"x_ptr": B16, "w_ptr": F32, "out_ptr": B16, "q_ptr": I8, "s_ptr": F32,
                                                "n": I32, "eps": "fp32"}, {"BLOCK": 8192, "INT8": True}),
        "add_rms_norm": (dk._add_rms_norm, {"h_ptr": B16, "y_ptr": B16, "w_ptr": B16, "hout_ptr": B16,
                                            "out_ptr": B16, "q_ptr": I8, "s_ptr": F32, "pw_ptr": B16, "ew_ptr": B16,
                                            "n": I32, "eps": "fp32", "pre_eps": "fp32"},
                         {"BLOCK": 8192, "INT8": True, "PRE": False, "K": 0}),
        "add_rms_norm_pre": (dk._add_rms_norm, {"h_ptr": B16, "y_ptr": B16, "w_ptr": F32, "hout_ptr": B16,
                                                "out_ptr": B16, "q_ptr": I8, "s_ptr": F32, "pw_ptr": F32,
                                                "ew_ptr": B16, "n": I32, "eps": "fp32", "pre_eps": "fp32"},
                             {"BLOCK": 8192, "INT8": True, "PRE": True, "K": 0}),
        "add_rms_norm_experts": (dk._add_rms_norm, {"h_ptr": B16, "y_ptr": B16, "w_ptr": B16, "hout_ptr": B16,
                                                    "out_ptr": B16, "q_ptr": I8, "s_ptr": F32, "pw_ptr": B16,
                                                    "ew_ptr": F32, "n": I32, "eps": "fp32", "pre_eps": "fp32"},
                                 {"BLOCK": 2048, "INT8": True, "PRE": False, "K": 8}),
        "act_mul_silu_int8": (dk._act_mul, {"g_ptr": B16, "u_ptr": B16, "out_ptr": B16, "q_ptr": I8, "s_ptr": F32,
                                            "n": I32, "in_stride": I32}, {"ACT": 0, "BLOCK": dk.ACT_COLS, "INT8": True}),
        "act_mul_gelu": (dk._act_mul, {"g_ptr": B16, "u_ptr": B16, "out_ptr": B16, "q_ptr": B16, "s_ptr": B16,
                                       "n": I32, "in_stride": I32}, {"ACT": 1, "BLOCK": dk.ACT_COLS, "INT8": False}),
        "rope_store": (dk._rope_store, {"qkv_ptr": B16, "cos_ptr": B16, "ssin_ptr": B16, "pos_ptr": I64,
                                        "q_ptr": B16, "kc_ptr": B16, "vc_ptr": B16, "ks_ptr": B16, "vs_ptr": B16,
                                        "qw_ptr": B16, "kw_ptr": B16, "eps": "fp32",
                                        **ints("skh", "sks", "svh", "svs"), "slot_ptr": I64, **ints("sk_slot", "sv_slot")},
                       {"NH": 32, "NKV": 8, "HD": 128, "COLS": 128, "Q8": False, "QK_NORM": False, "ROWS": False}),
        "rope_store_qk_norm": (dk._rope_store, {"qkv_ptr": B16, "cos_ptr": B16, "ssin_ptr": B16, "pos_ptr": I64,
                                                "q_ptr": B16, "kc_ptr": B16, "vc_ptr": B16, "ks_ptr": B16,
                                                "vs_ptr": B16, "qw_ptr": F32, "kw_ptr": F32, "eps": "fp32",
                                                **ints("skh", "sks", "svh", "svs"), "slot_ptr": I64, **ints("sk_slot", "sv_slot")},
                               {"NH": 32, "NKV": 16, "HD": 256, "COLS": 256, "Q8": False, "QK_NORM": True, "ROWS": False}),
        "rope_store_q8": (dk._rope_store, {"qkv_ptr": B16, "cos_ptr": B16, "ssin_ptr": B16, "pos_ptr": I64,
                                           "q_ptr": B16, "kc_ptr": I8, "vc_ptr": I8, "ks_ptr": F16, "vs_ptr": F16,
                                           "qw_ptr": B16, "kw_ptr": B16, "eps": "fp32",
                                           **ints("skh", "sks", "svh", "svs"), "slot_ptr": I64, **ints("sk_slot", "sv_slot")},
                          {"NH": 32, "NKV": 8, "HD": 128, "COLS": 32, "Q8": True, "QK_NORM": True, "ROWS": False}),
        "argmax_blocks": (dk._argmax_blocks, {"x_ptr": F32, "n": I32, "vals_ptr": F32, "idx_ptr": I64},
                          {"BLOCK": dk.ARGMAX_BLOCK}),
        "argmax_final": (dk._argmax_final, {"vals_ptr": F32, "idx_ptr": I64, "parts": I32, "out_ptr": I64},
                         {"BLOCK": 32}),
        "dense_gemv": (dg._gemv, {"x_ptr": B16, "w_ptr": B16, "b_ptr": B16, "y_ptr": B16, "K": I32, "stride_w": I32},
                       {"HAS_BIAS": False, "BLOCK_N": 8, "BLOCK_K": 512}),
    }
    # the decode batches' launches (ROWS: each row its slot and position): the one-row kernels' signatures
    for name, base, extra in (("split_k_partial_rows", "split_k_partial", {}),
                              ("split_k_partial_q8_rows", "split_k_partial_q8", {"INT8": 2}),
                              ("split_k_merge_rows", "split_k_merge_sinks", {}),
                              ("rope_store_rows", "rope_store", {}), ("rope_store_rows_q8", "rope_store_q8", {})):
        fn, sig, c = cases[base]
        cases[name] = (fn, sig, {**c, **extra, "ROWS": True})
    return cases


@pytest.mark.parametrize("name", ["lse_merge", "gated", "rope", "split_k_partial", "split_k_partial_q8",
                                  "q8_0_widen", "split_k_merge", "split_k_merge_int8", "split_k_merge_sinks", "rms_norm",
                                  "rms_norm_upcast_int8", "act_mul_silu_int8", "add_rms_norm_pre", "act_mul_gelu",
                                  "add_rms_norm_experts",
                                  "rope_store_qk_norm",
                                  "add_rms_norm", "rope_store", "rope_store_q8", "argmax_blocks", "argmax_final",
                                  "dense_gemv", "rope_store_rows", "rope_store_rows_q8", "split_k_partial_rows",
                                  "split_k_partial_q8_rows", "split_k_merge_rows"])
def test_prefill_and_decode_kernels_compile_for_sm90(name):
    fn, sig, constexprs = _kernel_cases()[name]
    sig = {**sig, **{c: "constexpr" for c in constexprs}}
    assert ".target sm_90" in ptx(fn, sig, constexprs)


@pytest.mark.parametrize("hd,g,int8,block,stages", [(128, 4, 1, 64, 3), (128, 4, 2, 64, 3), (64, 8, 1, 64, 3),
                                                    (256, 2, 2, 64, 3), (128, 4, 2, 128, 2)])
def test_split_k_q8_int8_arm_compiles_for_sm90(hd, g, int8, block, stages):
    """kernels.q8_attention int8 (INT8 1) and int8x2 (2): the q8_0 partial kernel scores on int8 tensor cores (mma
    s8 x s8 -> s32) and widens V by the inline asm's byte permutes and packed float16 subtract / multiply, with no
    int8-to-float cvt left; pointers and the strides Triton specializes marked 16-byte divisible as a CUDA launch
    gives them (without that the values load byte by byte). PTX off (the interpreter's emulation) compiles too,
    without the asm. Also a tile of 128 keys with 2 stages (bench/splitk.py's sweep). No byte-wise shared-memory
    loads: the asm widens V in its load's layout (were it marked pure, Triton would gather its bytes one at a
    time after converting V's int8 tile to the dot's layout: strata/kernels/decode_attention.py's _widen_f16)."""
    fn, sig, constexprs = _kernel_cases()["split_k_partial_q8"]
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n.endswith("_ptr") or n in (
        "sk_h", "sv_h", "span")}
    for use_ptx in (True, False):
        c = {**constexprs, "G": g, "HD": hd, "INT8": int8, "PTX": use_ptx, "BLOCK": block}
        try:
            code = triton.compile(ASTSource(fn=fn, signature={**sig, **{k: "constexpr" for k in c}}, constexprs=c,
                                            attrs=attrs), target=SM90, options={"num_stages": stages}).asm["ptx"]
        except FileNotFoundError as e:
            pytest.skip(f"no CUDA toolchain in this Triton: {e}")
        mma = "mma.sync.aligned.m16n8k32.row.col.satfinite.s32.s8.s8.s32"
        # 4 warps side by side over the tile's keys, n-tiles of 8 keys: block / 32 mma a group a warp
        assert ".target sm_90" in code and code.count(mma) == int8 * hd // 32 * block // 32
        assert "cvt.rn.f32.s8" not in code and "cvt.rn.f32.s16" not in code and "cvt.s16.s8" not in code
        asm = ("prmt.b32 ", "sub.f16x2", "mul.rn.f16x2")
        assert all(a in code for a in asm) == use_ptx and any(a in code for a in asm[1:]) == use_ptx
        assert not use_ptx or "ld.shared.b8" not in code


@pytest.mark.parametrize("base", ["split_k_partial", "split_k_partial_q8"])
def test_split_k_rows_load_as_wide_as_one_row(base):
    """The decode batches' split-K launch (ROWS: each row's slot added to the cache pointers at run time) loads keys
    and values in vectors as wide as the one-row launch (a slot stride divisible by 16, as a launch specializes it):
    the same global loads but the row's slot word."""
    import re
    from collections import Counter

    def loads(name):
        fn, sig, c = _kernel_cases()[name]
        c = dict(c, INT8=2) if "q8" in name else dict(c)
        names = list(sig)
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
                 if n.endswith("_ptr") or n in ("sk_h", "sv_h", "span", "sk_slot", "sv_slot")}
        try:
            code = triton.compile(ASTSource(fn=fn, signature={**sig, **{k: "constexpr" for k in c}}, constexprs=c,
                                            attrs=attrs), target=SM90, options={"num_stages": 3}).asm["ptx"]
        except FileNotFoundError as e:
            pytest.skip(f"no CUDA toolchain in this Triton: {e}")
        return Counter(re.findall(r"ld\.global[.\w]*", code))

    one, rows = loads(base), loads(base + "_rows")
    assert rows - one == Counter({"ld.global.b64": 1}) and not one - rows, (one, rows)
