"""The layer-split planner against a brute force over every contiguous split, on described rigs;
memory accounting; refusals (planner, build_plan, launcher) with their messages checked.

Speeds here are given, never calibrated, except in the one calibration test at the end."""
from __future__ import annotations

import itertools
import os
import random
import re
from dataclasses import replace

import pytest

from strata.config import ConfigError, from_dict
from strata.models.args import PRESETS, ModelArgs
from strata.plan.plan import build_plan
from strata.plan.planner import (CPU_RUNTIME_BYTES, CUDA_RUNTIME_BYTES, DTYPE_BYTES, GiB, PlanError, Speed, check_split,
                            max_layers, plan_split, predicted_times, stage_need, stage_time)

GB = 10**9
LLAMA8 = PRESETS["llama-3-8b"]
LLAMA70 = PRESETS["llama-3-70b"]
SMOLLM2 = ModelArgs(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64, ffn_dim=1536,
                    tie_embeddings=True, max_seq_len=8192)
SEED_TOKENS = 120 * 1024  # the seed's 120k-token prompt


@pytest.fixture(autouse=True)
def flash_attention(monkeypatch):
    """CUDA stages' activations depend on the attention path (`attention: auto` is
    strata.kernels.attention.CUDA_ATTENTION_DEFAULT): pin flash here; test_cudnn_split_needs_the_repeated_kv covers the
    other."""
    import strata.kernels.attention
    monkeypatch.setattr(strata.kernels.attention, "CUDA_ATTENTION_DEFAULT", "flash")


# -- brute force ---------------------------------------------------------------------------------
def compositions(L: int, S: int):
    """Every split of L layers into S contiguous non-empty ranges."""
    for cuts in itertools.combinations(range(1, L), S - 1):
        bounds = (0, *cuts, L)
        yield [bounds[i + 1] - bounds[i] for i in range(S)]


def fits(args, split, caps, tokens, chunk, dtype, host, with_head) -> bool:
    a = 0
    for i, n in enumerate(split):
        need = stage_need(args, a, a + n, tokens, chunk, dtype, host[i], with_head).total
        if caps[i] is not None and need > caps[i]:
            return False
        a += n
    return True


def brute(args, speeds, caps, tokens, chunk, dtype, host=None, with_head=True, prompt_tokens=None):
    """(min over splits of the slowest stage, min total time among those) or None if nothing fits."""
    S = len(speeds)
    host = host or [False] * S
    work = prompt_tokens or tokens
    best = None
    for split in compositions(args.n_layers, S):
        if not fits(args, split, caps, tokens, chunk, dtype, host, with_head):
            continue
        t = predicted_times(args, split, speeds, work, with_head)
        key = (max(t), sum(t))
        if best is None or key[0] < best[0] * (1 - 1e-12) or (key[0] <= best[0] * (1 + 1e-12) and key[1] < best[1]):
            best = key
    return best


def check_against_brute(args, speeds, caps, tokens, chunk, dtype, host=None, with_head=True):
    S = len(speeds)
    host = host or [False] * S
    split = plan_split(args, S, speeds, caps, tokens, chunk, dtype, host, with_head=with_head)
    assert len(split) == S and sum(split) == args.n_layers and min(split) >= 1
    assert fits(args, split, caps, tokens, chunk, dtype, host, with_head), "the plan breaks a memory cap"
    t = predicted_times(args, split, speeds, tokens, with_head)
    want = brute(args, speeds, caps, tokens, chunk, dtype, host, with_head)
    assert max(t) == pytest.approx(want[0], rel=1e-12), (split, t)
    assert sum(t) == pytest.approx(want[1], rel=1e-9), (split, t)
    return split, t


# -- described rigs ------------------------------------------------------------------------------
SEED_SPEEDS = [1.0, 1.0, 1.6, 1.6]          # 3060-ish 12 GB cards, 5060-ish 8 GB cards
SEED_CAPS = [12 * GiB, 12 * GiB, 8 * GiB, 8 * GiB]


def test_kv_cache_of_the_seed_prompt_is_15_gib():
    # llama-3-8b in bf16: 2 (K, V) * 8 kv heads * 128 * 2 bytes = 4 KiB per token per layer
    full = stage_need(LLAMA8, 0, 32, SEED_TOKENS, 2048, "bfloat16")
    assert full.kv_cache == 15 * GiB
    assert full.weights == LLAMA8.param_count(0, 32) * 2


def test_seed_rig_memory_binds_and_dp_matches_brute_force():
    split, t = check_against_brute(LLAMA8, SEED_SPEEDS, SEED_CAPS, SEED_TOKENS, 2048, "bfloat16")
    # without caps the fast 8 GB cards would take more layers than they can hold
    free = plan_split(LLAMA8, 4, SEED_SPEEDS, [None] * 4, SEED_TOKENS, 2048, "bfloat16")
    assert not fits(LLAMA8, free, SEED_CAPS, SEED_TOKENS, 2048, "bfloat16", [False] * 4, True)
    assert free[2] > split[2] or free[3] > split[3]
    # and the capped plan puts the 8 GB cards at (or next to) their most
    for i in (2, 3):
        m = max_layers(LLAMA8, i, 4, SEED_CAPS[i], SEED_TOKENS, 2048, "bfloat16", False)
        assert split[i] == m
    # memory costs time here: the capped optimum is slower than the uncapped one
    assert max(t) > max(predicted_times(LLAMA8, free, SEED_SPEEDS, SEED_TOKENS))
    # the even split does not even fit the 8 GB cards
    assert "stage 3 (layers 24-31)" in check_split(LLAMA8, [8, 8, 8, 8], SEED_CAPS, SEED_TOKENS, 2048, "bfloat16")


@pytest.mark.parametrize("order", [[0, 2, 1, 3], [2, 3, 0, 1]])
def test_seed_rig_other_card_orders(order):
    check_against_brute(LLAMA8, [SEED_SPEEDS[i] for i in order], [SEED_CAPS[i] for i in order],
                        SEED_TOKENS, 2048, "bfloat16")


def test_seed_rig_with_calibrated_style_speeds_and_head_speed():
    # FLOP/s with separate linear / attention / head throughputs (what calibration returns)
    speeds = [Speed(30e12, 20e12, 25e12), Speed(30e12, 20e12, 25e12), Speed(48e12, 35e12, 40e12),
              Speed(48e12, 35e12, 40e12)]
    check_against_brute(LLAMA8, speeds, SEED_CAPS, SEED_TOKENS, 2048, "bfloat16")


