"""GGUF block types by name or number: `qtype_of`, and a type's weights and bytes per block. A leaf module:
quant/random.py imports it without importing the package (which imports random.py); the package re-exports it."""
from __future__ import annotations

import gguf


def qtype_of(qtype) -> gguf.GGMLQuantizationType:
    """A type name (any case) or enum value -> `gguf.GGMLQuantizationType`; ValueError if unknown."""
    if isinstance(qtype, gguf.GGMLQuantizationType):
        return qtype
    if isinstance(qtype, str):
        try:
            return gguf.GGMLQuantizationType[qtype.upper()]
        except KeyError:
            raise ValueError(f"unknown GGUF quantization type {qtype!r}") from None
    try:
        return gguf.GGMLQuantizationType(qtype)
    except ValueError:
        raise ValueError(f"unknown GGUF quantization type {qtype!r}") from None


def block_size(qtype) -> int:
    """Weights per block."""
    return gguf.constants.GGML_QUANT_SIZES[qtype_of(qtype)][0]


def type_size(qtype) -> int:
    """Bytes per block."""
    return gguf.constants.GGML_QUANT_SIZES[qtype_of(qtype)][1]
