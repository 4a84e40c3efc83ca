"""The prefill path's fused pieces against float64 formulas: the LSE merge (torch, and the Triton kernels under
Triton's interpreter: merge, the gated activation, RoPE), RoPE's torch form, RMSNorm; the cuDNN warm-up's calls vs
a forward's."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import strata.kernels.attention as sm
from strata.weights.checkpoint import synthetic_tensors
from strata.models.args import ModelArgs
from strata.models.model import RMSNorm, Transformer

ROOT = Path(__file__).resolve().parents[1]
SMALL = ModelArgs(vocab_size=300, dim=128, n_layers=2, n_heads=8, n_kv_heads=2, head_dim=16, ffn_dim=192,
                  max_seq_len=4096)


def merge64(out_p, lse_p, out_s, lse_s):
    lse = torch.logaddexp(lse_p.double(), lse_s.double())
    return (out_p.double() * torch.exp(lse_p.double() - lse)[..., None]
            + out_s.double() * torch.exp(lse_s.double() - lse)[..., None])


def parts(T, nh=3, hd=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    out_p = torch.randn(1, T, nh, hd, generator=g).to(dtype).transpose(1, 2)  # cuDNN's (1, T, nh, hd) layout
    out_s = torch.randn(1, nh, T, hd, generator=g).to(dtype)
    lse_p = torch.randn(1, nh, T, generator=g) * 5
    lse_s = torch.randn(1, nh, T, generator=g) * 5
    lse_p[..., 0], lse_s[..., 0] = 80.0, -80.0  # one row all prefix: no overflow, no NaN
    return out_p, lse_p, out_s, lse_s


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2 ** -8)])
def test_merge_lse_torch_formula(dtype, tol):
    p = parts(37, dtype=dtype)
    got = sm.merge_lse(*p)
    assert got.dtype == dtype
    want = merge64(*p)
    assert ((got.double() - want).abs() <= tol * want.abs() + 1e-6).all()


_KERNEL_SCRIPT = r"""
import torch
import torch.nn.functional as F
import strata.kernels.attention as sm
from strata.kernels import fused as K
from strata.triton_state import TritonState
from tests.test_prefill_ops import merge64, parts
st = TritonState()  # the holder every call passes: a kernel that failed would have turned it off
# float32 and float16 round to nearest in the interpreter; its bfloat16 cast truncates (a GPU rounds to nearest)
TOL = {torch.float32: 2e-6, torch.float16: 2 ** -11, torch.bfloat16: 2 ** -7}
checked = 0
for T, hd in ((37, 16), (1, 16), (70, 24)):
    for dtype, tol in TOL.items():
        out_p, lse_p, out_s, lse_s = parts(T, hd=hd, dtype=dtype, seed=T)
        lse_s = lse_s.transpose(1, 2).contiguous().transpose(1, 2)  # strided log-sum-exp too
        got = K.lse_merge(out_p, lse_p, out_s, lse_s, st)
        assert got is not None and st.kernels, "kernel did not run"
        assert got.shape == out_p.shape and got.dtype == dtype
        assert got.transpose(1, 2).is_contiguous(), got.stride()  # rows for the o-projection, no copy
        want = merge64(out_p, lse_p, out_s, lse_s)
        err = (got.double() - want).abs()
        assert torch.isfinite(got).all()
        assert (err <= tol * want.abs() + 1e-6).all(), (T, hd, dtype, float(err.max()))
        checked += 1
for T, cols, act in ((7, 50, "silu"), (3, 1500, "silu"), (5, 1100, "gelu_tanh")):
    for dtype, tol in TOL.items():
        gu = (torch.randn(1, T, 2 * cols, generator=torch.Generator().manual_seed(cols)) * 4).to(dtype)
        gate, up = gu.split(cols, dim=-1)  # strided halves, as the fused gate/up GEMM gives them
        got = K.gated(gate, up, act, st)
        assert got is not None and st.kernels and got.shape == gate.shape and got.dtype == dtype
        g64, u64 = gate.double(), up.double()
        want = (g64 * torch.sigmoid(g64) if act == "silu" else F.gelu(g64, approximate="tanh")) * u64
        err = (got.double() - want).abs()
        assert (err <= tol * want.abs() + 1e-6).all(), (T, cols, act, dtype, float(err.max()))
        checked += 1
