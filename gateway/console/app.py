"""The console's web app: login, the fleet view, the e-stop and teleoperation.

:func:`create_app` builds a FastAPI app around a :class:`~gateway.console.link.GatewayLink`
(status, e-stop) and the gateway's client address (teleoperation)::

    app = create_app(ConsoleApp(config=cfg.console, credentials=creds, origins=origins,
                                link=link, clients_address=addr, run_dir=run_dir))
    uvicorn.run(app, host="127.0.0.1", port=8080)

HTTP: ``POST /api/login {token}`` (sets an HttpOnly, SameSite=Strict session cookie),
``POST /api/logout``, ``GET /api/me``, ``GET /api/fleet``, ``GET /api/metrics`` (the
training view's curves), ``POST /api/estop`` (any
logged-in user), ``POST /api/resume`` (operators). WebSockets: ``/ws/fleet`` (the fleet
view, pushed), ``/ws/teleop`` (take over, commands, hold, release; pushed teleop
state) and ``/ws/camera`` (the robot view's frames, :mod:`gateway.console.camera`). Every WebSocket handshake and every POST checks the session and the Origin.
Bad requests are answered ``{"error": ...}`` with a 4xx status; the page shows it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fastapi import BackgroundTasks, FastAPI, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool

from gateway.console import camera
from gateway.console.auth import Credential, Role, Sessions, authenticate, origin_allowed
from gateway.console.config import ConsoleConfig
from gateway.console.link import GatewayLink
from gateway.console.metrics import MetricsTail
from gateway.console.recording import Recorder, RecordingError
from gateway.console.teleop import CommandError, TeleopLoop, TeleopSettings, parse_command
from gateway.priority import go_realtime
from gateway.protocol import RemoteError, Timeout
from gateway.tap import TapFrame

log = logging.getLogger(__name__)

COOKIE = "loopgate_console"
STATIC = Path(__file__).parent / "static"
PUSH_S = 0.1
"""How often the teleop state goes to the page."""


@dataclass
class ConsoleApp:
    """Everything the app needs, built by :mod:`gateway.console.__main__`."""

    config: ConsoleConfig
    credentials: list[Credential]
    origins: set[str]
    link: GatewayLink
    clients_address: str
    metrics: MetricsTail | None = None
    frames: camera.FrameSource | None = None
    """The workers' taps (camera frames, env state); None: no live feed."""
    policy_source: Callable[[], Any] | None = None
    """Makes the experiment's action source, which drives the envs of a taken-over worker
    that the operator does not (None, or ``console.others: hold``: they hold)."""
    recorder: Recorder = field(default_factory=lambda: Recorder(None))
    """Takes stored as demonstrations through the replay service."""
    teleop: TeleopLoop | None = None
    teleop_owner: object | None = None
    teleop_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    realtime_priority: int = 0
    """``run.realtime_priority``: the event loop's (and its ZeroMQ I/O threads') real-time
    priority, taken at start-up (:func:`gateway.priority.go_realtime`); 0: normal."""


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def create_app(console: ConsoleApp) -> FastAPI:
    cfg = console.config
    sessions = Sessions(cfg.session_ttl_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # This thread (the event loop serving POST /api/estop) and the I/O threads running
        # already; then the e-stop's socket, whose context's I/O thread, started from here,
        # inherits the priority.
        go_realtime(console.realtime_priority, "console event loop")
        console.link.estop_line()
        yield

    app = FastAPI(
        title="loopgate console", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan
    )
    app.state.console = console
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    def role_of(request: Request | WebSocket) -> Role | None:
        return sessions.role(request.cookies.get(COOKIE))

    def refuse_post(request: Request) -> JSONResponse | None:
        if not origin_allowed(request.headers.get("origin"), console.origins):
            return _error(403, "requests must come from the console's own page (Origin refused)")
        return None

    @app.get("/")
    def index() -> FileResponse:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-store"})

    @app.get("/favicon.ico")
    def favicon() -> Response:
        return Response(status_code=204)  # no icon: answered, so the browser logs no error

    @app.get("/api/health")
    def health() -> dict[str, Any]:
        return {"ok": True}

    @app.post("/api/login")
    async def login(request: Request) -> JSONResponse:
        if (refused := refuse_post(request)) is not None:
            return refused
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "login needs a JSON body {token}")
        token = body.get("token") if isinstance(body, dict) else None
        if not isinstance(token, str) or not token or len(token) > 512:
            return _error(400, "token must be a non-empty string")
        role = await run_in_threadpool(authenticate, token, console.credentials)
        if role is None:
            log.warning("login refused from %s", request.client.host if request.client else "?")
            return _error(401, "wrong token")
        response = JSONResponse({"role": role})
        response.set_cookie(
            COOKIE,
            sessions.create(role),
            max_age=int(cfg.session_ttl_s),
            httponly=True,
            samesite="strict",
            path="/",
        )
        return response

    @app.post("/api/logout")
    def logout(request: Request) -> JSONResponse:
        if (refused := refuse_post(request)) is not None:
            return refused
        sessions.end(request.cookies.get(COOKIE))
        response = JSONResponse({"role": None})
        response.delete_cookie(COOKIE, path="/")
        return response

    @app.get("/api/me")
    def me(request: Request) -> JSONResponse:
        role = role_of(request)
        return JSONResponse({"role": role}) if role else _error(401, "not logged in")

    @app.get("/api/fleet")
    def fleet(request: Request) -> JSONResponse:
        if role_of(request) is None:
            return _error(401, "not logged in")
        return JSONResponse(console.link.fleet())

    @app.get("/api/metrics")
    def metrics(request: Request) -> JSONResponse:
        if role_of(request) is None:
            return _error(401, "not logged in")
        if console.metrics is None:
            return JSONResponse({"series": {}, "histograms": {}})
        series = console.metrics.series()
        return JSONResponse({"series": series, "histograms": console.metrics.histograms()})

    # The e-stop path, served on the event loop with its own control connection: it never
    # waits for the other WebSockets, the status poller, a takeover or a thread of the pool
    # (the takeover's release runs there, after the answer). The page sends it on its own
    # WebSocket (/ws/estop, open from login on: no request to set up when it counts), or
    # as a plain POST when that socket is down.
    async def engage_estop(role: Role, received: float) -> dict[str, Any]:
        """Engage the gateway's e-stop; the answer, with the unix ms of each leg (when the
        console had the request, the gateway engaged it, the console answered)."""
        reply = await console.link.estop_async(True, f"console ({role})")
        answer: dict[str, Any] = {"estopped": True, "reply": reply, "t_received_ms": received * 1e3}
        if isinstance(reply.get("t_engaged"), float):
            answer["t_engaged_ms"] = reply["t_engaged"] * 1e3
        answer["t_answered_ms"] = time.time() * 1e3
        log.warning("e-stop engaged from the console (%s)", role)
        if console.teleop is not None:
            console.teleop.hold("e-stop")
        return answer

    @app.post("/api/estop")
    async def estop(request: Request, background: BackgroundTasks) -> JSONResponse:
        received = time.time()
        if (refused := refuse_post(request)) is not None:
            return refused
        role = role_of(request)
        if role is None:
            return _error(401, "not logged in")
        try:
            answer = await engage_estop(role, received)
        except (Timeout, RemoteError) as exc:
            return _error(502, f"the gateway did not take the e-stop: {exc}")
        if console.teleop is not None:
            background.add_task(_release, console)
        return JSONResponse(answer)

    @app.websocket("/ws/estop")
    async def estop_ws(ws: WebSocket) -> None:
        role = await admit(ws)
        if role is None:
            return
        try:
            while True:
                text = await ws.receive_text()
                received = time.time()
                try:
                    msg = json.loads(text)
                    ref = msg.get("id") if isinstance(msg, dict) else None
                except ValueError:
                    msg, ref = None, None
                if not isinstance(msg, dict) or msg.get("type") != "estop":
                    await ws.send_text(
                        json.dumps({"type": "error", "id": ref, "message": 'send {"type": "estop"}'})
                    )
                    continue
                try:
                    answer = await engage_estop(role, received)
                except (Timeout, RemoteError) as exc:
                    error = f"the gateway did not take the e-stop: {exc}"
                    await ws.send_text(json.dumps({"type": "error", "id": ref, "message": error}))
                    continue
                await ws.send_text(json.dumps({"type": "estop", "id": ref, **answer}))
                if console.teleop is not None:
                    await run_in_threadpool(_release, console)
        except (WebSocketDisconnect, RuntimeError):
            return

    @app.post("/api/resume")
    async def resume(request: Request) -> JSONResponse:
        if (refused := refuse_post(request)) is not None:
            return refused
        role = role_of(request)
        if role is None:
            return _error(401, "not logged in")
        if role != "operator":
            return _error(403, "only an operator can resume")
        try:
            reply = await console.link.estop_async(False, "console (operator)")
        except (Timeout, RemoteError) as exc:
            return _error(502, f"the gateway did not take the resume: {exc}")
        log.warning("e-stop lifted from the console")
        return JSONResponse({"estopped": False, "reply": reply})

    def operator_post(request: Request) -> JSONResponse | None:
        if (refused := refuse_post(request)) is not None:
            return refused
        role = role_of(request)
        if role is None:
            return _error(401, "not logged in")
        return None if role == "operator" else _error(403, "only an operator can record and label")

    def where(body: Any) -> tuple[str, int, TapFrame]:
        """The worker, env and that env's newest observation a recording request names."""
        take = console.recorder.take
        worker = take.worker if take else body.get("worker") if isinstance(body, dict) else None
        env = take.env if take else body.get("env", 0) if isinstance(body, dict) else 0
        if not isinstance(worker, str) or not worker:
            raise RecordingError(f"name the worker to record (see the fleet view), got {worker!r}")
        if not isinstance(env, int) or isinstance(env, bool) or env < 0:
            raise RecordingError(f"env must be a non-negative integer, got {env!r}")
        try:
            frame = (console.frames or camera.FrameSource([])).current(worker)
        except LookupError as exc:
            raise RecordingError(str(exc)) from None
        if env >= frame.num_envs:
            raise RecordingError(f"worker {worker} has envs 0..{frame.num_envs - 1}, not {env}")
        return worker, env, frame

    async def body_of(request: Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except ValueError:
            raise RecordingError("the request needs a JSON body") from None
        if not isinstance(body, dict):
            raise RecordingError("the request body must be a JSON object")
        return body

    @app.post("/api/record")
    async def record(request: Request) -> JSONResponse:
        """``{action: start|stop|rerecord, worker, env, note}``."""
        if (refused := operator_post(request)) is not None:
            return refused
        rec = console.recorder
        try:
            body = await body_of(request)
            action = body.get("action")
            if action not in ("start", "stop", "rerecord"):
                raise RecordingError(f"action must be start, stop or rerecord, got {action!r}")
            worker, env, frame = await run_in_threadpool(where, body)
            episode, step = int(frame.info.episode[env]), int(frame.info.step[env])
            if action == "stop":
                result = await run_in_threadpool(rec.stop, episode, step, body.get("note"))
                return JSONResponse({"stored": result, **rec.state()})
            if action == "rerecord":
                discarded = rec.discard()
                started = rec.start(worker, env, episode, step)
                return JSONResponse({"discarded": discarded, "started": started, **rec.state()})
            return JSONResponse({"started": rec.start(worker, env, episode, step), **rec.state()})
        except RecordingError as exc:
            return _error(409, str(exc))

    @app.post("/api/label")
    async def label(request: Request) -> JSONResponse:
        """``{label: success|failure, note}`` for the take being recorded."""
        if (refused := operator_post(request)) is not None:
            return refused
        rec = console.recorder
        try:
            body = await body_of(request)
            _, env, frame = await run_in_threadpool(where, body)
            episode, step = int(frame.info.episode[env]), int(frame.info.step[env])
            marked = rec.mark(body.get("label"), body.get("note"), episode, step)
            return JSONResponse({"marked": marked, **rec.state()})
        except RecordingError as exc:
            return _error(409, str(exc))

    @app.get("/api/record")
    def record_state(request: Request) -> JSONResponse:
        if role_of(request) is None:
            return _error(401, "not logged in")
        return JSONResponse(console.recorder.state())

    async def admit(ws: WebSocket) -> Role | None:
        """The handshake's checks; a refused one is closed before it is accepted (HTTP 403)."""
        role = role_of(ws)
        if not origin_allowed(ws.headers.get("origin"), console.origins) or role is None:
            log.warning("websocket %s refused (origin %r)", ws.url.path, ws.headers.get("origin"))
            await ws.close(code=1008)
            return None
        await ws.accept()
        return role

    camera.install(app, console.frames or camera.FrameSource([]), admit)

    @app.websocket("/ws/fleet")
    async def fleet_ws(ws: WebSocket) -> None:
        if await admit(ws) is None:
            return
        try:
            while True:
                await ws.send_text(json.dumps(console.link.fleet()))
                await asyncio.sleep(cfg.status_interval_s)
        except (WebSocketDisconnect, RuntimeError):
            return

    @app.websocket("/ws/teleop")
    async def teleop_ws(ws: WebSocket) -> None:
        role = await admit(ws)
        if role is None:
            return
        owner = object()
        pusher = asyncio.create_task(_push_teleop(ws, console, owner))
        try:
            while True:
                text = await ws.receive_text()
                reply = await _on_teleop_message(console, owner, role, text)
                if reply is not None:
                    await ws.send_text(json.dumps(reply))
        except (WebSocketDisconnect, RuntimeError):
            pass
        finally:
            pusher.cancel()
            if console.teleop_owner is owner:  # a dropped socket lets go at once
                await run_in_threadpool(_release, console)

    return app


def _release(console: ConsoleApp, *, ramp: bool = False) -> None:
    """Let go of the takeover; ``ramp`` (the operator's Release) hands the env back to the
    policy over ``console.release_ramp_s`` first, the loop still in place meanwhile so an
    e-stop's hold reaches it."""
    loop = console.teleop
    if loop is not None and ramp:
        loop.release(ramp=True)
    loop, console.teleop, console.teleop_owner = console.teleop, None, None
    console.link.controlled_by_console = None
    if loop is not None:
        loop.release()


async def _push_teleop(ws: WebSocket, console: ConsoleApp, owner: object) -> None:
    try:
        while True:
            loop = console.teleop
            if loop is not None and console.teleop_owner is owner:
                state = asdict(loop.snapshot())
                if not state["active"]:  # ended by itself (e-stop, run ended): let go of it
                    await run_in_threadpool(_release, console)
                state["mine"] = True
            else:
                state = {"active": False, "mine": False, "taken": loop is not None}
            await ws.send_text(json.dumps({"type": "teleop", **state}))
            await asyncio.sleep(PUSH_S)
    except (WebSocketDisconnect, RuntimeError):
        return


async def _on_teleop_message(
    console: ConsoleApp, owner: object, role: Role, text: str
) -> dict[str, Any] | None:
    try:
        msg = json.loads(text)
    except ValueError:
        return {"type": "error", "message": "messages must be JSON"}
    kind = msg.get("type") if isinstance(msg, dict) else None
    mine = console.teleop if console.teleop_owner is owner else None
    if kind == "command":
        if mine is None:
            return {"type": "error", "message": "take over first"}
        try:
            cmd = parse_command(msg, mine.action_size, mine.num_envs)
        except CommandError as exc:
            return {"type": "error", "message": str(exc)}
        mine.command(cmd, time.monotonic(), time.time() * 1000.0)
        return None
    if kind == "hold":
        if mine is not None:
            why = msg.get("why")
            mine.hold(why[:80] if isinstance(why, str) and why else "the page asked")
        return None
    if kind == "take_over":
        if role != "operator":
            return {"type": "error", "message": "viewers cannot take over; log in with an operator token"}
        worker = msg.get("worker")
        if not isinstance(worker, str) or not worker:
            return {
                "type": "error",
                "message": f"take_over needs a worker uid (see the fleet view), got {worker!r}",
            }
        async with console.teleop_lock:
            if console.teleop is not None:
                return {
                    "type": "error",
                    "message": "another console session is in control; it must release first",
                }
            settings = TeleopSettings(
                deadman_s=console.config.deadman_s,
                stale_command_s=console.config.stale_command_s,
                max_command_hz=console.config.max_command_hz,
                scale=console.config.teleop_scale,
                release_ramp_s=console.config.release_ramp_s,
            )
            try:
                frames = console.frames or camera.FrameSource([])
                make_others = console.policy_source if console.config.others == "policy" else None
                loop = await run_in_threadpool(
                    lambda: TeleopLoop(
                        console.clients_address,
                        worker=worker,
                        settings=settings,
                        current_obs=lambda: frames.current(worker).obs,
                        others=make_others() if make_others is not None else None,
                    )
                )
            except (Timeout, RemoteError) as exc:
                return {"type": "error", "message": f"the gateway refused the takeover: {exc}"}
            except (ValueError, LookupError) as exc:  # absolute action space without its command
                return {"type": "error", "message": f"cannot take over bumplessly: {exc}"}
            loop.start()
            console.teleop, console.teleop_owner = loop, owner
            console.link.controlled_by_console = loop.state.worker
        log.info("console took over %s", loop.state.worker)
        return {
            "type": "taken",
            "worker": loop.state.worker,
            "num_envs": loop.num_envs,
            "action_size": loop.action_size,
        }
    if kind == "release":
        if mine is not None:
            await run_in_threadpool(lambda: _release(console, ramp=True))
        return {"type": "released"}
    return {"type": "error", "message": f"unknown message type {kind!r}"}
