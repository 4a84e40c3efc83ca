"""Experts kept as stored (GGUF blocks, strata.models.resident.ResidentExperts): the same results as the same blocks
dequantized at load, in prefill (a few groups of experts, each one grouped GEMM) and decode (only the chosen
experts' blocks); the planner's bytes are the loaded stage's."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from strata.models.args import PRESETS
from strata.weights.checkpoint import load_stage, model_args, slice_tensors, stage_bytes
from strata.decode.graphs import GraphedDecode
from strata.models.model import Transformer
from strata.models import resident

from test_families import CHUNK, HF_OVERRIDES, chained_prefill, make_hf, rel, three_way

ROOT = Path(__file__).resolve().parents[1]


def _run(m_slices, ids, new: int = 6):
    """Chunked prefill through the slices, the last logits, and `new` greedy tokens."""
    with torch.no_grad():
        h = chained_prefill(m_slices, ids, CHUNK)
        last = m_slices[-1].logits(h[0, -1])
        tok, pos, out = int(last.argmax()), ids.shape[1], []
        for _ in range(new):
            out.append(tok)
            x = torch.tensor([[tok]])
            for s in m_slices:
                x = s(x, pos)
            tok, pos = int(m_slices[-1].logits(x[0, -1]).argmax()), pos + 1
    return last, out


@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K_M"])
def test_resident_experts_equal_dequantized(monkeypatch, qtype):
    """smoke-moe's random blocks held as stored, in groups of 3 of its 8 experts (3 groups a layer), against the
    same blocks dequantized at load: prefill logits and greedy tokens; stage_bytes counts what the stage holds."""
    monkeypatch.setattr(resident, "EXPERT_GROUP_ELEMS", 3 * 3 * 256 * 256)
    args, spec = PRESETS["smoke-moe"], f"synthetic:smoke-moe@{qtype}"
    ids = torch.randint(0, args.vocab_size, (1, 45), generator=torch.Generator().manual_seed(3))
    got = {}
    for mode in ("dequantized", "resident"):
        ms = [load_stage(spec, args, a, b, device="cpu", dtype=torch.float32, weights=mode, max_len=64)
              for a, b in three_way(args.n_layers)]
        for m, (a, b) in zip(ms, three_way(args.n_layers)):
            assert (m.weight_bytes, m.scratch_bytes) == stage_bytes(spec, args, a, b, torch.float32, mode,
                                                                    max_len=64)[:2]
        if mode == "resident":
            blk = ms[1].layers["1"]
            assert blk.mlp.resident is not None and blk.mlp.w13 is None and blk.mlp.resident.per_group == 3
        got[mode] = _run(ms, ids)
    (a, ta), (b, tb) = got["dequantized"], got["resident"]
    assert rel(b, a) < 1e-6 and ta == tb


@pytest.fixture(scope="module")
def converted_q8(tmp_path_factory):
    """qwen3_moe, mixtral and gpt_oss fixtures (expert widths in whole Q8_0 blocks) through llama.cpp's converter
    at Q8_0: the expert stacks quantized."""
    from families_fixtures import SMOLLM2_VOCAB, ConversionError, convert_many, converter_skip_reason
    why = converter_skip_reason()
    if why:
        pytest.skip(why)
    base = tmp_path_factory.mktemp("gguf_q8")
    over = {"qwen3_moe": dict(vocab_size=SMOLLM2_VOCAB, moe_intermediate_size=64),
            "mixtral": dict(HF_OVERRIDES.get("mixtral", {}), intermediate_size=64),
            "gpt_oss": dict(vocab_size=SMOLLM2_VOCAB, rope_parameters={
                "rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "original_max_position_embeddings": 256, "truncate": True})}
    made = {f: make_hf(base, f, **o)[1] for f, o in over.items()}
    files = convert_many([(d, base / f"{f}.gguf") for f, d in made.items()], outtype="q8_0")
    for g in files:
        if isinstance(g, ConversionError):
            raise g
    return {f: str(g) for f, g in zip(made, files)}


@pytest.mark.slow
@pytest.mark.parametrize("fam", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_converted_q8_0_experts_resident(converted_q8, fam):
    """The converter's Q8_0 file on 3 CPU stages, resident against dequantized at load: prefill logits within
    float32 rounding and the same greedy tokens (gpt_oss: its q/k/v/o biases and sinks on a resident layer)."""
    g = converted_q8[fam]
    args = model_args(g)
    ids = torch.randint(0, args.vocab_size, (1, 45), generator=torch.Generator().manual_seed(4))
    got = {}
    for mode in ("dequantized", "resident"):
        ms = []
        for a, b in three_way(args.n_layers):
            t = Transformer(args, a, b)
            t.load_weights(slice_tensors(g, args, a, b, weights=mode), "cpu", torch.float32)
            t.setup_cache(64, max_chunk=CHUNK)
            ms.append(t)
        if mode == "resident":
            assert all(blk.mlp.resident is not None for blk in ms[1].layers.values() if blk.moe)
        got[mode] = _run(ms, ids)
    (a, ta), (b, tb) = got["dequantized"], got["resident"]
    assert rel(b, a) < 1e-5 and ta == tb


FUSED = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
from strata.models.args import PRESETS
from strata.weights.checkpoint import load_stage
from strata.decode.graphs import DecodeGraphs, covers
args = PRESETS["smoke-moe"]
# two layers (with the embedding): the first one's experts weighed in the second's norm launch (the graph body)
load = lambda: load_stage("synthetic:smoke-moe@" + sys.argv[2], args, 0, 2, device="cpu", dtype=torch.float32,
                          weights="resident", max_len=64)
m, eager = load(), load()
moe = m.layers["0"].mlp
assert moe.resident.fused_ok("cpu") and covers(args)
assert moe.resident.w13.split == moe.resident.w2.split == sys.argv[2].startswith("MXFP4")  # re-laid for the kernel
x = torch.randn(1, args.dim, generator=torch.Generator().manual_seed(0))
w, idx = moe.route(x)
a = moe._on_blocks(x, w, idx.reshape(-1), moe.k)
w13, w2 = moe.resident.chosen(idx.reshape(-1))
xs = x.repeat_interleave(moe.k, 0).unsqueeze(-1)
y = torch.bmm(w2, moe.gate(torch.bmm(w13, xs).squeeze(-1)).unsqueeze(-1)).squeeze(-1)
b = (y * w.reshape(-1, 1)).view(1, moe.k, -1).sum(1)
err = ((a - b).norm() / b.norm()).item()
assert err < 2e-2, err  # the fused kernels take x in int8 (dp4a): ~5e-3 of a product
ids = torch.randint(0, args.vocab_size, (1, 18), generator=torch.Generator().manual_seed(1))
with torch.inference_mode():
    eager(ids[:, :16], 0), m(ids[:, :16], 0)
    dg = DecodeGraphs(m)
    for p in (16, 17):
        ref = eager(ids[:, p:p + 1], p)
        dg.ids.copy_(ids[:, p:p + 1].reshape(-1))
        dg.pos.fill_(p)
        h, _, _ = dg._body(dg.bucket(p))
        e = ((h.float() - ref.float()).norm() / ref.float().norm()).item()
        assert e < 1e-5, (p, e)  # the same fused products in both
print("ok", err)
"""