def test_four_equal_cards():
    caps = [24 * GiB] * 4
    split, _ = check_against_brute(LLAMA8, [1.0] * 4, caps, 8192, 2048, "bfloat16", with_head=False)
    assert split == [8, 8, 8, 8]
    split, t = check_against_brute(LLAMA8, [1.0] * 4, caps, 8192, 2048, "bfloat16", with_head=True)
    # the head (about two layers' worth at 8k tokens) costs the last stage layers
    assert split[-1] == min(split) < 8 and max(split) - min(split) <= 3
    assert max(t) < max(predicted_times(LLAMA8, [8, 8, 8, 8], [1.0] * 4, 8192))


def test_two_to_one_speed_ratio():
    args = replace(SMOLLM2, n_layers=24)
    split, _ = check_against_brute(args, [2.0, 1.0], [None, None], 4096, 512, "float32", [True, True],
                                   with_head=False)
    assert split == [16, 8]
    # with the perplexity head (about 5-8 layers' worth for this shape) on the slower last stage
    split, t = check_against_brute(args, [2.0, 1.0], [None, None], 4096, 512, "float32", [True, True])
    assert split[1] < 8
    split, _ = check_against_brute(args, [1.0, 2.0], [None, None], 4096, 512, "float32", [True, True])
    assert split[0] < split[1]


def test_random_rigs_match_brute_force():
    rng = random.Random(7)
    hits = fails = 0
    for _ in range(250):
        L = rng.randint(2, 11)
        S = rng.randint(1, min(4, L))
        args = ModelArgs(vocab_size=rng.choice([64, 512, 4096]), dim=64, n_layers=L, n_heads=4, n_kv_heads=2,
                         head_dim=16, ffn_dim=rng.choice([96, 256]), tie_embeddings=rng.random() < 0.5,
                         max_seq_len=1 << 20)
        tokens, chunk = rng.choice([256, 4096, 65536]), rng.choice([64, 512])
        host = [rng.random() < 0.5 for _ in range(S)]
        with_head = rng.random() < 0.7
        speeds = [rng.choice([1.0, 1.5, 2.0, 3.0, Speed(2.0, 1.0, 4.0)]) for _ in range(S)]
        base = [stage_need(args, 0, 1, tokens, chunk, "float32", host[i], with_head).total for i in range(S)]
        caps = [None if rng.random() < 0.3 else int(base[i] * rng.uniform(0.9, 3.0)) for i in range(S)]
        want = brute(args, speeds, caps, tokens, chunk, "float32", host, with_head)
        if want is None:
            fails += 1
            with pytest.raises(PlanError, match="no layer split fits|stages but the model"):
                plan_split(args, S, speeds, caps, tokens, chunk, "float32", host, with_head=with_head)
        else:
            hits += 1
            check_against_brute(args, speeds, caps, tokens, chunk, "float32", host, with_head)
    assert hits > 100 and fails > 10  # both branches exercised


# -- refusals ------------------------------------------------------------------------------------
def _numbers(msg: str) -> list[int]:
    return [int(x.replace(",", "")) for x in re.findall(r"\d{1,3}(?:,\d{3})+|\d+(?= bytes)", msg)]


def test_rig_that_cannot_fit_names_the_tightest_stage():
    caps = [8 * GiB] * 4
    with pytest.raises(PlanError) as ei:
        plan_split(LLAMA70, 4, [1.0] * 4, caps, 8192, 2048, "bfloat16")
    msg = str(ei.value)
    m = re.search(r"stage (\d) must take (\d+) layers and needs ([\d,]+) bytes .* but has ([\d,]+) bytes", msg)
    assert m, msg
    j, n, needed, has = int(m[1]), int(m[2]), int(m[3].replace(",", "")), int(m[4].replace(",", ""))
    assert has == caps[j] and needed > has
    start = 0 if j == 0 else LLAMA70.n_layers - n if j == 3 else 1
    assert needed == stage_need(LLAMA70, start, start + n, 8192, 2048, "bfloat16").total
    assert "weights" in msg and "KV cache" in msg and "activations" in msg
    # a true lower bound: the others at their most leave stage j exactly n layers
    most = [max_layers(LLAMA70, i, 4, caps[i], 8192, 2048, "bfloat16", False) for i in range(4)]
    assert n == LLAMA70.n_layers - (sum(most) - most[j])
    assert f"at most {sum(most)} of the model's 80 layers" in msg


def test_brute_force_agrees_nothing_fits_on_a_small_rig():
    args = replace(LLAMA8, n_layers=12)
    caps = [3 * GiB] * 3
    assert brute(args, [1.0] * 3, caps, 32768, 2048, "bfloat16") is None
    with pytest.raises(PlanError, match=r"no layer split fits"):
        plan_split(args, 3, [1.0] * 3, caps, 32768, 2048, "bfloat16")


def test_stage_that_cannot_hold_one_layer():
    caps = [int(1.5 * GiB), None, None]  # the embedding alone is ~1 GB; one layer + KV pushes it over
    with pytest.raises(PlanError) as ei:
        plan_split(LLAMA8, 3, [1.0] * 3, caps, 65536, 2048, "bfloat16", labels=["cuda:0", "cuda:1", "cuda:2"],
                   cap_notes=["the rig's memory", "", ""])
    msg = str(ei.value)
    need = stage_need(LLAMA8, 0, 1, 65536, 2048, "bfloat16").total
    assert f"stage 0 (cuda:0) needs {need:,} bytes" in msg and "single layer" in msg
    assert f"has {caps[0]:,} bytes" in msg and "the rig's memory" in msg


def test_explicit_split_checked():
    err = check_split(LLAMA8, [20, 4, 4, 4], SEED_CAPS, SEED_TOKENS, 2048, "bfloat16")
    need = stage_need(LLAMA8, 0, 20, SEED_TOKENS, 2048, "bfloat16").total
    assert err.startswith(f"stage 0 (layers 0-19) needs {need:,} bytes")
    assert f"but has {SEED_CAPS[0]:,} bytes" in err
    assert check_split(LLAMA8, [9, 9, 8, 6], SEED_CAPS, SEED_TOKENS, 2048, "bfloat16") is None


def test_too_many_stages():
    with pytest.raises(PlanError, match="only 8 layers"):
        plan_split(PRESETS["smoke"], 9, [1.0] * 9, [None] * 9, 128, 64, "float32")


# -- memory accounting ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_weights_over_stages_add_up(dtype):
    b = DTYPE_BYTES[dtype]
    for args in (LLAMA8, SMOLLM2):
        for split in ([args.n_layers], [3, args.n_layers - 3], [1, 1, args.n_layers - 2]):
            a, w = 0, 0
            for n in split:
                w += stage_need(args, a, a + n, 1024, 256, dtype).weights
                a += n
            tied_copy = args.vocab_size * args.dim * b if args.tie_embeddings and len(split) > 1 else 0
            assert w == args.param_count(0, args.n_layers) * b + tied_copy


