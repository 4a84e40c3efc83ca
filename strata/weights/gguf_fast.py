"""A fast GGUF index: metadata values and tensor views in ~0.1 s where gguf-py's reader takes ~2 s.

gguf-py builds a memory-mapped numpy view for every element of every metadata array (the
tokenizer's ~100k strings), which is most of a run's start-up, paid by the head and again by
every stage. This parses the same little-endian layout with plain `struct` reads, decodes the
values once, and builds the tensors as gguf-py's own `ReaderTensor`s (same dtypes, shapes and
memory-mapped data), so the code that reads tensors is unchanged. Files it does not handle
(big-endian, arrays of arrays) raise `Unhandled`: the caller falls back to gguf-py.
"""
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

VERSIONS = (2, 3)
# GGUFValueType -> struct format of one scalar
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_ITEM = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
         "I32": np.int32, "I64": np.int64}


class Unhandled(Exception):
    """A valid file this parser leaves to gguf-py."""


class GGUFIndex:
    """`values`: metadata key -> Python value (str, int, float, bool or a list of them);
    `tensors`: gguf.ReaderTensor per tensor, in file order; `alignment`, `data_offset` as in gguf-py."""

    def __init__(self, path: str | Path):
        import gguf
        self.path = str(path)
        self.data = np.memmap(self.path, mode="r")
        buf = memoryview(self.data)
        self._buf, self._off = buf, 0
        if bytes(buf[:4]) != b"GGUF":
            raise ValueError("GGUF magic invalid")
        self._off = 4
        version = self._u("I")
        if version & 0xFFFF == 0:
            raise Unhandled("big-endian GGUF")
        if version not in VERSIONS:
            raise ValueError(f"GGUF version {version} is not supported")
        n_tensors, n_kv = self._u("Q"), self._u("Q")
        self.values: dict = {"GGUF.version": version, "GGUF.tensor_count": n_tensors, "GGUF.kv_count": n_kv}
        for _ in range(n_kv):
            key = self._str(strict=True)
            if key in self.values:
                raise ValueError(f"duplicate metadata key {key!r}")
            self.values[key] = self._value(self._u("I"))
        infos = []
        for _ in range(n_tensors):
            name = self._str(strict=True)
            n_dims = self._u("I")
            if n_dims > 8:
                raise ValueError(f"tensor {name!r}: {n_dims} dimensions")
            dims = struct.unpack_from(f"<{n_dims}Q", buf, self._off)
            self._off += 8 * n_dims
            infos.append((name, dims, self._u("I"), self._u("Q")))
        align = self.values.get("general.alignment", 32)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise ValueError("invalid general.alignment")
        self.alignment = align
        self.data_offset = -(-self._off // align) * align
        self.tensors = []
        seen = set()
        for name, dims, raw_type, rel in infos:
            if name in seen:
                raise ValueError(f"duplicated tensor {name!r}")
            seen.add(name)
            qtype = gguf.GGMLQuantizationType(raw_type)
            n = int(np.prod(dims, dtype=np.int64)) if dims else 1
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            n_bytes = n * type_size // block
            start = self.data_offset + rel
            np_dims = tuple(reversed(dims))
            item = _ITEM.get(qtype.name)
            if item is None:
                item, count, np_dims = np.uint8, n_bytes, gguf.quant_shape_to_byte_shape(np_dims, qtype)
            else:
                count = n
            width = np.dtype(item).itemsize * count
            # past the end: no view (the caller names the truncation from data_offset + n_bytes)
            view = self.data[start:start + width].view(item).reshape(np_dims) if start + width <= self.data.size \
                else None
            self.tensors.append(gguf.ReaderTensor(name=name, tensor_type=qtype, shape=np.array(dims, dtype=np.uint64),
                                                  n_elements=n, n_bytes=n_bytes, data_offset=start, data=view,
                                                  field=None))
        del self._buf

    def value(self, key: str, default=None):
        return self.values.get(key, default)

    # -- reading ---------------------------------------------------------------------------------
    def _u(self, fmt: str) -> int:
        v = struct.unpack_from("<" + fmt, self._buf, self._off)[0]
        self._off += struct.calcsize(fmt)
        return v

    def _str(self, strict: bool = False) -> str:
        """strict for keys and tensor names (gguf-py refuses bad UTF-8 there); values as field_value reads them."""
        n = self._u("Q")
        end = self._off + n
        if end > len(self._buf):
            raise ValueError("string runs past the end of the file")
        s = bytes(self._buf[self._off:end]).decode("utf-8", errors="strict" if strict else "replace")
        self._off = end
        return s

    def _value(self, vtype: int):
        if vtype == _STRING:
            return self._str()
        if vtype == _ARRAY:
            itype, count = self._u("I"), self._u("Q")
            if itype == _STRING:
                return self._strings(count)
            if itype == _ARRAY:
                raise Unhandled("array of arrays")
            fmt = _SCALAR.get(itype)
            if fmt is None:
                raise ValueError(f"unknown array item type {itype}")
            out = list(struct.unpack_from(f"<{count}{fmt}", self._buf, self._off))
            self._off += struct.calcsize(fmt) * count
            return [bool(v) for v in out] if itype == 7 else out
        fmt = _SCALAR.get(vtype)
        if fmt is None:
            raise ValueError(f"unknown value type {vtype}")
        v = self._u(fmt)
        return bool(v) if vtype == 7 else v

    def _strings(self, count: int) -> list[str]:
        buf, off, size, out = self._buf, self._off, len(self._buf), []
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(count):
            (n,) = unpack(buf, off)
            off += 8
            if off + n > size:
                raise ValueError("string array runs past the end of the file")
            out.append(bytes(buf[off:off + n]).decode("utf-8", errors="replace"))
            off += n
        self._off = off
        return out
