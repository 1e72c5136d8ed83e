"""``loopgate bench``: run the benchmark suites, print a table, optionally write JSON.

    loopgate bench                                   # every suite, full length
    loopgate bench --quick --json bench.json         # short run (CI smoke test)
    loopgate bench --only gateway.rtt --repeats 7    # records whose name contains it

Suites come from :data:`benchmarks.suites.SUITES`; ``--only`` runs the suites that can
produce a matching record and keeps the matching records plus their baselines. Targets
are reported in the table and the JSON, never turned into a failing exit status: the
exit status says whether the benchmarks ran (0), some suite failed (1: the others'
records are still printed and written) or the run was interrupted (130), not whether
they were fast.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import suites
from benchmarks.procs import code_version
from benchmarks.records import Record, Result, finish, select

log = logging.getLogger("loopgate.bench")

FULL_REPEATS = 5
QUICK_REPEATS = 2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loopgate bench",
        description="Measure the data path against raw baselines measured in the same run.",
        epilog="example: loopgate bench --quick --json bench.json\n"
        "         loopgate bench --only gateway.rtt_p50_us.4KiB --repeats 9",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="short windows and few repeats (CI smoke test)")
    p.add_argument("--json", metavar="FILE", help="write the records as a JSON list to FILE")
    p.add_argument("--only", metavar="SUBSTRING", help="only records whose name contains SUBSTRING")
    p.add_argument(
        "--repeats",
        type=int,
        help=f"repeats per measurement; figures are medians (default {FULL_REPEATS}, --quick {QUICK_REPEATS})",
    )
    p.add_argument("--log-level", default="INFO")
    return p


def _fmt(value: float | None, digits: int = 1) -> str:
    if value is None:
        return "-"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    if value and abs(value) < 10:
        return f"{value:.3g}"  # a 4 ms transfer is 0.004 s, not 0.0 s
    return f"{value:.{digits}f}"


def print_table(results: list[Result], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for column, justify in (
        ("record", "left"),
        ("value", "right"),
        ("unit", "left"),
        ("baseline", "left"),
        ("baseline value", "right"),
        ("ratio", "right"),
        ("target", "left"),
    ):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    for res in results:
        r = res.record
        target = ""
        if r.target is not None:
            verdict = "-" if res.met is None else ("[green]met[/]" if res.met else "[red]missed[/]")
            target = f"{r.target} {verdict}"
        table.add_row(
            r.name,
            _fmt(r.value),
            r.unit,
            r.baseline if res.baseline_value is not None else "",
            _fmt(res.baseline_value),
            "" if res.ratio is None else f"{res.ratio:.2f}x",
            target,
        )
    console = Console()
    if not console.is_terminal:
        console = Console(width=200)  # a log file or pipe: do not cut record names
    console.print(table)


@dataclass
class Outcome:
    """What a run produced: records, suites that failed, and whether it was interrupted."""

    records: list[Record] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    interrupted: bool = False


def run_suites(quick: bool, repeats: int, only: str | None) -> Outcome:
    """Run the selected suites in order; a failing suite costs only its own records."""
    outcome = Outcome()
    for name in suites.SUITES:
        run, declared = suites.load(name)
        if not suites.selected(name, declared, only):
            continue
        log.info("suite %s: %s, %d repeat(s)", name, "quick" if quick else "full", repeats)
        started = time.monotonic()
        try:
            produced = run(quick=quick, repeats=repeats)
        except KeyboardInterrupt:
            log.warning("interrupted during suite %s; reporting what was measured before it", name)
            outcome.interrupted = True
            return outcome
        except Exception:
            # The boundary between independent suites, like a test runner's: one suite
            # failing (a peer that did not start, a missing optional package) must not
            # throw away the minutes of figures the others measured. It is logged with
            # its traceback and makes the exit status non-zero.
            log.exception(
                "suite %s failed after %.1f s; its records are missing", name, time.monotonic() - started
            )
            outcome.failed.append(name)
            continue
        log.info("suite %s done in %.1f s", name, time.monotonic() - started)
        # A suite may run more than asked for; --only keeps matches and their baselines.
        outcome.records += select(produced, None if only is None or only in name else only)
    return outcome


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    repeats = args.repeats or (QUICK_REPEATS if args.quick else FULL_REPEATS)
    if repeats < 1:
        log.error("--repeats must be >= 1, got %d", repeats)
        return 2
    load = os.getloadavg()[0]
    cpus = len(os.sched_getaffinity(0))
    if load > 0.5 * cpus:
        log.warning(
            "load average %.1f on %d CPU(s): other work is running, figures will be noisy", load, cpus
        )
    started = time.monotonic()
    # SIGTERM unwinds like Ctrl-C: every suite's finally blocks stop what they started,
    # and what was measured so far is still reported.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        outcome = run_suites(args.quick, repeats, args.only)
    finally:
        signal.signal(signal.SIGTERM, previous)
    if not outcome.records and not (outcome.failed or outcome.interrupted):
        log.error("no benchmark record matches --only %r", args.only)
        return 2
    results = finish(outcome.records)
    title = (
        f"loopgate bench{' --quick' if args.quick else ''}: medians of {repeats} repeat(s), "
        f"{time.monotonic() - started:.0f} s, {cpus} CPU(s), load {load:.1f} at start; "
        f"code: {code_version()}"
    )
    if outcome.failed:
        title += f"; FAILED suites: {', '.join(outcome.failed)}"
    if outcome.interrupted:
        title += "; INTERRUPTED"
    if results:
        print_table(results, title)
    if args.json:
        Path(args.json).write_text(json.dumps([r.to_json() for r in results], indent=2) + "\n")
        log.info("wrote %s", args.json)
    if outcome.interrupted:
        return 130
    return 1 if outcome.failed else 0


if __name__ == "__main__":
    sys.exit(main())