for T, H, D in ((13, 3, 16), (1, 2, 32)):
    for dtype, tol in TOL.items():
        g = torch.Generator().manual_seed(T)
        x = torch.randn(1, T, H + 2, D, generator=g).to(dtype)[:, :, :H]  # strided rows
        ang = torch.randn(T, D // 2, generator=g, dtype=torch.float64)
        cos64, sin64 = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
        cos, ssin = cos64.to(dtype)[:, None], sm._signed_sin(sin64.to(dtype)[:, None])
        got = K.rope(x, cos, ssin, st)
        assert got is not None and st.kernels and got.is_contiguous() and got.dtype == dtype
        x1, x2 = x.double().chunk(2, dim=-1)  # the textbook form with the tables as rounded
        want = x.double() * cos.double() + torch.cat((-x2, x1), -1) * sin64.to(dtype).double()[:, None]
        err = (got.double() - want).abs()
        assert (err <= tol * want.abs() + 1e-5).all(), (T, H, D, dtype, float(err.max()))
        checked += 1
x = torch.randn(1, 4, 2, 24)  # head_dim not a power of two: declined, apply_rope's torch ops run instead
assert K.rope(x, torch.ones(4, 1, 24), torch.ones(4, 1, 24), st) is None and st.kernels
print("checked", checked)
"""


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernels_interpreted():
    """The Triton kernels on CPU tensors under TRITON_INTERPRET=1 (set before triton is imported: a fresh
    process) against float64 formulas: the LSE merge at odd T and a head_dim that is not a power of two,
    SwiGLU / GeGLU on strided halves, rows longer and shorter than a program's block, RoPE on strided rows."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", _KERNEL_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "checked 24" in r.stdout


def test_apply_rope_is_rotate_half():
    g = torch.Generator().manual_seed(1)
    T, heads, hd = 9, 3, 16
    x = torch.randn(1, T, heads + 2, hd, generator=g)[:, :, :heads]  # strided rows, as a q view of the qkv GEMM
    ang = torch.randn(T, hd // 2, generator=g, dtype=torch.float64)
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
    x1, x2 = x.double().chunk(2, dim=-1)
    want = x.double() * cos[:, None] + torch.cat((-x2, x1), -1) * sin[:, None]
    got = sm.apply_rope(x, cos.float()[:, None], sm._signed_sin(sin.float()[:, None]))
    assert got.is_contiguous() and got.shape == x.shape
    assert (got.double() - want).abs().max() < 1e-5


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2 ** -7)])
def test_rms_norm_within_rounding_of_transformers_formula(dtype, tol):
    g = torch.Generator().manual_seed(2)
    norm = RMSNorm(96, 1e-5)
    norm.weight = torch.nn.Parameter((1 + torch.randn(96, generator=g) * 0.3).to(dtype))
    x = (torch.randn(5, 96, generator=g) * 4).to(dtype)
    xf = x.float()  # transformers' LlamaRMSNorm: normalized rows rounded to x's dtype, then the weight
    ref = norm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    got = norm(x)
    assert got.dtype == dtype
    assert ((got.float() - ref.float()).abs() <= tol * ref.float().abs() + 1e-6).all()


def build(max_len, kv_dtype):
    with torch.device("meta"):
        m = Transformer(SMALL)
    m.load_weights(synthetic_tensors(SMALL, 0, SMALL.n_layers, "cpu", torch.float32, seed=3), "cpu", torch.float32)
    m.setup_cache(max_len, kv_dtype)
    return m.eval()


