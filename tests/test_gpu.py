"""GPU checks (run on the GPU machine; skipped without CUDA): stages sharing one GPU, bf16."""
import importlib.util
import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from strata.decode.graphs import GraphedDecode  # noqa: E402
from strata.models.model import Transformer  # noqa: E402
from strata.head.pipeline import Pipeline  # noqa: E402
from strata.weights.checkpoint import model_args, slice_tensors  # noqa: E402

MODEL = "synthetic:smoke-wide"


def single_process_logits(ids, chunk):
    args = model_args(MODEL)
    t = Transformer(args)
    t.load_weights(slice_tensors(MODEL, args, 0, args.n_layers, device="cuda:0", dtype=torch.bfloat16),
                   "cuda:0", torch.bfloat16)
    t.setup_cache(ids.size)
    x = torch.from_numpy(ids.astype(np.int64)).view(1, -1).cuda()
    h = torch.cat([t(x[:, p:p + chunk], p) for p in range(0, ids.size, chunk)], dim=1)
    return t.logits(h[0, -1]).cpu().numpy()


@pytest.mark.parametrize("n_stages", [2, 4])
def test_stages_sharing_one_gpu(tmp_path, n_stages):
    tokens, chunk = 8192, 1024
    cfg = dict(model=MODEL, dtype="bfloat16", stages=[{"device": "cuda:0"}] * n_stages, chunk=chunk,
               prompt={"random": {"tokens": tokens, "seed": 5}}, dump_residual=True, progress=False)
    reports, logits = {}, {}
    for depth in (0, 1):
        with Pipeline(dict(cfg, depth=depth), out=tmp_path / f"d{depth}", console=False) as p:
            res = p.prefill()
            ids = p.plan.ids
        reports[depth], logits[depth] = res.report, res.last_logits
    assert reports[0]["residual_md5"] == reports[1]["residual_md5"]
    assert np.array_equal(logits[0], logits[1])
    ref = single_process_logits(ids, chunk)
    rel = np.linalg.norm(logits[1] - ref) / np.linalg.norm(ref)
    assert rel < 2e-2, rel
    rep = reports[1]
    assert rep["pinned"] and all(s["pinned"] for s in rep["stages"])
    work = sum(s["work_s"] for s in rep["stages"])
    copy = sum(s["copy_s"] for s in rep["stages"])
    print(f"{n_stages} stages: rel {rel:.2e}, copy {copy:.4f}s of work {work:.3f}s ({copy / work:.2%}), "
          f"pinned {rep['handoff_pinned_bytes']:,} bytes, tok/s d0 {reports[0]['tok_s']:.0f} d1 {rep['tok_s']:.0f}")
    # several stages share ONE GPU here: a copy waits for the GPU's time slice behind the other processes'
    # kernels, so it measures the sharing more than the copy (H200: 4.3% with 2 stages, 7.8% with 4; it failed
    # a 15 % bound once with a build beside it). Timing is a benchmark's (bench/ab.py), not this test's: printed
    # only. The hand-off buffers are checked pinned above.


# -- the one-token decode step on CUDA: eager decode path and CUDA graphs ------------------------------
def _dense(dtype, max_len, start=0, end=None, kv_dtype="auto"):
    args = model_args(MODEL)
    end = args.n_layers if end is None else end
    with torch.device("meta"):
        t = Transformer(args, start, end)
    t.load_weights(slice_tensors(MODEL, args, start, end, device="cuda:0", dtype=dtype), "cuda:0", dtype)
    t.setup_cache(max_len, kv_dtype)
    return t.eval()


def _rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-4)])
def test_decode_path_matches_prefill_path_cuda(dtype, tol):
    """flash (bf16) / efficient (fp32) single-call attention vs the chunk path with T=1."""
    old, new = _dense(dtype, 600), _dense(dtype, 600)
    ids = torch.randint(0, 2048, (1, 520), generator=torch.Generator().manual_seed(1)).cuda()
    old(ids[:, :500], 0), new(ids[:, :500], 0)
    for p in range(500, 520):
        a, b = old(ids[:, p:p + 1], p, decode=False), new(ids[:, p:p + 1], p)
        assert _rel(b, a) < tol, p
        assert _rel(new.logits(b[0, -1]), old.logits(a[0, -1])) < tol, p


