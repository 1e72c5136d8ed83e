"""A run's ``endpoints.json``: where every service of the run binds, read by its peers.

``loopgate up`` writes it before anything starts; a service restarted in place binds the
same addresses again, so its peers' sockets simply reconnect. Under the Ray engine a
restarted service may land on another node, with another IP: the driver then writes the
new address into ``endpoints.json`` (:func:`write`, atomic) before the process starts,
and every running peer follows the file, re-pointing the sockets whose address changed::

    follower = EndpointsFollower(run_dir / "endpoints.json")
    ...
    moved = follower.poll()          # in the peer's loop: None, or the new endpoints
    if moved is not None:
        sink.follow(moved)           # reconnects to replay.ingest if it changed

The gateway follows it for its inference servers and the replay service, the trainer for
the replay service, the inference servers and the gateway, an env worker for the gateway
(when it reconnects), ``loopgate up`` for the gateway. The file is read whole every
``interval_s`` (not its modification time, which network file systems cache: opening a
file gets its current content under NFS's close-to-open consistency).
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

FOLLOW_INTERVAL_S = 1.0
"""How often a peer reads ``endpoints.json`` again: a moved service is found within about
this long after the driver wrote its new address (well before it has started)."""


def run_ended(run_dir: Path) -> bool:
    """Whether the run in ``run_dir`` has ended: ``loopgate up`` writes ``endpoints.json``
    as it starts and ``summary.json`` as it ends, so a summary written after the last
    start means no ``loopgate up`` serves it."""
    endpoints, summary = run_dir / "endpoints.json", run_dir / "summary.json"
    return summary.exists() and summary.stat().st_mtime >= endpoints.stat().st_mtime


def read(path: str | Path) -> dict[str, Any]:
    """The endpoints in ``path``; ``{}`` if there is no such file."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return {}
    data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object of endpoints, got {type(data).__name__}")
    return data


def write(path: str | Path, endpoints: dict[str, Any]) -> None:
    """Replace ``path`` with ``endpoints`` at once: a peer reading it meanwhile sees the old
    content or the new, never half of it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.new")
    tmp.write_text(json.dumps(endpoints, indent=2))
    os.replace(tmp, path)


def lookup(endpoints: dict[str, Any], *keys: str | int) -> str | None:
    """``endpoints[k0][k1]...`` if that is an address (a string), else ``None``:
    ``lookup(e, "replay", "ingest")``, ``lookup(e, "inference", 0, "requests")``."""
    node: Any = endpoints
    for key in keys:
        if isinstance(key, int):
            if not isinstance(node, list) or key >= len(node):
                return None
        elif not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node if isinstance(node, str) else None


def follow_all(endpoints: dict[str, Any], *parts: Any) -> list[str]:
    """Hand new ``endpoints`` to every part that dials a peer (an action source, a sink):
    those with a ``follow(endpoints) -> list[str]`` method re-point what moved; the moves."""
    moved: list[str] = []
    for part in parts:
        follow = getattr(part, "follow", None)
        if follow is not None:
            moved.extend(follow(endpoints))
    return moved


ADDRESS = re.compile(r"^(tcp|http)://([^:/]+):(\d+)(.*)$")
"""A TCP address (``tcp://host:port`` or a metrics ``http://host:port/metrics``): scheme,
host, port and the rest."""


def rewrite(
    endpoints: dict[str, Any], service: str, change: Callable[[str, str, int], tuple[str, int]]
) -> bool:
    """Change the addresses ``service`` binds (the gateway's, the replay service's, an
    ``inference-N``'s, and its metrics address): ``change(scheme, host, port)`` gives each
    TCP address its new host and port. Whether any changed; other services bind nothing."""
    slots: list[tuple[dict[str, Any], str]] = []
    if service in ("gateway", "replay") and isinstance(endpoints.get(service), dict):
        slots.extend((endpoints[service], key) for key in endpoints[service])
    match = re.fullmatch(r"inference-(\d+)", service)
    replicas = endpoints.get("inference", [])
    if match and int(match.group(1)) < len(replicas) and isinstance(replicas[int(match.group(1))], dict):
        entry = replicas[int(match.group(1))]
        slots.extend((entry, key) for key in entry)
    metrics = endpoints.get("metrics", {})
    if isinstance(metrics, dict) and service in metrics:
        slots.append((metrics, service))
    changed = False
    for entry, key in slots:
        value = entry[key]
        parts = ADDRESS.match(value) if isinstance(value, str) else None  # not e.g. a slot's flag
        if parts is None:
            continue
        scheme, host, port, rest = parts.groups()
        new_host, new_port = change(scheme, host, int(port))
        new = f"{scheme}://{new_host}:{new_port}{rest}"
        changed |= new != value
        entry[key] = new
    return changed


class EndpointsFollower:
    """Reads a run's ``endpoints.json`` again now and then; hands back what changed."""

    def __init__(self, path: str | Path, interval_s: float = FOLLOW_INTERVAL_S) -> None:
        self.path = Path(path)
        self.interval_s = interval_s
        self._text = self._read_text()
        self._next = time.monotonic() + interval_s
        self._bad_logged = False
        self.changes = 0
        """How many times the file's content changed while followed."""

    def _read_text(self) -> str | None:
        try:
            return self.path.read_text()
        except FileNotFoundError:
            return None

    def poll(self, force: bool = False) -> dict[str, Any] | None:
        """The endpoints if the file changed since the last poll (read at most every
        ``interval_s`` unless ``force``), else ``None``."""
        now = time.monotonic()
        if not force and now < self._next:
            return None
        self._next = now + self.interval_s
        text = self._read_text()
        if text is None or text == self._text:
            return None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            # Written by something other than write() (a person's editor): keep the old
            # addresses until it is whole again.
            if not self._bad_logged:
                log.error("%s does not parse (%s); keeping the addresses read before", self.path, exc)
                self._bad_logged = True
            return None
        if not isinstance(data, dict):
            if not self._bad_logged:
                log.error("%s is not a JSON object; keeping the addresses read before", self.path)
                self._bad_logged = True
            return None
        self._text, self._bad_logged = text, False
        self.changes += 1
        return data


__all__ = [
    "ADDRESS",
    "FOLLOW_INTERVAL_S",
    "EndpointsFollower",
    "follow_all",
    "lookup",
    "read",
    "rewrite",
    "write",
]