@pytest.mark.parametrize("kv_dtype", ["auto", "bfloat16"])
def test_warm_up_calls_match_the_forward(monkeypatch, kv_dtype):
    """warm_chunk_attention makes the very attention calls (shapes and strides: cuDNN's graph key) that the
    chunks at those positions make, prefix and own chunk, reads the cache and writes nothing; without CUDA it
    does nothing."""
    n, m = 32, build(200, kv_dtype)
    calls, real = [], sm._cpu_with_lse

    def record(q, k, v, causal, scale=None):
        calls.append((tuple(q.shape), q.stride(), tuple(k.shape), k.stride(), v.stride(), causal, scale))
        return real(q, k, v, causal, scale)

    monkeypatch.setattr(sm, "_cpu_with_lse", record)
    ids = torch.randint(0, SMALL.vocab_size, (1, 4 * n), generator=torch.Generator().manual_seed(4))
    for pos in range(0, 4 * n, n):
        m(ids[:, pos:pos + n], pos)
    forward = set(calls)
    # prefixes n, 2n, 3n and the own chunk's causal n x n (per position where a widened cache's strides move)
    assert len(forward) == (4 if kv_dtype == "auto" else 6)
    calls.clear()
    before = [(b.attn.k_cache.clone(), b.attn.v_cache.clone()) for b in m.layers.values()]
    assert sm.warm_chunk_attention(m, [(n, n), (2 * n, n), (3 * n, n), (190, n)]) == 0  # CPU: nothing
    assert sm.warm_chunk_attention(m, [(n, n), (2 * n, n), (3 * n, n), (190, n)], attend=record) == 3
    assert set(calls) == forward and len(calls) == len(forward)  # each shape once; (190, n) runs past the cache
    for (k, v), b in zip(before, m.layers.values()):
        assert torch.equal(k, b.attn.k_cache) and torch.equal(v, b.attn.v_cache)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
def test_cuda_kernels_match_float64():
    from strata.kernels import fused as kernels
    from strata.triton_state import TritonState
    if kernels.triton is None:
        pytest.skip("triton is not installed")
    st = TritonState()
    for T in (1, 1001):
        p = [t.cuda() for t in parts(T, nh=32, hd=128, dtype=torch.bfloat16, seed=T)]
        got = kernels.lse_merge(*p, st)
        assert got is not None and st.kernels
        want = merge64(*p)
        assert ((got.double() - want).abs() <= 2 ** -8 * want.abs() + 1e-6).all()  # rounded to nearest on a GPU
    gate, up = (torch.randn(1, 1001, 2 * 14336, device="cuda") * 4).bfloat16().split(14336, dim=-1)
    for act in ("silu", "gelu_tanh"):
        got = kernels.gated(gate, up, act, st)
        assert got is not None and st.kernels
        g64 = gate.double()
        want = (g64 * torch.sigmoid(g64) if act == "silu" else F.gelu(g64, approximate="tanh")) * up.double()
        assert ((got.double() - want).abs() <= 2 ** -8 * want.abs() + 1e-6).all(), act
    x = torch.randn(1, 1001, 48, 128, device="cuda").bfloat16()[:, :, :32]  # q rows of a q/k/v GEMM's output
    ang = torch.randn(1001, 64, device="cuda", dtype=torch.float64)
    cos, sin = torch.cat((ang, ang), -1).cos().bfloat16(), torch.cat((ang, ang), -1).sin().bfloat16()
    got = kernels.rope(x, cos[:, None], sm._signed_sin(sin[:, None]), st)
    assert got is not None and st.kernels
    x1, x2 = x.double().chunk(2, dim=-1)
    want = x.double() * cos.double()[:, None] + torch.cat((-x2, x1), -1) * sin.double()[:, None]
    assert ((got.double() - want).abs() <= 2 ** -8 * want.abs() + 1e-4).all()


