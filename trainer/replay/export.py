"""``loopgate export RUN --format lerobot|mcap OUT``: a run's episodes in formats other tools read.

Episodes are read back from where the run stored them (its replay log, or its local
episode store), duplicates dropped, in the order they were stored. Demonstrations
imported into the run are left out unless ``--demos``; evaluation episodes are kept
and flagged (``--no-eval`` leaves them out)::

    loopgate export runs/reach_sim-20261130-101500 --format lerobot exports/reach
    loopgate export runs/reach_sim-20261130-101500 --format mcap exports/reach.mcap

- ``lerobot``: a LeRobotDataset v3.0 folder (:mod:`trainer.replay.export_lerobot`);
- ``mcap``: ROS 2 messages for Foxglove and the ``mcap`` readers
  (:mod:`trainer.replay.export_mcap`).

On a terminal the export draws a progress bar per phase (episodes, each camera's
video, MCAP steps); otherwise it logs each phase's progress every few seconds and when
the phase is done. It ends with a one-line summary on stderr and the summary as JSON on
stdout. Every column and topic is listed in ``docs/export.md``.

The export is written beside its destination and takes its place only once complete
(:func:`replacing`): interrupted or failed, it leaves ``OUT`` as it was, a dataset
exported there before included. A LeRobot ``OUT`` that holds something other than a
dataset is refused, never replaced.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gateway.lifeline import pid_alive
from gateway.trajectory import Episode, assemble_episodes
from trainer.replay.export_mcap import ProgressFn
from trainer.replay.log import run_chunks

log = logging.getLogger(__name__)

LOG_EVERY_S = 5.0


def run_episodes(run_dir: str | Path, *, demos: bool = False, evals: bool = True) -> list[Episode]:
    """Episodes of a run folder, complete and deduplicated."""
    chunks = []
    for chunk in run_chunks(run_dir):
        source = chunk.meta.get("source", "online")
        if (source == "demos" and not demos) or (chunk.meta.get("eval") and not evals):
            continue
        chunk.meta["source"] = source
        chunks.append(chunk)
    return assemble_episodes(chunks)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def sweep_leftovers(target: Path) -> None:
    """Clear what an export to ``target`` killed outright (SIGKILL, power loss) left beside
    it: its partial is removed; a previous export it had swapped out but not yet replaced
    is put back where it was, or removed once the new one is in place. Only exports whose
    process is gone are touched: one still running keeps its files."""
    if not target.parent.is_dir():
        return
    pattern = re.compile(rf"\.{re.escape(target.stem)}\.(partial|old)-(\d+){re.escape(target.suffix)}")
    found = [
        (m.group(1), int(m.group(2)), p) for p in target.parent.iterdir() if (m := pattern.fullmatch(p.name))
    ]
    for kind, pid, path in sorted(found, key=lambda f: f[0] != "old"):  # swapped-out ones first
        if pid == os.getpid() or pid_alive(pid):
            continue
        if kind == "old" and not (target.exists() or target.is_symlink()):
            log.warning(
                "%s: putting back the export an interrupted one (pid %d) had swapped out", target, pid
            )
            os.rename(path, target)
        else:
            log.info("%s: removing %s, left by an interrupted export (pid %d)", target, path.name, pid)
            _remove(path)


@contextlib.contextmanager
def replacing(target: Path) -> Iterator[Path]:
    """A path beside ``target`` (same folder, same suffix) to write the export to. Once the
    block ends, it takes ``target``'s place (a folder there is swapped out and removed);
    if the block raises, Ctrl-C included, it is removed and ``target`` is left as it was.
    What an export killed outright left beside ``target`` is cleared first (:func:`sweep_leftovers`)."""
    partial = target.with_name(f".{target.stem}.partial-{os.getpid()}{target.suffix}")
    target.parent.mkdir(parents=True, exist_ok=True)
    sweep_leftovers(target)
    _remove(partial)
    try:
        yield partial
    except BaseException:
        _remove(partial)
        raise
    if target.is_dir() and not target.is_symlink():
        old = target.with_name(f".{target.stem}.old-{os.getpid()}{target.suffix}")
        os.rename(target, old)
        os.rename(partial, target)
        shutil.rmtree(old)
    else:
        os.replace(partial, target)


def check_lerobot_out(out: Path) -> None:
    """Refuse an ``OUT`` that is a file, or a folder holding anything but a dataset: the
    export replaces ``OUT`` whole."""
    if out.is_file():
        raise ValueError(f"{out} is a file; a LeRobot dataset is a folder")
    if out.is_dir() and any(out.iterdir()) and not (out / "meta" / "info.json").is_file():
        raise ValueError(
            f"{out} holds something other than a LeRobot dataset (no meta/info.json), and the "
            "export would replace it whole: export into a new or empty folder"
        )


def export(
    run_dir: str | Path,
    fmt: str,
    out: str | Path,
    *,
    demos: bool = False,
    evals: bool = True,
    progress: ProgressFn | None = None,
) -> dict[str, Any]:
    run = Path(run_dir)
    if fmt not in ("lerobot", "mcap"):
        raise ValueError(f"unknown export format {fmt!r} (lerobot, mcap)")
    out = Path(out)
    if fmt == "lerobot":
        check_lerobot_out(out)
    episodes = run_episodes(run, demos=demos, evals=evals)
    spec_path = run / "spec.json"
    spec = json.loads(spec_path.read_text()) if spec_path.exists() else None
    if fmt == "lerobot":
        from trainer.replay.export_lerobot import write_lerobot

        with replacing(out) as partial:
            result = write_lerobot(episodes, partial, spec, progress=progress)
        return {**result, "path": str(out)}
    from trainer.replay.export_mcap import write_mcap

    target = out / "episodes.mcap" if out.suffix != ".mcap" else out
    with replacing(target) as partial:
        result = write_mcap(episodes, partial, progress=progress)
    return {**result, "path": str(target)}


class ExportProgress:
    """Progress of an export: rich bars on a terminal, a log line now and then elsewhere."""

    def __init__(self, interactive: bool | None = None) -> None:
        from rich.console import Console

        self.console = Console(stderr=True)
        self.interactive = (
            (self.console.is_terminal and sys.stderr.isatty()) if interactive is None else interactive
        )
        self._bars: Any = None
        self._tasks: dict[str, Any] = {}
        self._logged: dict[str, float] = {}

    def __enter__(self) -> ExportProgress:
        if self.interactive:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._bars = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=self.console,
            )
            self._bars.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._bars is not None:
            self._bars.__exit__(*exc)

    def __call__(self, phase: str, done: int, total: int) -> None:
        if self._bars is not None:
            if phase not in self._tasks:
                self._tasks[phase] = self._bars.add_task(phase, total=total)
            self._bars.update(self._tasks[phase], completed=done, total=total)
            return
        now = time.monotonic()
        if done >= total or now - self._logged.get(phase, now - LOG_EVERY_S) >= LOG_EVERY_S:
            self._logged[phase] = now
            log.info("%s %d/%d", phase, done, total)


def summary_line(fmt: str, result: dict[str, Any], seconds: float) -> str:
    """E.g. ``exported 24 episodes (408 frames, video of image in libsvtav1) to OUT in 2.1 s``."""
    if fmt == "lerobot":
        cams = ", ".join(result["cameras"])
        what = f"{result['frames']} frames" + (f", video of {cams} in {result['codec']}" if cams else "")
    else:
        what = f"{result['messages']} messages on {result['topics']} topics, {result['envs']} envs"
    return f"exported {result['episodes']} episodes ({what}) to {result['path']} in {seconds:.1f} s"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loopgate export",
        description="Export a run's episodes as a LeRobot v3 dataset or an MCAP file of ROS 2 messages.",
        epilog="example: loopgate export runs/reach_sim-20261130-101500 --format lerobot exports/reach\n"
        "         loopgate export runs/reach_sim-20261130-101500 --format mcap exports/reach.mcap",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run", help="run folder (with replay/log or episodes/)")
    p.add_argument("out", help="output folder (lerobot) or .mcap file / folder (mcap)")
    p.add_argument("--format", required=True, choices=("lerobot", "mcap"), help="what to write")
    p.add_argument("--demos", action="store_true", help="include demonstrations imported into the run")
    p.add_argument("--no-eval", action="store_true", help="leave evaluation episodes out")
    p.add_argument("--log-level", default="INFO")
    return p


def _interrupted(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    start = time.monotonic()
    signal.signal(signal.SIGTERM, _interrupted)  # stops like Ctrl-C: OUT left as it was
    try:
        with ExportProgress() as progress:
            result = export(
                args.run, args.format, args.out, demos=args.demos, evals=not args.no_eval, progress=progress
            )
    except (FileNotFoundError, ValueError, ImportError) as exc:
        log.error("%s", exc)
        return 2
    except KeyboardInterrupt:
        log.warning("interrupted: %s is left as it was", args.out)
        return 130
    log.info("%s", summary_line(args.format, result, time.monotonic() - start))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