def _graph_vs_eager(eager, graph, ids, start, stop, x_of):
    worst = 0.0
    for p in range(start, stop):
        a = eager(x_of(p), p, decode=True)
        b = graph.decode_step(x_of(p), p)
        assert b.shape == a.shape and b.dtype == a.dtype
        worst = max(worst, _rel(b, a))
    return worst


def test_cuda_graph_decode_matches_eager():
    """Graph steps == eager decode steps (bf16 2e-2) across bucket boundaries (256, 512, 1024 and the
    cache's own 1200), then again after a second prompt rewrites the cache."""
    eager, graph = _dense(torch.bfloat16, 1200), _dense(torch.bfloat16, 1200)
    steps = GraphedDecode(graph)
    g = torch.Generator().manual_seed(2)
    for prompt_len, stop in ((200, 1100), (100, 300)):
        ids = torch.randint(0, 2048, (1, stop), generator=g).cuda()
        ha, hb = eager(ids[:, :prompt_len], 0), graph(ids[:, :prompt_len], 0)
        assert torch.equal(ha, hb)
        worst = _graph_vs_eager(eager, steps, ids, prompt_len, stop, lambda p: ids[:, p:p + 1])
        print(f"prompt {prompt_len}: graph vs eager worst rel {worst:.2e}, buckets {sorted(steps.graphs.graphs)}")
        # bf16's tolerance on the largest element: 2.01e-2 measured once the graphs' norms summed their squares in
        # another order (d84c46b); a wrong bucket, position or cache row is off by O(1)
        assert worst < 3e-2
    assert sorted(steps.graphs.graphs) == [256, 512, 1024, 1200]
    # logits through the graph's residual: within bf16's tolerance of eager's, and the same greedy token unless
    # eager's top two are closer than the two paths differ (a random model's logits are nearly flat: call 16
    # saw 684 vs 946 on a near-tie)
    p = 300
    x = ids[:, p - 1:p]
    a, b = eager(x, p - 1, decode=True), steps.decode_step(x, p - 1)
    la, lb = eager.logits(a[0, -1]).float(), graph.logits(b[0, -1]).float()
    assert _rel(lb, la) < 2e-2
    top2 = la.topk(2).values
    if float(top2[0] - top2[1]) > 2 * float((la - lb).abs().max()):
        assert int(la.argmax()) == int(lb.argmax())


def test_cuda_graph_float32_with_bfloat16_cache():
    """configs/rig.yaml's setting on a GPU (float32 compute, kv_dtype bfloat16): the prefill widens the cached
    prefix, graph steps (split-K over the bfloat16 keys) give eager steps' residuals within float32 rounding,
    and both stay within bfloat16 rounding of a float32 cache."""
    ref = _dense(torch.float32, 700)
    eager, graph = (_dense(torch.float32, 700, kv_dtype="bfloat16") for _ in range(2))
    assert graph.layers["0"].attn.k_cache.dtype == torch.bfloat16
    ids = torch.randint(0, 2048, (1, 560), generator=torch.Generator().manual_seed(4)).cuda()
    h = ref(ids[:, :500], 0)
    ha, hb = eager(ids[:, :500], 0), graph(ids[:, :500], 0)
    assert torch.equal(ha, hb) and _rel(ha, h) < 2e-2
    steps = GraphedDecode(graph)
    worst = _graph_vs_eager(eager, steps, ids, 500, 560, lambda p: ids[:, p:p + 1])
    assert worst < 1e-4, worst
    for p in range(500, 560):
        ref(ids[:, p:p + 1], p, decode=True)
    assert _rel(steps.decode_step(ids[:, 559:560], 559), ref(ids[:, 559:560], 559, decode=True)) < 2e-2


@pytest.mark.parametrize("kv", ["float8_e4m3fn", "q8_0"])
def test_cuda_graph_with_8bit_cache(kv):
    """kv_dtype float8_e4m3fn with CUDA graphs (it failed at load: CUDA's index_copy_ has no float8 kernel): graph
    steps store through the cache's bytes and read the 8-bit keys in the split-K kernel; q8_0: stored by the fused
    rope kernel as blocks, read as blocks by split-K; within 8-bit rounding of a bfloat16 cache's steps."""
    ref = _dense(torch.bfloat16, 700)
    eager, graph = (_dense(torch.bfloat16, 700, kv_dtype=kv) for _ in range(2))
    assert graph.layers["0"].attn.k_cache.dtype == (torch.uint8 if kv == "q8_0" else torch.float8_e4m3fn)
    ids = torch.randint(0, 2048, (1, 560), generator=torch.Generator().manual_seed(4)).cuda()
    ref(ids[:, :500], 0), eager(ids[:, :500], 0), graph(ids[:, :500], 0)
    steps = GraphedDecode(graph)
    worst = _graph_vs_eager(eager, steps, ids, 500, 560, lambda p: ids[:, p:p + 1])
    assert worst < 2e-2, worst
    for p in range(500, 560):
        ref(ids[:, p:p + 1], p, decode=True)
    assert _rel(steps.decode_step(ids[:, 559:560], 559), ref(ids[:, 559:560], 559, decode=True)) < 5e-2
    assert steps.graphs is not None and steps.graphs.graphs


