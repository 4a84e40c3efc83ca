"""Decode batches in CUDA graphs (strata/decode/batch_graphs.py): the rows kernels against their one-row launches, and the
batch body (what a graph captures), run on CPU under Triton's interpreter, against each sequence's step alone."""
import os
import subprocess
import sys
from itertools import repeat
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

pytest.importorskip("triton")


def check_batches(eager, body, first: bool, prompts: list, batches: list[list[int]], tol: float = 1e-5,
                  one_graph: bool = False, rounding=None, seen: list | None = None) -> str:
    """Both slices hold len(prompts) slots; each slot is prefilled with its prompt's first rows (prompts[s]: ids (1, n)
    or residual rows (1, n, dim), n - (steps it takes) prefilled). Then each batch (a list of slots) takes one step of
    each of its slots: the body's rows against `eager`'s steps alone, each slot at its own position (one_graph: the
    one-token graphs' body on eager's slot instead, the same kernels). Returns the (rows, bucket) pairs the batches
    took.

    rounding: a third slice of the same model, prefilled and stepped alone as eager is, whose steps round where
    eager's and the body's do not (the dp4a kernels' int8 x, against the float x both read). A row (its residual,
    its logits) is then held to tol times the distance between rounding's step and eager's for that row, and the
    caches to tol times the largest such distance among them: a multiple of a rounding measured here, not a
    constant. That distance must itself stay under ROUNDING_MAX, so that a wrong slot, position or row (O(1))
    cannot hide under it. The argmax need not be eager's then (two logits nearer than the rounding may swap), but
    eager's logit of it must lie within twice the logits' distance of eager's largest, as that distance implies.
    seen: a list that, where given, gets each comparison (a dict) instead of its assert (the figures
    bench/device_gpu_tests.sh prints)."""
    from strata.kernels.attention import Q8_0, from_cache
    from strata.decode.batch_graphs import BatchGraphs
    from strata.decode.graphs import DecodeGraphs
    if rounding is not None and one_graph:
        raise ValueError("rounding takes eager's steps alone, not one_graph's")
    rel = lambda a, b: float((a.float() - b.float()).abs().max() / b.float().abs().max())  # noqa: E731

    def hold(what, got, want, other=None, scale=None, fixed=None):
        """got against want within tol, or `fixed` where given (rounding: tol times other's distance from want, or
        times `scale` where given; at least `fixed`)."""
        d = rel(got, want)
        r = None if other is None else rel(other, want)
        if r is None:
            bound = tol if fixed is None else fixed
        else:  # (a distance under the values' resolution, finfo's eps, measures no rounding: eps at least)
            bound = max(fixed or 0.0, tol * max(r if scale is None else scale, torch.finfo(want.dtype).eps))
        if seen is not None:
            seen.append(dict(what=what, d=d, bound=bound, rounding=r, old=None if other is None else rel(got, other)))
            return
        assert r is None or r < ROUNDING_MAX, (what, "rounding's own distance", r)
        assert d <= bound, (what, d, bound, r)

    steps = [sum(s in b for b in batches) for s in range(len(prompts))]
    pos = [x.shape[1] - k for x, k in zip(prompts, steps)]
    bg = BatchGraphs(body, DecodeGraphs(body))
    dg = DecodeGraphs(eager) if one_graph else None
    alone = (eager,) if rounding is None else (eager, rounding)
    took = []
    with torch.inference_mode():
        for m in alone + (body,):
            for s, x in enumerate(prompts):
                m.use_slot(s)
                for c in range(0, pos[s], 64):  # in chunks: a window layer's ring holds window + 63 rows
                    m(x[:, c:min(c + 64, pos[s])], c)
        groups = [b[i:i + bg.max_rows] for b in batches for i in range(0, len(b), bg.max_rows)]  # as step splits
        for order in groups:
            n = len(order)
            r = bg.rows_for(n)
            x = torch.cat([prompts[s][0, pos[s]:pos[s] + 1] for s in order])
            want, near = [], []
            for s in order:
                x1 = prompts[s][:, pos[s]:pos[s] + 1]
                for m, into in zip(alone, (want, near)):
                    m.use_slot(s)
                    if one_graph:
                        (dg.ids if first else dg.res).copy_(x1.reshape(dg.ids.shape if first else dg.res.shape))
                        dg.pos.fill_(pos[s])
                        into.append(dg._body(dg.bucket(pos[s])))
                    else:
                        into.append(m.decode_token(x1, pos[s]))
            static = bg.ids if first else bg.res
            static[:n] = x
            static[n:r] = x[:1]
            bg.pos[:r] = torch.tensor([pos[s] for s in order] + [pos[order[0]]] * (r - n))
            bg.slot[:r] = torch.tensor(order + [order[0]] * (r - n))
            bg.base[:r] = torch.tensor([body.slot_base(s) for s in order + [order[0]] * (r - n)])
            bg.live[:r] = torch.arange(r) < n
            b = bg.bucket(max(pos[s] for s in order))
            h, logits, am = bg.body(r, b)
            took.append((r, b))
            for t, s in enumerate(order):
                o = near[t] if near else None
                hold((order, s, "h"), h[t], want[t][0].reshape(-1), None if o is None else o[0].reshape(-1))
                if logits is not None:
                    hold((order, s, "logits"), logits[t], want[t][1], None if o is None else o[1])
                    a, w = int(am[t]), want[t][1].float()
                    # logits within d of eager's (of its largest) put eager's logit of the body's argmax within 2d of
                    # eager's largest: with a rounding between them, their tops may differ
                    near_top = float(w.max() - w[a]) <= 2 * rel(logits[t], w) * float(w.abs().max())
                    if seen is not None:
                        seen.append(dict(what=(order, s, "argmax"), same=a == int(want[t][2]), near_top=near_top,
                                         old=None if o is None else a == int(o[2])))
                    else:
                        assert a == int(want[t][2]) or (o is not None and near_top), (order, s, a, int(want[t][2]))
                pos[s] += 1
        cache = []  # (what, eager's, the body's, rounding's or None): the rows each batch wrote (padding rows
        for i, blk in body.layers.items():  # wrote none), the states it left
            held = (lambda m: m.layers[i].attn.slot_states()) if blk.linear else (lambda m: m.slot_caches(i))
            trios = list(zip(held(eager), held(body), held(rounding) if rounding is not None else repeat(None)))
            if body.pooled(i):  # (a KV pool: each slot's extent against the slot's own cache)
                trios = [(a[:, :, :b.shape[2]], b, None if c is None else c[:, :, :b.shape[2]])
                         for s in range(len(prompts)) for a, b, c in zip(
                             eager._slots[s][i], body._slots[s][i],
                             rounding._slots[s][i] if rounding is not None else repeat(None))]
            for a, b, c in trios:
                q8 = a.dtype == Q8_0  # int8 steps: a value now and then rounds the other way (1/127 of a block's max)
                if q8:
                    a, b, c = (None if t is None else from_cache(t, torch.float32) for t in (a, b, c))
                cache.append(((i, "q8" if q8 else "cache"), a, b, c))
        scale = None if rounding is None else max(rel(c, a) for _, a, _, c in cache)
        for what, a, b, c in cache:
            hold(what, b, a, c, scale, 1e-2 if what[1] == "q8" else None)
    return str(sorted(set(took)))


