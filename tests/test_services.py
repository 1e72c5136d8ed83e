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
    """The OS may offer a port again once the probing socket is closed (one run planned
    the same port for the replay and the inference control sockets). That offer cannot
    be provoked on demand, so the OS's choices are replayed here: a port already handed
    out is skipped, and the next one the OS offers is taken."""
    import socket

    from gateway import services

    first = services.free_port()
    offers = iter([first, first, first + 1 if first < 65535 else first - 1])
    real_socket = socket.socket

    class Offering(real_socket):
        def getsockname(self):  # type: ignore[no-untyped-def]
            return ("127.0.0.1", next(offers))

    monkeypatch.setattr(services.socket, "socket", Offering)
    assert services.free_port() != first
    assert next(offers, None) is None  # it asked the OS until the port was new


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
