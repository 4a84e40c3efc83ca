"""Strata: pipelined long-prompt prefill across the layer-split stages of a model."""
from strata.config import ConfigError, RigConfig

__all__ = ["Pipeline", "PipelineError", "Result", "RigConfig", "ConfigError"]


def __getattr__(name: str):
    # the pipeline (and torch) on first use: the launcher reads the rig and starts the stages' fork
    # server before it imports torch itself
    if name in ("Pipeline", "PipelineError", "Result"):
        from strata.head import pipeline
        return getattr(pipeline, name)
    raise AttributeError(f"module 'strata' has no attribute {name!r}")
