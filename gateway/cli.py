"""The ``loopgate`` command: one entry point, one subcommand per process or tool.

Subcommands are looked up lazily in :data:`COMMANDS` (``"module:main"``), so
``loopgate doctor`` never imports MuJoCo and ``loopgate worker`` never imports torch.
Every subcommand is also ``python -m <module>``.
"""

from __future__ import annotations

import importlib
import os
import sys

from gateway import __version__
from gateway.registry import find_modules_in_start_folder

COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("gateway.supervisor:main", "start and supervise every process of an experiment"),
    "scale": ("gateway.engines.scaling:main", "env workers join or leave a live run (env.workers=N)"),
    "gateway": ("gateway.hub.__main__:main", "run the gateway process"),
    "worker": ("gateway.worker.cli:main", "run an env worker (a batch of envs of one backend)"),
    "inference": (
        "inference.__main__:main",
        "run an inference server (batched policy, hot-swapped weights)",
    ),
    "train": ("trainer.__main__:main", "run the FSDP trainer (also: torchrun -m trainer)"),
    "bench": ("benchmarks.__main__:main", "measure the data path against raw baselines"),
    "chaos": ("benchmarks.chaos:main", "run an experiment under injected faults; check nothing was lost"),
    "report": ("gateway.report:main", "where a run's time went: stages, bottleneck, model, trace"),
    "doctor": ("gateway.doctor:main", "show what is installed and what to install"),
    "keys": ("gateway.keys:main", "make CURVE keys for binding beyond loopback"),
    "emulator": ("robots.emulator:main", "emulate the reach arm as a ROS 2 (ros2_control) robot"),
    "replay": ("trainer.replay.cli:main", "run the replay service, or import demonstrations into a run"),
    "export": ("trainer.replay.export:main", "export a run's episodes (LeRobot v3 dataset, MCAP for ROS 2)"),
    "console": ("gateway.console.__main__:main", "serve a run's web console: fleet, e-stop, teleoperation"),
    "estop": ("gateway.latch:main", "engage (or --release) a run's e-stop from a terminal or a script"),
}
"""Subcommand -> (``module:function``, one-line description)."""

USAGE = """usage: loopgate [--version] <command> [args]

commands:
{commands}

examples:
  loopgate up configs/reach_sim.yaml                 # the main job on this machine
  loopgate up configs/reach_sim.yaml --max-env-steps 2000 --set policy.kind=reach_pd
  loopgate bench --quick --json bench.json
  loopgate doctor

Run `loopgate <command> --help` for a command's options."""


def usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = [f"  {name.ljust(width)}  {text}" for name, (_, text) in COMMANDS.items()]
    return USAGE.format(commands="\n".join(lines))


def _own_packages_first() -> None:
    """``python -m gateway.cli`` starts with the current folder first on the import path,
    where a researcher's ``trainer.py`` would hide loopgate's ``trainer``: take it off, and
    find a config's own modules there as ``loopgate`` (the installed command) does, after
    every package (:func:`gateway.registry.find_modules_in_start_folder`)."""
    if sys.path and sys.path[0] in ("", os.getcwd()):
        del sys.path[0]
        find_modules_in_start_folder()


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if args else 2
    if args[0] in ("-V", "--version"):
        print(f"loopgate {__version__}")
        return 0
    name = args[0]
    if name not in COMMANDS:
        print(f"loopgate: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    _own_packages_first()
    target, _ = COMMANDS[name]
    module_name, _, func = target.partition(":")
    try:
        # A command's imports take a while (torch, MuJoCo, rclpy); Ctrl-C during them, or
        # in a command that does not stop on it itself, ends it with one line.
        result = getattr(importlib.import_module(module_name), func)(args[1:])
    except KeyboardInterrupt:
        print(f"loopgate {name}: interrupted", file=sys.stderr)
        return 130
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
