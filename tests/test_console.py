"""The web console against a real ``loopgate up`` (MuJoCo reach, 1 worker x 2 envs,
random policy): login, roles, the Origin check, the e-stop and keyboard teleoperation.

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

import pytest

from gateway.console.auth import hash_token
from tests.conftest import Procs, log_of, time_left, wait_for, write_config

OPERATOR, VIEWER = "operator-token-for-tests", "viewer-token-for-tests"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--headless",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@dataclass
class Run:
    url: str
    run_dir: Path
    control: Any

    def status(self) -> dict[str, Any]:
        return self.control.request("status", timeout_s=5.0)

    def worker(self) -> dict[str, Any]:
        return self.status()["workers"][0]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    from gateway.control_client import ControlClient

    tmp = tmp_path_factory.mktemp("console")
    config = write_config(
        tmp / "console.yaml",
        env={"backend": "mujoco_reach", "workers": 1, "num_envs": 2, "options": {"max_episode_steps": 5000}},
        policy={"kind": "random"},
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
    control = None
    try:
        endpoints = run_dir / "endpoints.json"
        wait_for(
            lambda: endpoints.exists() and "console" in json.loads(endpoints.read_text()),
            60,
            what="endpoints",
        )
        data = json.loads(endpoints.read_text())
        url = data["console"]
        control = ControlClient(data["gateway"]["control"])

        def serving() -> bool:
            assert up.poll() is None, log_of(up)
            try:
                with urllib.request.urlopen(url + "/api/health", timeout=1.0) as r:
                    return r.status == 200 and bool(control.request("status", timeout_s=1.0)["workers"])
            except (OSError, Exception):
                return False

        wait_for(serving, 60, interval=0.2, what="console and worker up")
        yield Run(url=url, run_dir=run_dir, control=control)
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                up.wait(timeout=30)
        if control is not None:
            control.close()
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
    assert post(run, "/api/resume", cookie=session_cookie(run, VIEWER), origin=run.url)[0] == 403
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
    page.locator("#workers tbody tr").filter(has_text="console operator").wait_for(timeout=time_left() * 1000)
    # Bumpless: until a key is held the console sends the hold action (zero joint deltas).
    wait_for(lambda: len(joints(page)) == 3, time_left(), what="joint positions")
    assert page.locator("#t-action").inner_text() == "0.000, 0.000, 0.000"
    start = joints(page)[0]
    # Move away from the nearer joint limit (the random policy may have left it near one).
    key, sign = ("q", 1.0) if start < 0 else ("a", -1.0)

    page.keyboard.down(key)
    wait_for(lambda: sign * (joints(page)[0] - start) > 0.1, time_left(), what="joint 1 to move as commanded")
    assert page.locator("#t-action").inner_text().startswith("0.500" if sign > 0 else "-0.500")
    page.screenshot(path=str(tmp_path / "teleop.png"))

    page.evaluate("window.dispatchEvent(new Event('blur'))")
    page.get_by_text("holding: window blurred").wait_for(timeout=time_left() * 1000)
    wait_for(
        lambda: page.locator("#t-action").inner_text() == "0.000, 0.000, 0.000", time_left(), what="hold"
    )
    readings: list[float] = []

    def still() -> bool:
        readings.append(joints(page)[0])
        return len(readings) >= 4 and max(readings[-4:]) - min(readings[-4:]) < 2e-3

    wait_for(still, time_left(), interval=0.15, what="the joint to hold still")
    page.keyboard.up(key)
    page.screenshot(path=str(tmp_path / "holding.png"))

    page.get_by_role("button", name="Release").click()
    wait_for(lambda: not run.worker()["client"], time_left(), what="the policy to get the worker back")


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
