"""The local engine: every service a child process of ``loopgate up`` on this machine.

This is the supervisor's own path (:class:`gateway.supervisor.Supervisor` starts the
processes with ``subprocess``, restarts them, and ends their sessions); the engine adds
nothing to it, so a run under ``run.engine: local`` behaves as ``loopgate up`` always has.
"""

from __future__ import annotations

from typing import Any

from gateway.config import ExperimentConfig


class LocalEngine:
    name = "local"

    def __init__(self, cfg: ExperimentConfig) -> None:
        self.cfg = cfg

    def launcher(self, cfg: ExperimentConfig, run: Any) -> None:
        return None

    def close(self) -> None:
        return None
