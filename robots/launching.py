"""What the ROS 2 launch files in ``launch/`` start, computed without the ``launch`` package.

The launch files start the same ``python -m`` entry points the ``loopgate`` CLI uses,
with the same arguments: their launch arguments are the CLI's options (read from each
entry point's ``build_parser()``), and the experiment's processes are the ones
``loopgate up`` would start (:func:`gateway.supervisor.prepare_run` plans them from
the config: gateway, env workers, and the inference, replay and trainer services
the config enables). Keeping this here lets tests check the processes and
their arguments on machines where ``ros2 launch`` is not installed::

    args = launch_arguments(gateway.supervisor.build_parser())   # [LaunchArgument, ...]
    procs = experiment_processes({"config": "configs/reach_ros2.yaml", "run_dir": "runs/x"})
    for p in procs: print(p.name, p.argv)                           # python -m gateway.hub ...
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class LaunchArgument:
    """A launch argument mirroring one CLI option (``run_dir`` for ``--run-dir``)."""

    name: str
    default: str
    description: str


@dataclass(frozen=True)
class Process:
    """One process for ``launch.actions.ExecuteProcess``."""

    name: str
    argv: list[str]
    respawn: bool = False
    env: dict[str, str] = field(default_factory=dict)


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]


def launch_arguments(parser: argparse.ArgumentParser) -> list[LaunchArgument]:
    """One launch argument per CLI option; an empty value means "the CLI's default"."""
    out = []
    for action in _options(parser):
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            default = "false"
        else:
            default = "" if action.default in (None, [], argparse.SUPPRESS) else str(action.default)
        help_text = (action.help or "").replace("%(default)s", str(action.default))
        if isinstance(action, argparse._AppendAction):
            help_text += " (several: separate with spaces)"
        out.append(LaunchArgument(action.dest, default, help_text))
    return out


def cli_argv(parser: argparse.ArgumentParser, values: dict[str, str]) -> list[str]:
    """The command-line arguments that the launch argument ``values`` stand for."""
    argv: list[str] = []
    for action in _options(parser):
        value = str(values.get(action.dest, "")).strip()
        if not action.option_strings:  # positional
            argv.append(value)
            continue
        flag = action.option_strings[-1]
        if isinstance(action, argparse._StoreTrueAction):
            if value.lower() in ("true", "1", "yes"):
                argv.append(flag)
        elif isinstance(action, argparse._AppendAction):
            for item in shlex.split(value):
                argv += [flag, item]
        elif value:
            argv += [flag, value]
    return argv


def experiment_processes(values: dict[str, str], *, supervised: bool = False) -> list[Process]:
    """The processes ``loopgate up`` starts for these launch arguments (or, with
    ``supervised``, ``loopgate up`` itself, which then also drains and writes ``summary.json``)."""
    from gateway.config import load_config
    from gateway.supervisor import build_parser, default_run_dir, prepare_run

    parser = build_parser()
    argv = cli_argv(parser, values)
    if supervised:
        return [Process("loopgate_up", [sys.executable, "-m", "gateway.supervisor", *argv])]
    args = parser.parse_args(argv)
    overrides = list(args.set) + ([f"run.max_env_steps={args.max_env_steps}"] if args.max_env_steps else [])
    cfg = load_config(args.config, overrides)
    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(cfg)
    _, services, _ = prepare_run(cfg, run_dir, (args.log_level or cfg.run.log_level).upper())
    ordered = sorted(services, key=lambda s: s.order)
    return [Process(s.name, list(s.argv), respawn=s.restart, env=dict(s.env)) for s in ordered]


def emulator_process(values: dict[str, str]) -> Process:
    """The robot emulator for these launch arguments."""
    from robots.emulator import build_parser

    argv = cli_argv(build_parser(), values)
    return Process("reach_arm_emulator", [sys.executable, "-m", "robots.emulator", *argv])
