"""The control loop's hub, its policy and the e-stop's path at real-time priority
(``run.realtime_priority``).

On cores saturated by simulators, camera rendering and browsers, each hop of the e-stop
(the console's event loop, the ZeroMQ I/O threads, the gateway's control line and the
loop whose GIL it needs) would otherwise wait for a core. These tests read the scheduling policy of real processes'
threads from the kernel (``sched_getscheduler``); they need the right to use real-time
scheduling, which root (as in CI) has, and check the refusal by dropping that right
with ``setpriv``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from gateway.priority import may_use_realtime
from tests.conftest import REPO, wait_for
from tests.test_reliability import clients_address, ended
from tests.test_trainer_e2e import up

needs_realtime = pytest.mark.skipif(
    not may_use_realtime(10), reason="this user may not use real-time scheduling (no CAP_SYS_NICE, no rtprio)"
)


def realtime_threads(pid: int) -> set[int]:
    """Thread ids of process ``pid`` that run under ``SCHED_FIFO``."""
    found = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            if os.sched_getscheduler(int(tid)) == os.SCHED_FIFO:
                found.add(int(tid))
        except OSError:  # the thread ended meanwhile
            continue
    return found


def threads(pid: int) -> list[tuple[str, int]]:
    """``(name, real-time priority)`` of each thread of process ``pid``."""
    found = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            found.append((name, os.sched_getparam(int(tid)).sched_priority))
        except OSError:  # the thread ended meanwhile
            continue
    return found


def thread_priorities(pid: int) -> dict[str, int]:
    """The real-time priorities of process ``pid``'s ZeroMQ I/O threads, by name, and of
    its other threads (``other``, when they all share one)."""
    found: dict[str, set[int]] = {}
    for name, priority in threads(pid):
        found.setdefault(name if name.startswith("ZMQbg/IO") else "other", set()).add(priority)
    return {name: next(iter(p)) if len(p) == 1 else -1 for name, p in found.items()}


def every_priority(pid: int) -> list[int]:
    """The real-time priority of each thread of process ``pid``."""
    return [priority for _, priority in threads(pid)]


def pid_of(pattern: str, run: Path) -> int:
    found = subprocess.run(["pgrep", "-f", f"{pattern}.*{run}"], capture_output=True, text=True)
    pids = [int(p) for p in found.stdout.split()]
    assert len(pids) == 1, (pattern, pids)
    return pids[0]


def console_config(tmp_path: Path, priority: int) -> Path:
    cfg = {
        "env": {"backend": "mujoco_reach", "workers": 1, "num_envs": 2, "seed": 0},
        "policy": {"kind": "inference"},
        "inference": {"enabled": True, "backend": "torch", "network": {"hidden_sizes": [16]}},
        "console": {"enabled": True, "port": 0},
        "run": {"max_env_steps": None, "status_interval_s": 0.2, "realtime_priority": priority},
    }
    path = tmp_path / "console.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@needs_realtime
@pytest.mark.e2e
@pytest.mark.parametrize("priority", [10, 0], ids=["on", "off"])
def test_the_gateway_its_policy_and_the_consoles_estop_path_run_at_real_time_priority_and_nothing_else(
    tmp_path, priority
):
    """Under ``loopgate up`` with the console and an inference server: every thread of the
    gateway (its loop, its control line, its I/O and writer threads) and of the inference
    server (serving, I/O) but its weights loader, and the console's event loop and I/O
    threads, are ``SCHED_FIFO`` (the inference server's weights socket's context, its I/O
    and reaper threads, one priority below); the loader, the console's other threads and the env
    worker (a simulator stepping flat out must leave the cores to others) are not.
    ``realtime_priority: 0`` leaves every thread at normal priority."""
    run = tmp_path / "run"
    proc = up(console_config(tmp_path, priority), run)
    try:
        clients_address(run)
        wait_for(lambda: "console" in json.loads((run / "endpoints.json").read_text()), what="the console")
        gateway, console = pid_of("gateway.hub", run), pid_of("gateway.console", run)
        worker, inference = pid_of("gateway.worker", run), pid_of("m inference --config", run)
        if priority:

            def every_thread(pid: int) -> bool:
                return realtime_threads(pid) == {int(t) for t in os.listdir(f"/proc/{pid}/task")}

            wait_for(lambda: every_thread(gateway), what="every thread of the gateway")
            # The inference server's weights loader leaves real-time scheduling (normal
            # priority, 0 here); every other thread of it is real-time, the weights socket's
            # context's (I/O and reaper) one priority below the rest.
            wait_for(
                lambda: len(realtime_threads(inference)) == len(os.listdir(f"/proc/{inference}/task")) - 1,
                what="every thread of the inference server but its loader",
            )
            below = sorted(name for name, p in threads(inference) if p == priority - 1)
            assert below == ["7/ZMQbg/IO/0", "7/ZMQbg/Reaper"], threads(inference)
            # The gateway's ZeroMQ I/O thread one step above: a sent ACTION leaves while the
            # loop goes on. The inference server's at its loop's own: a batch's answers
            # leave together once the loop waits.
            assert thread_priorities(gateway) == {"ZMQbg/IO/0": priority + 1, "other": priority}
            assert sorted(every_priority(inference)) == [
                0,
                priority - 1,
                priority - 1,
                *[priority] * (len(os.listdir(f"/proc/{inference}/task")) - 3),
            ]
            # The event loop is the console's main thread; its I/O threads follow it.
            wait_for(lambda: console in realtime_threads(console), what="the console's event loop")
            assert len(realtime_threads(console)) >= 2
            assert len(realtime_threads(console)) < len(os.listdir(f"/proc/{console}/task"))
        else:
            assert realtime_threads(gateway) == set() and realtime_threads(console) == set()
            assert realtime_threads(inference) == set()
        assert realtime_threads(worker) == set()
        proc.send_signal(signal.SIGINT)
    except BaseException:
        proc.kill()
        raise
    _, summary = ended(proc, run)
    assert summary["outcome"] == "interrupted"


@pytest.mark.unit
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv (util-linux) is not installed")
def test_without_the_right_the_estop_path_stays_at_normal_priority_and_says_what_would_allow_it():
    """A process without ``CAP_SYS_NICE`` and without an ``rtprio`` limit: nothing changes,
    and the log names both ways to allow it."""
    probe = (
        "import json, logging, os, zmq\n"
        "logging.basicConfig(level=logging.INFO)\n"
        "from gateway.priority import go_realtime, zmq_io_threads\n"
        "sock = zmq.Context.instance().socket(zmq.PAIR)\n"
        "took = go_realtime(10, 'probe')\n"
        "print(json.dumps({'took': took, 'policies': [os.sched_getscheduler(0)] +"
        " [os.sched_getscheduler(t) for t in zmq_io_threads()]}))\n"
    )
    drop = ["setpriv", "--bounding-set", "-sys_nice", "--inh-caps", "-sys_nice", "--"]
    out = subprocess.run(
        [*drop, sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result == {"took": False, "policies": [os.SCHED_OTHER] * len(result["policies"])}
    assert "CAP_SYS_NICE" in out.stderr and "rtprio" in out.stderr


@pytest.mark.unit
def test_realtime_priority_outside_0_to_99_is_a_config_error():
    from gateway.config import ConfigError, RunConfig

    for bad in (-1, 100):
        with pytest.raises(ConfigError, match=r"run\.realtime_priority"):
            RunConfig(realtime_priority=bad)
    assert RunConfig().realtime_priority == 10


@needs_realtime
@pytest.mark.unit
def test_a_background_thread_leaves_real_time_scheduling_and_a_normal_one_is_left_alone():
    """A fresh process at real-time priority 10: a thread that leaves runs under
    ``SCHED_OTHER`` while the rest stay ``SCHED_FIFO`` at 10; in a process at normal
    priority nothing changes."""
    probe = (
        "import json, os, sys, threading\n"
        "from gateway.priority import go_realtime, leave_realtime\n"
        "if sys.argv[1] == 'rt': go_realtime(10, 'probe', every_thread=True)\n"
        "seen = {}\n"
        "def background():\n"
        "    seen['took'] = leave_realtime('probe')\n"
        "    seen['self'] = [os.sched_getscheduler(0), os.sched_getparam(0).sched_priority]\n"
        "t = threading.Thread(target=background); t.start(); t.join()\n"
        "seen['main'] = [os.sched_getscheduler(0), os.sched_getparam(0).sched_priority]\n"
        "print(json.dumps(seen))\n"
    )
    for mode, expected in (
        ("rt", {"took": True, "self": [os.SCHED_OTHER, 0], "main": [os.SCHED_FIFO, 10]}),
        ("normal", {"took": False, "self": [os.SCHED_OTHER, 0], "main": [os.SCHED_OTHER, 0]}),
    ):
        out = subprocess.run(
            [sys.executable, "-c", probe, mode], cwd=REPO, capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout) == expected, mode


@needs_realtime
@pytest.mark.unit
def test_a_named_zmq_contexts_threads_step_below_and_the_serving_contexts_stay():
    """A fresh process with two ZeroMQ contexts, one named as the inference server names its
    weights context: after ``go_realtime(every_thread=True)``, ``step_below`` of the threads
    ``weights_threads`` finds by that name runs exactly them (I/O and reaper) one
    ``SCHED_FIFO`` priority below; the default context's I/O thread (``zmq_io_threads``,
    which does not count the named one) and the main thread stay at the process's. At the
    lowest real-time priority there is none below: they run under ``SCHED_OTHER``; in a
    process at normal priority nothing changes."""
    probe = (
        "import json, os, sys, time, zmq\n"
        "from gateway.priority import go_realtime, step_below, zmq_io_threads\n"
        "from inference.server import WEIGHTS_THREADS, weights_threads\n"
        "serving = zmq.Context.instance().socket(zmq.ROUTER)\n"
        "bulk = zmq.Context(io_threads=1); bulk.set(zmq.THREAD_NAME_PREFIX, WEIGHTS_THREADS)\n"
        "weights = bulk.socket(zmq.ROUTER)\n"
        # libzmq's threads name themselves once running: on a busy machine, a moment later.
        "deadline = time.monotonic() + 30\n"
        "while not zmq_io_threads() and time.monotonic() < deadline: time.sleep(0.001)\n"
        "go_realtime(int(sys.argv[1]), 'probe', every_thread=True, io_above=False)\n"
        "named = weights_threads()\n"
        "took = step_below('probe', named)\n"
        "param = lambda t: [os.sched_getscheduler(t), os.sched_getparam(t).sched_priority]\n"
        "print(json.dumps({'took': took, 'named': sorted({tuple(param(t)) for t in named}),\n"
        "    'io': [param(t) for t in zmq_io_threads()], 'main': param(0), 'count': len(named)}))\n"
    )
    fifo, other = os.SCHED_FIFO, os.SCHED_OTHER
    for priority, expected in (
        (10, {"took": True, "named": [[fifo, 9]], "io": [[fifo, 10]], "main": [fifo, 10], "count": 2}),
        (1, {"took": True, "named": [[other, 0]], "io": [[fifo, 1]], "main": [fifo, 1], "count": 2}),
        (0, {"took": False, "named": [[other, 0]], "io": [[other, 0]], "main": [other, 0], "count": 2}),
    ):
        out = subprocess.run(
            [sys.executable, "-c", probe, str(priority)], cwd=REPO, capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout) == expected, priority


@pytest.mark.unit
def test_the_kernels_real_time_budget_is_read_and_said_in_words(tmp_path):
    """``realtime_budget`` reads the two kernel settings (here from a stand-in for
    ``/proc/sys/kernel``); -1 is no limit; a kernel that does not say is unknown, not an
    error. On this machine it agrees with the real files."""
    from gateway.priority import describe_realtime_budget, realtime_budget

    (tmp_path / "sched_rt_runtime_us").write_text("950000\n")
    (tmp_path / "sched_rt_period_us").write_text("1000000\n")
    assert realtime_budget(tmp_path) == (950_000, 1_000_000)
    said = describe_realtime_budget(realtime_budget(tmp_path))
    assert "950 ms of each 1000 ms" in said and "stops them 50 ms" in said
    (tmp_path / "sched_rt_runtime_us").write_text("-1\n")
    assert "unlimited" in describe_realtime_budget(realtime_budget(tmp_path))
    (tmp_path / "sched_rt_period_us").unlink()
    assert realtime_budget(tmp_path) is None
    assert describe_realtime_budget(None) == "real-time budget unknown"
    real = Path("/proc/sys/kernel/sched_rt_runtime_us")
    if real.exists():
        budget = realtime_budget()
        assert budget is not None and budget[0] == int(real.read_text())


def threads_at_realtime() -> list[tuple[str, int]]:
    """(name, priority) of this process's threads under ``SCHED_FIFO``."""
    return [(name, prio) for name, prio in threads(os.getpid()) if prio > 0]


