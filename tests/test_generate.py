"""One running pipeline, many prompts: prefill of any prompt up to max_context, prefix reuse, and
generate (greedy, seeded sampling, stop strings) against fresh pipelines and the single-process engine."""
from __future__ import annotations

import numpy as np
import pytest

from strata.config import ConfigError
from strata.head.pipeline import Pipeline
from strata.text.sampling import SamplingParams

STAGES = [{"device": "cpu", "threads": 1}, {"device": "cpu", "threads": 1}]
DOC = ("The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is named "
       "after the engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889. ")


def smoke(tmp_path, name, **over):
    rig = dict(model="synthetic:smoke", stages=STAGES, chunk=64, progress=False, dump_residual=True,
               prompt={"random": {"tokens": 8, "seed": 0}})
    rig.update(over)
    return Pipeline(rig, out=tmp_path / name, console=False)


def random_ids(n, seed, vocab=512):
    return np.random.default_rng(seed).integers(0, vocab, size=n).astype(np.int32)


@pytest.mark.slow
def test_two_prompts_on_one_pipeline_equal_fresh_pipelines(tmp_path):
    """Buffers and KV are sized once: a second, longer prompt runs on the same stages, and its residual
    and logits are those of a pipeline that saw only it."""
    a, b = random_ids(150, 1), random_ids(230, 2)
    with smoke(tmp_path, "both") as p:
        ra = p.prefill(a)
        md5_a = ra.report["residual_md5"]
        rb = p.prefill(b)
        md5_b = rb.report["residual_md5"]
        assert rb.report["tokens"] == 230 and rb.report["reused_tokens"] == 0  # dump_residual: every row computed
        assert [tuple(c) for c in rb.report["schedule"]] == [(0, 64), (64, 64), (128, 64), (192, 38)]
    with smoke(tmp_path, "b") as q:
        fresh_b = q.prefill(b)
    with smoke(tmp_path, "a") as q:
        fresh_a = q.prefill(a)
    assert md5_b == fresh_b.report["residual_md5"] and md5_a == fresh_a.report["residual_md5"]
    assert md5_a != md5_b
    np.testing.assert_array_equal(rb.last_logits, fresh_b.last_logits)
    assert rb.perplexity == fresh_b.perplexity


@pytest.mark.slow
def test_prompt_over_max_context_is_refused_and_the_pipeline_goes_on(tmp_path):
    with smoke(tmp_path, "ctx", max_context=64, dump_residual=False) as p:
        assert p.max_context == 64
        with pytest.raises(ConfigError, match=r"^prompt: 65 tokens exceeds max_context of 64 tokens$"):
            p.generate(random_ids(65, 3), SamplingParams(max_tokens=1))
        r = p.generate(random_ids(60, 3), SamplingParams(max_tokens=10))
        # the context ends the answer: 4 tokens fit after 60
        assert len(r.continuation_ids) == 4 and r.finish_reason == "length"
        assert r.report["decode_tokens"] == 4 and r.report["decode_steps"] == 3


def test_rig_key_max_context_is_checked_before_anything_starts(tmp_path):
    with pytest.raises(ConfigError, match="prompt: 8 tokens \\+ 0 generated exceeds max_context of 4 tokens"):
        smoke(tmp_path, "x", max_context=4)
    with pytest.raises(ConfigError, match="exceeds the model's context of 65536"):
        smoke(tmp_path, "y", max_context=70000)


# -- SmolLM2: real text, against the single-process engine ---------------------------------------------
@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    pytest.importorskip("gguf")
    from strata.weights.checkpoint import smollm2_path
    try:
        smollm2_path()
    except Exception as e:  # noqa: BLE001
        pytest.skip(str(e))
    # decode_weights none: the reference (LocalEngine) decodes with the dense weights, and so must these stages to
    # give its bits; the C decoder's block products (8-bit activations) round otherwise and pick other tokens
    # where two logits are close (tests/test_cpu_decode.py checks it against its own reference)
    # prefix_reuse chunks: these tests compare exact continuations, and each prompt's reuse of the live KV; with
    # rows the prefix cache would also serve the last blocks of the module's earlier prompts (tests/test_prefix_cache.py)
    with Pipeline(dict(model="smollm2", stages=STAGES, chunk=64, max_context=1024, progress=False,
                       decode_weights="none", prefix_reuse="chunks"),
                  out=tmp_path_factory.mktemp("smol"), console=False) as p:
        yield p


@pytest.fixture(scope="module")
def local():
    """The reference: the whole model in this process (strata.serve.engine.LocalEngine), one thread like a stage."""
    import torch
    from strata.serve.engine import LocalEngine
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield LocalEngine("smollm2", max_context=1024, prefill_chunk=64)
    finally:
        torch.set_num_threads(threads)


def local_generate(eng, ids, params):
    out = []
    eng.kept = []  # cold
    stats = eng.generate(list(ids), params, lambda t: out.append(t) or True)
    return out, stats