def test_qkv_bias_counted():
    q = replace(SMOLLM2, arch="qwen2", qkv_bias=True)
    d = stage_need(q, 1, 3, 1024, 256, "float32").weights - stage_need(SMOLLM2, 1, 3, 1024, 256, "float32").weights
    assert d == 2 * (9 + 2 * 3) * 64 * 4


def test_kv_activations_handoff_runtime():
    t, c = 4096, 512
    mid = stage_need(SMOLLM2, 5, 10, t, c, "float32", host_handoff=True)
    assert mid.kv_cache == 2 * 5 * 3 * 64 * t * 4
    assert mid.handoff == 2 * c * 576 * 4 + (t + 1) * 4 and mid.runtime == CPU_RUNTIME_BYTES
    gpu = stage_need(SMOLLM2, 5, 10, t, c, "float32", host_handoff=False)
    assert gpu.handoff == 0 and gpu.runtime == CUDA_RUNTIME_BYTES
    # the last stage holds the perplexity's blocked full-vocabulary logits (logits + log-softmax)
    last = stage_need(SMOLLM2, 25, 30, t, c, "float32", host_handoff=True)
    assert last.activations >= c * 49152 * 4 * 2 > mid.activations
    no_ppl = stage_need(SMOLLM2, 25, 30, t, c, "float32", host_handoff=True, with_head=False)
    assert no_ppl.activations < last.activations
    # activations scale with the chunk, not the prompt
    assert stage_need(SMOLLM2, 5, 10, 8 * t, c, "float32").activations == \
        stage_need(SMOLLM2, 5, 10, t, c, "float32").activations
    big = stage_need(SMOLLM2, 5, 10, t, 2 * c, "float32").activations
    assert 1.9 < big / stage_need(SMOLLM2, 5, 10, t, c, "float32").activations < 2.1


def test_the_prefix_caches_device_tier_is_counted_on_a_cuda_stage_only():
    """prefix_cache_device_bytes: a CUDA stage's need holds it (in its total, its description and report.json's
    needs); a CPU stage's does not (its snapshots are host memory: the tier is never made there), nor does a rig's
    plan whose stages are all CPUs."""
    from strata.weights.storage import Storage
    t, c = 4096, 512
    st = Storage(layer=1e7, embed=0, head=0, norm=0, scratch=0, kv_elem=2, mode="resident", prefix_device=3 << 30)
    gpu = stage_need(SMOLLM2, 5, 10, t, c, "bfloat16", False, storage=st)
    bare = stage_need(SMOLLM2, 5, 10, t, c, "bfloat16", False, storage=replace(st, prefix_device=0))
    assert gpu.prefix_cache == 3 << 30 and gpu.total == bare.total + (3 << 30)
    assert "prefix cache (device tier) 3.00 GiB" in gpu.describe() and gpu.as_dict()["prefix_cache"] == 3 << 30
    cpu = stage_need(SMOLLM2, 5, 10, t, c, "bfloat16", True, storage=st)
    assert cpu.prefix_cache == 0 and "prefix cache" not in cpu.describe()
    cfg = from_dict(dict(model="synthetic:smoke", stages=[{"device": "cpu", "threads": 1}] * 2, chunk=64,
                         max_context=256, prefix_cache_device_bytes=1 << 30, prompt={"random": {"tokens": 8}}))
    plan = build_plan(cfg)
    assert [n["prefix_cache"] for n in plan.planner["needs"]] == [0, 0]


def test_an_auto_device_tier_takes_half_of_what_a_capped_cuda_stage_leaves():
    """prefix_cache_device_bytes auto (strata.plan.plan.device_tiers): after the split, a capped CUDA stage's tier is half
    of what its cap leaves, at most prefix_cache_bytes; a CPU stage and an uncapped one get none; a number is kept
    as given; a model whose prefix cache is off gets none (and no refusal), where a number is refused."""
    from strata.plan.plan import device_tiers
    from strata.weights.storage import Storage
    args, t, c = PRESETS["llama-3-8b"], 32768, 8192
    st = Storage(layer=1e8, embed=0, head=0, norm=0, scratch=0, kv_elem=2, mode="resident")
    need = stage_need(args, 0, 16, t, c, "bfloat16", False, True, "auto", st).total
    cfg = from_dict(dict(model="synthetic:llama-3-8b", dtype="bfloat16", chunk=c, prefix_cache_device_bytes="auto",
                         prompt={"random": {"tokens": 8}}))
    got = device_tiers(args, [16, 16], t, c, cfg, [False, True], [need + (2 << 30), None], [st, st])
    assert [s.prefix_device for s in got] == [1 << 30, 0]
    got = device_tiers(args, [16, 16], t, c, cfg, [False, False], [need + (10 << 30), None], [st, st])
    assert [s.prefix_device for s in got] == [2 << 30, 0]  # at most prefix_cache_bytes (2 GiB by default)
    assert stage_need(args, 0, 16, t, c, "bfloat16", False, True, "auto", got[0]).total == need + (2 << 30)
    fixed = from_dict(dict(model="synthetic:llama-3-8b", dtype="bfloat16", chunk=c, prefix_cache_device_bytes=5,
                           prompt={"random": {"tokens": 8}}))
    assert device_tiers(args, [16, 16], t, c, fixed, [False, False], [1 << 40] * 2, [st, st]) == [st, st]
    with pytest.raises(ConfigError, match="prefix_cache_device_bytes: expected 'auto' or a number of bytes"):
        from_dict(dict(model="synthetic:smoke", prefix_cache_device_bytes="lots", prompt={"random": {"tokens": 8}}))


def test_an_8bit_cache_counts_one_layer_widened():
    """A q8_0 or e4m3 cache is widened to the compute dtype for each layer's prefill attention, a block of the
    prefix at a time (strata.kernels.attention.narrow_cache_attention): the activations hold one block's keys and values."""
    from strata.weights.storage import Storage
    args, t, c = PRESETS["llama-3-8b"], 131072, 448
    st = {kv: Storage(layer=1e8, embed=0, head=0, norm=0, scratch=0, kv_elem=kv, mode="resident") for kv in (2, 34 / 32)}
    wide, narrow = (stage_need(args, 4, 8, t, c, "bfloat16", False, storage=st[kv]) for kv in (2, 34 / 32))
    from strata.kernels.attention import PREFIX_BLOCK
    # a block of the prefix and the chunk's own keys widened, the block's output and log-sum-exp
    assert narrow.activations - wide.activations == 2 * 8 * 128 * (PREFIX_BLOCK + c) * 2 + c * (32 * 128 * 2 + 32 * 4)
    assert narrow.kv_cache == wide.kv_cache * 34 // 64



