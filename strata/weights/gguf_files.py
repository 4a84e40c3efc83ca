"""A GGUF model's files: one .gguf, or the parts llama.cpp's gguf-split writes (NAME-00001-of-0000N.gguf), each
opened memory-mapped and cached, the parts checked against each other and read as one model from the first part.

gguf-split's format (llama.cpp tools/gguf-split, read by src/llama-model-loader.cpp): every part carries `split.no`
(0-based, u16), `split.count` (u16) and `split.tensors.count` (the model's tensors, i32); the first part alone carries
the model's metadata (architecture, hyperparameters, tokenizer); each part holds its own tensors, aligned within
that part. A file whose `split.count` is absent, 0 or 1 is a single file, as llama.cpp reads it.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

from strata.errors import ModelError

SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS = "split.no", "split.count", "split.tensors.count"
_PART_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5,})-of-(?P<count>\d{5,})\.gguf$")  # llama_split_path's


def is_part_name(name: str) -> bool:
    """Whether a file name is one of gguf-split's (NAME-00002-of-00009.gguf)."""
    return _PART_NAME.match(name) is not None


# -- one file -----------------------------------------------------------------------------------
def open_gguf(path: Path):
    """A parsed, memory-mapped `gguf.GGUFReader` (or `GGUFIndex`) of one file, cached per file version (parsing
    costs seconds). One part of a split model: the model as a whole is `open_model`."""
    return _open_cached(str(Path(path).resolve()), *_stat(Path(path)))


def _stat(path: Path) -> tuple[int, int]:
    try:
        st = path.stat()
    except OSError as e:
        raise ModelError(f"{path}: cannot read GGUF file ({e.strerror or e})") from None
    if not path.is_file():
        raise ModelError(f"{path}: not a file")
    return st.st_size, st.st_mtime_ns


@functools.lru_cache(maxsize=4)
def _open_cached(path: str, size: int, mtime_ns: int):
    import gguf
    if size < 24:
        raise ModelError(f"{path}: not a GGUF file (only {size} bytes)")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelError(f"{path}: not a GGUF file (bad magic {magic!r})")
    from strata.weights.gguf_fast import GGUFIndex, Unhandled
    try:
        try:
            reader = GGUFIndex(path)  # gguf-py's reader spends seconds on the tokenizer arrays
        except Unhandled:
            reader = gguf.GGUFReader(path, "r")
    except Exception as e:  # the parser fails in many ways on truncated or corrupt bytes
        raise ModelError(f"{path}: truncated or corrupt GGUF file ({type(e).__name__}: {one_line(e)})") from None
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise ModelError(f"{path}: truncated GGUF file: tensor {t.name} ({t.tensor_type.name}) extends to byte "
                             f"{t.data_offset + t.n_bytes}, the file has {size}")
    return reader


def one_line(e: BaseException) -> str:
    s = " ".join(str(e).split())
    return s[:200]


def field_value(reader, key: str, default=None):
    """A metadata value as a Python scalar, str or list (missing -> default)."""
    import gguf

    from strata.weights.gguf_fast import GGUFIndex
    if isinstance(reader, GGUFIndex):
        return reader.value(key, default)
    f = reader.fields.get(key)
    if f is None:
        return default
    T = gguf.GGUFValueType

    def scalar(vtype, part):
        if vtype == T.STRING:
            return bytes(part).decode("utf-8", errors="replace")
        v = part[0]
        if vtype == T.BOOL:
            return bool(v)
        if vtype in (T.FLOAT32, T.FLOAT64):
            return float(v)
        return int(v)

    if f.types[0] == T.ARRAY:
        if len(f.types) < 2:  # empty array
            return []
        return [scalar(f.types[1], f.parts[i]) for i in f.data]
    return scalar(f.types[0], f.parts[f.data[0]])


def field_keys(reader) -> list[str]:
    from strata.weights.gguf_fast import GGUFIndex
    return list(reader.values if isinstance(reader, GGUFIndex) else reader.fields)


# -- the model: one file or its parts ------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class GgufModel:
    """A GGUF model as one: the first part's metadata, every part's tensors (memory-mapped from their own part)."""
    path: Path                   # the file the model is named by (a split model's first part)
    meta: object                 # that file's reader: every metadata key (gguf-split writes them in the first part)
    parts: tuple[Path, ...]      # the files in order (one for an unsplit model)
    sizes: tuple[int, ...]       # their sizes in bytes
    tensors: dict                # tensor name -> gguf.ReaderTensor, the parts' in order
    part_of: dict                # tensor name -> its part's index in `parts`

    def value(self, key: str, default=None):
        return field_value(self.meta, key, default)

    def keys(self) -> list[str]:
        return field_keys(self.meta)

    def file_of(self, name: str) -> Path:
        """The part that holds tensor `name`."""
        return self.parts[self.part_of[name]]


