"""``python -m inference`` / ``loopgate inference``: one inference server's process.

    loopgate inference --config configs/reach_sim.yaml --run-dir runs/inf

Builds the server (:class:`inference.server.InferenceServer`) from the config and the run
folder, serves until SIGTERM or Ctrl-C, and exits 1 if serving failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import signal
import sys
from pathlib import Path
from typing import Any

import zmq

from gateway import lifeline
from gateway.config import ConfigError
from gateway.endpoints import read as read_endpoints
from gateway.endpoints import write as write_endpoints
from gateway.episode import EnvSpec
from gateway.metrics import MetricsWriter
from gateway.priority import go_realtime
from gateway.services import freeze_heap
from gateway.transport import CurveKeys
from inference.config import InferenceConfig
from inference.server import SWITCH_INTERVAL_S, InferenceServer
from inference.weights import WeightsError
from networks.config import network_problems

log = logging.getLogger("inference.server")  # the server's own log, as before


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loopgate inference",
        description="Run one inference server: batched policy serving with versioned, hot-swapped weights.",
        epilog="example: loopgate inference --config configs/reach_sim.yaml --run-dir runs/inf "
        "--set inference.backend=torch\n"
        "         (its addresses are written to runs/inf/endpoints.json under 'inference')",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", required=True, help="experiment config (YAML); its inference block is used")
    p.add_argument("--run-dir", required=True, help="run folder (endpoints.json, metrics.jsonl)")
    p.add_argument("--index", type=int, default=0, help="replica number (its entry in endpoints.json)")
    p.add_argument(
        "--endpoints", help="endpoints.json to read addresses from (default: RUN_DIR/endpoints.json)"
    )
    p.add_argument(
        "--spec", help="spec.json: the experiment's env spec (default: computed from the env block)"
    )
    p.add_argument("--set", action="append", default=[], metavar="BLOCK.KEY=VALUE", help="config override")
    p.add_argument("--log-level", default="INFO")
    return p


def build_server(args: argparse.Namespace) -> InferenceServer:
    from gateway.config import load_config
    from gateway.factory import experiment_spec
    from inference.services import replica_addresses

    cfg = load_config(args.config, args.set)
    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    spec_path = Path(args.spec) if args.spec else run_dir / "spec.json"
    if spec_path.exists():
        spec = EnvSpec.from_dict(json.loads(spec_path.read_text()))
    else:
        spec = experiment_spec(cfg.env.backend, dict(cfg.env.options))
    icfg: InferenceConfig = cfg.inference
    problems = network_problems(spec, icfg.network)
    if problems:
        raise ConfigError("inference.network does not fit the env spec: " + "; ".join(problems))
    icfg.check_weights_file()
    endpoints_path = Path(args.endpoints) if args.endpoints else run_dir / "endpoints.json"
    endpoints: dict[str, Any] = read_endpoints(endpoints_path)
    planned = endpoints.get("inference") or []
    addresses = (
        planned[args.index]
        if args.index < len(planned)
        else replica_addresses(cfg, run_dir, args.index, bind=True)
    )
    keys = CurveKeys.load(cfg.gateway.curve_keys) if cfg.gateway.curve_keys else None
    server = InferenceServer(
        config=icfg,
        spec=spec,
        addresses=addresses,
        index=args.index,
        keys=keys,
        metrics=MetricsWriter(run_dir / "metrics.jsonl", f"inference-{args.index}"),
        limits=cfg.gateway.limits,
        realtime_priority=cfg.run.realtime_priority,
    )
    if args.index >= len(planned):  # standalone: tell clients where this replica is
        fresh = read_endpoints(endpoints_path)
        entries = fresh.setdefault("inference", [])
        entries.extend({} for _ in range(args.index + 1 - len(entries)))
        entries[args.index] = server.addresses
        write_endpoints(endpoints_path, fresh)  # whole, never half-written, for its readers
    return server


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    lifeline.arm()
    # While the loader builds a version, a short switch interval keeps the socket
    # thread from waiting 5 ms for the interpreter lock between two batches.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        server = build_server(args)
    except (ConfigError, ValueError, WeightsError, OSError) as exc:
        log.error("cannot start: %s", exc)
        return 2

    def _stop(signum: int, frame: Any) -> None:
        server.stopping.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        freeze_heap()
        # Every thread, and threads started later inherit it; the weights loader then
        # leaves real-time scheduling for its long builds (InferenceServer._load_loop), and
        # the weights socket's context steps below for its transfers (weights_below_serving).
        # ZeroMQ's I/O thread at the serving loop's own priority: a batch's answers leave
        # together once the loop waits for the next requests, rather than the I/O thread
        # taking the core back at every answer (16 single-row clients, alternating runs:
        # 7 900-9 400 rows/s against 5 700-7 900 with the I/O thread one priority above).
        go_realtime(server.realtime_priority, f"inference-{server.index}", every_thread=True, io_above=False)
        server.weights_below_serving()
        server.serve()
    finally:
        with contextlib.suppress(zmq.ZMQError):
            server.close()
    return 1 if server.failure is not None else 0


if __name__ == "__main__":
    sys.exit(main())