def test_a_cuda_stage_widens_the_whole_prefix_where_its_memory_holds_it():
    """strata.plan.plan.prefix_blocks: after the split and the chunk, a capped CUDA stage with an 8-bit cache gets the
    whole context as its prefix block where its cap holds that, else the largest halving above PREFIX_BLOCK it
    holds, else PREFIX_BLOCK; a CPU stage, an uncapped one and a bf16 cache keep PREFIX_BLOCK."""
    from strata.kernels.attention import PREFIX_BLOCK
    from strata.plan.plan import prefix_blocks
    from strata.weights.storage import Storage
    args, t, c = PRESETS["llama-3-8b"], 122880, 8192
    cfg = from_dict(dict(model="synthetic:llama-3-8b", dtype="bfloat16", kv_dtype="q8_0", chunk=c,
                         prompt={"random": {"tokens": 8}}))
    q8, bf = (Storage(layer=1e8, embed=0, head=0, norm=0, scratch=0, kv_elem=kv, mode="resident") for kv in (34 / 32, 2))

    def need(block, st=q8, a=0, n=16):
        return stage_need(args, a, a + n, t, c, "bfloat16", False, cfg.perplexity, cfg.attention,
                          replace(st, prefix_block=block)).total

    split, host = [16, 16], [False, False]
    got = prefix_blocks(args, split, t, c, cfg, host, [need(t), need(t, a=16)], [q8, q8])
    assert [s.prefix_block for s in got] == [t, t]
    assert need(PREFIX_BLOCK) < need(32768) < need(65536) < need(t)
    for cap, block in ((need(t) - 1, 65536), (need(65536) - 1, 32768), (need(32768) - 1, PREFIX_BLOCK)):
        got = prefix_blocks(args, split, t, c, cfg, host, [cap, 1 << 50], [q8, q8])
        assert [s.prefix_block for s in got] == [block, t], cap
    got = prefix_blocks(args, split, t, c, cfg, [True, False], [None, 1 << 50], [q8, bf])
    assert [s.prefix_block for s in got] == [PREFIX_BLOCK, PREFIX_BLOCK]  # a CPU stage; a bf16 cache
    got = prefix_blocks(args, split, t, c, cfg, host, [None, 1 << 50], [q8, q8])
    assert [s.prefix_block for s in got] == [PREFIX_BLOCK, t]  # uncapped: PREFIX_BLOCK

def test_cudnn_split_keeps_grouped_kv(monkeypatch):
    import strata.kernels.attention
    flash = stage_need(LLAMA8, 4, 12, SEED_TOKENS, 2048, "bfloat16")
    monkeypatch.setattr(strata.kernels.attention, "CUDA_ATTENTION_DEFAULT", "cudnn-split")
    split = stage_need(LLAMA8, 4, 12, SEED_TOKENS, 2048, "bfloat16")
    # cuDNN takes the 8 key/value heads as they are: no copy of the context per query head
    assert split.activations - flash.activations < 2 * 32 * 128 * SEED_TOKENS * 2 // 10
    assert split.kv_cache == flash.kv_cache
    # and the seed rig holds the model with either attention path
    plan_split(LLAMA8, 4, SEED_SPEEDS, SEED_CAPS, SEED_TOKENS, 2048, "bfloat16")


def test_rig_attention_reaches_the_planner(monkeypatch):
    """`attention` in the rig (or STRATA_CUDA_ATTENTION) sizes activations for the path the stages take."""
    import strata.plan.plan
    smoke = PRESETS["smoke"]  # narrow MLP: the attention phase is the peak, so the path shows
    flash = stage_need(smoke, 0, 2, 4096, 2048, "bfloat16", attention="flash")
    split = stage_need(smoke, 0, 2, 4096, 2048, "bfloat16", attention="cudnn-split")
    assert split.activations > flash.activations
    seen = []
    real = strata.plan.plan.stage_needs
    monkeypatch.setattr(strata.plan.plan, "stage_needs", lambda *a, **k: seen.append(a[-1]) or real(*a, **k))
    for choice in ("flash", "cudnn-split"):
        build_plan(from_dict(rig(attention=choice)))
    assert seen == ["flash", "cudnn-split"]


def test_stage_time_model():
    # relative speeds: time is FLOPs / speed; the head only on the last stage, only with perplexity
    lin = 2 * SMOLLM2.layer_param_count() * 1000
    att = 2 * 9 * 64 * 1000 ** 2
    head = 2 * 49152 * 576 * 1000
    assert stage_time(SMOLLM2, 3, False, 2.0, 1000) == pytest.approx(3 * (lin + att) / 2)
    assert stage_time(SMOLLM2, 3, True, Speed(1.0, 2.0, 4.0), 1000) == pytest.approx(3 * (lin + att / 2) + head / 4)
    assert stage_time(SMOLLM2, 3, True, 1.0, 1000, with_head=False) == pytest.approx(3 * (lin + att))


# -- through build_plan and the launcher (no calibration: speeds given or identical stages) ------
def rig(**over) -> dict:
    r = {"model": "synthetic:smoke", "dtype": "float32", "chunk": 64, "progress": False,
         "stages": [{"device": "cpu", "threads": 1}, {"device": "cpu", "threads": 1}],
         "prompt": {"random": {"tokens": 512, "seed": 0}}}
    r.update(over)
    return r


def smoke_need(start, end, with_head=True):
    return stage_need(PRESETS["smoke"], start, end, 512, 64, "float32", True, with_head).total


def test_build_plan_memory_cap_moves_layers():
    cap = smoke_need(6, 8)  # stage 1 can hold exactly two layers with KV for 512 positions
    plan = build_plan(from_dict(rig(max_context=512, stages=[{"device": "cpu", "threads": 1},
                                                             {"device": "cpu", "threads": 1, "memory": cap}])))
    assert [s.end - s.start for s in plan.stages] == [6, 2]
    pl = plan.planner
    assert pl["split"] == [6, 2] and pl["mode"] == "auto" and pl["speeds_from"] == "equal"
    assert pl["caps"] == [None, cap] and pl["needs"][1]["total"] == cap
    assert pl["probes"] == [] and pl["calibration_s"] == 0.0


