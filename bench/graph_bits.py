"""Record the CUDA-graph decode's outputs on tiny models of each family, to compare two trees bit for bit on a GPU.

The graph bodies (strata.decode.graphs, strata.decode.batch_graphs) run the one layer body (strata.models.layer) with the fused
kernels as its ops; this checks that a tree captures the same arithmetic as another, replay for replay:

    python bench/graph_bits.py record ROOT OUT.pt      # ROOT: the tree whose strata runs (needs CUDA)
    python bench/layer_bits.py compare BEFORE.pt AFTER.pt

Per family of bench/layer_bits.py (in bfloat16, and the resident Q4_K_M ones with the dp4a products): one sequence's
one-token steps replayed from the one-sequence graphs (GraphedDecode.decode_token, two buckets), then three slots'
decode batches replayed from the batch graphs (GraphedDecode.decode_seqs: rows, and steps one replay a row).
"""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import torch


def record(root: str, path: str, device: str = "cuda") -> None:
    sys.path.insert(0, str(Path(root).resolve()))
    sys.path.insert(1, str(Path(__file__).resolve().parent))
    import strata
    if not Path(strata.__file__).resolve().is_relative_to(Path(root).resolve()):
        raise SystemExit(f"strata imported from {strata.__file__}, not {root}")
    import layer_bits
    # (--device=cpu: a dry run of this script where nothing is graphable)
    dev = layer_bits.DEVICE = device
    from strata.config import KernelSpec
    GraphedDecode = layer_bits.mod("strata.decode.graphs").GraphedDecode
    res = {}
    for name, (args, opts) in layer_bits.tiny_cases().items():
        if opts.get("long"):
            continue
        opts = {**opts, "dtype": torch.bfloat16}
        args = replace(args, max_seq_len=4096)
        g = torch.Generator().manual_seed(11)
        ids = torch.randint(0, args.vocab_size, (1, 600), generator=g).to(dev)
        out = {}
        with torch.inference_mode():
            m = layer_bits.build(args, opts, 600)
            if opts.get("qtype"):
                m.set_kernels(KernelSpec(gemv_q6k="dp4a", gemv_kquant="dp4a"))
            gd = GraphedDecode(m)
            m(ids[:, :250], 0)
            if not gd.graphable(ids[:, :1]):
                print(name, "not graphable: skipped", flush=True)
                continue
            for p in list(range(250, 262)):  # past the first bucket (256)
                h, lg, am = gd.decode_token(ids[:, p:p + 1], p)
                out[f"graph{p}"], out[f"graph{p}.logits"], out[f"graph{p}.am"] = h, lg, am
            for rows in (True, False):
                m = layer_bits.build(args, opts, 300, seqs=3)
                if opts.get("qtype"):
                    m.set_kernels(KernelSpec(gemv_q6k="dp4a", gemv_kquant="dp4a"))
                m.batch_rows = rows
                gd = GraphedDecode(m)
                lens = (17, 9, 23)
                for s, n in enumerate(lens):
                    m.use_slot(s)
                    m(ids[:, :n], 0)
                if not gd.batchable(ids[0, :1]):
                    print(name, "batches not graphable:", gd.batch_refusal(ids[0, :1]), flush=True)
                    break
                pos, tok = list(lens), [5, 17, 101]
                for k, order in enumerate(([0, 1, 2], [2, 0], [1, 2, 0], [0, 1, 2])):
                    x = torch.tensor([tok[s] for s in order], device=dev)
                    h, lg, am = gd.decode_seqs(x, order, [pos[s] for s in order])
                    tag = f"batch.{'rows' if rows else 'steps'}{k}"
                    out[tag], out[tag + ".logits"], out[tag + ".am"] = h, lg, am
                    for t, s in enumerate(order):
                        tok[s], pos[s] = int(am[t]), pos[s] + 1
        for k, v in out.items():
            if v is not None:
                res[f"{name}/{k}"] = v.detach().cpu().clone()
        print(name, "recorded", flush=True)
    torch.save(res, path)
    print(f"{len(res)} tensors -> {path}")


if __name__ == "__main__":
    argv = [a for a in sys.argv if not a.startswith("--device=")]
    if len(argv) != 4 or argv[1] != "record":
        raise SystemExit(__doc__)
    record(argv[2], argv[3], next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--device=")), "cuda"))
