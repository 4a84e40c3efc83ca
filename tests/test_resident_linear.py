"""Qwen3.5's linear-attention layers held resident (GGUF blocks as stored, strata.models.resident.ResidentMatrices): the same
prefill bits and greedy tokens as the dequantized slice on CPU, the bytes the planner counts, the file's tiled value
heads in ssm_out's columns undone where read; on CUDA, the decode graphs on the blocks against the eager path."""
import os

import pytest
import torch

from conftest import chained_prefill
from strata.models import resident
from strata.weights.checkpoint import load_stage, model_args, stage_bytes, storage, weights_mode
from strata.models.model import Packed, ResidentMatrices

BOUNDS = ((0, 2), (2, 4))  # a slice of linear layers, a slice with the full-attention layer and the head
PROMPT, CHUNK, NEW = 45, 13, 6


@pytest.fixture(scope="module")
def q35_gguf(tmp_path_factory):
    """bench/make_gguf.py's qwen35 at small widths, Q4_K_M: 2 k heads, 4 value heads (tiled in the file)."""
    from test_make_gguf_qwen35 import _make_gguf, small
    out = tmp_path_factory.mktemp("q35") / "q35.gguf"
    _make_gguf().write(out, small(), "Q4_K_M", seed=3)
    return str(out)


def slices(path: str, mode: str, device="cpu", dtype=torch.float32):
    args = model_args(path)
    return [load_stage(path, args, a, b, device=device, dtype=dtype, max_len=PROMPT + NEW, max_chunk=CHUNK,
                       weights=mode) for a, b in BOUNDS]


def greedy(ms, h, pos: int, n: int, steps=None) -> list[int]:
    steps = steps or ms
    tok, out = int(ms[-1].logits(h[0, -1]).argmax()), []
    for p in range(pos, pos + n):
        out.append(tok)
        x = torch.tensor([[tok]], device=h.device)
        for s in steps:
            x = s(x, p)
        tok = int(ms[-1].logits(x[0, -1]).argmax())
    return out


@pytest.mark.slow
def test_resident_equals_dequantized_on_cpu(q35_gguf):
    """Prefill in odd chunks: the resident slices' residual is the dequantized slices' bit for bit, and so are the
    greedy tokens after it (decode dequantizes into the scratch on CPU); the linear layers hold their five matrices
    as blocks (ssm_out with its column order), far fewer bytes."""
    args = model_args(q35_gguf)
    ids = torch.randint(0, args.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(4))
    got = {}
    for mode in ("resident", "dequantized"):
        ms = slices(q35_gguf, mode)
        with torch.no_grad():
            h = chained_prefill(ms, ids, CHUNK)
            got[mode] = (ms, h, greedy(ms, h, PROMPT, NEW))
    (res, hr, gr), (deq, hd, gd) = got["resident"], got["dequantized"]
    assert torch.equal(hr, hd) and gr == gd
    for s in res:
        for blk in s.layers.values():
            assert isinstance(blk.weights, ResidentMatrices)
            if blk.linear:
                parts = blk.weights.parts
                assert blk.attn.wqkv is None and all(isinstance(parts[n], Packed) and parts[n].qtype
                                                     for n in ("lin_qkv", "lin_z", "lin_b", "lin_a", "lin_out"))
                assert parts["lin_out"].col_perm is not None  # 2 value heads per k head: tiled in the file
            else:
                assert "wg" in blk.weights.parts
    assert sum(s.weight_bytes for s in res) < 0.25 * sum(s.weight_bytes for s in deq)


