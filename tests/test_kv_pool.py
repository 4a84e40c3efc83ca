"""One KV pool a stage for all sequences (the rig's kv_pool, max_seqs > 1): a sequence holds an extent of its prompt
and continuation, not max_context positions, so more sequences fit where most are short. The head's allocator, the
model's extents against caches of their own (torch rows, the C decoder through the engine), the planner's count, a
sequence that waits for room, and the refusals. The decode batches' kernels over a pool: tests/test_batch_graphs.py."""
from __future__ import annotations

import threading

import pytest
import torch

from strata.errors import ConfigError
from strata.head.slots import Extents


def test_extents_first_fit_merge_and_refuse_a_double_free():
    e = Extents(300)
    assert [e.take(100), e.take(64), e.take(100)] == [0, 100, 164] and e.free == 36
    assert e.take(64) is None  # 36 free: no gap holds 64
    e.give(100, 64)
    assert e.gaps == [[100, 64], [264, 36]] and e.take(80) is None
    e.give(0, 100)  # merged with [100, 164)
    assert e.gaps == [[0, 164], [264, 36]] and e.take(150) == 0
    e.give(0, 150)
    e.give(164, 100)  # merged both ways: the whole pool again
    assert e.gaps == [[0, 300]] and e.free == 300
    with pytest.raises(ValueError, match="partly free already"):
        e.give(10, 5)


def _small(pool: int):
    from strata.weights.checkpoint import synthetic_tensors
    from test_decode_model import SMALL
    with torch.device("meta"):
        from strata.models.model import Transformer
        m = Transformer(SMALL)
    m.load_weights(synthetic_tensors(SMALL, 0, SMALL.n_layers, "cpu", torch.float32, seed=4), "cpu", torch.float32)
    m.setup_cache(128, seqs=3, pool=pool)
    return m.eval()


@pytest.mark.slow
@torch.inference_mode()
def test_extents_of_a_pool_give_each_sequence_its_own_caches_bits():
    """Three sequences in extents of one pool (out of slot order, each only as long as it needs) prefilled and then
    stepped together by decode_seqs' rows: each row's logits are the bits of a model whose slots have caches of
    their own, and each extent holds that cache's rows. A step past a slot's extent, an extent outside the pool and
    a pool shorter than max_len are refused."""
    plain, pooled = _small(0), _small(200)
    for s, (off, n) in enumerate([(120, 60), (0, 40), (40, 70)]):
        pooled.place_slot(s, off, n)
    assert pooled.kv_bytes < plain.kv_bytes and pooled.slot_positions(2) == 70 and plain.slot_positions(2) == 128
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (1, n), generator=g) for n in (50, 20, 61)]
    pos = [p.shape[1] for p in prompts]
    for m in (plain, pooled):
        for s, x in enumerate(prompts):
            m.use_slot(s)
            m(x[:, :13], 0)  # (two chunks: the second attends to a prefix in the extent)
            m(x[:, 13:], 13)
    tok = [int(p[0, -1]) for p in prompts]
    for order in ([2, 0, 1], [1, 2], [0, 1, 2]):
        x = torch.tensor([tok[s] for s in order])
        want = plain.decode_seqs(x, order, [pos[s] for s in order])
        got = pooled.decode_seqs(x, order, [pos[s] for s in order])
        assert torch.equal(want[1], got[1])
        for s, t in zip(order, want[2].tolist()):
            tok[s], pos[s] = t, pos[s] + 1
    for s in range(3):
        for i in [i for i in pooled.layers if pooled.pooled(i)]:
            for a, b in zip(plain._slots[s][i], pooled._slots[s][i]):
                assert torch.equal(a[:, :, :pos[s]], b[:, :, :pos[s]])
    with pytest.raises((ValueError, RuntimeError)):
        pooled.decode_seqs(torch.tensor([5]), [1], [40])  # slot 1 holds positions [0, 40)
    with pytest.raises(ValueError, match="of a 200-position pool"):
        pooled.place_slot(0, 150, 60)
    with pytest.raises(ValueError, match="holds no 128-position sequence"):
        _small(100)


_RIG = dict(model="smollm2", stages=[{"device": "cpu", "threads": 1}] * 2, chunk=64, max_context=320,
            progress=False, max_seqs=4, prefix_reuse="chunks")
_PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):",
            "A long document. " + " ".join(f"Item {i} is number {i * 7 % 13}." for i in range(24))]


def _generate(rig: dict, out, together: bool, limits) -> tuple[list[list[int]], object]:
    from strata.serve.engine import PipelineEngine
    from strata.text.sampling import SamplingParams
    eng = PipelineEngine(rig, out=out)
    try:
        got: dict[int, list[int]] = {}

        def one(i: int) -> None:
            made: list[int] = []
            eng.generate(eng.tokenize(_PROMPTS[i]), SamplingParams(max_tokens=limits[i], temperature=0),
                         lambda t: made.append(t) or True)
            got[i] = made
        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(_PROMPTS))]
        for t in threads:
            t.start()
            if not together:
                t.join(300)
        for t in threads:
            t.join(300)
        return [got[i] for i in range(len(_PROMPTS))], (eng.slot_stats(), "\n".join(eng._slot_metrics()))
    finally:
        eng.close()


