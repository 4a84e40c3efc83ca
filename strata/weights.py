"""Compatibility: the model sources now live in strata.checkpoint (and the names in strata.names)."""
from __future__ import annotations

from .checkpoint import (SMOLLM2_FILE, check_model_files, hf_model_args, hf_slice_tensors, load_stage,  # noqa: F401
                         model_args, resolve, slice_tensors, smollm2_path, stage_bytes, synthetic_tensors,
                         weights_mode)
from .errors import ModelError  # noqa: F401
from .names import hf_name, wanted_names  # noqa: F401
