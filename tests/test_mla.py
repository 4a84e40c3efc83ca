"""Multi-head latent attention (strata.models.mla) against a plain reading of its definition: both forms (expanded and
absorbed), chunked, in prefix blocks, on 8-bit caches; and a DeepSeek V3 model through stage processes."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from strata.models import mla
from strata.models.args import ModelArgs
from strata.models.layer import PrefillOps, RowsOps
from strata.models.model import RMSNorm, Transformer

ARGS = ModelArgs(arch="deepseek_v3", vocab_size=64, dim=48, n_layers=1, n_heads=4, n_kv_heads=4, head_dim=24,
                 ffn_dim=64, kv_lora_rank=24, q_lora_rank=16, qk_rope_dim=8, v_head_dim=12, attn_scale=0.3,
                 max_seq_len=256)


def reference(a: mla.LatentAttention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The definition over the whole sequence x (L, dim): per-head keys and values from the latent, causal softmax
    in float64. cos, sin: (L, rope) rotate-half tables (the rows are in halves order: no interleave here)."""
    x = x.double()
    L, nh, nope, rope = x.shape[0], a.nh, a.nope, a.rope
    norm = lambda t, w: t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + mla.LATENT_NORM_EPS) * w.double()
    q = F.linear(norm(F.linear(x, a.wq_a.w.double()), a.q_a_norm.weight), a.wq_b.w.double()).view(L, nh, -1)
    ckv = F.linear(x, a.wkv_a.w.double())
    c, kr = norm(ckv[:, :a.rank], a.kv_a_norm.weight), ckv[:, a.rank:]

    def rot(t):  # rotate-half RoPE on the last dim
        h = t.shape[-1] // 2
        cs, sn = cos.double().view(L, *([1] * (t.dim() - 2)), -1), sin.double().view(L, *([1] * (t.dim() - 2)), -1)
        return t * cs + torch.cat((-t[..., h:], t[..., :h]), -1) * sn

    q = torch.cat((q[..., :nope], rot(q[..., nope:])), -1)
    kv = F.linear(c, a.wkv_b.double()).view(L, nh, nope + a.vd)
    k = torch.cat((kv[..., :nope], rot(kr)[:, None].expand(L, nh, rope)), -1)
    s = torch.einsum("qhd,khd->hqk", q, k) * a.scale
    s = s.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
    y = torch.einsum("hqk,khd->qhd", s.softmax(-1), kv[..., nope:]).reshape(L, -1)
    return F.linear(y, a.wo.w.double())


def make(kv_dtype="auto", prefix_block=None):
    torch.manual_seed(0)
    t = Transformer(ARGS, 0, 1)
    a = t.layers["0"].attn
    g = torch.Generator().manual_seed(1)
    for name, shape in (("wq_a", (16, 48)), ("wq_b", (4 * 24, 16)), ("wkv_a", (32, 48)), ("wkv_b", (4 * 28, 24)),
                        ("wo", (48, 48))):
        w = torch.nn.Parameter(torch.randn(shape, generator=g) * 0.3, requires_grad=False)
        setattr(a, name, w if name == "wkv_b" else mla.LatentMatrix(w))
    a.q_a_norm.weight.data = 1 + 0.1 * torch.randn(16, generator=g)
    a.kv_a_norm.weight.data = 1 + 0.1 * torch.randn(24, generator=g)
    t._device_dtype = (torch.device("cpu"), torch.float32)
    t.setup_cache(64, kv_dtype)
    if prefix_block is not None:
        a.prefix_block = prefix_block
    return t, a


def run(t, a, x, pos, chunks, decode: bool = False) -> torch.Tensor:
    """latent_attention over x's rows from `pos` in `chunks`, each through prefill's ops (or the decode rows')."""
    out = []
    for n in chunks:
        tabs = t._tables(pos, n, x.dtype, decode, x.device)
        ops = RowsOps(tabs, x.device, pos=pos) if decode else PrefillOps(pos, tabs)
        rows = x[pos:pos + n] if decode else x[None, pos:pos + n]
        out.append(mla.latent_attention(a, rows, ops).reshape(n, -1))
        pos += n
    return torch.cat(out)