def test_chunk_auto_takes_the_largest_chunk_that_fits():
    """chunk: auto starts at the preferred chunk (CPU stages 512, cut to 4 chunks a stage for this 512-token
    prompt: 256) and takes the largest of its halvings that every stage holds."""
    from strata.plan.plan import chunk_ladder, preferred_chunk
    from strata.config import StageSpec
    cpu2, gpu = [StageSpec("cpu"), StageSpec("cpu")], [StageSpec("cuda:0")]
    assert preferred_chunk(cpu2, 512) == 256 and preferred_chunk(cpu2, 100_000) == 512
    assert preferred_chunk(gpu, 100) == 8192 and preferred_chunk(gpu * 4, 122_880) == 7680
    assert chunk_ladder(8192, 1024) == [8192, 4096, 2048, 1024] and chunk_ladder(256, 64) == [256, 128, 64]
    stages = [{"device": "cpu", "threads": 1}, {"device": "cpu", "threads": 1}]
    free = build_plan(from_dict(rig(chunk="auto", max_context=512, layer_split=[4, 4], stages=stages)))
    assert free.max_chunk == 256 and free.planner["chunk"] == 256 and free.planner["chunk_from"] == "auto"
    assert [n for _, n in free.schedule] == [256, 256]
    cap = stage_need(PRESETS["smoke"], 4, 8, 512, 128, "float32", True).total  # 128 fits stage 1, 256 does not
    assert stage_need(PRESETS["smoke"], 4, 8, 512, 256, "float32", True).total > cap
    capped = [stages[0], {**stages[1], "memory": cap}]
    plan = build_plan(from_dict(rig(chunk="auto", max_context=512, layer_split=[4, 4], stages=capped)))
    assert plan.max_chunk == 128 and [n for _, n in plan.schedule] == [128] * 4
    assert plan.planner["needs"][1]["total"] == cap


def test_chunk_auto_goes_small_when_the_prompt_fills_the_context(monkeypatch):
    """A prompt that needs the model's whole context leaves nothing to shrink but the chunk: chunk: auto goes on
    down its ladder (to 64) past the floor it keeps while a default context could still be halved (the seed's
    rig: 122,880 tokens of a 131,072 context on capped cards)."""
    import strata.plan.plan as plan_mod
    monkeypatch.setattr(plan_mod, "CPU_CHUNK", 8192)  # a CUDA stage's preferred chunk, on CPU stages
    args = PRESETS["smoke"]
    n = args.max_seq_len
    cap = stage_need(args, 4, 8, n, 128, "float32", True).total  # 128 fits stage 1 at the whole context, 256 not
    assert stage_need(args, 4, 8, n, 256, "float32", True).total > cap
    stages = [{"device": "cpu", "threads": 1}, {"device": "cpu", "threads": 1, "memory": cap}]
    r = rig(chunk="auto", layer_split=[4, 4], stages=stages, generate=0,
            prompt={"random": {"tokens": n, "seed": 0}})
    plan = build_plan(from_dict(r))
    assert plan.max_chunk == 128 and plan.max_len == n  # not refused at the old floor, 8192 // 8


def test_refusal_says_what_would_fit():
    """A given chunk over a stage's cap: the refusal names the largest smaller chunk that fits, the longest
    max_context at the given chunk (by bisection: one more position would not fit), and the 8-bit cache."""
    args = PRESETS["smoke"]
    # 1,536 positions at chunk 256, not 2,048 (a context long enough that an 8-bit cache's saving outweighs its
    # widened block: strata.kernels.attention.narrow_cache_attention)
    cap = stage_need(args, 4, 8, 1536, 256, "float32", True).total
    stages = [{"device": "cpu", "threads": 1}, {"device": "cpu", "threads": 1, "memory": cap}]
    with pytest.raises(ConfigError) as ei:
        build_plan(from_dict(rig(chunk=256, max_context=2048, layer_split=[4, 4], stages=stages)))
    msg = str(ei.value)
    assert msg.startswith("stage 1 (cpu, 1 thread) (layers 4-7) needs"), msg
    longest = int(msg.split("or max_context ")[1].split(" ")[0])
    assert 1536 <= longest < 2048
    assert stage_need(args, 4, 8, longest, 256, "float32", True).total <= cap
    assert stage_need(args, 4, 8, longest + 1, 256, "float32", True).total > cap
    assert msg.endswith(f"; would fit: chunk 64, or max_context {longest} at chunk 256, or kv_dtype q8_0")


def test_build_plan_rig_speeds():
    plan = build_plan(from_dict(rig(perplexity=False, stages=[{"device": "cpu", "threads": 1, "speed": 3.0},
                                                              {"device": "cpu", "threads": 1, "speed": 1.0}])))
    assert plan.planner["split"] == [6, 2] and plan.planner["speeds_from"] == "rig"
    assert plan.planner["unit"] == "relative"
    assert sum(plan.planner["predicted_share"]) == pytest.approx(1.0)


def test_build_plan_partial_speeds_refused():
    with pytest.raises(ConfigError, match=r"speed is given for stage\(s\) \[0\] but not for all 2"):
        build_plan(from_dict(rig(stages=[{"device": "cpu", "threads": 1, "speed": 2.0},
                                         {"device": "cpu", "threads": 1}])))


def test_build_plan_refuses_explicit_split_over_cap():
    cap = smoke_need(4, 8) - 1
    with pytest.raises(ConfigError) as ei:
        build_plan(from_dict(rig(layer_split=[4, 4], stages=[{"device": "cpu", "threads": 1},
                                                             {"device": "cpu", "threads": 1, "memory": cap}])))
    msg = str(ei.value)
    assert f"stage 1 (cpu, 1 thread) (layers 4-7) needs {cap + 1:,} bytes" in msg
    assert f"but has {cap:,} bytes" in msg and "stages[].memory" in msg


def test_build_plan_refuses_auto_that_cannot_fit():
    cap = smoke_need(4, 8) - 1  # neither stage can hold half, so 8 layers cannot be covered
    cap0 = smoke_need(0, 4) - 1
    with pytest.raises(ConfigError) as ei:
        build_plan(from_dict(rig(stages=[{"device": "cpu", "threads": 1, "memory": cap0},
                                         {"device": "cpu", "threads": 1, "memory": cap}])))
    msg = str(ei.value)
    assert "no layer split fits: the stages hold at most 6 of the model's 8 layers" in msg
    assert "must take 5 layers" in msg and f"but has {cap0:,} bytes" in msg


def test_launcher_refuses_memory_cap_before_anything_starts(tmp_path, capsys):
    import launcher
    import yaml
    cfg = tmp_path / "rig.yaml"
    cfg.write_text(yaml.safe_dump(rig()))
    import signal
    old = signal.getsignal(signal.SIGTERM)  # the launcher installs its own; give pytest's back
    try:
        code = launcher.main(["--config", str(cfg), "--out", str(tmp_path / "out"), "--no-timeline", "--set",
                              "stages=[{device: cpu, threads: 1, memory: 100000000}, {device: cpu, threads: 1}]"])
    finally:
        signal.signal(signal.SIGTERM, old)
    err = capsys.readouterr().err
    assert code == 2
    need = smoke_need(0, 1)
    assert f"error: no layer split fits: stage 0 (cpu, 1 thread) needs {need:,} bytes" in err
    assert "even with a single layer" in err and "has 100,000,000 bytes" in err
    assert not (tmp_path / "out").exists()  # refused before any process or directory