@pytest.mark.slow
def test_greedy_generate_equals_the_single_process_engine_and_the_rig_continuation(smol, local, tmp_path):
    ids = smol.prompt_ids(DOC + "The tower is named after")
    want, _ = local_generate(local, ids, SamplingParams(max_tokens=12))
    got = smol.generate(ids, SamplingParams(max_tokens=12))
    assert got.continuation_ids == want and got.continuation == local.detokenize(want)
    rep = got.report
    assert rep["decode_tokens"] == 12 and rep["decode_steps"] == 11 and rep["decode_tok_s"] > 0
    assert rep["ttft_s"] > 0 and rep["decode_s"] > 0 and rep["finish_reason"] == "length"
    assert len(rep["stages"]) == 2 and all(s["decode_work_s"] > 0 for s in rep["stages"])
    # the rig's `generate: N` is the same greedy continuation
    with Pipeline(dict(model="smollm2", stages=STAGES, chunk=64, max_context=256, progress=False, generate=12,
                       decode_weights="none", prompt={"text": DOC + "The tower is named after"}), out=tmp_path / "rig", console=False) as p:
        rig = p.prefill()
    assert rig.continuation_ids == want and rig.report["decode_tokens"] == 12


def test_prefix_reuse_gives_the_cold_continuation(smol):
    q1, q2 = smol.prompt_ids(DOC + "Who designed it?"), smol.prompt_ids(DOC + "When was it built? It was built")
    common = int(np.flatnonzero(q1[:min(q1.size, q2.size)] != q2[:min(q1.size, q2.size)])[0])
    assert common > 20
    smol.generate(np.concatenate([[q2[0] + 1], q2[1:]]), SamplingParams(max_tokens=1))  # nothing in common
    cold = smol.generate(q2, SamplingParams(max_tokens=10))
    assert cold.reused_tokens == 0 and cold.report["prefilled_tokens"] == q2.size
    first = smol.generate(q1, SamplingParams(max_tokens=6))
    assert first.reused_tokens == common
    warm = smol.generate(q2, SamplingParams(max_tokens=10))
    assert warm.reused_tokens == common and warm.report["reused_tokens"] == common
    assert warm.report["prefilled_tokens"] == q2.size - common
    assert warm.report["schedule"][0][0] == common  # only the tail went through the stages
    assert warm.report["perplexity_tokens"] == q2.size - common - 1
    assert warm.continuation_ids == cold.continuation_ids
    # the same prompt again: all but its last token (recomputed: its logits give the first new token)
    again = smol.generate(q2, SamplingParams(max_tokens=10))
    assert again.reused_tokens == q2.size - 1 and again.continuation_ids == cold.continuation_ids
    # a follow-up that contains the answer reuses the answer's KV too
    follow = np.concatenate([q2, np.array(again.continuation_ids[:-1], dtype=np.int32), [q2[5]]])
    assert smol.generate(follow, SamplingParams(max_tokens=1)).reused_tokens == follow.size - 1


@pytest.mark.slow
def test_seeded_sampling_is_reproducible_and_matches_the_engine(smol, local):
    ids = smol.prompt_ids(DOC + "In one word, the tower is")
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=1234, max_tokens=10)
    a = smol.generate(ids, params).continuation_ids
    b = smol.generate(ids, params).continuation_ids
    want, _ = local_generate(local, ids, params)
    assert a == b == want
    others = {tuple(smol.generate(ids, SamplingParams(temperature=1.5, seed=s, max_tokens=10)).continuation_ids)
              for s in range(3)}
    assert len(others) > 1  # the seed matters


def test_stop_strings_cut_the_text(smol):
    ids = smol.prompt_ids(DOC + "The tower is named after")
    full = smol.generate(ids, SamplingParams(max_tokens=12))
    text = full.continuation
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip() and text.find(stop) > 0
    cut = smol.generate(ids, SamplingParams(max_tokens=12, stop=("zzzq", stop)))
    assert cut.continuation == text[:text.find(stop)] and cut.finish_reason == "stop"
    assert len(cut.continuation_ids) < 12
    assert cut.continuation_ids == full.continuation_ids[:len(cut.continuation_ids)]
    told = []
    r = smol.generate(ids, SamplingParams(max_tokens=12), on_token=lambda t: told.append(t) or len(told) < 3)
    assert told == full.continuation_ids[:3] and r.continuation_ids == told and r.finish_reason == "stop"