@pytest.mark.parametrize("form", ["expanded", "absorbed", "by cost"])
def test_both_forms_are_the_definition(monkeypatch, form):
    """Chunks 7 + 1 + 13 + 3 (decode rows, then a prefill chunk, then decode rows) over a prefix expanded in blocks
    of 5: every row within float32 rounding of the definition, whichever form the cost picks or is forced."""
    if form != "by cost":
        monkeypatch.setattr(mla, "form", lambda *_: form)
    t, a = make(prefix_block=5)
    x = torch.randn(24, 48, generator=torch.Generator().manual_seed(2))
    cos, sin = t.rope(0, 24, torch.float32)
    want = reference(a, x, cos, sin).float()
    got = torch.cat([run(t, a, x, 0, [7]), run(t, a, x, 7, [1], True), run(t, a, x, 8, [13]),
                     run(t, a, x, 21, [3], True)])
    assert (got - want).abs().max() < 1e-5 * want.abs().max() * 10


def test_the_cost_picks_expanded_for_chunks_and_absorbed_for_decode():
    """DeepSeek V3's shapes: a 2,048-row chunk over a long prefix expands; one decode row absorbs."""
    v3 = ModelArgs(arch="deepseek_v3", dim=7168, n_layers=1, n_heads=128, n_kv_heads=128, head_dim=192,
                   kv_lora_rank=512, q_lora_rank=1536, qk_rope_dim=64, v_head_dim=128)
    a = mla.LatentAttention(v3, 0, RMSNorm)
    assert mla.form(a, 2048, 65536) == "expanded"
    assert mla.form(a, 1, 65536) == "absorbed"
    assert v3.kv_values() == 576


@pytest.mark.parametrize("kv", ["q8_0", "float8_e4m3fn"])
def test_cache_holds_the_latent_and_8bit_forms_are_close(kv):
    """The cache is [normed latent | roped key], 32 values a position (V empty); an 8-bit cache stays within its
    rounding of the full-precision one."""
    t, a = make()
    assert a.k_cache.shape[-1] == 32 and a.v_cache.shape[-1] == 0
    assert t.kv_bytes == 64 * 32 * 4
    x = torch.randn(20, 48, generator=torch.Generator().manual_seed(3))
    want = run(t, a, x, 0, [9, 11])
    t8, a8 = make(kv)
    got = run(t8, a8, x, 0, [9, 11])
    assert (got - want).abs().max() < (2e-2 if kv == "q8_0" else 8e-2) * want.abs().max()


def test_interleaved_rows_become_halves():
    """deinterleave_rows moves only each head's last rope rows, pairs (x0, x1), (x2, x3) -> halves (x0, x2 | x1, x3)."""
    w = torch.arange(12.0)[:, None]
    got = mla.deinterleave_rows(w, 2, 6, 4)[:, 0].tolist()
    assert got == [0, 1, 2, 4, 3, 5, 6, 7, 8, 10, 9, 11]


@pytest.mark.slow
def test_deepseek_through_stage_processes(tmp_path):
    """A tiny DeepSeek V3 (MLA, grouped sigmoid routing, a shared expert, the first layer dense) on 3 CPU stage
    processes split mid-model with an odd chunk: depth 0 and 1 give the same residual bits, the last logits and
    the perplexity are transformers', and greedy decode too."""
    from families_fixtures import make_hf
    from test_families import NEW, rel, reference_greedy, split_rig
    from strata.head.pipeline import Pipeline
    from strata.text.sampling import SamplingParams
    ref, d = make_hf(tmp_path, "deepseek_v3")
    ids = np.random.default_rng(4).integers(0, ref.config.vocab_size, size=90).astype(np.int32)
    with torch.no_grad():
        logits = ref(torch.from_numpy(ids).long()[None]).logits[0]
    ppl = float(torch.nn.functional.cross_entropy(logits[:-1], torch.from_numpy(ids[1:]).long()).exp())
    greedy = reference_greedy(ref, torch.from_numpy(ids).long()[None], NEW)
    md5 = {}
    for depth in (0, 1):
        with Pipeline(split_rig(d, depth, 128), out=tmp_path / f"d{depth}", console=False) as p:
            r = p.prefill(ids)
            md5[depth] = r.report["residual_md5"]
            assert rel(torch.from_numpy(r.last_logits), logits[-1]) < 1e-4
            assert abs(r.perplexity - ppl) / ppl < 1e-4
            if depth == 1:
                g = p.generate(ids, SamplingParams(max_tokens=NEW, temperature=0.0))
                assert g.continuation_ids == greedy
    assert md5[0] == md5[1]


