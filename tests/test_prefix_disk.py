"""The prefix cache's disk tier (kv_cache_dir): block files written through by each stage, read back once the host
copy is evicted, and found again by a later pipeline (other processes) of the same model and rig."""
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from strata.kvcache import prefix_cache as pc
from strata.weights.checkpoint import model_args
from strata.errors import ConfigError
from strata.head.pipeline import Pipeline
from test_prefix_cache import _fill, _model

STAGES = [{"device": "cpu", "threads": 1}, {"device": "cpu", "threads": 1}]


def test_snapshots_write_through_and_restore_from_the_file(tmp_path):
    """A snapped block's file holds its rows; dropped from the host, it is restored from the file byte for byte;
    a new Snapshots on the folder lists it (oldest first) and removes a half-written leftover; unlink removes it."""
    m = _model(torch.bfloat16, 16, rows=64)
    _fill(m, 1)
    before = [c.view(torch.uint8).clone() for c in pc.layer_caches(m)]
    s = pc.Snapshots(m, torch.device("cpu"))
    assert s.open(str(tmp_path / "st")) == ([], [])
    a, b = b"a" * 16, b"b" * 16
    s.snap([a], [0], 16)
    s.snap([b], [2], 16)
    s.flush()
    size = 16 * pc.row_bytes(pc.layer_caches(m))
    assert (tmp_path / "st" / a.hex()).stat().st_size == size and not s.unwritten
    s.drop([a, b])
    assert s.nbytes == 0
    _fill(m, 2)
    s.restore([b, a], [2, 0], 16)
    for c, old in zip(pc.layer_caches(m), before):
        assert torch.equal(c.view(torch.uint8)[:, :, 32:48], old[:, :, 32:48])
        assert torch.equal(c.view(torch.uint8)[:, :, 0:16], old[:, :, 0:16])
    (tmp_path / "st" / ("c" * 32 + ".part")).write_bytes(b"half")
    os.utime(tmp_path / "st" / a.hex(), ns=(1, 1))  # a: the older
    t = pc.Snapshots(m, torch.device("cpu"))
    assert t.open(str(tmp_path / "st")) == ([a, b], [])
    assert not list((tmp_path / "st").glob("*.part"))
    t.unlink([a])
    t.close()
    assert not (tmp_path / "st" / a.hex()).exists()
    with pytest.raises(KeyError, match="no snapshot"):
        t.restore([a], [0], 16)
    (tmp_path / "st" / b.hex()).write_bytes(b"short")
    with pytest.raises(ValueError, match="holds 5 bytes"):
        t.restore([b], [2], 16)



def test_a_slow_disk_slows_the_drops_instead_of_growing_host_memory(tmp_path):
    """Blocks dropped from the host tier while their writes are queued stay in memory until written: under
    orphan_limit bytes of them a drop returns at once; past it the drop waits for the writer, and every block
    still reaches its file."""
    m = _model(torch.bfloat16, 16, rows=64)
    _fill(m, 1)
    s = pc.Snapshots(m, torch.device("cpu"))
    s.open(str(tmp_path / "st"))
    size = 16 * pc.row_bytes(pc.layer_caches(m))
    s.orphan_limit = 2 * size
    gate, real = threading.Event(), s._file
    s._file = lambda key: gate.wait(30) and real(key)  # the disk stalls until the gate opens
    keys = [bytes([65 + i]) * 16 for i in range(4)]
    s.snap(keys, [0, 1, 2, 3], 16)
    s.drop(keys[:2])  # two queued blocks off the host: at the limit, not past it
    assert len(s.unwritten) == 4 and s.nbytes == 2 * size
    t = threading.Thread(target=s.drop, args=(keys[2:],))
    t.start()
    t.join(0.5)
    assert t.is_alive()  # four blocks' bytes would wait for the disk in host memory: the drop waits
    gate.set()
    t.join(30)
    assert not t.is_alive()
    s.flush()
    assert not s.unwritten and s.nbytes == 0
    assert all((tmp_path / "st" / k.hex()).stat().st_size == size for k in keys)