def test_default_max_context_is_what_every_stage_can_hold():
    """Default max_context: the model's context, halved until each stage's KV + weights fit its memory."""
    from strata.config import from_dict
    from strata.plan.plan import build_plan
    base = dict(model="synthetic:smoke", chunk=64, prompt={"random": {"tokens": 8, "seed": 0}}, progress=False)
    roomy = build_plan(from_dict({**base, "stages": STAGES}, env={}))
    assert roomy.max_len == roomy.args.max_seq_len == 65536
    capped = [{"device": "cpu", "threads": 1, "memory": 300_000_000, "speed": 1.0}] * 2
    plan = build_plan(from_dict({**base, "stages": capped}, env={}))
    need = plan.planner["needs"]
    assert plan.max_len < 65536 and all(n["total"] <= 300_000_000 for n in need)
    # twice as many positions would not have fitted
    kv_per_token = need[0]["kv_cache"] / plan.max_len
    assert need[0]["total"] + kv_per_token * plan.max_len > 300_000_000
    with pytest.raises(ConfigError):  # and a given max_context is not cut: refused with the planner's reason
        build_plan(from_dict({**base, "stages": capped, "max_context": 65536}, env={}))


@pytest.mark.slow
@pytest.mark.parametrize("params", [SamplingParams(max_tokens=16),
                                    SamplingParams(temperature=0.9, top_k=20, seed=7, max_tokens=16)])
def test_decode_bells_give_the_notes_tokens(tmp_path, params):
    """Decode steps announced on shared-memory bells (strata/comm/bells.py; forced here on CPU stages, where they are
    off by default) give the tokens ZeroMQ notes give, greedy and sampled; every step after a phase's first
    went by bell, and a second generation on the same pipeline does too."""
    ids = random_ids(40, 5)
    out = {}
    for mode in (False, True):  # kernels.decode_bells
        with smoke(tmp_path, f"bells{mode}", dump_residual=False, kernels={"decode_bells": mode}) as p:
            res = [p.generate(ids, params) for _ in range(2)]
            runs = [r.continuation_ids for r in res]
            b = p._buffers.bells
            assert (b is None) == (not mode)
            if b is not None:  # the head's bell: one result per step but each generation's first
                assert b.seen == 2 * (len(runs[0]) - 2)
            assert [r.report["decode_bell_steps"] for r in res] == [0 if b is None else len(runs[0]) - 2] * 2
        assert runs[0] == runs[1] and len(runs[0]) == 16
        out[mode] = runs[0]
    assert out[False] == out[True]


@pytest.mark.slow
def test_decode_bells_stop_mid_answer_then_reuse(tmp_path):
    """With bells (forced on CPU stages), an answer stopped by its caller mid-way (what the server does when a
    client leaves) leaves the stages ready: the next request on the same prompt reuses its KV, goes by bell
    again and gives the whole greedy answer, and one that continues the stopped answer reuses that too."""
    ids = random_ids(40, 9)
    with smoke(tmp_path, "bellstop", dump_residual=False, kernels={"decode_bells": True}) as p:
        full = p.generate(ids, SamplingParams(max_tokens=16)).continuation_ids
        assert p._buffers.bells is not None
        told = []
        r = p.generate(ids, SamplingParams(max_tokens=16), on_token=lambda t: told.append(t) or len(told) < 3)
        assert r.continuation_ids == told == full[:3] and r.finish_reason == "stop"
        again = p.generate(ids, SamplingParams(max_tokens=16))
        assert again.continuation_ids == full and again.reused_tokens == ids.size - 1
        assert again.report["decode_bell_steps"] == len(full) - 2
        follow = np.concatenate([ids, np.array(full[:2], dtype=np.int32)])
        more = p.generate(follow, SamplingParams(max_tokens=4))
        assert more.reused_tokens == follow.size - 1 and more.continuation_ids == full[2:6]


def test_decode_ahead_only_with_a_gpu_per_stage():
    """Launch-ahead (a stream parked on a bell) is asked for only when every stage has a GPU of its own: stages
    sharing a GPU would hold its time slices from each other; kernels.decode_ahead false turns it off."""
    from strata.comm import bells
    assert bells.ahead_wanted(["cuda:0", "cuda:1"], "auto")
    assert not bells.ahead_wanted(["cuda:0", "cuda:0"]) and not bells.ahead_wanted(["cuda:0", "cpu"])
    assert not bells.ahead_wanted(["cuda:0", "cuda:1"], False)


def test_bell_release_reads_as_the_step_queued_ahead():
    """A stage's release of the step it queued ahead rings its own bell as the hop above would: the queued
    step's copies find its position and a valid token, the wait (seq >= seen + 1) passes, the stage has seen that
    seq (it is not taken as a note), and the sender's next ring is the next seq, which is."""
    from strata.comm.bells import ARGMAX, POS, ROW, SEQ, Bells
    words = np.zeros((3, ROW), dtype=np.int64)
    sender, stage = Bells(words), Bells(words)
    sender.ring(1, k=4, pos=700, argmax=-1, t0=1.5)
    assert stage.take(1) == (4, 700, -1, 1.5)
    queued_for = stage.seen + 1  # what the queued step waits for
    assert stage.release(1, pos=701) == queued_for == words[1, SEQ]
    assert words[1, POS] == 701 and words[1, ARGMAX] == 0
    assert stage.take(1) is None
    sender.ring(1, k=0, pos=705, t0=2.5)
    assert words[1, SEQ] == queued_for + 1 and stage.take(1) == (0, 705, -1, 2.5)
