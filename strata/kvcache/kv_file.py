"""KV files (`kv_save` / `kv_load`): a prompt's token ids and every layer's KV rows, checked against the rig on load.

The layout, no pickle and nothing that runs on load:

    MAGIC (8 bytes) | header length (uint64 LE) | header (UTF-8 JSON) | zero padding to ALIGN
    | ids (int32 LE, `tokens` of them) | zero padding to ALIGN | data

The data is, layer after layer in model order, that layer's K rows [0, tokens) then its V rows, each as the cache
holds them ((1, n_kv, tokens, last) in the cache's dtype, C order): opaque bytes, whatever the dtype or packing.
Every layer has the same `layer_row_bytes` per position, so the file does not depend on how the layers are split
across stages: each stage writes and reads its own layers' range at an offset the head computes, in parallel.

The header's `fingerprint` names what the rows depend on: the model's files (name, size, a hash of their first and
last MiB; a synthetic model's preset and seed), its shape (ModelArgs), dtype, kv_dtype and max_context. A file
whose fingerprint, layout or size differs from what this rig would write is refused in one line (`KvFileError`),
before any stage reads it. The split it was written with is recorded (`split`), not checked: the rows of a layer
do not depend on it.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
from pathlib import Path

import numpy as np
import torch

from strata.errors import ConfigError

MAGIC = b"STRATAKV"
VERSION = 2  # 2: a q8_0 row holds its values, then its scales (strata.kernels.attention.to_q8_0)
ALIGN = 4096
MAX_HEADER = 1 << 20


class KvFileError(ConfigError):
    """A KV file that cannot be written, read, or used with this rig (one line; bad input, as a bad rig is)."""


def _file_id(p: Path) -> str:
    """name:size:blake2b of the first and last MiB (a multi-GB file is not read whole)."""
    size = p.stat().st_size
    h = hashlib.blake2b(digest_size=12)
    with open(p, "rb") as f:
        h.update(f.read(1 << 20))
        if size > 2 << 20:
            f.seek(size - (1 << 20))
            h.update(f.read(1 << 20))
    return f"{p.name}:{size}:{h.hexdigest()}"


def model_identity(model: str, seed: int) -> str:
    """What names a model's weights: its files' identities (or a synthetic preset and seed)."""
    from strata.weights.checkpoint import resolve
    kind, where = resolve(model)
    if kind == "synthetic":
        return f"synthetic:{where}:seed={seed}"
    p = Path(where)
    if kind == "gguf":
        from strata.weights.gguf_files import open_model
        return "gguf " + " ".join(_file_id(f) for f in open_model(p).parts)  # a split model: every part
    files = [p / "config.json"] + sorted(p.glob("*.safetensors"))
    return "hf " + " ".join(_file_id(f) for f in files)


def fingerprint(model: str, seed: int, args, dtype: str, kv_dtype: str, max_context: int) -> dict:
    """The facts a KV file's rows depend on (see the module docstring); kv_dtype "auto" is the compute dtype."""
    fields = {f: getattr(args, f) for f in args.__dataclass_fields__}
    shape = hashlib.blake2b(json.dumps(fields, sort_keys=True, default=str).encode(), digest_size=12).hexdigest()
    return {"model": model_identity(model, seed), "shape": shape, "n_layers": args.n_layers, "dtype": dtype,
            "kv_dtype": dtype if kv_dtype == "auto" else kv_dtype, "max_context": max_context}


def rig_fingerprint(cfg, plan) -> dict:
    """A pipeline's fingerprint: its rig's model, seed, dtype and kv_dtype, its plan's model shape and max_context."""
    return fingerprint(cfg.model, cfg.seed, plan.args, cfg.dtype, cfg.kv_dtype, plan.max_len)


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def layout(tokens: int, n_layers: int, layer_row_bytes: int, header: bytes) -> tuple[int, int, int]:
    """(ids offset, data offset, file size) for a header of these bytes."""
    ids_at = _align(len(MAGIC) + 8 + len(header))
    data_at = _align(ids_at + 4 * tokens)
    return ids_at, data_at, data_at + tokens * n_layers * layer_row_bytes


def _header(fp: dict, tokens: int, layer_row_bytes: int, split: list) -> bytes:
    h = {"format": "strata-kv", "version": VERSION, "fingerprint": fp, "tokens": tokens,
         "layer_row_bytes": layer_row_bytes, "split": split}
    return json.dumps(h, sort_keys=True).encode()


