"""Env workers in the simulator's own interpreter (``env.python``).

Isaac Sim brings its own Python (6.x: 3.12, 5.x: 3.11) and mjlab pins a MuJoCo the
gateway's venv cannot share, so their workers run from another venv::

    env:
      backend: mjlab
      python: .venv-mjlab/bin/python

That venv needs loopgate with the ``worker`` extra only (numpy, pyzmq, msgpack, PyYAML:
``pip install -e '/path/to/loopgate[worker]'``) and the simulator. ``loopgate up`` checks
the interpreter before anything starts (:func:`check_interpreter`: it exists, imports
loopgate's worker and speaks this wire protocol), reads the env spec there
(:func:`foreign_spec`: the backend is importable only in that venv) and starts every
worker with it (:func:`gateway.services.plan_workers`).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from gateway.episode import EnvSpec
from gateway.factory import ConfigError
from gateway.protocol.messages import PROTOCOL_VERSION

log = logging.getLogger(__name__)

WORKER_INSTALL = "pip install -e '/path/to/loopgate[worker]' with that interpreter"
"""How to make an interpreter able to run loopgate's env workers."""

_PROBE = (
    "import json, sys, gateway, gateway.worker\n"
    "from gateway.protocol.messages import PROTOCOL_VERSION\n"
    "print(json.dumps({'python': '%d.%d.%d' % sys.version_info[:3], 'loopgate': gateway.__version__,"
    " 'protocol': PROTOCOL_VERSION}))\n"
)


def interpreter(python: str) -> str:
    """``env.python`` as an absolute path (relative to the working directory; symlinks kept:
    a venv's ``bin/python`` is a link to the base interpreter, and resolving it leaves the venv)."""
    return os.path.abspath(os.path.expanduser(python))


def _tail(text: str, lines: int = 3) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])


def check_interpreter(python: str, timeout_s: float = 60.0) -> dict[str, Any]:
    """Raise :class:`ConfigError` unless ``python`` can run this loopgate's env workers; its versions."""
    path = interpreter(python)
    if not os.path.isfile(path):
        hint = " (`make install` creates .venv-mjlab)" if ".venv-mjlab" in path else ""
        raise ConfigError(f"env.python: {path} does not exist{hint}")
    if not os.access(path, os.X_OK):
        raise ConfigError(f"env.python: {path} is not executable")
    log.info("checking the worker interpreter %s", path)
    try:
        out = subprocess.run(
            [path, "-c", _PROBE], capture_output=True, text=True, timeout=timeout_s, cwd=tempfile.gettempdir()
        )
    except subprocess.TimeoutExpired:
        raise ConfigError(
            f"env.python: {path} did not import loopgate's worker within {timeout_s:.0f} s"
        ) from None
    except OSError as exc:
        raise ConfigError(f"env.python: {path} cannot be run: {exc}") from None
    if out.returncode != 0:
        raise ConfigError(
            f"env.python: {path} cannot import loopgate's worker ({_tail(out.stderr)}); {WORKER_INSTALL}"
        )
    try:
        facts: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise ConfigError(f"env.python: {path} answered the probe with {out.stdout!r}") from None
    if facts.get("protocol") != PROTOCOL_VERSION:
        raise ConfigError(
            f"env.python: {path} has loopgate {facts.get('loopgate')} speaking wire protocol "
            f"{facts.get('protocol')}, this gateway speaks {PROTOCOL_VERSION}: install this checkout there "
            f"({WORKER_INSTALL})"
        )
    return facts


def foreign_spec(python: str, backend: str, options: dict[str, Any], timeout_s: float = 600.0) -> EnvSpec:
    """The env spec of ``backend`` built by ``python`` (``gateway.worker --write-spec``).

    Building the backend imports the simulator (mjlab: seconds; Isaac Sim starts once: a
    minute or more, several on its very first start while it fills its caches); errors come
    back as the worker wrote them, as a :class:`ConfigError`.
    """
    path = interpreter(python)
    with tempfile.TemporaryDirectory(prefix="loopgate-spec-") as tmp:
        target = Path(tmp) / "spec.json"
        argv = [path, "-m", "gateway.worker", "--backend", backend, "--write-spec", str(target)]
        for key, value in options.items():
            argv += ["--option", f"{key}={json.dumps(value)}"]
        log.info(
            "reading the env spec of %r in %s (this imports the simulator; waiting up to %.0f s)",
            backend,
            path,
            timeout_s,
        )
        started = time.monotonic()
        try:
            out = subprocess.run(
                argv, capture_output=True, text=True, timeout=timeout_s, cwd=tempfile.gettempdir()
            )
        except subprocess.TimeoutExpired:
            raise ConfigError(
                f"env.python: building {backend!r} in {path} to read its spec took over {timeout_s:.0f} s"
            ) from None
        if out.returncode != 0 or not target.is_file():
            raise ConfigError(
                f"env.backend {backend!r} cannot be built by {path}: {_tail(out.stderr) or 'no output'}"
            )
        log.info("env spec of %r read in %.1f s", backend, time.monotonic() - started)
        try:
            return EnvSpec.from_dict(json.loads(target.read_text()))
        except ValueError as exc:
            raise ConfigError(f"env.python: {path} wrote a bad env spec: {exc}") from None