def test_cuda_graph_middle_slice_and_forward():
    """A slice without embedding takes the residual row; GraphedDecode's forward routes T=1 steps through the
    graphs; after setup_cache it holds none (they address the old cache)."""
    eager, graph = _dense(torch.bfloat16, 700, 2, 6), _dense(torch.bfloat16, 700, 2, 6)
    g = torch.Generator().manual_seed(3)
    rows = (torch.randn(1, 600, 1024, generator=g) * 0.5).to("cuda", torch.bfloat16)
    eager(rows[:, :300], 0), graph(rows[:, :300], 0)
    steps = GraphedDecode(graph)
    worst = 0.0
    for p in range(300, 600):
        a = eager(rows[:, p:p + 1], p)
        b = steps(rows[:, p:p + 1], p)
        worst = max(worst, _rel(b, a))
    assert worst < 2e-2, worst
    assert sorted(steps.graphs.graphs) == [512, 700]  # 1024 is clipped to the cache
    graph.setup_cache(700)
    assert steps.graphs is None


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_cuda_graph_resident_quantized_matches_eager():
    """Resident IQ3_S layers, head and embedding: the graph step (fused kernels on the blocks, the embedding
    row gathered and dequantized inside the replay) gives the eager decode path's residual, logits and argmax."""
    from strata.weights.checkpoint import load_stage
    model = "synthetic:smoke-wide@IQ3_S"
    args = model_args(model)
    ms = [load_stage(model, args, 0, args.n_layers, device="cuda:0", dtype=torch.bfloat16, weights="resident",
                     max_len=700) for _ in range(2)]
    eager, graph = ms
    steps = GraphedDecode(graph)
    ids = torch.randint(0, args.vocab_size, (1, 560), generator=torch.Generator().manual_seed(5)).cuda()
    eager(ids[:, :500], 0), graph(ids[:, :500], 0)
    x = ids[:, :1]
    assert steps.graphable(x)
    # the dp4a kernels round each product's x to int8 (per 32 values): a bf16 rounding difference between the
    # graph's and eager's inputs (split-K vs flash attention) can move an int8 step, so the two paths differ
    # more than bf16 alone (H200: 2.2e-2 max-relative at p=500 with dp4a-u16; 2e-2 holds with the float kernel)
    tol = 4e-2 if graph.gemv.iq3s.startswith("dp4a") else 2e-2  # (the kernel the slice ran, after any fallback)
    for p in range(500, 560):
        a, la, ia = eager.decode_token(ids[:, p:p + 1], p)
        b, lb, ib = steps.decode_token(ids[:, p:p + 1], p)
        assert _rel(b, a) < tol and _rel(lb, la) < tol, (p, _rel(b, a), _rel(lb, la))
    assert steps.graphs is not None and sorted(steps.graphs.graphs) == [512, 700]
    assert steps.graphs.ids is not None  # the token id goes in, not an embedding row made before the replay


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_rows_on_cuda_close_to_each_step_alone(tmp_path, family):
    """Transformer.decode_seqs on CUDA in bfloat16: three sequences' rows in one batch are each within bf16 rounding
    of the step alone (cuBLAS picks its kernel by the row count, so the bits differ; tests/test_decode_model.py
    holds float32 on CPU to 1e-4), the same argmax where the alone step's top two are apart; with decode_batch
    steps, each row is its step alone bit for bit."""
    from families_fixtures import make_hf
    from test_decode_model import slotted_stages
    _, d = make_hf(tmp_path, family)
    args = model_args(d)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, args.vocab_size, (1, n), generator=g).cuda() for n in (40, 9, 27)]
    (b0, b1), (a0, a1), (e0, e1) = (slotted_stages(d, args, prompts, device="cuda:0", dtype=torch.bfloat16)
                                    for _ in range(3))
    e0.batch_rows = e1.batch_rows = False
    tok, pos = [5, 17, 101], [p.shape[1] for p in prompts]
    for order in ([0, 1, 2], [2, 0], [1, 2, 0], [0, 1, 2], [2, 1, 0]):
        x = torch.tensor([tok[s] for s in order], device="cuda:0")
        at = [pos[s] for s in order]
        with torch.inference_mode():
            h, _, _ = b0.decode_seqs(x, order, at)
            out, logits, am = b1.decode_seqs(h, order, at)
            he, _, _ = e0.decode_seqs(x, order, at)
            oute, logitse, ame = e1.decode_seqs(he, order, at)
            for t, s in enumerate(order):
                a0.use_slot(s), a1.use_slot(s)
                h1 = a0.decode_step(torch.tensor([[tok[s]]], device="cuda:0"), pos[s])
                o1, lg1, am1 = a1.decode_token(h1, pos[s])
                assert torch.equal(he[t], h1.view(-1)) and torch.equal(logitse[t], lg1), (family, order, t)
                assert _rel(h[t].float(), h1.view(-1).float()) < 2e-2, (family, order, t)
                assert _rel(logits[t].float(), lg1.float()) < 2e-2, (family, order, t)
                top2 = lg1.float().view(-1).topk(2).values
                if float(top2[0] - top2[1]) > 0.1:
                    assert int(am[t]) == int(am1), (family, order, t)
                assert int(ame[t]) == int(am1)
                tok[s], pos[s] = int(am1), pos[s] + 1


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3_moe", "qwen3_5"])
def test_batch_graphs_close_to_each_step_alone(tmp_path, family):
    """strata.decode.batch_graphs on CUDA in bfloat16, through GraphedDecode as a stage holds it: batches of 3, 2 and 1
    sequences (3 padded to 4 rows; qwen3_moe with k 8: at most 2 rows a replay; qwen3_5's linear layers from each
    slot's states) replayed from graphs, each row
    within bf16 rounding of the eager step alone, the same argmax where that step's top two are apart; with
    decode_batch steps, one replay of one row each. The graphs were captured (not the eager fallback)."""
    from families_fixtures import make_hf
    from test_decode_model import slotted_stages
    _, d = make_hf(tmp_path, family, **({"num_experts_per_tok": 8} if family == "qwen3_moe" else {}))
    args = model_args(d)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, args.vocab_size, (1, n), generator=g).cuda() for n in (40, 9, 27)]
    (b0, b1), (a0, a1), (e0, e1) = (slotted_stages(d, args, prompts, device="cuda:0", dtype=torch.bfloat16)
                                    for _ in range(3))
    rows, steps = [GraphedDecode(b0), GraphedDecode(b1)], [GraphedDecode(e0), GraphedDecode(e1)]
    e0.batch_rows = e1.batch_rows = False
    tok, pos = [5, 17, 101], [p.shape[1] for p in prompts]
    for order in ([0, 1, 2], [2, 0], [1], [1, 2, 0], [0, 1, 2], [2, 1, 0]):
        x = torch.tensor([tok[s] for s in order], device="cuda:0")
        at = [pos[s] for s in order]
        with torch.inference_mode():
            _, logits, am = rows[1].decode_seqs(rows[0].decode_seqs(x, order, at)[0], order, at)
            _, logits_s, am_s = steps[1].decode_seqs(steps[0].decode_seqs(x, order, at)[0], order, at)
            for t, s in enumerate(order):
                a0.use_slot(s), a1.use_slot(s)
                _, lg1, am1 = a1.decode_token(a0.decode_step(torch.tensor([[tok[s]]], device="cuda:0"), pos[s]),
                                              pos[s])
                for lg in (logits, logits_s):  # bf16 as the one-token graphs' tests hold it (as a whole: a row's largest
                    # value differs by 2.3e-2 of the largest for gemma3 on an H100, its sandwich norms' rounding)
                    err = float((lg[t].float() - lg1.float()).norm() / lg1.float().norm())
                    assert err < 2e-2, (family, order, t, err)
                top2 = lg1.float().view(-1).topk(2).values
                if float(top2[0] - top2[1]) > 0.1:
                    assert int(am[t]) == int(am_s[t]) == int(am1), (family, order, t)
                tok[s], pos[s] = int(am1), pos[s] + 1
    assert all(gd.batch_refusal(x) is None and gd._batch.graphs for gd in rows + steps)
    assert {r for r, _ in steps[0]._batch.graphs} == {1}
    assert {r for r, _ in rows[0]._batch.graphs} == ({1, 2} if family == "qwen3_moe" else {1, 2, 4})


