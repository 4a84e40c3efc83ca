"""Write a random-weight Llama GGUF of a preset's shape in one quantization type, streaming.

For benchmarks (llama.cpp's llama-bench, Strata) where only shapes and types matter: every
quantized tensor is `strata.quant.random_blocks` (random bytes, finite scales, weights ~0.02),
norms are F32 near 1. No vocabulary: `tokenizer.ggml.model = "none"` and `llama.vocab_size`
make llama.cpp add dummy tokens; Strata runs it with random-id prompts. Tensors are generated
and written one at a time, so a 28 GB file needs about one tensor's worth of memory.

    python bench/make_gguf.py --preset llama-3-70b --qtype IQ3_S --out /data/l70-iq3s.gguf
    python bench/make_gguf.py --preset smoke --qtype Q4_K --out /tmp/smoke.gguf --layers 2
    python bench/make_gguf.py --preset llama-3-8b --qtype Q4_K_M --out /tmp/8b-q4km.gguf --device cuda
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strata.args import PRESETS, ModelArgs  # noqa: E402

from strata.model import rope_frequencies  # noqa: E402
from strata.quant import MIXES, block_size, mix_type, qtype_of, random_blocks, type_size  # noqa: E402


@dataclass(frozen=True)
class Planned:
    name: str
    shape: tuple[int, ...]  # numpy order: (rows, cols) or (n,)
    qtype: str


def tensor_type(qtype: str, cols: int) -> str:
    """The type a tensor of `cols` columns gets: `qtype` if its blocks fit the row, else (like
    llama.cpp's quantizer) Q8_0, else F16."""
    if cols % block_size(qtype) == 0:
        return qtype
    return "Q8_0" if cols % 32 == 0 else "F16"


def plan(args: ModelArgs, qtype: str) -> list[Planned]:
    """Every tensor of a llama GGUF, in llama.cpp's order and names."""
    dim, hd, ffn = args.dim, args.head_dim, args.ffn_dim
    role = {"attn_v": "wv", "ffn_down": "w_down", "output": "head"}  # what a mix widens (strata.quant.MIXES)
    mat = lambda name, rows, cols: Planned(  # noqa: E731
        name, (rows, cols), tensor_type(mix_type(qtype, role.get(name.split(".")[-2], "")), cols))
    out = [mat("token_embd.weight", args.vocab_size, dim)]
    if args.rope_scaling:  # llama.cpp keeps Llama-3 rope scaling as per-frequency divisors
        out.append(Planned("rope_freqs.weight", (hd // 2,), "F32"))
    for i in range(args.n_layers):
        p = f"blk.{i}."
        out += [Planned(p + "attn_norm.weight", (dim,), "F32"),
                mat(p + "attn_q.weight", args.n_heads * hd, dim),
                mat(p + "attn_k.weight", args.n_kv_heads * hd, dim),
                mat(p + "attn_v.weight", args.n_kv_heads * hd, dim),
                mat(p + "attn_output.weight", dim, args.n_heads * hd),
                Planned(p + "ffn_norm.weight", (dim,), "F32"),
                mat(p + "ffn_gate.weight", ffn, dim),
                mat(p + "ffn_up.weight", ffn, dim),
                mat(p + "ffn_down.weight", dim, ffn)]
    out.append(Planned("output_norm.weight", (dim,), "F32"))
    if not args.tie_embeddings:
        out.append(mat("output.weight", args.vocab_size, dim))
    return out


def nbytes(t: Planned) -> int:
    if len(t.shape) == 1:
        return t.shape[0] * type_size(t.qtype)
    rows, cols = t.shape
    return rows * (cols // block_size(t.qtype)) * type_size(t.qtype)


def tensor_data(t: Planned, args: ModelArgs, g: torch.Generator, device: str = "cpu") -> np.ndarray:
    """The bytes of one tensor, as uint8 numpy (what GGUFWriter writes)."""
    if t.name == "rope_freqs.weight":
        base = 1.0 / (args.rope_theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.float64) / args.head_dim))
        return (base / rope_frequencies(args).double()).float().numpy().view(np.uint8)
    if len(t.shape) == 1:  # a norm: near 1, as in a trained model
        return (1.0 + 0.02 * torch.randn(t.shape, generator=g)).numpy().view(np.uint8)
    return random_blocks(t.qtype, *t.shape, generator=g, device=device).cpu().numpy()


def _file_type(qtype: str) -> int | None:
    names = {"F32": "ALL_F32"}
    for cand in (names.get(qtype), f"MOSTLY_{qtype}", f"MOSTLY_{qtype}_M"):
        if cand and cand in gguf.LlamaFileType.__members__:
            return int(gguf.LlamaFileType[cand])
    return None


def write(path: Path, args: ModelArgs, qtype: str, seed: int = 0, name: str = "random", progress: bool = False,
          device: str = "cpu") -> int:
    """Write the file; returns its size in bytes. `device` makes the random blocks there (a GPU makes a 28 GiB
    file in the time the disk takes; the bytes differ from the CPU's, each device is reproducible)."""
    qtype = qtype.upper() if qtype.upper() in MIXES else qtype_of(qtype).name
    tensors = plan(args, qtype)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"strata random {name} {qtype}")
    ft = _file_type(qtype)
    if ft is not None:
        w.add_file_type(ft)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_block_count(args.n_layers)
    w.add_context_length(args.max_seq_len)
    w.add_embedding_length(args.dim)
    w.add_feed_forward_length(args.ffn_dim)
    w.add_head_count(args.n_heads)
    w.add_head_count_kv(args.n_kv_heads)
    w.add_rope_dimension_count(args.head_dim)
    if args.head_dim != args.dim // args.n_heads:
        w.add_key_length(args.head_dim)
        w.add_value_length(args.head_dim)
    w.add_rope_freq_base(args.rope_theta)
    w.add_layer_norm_rms_eps(args.norm_eps)
    w.add_vocab_size(args.vocab_size)
    w.add_tokenizer_model("none")
    for t in tensors:
        raw = gguf.GGMLQuantizationType[t.qtype]
        byte_shape = (*t.shape[:-1], nbytes(t) // int(np.prod(t.shape[:-1], dtype=np.int64)))
        w.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), nbytes(t), raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    total, t0 = sum(nbytes(t) for t in tensors), time.monotonic()
    done = 0
    for i, t in enumerate(tensors):
        g = torch.Generator(device if len(t.shape) == 2 else "cpu").manual_seed(seed * 1_000_003 + i)  # per tensor
        data = tensor_data(t, args, g, device)
        assert data.nbytes == nbytes(t), (t.name, data.nbytes, nbytes(t))
        w.write_tensor_data(data)
        done += data.nbytes
        if progress and (i % 20 == 0 or i == len(tensors) - 1):
            print(f"\r{done / 2**30:7.2f} / {total / 2**30:.2f} GiB  {time.monotonic() - t0:6.1f} s",
                  end="", file=sys.stderr, flush=True)
    w.close()
    if progress:
        print(file=sys.stderr)
    return Path(path).stat().st_size


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", required=True, choices=sorted(PRESETS))
    ap.add_argument("--qtype", default="Q4_K", help="GGUF type of the weight matrices (e.g. Q4_K, IQ3_S, or the mix "
                    "Q4_K_M: strata.quant.MIXES)")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="where the random blocks are made (cuda: much faster)")
    ap.add_argument("--layers", type=int, help="override the preset's layer count (a smaller file of the same widths)")
    a = ap.parse_args(argv)
    args = PRESETS[a.preset]
    if a.layers:
        args = dataclasses.replace(args, n_layers=a.layers)
    try:
        q = a.qtype.upper() if a.qtype.upper() in MIXES else qtype_of(a.qtype).name
        for t in MIXES.get(q, (q,)):
            block_size(t)
    except (ValueError, KeyError) as e:
        ap.error(str(e))
    size = write(a.out, args, q, a.seed, name=a.preset, progress=True, device=a.device)
    print(f"{a.out}: {a.preset} ({args.n_layers} layers) in {q}, {size / 2**30:.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
