"""Record the outputs of every eager layer path on tiny models of each family, to compare two trees bit for bit.

A refactor of the decoder layer (issue 55: one layer body for every path) must not move a bit. This runs the same
seeded work through a tree's strata and saves every residual, logits row and cache it produced:

    python bench/layer_bits.py record ROOT OUT.pt [--graphs | --graphs-only] [--only=NAME,...] [--device=cuda]
    python bench/layer_bits.py compare BEFORE.pt AFTER.pt                        # torch.equal on every tensor

Paths: chunked prefill (two chunks, a window passed), the decode path of a few rows (forward with T <= DECODE_T),
one-token steps (decode_token), a decode batch as rows and as steps (decode_seqs, three slots), a prefill group
(forward_group), and CPU weight-only decode (int8 / int4 / float16) where the slice takes it. --graphs adds the
CUDA-graph bodies run eagerly on CPU (DecodeGraphs._body; with TRITON_INTERPRET=1 in the environment the split-K
and fused Triton kernels under Triton's interpreter, and BatchGraphs.body): slow, so only on a few families.
Families: tiny shapes of strata.models.args.PRESETS (llama3 rope, qwen3 q/k norms, gemma3 post norms / GeGLU / windows,
mistral, gpt-oss sinks / experts / biases, qwen3 MoE, qwen3.5 linear attention and output gate), a GLM-like
sigmoid router with a shared expert, and resident Q4_K_M blocks (synthetic:...@Q4_K_M's types).
"""
from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path

import torch


# the modules this reads, by their names in the packages (issue 55) and in the flat layout before them: a tree of
# either layout can be recorded
FLAT = {"strata.models.args": "strata.args", "strata.weights.checkpoint": "strata.checkpoint",
        "strata.models.model": "strata.model", "strata.decode.graphs": "strata.decode_graphs",
        "strata.decode.batch_graphs": "strata.batch_graphs"}


def mod(name: str):
    """strata's module `name`, or its flat-layout namesake in a tree from before the packages."""
    import importlib
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError:
        return importlib.import_module(FLAT[name])


def tiny_cases():
    PRESETS = mod("strata.models.args").PRESETS
    small = dict(vocab_size=300, dim=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128, max_seq_len=4096)
    P = PRESETS
    LIN4 = (True, True, True, False)  # qwen3.5's three linear layers to one full attention
    cases = {
        "llama3": (replace(P["llama-3-8b"], n_layers=3, **small), {}),
        "qwen3": (replace(P["qwen3-8b"], n_layers=3, **small), {}),
        "qwen3-yarn": (replace(P["qwen3-8b-yarn"], n_layers=2, **small), {}),
        "gemma3": (replace(P["gemma-3-27b"], n_layers=4, embed_scale=8.0, sliding_window=8,
                           window_layers=(True, True, False, True), final_softcap=30.0, **small), {}),
        "mistral": (replace(P["mistral-small-24b"], n_layers=2, **small), {}),
        "gpt-oss": (replace(P["gpt-oss-20b"], n_layers=4, sliding_window=8, window_layers=(True, False, True, False),
                            n_experts=4, n_experts_used=2, expert_ffn_dim=32, **small), {}),
        "qwen3-moe": (replace(P["qwen3-30b-a3b"], n_layers=3, n_experts=4, n_experts_used=2, expert_ffn_dim=32,
                              **small), {}),
        "glm-like": (replace(P["qwen3-30b-a3b"], arch="glm4_moe", n_layers=3, qk_norm=False, qkv_bias=True,
                             n_experts=4, n_experts_used=2, expert_ffn_dim=32, router="sigmoid", router_groups=2,
                             router_groups_used=1, routed_scale=2.5, shared_ffn_dim=32, first_dense_layers=1,
                             rotary_dim=8, **small), {}),
        "qwen3.5": (replace(P["qwen3.5-9b"], n_layers=4, linear_layers=LIN4, rotary_dim=8, lin_k_heads=2, lin_k_dim=16,
                            lin_v_heads=4, lin_v_dim=16, **small), {}),
        "llama3-bf16": (replace(P["llama-3-8b"], n_layers=2, **small), {"dtype": torch.bfloat16}),
        "qwen3-bf16kv": (replace(P["qwen3-8b"], n_layers=2, **small), {"kv": "bfloat16"}),
        "qwen3-bf16kv-long": (replace(P["qwen3-8b"], n_layers=2, **small), {"kv": "bfloat16", "long": True}),
        "llama3-q8kv": (replace(P["llama-3-8b"], n_layers=2, **{**small, "head_dim": 32}), {"kv": "q8_0"}),
        "smoke-Q4_K_M": (replace(P["smoke"], n_layers=2, vocab_size=300), {"qtype": "Q4_K_M"}),
        "smoke-moe-Q4_K_M": (replace(P["smoke-moe"], n_layers=2, vocab_size=300), {"qtype": "Q4_K_M"}),
        "qwen3.5-Q4_K_M": (replace(P["qwen3.5-9b"], n_layers=4, linear_layers=LIN4, vocab_size=300, dim=256, n_heads=4,
                                   n_kv_heads=2, head_dim=64, ffn_dim=256, rotary_dim=16, lin_k_heads=2, lin_k_dim=32,
                                   lin_v_heads=4, lin_v_dim=32, max_seq_len=4096), {"qtype": "Q4_K_M"}),
    }
    return cases


