"""The prefix cache and KV files through running stages (2 CPU stages): alternating documents served from the
snapshots with a cold prefill's bits, the LRU budget, and a KV saved by one process and loaded by another."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from strata.weights.checkpoint import model_args
from strata.kvcache.kv_file import KvFileError
from strata.head.pipeline import Pipeline
from strata.text.sampling import SamplingParams
from strata.comm.shm import SHM_DIR

ROOT = Path(__file__).resolve().parents[1]
STAGES = [{"device": "cpu", "threads": 1}, {"device": "cpu", "threads": 1}]


@pytest.fixture(scope="module")
def docs():
    """Two documents of 768 tokens (3 blocks, 3 chunks of 256) and a question, as SmolLM2 ids."""
    pytest.importorskip("gguf")
    from strata.weights.checkpoint import smollm2_path
    try:
        smollm2_path()
    except Exception as e:  # noqa: BLE001
        pytest.skip(str(e))
    from strata.text.tokenizer import Tokenizer
    import inspect
    import typing
    tok = Tokenizer.for_model("smollm2")
    text = np.asarray(tok.encode(inspect.getsource(typing)), dtype=np.int32)
    q = np.asarray(tok.encode("\nQuestion: what does this module define?\nAnswer:"), dtype=np.int32)
    return text[:768], text[5000:5768], q


@pytest.mark.slow
def test_alternating_documents_come_from_the_cache_with_the_cold_bits(tmp_path, docs):
    a_doc, b_doc, q = docs
    a, b = np.concatenate([a_doc, q]), np.concatenate([b_doc, q])
    # prefix_reuse chunks: restores up to the cold chunks' boundary, the answers the cold bits (rows:
    # tests/test_prefix_cache.py)
    cfg = dict(model="smollm2", stages=STAGES, chunk=256, max_context=1024, progress=False, prefix_reuse="chunks")
    greedy = SamplingParams(max_tokens=6)
    with Pipeline(cfg, out=tmp_path / "o", console=False) as p:
        runs = [p.generate(ids, greedy) for ids in (a, b, a, b)]
        run_id = p.run_id
    first_a, first_b, again_a, again_b = runs
    assert first_a.reused_tokens == 0 and first_b.reused_tokens < 256  # cold (B shares at most a token with A)
    for again, first, doc in ((again_a, first_a, a_doc), (again_b, first_b, b_doc)):
        assert again.reused_tokens == doc.size == 768  # the whole document, from the snapshots
        assert again.report["prefix_cache"]["restored_tokens"] == 768 - (first_b.reused_tokens if doc is b_doc else 0)
        assert again.report["prefilled_tokens"] == q.size
        assert again.report["schedule"] == [[768, q.size]]  # the cold prefill's last chunk, as it was
        # the same bits as the cold prefill: the rows are its, and the rest is computed in its own chunks
        assert np.array_equal(again.last_logits, first.last_logits)
        assert again.continuation_ids == first.continuation_ids
    print(f"\ncold prefill {first_a.prefill_s:.2f} s / ttft {first_a.ttft_s:.2f} s; from the cache "
          f"{again_a.prefill_s:.2f} s / ttft {again_a.ttft_s:.2f} s")
    assert not [n for n in os.listdir(SHM_DIR) if run_id in n]


@pytest.mark.slow
def test_budget_evicts_least_recently_used_blocks(tmp_path):
    """synthetic:smoke, 4 layers a stage: a budget of 4 blocks holds one 3-block prompt and part of another; the
    oldest prompt's deepest blocks go first, and a stage never holds more than its budget."""
    args = model_args("synthetic:smoke")
    per_block = 256 * 4 * 2 * args.n_kv_heads * args.head_dim * 4  # a stage's 4 layers' k and v rows, float32
    cfg = dict(model="synthetic:smoke", stages=STAGES, layer_split=[4, 4], chunk=256, max_context=1024, prefix_reuse="chunks",
               progress=False, prefix_cache_bytes=4 * per_block + per_block // 2,
               prompt={"random": {"tokens": 10, "seed": 0}})
    rng = np.random.default_rng(5)
    a, b, c = (rng.integers(0, args.vocab_size, 3 * 256 + 10).astype(np.int32) for _ in range(3))
    with Pipeline(cfg, out=tmp_path / "o", console=False) as p:
        p.start()
        assert p.kv._index.capacity == 4
        p.prefill(a)   # A's 3 blocks
        p.prefill(b)   # B's 3: A's blocks 2 and 1 evicted
        assert p.prefill(a).reused_tokens == 256  # only A's first block is left
        # A was just used (its first block, and its blocks 1, 2 again): B's deepest blocks go now
        assert p.prefill(b).reused_tokens == 256
        r = p.prefill(c)
        assert r.reused_tokens == 0 and r.report["prefix_cache"]["blocks"] <= 4
        held = p.kv._round_all("drop")  # nothing dropped: each stage says what it holds
        assert all(d.held_bytes <= 4 * per_block for d in held.values()), held
        assert max(d.held_bytes for d in held.values()) == 4 * per_block
    off = dict(cfg, prefix_cache_bytes=0)
    with Pipeline(off, out=tmp_path / "off", console=False) as p:
        p.prefill(a)
        p.prefill(b)
        r = p.prefill(a)
        assert r.reused_tokens == 0 and r.report["prefix_cache"]["off"] == "prefix_cache_bytes is 0"


