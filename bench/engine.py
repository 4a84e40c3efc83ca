"""One stage on one GPU: Strata's engine next to transformers' LlamaForCausalLM, same weights.

    python bench/engine.py --preset llama-3-8b --tokens 122880 --chunk 10240 --hf --attn flash,cudnn-split --profile
    python bench/engine.py --attn cudnn-split --kernels triton,torch --runs 2 --profile   # the prefill A/B (issue 14)

Prints tok/s of each engine (same chunks), a bf16 correctness check on a small model against
transformers in float32, and optionally the per-op CUDA time of one late chunk and its time by kernel
category (attention / GEMM / elementwise). Each Strata variant first warms up as a CUDA stage does at
load (a chunk at 0 and at `chunk`, then cuDNN's graphs of every later prefix length: `--warm stage`;
`--warm small` is the old 2,048-token warm-up), so its first timed run is what a cold launcher run
pays; its second (`--runs 2`) is warm. cuDNN's graphs are process-wide: only the first variant is cold.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import strata.kernels.attention as sm  # noqa: E402
from strata.models.args import PRESETS  # noqa: E402
from strata.config import KernelSpec  # noqa: E402
from strata.models.model import Transformer  # noqa: E402
from strata.weights.checkpoint import hf_name, synthetic_tensors  # noqa: E402


def llama_config(args, dtype):
    """transformers' LlamaConfig for a ModelArgs (the reference side of every GPU comparison)."""
    import transformers
    return transformers.LlamaConfig(
        vocab_size=args.vocab_size, hidden_size=args.dim, intermediate_size=args.ffn_dim,
        num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads, num_key_value_heads=args.n_kv_heads,
        head_dim=args.head_dim, rms_norm_eps=args.norm_eps, rope_theta=args.rope_theta,
        max_position_embeddings=args.max_seq_len, tie_word_embeddings=args.tie_embeddings,
        rope_scaling=dict(rope_type="llama3", **args.rope_scaling) if args.rope_scaling else None,
        attn_implementation="sdpa", torch_dtype=dtype)


def hf_model(args, tensors, dtype, device):
    import transformers
    cfg = llama_config(args, dtype)
    with torch.device("meta"):
        m = transformers.LlamaForCausalLM(cfg)
    sd = {hf_name(k): v for k, v in tensors.items()}
    sd.setdefault("lm_head.weight", tensors["embed"])  # tied
    m.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in sd.items()}, strict=False, assign=True)
    with torch.device(device):  # its inv_freq buffer was built on meta
        m.model.rotary_emb = type(m.model.rotary_emb)(config=cfg)
    return m.eval()


def strata_model(args, tensors, dtype, device):
    with torch.device("meta"):
        t = Transformer(args)
    t.load_weights(tensors, device, dtype)
    return t.eval()