ROUNDING_MAX = 0.1  # check_batches' rounding distance at most (its bounds then stay well under a wrong row's O(1))


def _interpreted(script: str, *argv: str, timeout: int = 900) -> str:
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", script, str(ROOT), *argv], env=env, capture_output=True, text=True,
                       timeout=timeout, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    return r.stdout.strip()


KERNELS = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
from strata.kernels.decode_kernels import rope_store, rope_store_rows, rms_norm, add_rms_norm
from strata.kernels.decode_attention import SplitKAttention
from strata.kernels.attention import to_cache, Q8_0, cache_width
g = torch.Generator().manual_seed(3)
nh, nkv, hd, S, seqs, R = 8, 2, 32, 300, 3, 4
for kvd, arm in ((torch.float32, "widen"), (Q8_0, "widen"), (Q8_0, "int8x2")):
    w = cache_width(hd, kvd)
    if kvd == torch.float32:
        K, V = torch.randn(seqs, nkv, S, w, generator=g), torch.randn(seqs, nkv, S, w, generator=g)
    else:
        K, V = (to_cache(torch.randn(seqs, nkv, S, hd, generator=g), Q8_0) for _ in range(2))
    K1, V1 = K.clone(), V.clone()
    qkv = torch.randn(R, nh + 2 * nkv, hd, generator=g)
    cos, ssin = torch.randn(R, hd, generator=g), torch.randn(R, hd, generator=g)
    slots, pos = torch.tensor([2, 0, 1, 2]), torch.tensor([37, 250, 5, -1])  # the last a padding row: no store
    q = rope_store_rows(qkv, cos, ssin, pos, slots, nh, nkv, K, V)
    for t in range(R):
        kc, vc = (K1[slots[t]], V1[slots[t]]) if pos[t] >= 0 else (K1[0].clone(), V1[0].clone())
        q1 = rope_store(qkv[t].contiguous(), cos[t], ssin[t], pos[t:t + 1].clamp(min=0), nh, nkv, kc, vc)
        assert torch.equal(q[t], q1), t
    assert torch.equal(K.view(torch.uint8), K1.view(torch.uint8)) and torch.equal(V.view(torch.uint8), V1.view(torch.uint8))
    n_keys = torch.tensor([38, 251, 6, 38])
    for window in (0, 20):
        keys = 256 if window == 0 else window
        att = SplitKAttention(nkv, nh // nkv, hd, keys, "cpu", rows=R, q8=arm, splits=3)
        y = att.rows_call(q.view(R, nkv, nh // nkv, hd), K, V, n_keys, slots, window=window)
        for t in range(R):
            one = SplitKAttention(nkv, nh // nkv, hd, keys, "cpu", q8=arm, splits=3)
            y1 = one(q[t].view(nkv, nh // nkv, hd), K[slots[t]], V[slots[t]], n_keys[t:t + 1], window=window)
            assert torch.equal(y[t], y1), (kvd, arm, window, t, (y[t] - y1).abs().max())
x, y, wt = torch.randn(R, 64, generator=g), torch.randn(R, 64, generator=g), torch.randn(64, generator=g)
pw = torch.randn(64, generator=g)
o, (qq, ss) = rms_norm(x, wt, 1e-6, int8=True, rows=R)
h2, o2, (q2, s2) = add_rms_norm(x, y, wt, 1e-6, True, (pw, 1e-5), rows=R)
for t in range(R):
    o1, (q1, s1) = rms_norm(x[t].contiguous(), wt, 1e-6, int8=True)
    assert torch.equal(o[t], o1) and torch.equal(qq[t], q1[0]) and torch.equal(ss[t], s1[0])
    h1, o1b, (q1b, s1b) = add_rms_norm(x[t].contiguous(), y[t].contiguous(), wt, 1e-6, True, (pw, 1e-5))
    assert torch.equal(h2[t], h1) and torch.equal(o2[t], o1b) and torch.equal(q2[t], q1b[0]) and torch.equal(s2[t], s1b[0])
print("ok")
"""


@pytest.mark.slow
def test_rows_kernels_equal_their_one_row_launches():
    """rope_store_rows (each row its slot and cache row; a padding row, row -1, writes nothing), the split-K rows
    launch (each row its slot and key count; float32, q8_0 widened and its int8x2 arm; a window), and the norms by
    rows: bit for bit what each row's own launch gives, under Triton's interpreter."""
    assert _interpreted(KERNELS) == "ok"


SMALL_BODY = r"""
import dataclasses, sys, torch
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[1] + "/tests")
from test_batch_graphs import check_batches
from test_decode_model import SMALL
from strata.weights.checkpoint import synthetic_tensors
from strata.models.model import Transformer
kv, start, pool = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) > 4 else 0
args = SMALL if kv != "q8_0" else dataclasses.replace(SMALL, n_heads=4, head_dim=32)  # q8_0: blocks of 32
def build(pool=0):
    with torch.device("meta"):
        m = Transformer(args, start, args.n_layers)
    m.load_weights(synthetic_tensors(args, start, args.n_layers, "cpu", torch.float32, seed=4), "cpu", torch.float32)
    m.setup_cache(600, kv, seqs=3, pool=pool)
    if pool:  # extents out of slot order, each just the positions its sequence takes (a KV pool: kv_pool)
        for s, (off, n) in enumerate([(430, 520), (0, 48), (100, 270)]):
            m.place_slot(s, off, n)
    return m.eval()
g = torch.Generator().manual_seed(1)
if start == 0:
    prompts = [torch.randint(0, args.vocab_size, (1, n), generator=g) for n in (514, 40, 264)]
else:
    prompts = [torch.randn(1, n, args.dim, generator=g) for n in (514, 40, 264)]
batches = [[2, 0, 1], [1], [0, 2], [2, 1, 0], [0]]
print(check_batches(build(), build(pool), start == 0, prompts, batches, 1e-4 if kv == "q8_0" else 1e-5, kv != "auto"))
"""


STEP = r"""
import sys, torch
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[1] + "/tests")
from test_decode_model import SMALL
from strata.decode.batch_graphs import BatchGraphs
from strata.weights.checkpoint import synthetic_tensors
from strata.decode.graphs import DecodeGraphs
from strata.models.model import Transformer


class Replayed:  # a CUDA graph's contract on CPU: replay reruns the captured body into the same output tensors
    def __init__(self, body, out):
        self.body, self.out = body, out

    def replay(self):
        for o, n in zip(self.out, self.body()):
            if o is not None:
                o.copy_(n)


class OnCPU(BatchGraphs):
    def _capture(self, r, b):  # a capture records and computes nothing: run the body for its outputs, states kept
        self._write = False
        try:
            out = self.body(r, b)
        finally:
            self._write = True
        return Replayed(lambda: self.body(r, b), out), out


if sys.argv[2] in ("llama", "llama-pool"):
    args = SMALL

    def build(seqs, pool=0):
        with torch.device("meta"):
            m = Transformer(SMALL)
        m.load_weights(synthetic_tensors(SMALL, 0, SMALL.n_layers, "cpu", torch.float32, seed=4), "cpu",
                       torch.float32)
        m.setup_cache(300, seqs=seqs, pool=pool)
        for s in range(seqs if pool else 0):  # a KV pool (kv_pool): extents of 80 positions, in reverse slot order
            m.place_slot(s, 80 * (seqs - 1 - s), 80)
        return m.eval()
else:  # a hybrid: its linear layers' states stand where each slot left them
    import tempfile
    from pathlib import Path
    from families_fixtures import make_hf
    from strata.weights.checkpoint import model_args, slice_tensors
    _, d = make_hf(Path(tempfile.mkdtemp()), sys.argv[2])
    args = model_args(d)

    def build(seqs, pool=0):
        m = Transformer(args)
        m.load_weights(slice_tensors(d, args, 0, args.n_layers), "cpu", torch.float32)
        m.setup_cache(300, max_chunk=64, seqs=seqs)
        return m.eval()


eager, m = build(6), build(6, 480 if sys.argv[2] == "llama-pool" else 0)
g = torch.Generator().manual_seed(5)
prompts = [torch.randint(0, args.vocab_size, (1, 30 + 7 * s), generator=g) for s in range(6)]
with torch.inference_mode():
    for t in (eager, m):
        for s, x in enumerate(prompts):
            t.use_slot(s)
            t(x, 0)
    bg = OnCPU(m, DecodeGraphs(m))
    bg.max_rows = 4  # (a mixture's cap): a batch of 6 is replayed as 4 rows, then 2
    pos = [x.shape[1] for x in prompts]
    tok = [int(x[0, -1]) for x in prompts]
    for order in ([5, 0, 3, 1, 2, 4], [2, 4, 1], [3], [0, 1, 2, 3, 4, 5]):
        h, logits, am = bg.step(torch.tensor([tok[s] for s in order]), order, [pos[s] for s in order])
        assert h.shape == (len(order), args.dim) and logits.shape == (len(order), args.vocab_size)
        for t, s in enumerate(order):
            eager.use_slot(s)
            _, lg, a = eager.decode_token(torch.tensor([[tok[s]]]), pos[s])
            assert float((logits[t] - lg).abs().max() / lg.abs().max()) < 1e-5 and int(am[t]) == int(a), (order, s)
            tok[s], pos[s] = int(a), pos[s] + 1
    bad = [([0, 0], [40, 41]), ([6], [40]), ([1], [300])]
    if bg.linear:  # a slot's state serves only the position it stands at
        bad.append(([2], [pos[2] + 1]))
    for slots, at in bad:
        try:
            bg.step(torch.zeros(len(slots), dtype=torch.long), slots, at)
        except ValueError as e:
            print(str(e).split(":")[0])
print(sorted(bg.graphs))
"""


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama", "qwen3_5", "llama-pool"])
def test_step_pads_groups_and_refuses(model):
    """BatchGraphs.step with a replay that reruns the body into the captured outputs (a CUDA graph's contract, on
    CPU): batches of 6, 3 and 1 sequences at their own positions, 6 over max_rows 4 replayed as 4 then 2 rows, 3 as 4
    (a padding row); each row's logits and argmax == the sequence's eager step alone (qwen3_5: its linear layers'
    states stepped per slot, checked and moved on by the host). A slot named twice, a slot or position outside the
    caches, a position where the slot's state does not stand: a one-line ValueError. llama-pool: the slots' caches are
    extents of one KV pool (kv_pool), each row's found from its slot's extent (a position past the extent: refused)."""
    out = _interpreted(STEP, model).splitlines()
    out = [line for line in out if not line.startswith("Writing")]
    want = ["a decode batch names a slot twice", "slot 6 at position 40", "slot 1 at position 300"]
    if model == "qwen3_5":
        want.append("linear attention")
    assert out == want + ["[(1, 256), (2, 256), (4, 256)]"], out


@pytest.mark.slow
@pytest.mark.parametrize("kv,start", [("auto", 0), ("bfloat16", 1), ("q8_0", 0)])
def test_batch_body_matches_each_step_alone(kv, start):
    """The batch body on a Llama slice (with the embedding and head, or a later slice taking residual rows): batches
    of 3, 1 and 2 sequences (3 and 2 padded to 4 and 2 rows) at their own positions (buckets 256 and 512 and the
    cache's 600), each row == that sequence's step alone within float32 rounding (1e-5), and the caches hold the
    same rows. With a bfloat16 or q8_0 cache the step alone is the one-token graphs' body (the same kernels): a
    product's last float32 bit (a batch's rows against one row) now and then moves a cached value to the next
    bfloat16 or int8 step, and the eager path's other products move more of them (the one-token body is 7e-4 from
    eager with a bfloat16 cache); a q8_0 cache's int8 steps are coarse enough that its rows hold to 1e-4."""
    out = _interpreted(SMALL_BODY, kv, str(start))
    assert out == "[(1, 256), (1, 600), (2, 512), (4, 512), (4, 600)]", out


@pytest.mark.slow
@pytest.mark.parametrize("kv", ["auto", "q8_0"])
def test_batch_body_over_a_kv_pool_matches_each_step_alone(kv):
    """The same batches with the slots' global layers in one KV pool (kv_pool): each slot an extent of its own
    length, placed out of slot order, the kernels reaching it from the extent's first position. Each row == the
    step alone of a model whose slots are caches of their own, and each extent holds that cache's rows."""
    out = _interpreted(SMALL_BODY, kv, "0", "1000")
    assert out == "[(1, 256), (1, 600), (2, 512), (4, 512), (4, 600)]", out


FAMILY_BODY = r"""
import sys, tempfile, torch
from pathlib import Path
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[1] + "/tests")
from families_fixtures import make_hf
from test_batch_graphs import check_batches
from test_families import CHUNK
from strata.decode.batch_graphs import batch_refusal, max_rows
from strata.weights.checkpoint import model_args, slice_tensors
from strata.models.model import Transformer
fam, pool = sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 0
over = {"gemma3": dict(query_pre_attn_scalar=24, final_logit_softcapping=1.5),
        "qwen3_moe": dict(num_experts_per_tok=8)}.get(fam, {})  # 16 pairs: 2 rows a replay
ref, d = make_hf(Path(tempfile.mkdtemp()), fam, **over)
args = model_args(d)
def build(pool=0):
    t = Transformer(args, 0, args.n_layers)
    t.load_weights(slice_tensors(d, args, 0, args.n_layers), "cpu", torch.float32)
    t.setup_cache(200, max_chunk=64, seqs=3, pool=pool)
    for s, (off, n) in enumerate([(300, 170), (0, 32), (100, 110)] if pool else []):  # (kv_pool: extents)
        t.place_slot(s, off, n)
    return t.eval()
eager, body = build(), build(pool)
g = torch.Generator().manual_seed(2)
prompts = [torch.randint(0, args.vocab_size, (1, n), generator=g) for n in (150, 12, 97)]
batches = [[2, 0, 1], [1, 0], [0], [2, 1, 0]] + [[0, 1, 2]] * 4  # past the windows: the rings wrap
print(max_rows(body), check_batches(eager, body, True, prompts, batches))
"""


@pytest.mark.slow
@pytest.mark.parametrize("fam", ["gemma3", "qwen3_5"])
def test_batch_body_families_over_a_kv_pool(fam):
    """A KV pool (kv_pool) where global layers sit beside others: gemma3's window layers keep their rings a slot
    (and wrap) while its global layers read extents of the pool; qwen3_5's linear layers keep their states a slot.
    Each row == the family's step alone without a pool, and each extent holds that slot's rows."""
    out = _interpreted(FAMILY_BODY, fam, "500").split(" ", 1)
    assert out[0] == "4", out


@pytest.mark.slow
@pytest.mark.parametrize("fam,rows", [("gemma3", 4), ("mistral", 4), ("qwen3", 4), ("gpt_oss", 4), ("qwen3_moe", 2),
                                      ("qwen3_5", 4), ("qwen3_5_moe", 4), ("glm4_moe", 4)])
def test_batch_body_families(fam, rows):
    """The batch body for the families the one-token graphs cover (q/k norms in the store's launch, window rings, gemma3's
    post norms and scales, gpt-oss's sinks and biases, experts on their few-rows path; qwen3_5's linear layers from
    each slot's states and its gated, partially rotated attention; glm4_moe's partial rotary): each row == its eager
    step alone, and the caches and states hold the same. A mixture's replay takes GATHER_PAIRS / k rows at most (16 / 8 = 2 for this qwen3_moe: a batch of 3 is
    replayed as 2 rows then 1; gpt_oss's k 2: the 3 slots' 4)."""
    out = _interpreted(FAMILY_BODY, fam, timeout=1200)
    assert out.split(" ", 1)[0] == str(rows), out


RESIDENT_BODY = r"""
import sys, torch
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[1] + "/tests")
from test_batch_graphs import check_batches
from strata.models.args import PRESETS
from strata.weights.checkpoint import load_stage
preset, qtype = sys.argv[2], sys.argv[3]
args = PRESETS[preset]
load = lambda: load_stage(f"synthetic:{preset}@{qtype}", args, 0, 2, device="cpu", dtype=torch.float32,
                          weights="resident", max_len=96, seqs=2)
eager, body = load(), load()
assert body.layers["0"].weights.fused_decode_ok("cpu") if not body.layers["0"].moe else True
g = torch.Generator().manual_seed(3)
prompts = [torch.randint(0, args.vocab_size, (1, n), generator=g) for n in (20, 9)]
print(check_batches(eager, body, True, prompts, [[1, 0], [0]], 1e-4))  # (interpreted blocks: minutes a batch)
"""


@pytest.mark.slow
@pytest.mark.parametrize("preset,qtype", [("smoke", "Q4_K_M"), ("smoke-moe", "Q4_K")])
def test_batch_body_on_blocks(preset, qtype):
    """A resident slice (its products on the Q4_K / Q6_K blocks, x's int8 rounding from the norm's launch, rows
    at a time; a mixture's chosen experts on theirs): each row == its eager step alone on the same blocks."""
    out = _interpreted(RESIDENT_BODY, preset, qtype, timeout=1500)
    assert out.startswith("[("), out


GATHER = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
from strata.models.args import PRESETS
from strata.decode.batch_graphs import max_rows
from strata.weights.checkpoint import load_stage
args = PRESETS["smoke-moe"]
m = load_stage("synthetic:smoke-moe@Q4_K", args, 0, 2, device="cpu", dtype=torch.float32, weights="resident",
               max_len=64, seqs=3)
moe = m.layers["0"].mlp
assert moe.gathers_any_rows("cpu")
print(max_rows(m))
moe.k = 8  # every expert for every row: 24 (row, expert) pairs, past GATHER_PAIRS
x = torch.randn(3, args.dim, generator=torch.Generator().manual_seed(0))
with torch.inference_mode():
    a, b = moe(x, gather=True), moe(x)  # the chosen experts' kernels on their blocks / grouped on the dequantized
err = ((a - b).norm() / b.norm()).item()
assert err < 2e-2, err  # (the experts' kernels take x in int8: ~5e-3 a product)
print("ok")
"""


@pytest.mark.slow
def test_experts_on_blocks_take_a_whole_batch():
    """Resident experts whose kernels read their blocks in place take a batch's rows whatever their count (one
    replay for 3 slots: max_rows 4), on the few-rows path (gather) past GATHER_PAIRS pairs: within the int8 products'
    rounding of the grouped path."""
    assert _interpreted(GATHER).splitlines() == ["4", "ok"]


@pytest.mark.slow
def test_refusals_name_what_is_not_covered(tmp_path):
    """A float8 cache and dynamic NTK rope keep the eager batches, with the reason; CPU tensors are never
    captured."""
    from families_fixtures import make_hf
    from strata.decode.batch_graphs import batch_refusal
    from strata.weights.checkpoint import model_args, slice_tensors
    from strata.models.model import Transformer
    _, d = make_hf(tmp_path, "llama")
    args = model_args(d)
    t = Transformer(args, 0, args.n_layers)
    t.load_weights(slice_tensors(d, args, 0, args.n_layers), "cpu", torch.float32)
    t.setup_cache(64, "float8_e4m3fn", seqs=2)
    assert batch_refusal(t, torch.zeros(1, dtype=torch.long)) == "a torch.float8_e4m3fn cache"
    t.rope_dynamic = {"rope_type": "dynamic"}
    assert batch_refusal(t, torch.zeros(1, dtype=torch.long)).startswith("dynamic NTK rope")
    t = Transformer(args, 0, args.n_layers)
    t.load_weights(slice_tensors(d, args, 0, args.n_layers), "cpu", torch.float32)
    t.setup_cache(64, seqs=2)
    assert batch_refusal(t, torch.zeros(1, dtype=torch.long)) is None
    from strata.decode.graphs import GraphedDecode
    assert GraphedDecode(t).batch_refusal(torch.zeros(1, dtype=torch.long)) == \
        "the one-token graphs do not cover this slice (CPU)"
