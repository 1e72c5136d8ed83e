"""Process-level helpers shared by loopgate's long-running services."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO

FROZEN = """
import gc, json
import numpy, zmq  # what a service has loaded by the time its loop starts
from gateway.services import freeze_heap

freeze_heap()
frozen = gc.get_freeze_count()

class Node:
    pass

a, b = Node(), Node()
a.other, b.other = b, a  # a reference cycle made after the freeze
del a, b
print(json.dumps({"frozen": frozen, "collected": gc.collect()}))
"""


def test_freeze_heap_takes_startup_objects_out_of_collections_but_still_collects_new_garbage():
    """In a fresh interpreter: the modules loaded at start-up are frozen, and a cycle made
    afterwards is still found and freed."""
    import json

    out = subprocess.run(
        [sys.executable, "-c", FROZEN], capture_output=True, text=True, cwd=REPO, timeout=60, check=True
    )
    result = json.loads(out.stdout)
    assert result["frozen"] > 10_000
    assert result["collected"] >= 2


def test_free_port_never_hands_out_the_same_port_twice(monkeypatch):
    """A port is free again once the probing socket is closed, so a later draw may hit it
    (one run planned the same port for the replay and the inference control sockets). The
    draws are replayed here: a port already handed out is skipped, the next draw is taken."""
    from gateway import services

    first = services.free_port()
    pool = services.planned_pool()
    assert pool is not None
    # Not one an earlier test of this process was handed (it would be skipped as well).
    other = next(p for p in pool if not services.planned(p) and services.bindable("127.0.0.1", p))
    draws = iter([first, first, other])
    monkeypatch.setattr(services._draw, "choice", lambda pool: next(draws))
    assert services.free_port() == other
    assert next(draws, None) is None  # it drew until the port was new


def test_planned_ports_lie_outside_the_ephemeral_range_outgoing_connections_take():
    """A planned port must not be one the OS may hand an outgoing connection before the
    service binds it (a Ray worker's connection took an inference server's port for all its
    restarts once)."""
    from gateway import services

    low, high = services.ephemeral_ports()
    ports = [services.free_port() for _ in range(50)]
    assert not [p for p in ports if low <= p <= high], (low, high, ports)
    assert services.planned_pool((32768, 60999)) == range(20000, 32768)
    assert services.planned_pool((15000, 25000)) == range(25001, 32768)
    assert services.planned_pool((1024, 65535)) is None  # nowhere left: the OS picks
    assert services.planned_pool((40000, 60999)) == range(20000, 32768)
    assert services.ephemeral_ports("/nonexistent") == (32768, 60999)


def test_a_planned_port_another_process_took_is_planned_again_and_written(tmp_path):
    """Before a service starts, each address it binds on a port planned by this process
    and taken meanwhile gets a new port in ``endpoints.json``; a port the config names
    stays (binding it then fails with the OS's error, naming the address)."""
    import json
    import socket

    from gateway import services

    taken_port, named_port = services.free_port(), services.free_port()
    services._handed_out.discard(named_port)  # as if a config had named it
    endpoints = {
        "inference": [
            {"requests": f"tcp://127.0.0.1:{taken_port}", "control": f"tcp://127.0.0.1:{named_port}"}
        ],
        "metrics": {"inference-0": f"http://127.0.0.1:{services.free_port()}/metrics"},
    }
    run = services.RunContext(tmp_path, tmp_path / "config.yaml", json.loads(json.dumps(endpoints)))
    holders = []
    for port in (taken_port, named_port):
        holder = socket.socket()
        holder.bind(("127.0.0.1", port))
        holder.listen()
        holders.append(holder)
    try:
        assert services.replan_taken(run, "worker-0") == []  # binds nothing
        moves = services.replan_taken(run, "inference-0")
        assert len(moves) == 1 and str(taken_port) in moves[0], moves
        written = json.loads((tmp_path / "endpoints.json").read_text())
        assert written == run.endpoints
        new = written["inference"][0]["requests"]
        assert new != endpoints["inference"][0]["requests"] and new.startswith("tcp://127.0.0.1:")
        assert services.bindable("127.0.0.1", int(new.rsplit(":", 1)[1]))
        assert written["inference"][0]["control"] == endpoints["inference"][0]["control"]
        assert written["metrics"] == endpoints["metrics"]  # still free: unchanged
        assert services.replan_taken(run, "inference-0", here=lambda host: False) == []
    finally:
        for holder in holders:
            holder.close()


def test_a_run_nice_that_raises_a_priority_without_the_right_is_a_config_error(tmp_path, monkeypatch):
    """``run.nice`` below 0 needs CAP_SYS_NICE or a nice limit: without them ``loopgate up``
    refuses the config before anything starts, naming the entry. The right is taken away
    by patching ``gateway.priority`` (these machines run the tests as root, which has it)."""
    import pytest
    import yaml

    from gateway import priority
    from gateway.config import ConfigError, load_config
    from gateway.supervisor import prepare_run

    config = tmp_path / "nice.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "env": {"backend": "mujoco_reach", "workers": 1, "num_envs": 1},
                "policy": {"kind": "random"},
                "run": {"nice": {"gateway": -5, "worker": 10}},
            }
        )
    )
    cfg = load_config(config)
    monkeypatch.setattr(priority, "has_sys_nice", lambda: False)
    monkeypatch.setattr(priority.resource, "getrlimit", lambda _: (0, 0))
    assert priority.may_set_niceness(10) and not priority.may_set_niceness(-5)
    with pytest.raises(ConfigError, match=r"run\.nice\.gateway: -5 .*CAP_SYS_NICE"):
        prepare_run(cfg, tmp_path / "run", "INFO")
    assert not (tmp_path / "run").exists()
    monkeypatch.setattr(priority, "has_sys_nice", lambda: True)
    assert priority.may_set_niceness(-5)


def test_the_preflight_checks_the_main_job_without_importing_torch(tmp_path):
    """``loopgate up`` checks every block (the trainer's options and experiment included)
    before it starts anything; importing torch for that delayed every start by about a
    second. Run in a fresh interpreter: this one has torch already."""
    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from gateway.config import load_config\n"
        "from gateway.supervisor import prepare_run\n"
        f"cfg = load_config(Path({str(REPO / 'configs' / 'reach_sim.yaml')!r}))\n"
        f"prepare_run(cfg, Path({str(tmp_path / 'run')!r}), 'INFO')\n"
        "print(sorted(m for m in ('torch', 'onnxruntime') if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
    assert (tmp_path / "run" / "endpoints.json").exists()


def test_an_unknown_algorithm_or_a_bad_option_is_refused_before_anything_starts(tmp_path):
    import pytest

    from gateway.config import ConfigError, load_config
    from gateway.supervisor import prepare_run

    cfg = load_config(REPO / "configs" / "reach_sim.yaml", ["trainer.algorithm=sac2"])
    with pytest.raises(ConfigError, match="unknown algorithm 'sac2'; known: bc, ppo, sac"):
        prepare_run(cfg, tmp_path / "run", "INFO")
    cfg = load_config(REPO / "configs" / "reach_sim.yaml", ["trainer.options.tau=2"])
    with pytest.raises(ConfigError, match=r"trainer\.options\.tau must be in \(0, 1\]"):
        prepare_run(cfg, tmp_path / "run", "INFO")
    assert not (tmp_path / "run").exists()
