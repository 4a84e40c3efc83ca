"""GGUF model files (the families of strata.models.families): metadata to `ModelArgs`, and one layer range's tensors,
dequantized or as stored blocks."""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from strata.errors import ModelError
from strata.models.args import ModelArgs
from strata.models.model import rope_frequencies
from strata.models.rope import yarn_positions
from strata.models.resident import Quantized
from strata.models.families import (LATENT_FAMILIES, _BY_GGUF, check_gguf_keys, family, gguf_args_extra,
                                     gguf_trunk_layers, supported_gguf)
from strata.models.names import fused_rows, gguf_name, gguf_names, shapes, short, wanted_names
from strata.weights.gguf_files import field_value, one_line, open_model

FLOAT_TYPES = ("F32", "F16", "BF16")  # held dense in the compute dtype in either load mode


# -- metadata -------------------------------------------------------------------------------------
def gguf_model_args(path: Path) -> ModelArgs:
    """A GGUF model's `ModelArgs` (a split model: its first part's metadata, all its parts' tensors)."""
    model = open_model(path)
    reader = model.meta
    arch = field_value(reader, "general.architecture")
    fam = _BY_GGUF.get(arch)
    if fam is None:
        raise ModelError(f"{path}: unsupported architecture {arch!r} (supported: {supported_gguf()})")
    tensors = model.tensors

    def need(key):
        v = field_value(reader, f"{arch}.{key}")
        if v is None:
            raise ModelError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return v

    def get(key, default=None):
        return field_value(reader, f"{arch}.{key}", default)

    check_gguf_keys(fam, model.keys(), get, str(path))
    dim, n_heads = need("embedding_length"), need("attention.head_count")
    n_kv = get("attention.head_count_kv", n_heads)
    if isinstance(n_heads, list) or isinstance(n_kv, list):
        raise ModelError(f"{path}: per-layer head counts are unsupported")
    partial = fam.name in ("qwen3_5", "glm4_moe")  # partial rotary: rope.dimension_count read below
    # latent attention (deepseek2, deepseek32, glm-dsa): the key and value lengths, head_count_kv and the rotary part
    # are its reader's (strata.models.deepseek), which gives head_dim and n_kv_heads
    latent = fam.name in LATENT_FAMILIES
    head_dim = get("attention.key_length") or (None if fam.name == "glm4_moe" else get("rope.dimension_count")) \
        or dim // n_heads
    rot = get("rope.dimension_count")
    if rot is not None and rot != head_dim and not partial and not latent:
        raise ModelError(f"{path}: unsupported partial rotary embedding ({rot} of {head_dim} head dims)")
    if get("attention.value_length", head_dim) != head_dim and not latent:
        raise ModelError(f"{path}: unsupported attention with value length != key length")

    tokens = field_value(reader, "tokenizer.ggml.tokens")
    vocab = get("vocab_size") or (len(tokens) if tokens else None)
    if vocab is None and "token_embd.weight" in tensors:
        vocab = int(tensors["token_embd.weight"].shape[1])
    if vocab is None:
        raise ModelError(f"{path}: cannot tell the vocabulary size")

    theta = float(get("rope.freq_base", 10000.0))
    blocks = int(need("block_count"))
    n_layers = gguf_trunk_layers(fam, get, blocks, str(path))
    if n_layers < blocks and not any(n.startswith("blk.0.") for n in tensors):
        # llama.cpp's converter with --mtp writes the draft head alone (its loader: "mtp_only"), for speculative
        # decoding beside the model's own file
        mtp = f"blk.{n_layers}" + (f"-{blocks - 1}" if blocks - n_layers > 1 else "")
        raise ModelError(f"{path}: holds only the multi-token-prediction draft block ({mtp}, "
                         f"{arch}.nextn_predict_layers = {blocks - n_layers}, as convert_hf_to_gguf.py --mtp writes "
                         f"it), none of the model's {n_layers} layers: load the model's own GGUF")
    extra = gguf_args_extra(fam, get, n_layers, int(dim), int(n_heads), int(head_dim), str(path),
                            names=frozenset(tensors))
    head_dim, n_kv = extra.pop("head_dim", head_dim), extra.pop("n_kv_heads", n_kv)
    scaling = extra.pop("rope_scaling", None) or _rope_scaling(path, reader, arch, tensors, theta, head_dim)
    try:
        args = ModelArgs(
            arch=fam.name, vocab_size=int(vocab), dim=int(dim), n_layers=n_layers,
            n_heads=int(n_heads), n_kv_heads=int(n_kv), head_dim=int(head_dim),
            ffn_dim=int(need("feed_forward_length")),
            norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=theta, rope_scaling=scaling,
            tie_embeddings="output.weight" not in tensors,
            qkv_bias=fam.qkv_bias or "blk.0.attn_q.bias" in tensors, qk_norm=extra.pop("qk_norm", fam.qk_norm),
            **extra,
            max_seq_len=yarn_positions(int(get("context_length", 8192)), scaling),
            bos_id=field_value(reader, "tokenizer.ggml.bos_token_id"),
            eos_id=field_value(reader, "tokenizer.ggml.eos_token_id"))
    except (TypeError, ValueError) as e:
        raise ModelError(f"{path}: inconsistent GGUF metadata ({one_line(e)})") from None
    if args.qkv_bias and arch == "qwen2" and "blk.0.attn_q.bias" not in tensors:
        raise ModelError(f"{path}: qwen2 model without q/k/v biases is unsupported")
    if fam.gguf_keys is not None:
        _refuse_unread(path, args, tensors, blocks)
    return args