@pytest.mark.slow
def test_report_shows_split_and_predicted(tmp_path):
    from strata.head.pipeline import Pipeline
    from strata.head.report import format_table
    r = rig(stages=[{"device": "cpu", "threads": 1, "speed": 2.0}, {"device": "cpu", "threads": 1, "speed": 1.0}],
            prompt={"random": {"tokens": 256, "seed": 0}})
    with Pipeline(r, out=tmp_path / "run", console=False) as p:
        rep = p.prefill().report
    assert rep["split"] == p.plan.planner["split"] and sum(rep["split"]) == 8 and rep["split"][0] > rep["split"][1]
    for s in rep["stages"]:
        assert s["predicted_s"] is None and 0 < s["predicted_share"] < 1 and s["work_s"] > 0
    table = format_table(rep)
    assert f"split {rep['split']} (auto, speeds rig)" in table and "measured work" in table


# -- calibration (one real probe: a spawned process, a second or a few) ---------------------------
def test_calibration_probe_cpu():
    from strata.plan.calibrate import probe
    args = PRESETS["smoke"]
    [pr] = probe(args, "float32", [dict(device="cpu", threads=1, cores=[], speed=True, head=True,
                                        chunk=128, tokens=2048)])
    assert pr.speed is not None and pr.speed.head > 0
    # the fitted throughputs reproduce the probe's own timings at both contexts (t = lin/Sl + att/Sa),
    # and one CPU thread cannot exceed 1e12 FLOP/s: a fit that merely sums or mixes them up fails here
    d = pr.detail
    from strata.plan.schedule import chunk_flops
    for ctx, took in ((d["context"], d["layer_s"]), (d["context_lo"], d["layer_lo_s"])):
        lin, att = chunk_flops(args, ctx, d["chunk"])
        predicted = lin / pr.speed.linear + att / pr.speed.attention
        if pr.speed.linear != pr.speed.attention or ctx == d["context"]:
            assert predicted == pytest.approx(took, rel=0.02), (ctx, predicted, took)
    assert max(pr.speed.linear, pr.speed.attention, pr.speed.head) < 1e12
    assert pr.detail["chunk"] == 128 and pr.detail["context"] == 960 and pr.detail["context_lo"] == 128
    # calibrated FLOP/s plug straight into the planner
    split = plan_split(args, 2, [pr.speed, pr.speed], [None, None], 2048, 128, "float32", [True, True])
    assert sum(split) == 8


# -- stage_facts: which probes run and what comes of them (the probe itself faked) ----------------
def fake_probe(free=40 * GiB, speeds=None):
    from strata.plan.calibrate import Probe
    calls = []

    def run(args, dtype, jobs, timeout_s=0):
        calls.append(jobs)
        out = []
        for j in jobs:
            sp = (speeds or {}).get((j["device"], j["threads"]), Speed(1e12, 1e12, 1e12))
            if j["head"]:
                sp = Speed(sp.linear, sp.attention, 7e11)
            out.append(Probe(j["device"], j["threads"], tuple(j["cores"]), free if j["device"] != "cpu" else None,
                             80 * GiB, sp if j["speed"] else None, 0.1, {}))
        return out
    return run, calls


def facts(monkeypatch, stages, want_speed=True, with_head=True, always_calibrate=None, **kw):
    from strata.plan import calibrate
    from strata.config import StageSpec
    run, calls = fake_probe(**kw)
    monkeypatch.setattr(calibrate, "probe", run)
    specs = [StageSpec(**s) for s in stages]
    more = {} if always_calibrate is None else {"always_calibrate": always_calibrate}
    f = calibrate.stage_facts(specs, [()] * len(specs), PRESETS["smoke"], "float32", 64, 512, 512,
                              want_speed=want_speed, with_head=with_head, **more)
    return f, calls


def test_facts_identical_cpu_stages_run_no_probe(monkeypatch):
    f, calls = facts(monkeypatch, [{"device": "cpu", "threads": 1}] * 2)
    assert calls == [] and f.source == "equal" and f.speeds == [1.0, 1.0] and f.caps == [None, None]


def test_facts_always_calibrate_is_an_argument(monkeypatch):
    """always_calibrate (bench/split.py --calibrate) times identical stages too, once for their kind; an argument
    of stage_facts and build_plan, not a module switch: the call without it still runs no probe."""
    import inspect
    from strata.plan import calibrate
    from strata.head.pipeline import Pipeline
    sp = {("cpu", 1): Speed(2e11, 2e11, 2e11)}
    f, calls = facts(monkeypatch, [{"device": "cpu", "threads": 1}] * 2, always_calibrate=True, speeds=sp)
    [jobs] = calls
    assert [(j["threads"], j["speed"], j["head"]) for j in jobs] == [(1, True, True)]
    assert f.source == "calibrated" and f.speeds[0].linear == 2e11 and f.speeds[1].head == 7e11
    f, calls = facts(monkeypatch, [{"device": "cpu", "threads": 1}] * 2)
    assert calls == [] and f.source == "equal"
    assert not hasattr(calibrate, "ALWAYS")
    for fn in (calibrate.stage_facts, build_plan, Pipeline.__init__):
        assert inspect.signature(fn).parameters["always_calibrate"].default is False
    monkeypatch.setattr(calibrate, "probe", fake_probe(speeds=sp)[0])
    plan = build_plan(from_dict(rig(stages=[{"device": "cpu", "threads": 1}] * 2)), always_calibrate=True)
    assert plan.planner["speeds_from"] == "calibrated"


def test_facts_rig_speeds_and_memory(monkeypatch):
    from strata.plan.planner import CUDA_CONTEXT_BYTES
    f, calls = facts(monkeypatch, [{"device": "cuda:0", "speed": 1.0, "memory": 12 * GiB},
                                   {"device": "cuda:1", "speed": 1.6, "memory": 8 * GiB}])
    assert calls == [] and f.source == "rig" and f.speeds == [1.0, 1.6]
    assert f.caps == [12 * GiB - CUDA_CONTEXT_BYTES, 8 * GiB - CUDA_CONTEXT_BYTES]
    assert "for the CUDA context" in f.cap_notes[0]


def test_facts_calibrates_distinct_stages_once_each(monkeypatch):
    sp = {("cpu", 3): Speed(3e11, 3e11, 3e11), ("cpu", 1): Speed(1e11, 1e11, 1e11)}
    f, calls = facts(monkeypatch, [{"device": "cpu", "threads": 3}, {"device": "cpu", "threads": 1},
                                   {"device": "cpu", "threads": 1}], speeds=sp)
    [jobs] = calls
    assert [(j["device"], j["threads"], j["speed"], j["head"]) for j in jobs] == \
        [("cpu", 3, True, False), ("cpu", 1, True, True)]  # the head timed on the last stage's kind only
    assert f.source == "calibrated" and f.speeds[0] == sp[("cpu", 3)] and f.speeds[2].head == 7e11


