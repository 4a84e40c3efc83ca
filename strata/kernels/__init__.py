"""Compute kernels: attention and KV-cache formats, fused Triton ops, decode kernels, the C decoder."""
