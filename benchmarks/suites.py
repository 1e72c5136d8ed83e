"""The registry of benchmark suites: ``name -> "module:function"``, imported on use.

A suite is a function ``run(quick: bool, repeats: int) -> list[Record]``. Its module
may also define ``NAMES``, the record names it produces, so that
``loopgate bench --only SUBSTRING`` runs only the suites that can match without
importing anything heavy; suite modules therefore import simulators, ZeroMQ peers and
the like inside their functions, not at the top. Adding a suite is one line here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

SUITES: dict[str, str] = {
    "gateway": "benchmarks.gateway_rtt:run",
    "collect": "benchmarks.collect:run",
    "ray": "benchmarks.ray_engine:run",
    "model": "benchmarks.model:run",
    "inference": "benchmarks.inference:run",
    "ros2": "benchmarks.ros2_latency:run",
    "replay": "benchmarks.replay:run",
    "trainer": "benchmarks.trainer:run",
    "learn": "benchmarks.learn:run",
    "ppo": "benchmarks.ppo:run",
    "mjlab": "benchmarks.mjlab:run",
    "batched": "benchmarks.batched:run",
    "console": "benchmarks.console:run",
    "gpu": "benchmarks.gpu_inference:suite",
}
"""Suites in the order they run."""


def load(name: str) -> tuple[Callable[..., Any], tuple[str, ...]]:
    """The suite's ``run`` function and the record names it declares (may be empty)."""
    module_name, _, func = SUITES[name].partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, func), tuple(getattr(module, "NAMES", ()))


def selected(name: str, declared: tuple[str, ...], only: str | None) -> bool:
    """Whether suite ``name`` can produce a record whose name contains ``only``.

    A suite that declares no names is always run (its records are filtered after).
    """
    if only is None or only in name or not declared:
        return True
    return any(only in entry for entry in declared)
