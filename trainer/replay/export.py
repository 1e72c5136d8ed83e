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
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from gateway.trajectory import Episode, assemble_episodes
from trainer.replay.log import run_chunks

log = logging.getLogger(__name__)


def run_episodes(run_dir: str | Path, *, demos: bool = False, evals: bool = True) -> list[Episode]:
    """Episodes of a run folder, complete and deduplicated."""
    chunks = []
    for chunk in run_chunks(run_dir):
        source = chunk.meta.get("source", "online")
        if (source == "demos" and not demos) or (chunk.meta.get("eval") and not evals):
            continue
        chunks.append(chunk)
    return assemble_episodes(chunks)


def export(
    run_dir: str | Path, fmt: str, out: str | Path, *, demos: bool = False, evals: bool = True
) -> dict[str, Any]:
    run = Path(run_dir)
    episodes = run_episodes(run, demos=demos, evals=evals)
    spec_path = run / "spec.json"
    spec = json.loads(spec_path.read_text()) if spec_path.exists() else None
    if fmt == "lerobot":
        from trainer.replay.export_lerobot import write_lerobot

        return write_lerobot(episodes, Path(out), spec)
    if fmt == "mcap":
        from trainer.replay.export_mcap import write_mcap

        return write_mcap(episodes, Path(out))
    raise ValueError(f"unknown export format {fmt!r} (lerobot, mcap)")


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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        result = export(args.run, args.format, args.out, demos=args.demos, evals=not args.no_eval)
    except (FileNotFoundError, ValueError, ImportError) as exc:
        log.error("%s", exc)
        return 2
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
