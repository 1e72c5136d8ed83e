"""Who may use the console: hashed tokens, roles, sessions and the Origin check.

Tokens are never kept in plain text: the config holds PBKDF2 hashes (make one with
``loopgate console --hash-token``), and the operator token from the environment
(``LOOPGATE_CONSOLE_TOKEN``) is hashed when the console starts::

    hashed = hash_token("s3cret")            # "pbkdf2_sha256$100000$<salt>$<digest>"
    verify_token("s3cret", hashed)           # True
    sessions = Sessions(ttl_s=3600)
    sid = sessions.create("operator")
    sessions.role(sid)                       # "operator"
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

Role = Literal["viewer", "operator"]
ROLES: tuple[Role, ...] = ("viewer", "operator")

ITERATIONS = 100_000
"""PBKDF2 rounds: about 0.1 s per login on these CPUs, slow enough for guessing."""
SCHEME = "pbkdf2_sha256"


def hash_token(token: str, *, salt: bytes | None = None, iterations: int = ITERATIONS) -> str:
    """A token's hash as stored in the config: ``pbkdf2_sha256$<rounds>$<salt hex>$<digest hex>``."""
    if not token:
        raise ValueError("token: must not be empty")
    salt = secrets.token_bytes(16) if salt is None else salt
    digest = hashlib.pbkdf2_hmac("sha256", token.encode(), salt, iterations)
    return f"{SCHEME}${iterations}${salt.hex()}${digest.hex()}"


def check_hash(hashed: str) -> str | None:
    """What is wrong with a stored hash, or None."""
    parts = hashed.split("$")
    if len(parts) != 4 or parts[0] != SCHEME:
        return f"expected {SCHEME}$<rounds>$<salt hex>$<digest hex>"
    if not parts[1].isdigit() or int(parts[1]) < 1000:
        return f"rounds must be an integer >= 1000, got {parts[1]!r}"
    try:
        bytes.fromhex(parts[2])
        bytes.fromhex(parts[3])
    except ValueError:
        return "salt and digest must be hex"
    return None


def verify_token(token: str, hashed: str) -> bool:
    """Whether ``token`` matches ``hashed`` (constant-time comparison)."""
    if check_hash(hashed) is not None:
        return False
    _, rounds, salt, digest = hashed.split("$")
    candidate = hashlib.pbkdf2_hmac("sha256", token.encode(), bytes.fromhex(salt), int(rounds))
    return hmac.compare_digest(candidate.hex(), digest)


@dataclass(frozen=True)
class Credential:
    role: Role
    hashed: str


def authenticate(token: str, credentials: Iterable[Credential]) -> Role | None:
    """The role a token logs in as (the highest that matches), or None."""
    matched = [c.role for c in credentials if verify_token(token, c.hashed)]
    if not matched:
        return None
    return "operator" if "operator" in matched else "viewer"


class Sessions:
    """Logged-in browsers by session id (a random cookie value), each with a role and an expiry."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._sessions: dict[str, tuple[Role, float]] = {}

    def create(self, role: Role) -> str:
        sid = secrets.token_urlsafe(32)
        with self._lock:
            self._sessions[sid] = (role, time.monotonic() + self.ttl_s)
        return sid

    def role(self, sid: str | None) -> Role | None:
        if not sid:
            return None
        with self._lock:
            entry = self._sessions.get(sid)
            if entry is None:
                return None
            if time.monotonic() > entry[1]:
                del self._sessions[sid]
                return None
            return entry[0]

    def end(self, sid: str | None) -> None:
        with self._lock:
            self._sessions.pop(sid or "", None)


def own_origins(host: str, port: int) -> set[str]:
    """The origins the console's own pages have when served on ``host:port``."""
    names = {host}
    if host in ("127.0.0.1", "localhost", "::1"):
        names |= {"127.0.0.1", "localhost"}
    return {f"http://{name}:{port}" for name in names}


def origin_allowed(origin: str | None, allowed: set[str]) -> bool:
    """A WebSocket handshake or a state-changing request must come from the console's own
    pages: browsers always send ``Origin`` there, so a missing one is refused too."""
    return origin is not None and origin.rstrip("/") in allowed