def test_block_capacity_does_not_shrink_with_slots(tmp_path):
    """The budget holds as many blocks with 3 sequences' caches on each stage as with one: a block is one position's
    rows in the stage's layers, not a slot-count share of its whole cache (it was a third of the blocks here)."""
    args = model_args("synthetic:smoke")
    per_block = 256 * 4 * 2 * args.n_kv_heads * args.head_dim * 4
    cfg = dict(model="synthetic:smoke", stages=STAGES, layer_split=[4, 4], chunk=256, max_context=1024, max_seqs=3,
               progress=False, prefix_cache_bytes=4 * per_block + per_block // 2,
               prompt={"random": {"tokens": 10, "seed": 0}})
    with Pipeline(cfg, out=tmp_path / "o", console=False) as p:
        p.start()
        assert p.kv._index.capacity == 4


def _launch(rig: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "launcher.py"), "--config", str(rig), "--out", str(out),
                           "--no-timeline", *extra], capture_output=True, text=True, timeout=300, cwd=ROOT)


@pytest.mark.slow
def test_kv_saved_by_one_process_loads_in_another(tmp_path, docs):
    a_doc, _, q = docs
    ids = tmp_path / "ids.txt"
    ids.write_text(" ".join(map(str, np.concatenate([a_doc, q]))))
    rig = tmp_path / "rig.yaml"
    rig.write_text(f"model: smollm2\nstages: [{{device: cpu, threads: 1}}, {{device: cpu, threads: 1}}]\nchunk: 256\n"
                   f"max_context: 1024\ngenerate: 8\nprogress: false\nprefix_reuse: chunks\nprompt: {{ids_file: {ids}}}\n")
    kv = tmp_path / "doc.kv"
    cold = _launch(rig, tmp_path / "cold", "--kv-save", str(kv))
    assert cold.returncode == 0, cold.stderr
    cold_rep = json.loads((tmp_path / "cold" / "report.json").read_text())
    n = cold_rep["tokens"]
    assert cold_rep["kv_save"]["tokens"] == n + 7 and kv.is_file()  # the prompt and the answer's fed tokens
    warm = _launch(rig, tmp_path / "warm", "--kv-load", str(kv))
    assert warm.returncode == 0, warm.stderr
    warm_rep = json.loads((tmp_path / "warm" / "report.json").read_text())
    assert warm_rep["kv_load"]["tokens"] == n + 7
    # the loaded rows up to the cold schedule's last chunk boundary: that chunk is computed as it was, same bits
    assert warm_rep["reused_tokens"] == 768 and warm_rep["prefilled_tokens"] == n - 768
    assert warm_rep["continuation_ids"] == cold_rep["continuation_ids"]
    print(f"\ncold ttft {cold_rep['ttft_s']:.2f} s; after kv_load ttft {warm_rep['ttft_s']:.3f} s "
          f"(load {warm_rep['kv_load']['seconds']:.3f} s, {kv.stat().st_size / 1e6:.1f} MB)")
    # another rig's KV: refused in one line before any stage starts
    bad = _launch(rig, tmp_path / "bad", "--kv-load", str(kv), "--set", "kv_dtype=bfloat16")
    assert bad.returncode == 2
    assert bad.stderr == (f"error: kv_load: {kv} was saved with kv_dtype 'float32', this rig has 'bfloat16'\n")
    assert not list((tmp_path / "bad").glob("stage-*.log"))  # no stage was started