@pytest.mark.gpu
@cuda
def test_cuda_kernel_paths_agree_and_warm_up_builds():
    """cudnn-split on smoke-wide bf16: the Triton kernels (merge, RoPE, the gated activation) and the torch formulas give the
    same chunks up to bf16 rounding; warm_chunk_attention builds the later chunks' shapes."""
    from strata.weights.checkpoint import model_args, slice_tensors
    from strata.config import KernelSpec
    name = "synthetic:smoke-wide"
    args = model_args(name)
    ids = torch.randint(0, args.vocab_size, (1, 2048), generator=torch.Generator().manual_seed(6)).cuda()
    out = {}
    for kernels in ("torch", "triton"):  # kernels.prefill's two arms
        with torch.device("meta"):
            m = Transformer(args, kernels=KernelSpec(prefill=kernels), attention="cudnn-split")
        m.load_weights(slice_tensors(name, args, 0, args.n_layers, device="cuda:0", dtype=torch.bfloat16),
                       "cuda:0", torch.bfloat16)
        m.setup_cache(ids.shape[1])
        if kernels == "triton":
            assert sm.warm_chunk_attention(m, [(p, 512) for p in range(512, 2048, 512)]) == 3
        out[kernels] = torch.cat([m(ids[:, p:p + 512], p) for p in range(0, 2048, 512)], dim=1).float()
    rel = ((out["triton"] - out["torch"]).norm() / out["torch"].norm()).item()
    assert rel < 1e-2, rel


def test_keep_cudnn_shapes_reaches_every_attention_layer():
    m = build(200, "auto")
    assert all(b.attn.cudnn_shapes is None for b in m.layers.values())
    sm.keep_cudnn_shapes(m, [(32, 32), (64, 32)])
    assert all(b.attn.cudnn_shapes == {(32, 32), (64, 32)} for b in m.layers.values())


@pytest.mark.gpu
@cuda
def test_a_chunk_outside_the_kept_shapes_takes_flash(monkeypatch):
    """cudnn-split with kept shapes: a kept (pos, T) goes through cuDNN, any other (a question after a restored
    prefix) through flash, which builds no graph; both are the same attention up to bf16 rounding."""
    g = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(1, 8, 24, 64, device="cuda", generator=g).bfloat16()
    k, v = (torch.randn(1, 2, 1000 + 24, 64, device="cuda", generator=g).bfloat16() for _ in range(2))
    calls, real = [], sm._cudnn_with_lse

    def counted(*a, **kw):
        calls.append(a[0].shape)
        return real(*a, **kw)
    monkeypatch.setattr(sm, "_cudnn_with_lse", counted)
    kept = sm.chunk_attention(q, k, v, 1000, cuda_path="cudnn-split", cudnn_shapes=frozenset({(1000, 24)}))
    assert len(calls) == 2  # the prefix, then the chunk's own keys
    other = sm.chunk_attention(q, k, v, 1000, cuda_path="cudnn-split", cudnn_shapes=frozenset({(1000, 32)}))
    assert len(calls) == 2
    rel = ((kept.float() - other.float()).norm() / other.float().norm()).item()
    assert rel < 2e-2, rel
    # against float32 arithmetic with the lower-right causal mask
    qf, kf, vf = q.float(), k.float().repeat_interleave(4, 1), v.float().repeat_interleave(4, 1)
    s = (qf @ kf.transpose(-1, -2)) * 64 ** -0.5
    s = s.masked_fill(torch.arange(1024, device="cuda")[None] > 1000 + torch.arange(24, device="cuda")[:, None],
                      float("-inf"))
    want = torch.softmax(s, -1) @ vf
    for got in (kept, other):
        rel = ((got.float() - want).norm() / want.norm()).item()
        assert rel < 1e-2, rel


