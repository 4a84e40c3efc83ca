"""The baseline users would pick: transformers + accelerate `device_map="auto"` over the visible
GPUs (layers run in turn), on the same synthetic weights and prompt as Strata's benchmarks.

    python bench/accelerate_baseline.py --preset llama-3-70b --tokens 122880 --chunk 10240

Weights are generated on the device accelerate assigns each module to (same seeds as
strata.weights.checkpoint.synthetic_tensors), so nothing is read from disk.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from strata.models.args import PRESETS  # noqa: E402
from strata.weights.checkpoint import hf_name, synthetic_tensors  # noqa: E402

from engine import llama_config  # noqa: E402  (bench/ is on sys.path when run as a script)

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama-3-70b")
    ap.add_argument("--tokens", type=int, default=122880)
    ap.add_argument("--chunk", type=int, default=10240)
    ap.add_argument("--reserve-gib", type=float, default=30.0, help="per-GPU memory left for KV cache and activations")
    a = ap.parse_args()
    import transformers
    from accelerate import dispatch_model, infer_auto_device_map
    from accelerate.utils import get_balanced_memory, set_module_tensor_to_device

    args = PRESETS[a.preset]
    dtype = torch.bfloat16
    cfg = llama_config(args, dtype)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg).to(dtype)
    n_gpu = torch.cuda.device_count()
    total = [torch.cuda.mem_get_info(i)[1] for i in range(n_gpu)]
    max_memory = {i: int(t - a.reserve_gib * 2**30) for i, t in enumerate(total)}
    # what device_map="auto" does in from_pretrained: balance the layers over the GPUs first
    max_memory = get_balanced_memory(model, max_memory=max_memory, no_split_module_classes=["LlamaDecoderLayer"],
                                     dtype=dtype)
    device_map = infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=["LlamaDecoderLayer"],
                                       dtype=dtype)
    t0 = time.perf_counter()

    def where(name):
        parts = name.split(".")
        for k in range(len(parts), 0, -1):
            if ".".join(parts[:k]) in device_map:
                return device_map[".".join(parts[:k])]
        return device_map.get("", 0)

    for i in range(args.n_layers):
        dev = torch.device(f"cuda:{where(f'model.layers.{i}')}")
        for canon, t in synthetic_tensors(args, i, i + 1, dev, dtype, seed=0).items():
            if canon.startswith("layers."):
                set_module_tensor_to_device(model, hf_name(canon), dev, value=t)
    for canon, hf in (("embed", "model.embed_tokens.weight"), ("norm", "model.norm.weight"), ("head", "lm_head.weight")):
        dev = torch.device(f"cuda:{where(hf)}")
        t = synthetic_tensors(args, 0 if canon == "embed" else args.n_layers - 1,
                              1 if canon == "embed" else args.n_layers, dev, dtype, seed=0)[canon]
        set_module_tensor_to_device(model, hf, dev, value=t)
    with torch.device(f"cuda:{where('model.rotary_emb')}"):
        model.model.rotary_emb = type(model.model.rotary_emb)(config=cfg)
    model = dispatch_model(model.eval(), device_map=device_map)
    layers_per_gpu = {}
    for k, v in device_map.items():
        if k.startswith("model.layers."):
            layers_per_gpu[v] = layers_per_gpu.get(v, 0) + 1
    print(f"loaded in {time.perf_counter() - t0:.1f}s; layers per GPU {layers_per_gpu}", flush=True)

    from transformers import DynamicCache
    first = f"cuda:{where('model.embed_tokens')}"
    ids = torch.randint(0, args.vocab_size, (1, a.tokens), generator=torch.Generator().manual_seed(0)).to(first)
    with torch.inference_mode():
        model(input_ids=ids[:, :1024], logits_to_keep=1)  # warm-up
        cache = DynamicCache()
        for i in range(n_gpu):
            torch.cuda.synchronize(i)
        start = time.perf_counter()
        for p in range(0, a.tokens, a.chunk):
            x = ids[:, p:p + a.chunk]
            model(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1,
                  cache_position=torch.arange(p, p + x.shape[1], device=first))
        for i in range(n_gpu):
            torch.cuda.synchronize(i)
        sec = time.perf_counter() - start
    print(f"transformers + accelerate device_map=auto on {n_gpu} GPU(s), {a.preset} bf16, {a.tokens:,} tokens, "
          f"chunk {a.chunk:,}: {sec:.1f} s, {a.tokens / sec:,.0f} tok/s")


if __name__ == "__main__":
    main()