def warm_strata(t, ids, chunk, how):
    """Before the timed runs: `stage` does what workers/stage.py's _warm_up does for this schedule, `small`
    the old short warm-up (2,048 tokens in chunks of 1,024). Returns seconds."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    if how == "small":
        time_strata(t, ids[:, :2048], 1024)
    else:
        t.setup_cache(ids.shape[1])  # the timed run's cache length: the keys' strides (cuDNN's graph key) match
        n = min(chunk, ids.shape[1] // 2)
        for pos in (0, n):
            t.logits(t(ids[:, pos:pos + n], pos)[0, -1:])
        sm.warm_chunk_attention(t, [(p, n) for p in range(2 * n, ids.shape[1] - n + 1, n)])
    torch.cuda.synchronize()
    return time.perf_counter() - t0


# kernel name fragments -> category; attention first (cuDNN's attention kernels also name wgmma)
CATEGORIES = (("attention", ("attention", "fmha", "flash", "sdpa", "cudnn")),
              ("GEMM", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "matmul", "wgmma")))


def kernel_category(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "elementwise"  # norms, rope, SiLU*up, residual adds, cache writes, the LSE merge, copies


def category_table(prof) -> tuple[dict[str, float], list[tuple[str, float]]]:
    """CUDA kernel time (ms) per category, and the elementwise kernels by time."""
    cats = {"attention": 0.0, "GEMM": 0.0, "elementwise": 0.0}
    elem = []
    for e in prof.key_averages():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        ms = e.self_device_time_total / 1e3
        cat = kernel_category(e.key)
        cats[cat] += ms
        if cat == "elementwise":
            elem.append((e.key, ms))
    return cats, sorted(elem, key=lambda r: -r[1])


def time_strata(t, ids, chunk):
    t.setup_cache(ids.shape[1])
    torch.cuda.synchronize()
    start = time.perf_counter()
    per_chunk = []
    for p in range(0, ids.shape[1], chunk):
        c0 = time.perf_counter()
        h = t(ids[:, p:p + chunk], p)
        t.logits(h[0, -1:])
        torch.cuda.synchronize()
        per_chunk.append(time.perf_counter() - c0)
    return time.perf_counter() - start, per_chunk


@torch.inference_mode()
def time_hf(m, ids, chunk):
    from transformers import DynamicCache
    cache = DynamicCache()
    torch.cuda.synchronize()
    start = time.perf_counter()
    per_chunk = []
    for p in range(0, ids.shape[1], chunk):
        c0 = time.perf_counter()
        x = ids[:, p:p + chunk]
        m(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1,
          cache_position=torch.arange(p, p + x.shape[1], device=ids.device))
        torch.cuda.synchronize()
        per_chunk.append(time.perf_counter() - c0)
    del cache
    return time.perf_counter() - start, per_chunk


@torch.inference_mode()
def correctness(device):
    """bf16 engine vs transformers float32 on a small synthetic model; chunked vs whole."""
    args = PRESETS["smoke-wide"]
    tensors = synthetic_tensors(args, 0, args.n_layers, device, torch.float32, seed=1)
    ref = hf_model(args, tensors, torch.float32, device)
    ids = torch.randint(0, args.vocab_size, (1, 1500), device=device, generator=torch.Generator(device).manual_seed(0))
    want = ref(ids).logits[0].float()
    rows = []
    for mode, kernels in (("flash", "torch"), ("cudnn-split", "torch"), ("cudnn-split", "triton")):
        t = strata_model(args, dict(tensors), torch.bfloat16, device)  # load_weights consumes its dict
        t.set_kernels(KernelSpec(prefill=kernels), attention=mode)
        t.setup_cache(ids.shape[1])
        h = torch.cat([t(ids[:, p:p + 256], p) for p in range(0, ids.shape[1], 256)], dim=1)
        got = t.logits(h[0])
        rel = ((got - want).norm() / want.norm()).item()
        rows.append((f"{mode}, kernels {kernels}", rel))
    return rows


def variants(a) -> list[tuple[str, str]]:
    """(attention, kernels) pairs to time: every --attn with every --kernels."""
    return [(mode, k) for mode in a.attn.split(",") for k in a.kernels.split(",")]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama-3-8b")
    ap.add_argument("--tokens", type=int, default=122880)
    ap.add_argument("--chunk", type=int, default=10240)
    ap.add_argument("--attn", default="flash,cudnn-split")
    ap.add_argument("--kernels", default="triton",
                    help="the rig's kernels.prefill: triton (fused LSE merge, RoPE, "
                         "SiLU*up), torch, or triton,torch (A/B in one run)")
    ap.add_argument("--warm", default="stage", choices=("stage", "small"), help="warm-up before the timed runs")
    ap.add_argument("--runs", type=int, default=1, help="timed prefills per variant (the first is the cold one)")
    ap.add_argument("--hf", action="store_true")
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    device = torch.device("cuda:0")
    dtype = torch.bfloat16
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    for mode, rel in correctness(device):
        print(f"correctness smoke-wide bf16 vs transformers fp32 ({mode}): rel {rel:.2e}  (bf16 tolerance 2e-2)")
    args = PRESETS[a.preset]
    tensors = synthetic_tensors(args, 0, args.n_layers, device, dtype, seed=0)
    ids = torch.randint(0, args.vocab_size, (1, a.tokens), device=device, generator=torch.Generator(device).manual_seed(0))
    rows = []
    if a.hf:
        m = hf_model(args, tensors, dtype, device)
        time_hf(m, ids[:, :2048], 1024)  # warm-up
        sec, per = time_hf(m, ids, a.chunk)
        rows.append(("transformers sdpa", sec, per))
        print(f"transformers: {a.tokens / sec:,.0f} tok/s", flush=True)
        del m
        torch.cuda.empty_cache()
    t = strata_model(args, tensors, dtype, device)
    del tensors
    for mode, kernels in variants(a):
        t.set_kernels(KernelSpec(prefill=kernels), attention=mode)
        name = f"strata {mode} {kernels}"
        warm = warm_strata(t, ids, a.chunk, a.warm)
        for r in range(a.runs):
            sec, per = time_strata(t, ids, a.chunk)
            label = name if a.runs == 1 else f"{name} #{r + 1}"
            rows.append((label, sec, per))
            print(f"{label}: {a.tokens / sec:,.0f} tok/s (warm-up {warm:.1f} s); chunks s: "
                  + " ".join(f"{x:.3f}" for x in per), flush=True)
    print(f"\n{a.preset} bf16, {a.tokens:,} tokens, chunk {a.chunk:,}, one GPU (warm-up: {a.warm})")
    base = rows[0][1]
    print(f"{'engine':<30}{'tok/s':>10}{'vs first':>10}{'first chunk s':>15}{'last chunk s':>14}")
    for name, sec, per in rows:
        print(f"{name:<30}{a.tokens / sec:>10,.0f}{base / sec:>10.2f}{per[0]:>15.3f}{per[-1]:>14.3f}")
    if a.profile:
        from torch.profiler import ProfilerActivity, profile
        p = a.tokens - a.chunk  # the cache still holds the timed run's real keys and values
        tables = []
        for mode, kernels in variants(a):
            t.set_kernels(KernelSpec(prefill=kernels), attention=mode)
            t(ids[:, p:], p)  # unprofiled once: nothing left to set up
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                t(ids[:, p:], p)
                torch.cuda.synchronize()
            name = f"{mode}, kernels {kernels}"
            print(f"\nper-op CUDA time, one chunk of {a.chunk} at position {p:,} ({name}):")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
            cats, elem = category_table(prof)
            tables.append((name, cats))
            print("elementwise kernels (ms): " + "; ".join(f"{k[:50]} {ms:.1f}" for k, ms in elem[:10]))
        print(f"\nCUDA kernel time by category, one chunk of {a.chunk:,} at position {p:,} (ms):")
        print(f"{'variant':<32}{'attention':>11}{'GEMM':>9}{'elementwise':>13}{'total':>9}")
        for name, c in tables:
            print(f"{name:<32}{c['attention']:>11.1f}{c['GEMM']:>9.1f}{c['elementwise']:>13.1f}{sum(c.values()):>9.1f}")


if __name__ == "__main__":
    main()
