"""``loopgate bench``: the smoke run writes every promised record with sound ratios.

The integration test runs the real command in a subprocess (a real gateway, the
product's env worker and a raw ZeroMQ pair) and checks the JSON contract scripts
rely on. It asserts nothing about speed: that is what the benchmark reports.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks import suites
from benchmarks.records import Record, finish, select
from tests.conftest import time_left, wait_for

REPO = Path(__file__).resolve().parents[1]
SIZES = ("64B", "4KiB", "150KiB")
RTT_NAMES = {
    f"{side}.rtt_{q}_us.{size}" for side in ("gateway", "zmq") for q in ("p50", "p99") for size in SIZES
}
CONTRACT_KEYS = {"name", "value", "unit", "baseline", "baseline_value", "ratio"}


def run_bench(*args: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
    """``loopgate bench ARGS``; stopped with SIGTERM (it then stops its own children) on timeout."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "bench", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        pytest.fail(f"loopgate bench {' '.join(args)} ran past {timeout_s:.0f} s:\n{out[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, None)


@pytest.mark.integration
def test_quick_gateway_rtt_writes_every_record_with_its_baseline_and_ratio(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    result = run_bench("--quick", "--only", "gateway.rtt", "--json", str(out))
    assert result.returncode == 0, result.stdout[-3000:]
    records = json.loads(out.read_text())
    by_name = {r["name"]: r for r in records}
    assert len(by_name) == len(records), "duplicate record names"
    missing = RTT_NAMES - set(by_name)
    assert not missing, f"records missing: {sorted(missing)}"
    # --only keeps what matches and the baselines it refers to, nothing else.
    assert all("rtt" in name for name in by_name), sorted(by_name)
    for r in records:
        assert not CONTRACT_KEYS - set(r), r
        assert isinstance(r["value"], (int, float)) and math.isfinite(r["value"]) and r["value"] > 0, r
        assert r["unit"] == "us"
        if r["name"].startswith("zmq."):
            assert r["baseline"] is None and r["baseline_value"] is None and r["ratio"] is None, r
        else:
            base = by_name[r["baseline"]]
            assert r["baseline"] == "zmq." + r["name"].removeprefix("gateway."), r
            assert r["baseline_value"] == base["value"]
            assert r["ratio"] == pytest.approx(r["value"] / base["value"])
    target = by_name["gateway.rtt_p50_us.4KiB"]
    assert target["target"] == "ratio <= 2.5" and isinstance(target["met"], bool)
    # The table is the command's output; it names the records too.
    assert "gateway.rtt_p50_us.4KiB" in result.stdout


@pytest.mark.integration
def test_the_unix_socket_reference_measures_real_round_trips_between_two_processes(tmp_path: Path) -> None:
    """``unix.*`` (the transport AsyncVectorEnv uses, without ZeroMQ's I/O threads): a real
    server and client process; the server ends by itself when its client is done."""
    from benchmarks.gateway_rtt import NAMES, measure_unix
    from benchmarks.procs import split_placement

    data = measure_unix(tmp_path, 4096, 20, 300, split_placement())
    assert data["rtt_us"].shape == (300,) and data["period_us"].shape == (300,)
    assert np.isfinite(data["rtt_us"]).all() and (data["rtt_us"] > 0).all()
    assert {f"unix.rtt_{q}_us.{size}" for q in ("p50", "p99") for size in SIZES} <= set(NAMES)


@pytest.mark.integration
def test_the_unix_socket_server_gives_up_on_a_client_that_never_comes(tmp_path: Path) -> None:
    path = tmp_path / "rtt.sock"
    args = ["--log-level", "INFO", "unix-server", "--bind", str(path), "--bytes", "64", "--wait-s", "0.5"]
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.rtt_peers", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 1, run.stderr
    assert "waiting up to 0.5 s for the client" in run.stderr and "no client within 0.5 s" in run.stderr


@pytest.mark.integration
def test_the_unix_socket_server_gives_up_on_a_client_that_goes_silent(tmp_path: Path) -> None:
    """A connected client that sends nothing ends the server with an error naming the
    wait, as a missing one does (the read's deadline, SO_RCVTIMEO)."""
    import socket

    path = tmp_path / "rtt.sock"
    args = ["--log-level", "INFO", "unix-server", "--bind", str(path), "--bytes", "64", "--wait-s", "1"]
    server = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.rtt_peers", *args], cwd=REPO, stderr=subprocess.PIPE, text=True
    )
    try:
        wait_for(
            lambda: path.exists() or server.poll() is not None,
            timeout=time_left(),
            what="the server to listen",
        )
        assert server.poll() is None, "the server exited before it listened"
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(str(path))
            assert server.wait(timeout=30) == 1
    finally:
        if server.poll() is None:
            server.kill()
    assert "the client sent nothing for 1 s" in server.communicate()[1]


@pytest.mark.unit
def test_ratio_is_value_over_the_baseline_measured_in_the_same_run() -> None:
    records = [
        Record.median_of("zmq.rtt_p50_us.4KiB", [100.0, 80.0, 120.0], "us"),
        Record.median_of(
            "gateway.rtt_p50_us.4KiB",
            [210.0, 200.0, 260.0],
            "us",
            baseline="zmq.rtt_p50_us.4KiB",
            target="<= 2.5",
        ),
        Record(name="gateway.orphan", value=1.0, unit="us", baseline="not.measured"),
    ]
    base, gw, orphan = (r.to_json() for r in finish(records))
    assert base["value"] == 100.0 and base["ratio"] is None and base["baseline"] is None
    assert gw["value"] == 210.0 and gw["baseline_value"] == 100.0
    assert gw["ratio"] == pytest.approx(2.1) and gw["met"] is True
    assert gw["repeats"] == [210.0, 200.0, 260.0]
    assert orphan["baseline"] is None and orphan["baseline_value"] is None and orphan["ratio"] is None


@pytest.mark.unit
def test_only_keeps_matching_records_and_their_baselines() -> None:
    records = [
        Record(name="zmq.rtt_p50_us.64B", value=1.0, unit="us"),
        Record(name="gateway.rtt_p50_us.64B", value=2.0, unit="us", baseline="zmq.rtt_p50_us.64B"),
        Record(name="gateway.rtt_p50_us.4KiB", value=2.0, unit="us", baseline="zmq.rtt_p50_us.4KiB"),
        Record(name="zmq.rtt_p50_us.4KiB", value=1.0, unit="us"),
    ]
    kept = [r.name for r in select(records, "gateway.rtt_p50_us.64B")]
    assert kept == ["zmq.rtt_p50_us.64B", "gateway.rtt_p50_us.64B"]
    with pytest.raises(ValueError, match="two records"):
        finish([records[0], records[0]])


@pytest.mark.unit
def test_only_skips_suites_that_cannot_match() -> None:
    run, declared = suites.load("gateway")
    assert callable(run) and "gateway.rtt_p50_us.4KiB" in declared
    assert suites.selected("gateway", declared, "gateway.rtt")
    assert not suites.selected("gateway", declared, "collect.steps_per_s")
    _, collect_names = suites.load("collect")
    assert suites.selected("collect", collect_names, "n16")
    assert not suites.selected("collect", collect_names, "gateway.rtt")


def _good_suite(quick: bool, repeats: int) -> list[Record]:
    return [Record(name="fake.value", value=float(repeats), unit="x")]


def _broken_suite(quick: bool, repeats: int) -> list[Record]:
    raise RuntimeError("a peer did not start")


@pytest.mark.unit
def test_a_failing_suite_costs_only_its_own_records(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from benchmarks import __main__ as bench

    monkeypatch.setattr(
        suites,
        "SUITES",
        {"broken": "tests.test_bench:_broken_suite", "good": "tests.test_bench:_good_suite"},
    )
    out = tmp_path / "bench.json"
    assert bench.main(["--repeats", "3", "--json", str(out)]) == 1
    assert [r["name"] for r in json.loads(out.read_text())] == ["fake.value"]
    outcome = bench.run_suites(quick=True, repeats=2, only=None)
    assert outcome.failed == ["broken"] and [r.value for r in outcome.records] == [2.0]


def test_time_to_80_counts_to_the_end_of_the_round_that_reached_the_bar() -> None:
    """The main job's time is the round's own end (the gateway's stamp), not when a later
    metrics record happened to be written or read; a round below the bar does not count."""
    from benchmarks.learn import _reached

    def row(rate: float | None, t: float = 1_800_000_000.25) -> dict[str, object]:
        return {"service": "gateway", "env_steps": 10, "eval": {"last": {"success_rate": rate, "t": t}}}

    assert _reached(row(0.8), 0.8) == 1_800_000_000.25
    assert _reached(row(0.79), 0.8) is None
    assert _reached(row(None), 0.8) is None
    assert _reached({"service": "gateway", "env_steps": 10}, 0.8) is None


@pytest.mark.unit
def test_the_bench_names_the_checkout_and_commit_it_measures(tmp_path):
    """Comparing versions means knowing which code ran: the checkout, its commit, and
    whether tracked files differ from it; a folder outside git says so."""
    from benchmarks.procs import code_version

    repo = tmp_path / "checkout"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.org"]
    subprocess.run([*git, "init", "-q"], check=True, timeout=30)
    (repo / "a.py").write_text("x = 1\n")
    subprocess.run([*git, "add", "a.py"], check=True, timeout=30)
    subprocess.run([*git, "commit", "-q", "-m", "one"], check=True, timeout=30)
    head = subprocess.run(
        [*git, "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, check=True, timeout=30
    ).stdout.strip()
    assert code_version(repo) == f"{repo} at {head}"
    (repo / "a.py").write_text("x = 2\n")
    assert code_version(repo) == f"{repo} at {head} with uncommitted changes"
    (tmp_path / "plain").mkdir()
    assert code_version(tmp_path / "plain") == f"{tmp_path / 'plain'} (not a git checkout)"


def descendants(pid: int) -> dict[int, str]:
    """Every process below ``pid`` (children, theirs, ...), with its command line."""
    parents: dict[int, int] = {}
    commands: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
            commands[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
    found: dict[int, str] = {}
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        for child, ppid in parents.items():
            if ppid == parent and child not in found:
                found[child] = commands.get(child, "")
                frontier.append(child)
    return found


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_a_bench_killed_outright_leaves_none_of_its_processes_running() -> None:
    """``loopgate bench`` killed with SIGKILL (an OOM kill, a CI job cancelled) while it
    measures the gateway: its gateway and worker kept spinning on the cores, unowned, until
    someone found them. Each now ends with it: the kernel's SIGTERM, and the gateway's and
    worker's own lifeline."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "bench", "--only", "gateway.rtt_p50_us.4KiB", "--repeats", "1"],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    running: dict[int, str] = {}

    def gateway_started() -> bool:
        running.update(descendants(proc.pid))
        return any("gateway.hub" in command for command in running.values())

    def left() -> list[str]:
        """What still runs of what the bench started (a pid reused since is not it)."""
        alive = []
        for pid, command in running.items():
            with contextlib.suppress(OSError):
                if (Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()) == command:
                    alive.append(f"{pid}: {command}")
        return alive

    try:
        wait_for(gateway_started, timeout=time_left(margin=60), interval=0.1, what="the bench's gateway")
        running.update(descendants(proc.pid))
        proc.kill()
        proc.wait(timeout=30)
        wait_for(lambda: not left(), timeout=40, what="the bench's processes to end")
    finally:
        if proc.poll() is None:
            proc.kill()
        for still in left():  # only what is still the bench's: a reused pid is not
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(still.split(":")[0]), signal.SIGKILL)