@pytest.mark.slow
@pytest.mark.parametrize("decode_weights,stages", [("auto", 2), ("none", 1)])
def test_a_pool_smaller_than_the_slots_serves_each_as_alone(tmp_path, decode_weights, stages):
    """max_seqs 4 and max_context 320 with a pool of 384 positions (the slots would take 1,280): 4 greedy requests at
    once, one of them a 4-chunk document, get each the ids it gets alone without a pool, on the C decoder (SmolLM2's
    blocks, 2 stages) and on torch's rows (1 stage). Their extents (64 a short one, 320 the document's) did not all
    fit at once: one waited, and the pool was never over-full."""
    from strata.weights.checkpoint import smollm2_path
    try:
        smollm2_path()
    except Exception as e:  # noqa: BLE001
        pytest.skip(str(e))
    rig = {**_RIG, "decode_weights": decode_weights, "stages": [{"device": "cpu", "threads": 1}] * stages}
    limits = [16, 16, 16, 40]
    alone, _ = _generate(rig, tmp_path / "alone", False, limits)
    pooled, (st, metrics) = _generate({**rig, "kv_pool": 384}, tmp_path / "pool", True, limits)
    assert pooled == alone and all(alone), (pooled, alone)
    assert st.pool_waits >= 1 and 64 < st.pool_most_used <= 384, st
    assert st.most_in_flight >= 2, st  # (still side by side: the short ones ran together)
    log = (tmp_path / "pool" / "stage-0.log").read_text()
    assert "one pool of 384 positions for their global layers" in log
    assert all(f"\nstrata_{m}\n" in f"\n{metrics}\n" for m in ("kv_pool_positions 384",
                                                            f"kv_pool_waits_total {st.pool_waits}")), metrics
    assert "\nstrata_kv_pool_positions_in_use " in metrics  # (0 once the last snapshot is answered)


def test_kv_pool_counts_in_the_plan_and_refusals(tmp_path):
    """The plan counts the pool's positions once for all slots (a stage's KV is a fifth of the 4 slots' 1,280 here),
    and the refusals are one line each, before any stage starts."""
    from strata.config import from_dict
    from strata.plan.plan import build_plan
    base = dict(model="synthetic:smoke", stages=[{"device": "cpu", "memory": 2 << 30}], max_context=320,
                prompt={"random": {"tokens": 8, "seed": 0}}, progress=False, max_seqs=4)
    slots = build_plan(from_dict(base)).planner["needs"][0]["kv_cache"]
    pooled = build_plan(from_dict({**base, "kv_pool": 384})).planner["needs"][0]["kv_cache"]
    assert pooled * 1280 == slots * 384, (pooled, slots)
    with pytest.raises(ConfigError, match=r"^kv_pool 300 holds no sequence of max_context 320 positions: give at least "
                                          r"320$"):
        build_plan(from_dict({**base, "kv_pool": 300}))
    with pytest.raises(ConfigError, match=r"^kv_pool: a pool shared by several sequences needs max_seqs > 1$"):
        from_dict({**base, "max_seqs": 1, "kv_pool": 400})
    with pytest.raises(ConfigError, match=r"^kv_pool: must be >= 0"):
        from_dict({**base, "kv_pool": -1})


def test_a_span_is_checked_on_the_wire():
    from strata.comm import messages as M
    chunk = dict(k=0, kind=M.Kind.CHUNK, pos=0, n=4, t0=0.0, tokens=9, score=-1, slot=1)
    M.encode(M.Chunk(**chunk, span=[64, 128]))
    for bad in ([1], [-1, 4], [1, 2, 3], ["a", 2]):
        with pytest.raises(M.BadMessage, match="span"):
            M.encode(M.Chunk(**chunk, span=bad))


@pytest.mark.slow
def test_a_document_restored_into_an_extent_answers_as_cold(tmp_path):
    """The prefix cache over a pool: a document's blocks snapshotted from one extent and restored into another (the
    pool's first gap is taken by a short request running beside it the second time) give the cold answer."""
    import inspect
    import typing
    from strata.weights.checkpoint import smollm2_path
    from strata.serve.engine import PipelineEngine
    from strata.text.sampling import SamplingParams
    try:
        smollm2_path()
    except Exception as e:  # noqa: BLE001
        pytest.skip(str(e))
    doc = inspect.getsource(typing)[:2600] + "\nQ: What does this code define?\nA:"
    rig = {**_RIG, "max_context": 1024, "kv_pool": 1280}
    eng = PipelineEngine(rig, out=tmp_path / "e")
    try:
        def ask(text: str, n: int, box: dict) -> None:
            made: list[int] = []
            eng.generate(eng.tokenize(text), SamplingParams(max_tokens=n, temperature=0), lambda t: made.append(t) or True)
            box[text] = made
        cold: dict = {}
        ask(doc, 12, cold)
        before = eng.slot_stats().restored_tokens
        warm: dict = {}
        short = threading.Thread(target=ask, args=(_PROMPTS[0], 40, warm))
        short.start()
        ask(doc, 12, warm)
        short.join(300)
        st = eng.slot_stats()
        assert st.restored_tokens - before >= 512, st  # its two full blocks of 256
        assert warm[doc] == cold[doc] and warm[_PROMPTS[0]]
    finally:
        eng.close()


