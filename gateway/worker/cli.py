"""``loopgate worker`` / ``python -m gateway.worker``: an env worker from the command line."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from typing import Any

from gateway import lifeline
from gateway.services import freeze_heap
from gateway.transport import CurveKeys
from gateway.worker.core import EXIT_CONFIG, EnvWorker, FatalWorkerError

log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loopgate worker",
        description="Host a batch of envs and stream them through a gateway.",
        epilog="example: loopgate worker --connect tcp://127.0.0.1:5555 --backend mujoco_reach --num-envs 4\n"
        "         loopgate worker --config runs/x/config.yaml --endpoints runs/x/endpoints.json --index 0",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", help="experiment config (YAML); its env block chooses the backend")
    p.add_argument("--endpoints", help="endpoints.json of a run (gives the gateway address)")
    p.add_argument("--connect", help="gateway worker address, e.g. tcp://127.0.0.1:5555")
    p.add_argument("--backend", help="episode backend name (overrides the config)")
    p.add_argument("--num-envs", type=int, help="envs in this worker (overrides the config)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="backend option")
    p.add_argument(
        "--index", type=int, default=0, help="worker index (seeds env i with seed + 1000*index + i)"
    )
    p.add_argument("--seed", type=int, help="base seed (overrides the config)")
    p.add_argument("--max-steps", type=int, help="stop after this many env steps")
    p.add_argument(
        "--write-spec",
        metavar="PATH",
        help="write the backend's env spec (JSON) to PATH and exit: how `loopgate up` reads the spec "
        "of a backend in another interpreter (env.python)",
    )
    p.add_argument("--curve-keys", help="folder made by `loopgate keys`")
    p.add_argument(
        "--shared-memory",
        choices=("auto", "on", "off"),
        help="large batches through shared memory (default: gateway.shared_memory, auto = local gateway)",
    )
    p.add_argument(
        "--local-link",
        choices=("auto", "off"),
        help="a gateway on this host over a unix socket (default: gateway.local_link, auto = local gateway)",
    )
    p.add_argument(
        "--cuda-ipc",
        choices=("auto", "on", "off"),
        help="observations on a GPU also as CUDA IPC handles (default: gateway.cuda_ipc, auto = local gateway)",
    )
    p.add_argument("--log-level", default="INFO")
    return p


def main(argv: list[str] | None = None) -> int:
    import json

    import yaml

    from gateway.config import ConfigError, load_config
    from gateway.factory import make_backend

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    lifeline.arm()
    shared_memory = args.shared_memory or "auto"
    cuda = args.cuda_ipc or "auto"
    link = args.local_link or "auto"
    backend_name, num_envs, seed, options, heartbeat, timeout, curve = (
        "mujoco_reach",
        1,
        0,
        {},
        1.0,
        5.0,
        args.curve_keys,
    )
    try:
        if args.config:
            cfg = load_config(args.config)
            backend_name, num_envs, seed, options = (
                cfg.env.backend,
                cfg.env.num_envs,
                cfg.env.seed,
                dict(cfg.env.options),
            )
            heartbeat, timeout = cfg.gateway.heartbeat_s, cfg.gateway.worker_timeout_s
            curve = curve or cfg.gateway.curve_keys
            shared_memory = args.shared_memory or cfg.gateway.shared_memory
            cuda = args.cuda_ipc or cfg.gateway.cuda_ipc
            link = args.local_link or cfg.gateway.local_link
        for text in args.option:
            key, _, value = text.partition("=")
            options[key] = yaml.safe_load(value)
        backend_name = args.backend or backend_name
        num_envs = args.num_envs or num_envs
        seed = args.seed if args.seed is not None else seed
        if args.write_spec:
            from gateway.factory import experiment_spec

            spec = experiment_spec(backend_name, options)
            with open(args.write_spec, "w") as f:
                json.dump(spec.to_dict(), f)
            return 0
        address, tap = args.connect, None
        if args.endpoints:
            with open(args.endpoints) as f:
                endpoints = json.load(f)
            address = address or endpoints["gateway"]["workers"]
            taps = endpoints.get("taps") or []
            tap = taps[args.index] if args.index < len(taps) else None
        if address is None:
            raise ConfigError("give --connect ADDRESS or --endpoints FILE")
        backend = make_backend(
            backend_name, num_envs=num_envs, seed=seed + 1000 * args.index, options=options
        )
    except (ConfigError, ValueError) as exc:
        log.error("%s", exc)
        return EXIT_CONFIG
    worker = EnvWorker(
        backend,
        address,
        seed=seed + 1000 * args.index,
        heartbeat_s=heartbeat,
        gateway_timeout_s=max(timeout, 3 * heartbeat),
        keys=CurveKeys.load(curve) if curve else None,
        tap_address=tap,
        shared_memory=shared_memory,
        cuda_ipc=cuda,
        local_link=link,
        endpoints=args.endpoints if args.connect is None else None,
    )

    def _stop(signum: int, frame: Any) -> None:
        worker.stop_event.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    log.info(
        "worker %s: %d x %s on Python %s (%s)",
        worker.uid,
        num_envs,
        backend_name,
        sys.version.split()[0],
        sys.executable,
    )
    try:
        freeze_heap()
        worker.run(max_steps=args.max_steps)
    except FatalWorkerError as exc:
        log.error("%s", exc)
        return EXIT_CONFIG
    finally:
        backend.close()
    log.info(
        "worker %s stopped after %d env steps (%d acknowledged)",
        worker.uid,
        worker.env_steps,
        worker.acked_steps,
    )
    return 0
