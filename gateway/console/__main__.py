"""``python -m gateway.console`` / ``loopgate console``: the web console of a run.

    loopgate console --run-dir runs/reach_sim-20260101-120000      # http://127.0.0.1:8080
    LOOPGATE_CONSOLE_TOKEN=s3cret loopgate console --run-dir RUN --host 0.0.0.0 --port 8080
    loopgate console --hash-token          # reads a token, prints the hash for the config

Reads the run's ``config.yaml`` (its ``console:`` block) and ``endpoints.json`` (the
gateway's addresses). With no token configured it makes one for this start, writes it to
``RUN/console-token`` (readable by you only) and logs where it is; binding anything but
loopback without a configured token is refused.
"""

from __future__ import annotations

import argparse
import dataclasses
import getpass
import json
import logging
import os
import secrets
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gateway import lifeline
from gateway.config import ConfigError, ExperimentConfig, load_config
from gateway.console.auth import Credential, hash_token, own_origins
from gateway.console.config import ConsoleConfig

log = logging.getLogger("gateway.console")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loopgate console",
        description="Serve the web console of a running experiment.",
        epilog="example: loopgate console runs/reach_sim-20260101-120000   (or --run-dir RUN)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # The run folder as the other commands take it (report, scale, export), or --run-dir.
    p.add_argument("run", nargs="?", help="the run folder (config.yaml, endpoints.json)")
    p.add_argument("--run-dir", help="the same, as an option")
    p.add_argument("--config", help="experiment config (default: RUN/config.yaml)")
    p.add_argument("--host", help="interface to bind (default: console.host)")
    p.add_argument("--port", type=int, help="TCP port (default: console.port)")
    p.add_argument("--hash-token", action="store_true", help="read a token on stdin, print its hash")
    p.add_argument("--log-level", default="INFO")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.hash_token:
        token = getpass.getpass("token: ") if sys.stdin.isatty() else sys.stdin.readline().strip()
        print(hash_token(token))
        return 0
    if args.run and args.run_dir and Path(args.run) != Path(args.run_dir):
        print(
            f"loopgate console: two run folders given ({args.run}, --run-dir {args.run_dir})", file=sys.stderr
        )
        return 2
    if not (args.run or args.run_dir):
        print("loopgate console: give the run folder (loopgate console RUN)", file=sys.stderr)
        return 2
    run_dir = Path(args.run or args.run_dir)
    try:
        cfg = load_config(args.config or run_dir / "config.yaml")
        console_cfg: ConsoleConfig = cfg.console
        overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
        console_cfg = dataclasses.replace(console_cfg, **overrides)
        console_cfg.check_exposure()
        endpoints = json.loads((run_dir / "endpoints.json").read_text())
    except (ConfigError, OSError, ValueError) as exc:
        log.error("cannot start the console: %s", exc)
        return 2
    lifeline.arm()
    credentials = console_cfg.credentials()
    if not credentials:
        credentials = [Credential("operator", hash_token(_token_file(run_dir)))]
    return serve(
        console_cfg,
        credentials,
        endpoints,
        backend=cfg.env.backend,
        metrics_path=run_dir / "metrics.jsonl",
        log_level=args.log_level,
        policy_source=_policy_source(cfg, run_dir, endpoints),
        realtime_priority=cfg.run.realtime_priority,
    )


def _policy_source(cfg: ExperimentConfig, run_dir: Path, endpoints: dict[str, Any]) -> Callable[[], Any]:
    """Makes the experiment's action source as the gateway makes it (its spec from the run)."""

    def make() -> Any:
        from gateway.episode import EnvSpec
        from gateway.factory import experiment_spec
        from gateway.hub.assembly import make_source

        path = run_dir / "spec.json"
        if path.exists():
            spec = EnvSpec.from_dict(json.loads(path.read_text()))
        else:
            spec = experiment_spec(cfg.env.backend, dict(cfg.env.options))
        return make_source(cfg, spec, endpoints)

    return make


def _token_file(run_dir: Path) -> str:
    """A one-start operator token in ``RUN/console-token`` (mode 0600) for a loopback console."""
    token = secrets.token_urlsafe(24)
    path = run_dir / "console-token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    log.warning("no console token configured: log in with the token in %s", path)
    return token


def _listen(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (the server listens on it)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server would bind it
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def _replay_control(endpoints: dict[str, object]) -> str | None:
    """The replay service's control address (takes are stored as demos there), if one runs."""
    replay = endpoints.get("replay")
    address = replay.get("control") if isinstance(replay, dict) else None
    return address if isinstance(address, str) else None


def serve(
    cfg: ConsoleConfig,
    credentials: list[Credential],
    endpoints: dict[str, object],
    *,
    backend: str,
    metrics_path: Path,
    log_level: str = "INFO",
    policy_source: Callable[[], Any] | None = None,
    realtime_priority: int = 0,
) -> int:
    import uvicorn

    from gateway.console.app import ConsoleApp, create_app
    from gateway.console.camera import FrameSource
    from gateway.console.link import GatewayLink
    from gateway.console.metrics import MetricsTail
    from gateway.console.recording import Recorder
    from gateway.services import free_port

    port = cfg.port or free_port(cfg.host if cfg.host != "0.0.0.0" else "127.0.0.1")
    try:  # bound here and handed to the server: a port in use is said before anything starts
        listener = _listen(cfg.host, port)
    except OSError as exc:
        log.error(
            "cannot serve the console at http://%s:%d: %s (another program listens there?); "
            "set console.port to a free port, or 0 for any",
            cfg.host,
            port,
            exc.strerror or exc,
        )
        return 2  # a refusal (as for a bad config): loopgate up does not start it again
    gateway = endpoints["gateway"]
    assert isinstance(gateway, dict)
    link = GatewayLink(endpoints, interval_s=cfg.status_interval_s, backend=backend)
    taps = endpoints.get("taps") or []  # the workers' observation taps (camera frames)
    assert isinstance(taps, list)
    console = ConsoleApp(
        config=cfg,
        credentials=credentials,
        origins=own_origins(cfg.host, port),
        link=link,
        clients_address=gateway["clients"],
        metrics=MetricsTail(metrics_path),
        frames=FrameSource([str(a) for a in taps]),
        recorder=Recorder(_replay_control(endpoints), mark_reward=cfg.mark_success_reward),
        policy_source=policy_source,
        realtime_priority=realtime_priority,
    )
    link.start()
    assert console.frames is not None
    console.frames.start()
    try:
        log.info("console at http://%s:%d", cfg.host, port)
        server = uvicorn.Server(
            uvicorn.Config(
                create_app(console),
                host=cfg.host,
                port=port,
                log_level=log_level.lower(),
                access_log=False,
                ws_ping_interval=5.0,
                ws_ping_timeout=5.0,
                # JPEG frames do not compress: deflating them only cost both ends CPU.
                ws_per_message_deflate=False,
            )
        )
        server.run(sockets=[listener])
    finally:
        listener.close()
        if console.teleop is not None:
            console.teleop.release()
        console.frames.close()
        link.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
