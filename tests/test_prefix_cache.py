"""The prefix cache's parts without stages: block keys, the head's LRU index, a stage's snapshots, the KV file
format and its refusals, the notes."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from strata.kvcache import kv_file
from strata.kvcache import prefix_cache as pc
from strata.comm import messages as M
from strata.kvcache.prefix_cache import KEY_BYTES, PrefixIndex, Snapshots, block_keys, layer_caches, row_bytes, supported


def test_block_keys_name_the_whole_prefix():
    rng = np.random.default_rng(0)
    a = rng.integers(0, 1000, 1000).astype(np.int32)
    b = a.copy()
    b[300] += 1  # differs in block 1 (of 256)
    ka, kb = block_keys(a), block_keys(b)
    assert len(ka) == 3 and all(len(k) == KEY_BYTES for k in ka)  # 1000 // 256 full blocks; the tail has none
    assert ka[0] == kb[0] and ka[1] != kb[1] and ka[2] != kb[2]  # a key names everything before its block's end
    assert block_keys(a[:767]) == ka[:2] and block_keys(a[:255]) == []
    # the same block of ids after another prefix is another key
    c = np.concatenate([a[256:512], a[256:512]])
    assert block_keys(c)[1] != ka[1]
    assert block_keys(a, 64)[:4] != ka[:1]  # the block size is part of what a key means


def test_index_lru_evicts_the_deepest_blocks_of_the_oldest_prompt():
    idx = PrefixIndex(5)
    ka = [bytes([1, j]) * 8 for j in range(3)]
    kb = [bytes([2, j]) * 8 for j in range(3)]
    assert idx.add(ka) == ([0, 1, 2], [])
    assert idx.longest(ka) == 3 and idx.longest(kb) == 0
    new, evicted = idx.add(kb)
    assert new == [0, 1, 2] and evicted == [ka[2]]  # A's deepest block goes first, its head stays
    assert idx.longest(ka) == 2 and len(idx) == 5
    idx.touch(ka[:2])  # A used again: B is now the oldest
    new, evicted = idx.add([bytes([3, 0]) * 8])
    assert new == [0] and evicted == [kb[2]]
    assert idx.add(ka[:2]) == ([], [])  # held: nothing to copy
    # a prompt longer than the whole budget keeps its first blocks
    small = PrefixIndex(2)
    assert small.add(ka) == ([0, 1], []) and small.longest(ka) == 2
    small.discard([ka[0]])
    assert small.longest(ka) == 0


class _Attn:
    def __init__(self, shape, dtype):
        self.k_cache = torch.zeros(shape, dtype=dtype)
        self.v_cache = torch.zeros(shape, dtype=dtype)


def _model(dtype, last=16, rows=64, layers=3):
    return SimpleNamespace(layers={str(i): SimpleNamespace(attn=_Attn((1, 2, rows, last), dtype), linear=False)
                                   for i in range(layers)})


def _fill(model, seed):
    g = torch.Generator().manual_seed(seed)
    for c in layer_caches(model):
        c.view(torch.uint8).copy_(torch.randint(0, 256, c.view(torch.uint8).shape, generator=g, dtype=torch.uint8))


@pytest.mark.parametrize("dtype,last", [(torch.float32, 16), (torch.bfloat16, 16), (torch.uint8, 34),
                                        (torch.float8_e4m3fn, 16)], ids=["f32", "bf16", "packed-u8", "e4m3"])
def test_snapshots_restore_the_rows_byte_for_byte(dtype, last):
    m = _model(dtype, last)
    _fill(m, 1)
    before = [c.view(torch.uint8).clone() for c in layer_caches(m)]
    s = Snapshots(m, torch.device("cpu"))
    s.snap([b"a" * 16, b"b" * 16], [0, 2], 16)  # rows [0, 16) and [32, 48)
    assert s.nbytes == 2 * 16 * row_bytes(layer_caches(m))
    _fill(m, 2)
    s.restore([b"b" * 16], [2], 16)
    for c, b in zip(layer_caches(m), before):
        assert torch.equal(c.view(torch.uint8)[:, :, 32:48], b[:, :, 32:48])
        assert not torch.equal(c.view(torch.uint8)[:, :, 0:16], b[:, :, 0:16])
    s.restore([b"a" * 16], [0], 16)
    for c, b in zip(layer_caches(m), before):
        assert torch.equal(c.view(torch.uint8)[:, :, 0:16], b[:, :, 0:16])
    with pytest.raises(KeyError, match="no snapshot"):
        s.restore([b"c" * 16], [1], 16)
    s.drop([b"a" * 16])
    assert list(s.blocks) == [b"b" * 16]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_device_tier_keeps_the_last_blocks_and_restores_them_byte_for_byte(device):
    """A device tier of 2 blocks (prefix_cache_device_bytes): the blocks snapped or restored last are read from it
    (their host copies spoiled on purpose do not reach the cache), the least recently used go first, a block missed
    is copied in from the host, a drop or an unlink takes a block out of it, and it never holds more than its budget.
    On CPU the tier is host memory too (a stage never gets one there): its bookkeeping, and the rows' bytes."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    dev = torch.device(device)
    m = _model(torch.bfloat16, rows=64)
    for blk in m.layers.values():
        blk.attn.k_cache, blk.attn.v_cache = blk.attn.k_cache.to(dev), blk.attn.v_cache.to(dev)
    _fill(m, 1)
    want = [c.view(torch.uint8).cpu().clone() for c in layer_caches(m)]
    size = 16 * row_bytes(layer_caches(m))
    s = Snapshots(m, dev, 2 * size + size // 2)
    keys = [bytes([65 + j]) * 16 for j in range(4)]
    s.snap(keys[:3], [0, 1, 2], 16)
    if dev.type == "cuda":
        torch.cuda.synchronize()  # the copies out to the host are done before their bytes are spoiled below
    assert list(s.tier.lru) == keys[1:3] and s.tier.nbytes <= 2 * size + size // 2
    for k in keys[1:3]:
        s.blocks[k].zero_()  # held on the device: restores of these never read the host copy
    _fill(m, 2)
    s.restore([keys[2], keys[1]], [2, 1], 16)
    assert (s.tier.hits, s.tier.misses) == (2, 0)
    s.restore([keys[0]], [0], 16)  # from the host, into the tier: keys[2], the least recently used, goes
    assert (s.tier.hits, s.tier.misses) == (2, 1) and list(s.tier.lru) == [keys[1], keys[0]]
    if dev.type == "cuda":
        torch.cuda.synchronize()
    for c, w in zip(layer_caches(m), want):
        assert torch.equal(c.view(torch.uint8)[:, :, :48].cpu(), w[:, :, :48])
        assert not torch.equal(c.view(torch.uint8)[:, :, 48:].cpu(), w[:, :, 48:])  # block 3 was not restored
    s.drop([keys[1]])
    s.unlink([keys[0]])  # (no disk folder: its device copy goes all the same)
    assert not s.tier.lru and keys[1] not in s.blocks
    s.restore([keys[2]], [2], 16)  # out of the tier: its host copy, spoiled above, is what a restore reads now
    assert all(not c.view(torch.uint8)[:, :, 32:48].any() for c in layer_caches(m))
    small = Snapshots(m, dev, size - 1)  # a block larger than the budget: no device copy, the host's as before
    small.snap([keys[3]], [3], 16)
    assert not small.tier.lru and keys[3] in small.blocks


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_device_tier_restores_runs_of_blocks_out_of_row_order_byte_for_byte(device):
    """A tier of 8 blocks in 4 segments, its rows given out of order (blocks dropped, then snapped again in another
    order), caches that are views into a larger tensor (a pool's extent) of two dtypes: a document's blocks
    restored in one call, in any order and at other positions, are its rows byte for byte, wherever each sat."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    dev = torch.device(device)
    rows = 128
    m = _model(torch.bfloat16, rows=rows)
    for i, blk in enumerate(m.layers.values()):
        pool_k = torch.zeros((1, 2, rows + 40, 16), dtype=torch.bfloat16, device=dev)
        pool_v = torch.zeros((1, 2, rows + 40, 34), dtype=torch.uint8, device=dev)
        blk.attn.k_cache, blk.attn.v_cache = pool_k[:, :, 40:], pool_v[:, :, 40:]  # not contiguous: heads apart
    _fill(m, 1)
    want = [c.view(torch.uint8).cpu().clone() for c in layer_caches(m)]
    size = 16 * row_bytes(layer_caches(m))
    s = Snapshots(m, dev, 8 * size)
    keys = [bytes([65 + j]) * 16 for j in range(8)]
    s.snap(keys[:6], list(range(6)), 16)
    assert [t.shape[0] for t in s.tier.segs] == [2, 2, 2]
    s.drop([keys[1], keys[4]])
    s.snap([keys[4], keys[1]], [4, 1], 16)  # keys[4] takes block 1's old row, keys[1] block 4's
    s.drop([keys[2], keys[3]])
    s.snap([keys[3], keys[2]], [3, 2], 16)  # blocks 2, 3 into one segment's rows 1, 0: an index_copy_
    assert [s.tier.lru[k] for k in keys[:6]] == [(0, 0), (2, 0), (1, 1), (1, 0), (0, 1), (2, 1)]
    if dev.type == "cuda":
        torch.cuda.synchronize()
    for k in keys[:6]:
        s.blocks[k].zero_()  # every block held on the device: the host copies are never read
    _fill(m, 2)
    s.restore([keys[j] for j in (5, 0, 3, 1, 4, 2)], [5, 0, 3, 1, 4, 2], 16)
    assert (s.tier.hits, s.tier.misses) == (6, 0)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    for c, w in zip(layer_caches(m), want):
        assert torch.equal(c.view(torch.uint8)[:, :, :96].cpu(), w[:, :, :96])
    s.restore([keys[4], keys[0]], [6, 7], 16)  # into other positions (j says where); rows 1, 0: an index_select
    if dev.type == "cuda":
        torch.cuda.synchronize()
    for c, w in zip(layer_caches(m), want):
        u = c.view(torch.uint8).cpu()
        assert torch.equal(u[:, :, 96:112], w[:, :, 64:80]) and torch.equal(u[:, :, 112:128], w[:, :, :16])


def test_device_tier_shrinks_when_the_device_has_no_room(monkeypatch):
    """An allocation of the device tier that fails (less room than the plan counted) shrinks the tier to what it
    holds; the snapshot and its restore go through the host as without a tier."""
    m = _model(torch.bfloat16, rows=64)
    _fill(m, 1)
    want = [c.view(torch.uint8).clone() for c in layer_caches(m)]
    size = 16 * row_bytes(layer_caches(m))
    s = Snapshots(m, torch.device("cpu"), 4 * size)
    s.snap([b"a" * 16], [0], 16)
    empty = torch.empty

    def full(*a, **k):
        if "device" in k:
            raise torch.OutOfMemoryError("no room")
        return empty(*a, **k)
    monkeypatch.setattr(torch, "empty", full)
    s.snap([b"b" * 16], [1], 16)
    monkeypatch.setattr(torch, "empty", empty)
    assert s.tier.shrunk and s.tier.budget == size and list(s.tier.lru) == [b"a" * 16]
    _fill(m, 2)
    s.restore([b"b" * 16, b"a" * 16], [1, 0], 16)
    assert (s.tier.hits, s.tier.misses) == (1, 1)
    for c, w in zip(layer_caches(m), want):
        assert torch.equal(c.view(torch.uint8)[:, :, :32], w[:, :, :32])


def test_snapshots_of_a_slot_leave_the_slot_in_use_alone():
    """max_seqs > 1: a snapshot of slot 1 restored into slot 2 reads and writes those slots' tensors, not the caches
    the layers point at (the stage may be mid-way through another slot's micro-batch)."""
    m = _model(torch.bfloat16, layers=2)
    slots = [{i: (torch.zeros(1, 2, 64, 16, dtype=torch.bfloat16), torch.zeros(1, 2, 64, 16, dtype=torch.bfloat16))
              for i in m.layers} for _ in range(3)]
    for i, blk in m.layers.items():
        blk.attn.k_cache, blk.attn.v_cache = slots[0][i]  # slot 0 in use
    m._slots = slots
    for slot in (0, 1):
        _fill(SimpleNamespace(layers={i: SimpleNamespace(attn=SimpleNamespace(k_cache=k, v_cache=v), linear=False)
                                      for i, (k, v) in slots[slot].items()}), 10 + slot)
    in_use = [c.view(torch.uint8).clone() for c in layer_caches(m)]
    s = Snapshots(m, torch.device("cpu"))
    s.snap([b"a" * 16], [1], 16, slot=1)
    s.restore([b"a" * 16], [1], 16, slot=2)
    for got, want in zip(layer_caches(m, 2), layer_caches(m, 1)):
        got, want = got.view(torch.uint8), want.view(torch.uint8)
        assert torch.equal(got[:, :, 16:32], want[:, :, 16:32]) and not got[:, :, :16].any()
    # slot 0 untouched, and still the one the layers point at
    assert all(torch.equal(a.view(torch.uint8), b) for a, b in zip(layer_caches(m), in_use))
    assert all(c is slots[0][i][j] for c, (i, j) in zip(layer_caches(m), [(i, j) for i in m.layers for j in (0, 1)]))
    with pytest.raises(ValueError, match="slot 3 outside the 3"):
        s.snap([b"b" * 16], [0], 16, slot=3)


def test_supported_refuses_kv_files_of_window_and_linear_layers():
    from strata.weights.checkpoint import model_args
    assert supported(model_args("synthetic:smoke")) is None
    g27 = model_args("synthetic:gemma-3-27b")  # its window layers' rows kept at boundaries beside the blocks
    assert supported(g27) is None and "window layer's ring" in supported(g27, files=True)
    q35 = model_args("synthetic:qwen3.5-27b")  # its states likewise
    assert supported(q35) is None and "not linear-attention layers' states" in supported(q35, files=True)


FP = {"model": "gguf m.gguf:10:abc", "shape": "s", "n_layers": 3, "dtype": "float32", "kv_dtype": "bfloat16",
      "max_context": 64}


def _saved(tmp_path, model, ids):
    lrb = row_bytes(layer_caches(model)) // 3
    path = tmp_path / "a.kv"
    data_at = kv_file.create(path, FP, ids, lrb, [[0, 3]])
    kv_file.write_rows(str(path), data_at, ids.size, layer_caches(model))
    return path, lrb


def test_kv_file_round_trip_and_per_layer_offsets(tmp_path):
    m = _model(torch.bfloat16)
    _fill(m, 3)
    ids = np.arange(40, dtype=np.int32)
    path, lrb = _saved(tmp_path, m, ids)
    h, got_ids, data_at = kv_file.read_header(path)
    assert np.array_equal(got_ids, ids) and h["tokens"] == 40 and data_at % kv_file.ALIGN == 0
    kv_file.check(path, h, FP, lrb, 64, 100, got_ids)
    # two "stages" (layers [0, 1) and [1, 3)) read their own ranges at the head's offsets
    fresh = _model(torch.bfloat16)
    caches = layer_caches(fresh)
    kv_file.read_rows(str(path), data_at, 40, caches[:2])
    kv_file.read_rows(str(path), data_at + 40 * lrb * 1, 40, caches[2:])
    for a, b in zip(layer_caches(m), caches):
        assert torch.equal(a.view(torch.uint8)[:, :, :40], b.view(torch.uint8)[:, :, :40])
        assert not b.view(torch.uint8)[:, :, 40:].any()


@pytest.mark.parametrize("change,msg", [
    ({"kv_dtype": "float32"}, "was saved with kv_dtype 'bfloat16', this rig has 'float32'"),
    ({"model": "gguf other.gguf:1:x"}, "was saved with model 'gguf m.gguf:10:abc', this rig has 'gguf other.gguf:1:x'"),
    ({"max_context": 128}, "was saved with max_context 64, this rig has 128"),
    ({"dtype": "bfloat16"}, "was saved with dtype 'float32', this rig has 'bfloat16'"),
])
def test_kv_file_mismatch_refused_in_one_line(tmp_path, change, msg):
    m = _model(torch.bfloat16)
    path, lrb = _saved(tmp_path, m, np.arange(10, dtype=np.int32))
    h, ids, _ = kv_file.read_header(path)
    with pytest.raises(kv_file.KvFileError) as e:
        kv_file.check(path, h, {**FP, **change}, lrb, 128, 100, ids)
    assert str(e.value) == f"kv_load: {path} {msg}" and "\n" not in str(e.value)


def test_kv_file_garbage_and_truncation_refused(tmp_path):
    m = _model(torch.float32)
    path, _ = _saved(tmp_path, m, np.arange(10, dtype=np.int32))
    raw = path.read_bytes()
    (tmp_path / "short.kv").write_bytes(raw[:-5])
    with pytest.raises(kv_file.KvFileError, match=r"short.kv holds \d+ bytes, its header says \d+ \(truncated\?\)"):
        kv_file.read_header(tmp_path / "short.kv")
    (tmp_path / "pickle.kv").write_bytes(b"\x80\x04\x95" + raw[3:])
    with pytest.raises(kv_file.KvFileError, match="is not a Strata KV file"):
        kv_file.read_header(tmp_path / "pickle.kv")
    (tmp_path / "bad.kv").write_bytes(raw[:16] + b"{not json" + raw[25:])
    with pytest.raises(kv_file.KvFileError, match="the header is not JSON"):
        kv_file.read_header(tmp_path / "bad.kv")
    with pytest.raises(kv_file.KvFileError, match="cannot read"):
        kv_file.read_header(tmp_path / "missing.kv")
    with pytest.raises(kv_file.KvFileError, match="kv_save: cannot write"):
        kv_file.create(tmp_path / "no" / "dir.kv", FP, np.arange(3, dtype=np.int32), 8, [[0, 3]])


def test_kv_notes_validated():
    op = M.KvOp(op="snap", keys=[b"k" * 16], blocks=[3], block=256, path="", offset=0, tokens=0, slot=2)
    assert M.decode(M.encode(op)) == op
    done = M.KvDone(stage=1, op="load", error="", held_bytes=5)
    assert M.decode(M.encode(done)) == done
    for bad, why in ((dict(op="exec"), "unknown op"), (dict(keys=[b"short"]), "16 bytes"),
                     (dict(blocks=[-1]), "bad block"), (dict(blocks=[]), "one block index a key"),
                     (dict(offset=-1), "negative"), (dict(slot=-1), "negative offset, tokens or slot")):
        m = {**M.as_map(op), **bad}
        with pytest.raises(M.BadMessage, match=why):
            M.validate(m)


def test_tails_are_found_by_their_shared_ids_and_evicted_with_the_lru():
    """A prompt's last, partial block is held under the key of the full blocks before it; a later prompt finds the
    tail sharing the most leading ids with its own (rows are causal: its first c rows serve), and eviction forgets
    it."""
    idx = pc.PrefixIndex(3)
    ids = np.arange(700, dtype=np.int32)
    keys = pc.block_keys(ids, 256)
    assert idx.add(keys) == ([0, 1], [])
    key, evicted = idx.add_tail(keys[1], ids[512:])
    assert key is not None and evicted == [] and len(idx) == 3
    assert idx.add_tail(keys[1], ids[512:]) == (None, [])  # held already: nothing to snapshot
    other = ids.copy()
    other[600:] += 1000
    assert idx.best_tail(keys[1], other[512:699]) == (key, 88)   # shares ids 512..599
    assert idx.best_tail(keys[1], ids[512:699]) == (key, 187)    # the whole of it a prompt's cap allows
    assert idx.best_tail(keys[0], ids[256:699]) == (None, 0)     # not under another prefix
    key2, evicted = idx.add_tail(keys[1], other[512:])           # a fourth block: the LRU one goes
    assert key2 is not None and evicted == [keys[1]]            # (block 0 was touched last of the chain)
    idx.discard([key])
    assert idx.best_tail(keys[1], ids[512:699]) == (key2, 88) and len(idx) == 2


@pytest.mark.slow
def test_prefix_reuse_rows_restores_every_shared_row(tmp_path):
    """prefix_reuse rows (the default), SmolLM2 on 2 CPU stages: a document asked again after another restores every
    row but the last (its whole blocks, then its last, partial block); the same document with another question
    restores up to where the questions part; a KV file loaded by a new pipeline serves every row but the last. Each
    first token's logits are within float32 rounding of the cold prefill's (the rest runs in other chunks)."""
    import inspect
    import typing
    from strata.weights.checkpoint import smollm2_path
    from strata.head.pipeline import Pipeline
    from strata.text.sampling import SamplingParams
    try:
        smollm2_path()
    except Exception as e:  # noqa: BLE001
        pytest.skip(str(e))
    rig = dict(model="smollm2", stages=[{"device": "cpu", "threads": 1}] * 2, chunk=256, max_context=1024,
               progress=False)
    src = inspect.getsource(typing)
    one = SamplingParams(max_tokens=1)

    def close(x, y):
        return float(np.abs(x - y).max() / np.abs(y).max()) < 1e-4

    with Pipeline(rig, out=tmp_path / "a", console=False) as p:
        a = p.prompt_ids(src[:2600] + "\nQ: What does this code define?\nA:")
        a2 = p.prompt_ids(src[:2600] + "\nQ: Which names does it export?\nA:")
        b = p.prompt_ids(src[20000:22600] + "\nQ: What does this code define?\nA:")
        cold = p.generate(a, one)
        p.generate(b, one)
        again = p.generate(a, one)
        assert cold.reused_tokens == 0 and again.reused_tokens == a.size - 1 and a.size % 256
        assert close(again.last_logits, cold.last_logits) and again.continuation_ids == cold.continuation_ids
        p.generate(b, one)
        shared = pc.common_length(a, a2)
        assert 512 < shared < a2.size - 1 and shared % 256
        assert p.generate(a2, one).reused_tokens == shared
        p.generate(a, one)
        p.kv_save(tmp_path / "a.kv")
    with Pipeline(rig, out=tmp_path / "b", console=False) as q:
        q.kv_load(tmp_path / "a.kv")
        loaded = q.generate(a, one)
        assert loaded.reused_tokens == a.size - 1 and close(loaded.last_logits, cold.last_logits)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_5", "gemma3", "gpt_oss"])
def test_a_hybrid_model_restores_its_states_at_a_block_boundary(tmp_path, family):
    """A tiny Qwen3.5 (Gated DeltaNet layers beside full attention), Gemma 3 and gpt-oss (window layers, a ring of
    window + chunk - 1 rows, beside global ones) on 2 CPU stages: a prompt's prefill keeps those layers' states (a
    window layer's last window - 1 rows) at the block boundaries its chunks end on; after another prompt, the same document with
    another question restores its attention rows and those states up to the last boundary inside the document, and
    prefills only the rest, with the cold prefill's ids and logits (a chunk boundary of the cold schedule). Through
    Pipeline (max_seqs 1) and through the slot driver (max_seqs 2). Blocks whose states are gone are not restored;
    with chunks that end off the block boundaries, the prompt's chunk is cut at its last one."""
    from families_fixtures import make_hf
    from strata.serve.engine import PipelineEngine
    from strata.head.pipeline import Pipeline
    from strata.text.sampling import SamplingParams
    _, d = make_hf(tmp_path, family)
    rng = np.random.default_rng(4)
    doc, other = rng.integers(0, 200, 600), rng.integers(0, 200, 700)
    a, a2 = (np.concatenate([doc, rng.integers(0, 200, n)]) for n in (200, 30))  # a's question crosses 768
    rig = dict(model=d, stages=[{"device": "cpu", "threads": 1}] * 2, chunk=64, max_context=1024, progress=False,
               prompt={"random": {"tokens": 8, "seed": 0}})
    six = SamplingParams(max_tokens=6)
    with Pipeline({**rig, "prefix_cache_bytes": 0}, out=tmp_path / "cold", console=False) as p:
        cold = p.generate(a2, six)
    with Pipeline(rig, out=tmp_path / "p", console=False) as p:
        first = p.generate(a, six)
        assert p.kv.prefix_cache_off is None and p.kv._states.capacity >= 2
        assert first.reused_tokens == 0 and len(p.kv._states) == 3  # kept at 256, 512, 768 (chunk ends)
        p.generate(other, six)  # the live KV now holds another prompt
        again = p.generate(a2, six)
        assert again.reused_tokens == 512 and again.continuation_ids == cold.continuation_ids
        assert np.array_equal(again.last_logits, cold.last_logits)
        p.kv._states.discard(list(p.kv._states.lru))  # states forgotten: the blocks alone are not a restore point
        p.generate(other, six)
        assert p.generate(a2, six).reused_tokens == 0
    with Pipeline({**rig, "chunk": 100}, out=tmp_path / "cut", console=False) as p:
        p.start()  # chunks of 100 end on no block boundary: the chunk over 768 is cut there, and keeps the states
        sched = p.kv.keep_states(0, a, 0, p.plan.schedule_for(0, a.size))
        assert sched == [(q, 100) for q in range(0, 700, 100)] + [(700, 68), (768, 32)] and list(p.kv._keep[0]) == [768]
    for chunk, kept in ((100, []), (128, [256, 512, 768])):  # chunks: the cold schedule's boundaries, never cut
        with Pipeline({**rig, "chunk": chunk, "prefix_reuse": "chunks"}, out=tmp_path / f"c{chunk}",
                      console=False) as p:
            p.start()
            sch = p.plan.schedule_for(0, a.size)
            assert p.kv.keep_states(0, a, 0, sch) == list(sch) and sorted(p.kv._keep.get(0, {})) == kept, chunk
            p.kv._states.capacity = 2  # no more states copied out than the index holds: the last ones
            p.kv.keep_states(0, a, 0, sch)
            assert sorted(p.kv._keep.get(0, {})) == kept[-2:], chunk
    eng = PipelineEngine({**rig, "max_seqs": 2}, out=tmp_path / "eng")
    try:
        made = [[], [], []]
        for ids, out in zip((a, other, a2), made):
            eng.generate(ids.tolist(), SamplingParams(max_tokens=6, temperature=0), out.append)
        st = eng.slot_stats()
    finally:
        eng.close()
    assert made[2] == cold.continuation_ids and st.restores == 1 and st.restored_tokens == 512, st
