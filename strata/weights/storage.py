"""What a checkpoint costs a stage, part by part, as stored (`Storage`): made by strata.weights.checkpoint.storage,
read by the planner (strata.plan.planner), which counts params x dtype where it has none."""
from __future__ import annotations

from dataclasses import dataclass

from strata.kernels.attention import PREFIX_BLOCK


@dataclass(frozen=True)
class Storage:
    """Bytes as stored, per part (strata.weights.checkpoint.storage): resident quantized blocks count as blocks,
    plus the one-layer dequantization scratch; KV at the rig's kv_dtype. Without one, params x dtype."""
    layer: float               # one layer's weights (mean over the layers)
    embed: int
    head: int                  # the head, or the tied embedding's copy on a stage without the embedding
    norm: int
    scratch: int               # resident: one layer dense in dtype + the dequantizer's transient
    kv_elem: float             # bytes per cached K or V element (q8_0: 34 / 32, its scales included)
    mode: str = "dequantized"  # "resident" or "dequantized"
    per_layer: tuple = ()      # each layer's weights, where they differ (GLM's first dense layers, experts)
    seqs: int = 1              # sequences whose KV a stage holds (the rig's max_seqs): the KV counts this many times
    prefix_block: int = PREFIX_BLOCK  # an 8-bit cache's prefix positions widened at once for a chunk's attention
    prefix_device: int = 0     # a CUDA stage's device tier of the prefix cache (prefix_cache_device_bytes)
    pool: int = 0              # the rig's kv_pool: a global layer's positions for all `seqs` sequences (0: seqs x tokens)
