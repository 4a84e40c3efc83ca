"""IQ (importance-matrix grid) block types: IQ2_XXS IQ2_XS IQ2_S IQ3_XXS IQ3_S IQ1_S IQ1_M (being written)."""
from __future__ import annotations

DEQUANT: dict = {}  # type name -> fn(blocks uint8 (N, type_size)) -> float32 (N, block_size)
