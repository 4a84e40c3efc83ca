"""Where a Triton kernel that failed is remembered: on an object its caller holds, not in a module global.

strata.kernels.fused (prefill's LSE merge, RoPE, the gated activation, a q8_0 cache's widening; decode's router and the experts'
weighted sum), strata.quant.iq (IQ3_S's dequantization) and strata.quant.into (resident dequantization into the
scratch) try their Triton kernels and take their torch path where they cannot build or launch; strata.kernels.attention's
window layers try FlexAttention and take the band where it fails. A model holds one
`TritonState` (Transformer.triton_state), shared by its layers and its resident matrices (strata.models.resident.Packed); a
failure turns that module's field off on it, logged once, so this holder's later calls go straight to the torch path
while another model in the same process, or a call without a holder, still tries the kernel. (strata.quant.gemv's
decode products keep theirs with the rig's choices, on strata.quant.gemv.GemvKernels.)

Imports nothing heavy: a CPU stage makes one without importing Triton."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TritonState:
    """Whether each module's Triton kernels still run for this holder (True until one of them fails). Mutable on
    purpose: the module whose kernel failed sets its field False on the object its caller passed, and only there."""
    kernels: bool = True  # strata.kernels.fused' kernels (one that fails turns them all off, as they build alike)
    iq3s: bool = True     # strata.quant.iq's IQ3_S dequantization kernel
    into: bool = True     # strata.quant.into's dequantize-into kernels (one that fails turns them all off)
    flex_failed: str | None = None  # why strata.kernels.attention's FlexAttention path stopped for this holder (None: runs)