class _Launch:
    """Stands in for a jitted Triton kernel (`kernel[grid](*args)`): counts its launches, fails them where told."""

    def __init__(self, fail: bool):
        self.fail, self.launches = fail, 0

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.launches += 1
            if self.fail:
                raise RuntimeError("this Triton cannot build it")
        return launch


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_a_failed_kernel_falls_back_on_its_holder_only(monkeypatch, caplog):
    """strata.kernels.fused' fallback is state on the caller's TritonState: the holder whose kernel failed says so once and
    takes the torch formulas from then on (no more launches); another holder, and a call without one, still launch."""
    from strata.kernels import fused as K
    from strata.triton_state import TritonState
    gate, up = torch.randn(1, 3, 8), torch.randn(1, 3, 8)
    x, cs = torch.randn(1, 3, 2, 16), torch.ones(3, 1, 16)
    failing = _Launch(fail=True)
    monkeypatch.setattr(K, "_gated_kernel", failing)
    a, b = TritonState(), TritonState()
    with caplog.at_level("WARNING", logger="strata.kernels.fused"):
        assert K.gated(gate, up, "silu", a) is None and failing.launches == 1
        assert K.gated(gate, up, "silu", a) is None and K.rope(x, cs, cs, a) is None  # not tried again, any kernel
    assert failing.launches == 1 and not a.kernels
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == ["gated activation Triton kernel failed"]
    assert b.kernels  # the other holder's kernels still run: its launch fails now too, on b alone
    assert K.gated(gate, up, "silu", b) is None and failing.launches == 2 and not b.kernels
    working = _Launch(fail=False)
    monkeypatch.setattr(K, "_gated_kernel", working)
    c = TritonState()
    assert K.gated(gate, up, "silu", c) is not None and working.launches == 1 and c.kernels
    assert K.gated(gate, up, "silu", a) is None and working.launches == 1  # a stays on the torch formulas
    assert K.gated(gate, up) is not None and working.launches == 2  # no holder: tried on every call


def test_a_model_and_its_layers_share_one_triton_state():
    """A slice's layers hold its TritonState (where strata.kernels.fused' fallback lands), another slice its own: a kernel
    failing in one model leaves the other on its kernels. set_kernels keeps a fallback already taken."""
    from strata.config import KernelSpec
    from strata.models.model import Attention, FeedForward
    with torch.device("meta"):
        m, other = Transformer(SMALL), Transformer(SMALL, 1)
    held = [b.attn.triton_state for b in m.layers.values() if isinstance(b.attn, Attention)]
    held += [b.mlp.triton_state for b in m.layers.values() if isinstance(b.mlp, FeedForward)]
    assert len(held) == 2 * SMALL.n_layers and all(s is m.triton_state for s in held)
    assert other.triton_state is not m.triton_state
    assert all(b.attn.triton_state is other.triton_state for b in other.layers.values())
    m.triton_state.kernels = False  # what a failed launch leaves
    m.set_kernels(KernelSpec())
    assert not m.triton_state.kernels and other.triton_state.kernels


@pytest.mark.gpu
@cuda
def test_cuda_kernel_failure_in_one_model_leaves_another_on_its_kernels(monkeypatch):
    """Two slices in one process on CUDA: the first's gated-activation kernel fails in its forward, and it computes on with
    the torch formula (the same chunk as the kernel up to rounding); the second still launches the kernel."""
    from strata.kernels import fused as K
    from strata.weights.checkpoint import model_args, slice_tensors
    if K.triton is None:
        pytest.skip("triton is not installed")
    name = "synthetic:smoke"
    args = model_args(name)
    ids = torch.randint(0, args.vocab_size, (1, 64), generator=torch.Generator().manual_seed(7)).cuda()
    models = []
    for _ in range(2):
        with torch.device("meta"):
            m = Transformer(args)
        m.load_weights(slice_tensors(name, args, 0, args.n_layers, device="cuda:0", dtype=torch.bfloat16),
                       "cuda:0", torch.bfloat16)
        m.setup_cache(ids.shape[1])
        models.append(m)
    real, launches = K._gated_kernel, []

    class Failing:
        def __getitem__(self, grid):
            def launch(*a, **kw):
                launches.append(grid)
                raise RuntimeError("this Triton cannot build it")
            return launch

    monkeypatch.setattr(K, "_gated_kernel", Failing())
    broken = models[0](ids, 0).float()
    assert len(launches) == 1 and not models[0].triton_state.kernels  # tried once for all its layers
    monkeypatch.setattr(K, "_gated_kernel", real)
    counted = []

    class Counted:
        def __getitem__(self, grid):
            counted.append(grid)
            return real[grid]

    monkeypatch.setattr(K, "_gated_kernel", Counted())
    fine = models[1](ids, 0).float()
    assert len(counted) == args.n_layers and models[1].triton_state.kernels
    rel = ((broken - fine).norm() / fine.norm()).item()
    assert rel < 1e-2, rel