def test_facts_free_cuda_memory_shared_by_stages(monkeypatch):
    from strata.plan.planner import CUDA_CONTEXT_BYTES
    f, calls = facts(monkeypatch, [{"device": "cuda:0"}, {"device": "cuda:0"}, {"device": "cuda:0", "memory": 4 * GiB}],
                     free=40 * GiB)
    [jobs] = calls
    assert len(jobs) == 1 and jobs[0]["speed"]  # one probe; it calibrates too, being spawned anyway
    share = (40 * GiB - 2 * CUDA_CONTEXT_BYTES - 4 * GiB) // 2
    assert f.caps[:2] == [share, share] and "shared by 2 stages" in f.cap_notes[0]
    f, calls = facts(monkeypatch, [{"device": "cuda:0"}], want_speed=False, free=40 * GiB)
    assert f.caps == [40 * GiB] and not calls[0][0]["speed"] and f.cap_notes == ["free on cuda:0 now"]


def test_host_memory_checked_for_cpu_stages_together(monkeypatch):
    from strata.plan import calibrate
    monkeypatch.setattr(calibrate, "host_available_bytes", lambda: 300 * 2**20)  # 300 MiB: < two runtimes
    with pytest.raises(ConfigError) as ei:
        build_plan(from_dict(rig()))
    msg = str(ei.value)
    need = smoke_need(0, 4) + smoke_need(4, 8)
    assert f"the CPU stage(s) [0, 1] together need {need:,} bytes" in msg
    assert f"but the host has {300 * 2**20:,} bytes available" in msg and "memory:" in msg
    # every CPU stage with its own `memory:`: the user's caps are the plan, no host check
    plan = build_plan(from_dict(rig(stages=[{"device": "cpu", "threads": 1, "memory": 2**30}] * 2)))
    assert plan.planner["host_available"] is None


def test_calibration_failure_is_one_line_and_leaves_no_process():
    import multiprocessing as mp

    from strata.plan.calibrate import CalibrationError, probe
    bad = replace(PRESETS["smoke"], head_dim=33)  # rotate-half needs an even head_dim: the layer raises
    with pytest.raises(CalibrationError, match=r"calibration on cpu \(1 threads\) failed: \w+"):
        probe(bad, "float32", [dict(device="cpu", threads=1, cores=[], speed=True, head=False, chunk=64,
                                    tokens=512)])
    assert not [c for c in mp.active_children() if c.name.startswith("strata-probe")]


# -- on a GPU (skipped without CUDA): the CUDA probe, free memory, calibrated predictions -----------
def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()




@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs CUDA")
def test_gpu_probe_memory_and_speed():
    from strata.plan.calibrate import probe
    [pr] = probe(PRESETS["smoke-wide"], "bfloat16", [dict(device="cuda:0", threads=None, cores=[], speed=True,
                                                          head=True, chunk=1024, tokens=8192)])
    assert 2**30 < pr.free_bytes <= pr.total_bytes
    assert pr.speed.linear > 1e11 and pr.speed.attention > 1e11 and pr.speed.head > 1e11
    print(f"\ncuda:0 probe {pr.seconds:.1f}s: free {pr.free_bytes:,} of {pr.total_bytes:,}; "
          f"speed {pr.speed}; {pr.detail}")


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs CUDA")
def test_gpu_auto_split_calibrated_and_reported(tmp_path):
    from strata.head.pipeline import Pipeline
    cfg = dict(model="synthetic:smoke-wide", dtype="bfloat16", stages=[{"device": "cuda:0"}] * 2, chunk=1024,
               depth=0, prompt={"random": {"tokens": 8192, "seed": 0}}, progress=False)
    with Pipeline(cfg, out=tmp_path / "run", console=False) as p:
        rep = p.prefill().report
    pl = rep["planner"]
    assert pl["speeds_from"] == "calibrated" and pl["unit"] == "s"
    assert all(c and c > 2**30 for c in pl["caps"]) and "shared by 2 stages" in pl["cap_notes"][0]
    for s in rep["stages"]:
        assert s["predicted_s"] > 0 and s["work_s"] > 0
        print(f"\nstage {s['index']} layers {s['layers']}: predicted {s['predicted_s']:.4f}s, "
              f"measured work {s['work_s']:.4f}s, need {s['need_bytes']:,}, allocated {s['mem_bytes']:,}")
        assert s["mem_bytes"] <= s["need_bytes"]  # the planner's bytes bound what the stage allocated


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs CUDA")
def test_gpu_memory_cap_refused_before_loading():
    cfg = dict(model="synthetic:llama-3-8b", dtype="bfloat16", chunk=2048, prompt={"random": {"tokens": 8192, "seed": 0}},
               stages=[{"device": "cuda:0", "memory": 3 * GiB, "speed": 1.0}, {"device": "cuda:0", "memory": 3 * GiB,
                                                                                "speed": 1.0}])
    with pytest.raises(ConfigError) as ei:
        build_plan(from_dict(cfg))
    msg = str(ei.value)
    assert "no layer split fits" in msg and "stages[].memory 3.00 GiB less 0.50 GiB for the CUDA context" in msg
    assert f"but has {3 * GiB - 2**29:,} bytes" in msg


def test_expert_layers_counted_per_layer():
    """A model whose first layers keep a dense MLP (GLM-4.5's first_k_dense_replace): each stage's weights are its
    own layers' (dense ones smaller), exactly for a split and at most any n layers' while one is searched; and the
    stored bytes (checkpoint.storage) per layer of a resident MoE file equal the loaded stage's."""
    glm = ModelArgs(arch="glm4_moe", vocab_size=512, dim=256, n_layers=6, n_heads=4, n_kv_heads=2, head_dim=64,
                    ffn_dim=512, n_experts=8, n_experts_used=2, expert_ffn_dim=256, router="sigmoid",
                    router_renorm=True, first_dense_layers=2)
    dense, moe = glm.layer_param_count(0), glm.layer_param_count(3)
    assert moe > dense
    split = [2, 2, 2]
    w, a = [], 0
    for n in split:
        w.append(stage_need(glm, a, a + n, 1024, 256, "float32").weights)
        a += n
    assert w[0] - 512 * 256 * 4 == 2 * dense * 4 and w[1] == 2 * moe * 4  # (the first stage's embedding)
    assert sum(w) == glm.param_count(0, 6) * 4
    from strata.weights.checkpoint import load_stage, stage_bytes, storage
    args = PRESETS["smoke-moe"]
    st = storage("synthetic:smoke-moe@Q4_K_M", args, "float32", "resident", device_type="cpu")
    m = load_stage("synthetic:smoke-moe@Q4_K_M", args, 1, 3, device="cpu", dtype="float32", weights="resident",
                   max_len=64)
    assert m.weight_bytes == stage_bytes("synthetic:smoke-moe@Q4_K_M", args, 1, 3, "float32", "resident",
                                         max_len=64)[0]
    assert not st.per_layer and st.layer * 2 == m.weight_bytes  # equal layers: their mean, the blocks as stored