def test_kv_file_refusals_through_the_api(tmp_path):
    cfg = dict(model="synthetic:smoke", stages=STAGES, chunk=64, max_context=256, progress=False, prefix_reuse="chunks",
               prompt={"random": {"tokens": 100, "seed": 1}})
    with Pipeline(cfg, out=tmp_path / "o", console=False) as p:
        with pytest.raises(KvFileError, match="^kv_save: nothing to save: no prompt has been prefilled"):
            p.kv_save(tmp_path / "x.kv")
        first = p.generate(None, SamplingParams(max_tokens=4))
        info = p.kv_save(tmp_path / "a.kv")
        assert info["tokens"] == 103
        p.prefill(np.arange(50, dtype=np.int32))  # something else in the live KV
        loaded = p.kv_load(tmp_path / "a.kv")
        assert loaded["tokens"] == 103 and loaded["ids"].size == 103
        again = p.generate(None, SamplingParams(max_tokens=4))
        assert again.reused_tokens == 64 and again.continuation_ids == first.continuation_ids  # chunk 64: [64, 100) again
        with pytest.raises(KvFileError, match=r"^kv_save: cannot write .*: "):
            p.kv_save(tmp_path / "no" / "such" / "dir.kv")
        assert not list(tmp_path.glob(".*.tmp"))
    other = dict(cfg, seed=1)  # other synthetic weights
    with Pipeline(other, out=tmp_path / "p", console=False) as p:
        with pytest.raises(KvFileError, match="was saved with model 'synthetic:smoke:seed=0', this rig has "
                                              "'synthetic:smoke:seed=1'"):
            p.kv_load(tmp_path / "a.kv")
        assert not p.started  # refused before any stage started


@pytest.mark.slow
def test_local_engine_kv_file_round_trip_and_from_a_pipeline(tmp_path):
    """The single-process engine writes and reads the same format: its own file in a fresh engine, and a
    pipeline's file of the same model and rig, give the cold engine's greedy tokens."""
    from strata.serve.engine import LocalEngine
    model = "synthetic:smoke"
    ids = list(np.random.default_rng(2).integers(0, model_args(model).vocab_size, 150))
    greedy = SamplingParams(max_tokens=6)

    def gen(eng, prompt):
        out = []
        stats = eng.generate(prompt, greedy, lambda t: out.append(t) or True)
        return out, stats
    cold = LocalEngine(model, max_context=256, prefill_chunk=64)
    want, _ = gen(cold, ids)
    cold.kv_save(tmp_path / "local.kv")
    warm = LocalEngine(model, max_context=256, prefill_chunk=64)
    assert warm.kv_load(tmp_path / "local.kv")["tokens"] == 155
    got, stats = gen(warm, ids)
    assert got == want and stats.reused_tokens == 128  # up to the cold chunks' last boundary
    with pytest.raises(KvFileError, match="was saved with max_context 256, this rig has 512"):
        LocalEngine(model, max_context=512).kv_load(tmp_path / "local.kv")
    cfg = dict(model=model, stages=STAGES, chunk=64, max_context=256, progress=False,
               prompt={"random": {"tokens": 10, "seed": 0}})
    with Pipeline(cfg, out=tmp_path / "o", console=False) as p:
        p.generate(np.asarray(ids, dtype=np.int32), greedy)
        p.kv_save(tmp_path / "pipe.kv")
    fresh = LocalEngine(model, max_context=256, prefill_chunk=64)
    fresh.kv_load(tmp_path / "pipe.kv")
    assert gen(fresh, ids)[0] == want
