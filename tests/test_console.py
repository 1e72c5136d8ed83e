"""The web console against a real ``loopgate up`` (MuJoCo reach, 1 worker x 2 envs
rendering 96x96 cameras, random policy, the replay service with online, interventions
and demos tables): login, roles, the Origin check, the e-stop, the robot view's camera
frames, keyboard and gamepad teleoperation (flagged as interventions), and recording a
labelled demonstration into the demos table and an export.

Browser tests drive Debian's Chromium headless through Playwright; each saves a
screenshot of the views it shows under its ``tmp_path``. One run serves the module.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from benchmarks.console import CHROMIUM_ARGS
from gateway.console.auth import hash_token
from tests.conftest import Procs, log_of, time_left, wait_for, write_config

OPERATOR, VIEWER = "operator-token-for-tests", "viewer-token-for-tests"
CHROMIUM = Path("/usr/bin/chromium")


@dataclass
class Run:
    url: str
    run_dir: Path
    control: Any
    replay: Any

    def status(self) -> dict[str, Any]:
        return self.control.request("status", timeout_s=5.0)

    def table_size(self, name: str) -> int:
        return int(self.replay.request("status", timeout_s=5.0)["tables"][name]["size"])

    def worker(self) -> dict[str, Any]:
        return self.status()["workers"][0]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    from gateway.control_client import ControlClient

    tmp = tmp_path_factory.mktemp("console")
    config = write_config(
        tmp / "console.yaml",
        env={
            "backend": "mujoco_reach",
            "workers": 1,
            "num_envs": 2,
            # Cameras at 96x96 (the benchmark measures 224x224): every frame is stored, and
            # the run steps as fast as it can for a minute.
            "options": {"max_episode_steps": 5000, "camera": True, "image_height": 96, "image_width": 96},
        },
        policy={"kind": "random"},
        gateway={"chunk_steps": 16},
        replay={
            "enabled": True,
            "fsync": "never",
            "tables": [
                {"name": "online", "source": "online"},
                {"name": "interventions", "source": "interventions"},
                {"name": "demos", "source": "demos"},
            ],
        },
        console={
            "enabled": True,
            "port": 0,
            "operator_token_hash": hash_token(OPERATOR),
            "viewer_token_hash": hash_token(VIEWER),
        },
    )
    procs = Procs(tmp)
    run_dir = tmp / "run"
    up = procs.spawn("-m", "gateway", "up", str(config), "--run-dir", str(run_dir), name="up")
    control = replay = None
    try:
        endpoints = run_dir / "endpoints.json"

        def planned() -> bool:
            try:
                return "console" in json.loads(endpoints.read_text())
            except (OSError, ValueError):  # not written yet, or caught mid-write
                return False

        wait_for(planned, 60, what="endpoints")
        data = json.loads(endpoints.read_text())
        url = data["console"]
        control = ControlClient(data["gateway"]["control"])
        replay = ControlClient(data["replay"]["control"])

        def serving() -> bool:
            assert up.poll() is None, log_of(up)
            try:
                with urllib.request.urlopen(url + "/api/health", timeout=1.0) as r:
                    return r.status == 200 and bool(control.request("status", timeout_s=1.0)["workers"])
            except (OSError, Exception):
                return False

        wait_for(serving, 60, interval=0.2, what="console and worker up")
        yield Run(url=url, run_dir=run_dir, control=control, replay=replay)
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                up.wait(timeout=30)
        for client in (control, replay):
            if client is not None:
                client.close()
        procs.kill_all()


@pytest.fixture(scope="module")
def chromium() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    assert CHROMIUM.exists(), "Debian's chromium is missing: make system-deps (as root) installs it"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def console_page(chromium: Any, run: Run) -> Iterator[Any]:
    context = chromium.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    outside: list[str] = []
    page.on("request", lambda r: None if r.url.startswith(run.url) else outside.append(r.url))
    try:
        yield page
        assert not outside, f"the page made requests outside the console: {outside}"
    finally:
        context.close()


def login(page: Any, run: Run, token: str) -> None:
    page.goto(run.url + "/")
    page.get_by_label("Token").fill(token)
    page.get_by_role("button", name="Log in").click()


def post(run: Run, path: str, *, cookie: str = "", origin: str | None = None) -> tuple[int, dict[str, Any]]:
    headers = {"Content-Type": "application/json", "Cookie": cookie}
    if origin is not None:
        headers["Origin"] = origin
    req = urllib.request.Request(run.url + path, data=b"{}", headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=5.0) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def session_cookie(run: Run, token: str) -> str:
    req = urllib.request.Request(
        run.url + "/api/login",
        data=json.dumps({"token": token}).encode(),
        headers={"Content-Type": "application/json", "Origin": run.url},
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=10.0) as r:
        return str(r.headers["set-cookie"]).split(";")[0]


def steps_still(run: Run) -> int:
    """Env steps once they stopped changing (a step in flight at the stop may still land)."""
    readings: list[int] = []

    def settled() -> bool:
        readings.append(run.status()["env_steps"])
        return len(readings) >= 3 and readings[-1] == readings[-3]

    wait_for(settled, time_left(), interval=0.2, what="env steps to stop")
    return readings[-1]


@pytest.mark.browser
def test_wrong_token_is_refused_and_an_operator_sees_the_fleet(
    console_page: Any, run: Run, tmp_path: Path
) -> None:
    page = console_page
    login(page, run, "not-the-token")
    page.get_by_role("alert").filter(has_text="wrong token").wait_for(timeout=time_left() * 1000)
    assert page.locator("#main-view").is_hidden()
    page.screenshot(path=str(tmp_path / "login.png"))

    login(page, run, OPERATOR)
    page.get_by_text("logged in as operator").wait_for(timeout=time_left() * 1000)
    uid = run.worker()["uid"]
    row = page.locator("#workers tbody tr").filter(has_text=uid)
    row.filter(has_text="policy").wait_for(timeout=time_left() * 1000)
    first = int(page.locator("#f-env-steps").inner_text())
    wait_for(
        lambda: int(page.locator("#f-env-steps").inner_text()) > first, time_left(), what="env steps grow"
    )
    assert page.get_by_role("button", name="E-stop").is_visible()
    assert "hardware e-stop" in page.locator("#stop-bar .note").inner_text()
    # The training view plots the run's own metrics with the vendored uPlot.
    page.locator('#charts figure[data-series="steps_per_s"] canvas').wait_for(timeout=time_left() * 1000)
    for chart in ("hop_p50", "hop_p99", "replay_fill", "samples_per_insert", "intervention_rate"):
        page.locator(f'#charts figure[data-series="{chart}"] canvas').wait_for(timeout=time_left() * 1000)
    page.locator("#training-view").screenshot(path=str(tmp_path / "training.png"))
    cookie = next(c for c in page.context.cookies() if c["name"] == "loopgate_console")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    page.screenshot(path=str(tmp_path / "fleet.png"))


@pytest.mark.integration
def test_foreign_origin_and_missing_session_are_refused(run: Run) -> None:
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    cookie = session_cookie(run, OPERATOR)
    ws_url = run.url.replace("http://", "ws://") + "/ws/fleet"

    def handshake(headers: dict[str, str]) -> int:
        try:
            with connect(ws_url, additional_headers=headers, open_timeout=5) as ws:
                json.loads(ws.recv(timeout=5))
                return 101
        except InvalidStatus as exc:
            return exc.response.status_code

    assert handshake({"Cookie": cookie, "Origin": run.url}) == 101
    assert handshake({"Cookie": cookie, "Origin": "http://evil.example"}) == 403
    assert handshake({"Cookie": cookie}) == 403
    assert handshake({"Origin": run.url}) == 403
    assert handshake({"Cookie": "loopgate_console=forged", "Origin": run.url}) == 403
    # A cross-site form cannot press the e-stop, nor anything else.
    assert post(run, "/api/estop", cookie=cookie, origin="http://evil.example")[0] == 403
    assert post(run, "/api/estop", origin=run.url)[0] == 401
    assert not run.status()["estopped"]


@pytest.mark.integration
def test_the_estop_websocket_engages_answers_bad_messages_and_refuses_strangers(run: Run) -> None:
    """``/ws/estop``, the page's e-stop: a viewer engages it with one message and hears when
    the gateway engaged it; a malformed message is answered and the socket stays usable;
    a foreign Origin or no session is refused at the handshake. The POST stays the way
    for a page whose socket is down."""
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    viewer = session_cookie(run, VIEWER)
    ws_url = run.url.replace("http://", "ws://") + "/ws/estop"
    for headers in ({"Cookie": viewer, "Origin": "http://evil.example"}, {"Origin": run.url}):
        with pytest.raises(InvalidStatus) as refused:
            connect(ws_url, additional_headers=headers, open_timeout=5)
        assert refused.value.response.status_code == 403
    try:
        with connect(ws_url, additional_headers={"Cookie": viewer, "Origin": run.url}, open_timeout=5) as ws:
            for bad in ("not json", json.dumps({"type": "resume", "id": 1}), json.dumps([1, 2])):
                ws.send(bad)
                answer = json.loads(ws.recv(timeout=5))
                assert answer["type"] == "error" and "estop" in answer["message"], answer
            assert not run.status()["estopped"]
            sent_ms = time.time() * 1e3
            ws.send(json.dumps({"type": "estop", "id": 7}))
            answer = json.loads(ws.recv(timeout=10))
            assert answer["type"] == "estop" and answer["id"] == 7 and answer["estopped"] is True, answer
            assert sent_ms <= answer["t_received_ms"] <= answer["t_engaged_ms"] <= answer["t_answered_ms"]
            assert run.status()["estopped"]
        run.control.request("estop", timeout_s=5.0, engaged=False, reason="test")
        status, body = post(run, "/api/estop", cookie=viewer, origin=run.url)
        assert status == 200 and body["estopped"] is True and body["t_engaged_ms"] >= body["t_received_ms"]
        assert run.status()["estopped"]
    finally:
        run.control.request("estop", timeout_s=5.0, engaged=False, reason="test cleanup")


@pytest.mark.browser
def test_viewer_cannot_take_over_or_resume(console_page: Any, run: Run, tmp_path: Path) -> None:
    page = console_page
    login(page, run, VIEWER)
    page.get_by_text("logged in as viewer").wait_for(timeout=time_left() * 1000)
    page.locator("#teleop-worker option").first.wait_for(state="attached", timeout=time_left() * 1000)
    page.get_by_role("button", name="Take over").click()
    page.get_by_role("alert").filter(has_text="viewers cannot take over").wait_for(timeout=time_left() * 1000)
    assert not run.worker()["client"]
    assert page.get_by_role("button", name="Resume").is_disabled()
    viewer = session_cookie(run, VIEWER)
    assert post(run, "/api/resume", cookie=viewer, origin=run.url)[0] == 403
    for path in ("/api/record", "/api/label"):  # nor record or label demonstrations
        status, body = post(run, path, cookie=viewer, origin=run.url)
        assert status == 403 and "only an operator" in body["error"]
    assert page.get_by_role("button", name="Start recording").is_disabled()
    page.screenshot(path=str(tmp_path / "viewer.png"))


@pytest.mark.browser
def test_estop_stops_every_env_and_resume_alone_does_not_take_over(
    console_page: Any, run: Run, tmp_path: Path
) -> None:
    page = console_page
    login(page, run, OPERATOR)
    page.get_by_text("logged in as operator").wait_for(timeout=time_left() * 1000)
    try:
        page.get_by_role("button", name="E-stop").click()
        wait_for(lambda: run.status()["estopped"], time_left(), what="gateway estopped")
        page.get_by_text("E-stop engaged").wait_for(timeout=time_left() * 1000)
        stopped = steps_still(run)
        for _ in range(5):  # still stopped, poll after poll
            time.sleep(0.1)
            assert run.status()["env_steps"] == stopped
        page.screenshot(path=str(tmp_path / "estopped.png"))

        page.get_by_role("button", name="Resume").click()
        wait_for(lambda: not run.status()["estopped"], time_left(), what="e-stop lifted")
        wait_for(lambda: run.status()["env_steps"] > stopped, time_left(), what="the policy moves again")
        assert not run.worker()["client"], "Resume must not take over"
        assert page.locator("#t-control").inner_text() == "policy"
    finally:
        run.control.request("estop", timeout_s=5.0, engaged=False, reason="test cleanup")


def joints(page: Any) -> list[float]:
    text = page.locator("#t-joints").inner_text()
    return [float(v) for v in text.split(",")] if "," in text else []


def wait_until_still(page: Any) -> float:
    """Joint 1's position once four readings 0.15 s apart agree within 2 mrad. Under the
    hold action the arm still settles onto its last position target (the tracking error
    the policy left), so a check that nothing moves it starts from here."""
    readings: list[float] = []

    def still() -> bool:
        readings.append(joints(page)[0])
        return len(readings) >= 4 and max(readings[-4:]) - min(readings[-4:]) < 2e-3

    wait_for(still, time_left(), interval=0.15, what="the joint to hold still")
    return readings[-1]


@pytest.mark.browser
def test_keyboard_takeover_moves_the_joint_and_blur_holds(
    console_page: Any, run: Run, tmp_path: Path
) -> None:
    page = console_page
    login(page, run, OPERATOR)
    page.get_by_text("logged in as operator").wait_for(timeout=time_left() * 1000)
    page.locator("#teleop-worker option").first.wait_for(state="attached", timeout=time_left() * 1000)
    page.get_by_role("button", name="Take over").click()
    page.get_by_role("button", name="Release").and_(page.locator(":enabled")).wait_for(
        timeout=time_left() * 1000
    )
    wait_for(lambda: run.worker()["client"], time_left(), what="the gateway to hand the worker over")
    taken_at = time.time()
    page.locator("#workers tbody tr").filter(has_text="console operator").wait_for(timeout=time_left() * 1000)
    # Bumpless: until a key is held the console sends the hold action (zero joint deltas).
    wait_for(lambda: len(joints(page)) == 3, time_left(), what="joint positions")
    assert page.locator("#t-action").inner_text() == "0.000, 0.000, 0.000"
    start = joints(page)[0]
    # No jump at the takeover: while the hold action goes out the position targets stay
    # put, so the arm only settles onto the policy's last target (its tracking error,
    # under 0.09 rad in this sim), where any other action would move the target by up to
    # max_delta (0.15 rad) every step. The log below checks the hold actions themselves.
    time.sleep(0.3)
    assert abs(joints(page)[0] - start) < 0.1
    # Move away from the nearer joint limit (the random policy may have left it near one).
    key, sign = ("q", 1.0) if start < 0 else ("a", -1.0)

    key_down_at = time.time()
    page.keyboard.down(key)
    wait_for(lambda: sign * (joints(page)[0] - start) > 0.1, time_left(), what="joint 1 to move as commanded")
    assert page.locator("#t-action").inner_text().startswith("0.500" if sign > 0 else "-0.500")
    page.screenshot(path=str(tmp_path / "teleop.png"))

    page.evaluate("window.dispatchEvent(new Event('blur'))")
    page.get_by_text("holding: window blurred").wait_for(timeout=time_left() * 1000)
    wait_for(
        lambda: page.locator("#t-action").inner_text() == "0.000, 0.000, 0.000", time_left(), what="hold"
    )
    wait_until_still(page)
    page.keyboard.up(key)
    page.screenshot(path=str(tmp_path / "holding.png"))

    released_at = time.time()
    page.get_by_role("button", name="Release").click()
    wait_for(lambda: not run.worker()["client"], time_left(), what="the policy to get the worker back")
    # The takeover's steps are interventions: flagged, counted, and in the interventions table.
    assert run.status()["intervention_steps"] > 0
    wait_for(lambda: run.table_size("interventions") > 0, time_left(), what="intervention steps in replay")
    # Per env: the operator drove env 0 (flagged); the random policy kept driving env 1.
    from trainer.replay.log import run_chunks

    def during(
        env: int, key: str, start: float = taken_at + 0.5, end: float = released_at - 0.3
    ) -> np.ndarray:
        parts = []
        for chunk in run_chunks(run.run_dir):
            if int(chunk.meta["env"]) == env and chunk.meta.get("source", "online") == "online":
                t = chunk.arrays["t_action"]
                parts.append(chunk.arrays[key][(t > start) & (t < end)])
        return np.concatenate(parts) if parts else np.zeros(0)

    wait_for(lambda: len(during(1, "intervention")) > 10, time_left(), what="the takeover's steps in the log")
    driven, other = during(0, "intervention"), during(1, "intervention")
    assert driven.size and driven.all() and not other.any()
    # Bumpless, step by step: every operator step before the key went down was the hold.
    held = during(0, "action", taken_at, key_down_at)[during(0, "intervention", taken_at, key_down_at)]
    assert held.size and not held.any()
    assert np.abs(during(1, "action")).max() > 0.1  # the policy's random actions, not the hold


@pytest.mark.integration
def test_deadman_holds_without_commands_and_a_dropped_socket_releases(run: Run) -> None:
    from websockets.sync.client import connect

    cookie = session_cookie(run, OPERATOR)
    ws_url = run.url.replace("http://", "ws://") + "/ws/teleop"
    uid = run.worker()["uid"]

    with connect(ws_url, additional_headers={"Cookie": cookie, "Origin": run.url}, open_timeout=5) as ws:

        def until(pred: Any) -> dict[str, Any]:
            while True:
                msg = json.loads(ws.recv(timeout=10))
                if pred(msg):
                    return msg

        ws.send(json.dumps({"type": "take_over", "worker": uid}))
        until(lambda m: m["type"] == "taken")
        command = {"type": "command", "seq": 1, "t": time.time() * 1000, "env": 1, "axes": [0, 1, 0]}
        ws.send(json.dumps(command))
        ws.send(json.dumps({**command, "seq": 2, "axes": [2, 0, 0]}))
        bad = until(lambda m: m["type"] == "error")
        live = until(lambda m: m["type"] == "teleop" and m.get("holding") is None)
        held = until(lambda m: m["type"] == "teleop" and m.get("holding"))
    assert "[-1, 1]" in bad["message"]
    assert live["env"] == 1 and live["action"] == [0.0, 0.5, 0.0]
    assert held["holding"] == "no command for 0.5 s"
    # The socket is gone: the console lets go and the policy drives the worker again.
    wait_for(lambda: not run.worker()["client"], time_left(), what="release after the socket dropped")


@pytest.mark.browser
def test_robot_view_shows_live_camera_frames_and_the_envs_state(
    console_page: Any, run: Run, tmp_path: Path
) -> None:
    page = console_page
    login(page, run, VIEWER)
    page.get_by_text("logged in as viewer").wait_for(timeout=time_left() * 1000)
    page.get_by_text("frames/s").wait_for(timeout=time_left() * 1000)
    first = page.evaluate("window.consoleCamera.last")
    assert first["image"] and first["worker"] == run.worker()["uid"] and len(first["joint_pos"]) == 3
    wait_for(
        lambda: page.evaluate("window.consoleCamera.latencies.length") > 20, time_left(), what="camera frames"
    )
    last = page.evaluate("window.consoleCamera.last")
    assert last["t_render_ms"] > first["t_render_ms"] and last["step"] > first["step"]
    # The frame drawn is the env's camera image (not a blank canvas).
    spread = page.evaluate(
        "(() => { const c = document.getElementById('camera');"
        " const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;"
        " let lo = 255, hi = 0; for (let i = 0; i < d.length; i += 4) { lo = Math.min(lo, d[i]); hi = Math.max(hi, d[i]); }"
        " return hi - lo; })()"
    )
    assert spread > 50
    for plot in ("joint_pos", "action"):
        page.locator(f'#robot-plots figure[data-series="{plot}"] canvas').wait_for(timeout=time_left() * 1000)
    assert page.locator("#r-reward").inner_text() != "-"
    page.locator("#robot-view").screenshot(path=str(tmp_path / "robot.png"))


GAMEPAD_STUB = """
window.__pad = { id: "stub pad", index: 0, connected: true, mapping: "standard",
  axes: [0, 0, 0, 0], buttons: Array.from({ length: 16 }, () => ({ pressed: false, value: 0 })) };
