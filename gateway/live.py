"""The live view of ``loopgate up``: a progress bar and a status table.

On a terminal it redraws in place (rich ``Live``); otherwise (CI, a log file) it logs
one status line every few seconds instead. :class:`StartupWatch` says there why a worker
is not collecting yet (a robot that does not publish, a simulator still loading).
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

log = logging.getLogger(__name__)

SAID_HOLDS = ("estop", "paused", "storage")
"""Holds the live view logs as they start and end; the others (the sink's backpressure,
the policy's lag) come and go by themselves and show in the status line only."""


class LiveView:
    def __init__(self, title: str, total_steps: int | None, *, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True)
        self.interactive = self.console.is_terminal and sys.stderr.isatty()
        self.total = total_steps
        self.progress = Progress(
            TextColumn(f"[bold]{title}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("env steps"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=self.console,
        )
        self.task = self.progress.add_task("collect", total=total_steps)
        self._live: Live | None = None
        self._last_line = 0.0
        self._held: str | None = None

    def __enter__(self) -> LiveView:
        if self.interactive:
            self._live = Live(self.progress, console=self.console, refresh_per_second=4, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)

    def update(self, status: dict[str, Any], services: list[dict[str, Any]], extra: dict[str, Any]) -> None:
        steps = int(status.get("env_steps", 0))
        self.progress.update(self.task, completed=steps)
        self._say_hold(status)
        if self._live is not None:
            self._live.update(Group(self.progress, self._table(status, services, extra)))
            return
        now = time.monotonic()
        if now - self._last_line >= 5.0:
            self._last_line = now
            budget = f"/{self.total}" if self.total else ""
            held = {"held": status["held"]} if status.get("held") else {}
            more = " ".join(f"{k}={v}" for k, v in {**held, **extra}.items())
            log.info(
                "env_steps=%d%s steps/s=%.0f episodes=%d rtt_p50=%.0fus services=%s %s",
                steps,
                budget,
                status.get("steps_per_s", 0.0),
                status.get("episodes", 0),
                status.get("rtt_p50_us", 0.0),
                ",".join(f"{s['name']}:{s['state']}" for s in services),
                more,
            )

    def _say_hold(self, status: dict[str, Any]) -> None:
        """Log when an operator's hold (e-stop, pause) or a failing spool starts or ends
        collection: otherwise only steps/s falling to 0 would say so."""
        held = status.get("held") if status.get("held") in SAID_HOLDS else None
        if held == self._held:
            return
        if held is not None:
            log.warning("collection held: %s", status.get("held_why") or held)
        elif self._held is not None and "held" in status:
            log.info("collection resumed (%s lifted)", self._held)
        self._held = held

    def _table(self, status: dict[str, Any], services: list[dict[str, Any]], extra: dict[str, Any]) -> Table:
        table = Table(expand=False, show_edge=False, pad_edge=False)
        for col in ("service", "state", "pid", "restarts", "detail"):
            table.add_column(col)
        workers = {w["uid"]: w for w in status.get("workers", [])}
        for s in services:
            table.add_row(
                s["name"],
                s["state"],
                str(s.get("pid") or "-"),
                str(s.get("restarts", 0)),
                s.get("detail", ""),
            )
        stats = Table.grid(padding=(0, 2))
        stats.add_row(
            f"steps/s [bold]{status.get('steps_per_s', 0):.0f}[/]",
            f"episodes [bold]{status.get('episodes', 0)}[/]",
            f"acked [bold]{status.get('acked_steps', 0)}[/]",
            f"rtt p50/p99 [bold]{status.get('rtt_p50_us', 0):.0f}/{status.get('rtt_p99_us', 0):.0f} µs[/]",
            f"workers [bold]{len(workers)}[/]",
            f"errors [bold]{sum(status.get('errors', {}).values())}[/]",
            *([f"held [bold red]{status['held']}[/]"] if status.get("held") else []),
            *(f"{k} [bold]{v}[/]" for k, v in extra.items()),
        )
        outer = Table.grid()
        outer.add_row(stats)
        outer.add_row(table)
        return outer


def last_line(path: Path, limit: int = 240) -> str:
    """The last non-empty line of a log file (``""`` if there is none), cut to ``limit``."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 8192))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return ""
    line = next((text.strip() for text in reversed(lines) if text.strip()), "")
    return line if len(line) <= limit else line[: limit - 3] + "..."


class StartupWatch:
    """Workers that run but have not registered with the gateway, and what their log says.

    Until its backend is up a worker does not register: a ROS 2 robot it waits for (up to
    ``connect_timeout_s``), a simulator that loads for minutes. Its own log says what it
    waits for; ``loopgate up``'s output said only ``env_steps=0``. A worker not registered
    ``notice_s`` (``run.start_notice_s``) after it started is logged with its log's last
    line, again every ``notice_s``, and :attr:`details` holds the same for the live table. Workers are
    matched to the gateway's sessions by process id; where the ids cannot match (workers
    on other hosts), only a shortfall in the number registered is reported.
    """

    def __init__(self, logs: Path, notice_s: float) -> None:
        self.logs, self.notice_s = logs, notice_s
        self._since: dict[tuple[str, int], float] = {}
        self._told: dict[str, float] = {}
        self.details: dict[str, str] = {}
        """Service name -> why it is not collecting yet (only the workers that are late)."""

    def check(self, status: dict[str, Any], services: list[dict[str, Any]], now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        sessions = status.get("workers", [])
        registered = {w.get("pid") for w in sessions}
        running = [
            s
            for s in services
            if s["name"].startswith("worker-") and s["state"] == "running" and s.get("pid")
        ]
        late = [s for s in running if s["pid"] not in registered] if len(sessions) < len(running) else []
        keys = {(s["name"], s["pid"]) for s in late}
        self._since = {k: t for k, t in self._since.items() if k in keys}
        self.details = {}
        for s in late:
            name = s["name"]
            age = now - self._since.setdefault((name, s["pid"]), now)
            if age < self.notice_s:
                continue
            path = self.logs / f"{name}.log"
            said = last_line(path) or "(nothing yet)"
            self.details[name] = f"not registered after {age:.0f} s: {said}"
            if now - self._told.get(name, float("-inf")) >= self.notice_s:
                self._told[name] = now
                log.info(
                    "%s has not registered with the gateway %.0f s after it started; the last line of %s: %s",
                    name,
                    age,
                    path,
                    said,
                )
