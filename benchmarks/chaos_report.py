"""The chaos harness's tables, and the soak sampler (RSS and open fds of every service).

:func:`print_report` prints three tables from a chaos report (faults by kind with the
time to recover, the steps read back, the problems) and, for a soak, one row per
service with its RSS and fds at the first and last sample. :func:`soak_sampler` runs on
a thread of the harness and samples every process of the run every ``period_s``::

    soak = {}
    threading.Thread(target=soak_sampler, args=(exp, 60.0, stop_event, soak)).start()
    # soak["samples"]: [{"t": s, "services": {"gateway": {"rss": bytes, "fds": n}, ...}}, ...]
    # soak["rss_growth_frac"]: {"gateway": 0.03, ...}   (last / first-after-warm-up - 1)
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

from benchmarks.chaos_check import rss_and_fds

WARMUP_SAMPLES = 1
"""Samples left out of the growth figure: start-up (imports, first allocations, JIT)."""


def _name(kind: str, index: int, count: int) -> str:
    return kind if count == 1 else f"{kind}-{index}"


def sample_once(exp: Any) -> dict[str, dict[str, int]]:
    """RSS (bytes) and open fds of every process of the run, named by kind (``worker-0``...)."""
    out: dict[str, dict[str, int]] = {}
    for kind, pids in exp.pids().items():
        if kind == "other":
            continue
        for i, pid in enumerate(pids):
            got = rss_and_fds(pid)
            if got is not None:
                out[_name(kind, i, len(pids))] = {"pid": pid, "rss": got[0], "fds": got[1]}
    return out


def growth(samples: list[dict[str, Any]], key: str) -> dict[str, float]:
    """Per service: last sample / first sample after the warm-up - 1, over one process life
    (a service whose pid changed is measured from its newest life)."""
    out: dict[str, float] = {}
    names = {n for s in samples for n in s["services"]}
    for name in sorted(names):
        series = [s["services"][name] for s in samples[WARMUP_SAMPLES:] if name in s["services"]]
        if len(series) < 2:
            continue
        life = [x for x in series if x["pid"] == series[-1]["pid"]]
        first, last = life[0][key], life[-1][key]
        if len(life) >= 2 and first:
            out[name] = round(last / first - 1.0, 4)
    return out


def soak_sampler(exp: Any, period_s: float, stop: threading.Event, soak: dict[str, Any]) -> None:
    started = time.monotonic()
    samples: list[dict[str, Any]] = soak.setdefault("samples", [])
    while True:
        samples.append(
            {"t": round(time.monotonic() - started, 1), "acked": exp.status().get("acked_steps")}
            | {"services": sample_once(exp)}
        )
        soak["rss_growth_frac"] = growth(samples, "rss")
        soak["fds_growth_frac"] = growth(samples, "fds")
        if stop.wait(period_s):
            return


def print_report(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    faults = report["faults"]
    table = Table(title=f"chaos: seed {report['seed']}, {len(faults)} faults", title_justify="left")
    for col, justify in (("fault", "left"), ("n", "right"), ("recover p50 s", "right"), ("max s", "right")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    kinds: dict[str, list[dict[str, Any]]] = {}
    for f in faults:
        kinds.setdefault(f["kind"], []).append(f)
    for kind, items in sorted(kinds.items()):
        rec = [f["recover_s"] for f in items if f["recover_s"] is not None]
        failed = len(items) - len(rec)
        p50 = f"{statistics.median(rec):.2f}" if rec else "-"
        top = f"{max(rec):.2f}" if rec else "-"
        table.add_row(kind, f"{len(items)}" + (f" ({failed} not recovered)" if failed else ""), p50, top)
    for kind, why in sorted(report.get("skipped", {}).items()):
        table.add_row(kind, "skipped", why, "")
    console.print(table)
    c = report["check"]
    steps = Table(title="steps, read back from the store", title_justify="left")
    for col in (
        "acked",
        "stored",
        "lost",
        "duplicated",
        "spooled",
        "episodes",
        "open",
        "processes left",
        "files left",
    ):
        steps.add_column(col, justify="right")
    steps.add_row(
        *(
            str(c.get(k, "-"))
            for k in (
                "acked_steps",
                "stored_steps",
                "lost_steps",
                "duplicate_steps",
                "spooled_steps",
                "episodes",
                "open_episodes",
                "processes_left",
                "files_left",
            )
        )
    )
    console.print(steps)
    soak = report.get("soak") or {}
    if soak.get("samples"):
        first, last = soak["samples"][min(WARMUP_SAMPLES, len(soak["samples"]) - 1)], soak["samples"][-1]
        t = Table(
            title=f"soak: {len(soak['samples'])} samples over {last['t'] / 60:.0f} min", title_justify="left"
        )
        for col in ("service", "RSS first MiB", "RSS last MiB", "RSS growth", "fds first", "fds last"):
            t.add_column(col, justify="left" if col == "service" else "right")
        for name in sorted(last["services"]):
            a, b = first["services"].get(name), last["services"][name]
            g = soak["rss_growth_frac"].get(name)
            t.add_row(
                name,
                f"{a['rss'] / 2**20:.0f}" if a else "-",
                f"{b['rss'] / 2**20:.0f}",
                f"{g:+.1%}" if g is not None else "-",
                str(a["fds"]) if a else "-",
                str(b["fds"]),
            )
        console.print(t)
    if report["problems"]:
        console.print("[bold red]problems:[/]")
        for p in report["problems"]:
            console.print(f"  - {p}")
    else:
        console.print(
            "every check held: nothing acknowledged lost or stored twice, no episode open, "
            "no version went back, nothing left behind"
        )
