"""Decode steps as CUDA graphs (one row and batches)."""
