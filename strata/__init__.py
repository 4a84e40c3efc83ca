"""Strata: pipelined long-prompt prefill across the layer-split stages of a model."""
from .config import ConfigError, RigConfig
from .pipeline import Pipeline, PipelineError, Result

__all__ = ["Pipeline", "PipelineError", "Result", "RigConfig", "ConfigError"]