@pytest.mark.parametrize("pool", [0, 640])
def test_max_seqs_on_cuda_equals_alone(tmp_path, pool):
    """max_seqs 3 on two stages of one GPU (decode batches from strata.decode.batch_graphs' graphs), decode_batch steps:
    three sequences at once give each the greedy ids it gets alone, with two or more in flight together; with a
    KV pool (kv_pool 640) too, where alone each runs in the pool's first extent and together in three. (With rows,
    the default, a batch's bf16 products round apart from one row's, and a random model's near-flat logits let the
    greedy ids part: test_batch_graphs_close_to_each_step_alone holds those rows to bf16's rounding.)"""
    import threading
    from strata.serve.engine import PipelineEngine
    from strata.text.sampling import SamplingParams
    # prefix_reuse chunks: a prompt asked again restores only up to its cold schedule's chunk boundary (rows would
    # compute its last token alone on the decode path, rounded otherwise than the cold prefill's last chunk)
    eng = PipelineEngine(dict(model=MODEL, dtype="bfloat16", stages=[{"device": "cuda:0"}] * 2, chunk=64,
                              max_context=512, progress=False, max_seqs=3, decode_batch="steps", prefix_reuse="chunks",
                              kv_pool=pool,
                              prompt={"random": {"tokens": 8, "seed": 0}}),  # (a synthetic model has no tokenizer)
                         out=tmp_path / "slots")
    try:
        rng = np.random.default_rng(3)
        prompts = [rng.integers(0, eng.pipe.plan.args.vocab_size, n).tolist() for n in (7, 150, 33)]

        def run(ids, box, i):
            made = []
            eng.generate(ids, SamplingParams(max_tokens=24, temperature=0), lambda t: made.append(t) or True)
            box[i] = made
        alone, together = {}, {}
        for i, ids in enumerate(prompts):
            run(ids, alone, i)
        threads = [threading.Thread(target=run, args=(ids, together, i)) for i, ids in enumerate(prompts)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert together == alone and any(alone.values())
        assert eng.slot_stats().most_in_flight >= 2
        log = (tmp_path / "slots" / "stage-0.log").read_text()
        assert "decode: CUDA graphs of decode batches" in log, log
    finally:
        eng.close()


def test_prefill_group_on_cuda_close_to_each_chunk_alone():
    """Transformer.forward_group on CUDA: a resident Q4_K_M model in bf16 (products dequantized into the scratch
    once for the group, flash / cuDNN attention per sequence) with three sequences' chunks as one group: each row is
    as close to its chunk alone in its slot as the same rows computed in two chunks instead of one are (bf16's
    rounding through 8 layers; on an H100 both were 0.05-0.06 at most, ~0.006 on average), and so is each last
    row's logits. A wrong slot, position or rope row would be O(1)."""
    from strata.models.args import PRESETS
    from strata.weights.checkpoint import load_stage
    args = PRESETS["smoke-wide"]

    def load():
        return load_stage("synthetic:smoke-wide@Q4_K_M", args, 0, args.n_layers, device="cuda:0",
                          dtype=torch.bfloat16, weights="resident", max_len=512, seqs=3)
    a, b, c = load(), load(), load()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, args.vocab_size, (1, n), generator=g).cuda() for n in (300, 37, 120, 64)]
    with torch.inference_mode():
        for m in (a, b, c):
            for slot in range(3):
                m.use_slot(slot)
                m(prompts[slot], 0)
        # the rounding floor: slot 2's next 64 rows in two chunks of 32 against one chunk of 64
        c.use_slot(2)
        a.use_slot(2)
        two = torch.cat([c(prompts[3][:, :32], 120), c(prompts[3][:, 32:], 152)], 1).float()
        one = a(prompts[3], 120).float()
        floor = (two - one).abs()
        assert floor.max() > 0  # (bf16: re-chunking does round apart)
        segs = [(2, 120, 64), (0, 300, 9), (1, 0, 37)]  # later chunks, and slot 1 prefilled again from 0
        rows = [prompts[3], prompts[3][:, :9], prompts[1]]
        h = b.forward_group(torch.cat(rows, 1), segs)
        o = 0
        for (slot, pos, n), x in zip(segs, rows):
            a.use_slot(slot)
            alone = a(x, pos)
            d = (h[:, o:o + n].float() - alone.float()).abs()
            assert d.max() <= 2 * floor.max() and d.mean() <= 2 * floor.mean(), (slot, d.max(), floor.max())
            la, lb = a.logits(alone[0, -1]), b.logits(h[0, o + n - 1])
            assert (la - lb).abs().max() <= 0.05 * la.abs().max(), slot
            o += n


