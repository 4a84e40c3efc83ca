"""GPU checks (run on the GPU machine; skipped without CUDA): stages sharing one GPU, bf16."""
import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from strata.model import Transformer  # noqa: E402
from strata.pipeline import Pipeline  # noqa: E402
from strata.weights import model_args, slice_tensors  # noqa: E402

MODEL = "synthetic:smoke-wide"


def single_process_logits(ids, chunk):
    args = model_args(MODEL)
    t = Transformer(args)
    t.load_weights(slice_tensors(MODEL, args, 0, args.n_layers, device="cuda:0", dtype=torch.bfloat16),
                   "cuda:0", torch.bfloat16)
    t.setup_cache(ids.size)
    x = torch.from_numpy(ids.astype(np.int64)).view(1, -1).cuda()
    h = torch.cat([t(x[:, p:p + chunk], p) for p in range(0, ids.size, chunk)], dim=1)
    return t.logits(h[0, -1]).cpu().numpy()


@pytest.mark.parametrize("n_stages", [2, 4])
def test_stages_sharing_one_gpu(tmp_path, n_stages):
    tokens, chunk = 8192, 1024
    cfg = dict(model=MODEL, dtype="bfloat16", stages=[{"device": "cuda:0"}] * n_stages, chunk=chunk,
               prompt={"random": {"tokens": tokens, "seed": 5}}, dump_residual=True, progress=False)
    reports, logits = {}, {}
    for depth in (0, 1):
        with Pipeline(dict(cfg, depth=depth), out=tmp_path / f"d{depth}", console=False) as p:
            res = p.prefill()
            ids = p.plan.ids
        reports[depth], logits[depth] = res.report, res.last_logits
    assert reports[0]["residual_md5"] == reports[1]["residual_md5"]
    assert np.array_equal(logits[0], logits[1])
    ref = single_process_logits(ids, chunk)
    rel = np.linalg.norm(logits[1] - ref) / np.linalg.norm(ref)
    assert rel < 2e-2, rel
    rep = reports[1]
    assert rep["pinned"] and all(s["pinned"] for s in rep["stages"])
    work = sum(s["work_s"] for s in rep["stages"])
    copy = sum(s["copy_s"] for s in rep["stages"])
    print(f"{n_stages} stages: rel {rel:.2e}, copy {copy:.4f}s of work {work:.3f}s ({copy / work:.2%}), "
          f"pinned {rep['handoff_pinned_bytes']:,} bytes, tok/s d0 {reports[0]['tok_s']:.0f} d1 {rep['tok_s']:.0f}")
    assert copy <= 0.01 * work
