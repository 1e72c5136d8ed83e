"""``gateway.live.StartupWatch``: which running workers have not registered, and what their logs say."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from gateway.live import LiveView, StartupWatch, last_line

pytestmark = pytest.mark.unit


def service(name: str, pid: int | None, state: str = "running") -> dict:
    return {"name": name, "state": state, "pid": pid, "restarts": 0, "detail": ""}


def test_a_worker_late_to_register_is_reported_with_its_last_log_line(tmp_path: Path, caplog) -> None:
    (tmp_path / "worker-1.log").write_text(
        "starting\nwaiting for the robot: nothing yet on ['/b/joint_states']\n\n"
    )
    watch = StartupWatch(tmp_path, notice_s=10.0)
    status = {"workers": [{"uid": "a", "pid": 100}]}
    services = [service("gateway", 99), service("worker-0", 100), service("worker-1", 101)]
    caplog.set_level(logging.INFO, logger="gateway.live")
    watch.check(status, services, now=0.0)
    watch.check(status, services, now=9.0)
    assert watch.details == {} and "has not registered" not in caplog.text
    watch.check(status, services, now=10.5)
    assert list(watch.details) == ["worker-1"]
    assert watch.details["worker-1"].endswith("waiting for the robot: nothing yet on ['/b/joint_states']")
    assert caplog.text.count("worker-1 has not registered with the gateway 10 s after it started") == 1
    watch.check(status, services, now=15.0)  # told again only after another notice_s
    assert caplog.text.count("has not registered") == 1
    watch.check(status, services, now=21.0)
    assert caplog.text.count("has not registered") == 2
    # Restarted (a new pid): its wait counts from its own start.
    services[2] = service("worker-1", 102)
    watch.check(status, services, now=22.0)
    assert watch.details == {}
    # Registered: nothing more to say.
    status = {"workers": [{"uid": "a", "pid": 100}, {"uid": "b", "pid": 102}]}
    watch.check(status, services, now=40.0)
    assert watch.details == {}


def test_workers_whose_ids_cannot_match_are_reported_only_when_too_few_registered(tmp_path: Path) -> None:
    """On other hosts (the Ray engine) the supervisor's pids are not the workers': every
    worker registered means nothing to report, whatever the ids."""
    watch = StartupWatch(tmp_path, notice_s=1.0)
    services = [service("worker-0", 500), service("worker-1", 501), service("worker-2", 502, state="backoff")]
    everyone = {"workers": [{"uid": "a", "pid": 7}, {"uid": "b", "pid": None}]}
    for now in (0.0, 5.0):
        watch.check(everyone, services, now=now)
    assert watch.details == {}
    watch.check({"workers": [{"uid": "a", "pid": 7}]}, services, now=6.0)
    watch.check({"workers": [{"uid": "a", "pid": 7}]}, services, now=7.5)
    assert sorted(watch.details) == ["worker-0", "worker-1"]  # not the one that is not running
    assert watch.details["worker-0"].endswith("(nothing yet)")


def test_last_line_reads_the_end_of_a_long_log(tmp_path: Path) -> None:
    log = tmp_path / "w.log"
    log.write_text("x" * 100_000 + "\nfirst\n" + "last " * 100 + "\n\n")
    assert last_line(log, limit=20) == "last last last la..."
    assert last_line(tmp_path / "missing.log") == ""


def test_an_operators_hold_is_said_when_it_starts_and_when_it_ends(caplog) -> None:
    """Before, ``loopgate up`` showed steps/s falling to 0 and nothing else while an e-stop
    or a pause held collection. The sink's backpressure comes and goes by itself: it is
    in the status line only."""
    from io import StringIO

    from rich.console import Console

    view = LiveView("run", None, console=Console(file=StringIO()))
    estop = {"held": "estop", "held_why": "the e-stop is engaged; steps resume once it is released"}
    with caplog.at_level(logging.INFO, logger="gateway.live"):
        for status in (
            {"held": None},
            estop,
            estop,
            {"held": "backpressure"},
            {"held": None},
            {"held": "paused"},
        ):
            view.update({"env_steps": 0, **status}, [], {})
    assert [r.getMessage() for r in caplog.records if "collection" in r.getMessage()] == [
        "collection held: the e-stop is engaged; steps resume once it is released",
        "collection resumed (estop lifted)",
        "collection held: paused",
    ]