def test_tail_files_and_an_index_loaded_oldest_first(tmp_path):
    tf = pc.TailFiles(tmp_path / "tails")
    ids = np.arange(7, dtype=np.int32)
    tf.write(b"t" * 16, b"", ids)
    tf.write(b"u" * 16, b"k" * 16, ids[:3])
    got = tf.read()
    assert got[b"t" * 16][0] == b"" and np.array_equal(got[b"t" * 16][1], ids)
    assert got[b"u" * 16][0] == b"k" * 16 and np.array_equal(got[b"u" * 16][1], ids[:3])
    ix = pc.PrefixIndex(2)
    evicted = ix.load([b"k" * 16, b"t" * 16, b"u" * 16], got)
    assert evicted == [b"k" * 16] and ix.best_tail(b"", np.arange(5)) == (b"t" * 16, 5)
    tf.remove([b"t" * 16])
    assert list(tf.read()) == [b"u" * 16]


def _files(root: Path) -> dict[str, set[str]]:
    return {d.name: {f.name for f in d.iterdir() if f.is_file()} for d in root.glob("rig-*/layers-*")}


@pytest.mark.slow
def test_a_later_pipeline_restores_from_disk_with_the_cold_bits(tmp_path):
    """synthetic:smoke on 2 CPU stages, prefix_reuse chunks (restored rows give a cold prefill's bits), host room
    for 3 blocks and kv_cache_dir: A, B, A restores A's evicted blocks from their files; a new pipeline (new stage
    processes) restores B and A from disk alone, logits equal to the cold ones; a block file gone from one stage is
    not used (the blocks after it are prefilled); kv_cache_dir_bytes cuts the oldest files at start."""
    args = model_args("synthetic:smoke")
    per_block = 256 * 4 * 2 * args.n_kv_heads * args.head_dim * 4  # a stage's 4 layers' k and v rows, float32
    kv = tmp_path / "kv"
    cfg = dict(model="synthetic:smoke", stages=STAGES, layer_split=[4, 4], chunk=256, max_context=1024,
               prefix_reuse="chunks", progress=False, prefix_cache_bytes=3 * per_block + per_block // 2,
               kv_cache_dir=str(kv), prompt={"random": {"tokens": 10, "seed": 0}})
    rng = np.random.default_rng(5)
    a, b = (rng.integers(0, args.vocab_size, 3 * 256 + 10).astype(np.int32) for _ in range(2))
    with Pipeline(cfg, out=tmp_path / "one", console=False) as p:
        cold_a = p.prefill(a)
        cold_b = p.prefill(b)  # the host holds B's 3 blocks now, A's only on disk
        again = p.prefill(a)
        assert cold_a.reused_tokens == 0 and again.reused_tokens == 768
        assert np.array_equal(again.last_logits, cold_a.last_logits)
        st = p.prefix_cache_stats()
        assert (st.blocks, st.disk_blocks) == (3, 6)
    files = _files(kv)
    assert sorted(files) == ["layers-0-4-cpu", "layers-4-8-cpu"]
    assert all(len(f) == 6 and not [n for n in f if n.endswith(".part")] for f in files.values()), files
    with Pipeline(cfg, out=tmp_path / "two", console=False) as q:
        q.start()
        assert q.prefix_cache_stats().disk_blocks == 6
        for ids, cold in ((b, cold_b), (a, cold_a)):
            r = q.prefill(ids)
            assert r.reused_tokens == 768 and np.array_equal(r.last_logits, cold.last_logits)
    # A's second block gone from stage 1: a new pipeline drops A's blocks 1 and 2... from the index (block 2
    # hangs after it), removes stage 0's copy of block 1, and restores block 0 alone
    ka = pc.block_keys(a)
    (next(kv.glob("rig-*/layers-4-8-cpu")) / ka[1].hex()).unlink()
    with Pipeline(cfg, out=tmp_path / "three", console=False) as r3:
        r3.start()
        assert r3.prefix_cache_stats().disk_blocks == 5
    # the stray file went, by stage 0's writer thread (which the stage's end waits for)
    assert not (next(kv.glob("rig-*/layers-0-4-cpu")) / ka[1].hex()).exists()
    with Pipeline(cfg, out=tmp_path / "three-b", console=False) as r3:
        r = r3.prefill(a)
        assert r.reused_tokens == 256 and np.array_equal(r.last_logits, cold_a.last_logits)
    # the budget, at start: 2 blocks a stage keep the 2 newest files
    with Pipeline(dict(cfg, kv_cache_dir_bytes=2 * per_block), out=tmp_path / "four", console=False) as r4:
        r4.start()
        assert r4.prefix_cache_stats().disk_blocks == 2
    assert all(len(f) == 2 for f in _files(kv).values())


