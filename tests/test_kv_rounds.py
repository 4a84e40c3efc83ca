"""KvRounds without stages or a Pipeline: the head's prefix-cache decisions seen as the KvOp notes it sends through
its link, the stages' answers played by the test (strata/head/kv_rounds.py is handed send and wait, nothing else)."""
from types import SimpleNamespace

import numpy as np
import pytest

from strata.comm import messages as M
from strata.config import from_dict
from strata.head.kv_rounds import KvLink, KvRounds
from strata.plan.plan import build_plan
from strata.kvcache.prefix_cache import block_keys

STAGES = [{"device": "cpu", "threads": 1}, {"device": "cpu", "threads": 1}]


class FakeStages:
    """The link's far end: notes kept as sent; a wait answers the unanswered ones in order through on_done until the
    condition holds (`errors`: stage -> the error its answers carry)."""

    def __init__(self):
        self.sent: list[tuple[int, M.KvOp]] = []
        self.unanswered: list[tuple[int, M.KvOp]] = []
        self.errors: dict[int, str] = {}
        self.kv: KvRounds | None = None

    def send(self, i: int, msg: M.KvOp) -> None:
        self.sent.append((i, msg))
        self.unanswered.append((i, msg))

    def wait(self, condition) -> None:
        while not condition():
            assert self.unanswered, "a wait that no answer can end"
            i, msg = self.unanswered.pop(0)
            self.kv.on_done(M.KvDone(stage=i, op=msg.op, error=self.errors.get(i, ""), held_bytes=0), None)

    def ops(self, op: str) -> list[M.KvOp]:
        return [m for _, m in self.sent if m.op == op]


@pytest.fixture(scope="module")
def rig():
    cfg = from_dict(dict(model="synthetic:smoke", stages=STAGES, chunk=256, max_context=1024, progress=False,
                         prefix_cache_bytes=1 << 26, prompt={"random": {"tokens": 10, "seed": 0}}))
    plan = build_plan(cfg)
    return plan.cfg, plan  # (the plan's rig: max_seqs auto resolved, as Pipeline takes it)


def make(rig, spans=None) -> tuple[KvRounds, FakeStages]:
    cfg, plan = rig
    stages = [SimpleNamespace(index=s.index, device=s.device, layers=(s.start, s.end), host=None, kv_bytes=0,
                              state_bytes=0) for s in plan.stages]
    far = FakeStages()
    kv = KvRounds(cfg, plan, stages, spans or {}, KvLink(send=far.send, wait=far.wait, who=lambda i: f"stage {i}",
                                                         failed=lambda: False))
    far.kv = kv
    kv.start()
    assert kv.prefix_cache_off is None
    return kv, far


def prompts(n: int = 3 * 256 + 10):
    rng = np.random.default_rng(7)
    a = rng.integers(0, 1000, n).astype(np.int32)
    b = a.copy()
    b[600:] = rng.integers(0, 1000, n - 600)  # shares a's blocks 0 and 1, not block 2
    return a, b


def test_a_snapshot_then_a_restore_are_notes_to_every_stage(rig):
    kv, far = make(rig)
    a, b = prompts()
    keys = block_keys(a)
    kv.snapshot(a)
    snaps = far.ops("snap")
    assert [m.blocks for m in snaps] == [[0, 1, 2, 3]] * 2  # 3 full blocks and (prefix_reuse rows) the partial one
    assert all(m.keys[:3] == keys for m in snaps)
    assert kv.restore(b, 0, b.size - 1) == 512 and kv.restored == 512
    restores = far.ops("restore")
    assert [(m.keys, m.blocks) for m in restores] == [(keys[:2], [0, 1])] * 2
    assert not kv.in_flight and kv.answers == 4
    stats = kv.stats()
    assert (stats.lookups, stats.hits, stats.blocks) == (1, 1, 4)
    # the live KV already holds more than the cache would restore: nothing is sent
    assert kv.restore(b, 600, b.size - 1) == 600 and len(far.ops("restore")) == 2


def test_a_failed_restore_is_forgotten_everywhere_and_prefilled(rig):
    kv, far = make(rig)
    a, b = prompts()
    kv.snapshot(a)
    far.errors = {1: "block file gone"}
    assert kv.restore(b, 0, b.size - 1) == 0 and kv.restored == 0  # prefilled from the live KV's 0 instead
    dropped = far.ops("drop")
    assert dropped and set(block_keys(a)[:2]) <= set(dropped[0].keys)
    assert kv.stats().hits == 0  # the lookup's hit taken back
    far.errors = {}
    assert kv.restore(b, 0, b.size - 1) == 0 and len(far.ops("restore")) == 2  # the blocks are gone from the index


def test_answers_go_to_the_oldest_round_waiting_on_their_stage(rig):
    kv, far = make(rig, spans={1: (64, 512)})
    ids = np.arange(300, dtype=np.int32)
    r1 = kv.load_begin(1, "/nowhere.kv", ids, 4096, 8)
    r2 = kv.load_begin(1, "/nowhere.kv", ids, 4096, 8)
    assert [m.span for m in far.ops("load")] == [[64, 512]] * 4  # the slot's extent of the pools travels
    assert kv.in_flight == 2
    kv.on_done(M.KvDone(stage=1, op="load", error="", held_bytes=0), None)
    assert r1.waiting == {0} and r2.waiting == {0, 1}
    kv.on_done(M.KvDone(stage=0, op="load", error="short read", held_bytes=0), None)
    assert r1.complete and kv.errors(r1.done) == ["stage 0: short read"] and kv.in_flight == 1
    for i in (0, 1):
        kv.on_done(M.KvDone(stage=i, op="load", error="", held_bytes=0), None)
    assert r2.complete and not kv.in_flight
    with pytest.raises(M.BadMessage):
        kv.on_done(M.KvDone(stage=0, op="load", error="", held_bytes=0), None)  # no round waits on it