def _flex_importable() -> bool:
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


flex = pytest.mark.skipif(not _flex_importable(), reason="torch.nn.attention.flex_attention is not importable")

# (heads, kv heads, window, chunk, prompt): windows shorter and longer than the chunk, GQA and plain multi-head; the
# prompt's last chunk is shorter
WINDOW_CASES = [(4, 2, 8, 13, 45), (4, 4, 24, 13, 45), (8, 1, 40, 16, 70)]


def _window_chunks(nh, nkv, window, chunk, prompt, hd=16, dtype=torch.float32, device="cpu", seed=0):
    """A window layer's prefill as Attention.forward makes it: each chunk's keys and values stored into a ring of
    window + chunk - 1 rows (wrapping), then its queries (in the (1, T, nh, hd) layout) -> (pos, q, k ring, v ring)."""
    g = torch.Generator().manual_seed(seed)
    rows = window + chunk - 1
    kc = torch.zeros(1, nkv, rows, hd, dtype=dtype, device=device)
    vc = torch.zeros_like(kc)
    for pos in range(0, prompt, chunk):
        T = min(chunk, prompt - pos)
        k, v = (torch.randn(1, nkv, T, hd, generator=g).to(device, dtype) for _ in range(2))
        sm.store_rows(kc, k, pos)
        sm.store_rows(vc, v, pos)
        q = torch.randn(1, T, nh, hd, generator=g).to(device, dtype).transpose(1, 2)
        yield pos, q, kc, vc


@pytest.mark.slow
@flex
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("nh,nkv,window,chunk,prompt", WINDOW_CASES)
@pytest.mark.parametrize("sinks", [False, True])
def test_flex_window_attention_equals_the_band(nh, nkv, window, chunk, prompt, sinks):
    """kernels.window_attention's flex arm (FlexAttention eager: torch compiles it for CPU without the log-sum-exp
    only) gives the band's rows within float32 rounding at every chunk of a prompt: the first (pos 0, keys before
    position 0 masked), chunks whose keys wrap round the ring, the shorter last one (queries padded to the bucket),
    with and without gpt-oss's sinks."""
    s = torch.randn(nh, generator=torch.Generator().manual_seed(1)) if sinks else None
    wrapped = False
    with torch.inference_mode():
        for pos, q, kc, vc in _window_chunks(nh, nkv, window, chunk, prompt):
            wrapped |= (max(0, pos + 1 - window) % kc.shape[2]) + q.shape[2] + min(pos, window - 1) > kc.shape[2]
            band = sm.window_attention(q, kc, vc, pos, window, 0.3, s)
            got = sm.flex_window_attention(q, kc, vc, pos, window, 0.3, s, compiled=False)
            assert got.shape == band.shape and got.dtype == band.dtype
            assert (got - band).abs().max().item() <= 1e-5, pos
            # on CPU the flex arm is refused for the band itself: the same bits
            assert torch.equal(sm.window_attention(q, kc, vc, pos, window, 0.3, s, kernel="flex"), band)
    assert wrapped


def test_window_rows_gathers_the_ring_in_position_order():
    """The keys flex reads: positions [pos + 1 - window, pos + 1 - window + n) from the ring (row p % rows), in one
    slice or two where the ring wraps, zeros before position 0 and past the chunk; widened from an 8-bit cache."""
    rows, hd = 7, 4
    ring = torch.full((1, 2, rows, hd), -1.0)
    for p in range(12):  # positions 0..11 stored as their own value; row p % 7 holds the latest
        ring[:, :, p % rows] = p
    got = sm._window_rows(ring, torch.float32, 9, 3, 4, 9)  # keys of 6..14: 6..11 cached, 12..14 padding
    assert got.is_contiguous() and got.shape == (1, 2, 9, hd)
    assert got[0, 1, :, 0].tolist() == [6, 7, 8, 9, 10, 11, 0, 0, 0]
    first = torch.full((1, 2, rows, hd), -1.0)
    first[:, :, :3] = torch.arange(3.0)[:, None]  # the first chunk, positions 0..2, stored
    got = sm._window_rows(first, torch.float32, 1, 2, 4, 5)  # keys of -2..2: 0..2 cached
    assert got[0, 0, :, 0].tolist() == [0, 0, 0, 1, 2]
    ring8 = ring.to(torch.float8_e4m3fn)
    assert torch.equal(sm._window_rows(ring8, torch.float32, 9, 3, 4, 9)[0, 1, :, 0],
                       torch.tensor([6, 7, 8, 9, 10, 11, 0, 0, 0.0]))