@pytest.mark.skipif(
    not may_use_realtime(99),
    reason="this user may not use real-time scheduling: SVT-AV1 cannot take it either",
)
@pytest.mark.integration
def test_the_av1_encoder_leaves_no_thread_at_real_time_priority(tmp_path, caplog):
    """SVT-AV1, allowed real-time scheduling (root, as in CI and most containers), puts
    the thread that opens it and its own threads at SCHED_FIFO 99, above the gateway and
    the e-stop's path. None is left there while frames go in, after the video is written,
    or after an encode that failed as the encoder opened."""
    import logging

    import av

    from trainer.replay.export_video import VideoEncoder, encode

    caplog.set_level(logging.INFO, logger="gateway.priority")
    assert realtime_threads(os.getpid()) == set(), threads_at_realtime()
    encoder = VideoEncoder(codec="libsvtav1", crf=30, preset=12)
    seen: list[list[tuple[str, int]]] = []
    encode(
        np.zeros((12, 32, 32, 3), np.uint8),
        tmp_path / "ok.mp4",
        fps=20,
        encoder=encoder,
        progress=lambda done, total: seen.append(threads_at_realtime()),
    )
    assert len(seen) == 12 and all(s == [] for s in seen), seen
    assert realtime_threads(os.getpid()) == set()
    assert "put" in caplog.text and "real-time priority 99" in caplog.text
    with pytest.raises(av.FFmpegError):
        # Wider than SVT-AV1 takes (16 384): refused by the encoder itself in every PyAV
        # build (2x2 frames, used before, are padded and encoded by PyAV 18.1.1's).
        encode(np.zeros((2, 8, 16_392, 3), np.uint8), tmp_path / "bad.mp4", fps=20, encoder=encoder)
    assert realtime_threads(os.getpid()) == set()