def open_model(path: Path) -> GgufModel:
    """The model named by `path`: a single GGUF, or a split model's first part with the others found beside it by
    name and checked, each refusal one line naming the file, before any tensor is read: a later part given (the
    first is named), a missing part, a part whose split.no / split.count disagree with its name or the first part,
    a tensor in two parts, a total unlike split.tensors.count."""
    path = Path(path)
    first = open_gguf(path)
    parts = _part_paths(path, first)
    for i, p in enumerate(parts[1:], 1):
        if not p.exists():
            raise ModelError(f"{p}: missing part {i + 1} of {len(parts)} of the split GGUF {path.name}")
    return _model_cached(tuple(str(p) for p in parts), tuple(_stat(p) for p in parts))


def _split_key(path: Path, reader, key: str):
    v = field_value(reader, key)
    if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
        raise ModelError(f"{path}: GGUF key {key} = {v!r} is not an integer")
    return v


def _part_paths(path: Path, first) -> list[Path]:
    """The model's files from the one named: itself when unsplit, else every part's path by gguf-split's naming."""
    count = _split_key(path, first, SPLIT_COUNT) or 0
    if count <= 1:
        return [path]
    no = _split_key(path, first, SPLIT_NO)
    m = _PART_NAME.match(path.name)
    stem = m.group("prefix") if m else None
    if no is None:
        raise ModelError(f"{path}: split GGUF ({SPLIT_COUNT} {count}) without {SPLIT_NO}")
    if no != 0:
        where = f", {stem}-00001-of-{count:05d}.gguf" if stem else ""
        raise ModelError(f"{path}: part {no + 1} of {count} of a split GGUF; name its first part{where}")
    if m is None or int(m.group("no")) != 1 or int(m.group("count")) != count:
        raise ModelError(f"{path}: first part of a split GGUF ({SPLIT_COUNT} {count}) whose name does not end "
                         f"-00001-of-{count:05d}.gguf, as gguf-split names it: its other parts cannot be found")
    return [path.with_name(f"{stem}-{i + 1:05d}-of-{count:05d}.gguf") for i in range(count)]


@functools.lru_cache(maxsize=4)
def _model_cached(paths: tuple[str, ...], stats: tuple[tuple[int, int], ...]) -> GgufModel:
    readers = [_open_cached(str(Path(p).resolve()), *st) for p, st in zip(paths, stats)]
    parts = tuple(Path(p) for p in paths)
    tensors: dict = {}
    part_of: dict = {}
    for i, (p, r) in enumerate(zip(parts, readers)):
        if i > 0:
            _check_part(p, r, i, parts, readers[0])
        for t in r.tensors:  # (a file's own names are unique: its parser refuses a repeat)
            if t.name in part_of:
                raise ModelError(f"{p}: tensor {t.name} is also in {parts[part_of[t.name]].name}")
            tensors[t.name], part_of[t.name] = t, i
    if len(parts) > 1:
        want = _split_key(parts[0], readers[0], SPLIT_TENSORS)
        if want is None:
            raise ModelError(f"{parts[0]}: split GGUF without {SPLIT_TENSORS}")
        if want != len(tensors):
            raise ModelError(f"{parts[0]}: {SPLIT_TENSORS} is {want}, its {len(parts)} parts hold {len(tensors)} "
                             "tensors")
    return GgufModel(parts[0], readers[0], parts, tuple(st[0] for st in stats), tensors, part_of)


def _check_part(path: Path, reader, i: int, parts: tuple[Path, ...], first) -> None:
    """Part i (> 0)'s split keys against its name (gguf-split's, which found it) and the first part's."""
    count, no = _split_key(path, reader, SPLIT_COUNT), _split_key(path, reader, SPLIT_NO)
    if count != len(parts):
        raise ModelError(f"{path}: {SPLIT_COUNT} is {count}, its name and the first part {parts[0].name} say "
                         f"{len(parts)}")
    if no != i:
        raise ModelError(f"{path}: {SPLIT_NO} is {no}, its name says part {i + 1} of {len(parts)} ({SPLIT_NO} {i})")
    total, want = _split_key(path, reader, SPLIT_TENSORS), _split_key(parts[0], first, SPLIT_TENSORS)
    if total is not None and total != want:
        raise ModelError(f"{path}: {SPLIT_TENSORS} is {total}, the first part {parts[0].name} says {want}")
