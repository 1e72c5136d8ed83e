"""``python -m trainer`` / ``torchrun -m trainer`` / ``loopgate train``: the FSDP trainer.

    loopgate train --config runs/x/config.yaml --run-dir runs/x
    torchrun --standalone --nproc_per_node=2 -m trainer --config runs/x/config.yaml --run-dir runs/x

Reads the run's ``spec.json`` and ``endpoints.json`` (replay service, inference
servers, gateway), resumes from the newest checkpoint in ``<run>/checkpoints`` if there
is one, and exits 0 when training is done (``loopgate up`` then runs the final
evaluation). Under ``torchrun`` (one or many processes, one or many nodes) every
process is one FSDP rank; alone it is a group of one.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import logging
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway import lifeline

if TYPE_CHECKING:  # imported lazily below, so that --help stays fast
    from gateway.config import ExperimentConfig
    from trainer.distributed import World
    from trainer.loop import Trainer

log = logging.getLogger("trainer")


def _die_with_parent() -> None:
    """Under torchrun: if the launcher is killed, take this rank down with it (Linux)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loopgate train",
        description="Train a policy from the replay service and publish it to the inference servers.",
        epilog="example: loopgate train --config runs/x/config.yaml --run-dir runs/x\n"
        "         torchrun --standalone --nproc_per_node=2 -m trainer --config runs/x/config.yaml --run-dir runs/x",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", required=True, help="experiment config (YAML)")
    p.add_argument("--run-dir", required=True, help="run folder (spec.json, endpoints.json, checkpoints/)")
    p.add_argument("--endpoints", help="endpoints.json (default: <run-dir>/endpoints.json)")
    p.add_argument("--set", action="append", default=[], metavar="BLOCK.KEY=VALUE", help="config override")
    p.add_argument("--log-level", default="INFO")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    lifeline.arm()
    from gateway.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.set)
    except ConfigError as exc:
        log.error("invalid config: %s", exc)
        return 2
    if "LOCAL_RANK" in os.environ:
        _die_with_parent()
    run_dir = Path(args.run_dir)
    endpoints = json.loads(Path(args.endpoints or run_dir / "endpoints.json").read_text())
    from trainer.distributed import init_distributed, shutdown

    world = init_distributed(device=cfg.trainer.device, timeout_s=cfg.trainer.init_timeout_s)
    try:
        return _train(cfg, run_dir, endpoints, world)
    finally:
        shutdown()  # after _train has returned: the trainer and its sharded networks are gone
        # The interpreter's teardown collects garbage again and again as it clears the
        # modules, over all of torch's objects: seconds of exit under the stop's clock.
        # Nothing is left to collect that matters, so the collector leaves them alone.
        gc.freeze()


def _train(cfg: ExperimentConfig, run_dir: Path, endpoints: dict[str, Any], world: World) -> int:
    from trainer.loop import Trainer

    trainer = Trainer(cfg, run_dir, endpoints, world)
    with stop_on_signals(trainer):
        try:
            return trainer.run()
        finally:
            trainer.close()


@contextlib.contextmanager
def stop_on_signals(trainer: Trainer) -> Iterator[None]:
    """SIGTERM and SIGINT ask ``trainer`` to stop at its next check, inside this block.

    The previous handlers come back on leaving it, so nothing refers to the trainer
    afterwards and its sharded networks (and their process group) can be released.
    """

    def _stop(signum: int, frame: Any) -> None:
        trainer.on_signal(signum)

    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
