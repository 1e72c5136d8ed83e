"""``loopgate scale RUN env.workers=N``: env workers join or leave a live run.

    loopgate scale runs/reach-20261201-101500 env.workers=4     # two more workers join
    loopgate scale runs/reach-20261201-101500 env.workers=1     # the newest three leave

The command hands a request to the ``loopgate up`` that serves the run folder (whatever
its engine) through the run folder itself, and waits for its answer:

1. it writes ``RUN/requests/scale-<id>.json`` (``{"env.workers": N}``, atomically);
2. ``loopgate up`` claims it (renames it to ``.taken``), plans the new workers exactly as
   it planned the first ones (``worker-<index>``, same config, seeds by index) and starts
   them, or stops the highest-numbered workers gracefully: a leaving worker says goodbye,
   the gateway closes its open episodes as interrupted and keeps every step it
   acknowledged, so step accounting stays exact;
3. it writes ``RUN/requests/scale-<id>.done.json`` with the outcome, logs the change and
   appends it to ``metrics.jsonl`` (``{"scale": {...}}``); the status table shows the new
   set of workers.

A request nobody claims within ``--timeout`` (no ``loopgate up`` on that folder), or
whose command is interrupted (Ctrl-C) before it is claimed, is withdrawn and the command
fails; nothing is applied later by surprise. A run that has ended (its ``summary.json``
written after its last start) is refused at once.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from gateway.config import ConfigError, ExperimentConfig
from gateway.endpoints import run_ended
from gateway.registry import CONFIG_BLOCKS, PLANS, resolve

log = logging.getLogger("loopgate.scale")

REQUESTS = "requests"
SCALABLE = ("env.workers",)
_WORKER = re.compile(r"^worker-(\d+)$")


def parse_target(text: str) -> tuple[str, int]:
    """``"env.workers=4"`` -> ``("env.workers", 4)``; a clear :class:`ConfigError` otherwise."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or key not in SCALABLE:
        raise ConfigError(f"scale {text!r}: expected {' or '.join(k + '=N' for k in SCALABLE)}")
    try:
        value = int(raw.strip())
    except ValueError:
        raise ConfigError(f"scale {text!r}: {key} must be an integer, got {raw.strip()!r}") from None
    if value < 1:
        raise ConfigError(f"scale {text!r}: {key} must be >= 1, got {value}")
    return key, value


# ------------------------------------------------------------------ the driver's side


def serve_requests(sup: Any, cfg: ExperimentConfig, run: Any, metrics: Any = None) -> list[dict[str, Any]]:
    """Apply every pending scale request of ``run``'s folder to the supervisor ``sup``;
    the outcomes (also written next to each request)."""
    folder = Path(run.run_dir) / REQUESTS
    if not folder.is_dir():
        return []
    outcomes = []
    for path in sorted(folder.glob("scale-*.json")):
        if path.name.endswith(".done.json"):
            continue
        taken = path.with_suffix(".taken")
        try:
            os.rename(path, taken)  # claimed: the command can no longer withdraw it
        except FileNotFoundError:
            continue
        try:
            request = json.loads(taken.read_text())
            _, value = parse_target(f"env.workers={request.get('env.workers')}")
            outcome = scale_workers(sup, cfg, run, value)
        except (ConfigError, ValueError, json.JSONDecodeError) as exc:
            outcome = {"ok": False, "message": str(exc)}
            log.error("scale request %s refused: %s", path.name, exc)
        outcome["request"] = path.stem
        done = folder / f"{path.stem}.done.json"
        tmp = done.with_name(done.name + ".new")
        tmp.write_text(json.dumps(outcome, indent=2))
        os.replace(tmp, done)
        taken.unlink(missing_ok=True)
        if metrics is not None:
            metrics.emit({"scale": outcome})
        outcomes.append(outcome)
    return outcomes


def worker_names(sup: Any) -> list[str]:
    """The run's workers, lowest index first."""
    found = [(int(m.group(1)), name) for name in sup.procs if (m := _WORKER.match(name))]
    return [name for _, name in sorted(found)]


