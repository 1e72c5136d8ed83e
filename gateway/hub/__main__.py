"""``python -m gateway.hub`` / ``loopgate gateway``: the gateway process.

    loopgate gateway --config configs/reach_sim.yaml --run-dir runs/manual
    loopgate worker --endpoints runs/manual/endpoints.json

Builds the gateway from the config and the run folder (:mod:`gateway.hub.assembly`),
serves until SIGTERM or Ctrl-C, then delivers what it recorded to the sink
(``gateway.stop_drain_s``) before it exits.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from typing import Any

import zmq

from gateway import lifeline
from gateway.config import ConfigError
from gateway.hub.assembly import build_gateway
from gateway.hub.core import TICK_S, Gateway
from gateway.locks import Locked
from gateway.priority import go_realtime
from gateway.services import freeze_heap

log = logging.getLogger("gateway.hub")


def drain_on_exit(gateway: Gateway, timeout_s: float) -> None:
    """A stop nobody drained first (a signal from a launch file or a shell): close the
    open episodes as interrupted and give the sink ``timeout_s`` to store everything;
    what it has not stored by then stays in the spool for the next start."""
    if not gateway.state.draining:
        gateway.begin_drain()
    if gateway.fully_stored():
        return
    log.info(
        "stopping: waiting up to %.0f s for the sink to store %d chunk(s)",
        timeout_s,
        gateway.recorder.unacked_chunks,
    )
    poller = zmq.Poller()
    for sock in gateway.recorder.sink.sockets():
        poller.register(sock, zmq.POLLIN)
    deadline = time.monotonic() + timeout_s
    while gateway.recorder.unacked_chunks and time.monotonic() < deadline:
        poller.poll(int(TICK_S * 1000))
        gateway.recorder.pump()
        gateway.recorder.sink.tick()
    if gateway.recorder.unacked_chunks:
        log.warning(
            "%d step(s) not stored by the sink stay in the spool, delivered on the next start",
            gateway.recorder.undelivered_steps(),
        )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loopgate gateway",
        description="Run the gateway: env workers in, actions out, trajectories recorded.",
        epilog="example: loopgate gateway --config configs/reach_sim.yaml --run-dir runs/manual\n"
        "         (then: loopgate worker --endpoints runs/manual/endpoints.json)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", required=True, help="experiment config (YAML)")
    p.add_argument("--run-dir", required=True, help="run folder (spool, episodes, metrics)")
    p.add_argument("--endpoints", help="endpoints.json to read addresses from (written if absent)")
    p.add_argument("--spec", help="spec.json: the experiment's env spec (default: the first worker's)")
    p.add_argument("--set", action="append", default=[], metavar="BLOCK.KEY=VALUE", help="config override")
    p.add_argument("--max-env-steps", type=int, help="stop giving actions after this many recorded steps")
    p.add_argument("--log-level", default="INFO")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    lifeline.arm()
    try:
        gateway = build_gateway(args)
    except (ConfigError, ValueError, OSError, Locked) as exc:
        log.error("%s", exc)
        return 2
    stopping = {"n": 0}

    def _stop(signum: int, frame: Any) -> None:
        stopping["n"] += 1
        gateway.state.stopping = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        freeze_heap()
        # Every thread, before the loop starts its control line (which inherits it).
        go_realtime(gateway.realtime_priority, "gateway", every_thread=True)
        gateway.run()
        drain_on_exit(gateway, gateway.config.stop_drain_s)
        gateway.emit_metrics()  # the final counts, however short the run
    finally:
        gateway.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