def test_kv_pool_auto_takes_what_the_memory_leaves(tmp_path):
    """kv_pool auto: an uncapped stage's pool is the slots' own max_seqs x max_context; a capped one's, max_context
    plus nine tenths of what its cap leaves over a position's bytes, in steps of 64, and the stage still fits."""
    from strata.config import from_dict
    from strata.plan.plan import build_plan
    base = dict(model="synthetic:smoke", stages=[{"device": "cpu", "memory": 2 << 30}], max_context=320,
                prompt={"random": {"tokens": 8, "seed": 0}}, progress=False, max_seqs=4)
    assert build_plan(from_dict({**base, "kv_pool": "auto"})).kv_pool == 1280
    one = build_plan(from_dict({**base, "kv_pool": 320})).planner["needs"][0]
    two = build_plan(from_dict({**base, "kv_pool": 384})).planner["needs"][0]
    per = (two["kv_cache"] - one["kv_cache"]) / 64  # a position's bytes in the stage's layers
    cap = one["total"] + int(500 * per)
    plan = build_plan(from_dict({**base, "kv_pool": "auto", "stages": [{"device": "cpu", "memory": cap}]}))
    want = 320 + int(500 * per * 9 // 10 // per)
    assert plan.kv_pool == want // 64 * 64 == 768, (plan.kv_pool, want)
    assert plan.planner["needs"][0]["total"] <= cap
    with pytest.raises(ConfigError, match="^kv_pool: expected 'auto' or a number of positions"):
        from_dict({**base, "kv_pool": "lots"})


@pytest.mark.slow
def test_a_kv_file_loads_into_an_extent(tmp_path):
    """With a pool the engine's kv_load reads a KV file into an extent of the file's length, then its blocks into
    the prefix cache: a prompt that begins with its ids restores them and gets a max_seqs 1 pipeline's ids."""
    import inspect
    import typing

    import numpy as np
    from strata.weights.checkpoint import smollm2_path
    from strata.serve.engine import PipelineEngine
    from strata.head.pipeline import Pipeline
    from strata.text.sampling import SamplingParams
    try:
        smollm2_path()
    except Exception as e:  # noqa: BLE001
        pytest.skip(str(e))
    rig = {**_RIG, "max_context": 1024, "decode_weights": "none"}
    greedy = SamplingParams(max_tokens=8, temperature=0)
    with Pipeline({**rig, "max_seqs": 1}, out=tmp_path / "one", console=False) as p:
        doc = p.prompt_ids(inspect.getsource(typing)[40000:42600])
        prompt = np.concatenate([doc, p.prompt_ids("\nQ: What does this code define?\nA:")])
        assert 512 < doc.size < 768
        p.prefill(doc)
        p.kv_save(tmp_path / "doc.kv")
        want = p.generate(prompt, greedy).continuation_ids
    eng = PipelineEngine({**rig, "kv_pool": 1088}, out=tmp_path / "pool")
    try:
        got = eng.kv_load(tmp_path / "doc.kv")
        assert got["tokens"] == doc.size
        made: list[int] = []
        eng.generate(prompt, greedy, made.append)
        assert made == want and want
        assert eng.slot_stats().restored_tokens == 512  # the file's two whole blocks
    finally:
        eng.close()


def test_a_refusal_for_many_sequences_suggests_a_pool(tmp_path):
    """16 sequences of 32,768 positions that the stage's memory cannot hold as slots: the refusal names kv_pool
    auto, and with it the plan fits, its pool between one max_context and the slots' 16."""
    from strata.config import from_dict
    from strata.plan.plan import build_plan
    base = dict(model="synthetic:smoke", stages=[{"device": "cpu", "memory": 600 << 20}], max_context=32768,
                prompt={"random": {"tokens": 8, "seed": 0}}, progress=False, max_seqs=16)
    with pytest.raises(ConfigError, match=r"; would fit: kv_pool auto \(the sequences' KV in one pool"):
        build_plan(from_dict(base))
    plan = build_plan(from_dict({**base, "kv_pool": "auto"}))
    assert 32768 <= plan.kv_pool < 16 * 32768 and plan.planner["needs"][0]["total"] <= 600 << 20