def test_moe_compute_counts_the_active_experts():
    """An MoE layer's FLOPs (the planner's time model, the dynamic chunks' budget) scale with the k experts a
    token goes to, not all of them: Qwen3-30B-A3B's ~3.3B active parameters, not its 30B."""
    from strata.plan.planner import layer_flops
    from strata.plan.schedule import chunk_flops
    q = PRESETS["qwen3-30b-a3b"]
    active = q.layer_active_params() * q.n_layers + 2 * q.vocab_size * q.dim
    assert 3.0e9 < active < 3.6e9 and q.layer_param_count() > 10 * q.layer_active_params()
    assert layer_flops(q, 10)[0] == 2.0 * q.layer_active_params() * 10 == chunk_flops(q, 0, 10)[0]
    assert LLAMA8.layer_active_params() == LLAMA8.layer_param_count()


def _variants():
    """Every preset, and the variations no preset has: Qwen2's q/k/v biases, GLM-4.5's sigmoid router with its
    bias, shared expert and first dense layers, Qwen3.5-MoE's sigmoid-gated shared expert on hybrid layers."""
    import dataclasses
    out = dict(PRESETS)
    out["qwen2-like"] = dataclasses.replace(PRESETS["smoke"], arch="qwen2", qkv_bias=True)
    sm = PRESETS["smoke-moe"]
    out["glm-like"] = dataclasses.replace(sm, arch="glm4_moe", router="sigmoid", shared_ffn_dim=64,
                                          first_dense_layers=1, qkv_bias=True)
    q35 = PRESETS["qwen3.5-27b"]
    out["qwen3.5-moe-like"] = dataclasses.replace(q35, n_layers=4, linear_layers=q35.linear_layers[:4],
                                                  n_experts=8, n_experts_used=2, expert_ffn_dim=128,
                                                  shared_ffn_dim=128, shared_gate=True)
    return out


@pytest.mark.parametrize("name", sorted(_variants()))
def test_layer_param_count_is_the_built_layers(name):
    """The planner's weights per layer (ModelArgs.layer_param_count) are the parameters of the layer as built, for
    each kind of layer a model has (attention or linear, dense or experts): it missed Qwen3.5's linear layers and
    gated q (2B parameters short for the 27B: a plan could pass that did not fit), and gpt-oss's biases and sinks.
    An MLA layer's projections are attributes until loaded: the loader (Transformer._load_latent) sets them from
    meta tensors of the file's shapes first."""
    from types import SimpleNamespace
    import torch
    from strata.models.model import Block, Transformer
    from strata.models.names import shapes
    args = _variants()[name]
    kinds = {(args.is_linear(i), args.is_moe(i)): i for i in range(args.n_layers)}
    counts = []
    for i in kinds.values():
        with torch.device("meta"):
            b = Block(args, i)
        if b.latent:
            sh = shapes(args)
            Transformer._load_latent(SimpleNamespace(args=args), b.attn, "",
                                     lambda n: torch.empty(sh[n], device="meta"),
                                     lambda t: torch.nn.Parameter(t, requires_grad=False), lambda t: t, lambda t: t)
        counts.append(sum(p.numel() for p in b.parameters()))
        assert args.layer_param_count(i) == counts[-1], (name, i)
    assert args.layer_param_count() == max(counts)


def test_cpu_stages_without_threads_share_the_cores():
    """README: a CPU stage's threads default to cores / stages (what the other stages' threads leave), never torch's
    all-cores default on the one core assign_cores pins it to."""
    from strata.config import StageSpec
    from strata.plan.plan import default_threads
    cpu, gpu = StageSpec(device="cpu"), StageSpec(device="cuda:0")
    assert [s.threads for s in default_threads((cpu, cpu), 8)] == [4, 4]
    assert [s.threads for s in default_threads((StageSpec(device="cpu", threads=5), cpu, cpu, gpu), 8)] == [5, 1, 1, None]
    assert [s.threads for s in default_threads((cpu, cpu, cpu), 2)] == [1, 1, 1]
    assert [s.threads for s in default_threads((cpu,), 2)] == [2]
    plan = build_plan(from_dict(dict(model="synthetic:smoke", stages=["cpu", "cpu"], chunk=64,
                                     prompt={"random": {"tokens": 100, "seed": 0}})))
    n = len(os.sched_getaffinity(0))
    assert [p.threads for p in plan.stages] == [max(1, n // 2)] * 2


def test_the_rigs_autos_are_resolved_once_in_the_plan():
    """strata.plan.plan.resolve: every `auto` that depends on where the stages run, taken once for the plan (the head,
    its loop and the stages read Plan.resolved): CPU stages, one GPU stage, two; and a rig's own choice kept."""
    from strata.comm import bells
    from strata.config import AUTO_BATCH_AHEAD, from_dict
    from strata.kernels.attention import CUDA_ATTENTION_DEFAULT
    from strata.plan.plan import StagePlan, resolve
    from strata.models.args import PRESETS

    def on(*devices, **rig):
        cfg = from_dict({"model": "synthetic:smoke", "stages": [{"device": "cpu"}], **rig})
        stages = [StagePlan(i, d, 0, 1, None, (), None, None) for i, d in enumerate(devices)]
        return resolve(cfg, PRESETS["smoke"], stages)
    cpu = on("cpu", "cpu", max_seqs=4)
    assert (cpu.all_cuda, cpu.batch_ahead, cpu.prefill_groups, cpu.slot_spin, cpu.decode_bells) == \
        (False, 0, False, False, False)
    assert cpu.attention == CUDA_ATTENTION_DEFAULT
    gpu = on("cuda:0", max_seqs=4)
    assert (gpu.all_cuda, gpu.batch_ahead, gpu.prefill_groups, gpu.slot_spin) == (True, AUTO_BATCH_AHEAD, True, True)
    assert not gpu.decode_bells  # (several sequences: the notes' "taken" path)
    one = on("cuda:0", max_seqs=1)  # (build_plan hands resolve a rig whose max_seqs auto it resolved)
    assert one.decode_bells == one.decode_ahead == bells.supported()
    two = on("cuda:0", "cuda:1", max_seqs=4, batch_ahead=5)
    assert two.batch_ahead == 0  # (several stages: their batches in flight keep each busy)
    mine = on("cuda:0", max_seqs=4, batch_ahead=5, prefill_groups=False, attention="flash")
    assert (mine.batch_ahead, mine.prefill_groups, mine.attention) == (5, False, "flash")
    assert not on("cuda:0", "cuda:0", max_seqs=1).decode_ahead  # (stages sharing a GPU never queue ahead)