def scale_workers(sup: Any, cfg: ExperimentConfig, run: Any, workers: int) -> dict[str, Any]:
    """Start or stop workers so that ``workers`` of them are part of the run."""
    current = worker_names(sup)
    started: list[str] = []
    stopped: list[str] = []
    if workers > len(current):
        blocks = {b: getattr(cfg, b) for b in CONFIG_BLOCKS if cfg.has(b)}
        blocks["env"] = dataclasses.replace(cfg.env, workers=workers)
        planned = resolve(PLANS, "env", "service plan")(ExperimentConfig(blocks, cfg.name), run)
        for service in planned:
            if service.name not in sup.procs and len(current) + len(started) < workers:
                sup.start(sup.add(service))
                started.append(service.name)
    elif workers < len(current):
        stopped = current[workers:][::-1]
        sup.stop(stopped, timeout_s=cfg.run.drain_timeout_s)
        for name in stopped:
            sup.remove(name)
    now = worker_names(sup)
    if started or stopped:
        log.info(
            "scaled env workers %d -> %d%s%s",
            len(current),
            len(now),
            f"; started {', '.join(started)}" if started else "",
            f"; stopped {', '.join(stopped)}" if stopped else "",
        )
    return {
        "ok": True,
        "env.workers": len(now),
        "previous": len(current),
        "started": started,
        "stopped": stopped,
    }


# -------------------------------------------------------------------- the command


class NotServed(Exception):
    """No ``loopgate up`` serves the run folder: the run has ended."""


def request_scale(run_dir: Path, key: str, value: int, timeout_s: float) -> dict[str, Any]:
    """Hand a scale request to the run's ``loopgate up`` and wait for its outcome."""
    if not (run_dir / "endpoints.json").exists():
        raise ConfigError(f"{run_dir} is not a run folder (no endpoints.json)")
    if run_ended(run_dir):
        raise NotServed(
            f"the run in {run_dir} has ended (its summary.json was written after its last start): "
            "no loopgate up serves it; `loopgate up CONFIG --run-dir RUN` continues it"
        )
    folder = run_dir / REQUESTS
    folder.mkdir(exist_ok=True)
    stem = f"scale-{time.time_ns()}-{os.getpid()}"
    path = folder / f"{stem}.json"
    tmp = folder / f".{stem}.tmp"
    tmp.write_text(json.dumps({key: value}))
    os.replace(tmp, path)
    done = folder / f"{stem}.done.json"
    deadline = time.monotonic() + timeout_s
    log.info("waiting up to %.0f s for the run's loopgate up to apply %s=%d", timeout_s, key, value)
    try:
        while time.monotonic() < deadline:
            if done.exists():
                outcome: dict[str, Any] = json.loads(done.read_text())
                return outcome
            time.sleep(0.1)
    except KeyboardInterrupt:
        try:
            path.unlink()
            log.warning("interrupted: the request is withdrawn, nothing changes")
        except FileNotFoundError:
            log.warning("interrupted: loopgate up had already taken the request; it applies it")
        raise
    with contextlib.suppress(FileNotFoundError):
        path.unlink()  # withdrawn: never applied later by surprise
        raise TimeoutError(f"no loopgate up answered within {timeout_s:.0f} s: is one running on {run_dir}?")
    # Claimed but not answered yet: the change is under way; give it one more period.
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if done.exists():
            return dict(json.loads(done.read_text()))
        time.sleep(0.1)
    raise TimeoutError(f"loopgate up took the request but did not answer within {2 * timeout_s:.0f} s")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loopgate scale",
        description="Change the number of env workers of a live run (any engine).",
        epilog="example: loopgate scale runs/reach-20261201-101500 env.workers=4",
    )
    p.add_argument("run_dir", help="the run folder a `loopgate up` is serving")
    p.add_argument("target", help="env.workers=N")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the change (default 60)")
    p.add_argument("--log-level", default="INFO")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(message)s")
    try:
        key, value = parse_target(args.target)
        outcome = request_scale(Path(args.run_dir), key, value, args.timeout)
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    except (TimeoutError, NotServed) as exc:
        log.error("%s", exc)
        return 1
    print(json.dumps(outcome))
    return 0 if outcome.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
