"""The errors that reach the user from several modules, in one leaf module (it imports nothing of Strata's).

Each is one clear line for the user: what is wrong, with what, and where. An error of one module's own interface
(the server's RequestError, the wire's BadMessage, ...) lives in that module: ARCHITECTURE.md lists them.
"""
from __future__ import annotations


class ConfigError(ValueError):
    """A bad rig file or override: refused before any process starts."""


class ModelError(ValueError):
    """A model that cannot be used: missing, truncated, corrupt or unsupported. One clear line."""


class PlanError(ValueError):
    """No layer split fits the stages' memory (or a given split does not)."""


class PipelineError(RuntimeError):
    """A run that failed: names the stage (index, device, pid), the chunk and the cause."""
