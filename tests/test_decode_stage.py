"""The stages' decode step (workers/stage.py `Stage.decode_step`) against one process's decode path: greedy
tokens through 3 CPU stages, both depth arms, equal the whole model's one-token steps."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from strata.weights.checkpoint import load_stage, model_args
from strata.head.pipeline import Pipeline
from strata.text.sampling import SamplingParams

MODEL, PROMPT, TOKENS = "synthetic:smoke", 40, 16


def reference(ids: np.ndarray, tokens: int) -> list[int]:
    """The whole model in this process: prefill path over the prompt, then the decode path one token at a time."""
    args = model_args(MODEL)
    n = ids.size
    m = load_stage(MODEL, args, 0, args.n_layers, device="cpu", dtype="float32", seed=0, max_len=n + tokens + 1)
    h = m(torch.from_numpy(ids.astype(np.int64)).view(1, -1), 0, decode=False)
    tok = int(m.logits(h[0, -1]).argmax())
    out = [tok]
    for pos in range(n, n + tokens - 1):
        h = m(torch.tensor([[tok]]), pos, decode=True)
        tok = int(m.logits(h[0, -1]).argmax())
        out.append(tok)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("depth", [0, 1])
def test_greedy_through_three_stages_equals_one_process(tmp_path, depth):
    ids = np.random.default_rng(7).integers(0, 512, size=PROMPT).astype(np.int32)
    want = reference(ids, TOKENS)
    rig = dict(model=MODEL, stages=[{"device": "cpu", "threads": 1}] * 3, chunk=16, depth=depth, progress=False,
               max_context=PROMPT + TOKENS + 1, prompt={"random": {"tokens": 8, "seed": 0}})
    with Pipeline(rig, out=tmp_path / f"d{depth}", console=False) as p:
        first = p.generate(ids, SamplingParams(max_tokens=TOKENS))
        again = p.generate(ids[:PROMPT - 5], SamplingParams(max_tokens=4))  # a second answer on the same stages
    assert first.continuation_ids == want, f"depth {depth}"
    assert first.report["decode_steps"] == TOKENS - 1
    assert all(s["decode_work_s"] > 0 for s in first.report["stages"])
    assert again.continuation_ids == reference(ids[:PROMPT - 5], 4)
