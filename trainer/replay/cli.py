"""``loopgate replay``: run the replay service, or import demonstrations into a run.

::

    loopgate replay --config runs/x/config.yaml --run-dir runs/x      # the service
    loopgate replay import runs/teleop-1 --table demos --run-dir runs/x

``import`` copies every non-evaluation episode of an earlier run folder (its replay log,
or its local episode store) into the replay log of ``--run-dir`` as demonstrations, for
the tables with ``source: demos``. Importing the same run twice stores it once. When
the run's replay service is up, the import goes through it (its tables fill at once);
otherwise it is written to the log and the tables get it at the next start.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from gateway import lifeline

log = logging.getLogger(__name__)

SERVE_EXAMPLE = (
    "example: loopgate replay --config configs/reach_sim.yaml --run-dir runs/manual --set replay.enabled=true"
)
IMPORT_EXAMPLE = "example: loopgate replay import runs/teleop-20261130 --table demos --run-dir runs/manual"


def build_serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loopgate replay",
        description="Run the replay service: durable ingest from the gateway, tables, sampling. "
        "`loopgate replay import --help` imports demonstrations.",
        epilog=SERVE_EXAMPLE + "\n         " + IMPORT_EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", required=True, help="experiment config (YAML) with a replay: block")
    p.add_argument("--run-dir", required=True, help="run folder (durable data under <run>/replay)")
    p.add_argument("--set", action="append", default=[], metavar="BLOCK.KEY=VALUE", help="config override")
    p.add_argument(
        "--run-trainer-only",
        action="store_true",
        help="only the run's own trainer samples (as under `loopgate up`): tables it does not "
        "sample get no samples-per-insert ratio, which would wait for a sampler that never comes",
    )
    p.add_argument("--log-level", default="INFO")
    return p


def build_import_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loopgate replay import",
        description="Import an earlier run's episodes as demonstrations into a run's replay log.",
        epilog=IMPORT_EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("source", help="run folder to import from (replay/log or episodes/)")
    p.add_argument("--run-dir", required=True, help="run folder of the replay service to import into")
    p.add_argument("--table", default="demos", help="a table with source: demos in the run's config")
    p.add_argument("--config", help="config (default: <run-dir>/config.yaml)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for a running service")
    p.add_argument("--log-level", default="INFO")
    return p


def run_import(args: argparse.Namespace) -> int:
    from gateway.config import ConfigError, load_config
    from gateway.protocol import Message, MsgType, RemoteError, Timeout, raise_for_error
    from gateway.transport import recv_within

    run_dir = Path(args.run_dir)
    config = Path(args.config) if args.config else run_dir / "config.yaml"
    try:
        cfg = load_config(config)
        table = cfg.replay.table(args.table)
    except (ConfigError, KeyError) as exc:
        log.error("%s", exc.args[0] if isinstance(exc, KeyError) else exc)  # a KeyError's str() quotes it
        return 2
    if table.source != "demos":
        log.error(
            "replay table %r has source %r; import into a table with source: demos", table.name, table.source
        )
        return 2
    if not Path(args.source).is_dir():
        log.error("%s is not a run folder", args.source)
        return 2
    from trainer.replay.service import Locked, lock_dir, open_log

    try:
        fd = lock_dir(run_dir / "replay")
    except Locked:
        fd = None
    if fd is None:  # the service runs: ask it
        import zmq

        endpoints = json.loads((run_dir / "endpoints.json").read_text())
        sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
        sock.linger = 0
        try:
            sock.connect(endpoints["replay"]["control"])
            from gateway.protocol import send

            send(
                sock,
                Message(
                    MsgType.COMMAND, seq=1, meta={"cmd": "import", "path": str(Path(args.source).resolve())}
                ),
            )
            result: dict[str, Any] = raise_for_error(recv_within(sock, args.timeout)).meta
        except (Timeout, RemoteError, KeyError) as exc:
            log.error("import through the running replay service failed: %s", exc)
            return 1
        finally:
            sock.close(linger=0)
    else:
        import os

        from trainer.replay.ingest import import_into

        replay_log = open_log(cfg.replay, run_dir)
        try:
            result = import_into(replay_log, args.source, lambda chunk: None)
        finally:
            replay_log.close()
            os.close(fd)
    if "error" in result:
        log.error("import failed: %s", result["error"])
        return 1
    print(json.dumps(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    importing = bool(args_list) and args_list[0] == "import"
    parser = build_import_parser() if importing else build_serve_parser()
    args = parser.parse_args(args_list[1:] if importing else args_list)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    lifeline.arm()
    if importing:
        return run_import(args)
    from trainer.replay.service import serve

    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