@pytest.mark.slow
@pytest.mark.parametrize("fam", ["deepseek_v3", "deepseek_v32"])
def test_deepseek_prefix_cache_kv_file_and_a_batch(tmp_path, fam):
    """The latent cache through the KV machinery, 2 CPU stages (V3.2: the indexer's keys beside the latent, a top-k
    of 24 the prompts pass): a document asked again after another prompt restores its rows from the prefix cache and
    answers as cold; a KV file saved by one pipeline serves a new one; at max_seqs 2 two prompts decoding side by
    side each give their own greedy tokens, as alone."""
    import threading
    from families_fixtures import make_hf
    from strata.head.pipeline import Pipeline
    from strata.serve.engine import PipelineEngine
    from strata.text.sampling import SamplingParams
    _, d = make_hf(tmp_path, fam)
    rng = np.random.default_rng(4)
    doc, other = rng.integers(0, 200, 300), rng.integers(0, 200, 250)
    a, a2 = (np.concatenate([doc, rng.integers(0, 200, n)]) for n in (40, 20))
    rig = dict(model=d, stages=[{"device": "cpu", "threads": 1}] * 2, chunk=64, max_context=512, progress=False,
               prompt={"random": {"tokens": 8, "seed": 0}})
    six, many = SamplingParams(max_tokens=6, temperature=0.0), SamplingParams(max_tokens=40, temperature=0.0)

    def close(x, y):
        return float(np.abs(x - y).max() / np.abs(y).max()) < 1e-4

    with Pipeline({**rig, "prefix_cache_bytes": 0}, out=tmp_path / "cold", console=False) as p:
        cold = p.generate(a2, many)
        cold_o = p.generate(other, many)
    with Pipeline(rig, out=tmp_path / "p", console=False) as p:
        p.generate(a, six)
        p.generate(other, six)
        again = p.generate(a2, six)
        assert again.reused_tokens >= 256 and again.continuation_ids == cold.continuation_ids[:6]
        assert close(again.last_logits, cold.last_logits)
        p.kv_save(tmp_path / "a2.kv")
    with Pipeline(rig, out=tmp_path / "q", console=False) as q:
        q.kv_load(tmp_path / "a2.kv")
        loaded = q.generate(a2, six)
        assert loaded.reused_tokens == a2.size - 1 and loaded.continuation_ids == cold.continuation_ids[:6]
    eng = PipelineEngine({**rig, "max_seqs": 2, "prefix_cache_bytes": 0}, out=tmp_path / "eng")
    try:
        made = {0: [], 1: []}
        go = [threading.Thread(target=eng.generate, args=(ids.tolist(), many, made[i].append))
              for i, ids in enumerate((a2, other))]
        for t in go:
            t.start()
        for t in go:
            t.join()
        st = eng.slot_stats()
    finally:
        eng.close()
    assert made[0] == cold.continuation_ids and made[1] == cold_o.continuation_ids
    assert st.sequences == 2 and st.most_in_flight == 2, st


