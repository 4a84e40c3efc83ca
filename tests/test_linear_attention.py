"""The gated delta rule's forms against its token-by-token reference (strata.models.linear_attention): the chunked form at
odd lengths around its 64-token blocks, from a nonzero state, value heads sharing q/k heads; prefill split at odd
boundaries equals one pass; on CUDA, fla-core's kernel against the chunked torch form."""
import pytest
import torch

from strata.models.linear_attention import gated_delta_rule

LENGTHS = (1, 5, 63, 64, 65, 130, 200)


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def inputs(T: int, nk: int, rep: int, dk: int = 16, dv: int = 24, seed: int = 0, device="cpu"):
    """q, k, v, g, beta as GatedDeltaNet.forward hands them over, and a nonzero initial state (nv, dk, dv)."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    nv = nk * rep
    q, k, v = r(T, nk, dk), r(T, nk, dk), r(T, nv, dv)
    g = -torch.rand(T, nv, generator=gen) * 2           # log decays in (-2, 0]: down to e^-128 over a block
    beta = torch.rand(T, nv, generator=gen)
    S0 = r(nv, dk, dv) * 0.5
    return [t.to(device) for t in (q, k, v, g, beta, S0)]


@pytest.mark.parametrize("T", LENGTHS)
@pytest.mark.parametrize("nk,rep", [(1, 1), (2, 2), (3, 2)])
def test_chunked_equals_tokens(T, nk, rep):
    q, k, v, g, beta, S0 = inputs(T, nk, rep, seed=T)
    S_ref, S = S0.clone(), S0.clone()
    want = gated_delta_rule(S_ref, q, k, v, g, beta, impl="tokens")
    got = gated_delta_rule(S, q, k, v, g, beta, impl="chunked")
    assert got.shape == want.shape == (T, nk * rep, 24) and got.dtype == torch.float32
    assert rel(got, want) < 1e-5
    assert rel(S, S_ref) < 1e-5


@pytest.mark.parametrize("T", (64, 128, 65))
def test_chunked_takes_strided_views(T):
    """q, k, v as the layer hands them over: column slices of the convolution's output (channels, T) transposed
    (at whole blocks nothing is padded, and a view of v failed once)."""
    q, k, v, g, beta, S0 = inputs(T, 2, 2)
    qkv = torch.cat([x.reshape(T, -1) for x in (q, k, v)], 1).t().contiguous().t()  # (T, channels), column-major
    views = qkv[:, :32].reshape(T, 2, 16), qkv[:, 32:64].reshape(T, 2, 16), qkv[:, 64:].reshape(T, 4, 24)
    assert not views[2].is_contiguous()
    S_ref, S = S0.clone(), S0.clone()
    want = gated_delta_rule(S_ref, q, k, v, g, beta, impl="tokens")
    assert rel(gated_delta_rule(S, *views, g, beta, impl="chunked"), want) < 1e-5 and rel(S, S_ref) < 1e-5


def test_step_is_one_token():
    """The default for one token is the step; it equals the reference's first token."""
    q, k, v, g, beta, S0 = inputs(1, 2, 2)
    S_ref, S = S0.clone(), S0.clone()
    want = gated_delta_rule(S_ref, q, k, v, g, beta, impl="tokens")
    assert torch.equal(gated_delta_rule(S, q, k, v, g, beta), want) and torch.equal(S, S_ref)


def test_chunked_split_at_odd_boundaries_equals_one_pass():
    """The state carries across calls: 200 tokens as 1 + 62 + 65 + 3 + 69 equal one pass (and the reference)."""
    q, k, v, g, beta, S0 = inputs(200, 2, 2, seed=3)
    S_one, S_ref, S = S0.clone(), S0.clone(), S0.clone()
    one = gated_delta_rule(S_one, q, k, v, g, beta, impl="chunked")
    ref = gated_delta_rule(S_ref, q, k, v, g, beta, impl="tokens")
    parts, pos = [], 0
    for n in (1, 62, 65, 3, 69):
        sl = slice(pos, pos + n)
        parts.append(gated_delta_rule(S, q[sl], k[sl], v[sl], g[sl], beta[sl]))  # the default forms
        pos += n
    got = torch.cat(parts)
    assert rel(got, one) < 1e-5 and rel(S, S_one) < 1e-5
    assert rel(got, ref) < 1e-5 and rel(S, S_ref) < 1e-5


def test_strong_decay_and_zero_state():
    """Log decays far below a float32 exp's range inside one block (e^{G} underflows to 0) stay finite."""
    q, k, v, g, beta, _ = inputs(130, 2, 2, seed=4)
    g = g * 40
    S_ref, S = torch.zeros(4, 16, 24), torch.zeros(4, 16, 24)
    want = gated_delta_rule(S_ref, q, k, v, g, beta, impl="tokens")
    got = gated_delta_rule(S, q, k, v, g, beta, impl="chunked")
    assert torch.isfinite(got).all() and rel(got, want) < 1e-5 and rel(S, S_ref) < 1e-5


def test_unknown_form_refused():
    q, k, v, g, beta, S0 = inputs(5, 1, 1)
    with pytest.raises(ValueError, match="unknown delta rule form"):
        gated_delta_rule(S0, q, k, v, g, beta, impl="loop")


