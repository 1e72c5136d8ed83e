"""Demonstrations recorded at the console, the teleop action shaper, and the package's files.

The demo copy runs against a real replay log on disk (its episode index, chunks read
back from their places); the wheel test builds the real wheel and installs it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gateway.console.recording import Recorder, RecordingError, Take, spans
from gateway.console.teleop import ActionShaper
from gateway.protocol import ProtocolError
from gateway.trajectory import StepRows, validate_chunk
from tests.conftest import REPO, time_left
from trainer.replay.demos import parse_request, take_chunks
from trainer.replay.log import ReplayLog


def chunk(episode: str, first: int, n: int, *, end: str | None = None):
    rows = StepRows(episode, "w0", 1, "reach")
    for s in range(first, first + n):
        rows.add(
            {"joint_pos": np.full(3, s, np.float32)},
            np.full(3, 0.1, np.float32),
            reward=np.float32(-1.0),
            terminated=end == "terminated" and s == first + n - 1,
            truncated=False,
            success=False,
            policy_version=2,
            t_capture=1000.0 + s,
            t_action=1000.5 + s,
            step=s,
            intervention=True,
        )
    final = {"joint_pos": np.full(3, -1, np.float32)} if end else None
    return rows.to_chunk(end=end, final_obs=final)


@pytest.fixture
def replay_log(tmp_path: Path):
    log = ReplayLog(tmp_path / "log", fsync="never")
    try:
        yield log
    finally:
        log.close()


def request(**overrides):
    meta = {"take": "t1", "episodes": [{"episode_id": "w0-1-3", "first_step": 5, "last_step": 12}]}
    return parse_request({**meta, **overrides})


@pytest.mark.unit
@pytest.mark.parametrize(
    ("meta", "fragment"),
    [
        ({"take": "", "episodes": []}, "take must be"),
        ({"take": "a:b", "episodes": []}, "take must be"),
        ({"take": "t", "episodes": []}, "episodes must be a list"),
        ({"take": "t", "episodes": [{"episode_id": "e", "first_step": -1}]}, "first_step must be"),
        (
            {"take": "t", "episodes": [{"episode_id": "e", "first_step": 4, "last_step": 2}]},
            "before first_step",
        ),
        (
            {"take": "t", "label": "great", "episodes": [{"episode_id": "e", "first_step": 0}]},
            "label must be",
        ),
        (
            {"take": "t", "note": "x" * 501, "episodes": [{"episode_id": "e", "first_step": 0}]},
            "note must be",
        ),
        (
            {"take": "t", "success_steps": {"e": ["1"]}, "episodes": [{"episode_id": "e", "first_step": 0}]},
            "success_steps",
        ),
    ],
)
def test_a_bad_demo_request_is_refused_naming_the_field(meta, fragment):
    with pytest.raises(ProtocolError, match=fragment):
        parse_request(meta)


@pytest.mark.unit
def test_a_take_waits_for_its_steps_then_becomes_a_labelled_truncated_demo(replay_log):
    replay_log.append_group([chunk("w0-1-3", 0, 8)])
    req = request(label="success", note="clean", success_steps={"w0-1-3": [9]}, mark_reward=1.0)
    assert "steps 8..13 not stored yet" in take_chunks(req, replay_log.episode_chunks)
    replay_log.append_group([chunk("w0-1-3", 8, 8)])
    (demo,) = take_chunks(req, replay_log.episode_chunks)
    validate_chunk(demo)
    assert demo.meta["source"] == "demos" and demo.meta["episode_id"] == "demo:console:t1:w0-1-3"
    assert (demo.meta["label"], demo.meta["note"], demo.meta["end"]) == ("success", "clean", "truncated")
    assert demo.arrays["step"].tolist() == list(range(5, 13))
    assert demo.arrays["success"].tolist() == [s == 9 for s in range(5, 13)]
    assert demo.arrays["reward"][4] == 1.0 and demo.arrays["reward"][0] == -1.0
    assert demo.arrays["truncated"][-1] and demo.arrays["intervention"].all()
    # The step after the take closes it: its observation is the final one.
    np.testing.assert_array_equal(demo.arrays["final_obs/joint_pos"], [[13, 13, 13]])


@pytest.mark.unit
def test_a_take_to_the_end_of_its_episode_waits_for_the_end_and_keeps_it(replay_log):
    replay_log.append_group([chunk("w0-1-3", 0, 8)])
    req = request(episodes=[{"episode_id": "w0-1-3", "first_step": 2, "last_step": None}])
    assert "has not ended" in take_chunks(req, replay_log.episode_chunks)
    replay_log.append_group([chunk("w0-1-3", 8, 4, end="terminated")])
    (demo,) = take_chunks(req, replay_log.episode_chunks)
    validate_chunk(demo)
    assert demo.meta["end"] == "terminated" and demo.arrays["step"].tolist() == list(range(2, 12))
    np.testing.assert_array_equal(demo.arrays["final_obs/joint_pos"], [[-1, -1, -1]])
    assert "no steps of episode w0-1-9" in take_chunks(
        request(episodes=[{"episode_id": "w0-1-9", "first_step": 0, "last_step": 1}]),
        replay_log.episode_chunks,
    )


@pytest.mark.unit
def test_a_take_across_episodes_covers_the_rest_of_the_first_and_the_start_of_the_last():
    take = Take("t1", "w0", 1, episode=3, step=40)
    assert spans(take, 5, 7) == [
        {"episode_id": "w0-1-3", "first_step": 40, "last_step": None},
        {"episode_id": "w0-1-4", "first_step": 0, "last_step": None},
        {"episode_id": "w0-1-5", "first_step": 0, "last_step": 6},
    ]
    assert spans(take, 4, 0) == [{"episode_id": "w0-1-3", "first_step": 40, "last_step": None}]
    with pytest.raises(RecordingError, match="nothing recorded yet"):
        spans(take, 3, 40)


@pytest.mark.unit
def test_the_recorder_refuses_what_it_cannot_do_and_labels_the_take():
    with pytest.raises(RecordingError, match="needs the replay service"):
        Recorder(None).start("w0", 0, 0, 0)
    rec = Recorder("tcp://127.0.0.1:9")
    with pytest.raises(RecordingError, match="start recording first"):
        rec.mark("success", None, 0, 3)
    with pytest.raises(RecordingError, match="not recording"):
        rec.stop(0, 3)
    rec.start("w0", 1, 0, 10)
    with pytest.raises(RecordingError, match="already recording"):
        rec.start("w0", 1, 0, 11)
    with pytest.raises(RecordingError, match="success or failure"):
        rec.mark("maybe", None, 0, 12)
    with pytest.raises(RecordingError, match="at most 500"):
        rec.mark("failure", "x" * 501, 0, 12)
    rec.mark("failure", "slipped", 0, 12)
    rec.mark("success", None, 0, 14)
    assert rec.take is not None and rec.take.label == "success" and rec.take.note == "slipped"
    assert rec.take.success_steps == {"w0-1-0": [14]}
    take = rec.state()["take"]
    assert rec.discard() == take and rec.state()["recording"] is False and rec.take is None


@pytest.mark.unit
def test_delta_actions_hold_with_zeros_and_scale_the_axes():
    shaper = ActionShaper(np.full(3, -1.0), np.full(3, 1.0), scale=0.5, dt=0.05)
    np.testing.assert_array_equal(shaper.action(2, 1, None), np.zeros((2, 3)))
    np.testing.assert_allclose(shaper.action(2, 1, np.array([1.0, -1.0, 0.0])), [[0, 0, 0], [0.5, -0.5, 0]])


@pytest.mark.unit
def test_absolute_actions_start_at_the_current_command_and_move_from_there():
    shaper = ActionShaper(np.full(2, -2.0), np.full(2, 2.0), scale=0.5, dt=0.1, command_key="target")
    with pytest.raises(ValueError, match="no observation"):
        shaper.action(2, 0, None)
    with pytest.raises(ValueError, match="no 'target'"):
        shaper.observe({"joint_pos": np.zeros((2, 2))}, 2)
    shaper.observe({"target": np.array([[0.3, -0.4], [1.0, 3.0]])}, 2)
    # Bumpless: the first action is the current command (clamped to the bounds).
    np.testing.assert_allclose(shaper.action(2, 0, None), [[0.3, -0.4], [1.0, 2.0]])
    # Axes move env 0's target at scale * half the range per second: 0.5 * 2 * 0.1 per step.
    np.testing.assert_allclose(shaper.action(2, 0, np.array([1.0, 0.0])), [[0.4, -0.4], [1.0, 2.0]])
    np.testing.assert_allclose(shaper.action(2, 0, None), [[0.4, -0.4], [1.0, 2.0]])  # held there


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_the_built_wheel_installs_and_serves_the_console_page(tmp_path: Path):
    """Build the wheel from the working tree, install it with --no-deps into a fresh
    venv, and serve its static files with the console app loaded from that install."""
    src, out, venv = tmp_path / "src", tmp_path / "wheel", tmp_path / "venv"
    src.mkdir()
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, check=True, capture_output=True, text=True
    ).stdout.split()
    tar = subprocess.Popen(
        ["tar", "-cf", "-", "-T", "-"], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    untar = subprocess.Popen(["tar", "-xf", "-", "-C", str(src)], stdin=tar.stdout)
    assert tar.stdin is not None
    tar.stdin.write("\n".join(f for f in files if (REPO / f).is_file()).encode())
    tar.stdin.close()
    assert tar.wait(timeout=time_left()) == 0 and untar.wait(timeout=time_left()) == 0
    pip = [sys.executable, "-m", "pip"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)],
        check=True,
        timeout=time_left(),
        capture_output=True,
    )
    (wheel,) = out.glob("loopgate-*.whl")
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=time_left()
    )
    subprocess.run(
        [*pip, "--python", str(venv / "bin" / "python"), "install", "--no-deps", "-q", str(wheel)],
        check=True,
        timeout=time_left(),
        capture_output=True,
    )
    (site,) = venv.glob("lib/python*/site-packages")
    static = site / "gateway" / "console" / "static"
    for name in ("index.html", "console.js", "robot.js", "console.css", "vendor/uPlot.iife.min.js"):
        assert (static / name).is_file(), name
    # Served by the installed package's app (its dependencies from this environment).
    script = (
        "import sys, threading, time, urllib.request\n"
        f"sys.path.insert(0, {str(site)!r})\n"
        "import uvicorn\n"
        "from gateway.console import app as a\n"
        f"assert a.STATIC.is_relative_to({str(site)!r}), a.STATIC\n"
        "from gateway.console.config import ConsoleConfig\n"
        "from gateway.services import free_port\n"
        "port = free_port()\n"
        "from gateway.console.link import GatewayLink\n"
        "link = GatewayLink({'gateway': {'control': 'tcp://127.0.0.1:9', 'clients': ''}}, interval_s=1.0)\n"
        "app = a.create_app(a.ConsoleApp(config=ConsoleConfig(), credentials=[], origins=set(), link=link,"
        " clients_address=''))\n"
        "server = uvicorn.Server(uvicorn.Config(app, host='127.0.0.1', port=port, log_level='warning'))\n"
        "threading.Thread(target=server.run, daemon=True).start()\n"
        "while not server.started: time.sleep(0.05)\n"
        "for path in ('/', '/static/robot.js', '/static/vendor/uPlot.iife.min.js'):\n"
        "    with urllib.request.urlopen(f'http://127.0.0.1:{port}{path}', timeout=10) as r:\n"
        "        assert r.status == 200 and len(r.read()) > 100, path\n"
        "server.should_exit = True\n"
        "print('served')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=time_left()
    )
    assert done.returncode == 0 and "served" in done.stdout, done.stderr