def _refuse_unread(path, args: ModelArgs, tensors: dict, blocks: int) -> None:
    """Refuse, in one line, a tensor the file holds that no slice reads (a family listing its keys): a tensor
    llama.cpp uses and Strata left aside would be a variation computed without it. The blocks past the trunk
    (args.n_layers .. block_count, the nextn MTP layers: families.gguf_trunk_layers) are skipped whole, as
    llama.cpp skips them for inference."""
    read = {n for c in wanted_names(args, 0, args.n_layers) for n in gguf_names(c, args)}
    for name in tensors:
        m = re.match(r"blk\.(\d+)\.", name)
        if name in read or (m is not None and args.n_layers <= int(m.group(1)) < blocks):
            continue
        raise ModelError(f"{path}: tensor {name} is not implemented for {family(args.arch).gguf_arch} "
                         "(no layer reads it)")


def _rope_scaling(path, reader, arch, tensors, theta, head_dim) -> dict | None:
    """Llama-3 style scaling, from explicit metadata or recognised in a `rope_freqs` tensor."""
    kind = field_value(reader, f"{arch}.rope.scaling.type")
    factor = field_value(reader, f"{arch}.rope.scaling.factor")
    orig = field_value(reader, f"{arch}.rope.scaling.original_context_length")
    lo = field_value(reader, f"{arch}.rope.scaling.low_freq_factor")
    hi = field_value(reader, f"{arch}.rope.scaling.high_freq_factor")
    if kind not in (None, "none", "llama3") and not (kind == "linear" and factor in (None, 1.0)):
        raise ModelError(f"{path}: unsupported rope scaling {kind!r} (supported: llama3)")
    if kind == "llama3" or (lo is not None and hi is not None):
        if None in (factor, lo, hi, orig):
            raise ModelError(f"{path}: llama3 rope scaling lacks factor/low/high/original_context_length")
        return dict(rope_type="llama3", factor=float(factor), low_freq_factor=float(lo), high_freq_factor=float(hi),
                    original_max_position_embeddings=int(orig))
    if "rope_freqs.weight" not in tensors:
        return None
    # llama.cpp's converter stores Llama-3 scaling only as per-frequency divisors (rope_freqs).
    # Find the standard llama3 parameters that reproduce them exactly, or refuse.
    t = tensors["rope_freqs.weight"]
    divisors = torch.from_numpy(_dequantize(path, t)).double().flatten()
    if divisors.numel() != head_dim // 2:
        raise ModelError(f"{path}: rope_freqs has {divisors.numel()} entries, expected {head_dim // 2}")
    if torch.allclose(divisors, torch.ones_like(divisors)):
        return None
    fmax = float(divisors.max())
    origs = [int(orig)] if orig else [8192, 4096, 16384, 32768]
    for o in origs:
        for lo_, hi_ in ((1.0, 4.0), (1.0, 2.0), (1.0, 8.0)):
            cand = dict(rope_type="llama3", factor=fmax, low_freq_factor=lo_, high_freq_factor=hi_, original_max_position_embeddings=o)
            base = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
            trial = ModelArgs(head_dim=head_dim, rope_theta=theta, rope_scaling=cand, n_heads=1, n_kv_heads=1)
            got = base / rope_frequencies(trial).double()
            if torch.allclose(got, divisors, rtol=1e-3, atol=1e-4):
                return cand
    raise ModelError(f"{path}: unsupported rope scaling: rope_freqs tensor does not match llama3-style parameters")