# -- CUDA: fla-core's kernel -------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", (1, 5, 64, 65, 1000))
# float32: fla's dots run in TF32 (10-bit mantissas): 1.47e-3 measured on the H200 at T = 64, 65 and 1,000, hence
# 3e-3 (float32 models take the torch chunked form, not fla, for that reason)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 3e-3), (torch.bfloat16, 2e-2)])
def test_gpu_fla_matches_chunked(T, dtype, tol):
    """fla's chunk_gated_delta_rule (q, k, v in `dtype`; TF32 dots for float32) against the torch chunked form on
    the same inputs in float32, from a nonzero state: outputs and the final state written back in place."""
    pytest.importorskip("fla.ops.gated_delta_rule")
    q, k, v, g, beta, S0 = inputs(T, 4, 2, dk=128, dv=128, seed=T, device="cuda")
    q16, k16, v16 = q.to(dtype), k.to(dtype), v.to(dtype)
    S_ref, S = S0.clone(), S0.clone()
    want = gated_delta_rule(S_ref, q16.float(), k16.float(), v16.float(), g, beta, impl="chunked")
    got = gated_delta_rule(S, q16, k16, v16, g, beta, impl="fla")
    assert got.dtype == torch.float32 and S.dtype == torch.float32 and S.data_ptr() != S_ref.data_ptr()
    assert rel(got, want) < tol
    assert rel(S, S_ref) < tol


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_default_form_is_fla_for_16_bit():
    """With fla importable, a bfloat16 prefill takes it; float32 stays on the torch form (TF32 would not do)."""
    pytest.importorskip("fla.ops.gated_delta_rule")
    from strata.models.linear_attention import _fla_serves
    q = torch.zeros(3, 1, 8, device="cuda")
    assert _fla_serves(q.bfloat16()) and not _fla_serves(q) and not _fla_serves(q.cpu().bfloat16())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_step_captured_in_a_graph():
    """The one-token step runs inside a CUDA graph: replays on static tensors equal eager steps."""
    q, k, v, g, beta, S0 = inputs(4, 2, 2, device="cuda")
    S_eager, S = S0.clone(), S0.clone()
    static = [t[:1].clone() for t in (q, k, v, g, beta)]
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up off the default stream, as capture wants
        gated_delta_rule(S.clone(), *static)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gated_delta_rule(S, *static)
    S.copy_(S0)
    for t in range(4):
        for dst, src in zip(static, (q, k, v, g, beta)):
            dst.copy_(src[t:t + 1])
        graph.replay()
        want = gated_delta_rule(S_eager, q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1])
        assert rel(out, want) < 1e-6
    assert rel(S, S_eager) < 1e-6


# -- a tiny random Qwen3.5 through Strata's slices ----------------------------------------------------------------
PROMPT, ODD = 300, 97  # chunks of 97, 97, 97, 9: each crosses the delta rule's 64-token blocks at another offset


def qwen3_5_model(tmp_path) -> str:
    """The families test's tiny qwen3_5 (3 linear layers, 1 full), saved: its directory."""
    pytest.importorskip("transformers")
    from families_fixtures import make_hf
    return make_hf(tmp_path, "qwen3_5")[1]


def qwen3_5_slices(d: str, device: str, dtype=torch.float32):
    """The model as 3 slices, and a prompt on `device`."""
    from strata.weights.checkpoint import model_args, slice_tensors
    from strata.models.model import Transformer
    args = model_args(d)
    slices = []
    for a, b in [(0, 1), (1, args.n_layers - 1), (args.n_layers - 1, args.n_layers)]:
        t = Transformer(args, a, b)
        t.load_weights(slice_tensors(d, args, a, b), device, dtype)
        t.setup_cache(PROMPT, max_chunk=PROMPT)
        slices.append(t)
    ids = torch.randint(0, args.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(9))
    return slices, ids.to(device)


def prefill_logits(slices, ids, chunk: int):
    from conftest import chained_prefill
    return slices[-1].logits(chained_prefill(slices, ids, chunk)[0]).float().cpu()


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [ODD, 64])
def test_model_chunked_prefill_equals_token_loop(tmp_path, monkeypatch, chunk):
    """On CPU, prefill in odd chunks by the chunked form gives the token loop's one-pass logits; and in chunks of
    whole 64-token blocks, where nothing is padded (the strided v of the convolution's output reaches the blocks
    as it is: a view of it failed once)."""
    import strata.models.linear_attention as la
    slices, ids = qwen3_5_slices(qwen3_5_model(tmp_path), "cpu")
    got = prefill_logits(slices, ids, chunk)
    loop = la.gated_delta_rule
    monkeypatch.setattr(la, "gated_delta_rule", lambda *a: loop(*a, impl="tokens"))
    want = prefill_logits(slices, ids, PROMPT)
    assert rel(got, want) < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_model_prefill_against_cpu(tmp_path, monkeypatch):
    """On CUDA, prefill in odd chunks: float32 (the torch chunked form) within 1e-5 of the CPU path; bfloat16
    (fla's kernel) within 2e-2, and within bf16's reach of the same bfloat16 model on the torch form."""
    import strata.models.linear_attention as la
    d = qwen3_5_model(tmp_path)
    cpu, ids = qwen3_5_slices(d, "cpu")
    want = prefill_logits(cpu, ids, PROMPT)
    f32, x = qwen3_5_slices(d, "cuda")
    assert rel(prefill_logits(f32, x, ODD), want) < 1e-5
    bf, x = qwen3_5_slices(d, "cuda", torch.bfloat16)
    fla = prefill_logits(bf, x, ODD)
    assert rel(fla, want) < 2e-2
    if la._fla_kernel() is not None:
        monkeypatch.setattr(la, "_fla_serves", lambda q: False)
        assert rel(fla, prefill_logits(bf, x, ODD)) < 2e-2