def test_column_order_is_needed(q35_gguf, monkeypatch):
    """Without ssm_out's column order undone, the resident prefill differs (the check above can fail)."""
    args = model_args(q35_gguf)
    ids = torch.randint(0, args.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = chained_prefill(slices(q35_gguf, "dequantized"), ids, CHUNK)
        ms = slices(q35_gguf, "resident")
        for s in ms:
            for blk in s.layers.values():
                if blk.linear:
                    p = blk.weights.parts["lin_out"]
                    p.col_perm = torch.arange(p.cols)
        got = chained_prefill(ms, ids, CHUNK)
    assert not torch.allclose(got, want, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("mode", ["resident", "dequantized"])
def test_stage_bytes_agree_with_loaded(q35_gguf, mode):
    """stage_bytes (headers only) == what each loaded slice holds: weights as stored (q_proj's query and gate halves
    counted once between them), the scratch (largest group: here a linear layer's out projection beside its stored
    order fits under the MLP's), KV of the full-attention layer only; storage's per-layer bytes sum to the same."""
    args = model_args(q35_gguf)
    ms = slices(q35_gguf, mode)
    for (a, b), m in zip(BOUNDS, ms):
        want = stage_bytes(q35_gguf, args, a, b, torch.float32, mode, "auto", PROMPT + NEW, "cpu", CHUNK)
        assert (m.weight_bytes, m.scratch_bytes, m.kv_bytes) == want, (a, b)
    st = storage(q35_gguf, args, torch.float32, mode, device_type="cpu")
    layers = sum(m.weight_bytes for m in ms) - st.embed - st.norm - st.head
    assert sum(st.per_layer) == layers and st.mode == mode


def test_auto_is_resident_on_cuda(q35_gguf):
    """weights: auto holds a quantized hybrid file resident on CUDA (no longer forced dequantized)."""
    assert weights_mode(q35_gguf, "cuda") == "resident"
    assert weights_mode(q35_gguf, "cpu") == "dequantized"
    assert weights_mode(q35_gguf, "cpu", "resident") == "resident"


def test_scratch_layout_groups():
    """The scratch holds a linear layer's groups one at a time (each from 0), and q/k/v with the output gate as
    one adjacent span (one qkv product)."""
    from test_make_gguf_qwen35 import small
    args = small()
    lay, total = resident.scratch_layout(args)
    for n in ("lin_qkv", "lin_z", "lin_b", "lin_out"):
        assert lay[n][0] == 0
    assert lay["lin_a"][0] >= lay["lin_b"][1] * lay["lin_b"][2] and lay["lin_out_t"][0] > 0
    assert lay["wg"][0] >= lay["wv"][0] + lay["wv"][1] * lay["wv"][2]
    assert total == max(o + r * c for o, r, c in lay.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_resident_graphs_match_eager_and_dequantized(q35_gguf):
    """bfloat16 on CUDA: the resident slices' prefill against the dequantized slices' (the scratch dequantized by
    strata.quant.into: rows within 2e-2), then teacher-forced decode steps replayed from the graphs (linear and
    attention products on the blocks, strata.quant.gemv) against the eager decode path on the same slices' twins:
    logits within 2e-2, and the graphs made."""
    from strata.decode.graphs import GraphedDecode, graphable
    args = model_args(q35_gguf)
    ids = torch.randint(0, args.vocab_size, (1, PROMPT + NEW), generator=torch.Generator().manual_seed(5)).cuda()
    deq = slices(q35_gguf, "dequantized", "cuda", torch.bfloat16)
    eager = slices(q35_gguf, "resident", "cuda", torch.bfloat16)
    graphed = [GraphedDecode(m) for m in slices(q35_gguf, "resident", "cuda", torch.bfloat16)]
    x1 = torch.zeros(1, 1, dtype=torch.long, device="cuda")
    assert graphable(graphed[0].m, x1)
    hs = [chained_prefill(ms, ids[:, :PROMPT], CHUNK) for ms in (deq, eager, graphed)]
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    assert rel(hs[1], hs[0]) < 2e-2 and rel(hs[2], hs[1]) < 1e-3
    for p in range(PROMPT, PROMPT + NEW):
        out = []
        for ms in (eager, graphed):
            x = ids[:, p:p + 1]
            for s in ms:
                x, logits, _ = s.decode_token(x, p)
            out.append(logits)
        assert rel(out[1], out[0]) < 2e-2, (p, rel(out[1], out[0]))
    assert all(g.graphs is not None and g.graphs.graphs for g in graphed)


GRAPH_BODY = r"""
import sys, torch
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[1] + "/tests")
from conftest import chained_prefill
from strata.decode.graphs import DecodeGraphs, graphable
from test_resident_linear import CHUNK, PROMPT, slices
path = sys.argv[2]
eager, body = slices(path, "resident")[1], slices(path, "resident")[1]  # layers 2, 3: linear, then full attention
assert graphable(body, torch.zeros(1, 1, body.args.dim)) is False  # (CPU: the graphs are CUDA's; the body is not)
dg = DecodeGraphs(body)
assert dg.use_split_k and dg.fused and body.layers["2"].weights.fused_decode_ok("cpu")
x = torch.randn(1, PROMPT + 2, body.args.dim, generator=torch.Generator().manual_seed(2))
rel = lambda a, b: ((a - b).norm() / b.norm()).item()
import os
with torch.inference_mode():
    os.environ["TRITON_INTERPRET"] = "0"  # the prefill's scratch by torch's dequantization (interpreted: minutes)
    chained_prefill([eager], x[:, :PROMPT], CHUNK), chained_prefill([body], x[:, :PROMPT], CHUNK)
    os.environ["TRITON_INTERPRET"] = "1"  # (the kernels were built interpreted at import: the steps run them so)
    for p in range(PROMPT, PROMPT + 2):
        a = eager(x[:, p:p + 1], p)
        dg.res.copy_(x[:, p:p + 1])
        dg.pos.fill_(p)
        h, logits, am = dg._body(dg.bucket(p))
        assert rel(h, a) < 1e-4, (p, rel(h, a))
        want = eager.logits(a[0, -1])
        assert rel(logits, want) < 1e-4 and int(am) == int(want.argmax()), (p, rel(logits, want))
print("ok")
"""


@pytest.mark.slow
def test_graph_body_on_blocks_interpreted_matches_eager(q35_gguf):
    """The decode graphs' step body on a resident slice (a linear layer's five products and the gated attention's
    on the blocks, strata.quant.gemv; x's int8 rounding from the norm's launch), run on CPU under Triton's
    interpreter == the eager decode path on the same blocks, over 2 steps of the states."""
    pytest.importorskip("triton")
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", GRAPH_BODY, str(root), q35_gguf], env=env, capture_output=True,
                       text=True, timeout=900, cwd=root)
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stdout + r.stderr[-3000:]