# -- tensors --------------------------------------------------------------------------------------
def _dequantize(path, t) -> np.ndarray:
    """A GGUF tensor as a float32 numpy array in numpy/torch (HF) dimension order."""
    return _decode(path, t).numpy()


def _decode(path, t) -> torch.Tensor:
    """A GGUF tensor as a float32 torch tensor in HF dimension order.

    Block types through strata.quant's torch kernels (bit-exact with gguf-py on CPU, several times
    faster than its numpy code); gguf-py only for types strata.quant lacks."""
    import gguf

    from strata import quant
    T = gguf.GGMLQuantizationType
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists dims fastest-first
    name = t.tensor_type.name
    try:
        if t.tensor_type == T.F32:
            arr = torch.from_numpy(np.array(t.data, dtype=np.float32))
        elif t.tensor_type == T.F16:
            arr = torch.from_numpy(np.asarray(t.data).view(np.float16).astype(np.float32))
        elif name in quant.SUPPORTED:
            raw = np.asarray(t.data)
            if raw.dtype != np.uint8:
                raw = raw.view(np.uint8)
            arr = quant.dequantize(torch.from_numpy(np.array(raw)), name)  # copied out of the memory map
        else:
            arr = torch.from_numpy(np.asarray(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type),
                                              dtype=np.float32))
    except NotImplementedError:
        raise ModelError(f"{path}: tensor {t.name} has quantization type {name}, "
                         f"which gguf-py cannot dequantize") from None
    except Exception as e:
        raise ModelError(f"{path}: cannot decode tensor {t.name} ({name}): {one_line(e)}") from None
    if arr.numel() != int(np.prod(shape)):
        raise ModelError(f"{path}: tensor {t.name} decodes to {arr.numel()} values, its shape {shape} needs {np.prod(shape)}")
    return arr.reshape(shape).contiguous()


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order (interleaved rotary pairs) back to HF rotate-half order.

    The converter maps HF rows (head, half, i) to (head, i, half); we map them back.
    """
    rows = w.shape[0]
    hd = rows // n_heads
    return w.reshape(n_heads, hd // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


@dataclass(frozen=True)
class TensorFacts:
    """What the file says about one tensor, read from its header only."""
    name: str
    qtype: str               # GGML type name
    shape: tuple[int, ...]   # HF (numpy) dimension order
    stored: int              # bytes between its offset and the next tensor's (or the file's end)

    @property
    def quantized(self) -> bool:
        return self.qtype not in FLOAT_TYPES

    def needed(self) -> int:
        """Bytes its shape needs in its type (rows of whole blocks)."""
        import gguf
        bs, ts = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[self.qtype]]
        rows = int(np.prod(self.shape[:-1])) if len(self.shape) > 1 else 1
        return rows * -(-self.shape[-1] // bs) * ts


def tensor_facts(path: Path) -> dict[str, TensorFacts]:
    """Every tensor's type, shape and the bytes its file (its part, in a split model) holds for it, without
    reading any data."""
    model = open_model(path)
    out = {}
    for i, size in enumerate(model.sizes):
        ts = sorted((t for n, t in model.tensors.items() if model.part_of[n] == i), key=lambda t: t.data_offset)
        for j, t in enumerate(ts):
            end = ts[j + 1].data_offset if j + 1 < len(ts) else size
            out[t.name] = TensorFacts(t.name, t.tensor_type.name, tuple(int(d) for d in reversed(t.shape.tolist())),
                                      int(end - t.data_offset))
    return out


@functools.lru_cache(maxsize=None)
def quant_supported(qtype: str) -> bool:
    """strata.quant can dequantize this block type (asked with one zero block: the public contract only)."""
    import gguf

    from strata import quant
    if qtype in FLOAT_TYPES:
        return True
    if hasattr(quant, "SUPPORTED"):
        return qtype in quant.SUPPORTED
    dequantize = quant.dequantize
    try:
        t = gguf.GGMLQuantizationType[qtype]
        bs, ts = gguf.GGML_QUANT_SIZES[t]
        out = dequantize(torch.zeros(1, ts, dtype=torch.uint8), qtype)
        return tuple(out.shape) == (1, bs)
    except Exception:  # NotImplementedError, ValueError, a missing kernel: all mean "not supported"
        return False


def check_tensors(path: Path, args: ModelArgs, start: int, end: int) -> None:
    """Refuse, in one line naming tensor, type and file, any tensor of [start, end) that is missing, of a
    type strata.quant cannot dequantize, shaped unlike the metadata says, or shorter than its shape needs."""
    facts = tensor_facts(path)
    want = shapes(args)
    for canon, name in ((c, n) for c in wanted_names(args, start, end) for n in gguf_names(c, args)):
        f = facts.get(name)
        if f is None:
            raise ModelError(f"{path}: tensor {name} missing from the file")
        if not quant_supported(f.qtype):
            raise ModelError(f"{path}: tensor {name} has type {f.qtype}, which strata.quant cannot dequantize")
        expect = _file_shape(canon, args, want)
        if f.shape != expect and short(canon) not in family(args.arch).gguf_derived:  # (those: checked at load)
            raise ModelError(f"{path}: tensor {name} ({f.qtype}) has shape {f.shape}, the metadata implies {expect}")
        import gguf
        bs = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[f.qtype]][0]
        if f.shape[-1] % bs:
            raise ModelError(f"{path}: tensor {name} ({f.qtype}) has rows of {f.shape[-1]} values, "
                             f"not whole blocks of {bs}")
        if f.stored < f.needed():
            raise ModelError(f"{path}: tensor {name} ({f.qtype}) holds {f.stored} bytes, its shape {f.shape} "
                             f"needs {f.needed()}")


def has_quantized(path: Path, args: ModelArgs, start: int = 0, end: int | None = None) -> bool:
    facts = tensor_facts(path)
    names = wanted_names(args, start, args.n_layers if end is None else end)
    return any(facts[n].quantized for c in names for n in gguf_names(c, args) if n in facts)


def _file_shape(canon: str, args: ModelArgs, want: dict) -> tuple[int, ...]:
    """The shape the file's tensor for `canon` has: its own, or the fused tensor's that holds it."""
    rows = fused_rows(canon, args, gguf=True)
    s = want[short(canon)]
    return s if rows is None else (rows[2], *s[1:])


def _unpermute_for(args: ModelArgs, s: str, w: torch.Tensor) -> torch.Tensor:
    if not family(args.arch).gguf_permute_qk:
        return w
    if s in ("wq", "bq"):
        return _unpermute(w, args.n_heads)
    if s in ("wk", "bk"):
        return _unpermute(w, args.n_kv_heads)
    return w


def _derive_several(path, tensors: dict, canon: str, args: ModelArgs, expect: tuple) -> torch.Tensor:
    """A canonical tensor its family makes of several file tensors (Family.gguf_derived with a tuple of names), from
    their float32 decodings, checked against the shape the metadata implies."""
    names = gguf_names(canon, args)
    missing = [n for n in names if n not in tensors]
    if missing:
        raise ModelError(f"{path}: tensor {missing[0]} missing from the file")
    try:
        w = family(args.arch).gguf_derived[short(canon)][1](*(_decode(path, tensors[n]) for n in names), args)
    except ModelError as e:
        raise ModelError(f"{path}: tensors {', '.join(names)}: {e}") from None
    if tuple(w.shape) != expect:
        raise ModelError(f"{path}: tensors {', '.join(names)} give {tuple(w.shape)}, the metadata implies {expect}")
    return w.contiguous()


def gguf_slice_tensors(path: Path, args: ModelArgs, start: int, end: int, resident: bool = False) -> dict:
    """Canonical tensors of layers [start, end) (+ embedding / norm and head at the ends).

    Float32 tensors; with `resident`, quantized matrices stay `Quantized` blocks instead (llama's
    q/k row un-permutation moves whole rows, so it applies to the block rows unchanged)."""
    if not 0 <= start < end <= args.n_layers:
        raise ModelError(f"layer range [{start}, {end}) is outside the model's {args.n_layers} layers")
    model = open_model(path)
    tensors = model.tensors
    expect = shapes(args)
    out: dict = {}
    decoded: dict = {}  # a fused tensor's decoding, shared by its parts
    orders: dict = {}  # a column order (gguf_col_order), shared by the layers' matrices
    for canon in wanted_names(args, start, end):
        name = gguf_name(canon, args)
        t = tensors.get(name)
        if t is None:
            raise ModelError(f"{path}: tensor {name} missing from the file")
        s = short(canon)
        fam = family(args.arch)
        if isinstance(fam.gguf_derived.get(s, ("",))[0], tuple):  # made of several tensors (deepseek2's kv_b): dense
            out[canon] = _derive_several(path, tensors, canon, args, expect[s])
            continue
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        want = _file_shape(canon, args, expect)
        rows = fused_rows(canon, args, gguf=True)
        # an expert stack (E, rows, cols) stays as stored too; a router stays float, as llama.cpp keeps it
        if resident and t.tensor_type.name not in FLOAT_TYPES and (len(shape) == 2 or s in ("e_gate", "e_up", "e_down")):
            # a derived matrix (qwen35): its rows taken or reordered on the blocks, or its column order kept aside
            derive, order = fam.gguf_derived.get(s), fam.gguf_col_order.get(s)
            if derive is not None and rows is None:
                want = shape  # (the file's own layout: the derived matrix's shape is checked below)
            if shape != want:
                raise ModelError(f"{path}: tensor {name} has shape {shape}, the metadata implies {want}")
            if not quant_supported(t.tensor_type.name):
                raise ModelError(f"{path}: tensor {name} has type {t.tensor_type.name}, which strata.quant cannot dequantize")
            blocks = np.asarray(t.data)
            if blocks.dtype != np.uint8 or tuple(blocks.shape[:-1]) != shape[:-1]:
                raise ModelError(f"{path}: tensor {name} ({t.tensor_type.name}): unexpected block layout {blocks.shape}")
            if rows is not None:  # whole rows of blocks: a part of a fused tensor is a row range
                blocks = blocks[rows[0]:rows[1]]
            b = torch.from_numpy(np.array(blocks))  # copied out of the memory map
            perm = None
            if order is not None:  # (one tensor for all the slice's layers)
                perm = orders.setdefault(s, order(args))
            elif derive is not None:
                b = derive[1](b, args)
            if tuple(b.shape[:-1]) != expect[s][:-1] or shape[-1] != expect[s][-1]:
                raise ModelError(f"{path}: tensor {name} gives {(*b.shape[:-1], shape[-1])}, the metadata implies "
                                 f"{expect[s]}")
            out[canon] = Quantized(_unpermute_for(args, s, b).contiguous(), t.tensor_type.name, expect[s][-1], perm)
            continue
        derive = family(args.arch).gguf_derived.get(s)
        if derive is not None:  # a layout of the converter's own (qwen35), undone; checked after
            w = derive[1](_decode(model.file_of(name), t), args).contiguous()
            if tuple(w.shape) != expect[s]:
                raise ModelError(f"{path}: tensor {name} gives {tuple(w.shape)}, the metadata implies {expect[s]}")
            out[canon] = w
            continue
        w = decoded.get(name)
        if w is None:
            w = _decode(model.file_of(name), t)
            if tuple(w.shape) != want:
                raise ModelError(f"{path}: tensor {name} has shape {tuple(w.shape)}, the metadata implies {want}")
            if rows is not None:
                decoded[name] = w  # its other parts read the same decoding
        if rows is not None:
            if rows[1] == rows[2]:
                del decoded[name]  # the last part
            w = w[rows[0]:rows[1]]
        out[canon] = _unpermute_for(args, s, w).contiguous()
    return out