@pytest.mark.skipif(
    not may_use_realtime(99),
    reason="this user may not use real-time scheduling: SVT-AV1 cannot take it either",
)
@pytest.mark.integration
def test_threads_started_after_an_av1_export_run_at_normal_priority(tmp_path):
    """SVT-AV1 sets the opening thread's scheduling through the C library, which keeps its
    own copy of it; put back through the kernel alone, that copy still said ``SCHED_FIFO``
    99, and libzmq, which reads it in each I/O thread it starts, ran every ZeroMQ context
    made after the export (a script's :class:`gateway.client.GatewayEnv`) at 99, above the
    gateway. A fresh process: one export, then a context; its threads and a Python
    thread's are at normal priority."""
    probe = (
        "import json, os, threading, time\n"
        "from pathlib import Path\n"
        "import numpy as np, zmq\n"
        "from trainer.replay.export_video import VideoEncoder, encode\n"
        "encode(np.zeros((4, 16, 16, 3), np.uint8), Path(os.environ['OUT']), fps=20,\n"
        "       encoder=VideoEncoder(codec='libsvtav1', crf=30, preset=12))\n"
        "ctx = zmq.Context(); sock = ctx.socket(zmq.REQ)\n"
        "deadline = time.monotonic() + 30\n"
        "def names():\n"
        "    return {t: Path(f'/proc/self/task/{t}/comm').read_text().strip() for t in os.listdir('/proc/self/task')}\n"
        "while sum(n.startswith('ZMQbg') for n in names().values()) < 2 and time.monotonic() < deadline:\n"
        "    time.sleep(0.01)\n"
        "seen = {}\n"
        "t = threading.Thread(target=lambda: seen.update(py=os.sched_getscheduler(0))); t.start(); t.join()\n"
        "print(json.dumps({'py': seen['py'], **{n: os.sched_getscheduler(int(t)) for t, n in names().items() if n.startswith('ZMQbg')}}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OUT": str(tmp_path / "probe.mp4")},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    policies = json.loads(out.stdout.strip().splitlines()[-1])
    assert policies == {"py": os.SCHED_OTHER, "ZMQbg/Reaper": os.SCHED_OTHER, "ZMQbg/IO/0": os.SCHED_OTHER}