@contextlib.contextmanager
def replacing(path: Path):
    """A temporary name beside `path` to write a KV file under: moved onto `path` when the block ends, removed if
    it raised, so no half-written file is left under either name."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def create(path: str | os.PathLike, fp: dict, ids: np.ndarray, layer_row_bytes: int, split: list) -> int:
    """Write header and ids into `path` (sized for the data, which the stages write); returns the data offset."""
    ids = np.ascontiguousarray(ids, dtype="<i4")
    header = _header(fp, int(ids.size), layer_row_bytes, split)
    ids_at, data_at, size = layout(ids.size, fp["n_layers"], layer_row_bytes, header)
    try:
        with open(path, "wb") as f:
            f.write(MAGIC + struct.pack("<Q", len(header)) + header)
            f.seek(ids_at)
            f.write(ids.tobytes())
            f.truncate(size)
    except OSError as e:
        raise KvFileError(f"kv_save: cannot write {path}: {e.strerror or e}") from None
    return data_at


def read_header(path: str | os.PathLike) -> tuple[dict, np.ndarray, int]:
    """-> (header, ids, data offset), checked for shape: magic, version, sizes. KvFileError otherwise."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(MAGIC) + 8)
            if len(head) < len(MAGIC) + 8 or head[:len(MAGIC)] != MAGIC:
                raise KvFileError(f"kv_load: {path} is not a Strata KV file")
            (n,) = struct.unpack("<Q", head[len(MAGIC):])
            if n > MAX_HEADER:
                raise KvFileError(f"kv_load: {path}: a header of {n} bytes is larger than any KV file's")
            raw = f.read(n)
            try:
                h = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError):
                raise KvFileError(f"kv_load: {path}: the header is not JSON") from None
            if not (isinstance(h, dict) and h.get("format") == "strata-kv"):
                raise KvFileError(f"kv_load: {path} is not a Strata KV file")
            if h.get("version") != VERSION:
                raise KvFileError(f"kv_load: {path} has format version {h.get('version')!r}, this Strata reads {VERSION}")
            tokens, rb, fp = h.get("tokens"), h.get("layer_row_bytes"), h.get("fingerprint")
            if not (type(tokens) is int and tokens > 0 and type(rb) is int and rb > 0 and isinstance(fp, dict)
                    and type(fp.get("n_layers")) is int and fp["n_layers"] > 0):
                raise KvFileError(f"kv_load: {path}: a malformed header")
            ids_at, data_at, size = layout(tokens, fp["n_layers"], rb, raw)
            actual = os.fstat(f.fileno()).st_size
            if actual != size:
                raise KvFileError(f"kv_load: {path} holds {actual} bytes, its header says {size} (truncated?)")
            f.seek(ids_at)
            ids = np.frombuffer(f.read(4 * tokens), dtype="<i4").astype(np.int32)
    except OSError as e:
        raise KvFileError(f"kv_load: cannot read {path}: {e.strerror or e}") from None
    return h, ids, data_at


def check(path, h: dict, fp: dict, layer_row_bytes: int, max_context: int, vocab: int, ids: np.ndarray) -> None:
    """The file's fingerprint and layout against this rig's; the first difference refused in one line."""
    got = h["fingerprint"]
    for key in ("model", "shape", "n_layers", "dtype", "kv_dtype", "max_context"):
        if got.get(key) != fp[key]:
            raise KvFileError(f"kv_load: {path} was saved with {key} {got.get(key)!r}, this rig has {fp[key]!r}")
    if h["layer_row_bytes"] != layer_row_bytes:
        raise KvFileError(f"kv_load: {path} has {h['layer_row_bytes']} bytes a layer's position, this rig's cache "
                          f"{layer_row_bytes}")
    if h["tokens"] > max_context:
        raise KvFileError(f"kv_load: {path} holds {h['tokens']} tokens, over max_context of {max_context}")
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        raise KvFileError(f"kv_load: {path}: token ids outside [0, {vocab})")


# -- a stage's side: its layers' rows, at the offset the head gives ------------------------------------------------
def write_rows(path: str, offset: int, tokens: int, caches: list[torch.Tensor]) -> int:
    """Rows [0, tokens) of each cache (k, v of each layer in order) into path at offset; returns bytes written."""
    fd = os.open(path, os.O_WRONLY)
    try:
        at = offset
        for c in caches:
            if c.numel() == 0:  # an empty partner (MLA's V: its values are the latent in K)
                continue
            rows = c[:, :, :tokens].contiguous().cpu()
            mv = memoryview(rows.view(torch.uint8).numpy()).cast("B")
            done = 0
            while done < len(mv):
                done += os.pwrite(fd, mv[done:], at + done)
            at += len(mv)
        os.fsync(fd)
        return at - offset
    finally:
        os.close(fd)


def read_rows(path: str, offset: int, tokens: int, caches: list[torch.Tensor]) -> int:
    """The inverse of write_rows: rows [0, tokens) of each cache from path at offset."""
    fd = os.open(path, os.O_RDONLY)
    try:
        at = offset
        for c in caches:
            if c.numel() == 0:
                continue
            shape = (1, c.shape[1], tokens, c.shape[3])
            n = c.shape[1] * tokens * c.shape[3] * c.element_size()
            buf = bytearray(n)
            got = os.preadv(fd, [buf], at)
            if got != n:
                raise OSError(f"short read: {got} of {n} bytes at {at}")
            rows = torch.frombuffer(buf, dtype=torch.uint8).view(c.dtype).view(shape)
            c[:, :, :tokens].copy_(rows)
            at += n
        return at - offset
    finally:
        os.close(fd)
