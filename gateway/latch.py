"""The run folder's e-stop latch, and ``loopgate estop``.

While a run's e-stop is engaged its folder holds ``estop.json`` (``reason``,
``t_engaged``): the gateway writes it when the e-stop engages and removes it on release,
and a gateway starting on the folder starts e-stopped (:mod:`gateway.hub.estop`).
``loopgate estop RUN`` engages a running run's e-stop from a terminal or a script, as the
console's button does; ``--release`` lifts it. On a run that has ended it sets or clears
the latch its next start will find::

    loopgate estop runs/arm1 --reason "cable caught"
    loopgate estop runs/arm1 --release
"""

from __future__ import annotations

import argparse
import getpass
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from gateway.endpoints import lookup, run_ended
from gateway.endpoints import read as read_endpoints

log = logging.getLogger(__name__)

LATCH_FILE = "estop.json"
"""The run folder's e-stop latch: present while the e-stop is engaged."""


def write_latch(path: Path, reason: str) -> None:
    """Latch an engaged e-stop at ``path``, replaced whole (never half-written)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps({"engaged": True, "reason": reason, "t_engaged": time.time()}))
    os.replace(tmp, path)


def read_latch(path: Path) -> dict[str, Any] | None:
    """What the latch at ``path`` holds (``reason``, ``t_engaged``), None if there is none;
    one that cannot be read still counts as engaged."""
    if not path.exists():
        return None
    try:
        latched = json.loads(path.read_text())
        if not isinstance(latched, dict):
            raise ValueError(f"expected an object, got {type(latched).__name__}")
    except (OSError, ValueError) as exc:
        return {"reason": f"unreadable latch ({exc})"}
    return latched


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loopgate estop",
        description="Engage (or release) a run's software e-stop: every env holds. A software "
        "stop on top of the robot's own hardware e-stop, never a replacement for it.",
        epilog='example: loopgate estop runs/arm1 --reason "cable caught"\n'
        "         loopgate estop runs/arm1 --release",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run", help="run folder")
    p.add_argument("--release", action="store_true", help="lift the e-stop (motion may resume)")
    p.add_argument("--reason", default="", help="why (logged, and kept in the latch)")
    p.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for the gateway's answer")
    p.add_argument("--log-level", default="INFO")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(message)s")
    run_dir = Path(args.run)
    reason = args.reason or f"loopgate estop ({getpass.getuser()}@{socket.gethostname()})"
    latch = run_dir / LATCH_FILE
    if not (run_dir / "endpoints.json").exists():
        log.error("%s is not a run folder (no endpoints.json)", run_dir)
        return 2
    if run_ended(run_dir):
        if args.release:
            latch.unlink(missing_ok=True)
            log.info("the run in %s has ended; its e-stop is released for its next start", run_dir)
        else:
            write_latch(latch, reason)
            log.info("the run in %s has ended; its e-stop is latched for its next start", run_dir)
        print(json.dumps({"estopped": not args.release, "running": False}))
        return 0
    from gateway.config import ConfigError, load_config
    from gateway.control_client import ControlClient
    from gateway.protocol import RemoteError, Timeout
    from gateway.transport import CurveKeys

    address = lookup(read_endpoints(run_dir / "endpoints.json"), "gateway", "control")
    if address is None:
        log.error("%s/endpoints.json names no gateway", run_dir)
        return 2
    try:
        cfg = load_config(run_dir / "config.yaml")
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    keys = CurveKeys.load(cfg.gateway.curve_keys) if cfg.gateway.curve_keys else None
    control = ControlClient(address, keys)
    try:
        reply = control.request("estop", timeout_s=args.timeout, engaged=not args.release, reason=reason)
    except (Timeout, RemoteError) as exc:
        log.error(
            "the gateway of %s did not take it: %s (a gateway restarting does not answer; an engaged "
            "e-stop stays latched in %s and holds when it is back)",
            run_dir,
            exc,
            latch,
        )
        return 1
    finally:
        control.close()
    print(json.dumps({**reply, "running": True}))
    return 0 if reply.get("estopped") is not args.release else 1


if __name__ == "__main__":
    sys.exit(main())
