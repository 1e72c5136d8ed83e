"""The live view of ``loopgate up``: a progress bar and a status table.

On a terminal it redraws in place (rich ``Live``); otherwise (CI, a log file) it logs
one status line every few seconds instead.
"""

from __future__ import annotations

import logging
import sys
import time
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
        if self._live is not None:
            self._live.update(Group(self.progress, self._table(status, services, extra)))
            return
        now = time.monotonic()
        if now - self._last_line >= 5.0:
            self._last_line = now
            budget = f"/{self.total}" if self.total else ""
            more = " ".join(f"{k}={v}" for k, v in extra.items())
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
            *(f"{k} [bold]{v}[/]" for k, v in extra.items()),
        )
        outer = Table.grid()
        outer.add_row(stats)
        outer.add_row(table)
        return outer
