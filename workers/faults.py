"""Failures a stage makes on purpose (the rig's `debug`: delays, raise / exit / kill / hang) and `StageFailed`."""
from __future__ import annotations

import logging
import os
import signal
import time


class StageFailed(RuntimeError):
    """A stage's own failure (injected, or a broken protocol), reported to the head as `Fail`."""


class Faults:
    """The rig's `debug` spec for one stage: where it sleeps and where it fails, checked at load and per chunk."""

    def __init__(self, debug: dict, stage: int, log: logging.Logger):
        self.debug, self.stage, self.log = debug, stage, log

    def at_load(self) -> None:
        if self.debug["fail_stage"] == self.stage and self.debug["fail_phase"] == "load":
            self._injected_failure("while loading")

    def at_chunk(self, k: int, phase: str) -> None:
        """Before chunk (or decode step) k of `phase` computes."""
        d = self.debug
        delay = d["delay_s"] + self.stage * d["delay_step_s"]
        if delay:
            time.sleep(delay)
        if d["fail_stage"] == self.stage and d["fail_chunk"] == k and phase == d["fail_phase"]:
            self._injected_failure(f"at chunk {k}")

    def _injected_failure(self, where: str) -> None:
        # (the name is what the hang test finds in faulthandler's stack dump)
        mode = self.debug["fail_mode"]
        self.log.error("debug: injected failure (%s) %s", mode, where)
        for h in self.log.handlers:
            h.flush()
        if mode == "raise":
            raise StageFailed(f"injected failure {where}")
        if mode == "exit":
            os._exit(17)
        if mode == "kill":  # as if killed from outside: no message, no cleanup
            os.kill(os.getpid(), signal.SIGKILL)
        while True:  # hang: the watchdog (or the ready deadline) must notice
            time.sleep(1)