def test_kv_cache_dir_bad_input_in_one_line(tmp_path):
    base = dict(model="synthetic:smoke", stages=STAGES, progress=False, prompt={"random": {"tokens": 10, "seed": 0}})
    with pytest.raises(ConfigError, match="prefix_cache_bytes is 0"):
        Pipeline(dict(base, kv_cache_dir=str(tmp_path / "kv"), prefix_cache_bytes=0), out=tmp_path / "o",
                 console=False)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="kv_cache_dir: cannot make"):
        Pipeline(dict(base, kv_cache_dir=str(tmp_path / "file" / "kv")), out=tmp_path / "p", console=False)


@pytest.mark.slow
def test_a_restarted_engine_with_several_slots_restores_from_disk(tmp_path):
    """max_seqs 2 (the slot driver's restore and snapshot rounds): two prompts through one engine, then a new
    engine on the same kv_cache_dir gives each the same greedy ids with every row but the last restored."""
    from strata.serve.engine import PipelineEngine
    from strata.text.sampling import SamplingParams
    args = model_args("synthetic:smoke")
    cfg = dict(model="synthetic:smoke", stages=STAGES, chunk=256, max_context=1024, progress=False, max_seqs=2,
               kv_cache_dir=str(tmp_path / "kv"), prompt={"random": {"tokens": 10, "seed": 0}})
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, args.vocab_size, n).tolist() for n in (600, 300)]
    got = []
    for run in range(2):
        eng = PipelineEngine(cfg, out=tmp_path / f"eng{run}")
        try:
            made = []
            for ids in prompts:
                made.append([])
                eng.generate(ids, SamplingParams(max_tokens=6, temperature=0), made[-1].append)
            got.append((made, eng.slot_stats()))
        finally:
            eng.close()
    (cold, st0), (again, st1) = got
    assert again == cold and all(cold)
    assert st0.restored_tokens == 0 and st1.restores == 2 and st1.restored_tokens == 599 + 299


@pytest.mark.slow
def test_prefix_cache_rounds_do_not_hold_up_the_other_sequences(tmp_path):
    """max_seqs 2: a prompt restored from the prefix cache (and snapshotted after) while another sequence decodes:
    the driver sends micro-batches while those KV rounds are out (it used to wait for every stage's answer), and
    the restored prompt's greedy ids are its cold ones."""
    import dataclasses
    import threading
    from strata.serve.engine import PipelineEngine
    from strata.text.sampling import SamplingParams
    args = model_args("synthetic:smoke")
    cfg = dict(model="synthetic:smoke", stages=STAGES, chunk=256, max_context=1024, progress=False, max_seqs=2,
               prompt={"random": {"tokens": 10, "seed": 0}})
    rng = np.random.default_rng(11)
    doc, other = (rng.integers(0, args.vocab_size, n).tolist() for n in (700, 40))
    eng = PipelineEngine(cfg, out=tmp_path / "eng")
    try:
        cold = []
        eng.generate(doc, SamplingParams(max_tokens=4, temperature=0), cold.append)
        before = dataclasses.replace(eng.slot_stats())  # (a copy: the driver's own object moves on)
        started, other_ids = threading.Event(), []

        def decode_other():
            eng.generate(other, SamplingParams(max_tokens=60, temperature=0),
                         lambda t: other_ids.append(t) or started.set())
        t = threading.Thread(target=decode_other)
        t.start()
        assert started.wait(120)
        again = []
        eng.generate(doc, SamplingParams(max_tokens=4, temperature=0), again.append)
        t.join(300)
        st = eng.slot_stats()
    finally:
        eng.close()
    assert again == cold and len(other_ids) == 60
    assert st.restores - before.restores == 1 and st.restored_tokens - before.restored_tokens == 699
    assert st.sends_during_kv > before.sends_during_kv, (before, st)