@pytest.mark.slow
def test_fused_expert_products_interpreted():
    """Decode on the chosen experts' Q4_K blocks (strata.quant.gemv, under Triton's interpreter on CPU) against
    their dequantized matrices; and the decode graphs' body for a resident MoE slice == the eager decode step."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", FUSED, str(ROOT), "Q4_K"], env=env, capture_output=True, text=True,
                       timeout=900, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stdout + r.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("qtype", ["Q4_K_M", "Q8_0"])
def test_gpu_resident_experts_graphs(qtype):
    """CUDA: resident experts against the same blocks dequantized at load (bfloat16 prefill logits, within
    bf16's 2e-2), and decode through the CUDA graphs (on the chosen experts' blocks) against eager steps, in
    float32 (in bfloat16 the graphs' fused norms round differently, and a near tie of two experts' router logits
    then picks another expert: a measured 0.45 difference of one step's logits)."""
    args, spec = PRESETS["smoke-moe"], f"synthetic:smoke-moe@{qtype}"
    ids = torch.randint(0, args.vocab_size, (1, 300), generator=torch.Generator().manual_seed(5)).cuda()
    ms = {}
    for name, mode, graphs, dt in (("dense", "dequantized", False, torch.bfloat16),
                                   ("prefill", "resident", False, torch.bfloat16),
                                   ("eager", "resident", False, torch.float32),
                                   ("graphs", "resident", True, torch.float32)):
        m = load_stage(spec, args, 0, args.n_layers, device="cuda", dtype=dt, weights=mode, max_len=512)
        ms[name] = GraphedDecode(m) if graphs else m
    with torch.inference_mode():
        h = {k: m(ids[:, :256], 0) for k, m in ms.items()}
        la, lb = ms["dense"].logits(h["dense"][0, -1]), ms["prefill"].logits(h["prefill"][0, -1])
        assert rel(lb.float(), la.float()) < 2e-2
        assert ms["graphs"].graphable(ids[:, :1])
        for p in range(256, 300):
            a = ms["eager"].decode_token(ids[:, p:p + 1], p)[1]
            b = ms["graphs"].decode_token(ids[:, p:p + 1], p)[1]
            # the same fused products; the norms and RoPE by other kernels. The kernels round x to int8 first
            # (dp4a, ~5e-3 of a product, strata/quant/gemv.py; Q8_0's too since kernels.gemv_q8_0), so a last-bit
            # change of x can move a rounding: measured 5.3e-3 at one step
            assert rel(b, a) < 2e-2, p
    assert ms["graphs"].graphs is not None and ms["graphs"].graphs.graphs


EXPERTS_KERNEL = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
from strata.quant import dequantize, gemv, random_blocks
dev = sys.argv[2]
for q, rows, cols, tol in (("Q4_K", 48, 512, 2e-2), ("Q6_K", 32, 512, 2e-2), ("Q6_K", 6, 768, 2e-2),
                          ("MXFP4", 40, 256, 1e-6)):  # Q6_K 768: 3 blocks a row (one a step, parity per row)
    E = 5
    st = random_blocks(q, E * rows, cols, torch.Generator().manual_seed(1), "cpu").view(E, rows, -1).contiguous()
    W = dequantize(st.view(E * rows, -1), q).view(E, rows, cols).double()
    ids = torch.tensor([3, 0, 4, 3])
    for xr in (1, 4):  # one row for every slot (gate/up), or a row a slot (down)
        x = torch.randn(xr, cols, generator=torch.Generator().manual_seed(xr))
        got = gemv.quant_matmul_experts(x.to(dev), st.to(dev), ids.to(dev), q, cols).cpu().double()
        if gemv.experts_int8(q):  # x's rounding made by the caller (a norm's launch): the same products
            xq = gemv.quantize_x(x.to(dev))
            assert torch.equal(gemv.quant_matmul_experts(x.to(dev), st.to(dev), ids.to(dev), q, cols, xq=xq).cpu().double(), got)
        want = torch.stack([W[e] @ x[min(j, xr - 1)].double() for j, e in enumerate(ids.tolist())])
        err = ((got - want).norm() / want.norm()).item()
        assert err < tol, (q, xr, err)  # K-quants: x in int8 (dp4a), ~5e-3; MXFP4: float x, float32 sums
print("ok")
"""


@pytest.mark.slow
def test_experts_kernel_interpreted():
    """strata.quant.gemv's experts kernels (the chosen experts of a stack, ids read on the device) under
    Triton's interpreter: Q4_K, Q6_K (an even and an odd block count a row) and MXFP4 against the dequantized
    matrices."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", EXPERTS_KERNEL, str(ROOT), "cpu"], env=env, capture_output=True,
                       text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stdout + r.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_experts_kernel():
    """The experts kernels on CUDA against the dequantized matrices (as the interpreted test)."""
    r = subprocess.run([sys.executable, "-c", EXPERTS_KERNEL, str(ROOT), "cuda"], capture_output=True, text=True,
                       timeout=600, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stdout + r.stderr[-3000:]


ROUTER = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
from strata.kernels import fused as kernels
dev = sys.argv[2]
g = torch.Generator().manual_seed(0)
for n, k, chosen, renorm in ((128, 8, False, True), (128, 8, False, False), (32, 4, True, False), (60, 3, False, True)):
    logits = torch.randn(3, n, generator=g).to(torch.bfloat16)
    w, ids = (t.cpu() for t in kernels.route(logits.to(dev), k, chosen, renorm))
    if chosen:
        top, ri = logits.topk(k, -1)
        rw = top.softmax(-1).float()
    else:
        rw, ri = logits.softmax(-1, dtype=torch.float32).topk(k, -1)
        if renorm:
            rw = rw / rw.sum(-1, keepdim=True)
    assert torch.equal(ids, ri), (n, k, ids, ri)
    assert torch.allclose(w, rw, rtol=8e-3 if chosen else 1e-6, atol=1e-7), (n, k, (w - rw).abs().max())
print("ok")
for n, k, cols, dt in ((1, 8, 2048, torch.bfloat16), (3, 4, 2880, torch.float32)):
    y = torch.randn(n * k, cols, generator=g).to(dt)
    w = torch.rand(n, k, generator=g)
    got = kernels.weigh(y.to(dev), w.to(dev)).cpu()
    want = torch.bmm(w.view(n, 1, k), y.float().view(n, k, -1)).view(n, -1)
    assert got.dtype == dt and torch.allclose(got.float(), want, rtol=8e-3 if dt == torch.bfloat16 else 1e-6, atol=1e-5), (n, k)
# kernels.router: the logits in the route's launch (several programs, the last one routes), launched twice on one
# counter. float32: the same experts and weights as route over torch's logits. bfloat16 (whose logits round
# differently: the interpreter truncates, and the sums' order differs): every chosen expert within rounding of the
# k-th best float logit, and the weights of route over the kernel's own rounding of the chosen logits
for n, k, dim, chosen, renorm, bias in ((128, 8, 2048, False, True, False), (32, 4, 2880, True, False, True),
                                        (60, 3, 96, False, True, False), (512, 10, 256, False, False, False)):
    for dt in (torch.float32, torch.bfloat16):
        W = torch.randn(n, dim, generator=g).to(dt)
        h = torch.randn(dim, generator=g).to(dt)
        b = torch.randn(n, generator=g).to(dt) if bias else None
        count = torch.zeros(1, dtype=torch.int32, device=dev)
        for _ in range(2):
            w, ids = kernels.router(h.to(dev), W.to(dev), None if b is None else b.to(dev), count, k, chosen, renorm)
            assert int(count.cpu()) == 0, count
        w, ids = w.cpu(), ids.cpu()
        exact = W.double() @ h.double() + (b.double() if bias else 0)
        if dt == torch.float32:
            rw, ri = (t.cpu() for t in kernels.route(exact.float()[None].to(dev), k, chosen, renorm))
            assert torch.equal(ids, ri), (n, k, ids, ri)
            assert torch.allclose(w, rw, rtol=1e-5, atol=1e-7), (n, k, (w - rw).abs().max())
        else:
            kth = exact.topk(k).values[-1]
            assert ids.unique().numel() == k and (exact[ids[0]] >= kth - 2e-2 * exact.abs().max()).all(), (n, k)
            assert torch.allclose(w.sum(), torch.tensor(1.0), atol=1e-3) or not (renorm or chosen), w
print("ok")
"""


@pytest.mark.slow
def test_router_kernel_interpreted():
    """strata.kernels.fused.route (a decode step's softmax router in one launch) under Triton's interpreter against the
    torch path's ops: the same experts, the same weights (Qwen3-MoE's renormalized top 8 of 128, Mixtral-like
    without renormalization, gpt-oss's softmax over its chosen 4, which rounds like the torch path's bf16); and
    strata.kernels.fused.weigh (the experts' weighted sum) against the float32 bmm it replaces."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", ROUTER, str(ROOT), "cpu"], env=env, capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stdout + r.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_router_kernel():
    """The router kernels on CUDA (as the interpreted test; the one-launch router's counter across programs that
    really run at once)."""
    r = subprocess.run([sys.executable, "-c", ROUTER, str(ROOT), "cuda"], capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.count("ok") == 2, r.stdout + r.stderr[-3000:]


def _make_gguf():
    import importlib.util
    path = ROOT / "bench" / "make_gguf.py"
    spec = importlib.util.spec_from_file_location("make_gguf", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["make_gguf"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
@pytest.mark.parametrize("preset,qtype", [("smoke-moe", "Q4_K_M"), ("gpt-oss-20b", "MXFP4_MOE")])
def test_make_gguf_experts_read_back(tmp_path, preset, qtype):
    """bench/make_gguf.py's qwen3moe and gpt-oss files (gpt-oss at small widths, 2 layers) read by Strata: the
    preset's args back from the metadata, and the file resident on CPU (Q4_K/Q6_K or MXFP4 expert stacks, Q8_0
    attention with gpt-oss's biases and sinks) against it dequantized at load."""
    import dataclasses
    mg = _make_gguf()
    args = PRESETS[preset]
    if preset == "gpt-oss-20b":
        args = dataclasses.replace(args, vocab_size=512, dim=256, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=256,
                                   expert_ffn_dim=256, n_experts=4, n_experts_used=2, sliding_window=16)
    args = mg.with_layers(args, 2)
    out = tmp_path / "m.gguf"
    mg.write(out, args, qtype, seed=3)
    got = model_args(str(out))
    for k in ("arch", "dim", "n_layers", "n_experts", "n_experts_used", "expert_ffn_dim", "router", "expert_bias",
              "attn_sinks", "o_bias", "sliding_window", "window_layers", "qk_norm"):
        assert getattr(got, k) == getattr(args, k), k
    ids = torch.randint(0, args.vocab_size, (1, 45), generator=torch.Generator().manual_seed(4))
    res = {}
    for mode in ("dequantized", "resident"):
        ms = [load_stage(str(out), got, a, b, device="cpu", dtype=torch.float32, weights=mode, max_len=64,
                         max_chunk=CHUNK) for a, b in ((0, 1), (1, 2))]
        if mode == "resident":
            assert ms[1].layers["1"].mlp.resident is not None
        res[mode] = _run(ms, ids)
    (a, ta), (b, tb) = res["dequantized"], res["resident"]
    assert rel(b, a) < 1e-5 and ta == tb