navigator.getGamepads = () => [window.__pad];
"""
"""WebDriver has no gamepad: the page's ``navigator.getGamepads`` is replaced by one
that returns a pad the test sets (the page's own polling code reads it)."""


@pytest.mark.browser
def test_gamepad_drives_the_joint_while_its_button_is_held(
    console_page: Any, run: Run, tmp_path: Path
) -> None:
    page = console_page
    page.context.add_init_script(GAMEPAD_STUB)
    login(page, run, OPERATOR)
    page.get_by_text("logged in as operator").wait_for(timeout=time_left() * 1000)
    page.locator("#teleop-worker option").first.wait_for(state="attached", timeout=time_left() * 1000)
    page.get_by_role("button", name="Take over").click()
    wait_for(lambda: len(joints(page)) == 3, time_left(), what="joint positions")
    start = wait_until_still(page)
    sign = 1.0 if start < 0 else -1.0
    # The stick alone does nothing: button 0 is the deadman. The page keeps sending the
    # hold action, and the settled arm stays where it is.
    page.evaluate(f"window.__pad.axes[0] = {sign}")
    time.sleep(0.4)
    assert page.locator("#t-action").inner_text() == "0.000, 0.000, 0.000"
    assert abs(joints(page)[0] - start) < 0.02
    page.evaluate("window.__pad.buttons[0] = { pressed: true, value: 1 }")
    wait_for(lambda: sign * (joints(page)[0] - start) > 0.1, time_left(), what="joint 1 to follow the stick")
    page.screenshot(path=str(tmp_path / "gamepad.png"))
    page.evaluate("window.__pad.buttons[0] = { pressed: false, value: 0 }")
    page.get_by_text("holding: gamepad button released").wait_for(timeout=time_left() * 1000)
    page.get_by_role("button", name="Release").click()
    wait_for(lambda: not run.worker()["client"], time_left(), what="the policy to get the worker back")


@pytest.mark.browser
def test_record_and_label_a_demonstration_into_the_demos_table_and_an_export(
    console_page: Any, run: Run, tmp_path: Path
) -> None:
    from gateway.trajectory import assemble_episodes
    from tests.test_export import read_mcap
    from trainer.replay.export_mcap import write_mcap
    from trainer.replay.log import run_chunks

    page = console_page
    login(page, run, OPERATOR)
    page.get_by_text("logged in as operator").wait_for(timeout=time_left() * 1000)
    page.locator("#teleop-worker option").first.wait_for(state="attached", timeout=time_left() * 1000)
    before = run.table_size("demos")
    # A take thrown away: Re-record discards it and starts the next one.
    page.get_by_role("button", name="Start recording").click()
    page.get_by_text("recording take").wait_for(timeout=time_left() * 1000)
    discarded = page.locator("#rec-state").inner_text().split()[2]
    time.sleep(0.5)
    page.get_by_role("button", name="Re-record").click()
    wait_for(lambda: discarded not in page.locator("#rec-state").inner_text(), time_left(), what="a new take")
    take = page.locator("#rec-state").inner_text().split()[2]
    time.sleep(1.0)
    page.get_by_label("Note").fill("reached the target")
    page.get_by_role("button", name="Mark success").click()
    page.get_by_text("(success)").wait_for(timeout=time_left() * 1000)
    time.sleep(0.5)
    page.get_by_role("button", name="Stop recording").click()
    page.get_by_text(f"last take {take}").wait_for(timeout=time_left() * 1000)
    page.locator("#demo-view").screenshot(path=str(tmp_path / "demos.png"))
    assert run.table_size("demos") > before

    chunks = [c for c in run_chunks(run.run_dir) if c.meta.get("take") in (take, discarded)]
    demos = assemble_episodes(chunks)
    assert [e.meta["take"] for e in demos] == [take]
    (demo,) = demos
    assert demo.meta["label"] == "success" and demo.meta["note"] == "reached the target"
    # The live success mark: the step "Mark success" was pressed at is a success.
    (marked,) = demo.meta["success_steps"]
    assert demo.num_steps > 5 and demo.arrays["success"][demo.arrays["step"] == marked].all()
    messages, _ = read_mcap(write_mcap(demos, tmp_path / "demos.mcap")["path"])
    (info,) = [json.loads(m[4].data) for m in messages if m[0].endswith("/episode")]
    assert (info["label"], info["note"], info["source"]) == ("success", "reached the target", "demos")


@pytest.mark.integration
def test_bad_recording_requests_get_an_error_the_page_can_show(run: Run) -> None:
    cookie = session_cookie(run, OPERATOR)
    uid = run.worker()["uid"]

    def send(path: str, body: bytes) -> tuple[int, dict[str, Any]]:
        headers = {"Content-Type": "application/json", "Cookie": cookie, "Origin": run.url}
        req = urllib.request.Request(run.url + path, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=10.0) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    cases = [
        ("/api/record", b"not json", "needs a JSON body"),
        ("/api/record", b"[1, 2]", "must be a JSON object"),
        ("/api/record", json.dumps({"action": "dance", "worker": uid}).encode(), "action must be"),
        ("/api/record", json.dumps({"action": "start", "worker": "nobody"}).encode(), "'nobody'"),
        ("/api/record", json.dumps({"action": "start", "worker": uid, "env": 99}).encode(), "envs 0..1"),
        ("/api/record", json.dumps({"action": "start", "worker": uid, "env": -1}).encode(), "non-negative"),
        ("/api/record", json.dumps({"action": "stop", "worker": uid}).encode(), "not recording"),
        ("/api/label", json.dumps({"label": "success", "worker": uid}).encode(), "start recording first"),
    ]
    for path, body, fragment in cases:
        status, reply = send(path, body)
        assert status == 409 and fragment in reply["error"], (body, reply)
    assert send("/api/record", json.dumps({"action": "start", "worker": uid}).encode())[0] == 200
    try:
        status, reply = send("/api/label", json.dumps({"label": "great", "worker": uid}).encode())
        assert status == 409 and "success or failure" in reply["error"]
    finally:
        status, reply = send("/api/record", json.dumps({"action": "rerecord", "worker": uid}).encode())
        assert status == 200 and reply["discarded"]
        assert send("/api/record", json.dumps({"action": "stop"}).encode())[0] in (200, 409)