# the device the models are built on (the GPU check, bench/device_layer.sh, runs this on CUDA too)
DEVICE = "cpu"  # record --device=cuda: the CUDA paths


def build(args, opts: dict, max_len: int, seqs: int = 1, start: int = 0, end: int | None = None):
    synthetic_tensors = mod("strata.weights.checkpoint").synthetic_tensors
    Transformer = mod("strata.models.model").Transformer
    end = args.n_layers if end is None else end
    dtype, q = opts.get("dtype", torch.float32), opts.get("qtype")
    with torch.device("meta"):
        m = Transformer(args, start, end)
    m.load_weights(synthetic_tensors(args, start, end, DEVICE, dtype, seed=7, qtype=q, resident=q is not None),
                   DEVICE, dtype)
    m.setup_cache(max_len, opts.get("kv", "auto"), seqs=seqs)
    return m.eval()


def record_case(name: str, args, opts: dict, graphs: bool, graphs_only: bool = False) -> dict:
    out: dict[str, torch.Tensor] = {}
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, args.vocab_size, (1, 40), generator=g).to(DEVICE)
    if graphs_only:  # (resident models under Triton's interpreter: its dp4a kernels are slow there)
        with torch.inference_mode():
            return _graph_bodies(args, opts, ids)
    with torch.inference_mode():
        # one sequence: two prefill chunks (the second past any window), decode rows, one-token steps
        m = build(args, opts, 2100 if opts.get("long") else 64)
        h = m(ids[:, :20], 0)
        out["prefill0"], out["prefill0.logits"] = h, m.logits(h[0, -1:])
        h = m(ids[:, 20:30], 20)
        out["prefill1"] = h
        out["rows3"] = m(ids[:, 30:33], 30)
        for p in range(33, 38):
            h, lg, am = m.decode_token(ids[:, p:p + 1], p)
            out[f"step{p}"], out[f"step{p}.logits"], out[f"step{p}.am"] = h, lg, am
        for i, blk in m.layers.items():
            if not blk.linear:
                out[f"cache{i}.k"], out[f"cache{i}.v"] = _bytes(blk.attn.k_cache), _bytes(blk.attn.v_cache)
            else:
                out[f"state{i}"], out[f"conv{i}"] = blk.attn.state.clone(), blk.attn.conv_state.clone()
        if opts.get("long"):  # past BF16_ATTENTION_FROM: a bfloat16 cache read as it is by one-token steps
            h = m(torch.randint(0, args.vocab_size, (1, 2100), generator=g)[:, 38:].to(DEVICE), 38)
            for p in range(2062, 2065):
                out[f"long{p}"] = m.decode_token(ids[:, p % 40:p % 40 + 1], p)[0]
        # two stages, three slots: prefill each, then decode batches as rows and as steps, and a prefill group
        for batch_rows in (True, False):
            s0, s1 = (build(args, opts, 64, seqs=3, start=a, end=b)
                      for a, b in ((0, args.n_layers // 2), (args.n_layers // 2, args.n_layers)))
            s0.batch_rows = s1.batch_rows = batch_rows
            lens = (17, 9, 23)
            for s, n in enumerate(lens):
                s0.use_slot(s), s1.use_slot(s)
                s1(s0(ids[:, :n], 0), 0)
            pos, tok = list(lens), [5, 17, 101]
            for k, order in enumerate(([0, 1, 2], [2, 0], [1, 2, 0])):
                x = torch.tensor([tok[s] for s in order], device=DEVICE)
                hh, _, _ = s0.decode_seqs(x, order, [pos[s] for s in order])
                o, lg, am = s1.decode_seqs(hh, order, [pos[s] for s in order])
                tag = f"seqs.{'rows' if batch_rows else 'steps'}{k}"
                out[tag], out[tag + ".logits"], out[tag + ".am"] = o, lg, am
                for t, s in enumerate(order):
                    tok[s], pos[s] = int(am[t]), pos[s] + 1
            if batch_rows and args.group_refusal() is None:
                segs = [(2, pos[2], 5), (0, pos[0], 3), (1, 0, 9)]
                x = torch.cat([ids[:, :5], ids[:, 5:8], ids[:, :9]], 1)
                out["group"] = s1.forward_group(s0.forward_group(x, segs), segs)
        # CPU weight-only decode
        if _weight_only_ok(args, opts) and DEVICE == "cpu":
            for kind in ("int8", "int4", "float16"):
                m = build(args, opts, 64, seqs=3)
                m(ids[:, :20], 0)
                m.set_decode_weights(kind)
                for p in range(20, 23):
                    h, lg, am = m.decode_token(ids[:, p:p + 1], p)
                    out[f"wo.{kind}.step{p}"], out[f"wo.{kind}.step{p}.logits"] = h, lg
                out[f"wo.{kind}.rows3"] = m(ids[:, 23:26], 23)
                m.use_slot(1), m(ids[:, :9], 0), m.use_slot(0)
                hh, lg, am = m.decode_seqs(torch.tensor([3, 4], device=DEVICE), [0, 1], [26, 9])
                out[f"wo.{kind}.seqs"], out[f"wo.{kind}.seqs.logits"] = hh, lg
        if graphs and DEVICE == "cpu":
            out.update(_graph_bodies(args, opts, ids))
    return out


def _weight_only_ok(args, opts) -> bool:
    return (not args.n_experts and args.linear_layers is None and opts.get("qtype") is None
            and opts.get("dtype", torch.float32) == torch.float32 and args.dim % 32 == 0)


def _graph_bodies(args, opts, ids) -> dict:
    """DecodeGraphs' and (under Triton's interpreter) BatchGraphs' bodies, run eagerly on CPU."""
    graphs = mod("strata.decode.graphs")
    DecodeGraphs, covers = graphs.DecodeGraphs, graphs.covers
    out = {}
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if not covers(args) or (opts.get("qtype") and not interpreted):  # (resident: dp4a kernels, CUDA or interpreted)
        return out
    m = _dp4a(build(args, opts, 300), opts)
    m(ids[:, :20], 0)
    dg = DecodeGraphs(m)
    for p in range(20, 23):
        (dg.ids if dg.ids is not None else dg.res).copy_(ids[:, p:p + 1])
        dg.pos.fill_(p)
        for la in dg.linear:
            la.begin(p)
        h, lg, am = dg._body(dg.bucket(p))
        for la in dg.linear:
            la.state_pos = p + 1
        out[f"graph.step{p}"] = h.clone()
        if lg is not None:
            out[f"graph.step{p}.logits"], out[f"graph.step{p}.am"] = lg.clone(), am.clone()
    if os.environ.get("TRITON_INTERPRET") == "1":
        batch = mod("strata.decode.batch_graphs")
        BatchGraphs, batch_refusal = batch.BatchGraphs, batch.batch_refusal
        m = _dp4a(build(args, opts, 300, seqs=3), opts)
        lens = (17, 9, 23)
        for s, n in enumerate(lens):
            m.use_slot(s)
            m(ids[:, :n], 0)
        if batch_refusal(m, ids) is None:
            bg = BatchGraphs(m, DecodeGraphs(m))
            order, pos = [2, 0, 1], [lens[2], lens[0], lens[1]]
            r = 4
            bg.ids[:r] = torch.tensor([5, 17, 101, 5])
            bg.pos[:r] = torch.tensor(pos + [pos[0]])
            bg.slot[:r] = torch.tensor(order + [order[0]])
            bg.base[:r] = 0
            bg.live[:r] = torch.arange(r) < 3
            for la in bg.linear:
                la.begin_rows(order, pos)
            h, lg, am = bg.body(r, bg.bucket(max(pos)))
            out["batch.body"], out["batch.body.logits"], out["batch.body.am"] = h.clone(), lg.clone(), am.clone()
    return out


def _dp4a(m, opts: dict):
    """A resident model's products by the dp4a kernels, which read x's int8 rounding from the kernel before them."""
    if opts.get("qtype"):
        from strata.config import KernelSpec
        m.set_kernels(KernelSpec(gemv_q6k="dp4a", gemv_kquant="dp4a"))
    return m


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.clone() if t.element_size() != 1 else t.view(torch.uint8).clone()


def record(root: str, path: str, graphs: bool, only: list[str] | None, graphs_only: bool = False) -> None:
    sys.path.insert(0, str(Path(root).resolve()))
    import strata
    if not Path(strata.__file__).resolve().is_relative_to(Path(root).resolve()):
        raise SystemExit(f"strata imported from {strata.__file__}, not {root}")
    torch.manual_seed(0)
    res = {}
    for name, (args, opts) in tiny_cases().items():
        if only and name not in only:
            continue
        for k, v in record_case(name, args, opts, graphs, graphs_only).items():
            res[f"{name}/{k}"] = v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v
        print(name, "recorded", flush=True)
    torch.save(res, path)
    print(f"{len(res)} tensors -> {path}")


def compare(a: str, b: str) -> int:
    A, B = torch.load(a), torch.load(b)
    bad = sorted(k for k in A.keys() & B.keys() if not (A[k].dtype == B[k].dtype and torch.equal(A[k], B[k])))
    missing = sorted(A.keys() ^ B.keys())
    for k in bad:
        print("DIFFERS", k)
    for k in missing:
        print("ONLY IN ONE", k)
    print(f"{len(A.keys() & B.keys())} tensors compared, {len(bad)} differ, {len(missing)} in one file only")
    return 1 if bad or missing else 0


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "record":
        only = next((a.split("=", 1)[1].split(",") for a in sys.argv if a.startswith("--only=")), None)
        DEVICE = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--device=")), DEVICE)
        record(sys.argv[2], sys.argv[3], "--graphs" in sys.argv, only, "--graphs-only" in sys.argv)
    elif cmd == "compare":
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    else:
        raise SystemExit(__doc__)