BATCH_ROWS_MULTIPLE = 2.0  # the body's distance from the float-x step, in the int8-x step's (the test's docstring)


def batch_rows_case(seen: list | None = None, multiple: float = BATCH_ROWS_MULTIPLE) -> None:
    """test_resident_batch_rows_close_to_each_step_alone's check (seen: its figures instead of its asserts, as
    check_batches takes them; bench/device_gpu_tests.sh prints them)."""
    from test_batch_graphs import check_batches
    from strata.models.args import PRESETS
    from strata.weights.checkpoint import load_stage
    from strata.config import KernelSpec
    from strata.quant import rows
    args = PRESETS["smoke-wide"]

    def load(kernels):
        return load_stage("synthetic:smoke-wide@Q4_K_M", args, 0, args.n_layers, device="cuda:0",
                          dtype=torch.bfloat16, weights="resident", max_len=160, seqs=6, kernels=kernels)
    float_x = load(KernelSpec(gemv_rows="dp4a", gemv_kquant="words", gemv_q6k="words"))
    int8_x, body = load(KernelSpec(gemv_rows="dp4a")), load(None)
    calls, inner = [], rows.quant_matmul_rows

    def counted(*a, **kw):
        calls.append(1)
        return inner(*a, **kw)
    rows.quant_matmul_rows = counted
    try:
        g = torch.Generator().manual_seed(5)
        prompts = [torch.randint(0, args.vocab_size, (1, n), generator=g).cuda() for n in (40, 9, 27, 64, 13, 20)]
        check_batches(float_x, body, True, prompts, [[0, 1, 2, 3, 4, 5], [5, 3, 1, 0, 2], [2, 0, 4, 5, 1, 3]],
                      multiple, rounding=int8_x, seen=seen)
    finally:
        rows.quant_matmul_rows = inner
    assert calls and body.gemv.rows == rows.ARM  # (taken, and not fallen back to dp4a)
    assert (int8_x.gemv.kquant, int8_x.gemv.q6k) == ("dp4a", "dp4a")  # (the reference rounded x: no fallback)


