"""A decode batch's time by rows (Transformer.decode_seqs, max_seqs > 1), one process, one thread: SmolLM2 with m
sequences in their own slots, each prefilled with 200 tokens, then steps of m rows at positions 200..200+m-1.

Arms: `blocks` (the C decoder on the file's blocks, decode_weights blocks: each weight block read once a batch),
`rows` (the dense weights through torch's products, all rows at once: decode_batch rows), `steps` (the same, each
row's step alone: decode_batch steps). Printed: ms a step and ms a row, the best of --rounds rounds of --steps calls.

    python bench/decode_rows.py                         # all three arms, 1, 4 and 16 rows
    python bench/decode_rows.py --arms blocks --rows 1,2,4,8,16
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strata.checkpoint import load_stage, model_args, smollm2_path  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", default="blocks,rows,steps")
    ap.add_argument("--rows", default="1,4,16", help="rows a step, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="calls a round")
    ap.add_argument("--kv-dtype", default="bfloat16")
    a = ap.parse_args()
    torch.set_num_threads(1)
    path = str(smollm2_path())
    args = model_args(path)
    rows = [int(r) for r in a.rows.split(",")]
    seqs = max(rows)
    print(f"SmolLM2, one thread, kv {a.kv_dtype}; best of {a.rounds} rounds of {a.steps} steps")
    print(f"{'arm':>7} {'rows':>5} {'ms a step':>10} {'ms a row':>9}")
    for arm in a.arms.split(","):
        m = load_stage(path, args, 0, args.n_layers, device="cpu", dtype=torch.float32, max_len=1024,
                       decode_weights="blocks" if arm == "blocks" else None)
        m.setup_cache(1024, a.kv_dtype, seqs=seqs)
        m.batch_rows = arm != "steps"
        g = torch.Generator().manual_seed(0)
        with torch.inference_mode():
            for s in range(seqs):
                m.use_slot(s)
                m(torch.randint(0, args.vocab_size, (1, 200), generator=g), 0)
            for n in rows:
                slots, pos = list(range(n)), [200 + s for s in range(n)]
                x = torch.randint(0, args.vocab_size, (n,), generator=g)
                m.decode_seqs(x, slots, pos)  # warm-up (writes the same rows again below: the positions stay put)
                best = float("inf")
                for _ in range(a.rounds):
                    t = time.perf_counter()
                    for _ in range(a.steps):
                        m.decode_seqs(x, slots, pos)
                    best = min(best, (time.perf_counter() - t) / a.steps)
                print(f"{arm:>7} {n:>5} {best * 1e3:>10.1f} {best * 1e3 / n:>9.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