@pytest.mark.slow
@pytest.mark.parametrize("fam", ["deepseek_v3", "deepseek_v32"])
def test_a_decode_batch_over_two_slots_is_each_alone(tmp_path, fam):
    """decode_seqs: two sequences' rows at their own positions over their own slots' latents (and index keys)
    give each row within float32 rounding of its step alone."""
    from families_fixtures import make_hf
    from strata.weights.checkpoint import model_args, slice_tensors
    _, d = make_hf(tmp_path, fam)
    args = model_args(d)
    t = Transformer(args)
    t.load_weights(slice_tensors(d, args, 0, args.n_layers), "cpu", torch.float32)
    t.setup_cache(128, seqs=2)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 200, (1, n), generator=g) for n in (40, 23)]
    for s, ids in enumerate(prompts):
        t.use_slot(s)
        t(ids, 0)
    nxt = torch.tensor([7, 9])
    _, batch, _ = t.decode_seqs(nxt, [0, 1], [40, 23])
    alone = []
    t.setup_cache(128, seqs=2)
    for s, ids in enumerate(prompts):
        t.use_slot(s)
        t(ids, 0)
        alone.append(t.logits(t(nxt[s].view(1, 1), ids.shape[1])[0, -1]))
    for s in (0, 1):
        assert (batch[s] - alone[s]).abs().max() < 1e-4 * alone[s].abs().max()


@pytest.mark.slow
@pytest.mark.parametrize("fam", ["deepseek_v32", "glm_moe_dsa"])
def test_the_selection_matters_and_chunks_equal_one_pass(tmp_path, fam):
    """The fixtures' indexer keeps 24 of up to 71 positions: dropping the selection (a top-k past the prompt) moves
    the logits by far more than rounding, so a dense fallback would fail tests/test_families' comparison; and a
    prompt prefilled in chunks of 1, 7 and 64 over 3 slices gives one pass's logits within float32 rounding."""
    from dataclasses import replace
    from conftest import chained_prefill
    from families_fixtures import make_hf
    from strata.weights.checkpoint import model_args, slice_tensors
    _, d = make_hf(tmp_path, fam)
    args = model_args(d)
    ids = torch.randint(0, 200, (1, 71), generator=torch.Generator().manual_seed(7))

    def logits(a, bounds, chunk):
        sl = []
        for s, e in bounds:
            t = Transformer(a, s, e)
            t.load_weights(slice_tensors(d, args, s, e), "cpu", torch.float32)
            t.setup_cache(80)
            sl.append(t)
        return sl[-1].logits(chained_prefill(sl, ids, chunk)[0])

    one = logits(args, [(0, args.n_layers)], 71)
    dense = logits(replace(args, index_topk=10 ** 6), [(0, args.n_layers)], 71)
    assert (dense - one).norm() / one.norm() > 0.05
    for chunk in (1, 7, 64):
        got = logits(args, [(0, 1), (1, 3), (3, 4)], chunk)
        assert (got - one).norm() / one.norm() < 1e-5, chunk


@pytest.mark.slow
def test_a_stage_never_starts_on_a_shared_indexer_layer(tmp_path, capsys):
    """GLM-5's shared layer (2) takes layer 1's selection: a layer_split starting a stage there is refused in one
    line; an auto split of 2 stages starts its second elsewhere."""
    from families_fixtures import make_hf
    from test_bad_input import refuse
    from strata.config import from_dict
    from strata.plan.plan import build_plan
    _, d = make_hf(tmp_path, "glm_moe_dsa")
    capsys.readouterr()  # (the save's progress bar)
    rig = dict(model=d, stages=[{"device": "cpu", "threads": 1}] * 2, chunk=16, max_context=128, dtype="float32",
               progress=False, prompt={"random": {"tokens": 8, "seed": 0}})
    line = refuse(tmp_path, capsys, {**rig, "layer_split": [2, 2]})
    assert "starts a stage at layer 2: layer 2 takes layer 1's sparse-attention selection" in line
    plan = build_plan(from_dict({**rig, "stages": [{"device": "cpu", "threads": 1, "speed": 1.0}] * 2}))
    starts = [st.start for st in plan.stages]
    assert starts[0] == 0 and 2 not in starts and plan.stages[-1].end == 4, starts