def test_resident_batch_rows_close_to_each_step_alone():
    """A resident Q4_K_M model (smoke-wide: Q4_K and Q6_K blocks, the head included) in bf16 with 6 slots: the batch
    body's rows of 5 and 6 sequences (padded to 8), whose products take strata.quant.rows (kernels.gemv_rows
    mma-float, the default; counted), against each sequence's step alone.

    Like with like: the body multiplies x as it is (bf16, against weights dequantized in float32 then rounded to
    bf16), so its reference is the step on the word kernels, which read x as it is too (kernels.gemv_kquant and
    gemv_q6k words). The default step (dp4a) rounds x to int8 per 32 values (quantize_x: up to 1/254 of a group's
    largest, against 2^-9 of each weight for the body's bf16): a rounding the body does not make, measured here on
    the same rows as the dp4a step's distance from the word step. Each row's residual and logits must be within
    BATCH_ROWS_MULTIPLE (2) times that distance for that row, the caches within 2 times the largest of those
    (check_batches' rounding). 2, not 1: each layer writes its residual in bf16, so once the two differences come
    down to an ulp or two they are the same size (layer 0's caches: 0.0032 both), and the layers after amplify
    either alike. The argmax may differ from the word step's where their top two are nearer than that rounding
    (this random head's often are), but the word step's logit of it must lie within twice the logits' distance of
    its largest. A wrong slot, position or row is O(1); the distance measured must stay under ROUNDING_MAX (0.1).

    Measured on an H100 at 0b02601 (3 runs, the same bits; bench/device_gpu_tests.sh figures): the dp4a step
    0.016-0.033 from the word step, the body at most 0.024 (1.33 times its row's dp4a distance; most rows 0.5-0.9),
    the caches 0.016 against 0.023. The constant bound this replaces (the body within 3e-2 of the dp4a step, its
    argmax the dp4a step's) measured the int8 rounding more than the body: 0.034 at one row's logits, and one row's
    argmax apart."""
    batch_rows_case()
