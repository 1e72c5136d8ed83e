"""``loopgate keys DIR``: make CURVE key pairs for binding beyond loopback.

    loopgate keys ~/.loopgate/keys
    # then in the config:  gateway: {host: 0.0.0.0, curve_keys: ~/.loopgate/keys}

Copy the folder to every machine of the experiment; keep the ``*.key_secret`` files
private. Peers whose public key is not in ``authorized/`` are refused.
"""

from __future__ import annotations

import argparse
import logging
import sys

from gateway.transport import make_keys

log = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="loopgate keys",
        description="Make CURVE server and client key pairs.",
        epilog="example: loopgate keys ~/.loopgate/keys",
    )
    p.add_argument("directory", help="folder to create the keys in")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(message)s")
    try:
        d = make_keys(args.directory)
    except FileExistsError as exc:
        log.error("%s", exc)
        return 2
    log.info("wrote server and client key pairs to %s; set gateway.curve_keys: %s", d, d)
    return 0


if __name__ == "__main__":
    sys.exit(main())