def test_flex_is_refused_where_it_cannot_run():
    """flex_unavailable says why the flex arm takes the band (the stage log's line); the padded query buckets."""
    assert "CUDA only" in sm.flex_unavailable("cpu", torch.bfloat16)
    assert "not float32" in sm.flex_unavailable("cuda:0", torch.float32)
    rows = [sm.flex_rows(T) for T in (1, 128, 129, 257, 448, 2048, 2049, 3000, 3073)]
    assert rows == [128, 128, 256, 384, 512, 2048, 3072, 3072, 4096]


def test_warm_window_attention_compiles_each_bucket_once(monkeypatch):
    """A CUDA stage's warm-up calls one window layer's flex attention once per query bucket of the schedule's chunk
    lengths (the longest chunk of each, which the ring holds), past the window; nothing where flex is not taken."""
    from types import SimpleNamespace
    calls = []
    attn = SimpleNamespace(window=16, k_cache=torch.zeros(1, 2, 16 + 512 - 1, 8), v_cache=torch.zeros(1, 2, 527, 8),
                           nh=4, hd=8, scale=None, sinks=None, window_kernel="flex", triton_state=None)
    model = SimpleNamespace(device_dtype=lambda: (torch.device("cpu"), torch.bfloat16),
                            layers={"0": SimpleNamespace(attn=SimpleNamespace(window=None, k_cache=None)),
                                    "1": SimpleNamespace(attn=attn)})
    assert sm.warm_window_attention(model, [512, 300]) == []  # CPU: the band, nothing to compile
    monkeypatch.setattr(sm, "flex_unavailable", lambda device, dtype, state: None)
    monkeypatch.setattr(sm, "window_attention", lambda q, kc, vc, pos, window, scale, sinks, kernel, triton_state:
                        calls.append((q.shape[2], pos, kernel)))
    assert sm.warm_window_attention(model, [512, 512, 300, 100, 129, 257, 0]) == [128, 256, 384, 512]
    assert calls == [(100, 16, "flex"), (129, 16, "flex"), (300, 16, "flex"), (512, 16, "flex")]
    attn.window_kernel = "band"
    assert sm.warm_window_attention(model, [512]) == []


def test_warm_shapes_include_the_kept_state_cut():
    """The warm-up builds the chunks a prefill may meet, in the plan's chunks: for a model with kept states (window
    or linear layers) the schedule cut at the last block boundary before the last token, as KvRounds.keep_states
    cuts it (gpt-oss's 122,880-token prompt ends in a chunk of 256 rows, a FlexAttention bucket of its own), and
    uncut (where the prefix cache keeps no states); the first chunk too (a window layer's flex runs at 0); a model
    without such layers keeps its schedule uncut."""
    from types import SimpleNamespace
    from strata.models.args import PRESETS
    from strata.kvcache.prefix_cache import BLOCK
    from workers.load import warm_shapes
    spec = SimpleNamespace(tokens=122880, max_len=131072, dynamic_chunks=False, max_chunk=10240)
    oss = warm_shapes(spec, PRESETS["gpt-oss-20b"])
    assert {(0, 10240), (112640, 9984), (122880 - BLOCK, BLOCK), (112640, 10240), (131072 - BLOCK, BLOCK)} <= set(oss)
    assert len(oss) == len(set(oss))
    short = warm_shapes(SimpleNamespace(tokens=3000, max_len=8192, dynamic_chunks=False, max_chunk=4096),
                        PRESETS["gpt-oss-20b"])
    assert (0, 3000) in short and (0, 2816) in short and (2816, 184) in short  # a first chunk cut: bucket 3,072
    dense = warm_shapes(spec, PRESETS["llama-3-8b"])
    assert (122880 - BLOCK, BLOCK) not in dense
    assert dense[:12] == [(p, 10240) for p in range(0, 122880, 10240)]


