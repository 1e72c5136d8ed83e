"""The ROS 2 launch files: valid Python, starting real entry points with arguments they accept.

``ros2 launch`` itself (the ``launch`` package) is not available as a wheel, so the
files compute what they start in plain functions (``arguments()``, ``processes()``)
that these tests call; the launch description is built only where ``launch`` imports.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from gateway.cli import COMMANDS
from gateway.services import TORCHRUN_MODULES
from robots.launching import cli_argv

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
LAUNCH_FILES = sorted((REPO / "launch").glob("*.launch.py"))
PACKAGE_MAINS = {
    "gateway.hub": "gateway.hub.__main__",
    "gateway.worker": "gateway.worker.cli",
    "inference": "inference.__main__",
    "trainer.replay": "trainer.replay.cli",
    "trainer": "trainer.__main__",
}
ENTRY_MODULES = {target.partition(":")[0] for target, _ in COMMANDS.values()}


def load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(path.stem.replace(".", "_"), path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_process(argv: list[str]) -> str:
    """``argv`` is ``python -m <loopgate entry point> args`` and the entry point's parser accepts ``args``."""
    assert argv[:2] == [sys.executable, "-m"], argv
    module_name, args = argv[2], argv[3:]
    if module_name in TORCHRUN_MODULES:  # the trainer under torchrun: check what it runs
        at = args.index("-m")
        assert all(a.startswith("--") for a in args[:at]), args
        module_name, args = args[at + 1], args[at + 2 :]
    # `python -m package` runs package/__main__.py, which hands over to the CLI's module.
    module_name = PACKAGE_MAINS.get(module_name, module_name)
    assert module_name in ENTRY_MODULES, f"{module_name} is not an entry point of the loopgate CLI"
    module = importlib.import_module(module_name)
    assert hasattr(module, "main"), module_name
    # The replay CLI has two parsers (serve, import); the launch files start the service.
    parser = getattr(module, "build_parser", None) or module.build_serve_parser
    parser().parse_args(args)  # SystemExit (a failed test) on an unknown or bad argument
    return module_name


def test_there_is_a_launch_file_for_the_experiment_and_one_for_the_emulator() -> None:
    assert {p.name for p in LAUNCH_FILES} == {"loopgate.launch.py", "emulator.launch.py"}
    for path in LAUNCH_FILES:
        tree = ast.parse(path.read_text(), filename=str(path))
        assert ast.get_docstring(tree), path
        assert any(
            isinstance(n, ast.FunctionDef) and n.name == "generate_launch_description" for n in tree.body
        )


def test_experiment_launch_starts_what_loopgate_up_starts(tmp_path: Path) -> None:
    module = load(REPO / "launch/loopgate.launch.py")
    from gateway.supervisor import build_parser

    names = {a.name for a in module.arguments()}
    assert names == {a.dest for a in build_parser()._actions if a.dest != "help"} | {"supervised"}
    values: dict[str, Any] = {a.name: a.default for a in module.arguments()}
    values.update(config="configs/reach_ros2.yaml", run_dir=str(tmp_path / "run"), set="env.num_envs=1")
    procs = module.processes(values)
    started = {p.name: check_process(p.argv) for p in procs}
    assert started["gateway"] == "gateway.hub.__main__" and started["worker-0"] == "gateway.worker.cli"
    assert started["inference-0"] == "inference.__main__" and started["replay"] == "trainer.replay.cli"
    assert started["trainer"] == "trainer.__main__"
    assert (tmp_path / "run" / "endpoints.json").is_file()  # the same run folder loopgate up prepares
    assert next(p for p in procs if p.name == "worker-0").respawn
    (supervised,) = module.processes({**values, "supervised": "true"})
    assert check_process(supervised.argv) == "gateway.supervisor"
    assert supervised.argv[3:] == cli_argv(build_parser(), values)


def test_emulator_launch_arguments_mirror_its_cli() -> None:
    module = load(REPO / "launch/emulator.launch.py")
    from robots.emulator import build_parser

    assert {a.name for a in module.arguments()} == {
        a.dest for a in build_parser()._actions if a.dest != "help"
    }
    values = {a.name: a.default for a in module.arguments()}
    values.update(namespace="/arm1", camera="true", rate="200")
    (proc,) = module.processes(values)
    assert check_process(proc.argv) == "robots.emulator"
    assert "--camera" in proc.argv and proc.argv[proc.argv.index("--rate") + 1] == "200"


def ros2_launch() -> ModuleType:
    """ROS 2's ``launch`` package; this repository's ``launch/`` folder would shadow it from the repo root."""
    saved, cached = sys.path[:], sys.modules.pop("launch", None)
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO]
    try:
        return importlib.import_module("launch")
    except ImportError:
        if cached is not None:
            sys.modules["launch"] = cached
        pytest.skip("ROS 2's launch package is not installed (there is no wheel for it on PyPI)")
    finally:
        sys.path[:] = saved


def test_launch_descriptions_build_where_ros2_launch_is_installed() -> None:
    launch = ros2_launch()
    for path in LAUNCH_FILES:
        description = load(path).generate_launch_description()
        assert isinstance(description, launch.LaunchDescription)
        assert description.get_launch_arguments()
