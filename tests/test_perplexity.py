"""Prompt perplexity from the pipeline equals transformers' on the same GGUF and token ids."""
import math
import os

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

from strata.head.pipeline import Pipeline  # noqa: E402
from strata.plan.plan import stdlib_source  # noqa: E402
from strata.text.tokenizer import Tokenizer  # noqa: E402
from strata.weights.checkpoint import smollm2_path  # noqa: E402


@pytest.mark.slow
def test_perplexity_and_continuation_match_transformers(tmp_path):
    path = smollm2_path()
    ids = Tokenizer.from_gguf(path).encode(stdlib_source("typing"))[:400]
    with Pipeline(dict(model="smollm2", stages=[{"device": "cpu", "threads": 1}] * 2, chunk=96,
                       prompt={"ids_file": _save(tmp_path, ids)}, generate=4, progress=False),
                  out=tmp_path / "run", console=False) as p:
        res = p.prefill()
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                            torch_dtype=torch.float32).eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        loss = ref(x, labels=x).loss.item()  # mean NLL over positions 1..n-1
        want_cont = ref.generate(x, max_new_tokens=4, do_sample=False)[0, len(ids):].tolist()
    assert math.isclose(res.perplexity, math.exp(loss), rel_tol=1e-3), (res.perplexity, math.exp(loss))
    assert res.continuation_ids == want_cont
    assert res.report["perplexity"] == res.perplexity


def _save(tmp_path, ids):
    f = tmp_path / "ids.npy"
    np.save(f, np.array(ids, dtype=np.int32))
    return str(f)