def test_a_restore_from_files_is_read_by_a_thread_and_answered_in_order(tmp_path):
    """workers/kv_ops.StageKv: a restore of blocks on disk alone starts a reader thread and returns (the stage's
    chunks go on); an op after it waits; once the files are read, both are answered in order and the rows are the
    files' bytes."""
    import logging
    import time
    from strata.comm import messages as M
    from workers.kv_ops import StageKv
    m = _model(torch.float32, 16, rows=64)
    m._slots = [{i: (b.attn.k_cache, b.attn.v_cache) for i, b in m.layers.items()}]  # one sequence: slot 0
    _fill(m, 1)
    before = [c.view(torch.uint8).clone() for c in pc.layer_caches(m)]
    answers = []
    kv = StageKv(m, torch.device("cpu"), 64, logging.getLogger("t"), answers.append, 0)
    key = b"k" * 16

    def op(name, **kw):
        return M.KvOp(**{**dict(op=name, keys=[], blocks=[], block=16, path="", offset=0, tokens=0), **kw})
    kv.submit(op("open", path=str(tmp_path / "st")))
    kv.submit(op("snap", keys=[key], blocks=[1]))
    kv.submit(op("drop", keys=[key]))  # host copy gone: only the file (once written)
    kv.snapshots.flush()
    assert [a.op for a in answers] == ["open", "snap", "drop"] and not kv.snapshots.unwritten
    assert not any(a.error for a in answers), answers
    _fill(m, 2)
    release = threading.Event()
    real = kv.snapshots.read_files
    kv.snapshots.read_files = lambda keys, size: (release.wait(30), real(keys, size))[1]
    kv.submit(op("restore", keys=[key], blocks=[1]))
    kv.submit(op("drop", keys=[key]))
    assert kv.waiting and [a.op for a in answers] == ["open", "snap", "drop"]  # both wait behind the read
    release.set()
    deadline = time.monotonic() + 30
    while kv.waiting and time.monotonic() < deadline:
        time.sleep(0.01)
        kv.advance()
    assert [a.op for a in answers][3:] == ["restore", "drop"] and not any(a.error for a in answers)
    for c, old in zip(pc.layer_caches(m), before):
        assert torch.equal(c.view(torch.uint8)[:, :, 16:32], old[:, :, 16:32])
    kv.close()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_5", "gemma3"])
def test_a_hybrid_models_states_outlive_the_server_on_disk(tmp_path, family):
    """A tiny Qwen3.5 (linear-attention layers) or Gemma 3 (window layers) with kv_cache_dir: the states its prefill
    kept are written beside its blocks (a `states` folder on every stage); a new pipeline on the same folder restores
    a document's global rows and those states from the files, up to the last boundary inside the document, with the
    cold prefill's ids and logits."""
    from families_fixtures import make_hf
    from strata.text.sampling import SamplingParams
    _, d = make_hf(tmp_path, family)
    rng = np.random.default_rng(4)
    doc = rng.integers(0, 200, 600)
    a, a2 = (np.concatenate([doc, rng.integers(0, 200, n)]) for n in (200, 30))
    rig = dict(model=d, stages=STAGES, chunk=64, max_context=1024, progress=False,
               prompt={"random": {"tokens": 8, "seed": 0}}, kv_cache_dir=str(tmp_path / "kv"))
    six = SamplingParams(max_tokens=6)
    with Pipeline({**rig, "prefix_cache_bytes": 0, "kv_cache_dir": None}, out=tmp_path / "cold",
                  console=False) as p:
        cold = p.generate(a2, six)
    with Pipeline(rig, out=tmp_path / "one", console=False) as p:
        assert p.generate(a, six).reused_tokens == 0
        assert len(p.kv._disk_states) == 3 and len(p.kv._disk) == 3
    files = sorted((tmp_path / "kv").glob("rig-*/layers-*/states/*"))
    assert len(files) == 2 * 3 and not list((tmp_path / "kv").glob("**/*.part"))  # 3 states on each stage
    with Pipeline(rig, out=tmp_path / "two", console=False) as p:
        again = p.generate(a2, six)
        assert len(p.kv._disk_states) == 3 and len(p.kv._states) == 0  # (restored from the files; a2 kept none past 512)
    assert again.reused_tokens == 512 and again.continuation_ids == cold.continuation_ids
    assert np.array_equal(again.last_logits, cold.last_logits)


def test_kept_states_count_in_held_bytes(tmp_path):
    """Snapshots.nbytes counts a kept state's bytes (as held: one flat buffer), beside the blocks."""
    m = _model(torch.bfloat16, 16, rows=64)
    s = pc.Snapshots(m, torch.device("cpu"))
    s.states[b"s" * 16] = torch.zeros(1 << 20, dtype=torch.uint8)
    s.snap([b"a" * 16], [0], 16)
    assert s.nbytes == (1 << 20) + 16 * pc.row_bytes(pc.layer_caches(m))
    s.unwritten[b"s" * 16] = s.states[b"s" * 16]  # queued for the disk and still held: no orphan
    assert s.orphan_bytes() == 0
    s.drop([b"s" * 16])
    assert s.orphan_bytes() == 1 << 20