def test_flex_failure_is_the_holders(monkeypatch):
    """A FlexAttention call that fails sends that holder's window layers to the band (its TritonState remembers why,
    flex_unavailable says so) and leaves another holder, or a call without one, trying flex again."""
    from strata.triton_state import TritonState
    tried = []

    def failing(*a, **k):
        tried.append(1)
        raise RuntimeError("no compiler here\nmore")
    monkeypatch.setattr(sm, "flex_window_attention", failing)
    monkeypatch.setattr(sm, "_FLEX_DTYPES", (torch.float32,))
    q, kc, vc = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))  # the flex arm's device check
    a, b = TritonState(), TritonState()
    band = sm.window_attention(q, kc, vc, 20, 8, None, None, kernel="band")
    assert torch.equal(sm.window_attention(q, kc, vc, 20, 8, None, None, kernel="flex", triton_state=a), band)
    assert a.flex_failed == "FlexAttention failed (RuntimeError: no compiler here)" and len(tried) == 1
    sm.window_attention(q, kc, vc, 20, 8, None, None, kernel="flex", triton_state=a)
    assert len(tried) == 1 and sm.flex_failure(a) == a.flex_failed  # not tried again for a
    sm.window_attention(q, kc, vc, 20, 8, None, None, kernel="flex", triton_state=b)
    sm.window_attention(q, kc, vc, 20, 8, None, None, kernel="flex")
    assert len(tried) == 3 and b.flex_failed is not None and sm.flex_failure(None) is None
    monkeypatch.undo()
    assert sm.flex_unavailable("cuda:0", torch.bfloat16, a) == a.flex_failed


@pytest.mark.gpu
@cuda
@flex
def test_cuda_flex_window_attention_matches_the_band():
    """On CUDA in bfloat16 the compiled flex arm gives the band's rows within bf16 rounding (2e-2 relative) at every
    chunk of gpt-oss- and gemma-like window layers (sinks, GQA, ring wraps, a shorter last chunk), without falling
    back; then both arms timed on one full chunk."""
    import time
    from strata.triton_state import TritonState
    st = TritonState()  # where a failed flex call would be remembered
    for nh, nkv, hd, window, chunk, prompt, sinks in ((64, 8, 64, 128, 1024, 3000, True),
                                                      (32, 16, 128, 1024, 512, 2600, False)):
        s = torch.randn(nh, device="cuda") if sinks else None
        with torch.inference_mode():
            for pos, q, kc, vc in _window_chunks(nh, nkv, window, chunk, prompt, hd, torch.bfloat16, "cuda"):
                band = sm.window_attention(q, kc, vc, pos, window, None, s).float()
                got = sm.window_attention(q, kc, vc, pos, window, None, s, kernel="flex", triton_state=st).float()
                assert st.flex_failed is None, st.flex_failed
                rel = ((got - band).norm() / band.norm()).item()
                assert rel < 2e-2, (window, pos, rel)
            q = q.new_zeros(1, chunk, nh, hd).normal_().transpose(1, 2)
            pos = 2 * chunk + window
            times = {}
            for kernel in ("band", "flex", "band", "flex"):
                sm.window_attention(q, kc, vc, pos, window, None, s, kernel=kernel)
                torch.cuda.synchronize()
                t = time.perf_counter()
                for _ in range(20):
                    sm.window_attention(q, kc, vc, pos, window, None, s, kernel=kernel)
                torch.cuda.synchronize()
                times[kernel] = (time.perf_counter() - t) / 20 * 1e3
            print(f"window {window}, chunk {chunk}, {nh}/{nkv} heads x {hd}: band {times['band']:.3f} ms, "
                  f"flex {times['flex']:.3f} ms a layer")
