"""The ``console:`` config block and how ``loopgate up`` starts the console.

Registered in :mod:`gateway.registry` (``CONFIG_BLOCKS["console"]``, ``PLANS["console"]``);
torch-free and FastAPI-free, since every experiment builds every block::

    console:
      enabled: true
      host: 127.0.0.1                 # anything else needs a token
      port: 8080                      # 0: a free port (written to endpoints.json)
      viewer_token_hash: pbkdf2_sha256$100000$...   # loopgate console --hash-token
      operator_token_hash: null       # or LOOPGATE_CONSOLE_TOKEN in the environment

With ``enabled: true`` the plan adds one ``console`` service and writes its URL into the
run's ``endpoints.json`` as ``"console": "http://127.0.0.1:8080"``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from gateway.config import ConfigError, ExperimentConfig
from gateway.console.auth import Credential, check_hash, hash_token
from gateway.services import RunContext, Service, free_port

TOKEN_ENV = "LOOPGATE_CONSOLE_TOKEN"
"""Environment variable holding an operator token (plain; hashed when the console starts)."""

LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True, kw_only=True)
class ConsoleConfig:
    """The web console: where it listens, who may log in, and the teleoperation limits."""

    enabled: bool = False
    """Start the console with ``loopgate up``."""
    host: str = "127.0.0.1"
    """Interface to bind; anything but loopback needs a token configured."""
    port: int = 8080
    """TCP port; 0 picks a free one when the run is planned."""
    operator_token_hash: str | None = None
    """Hash of the operator token (``loopgate console --hash-token``); operators may take over and resume."""
    viewer_token_hash: str | None = None
    """Hash of the viewer token; viewers watch and may press the e-stop."""
    session_ttl_s: float = 12 * 3600.0
    """How long a login lasts."""
    status_interval_s: float = 0.25
    """How often the console asks the gateway for its status."""
    deadman_s: float = 0.5
    """Teleoperation holds (zero action) when no command arrived for this long."""
    stale_command_s: float = 0.3
    """A command older than this on arrival (by its own timestamp) is dropped."""
    max_command_hz: float = 60.0
    """Commands per second one operator may send; the rest are dropped and counted."""
    teleop_scale: float = 0.5
    """Full key deflection as a fraction of the action's bound."""
    release_ramp_s: float = 0.5
    """On Release, the driven env is handed back to the policy over this long, its action
    blended from the held command to the policy's so the arm neither jumps nor lurches
    (0: at once). Only with ``others: policy``: without a policy there is nothing to blend."""
    others: Literal["policy", "hold"] = "policy"
    """While one env of a worker is teleoperated, its other envs: the experiment's policy drives them, or they hold."""
    mark_success_reward: float | None = None
    """Reward given to a step an operator marks successful while recording (None: keep the env's)."""

    def __post_init__(self) -> None:
        if not self.host:
            raise ConfigError("console.host must not be empty")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"console.port must be in 0..65535, got {self.port}")
        for name in ("operator_token_hash", "viewer_token_hash"):
            value = getattr(self, name)
            if value is not None and (problem := check_hash(value)):
                raise ConfigError(f"console.{name}: {problem}")
        for name in ("session_ttl_s", "status_interval_s", "deadman_s", "stale_command_s", "max_command_hz"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"console.{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.release_ramp_s <= 10:
            raise ConfigError(f"console.release_ramp_s must be in 0..10 s, got {self.release_ramp_s}")
        if not 0 < self.teleop_scale <= 1:
            raise ConfigError(f"console.teleop_scale must be in (0, 1], got {self.teleop_scale}")

    def credentials(self, environ: dict[str, str] | None = None) -> list[Credential]:
        """Who may log in: the configured hashes and the operator token from the environment."""
        env = os.environ if environ is None else environ
        creds = []
        if self.operator_token_hash:
            creds.append(Credential("operator", self.operator_token_hash))
        if self.viewer_token_hash:
            creds.append(Credential("viewer", self.viewer_token_hash))
        if env.get(TOKEN_ENV):
            creds.append(Credential("operator", hash_token(env[TOKEN_ENV])))
        return creds

    def check_exposure(self, environ: dict[str, str] | None = None) -> None:
        """Refuse to listen beyond loopback without a token."""
        env = os.environ if environ is None else environ
        has_token = self.operator_token_hash or self.viewer_token_hash or env.get(TOKEN_ENV)
        if self.host not in LOOPBACK and not self.host.startswith("127.") and not has_token:
            raise ConfigError(
                f"console.host is {self.host!r} but no token is configured: set console.operator_token_hash "
                f"(loopgate console --hash-token) or {TOKEN_ENV}, or bind 127.0.0.1"
            )


def console_url(host: str, port: int) -> str:
    return f"http://{host}:{port}"


def plan_console(cfg: ExperimentConfig, run: RunContext) -> list[Service]:
    """One ``console`` service when ``console.enabled``; its URL into ``run.endpoints``."""
    c: ConsoleConfig = cfg.console
    if not c.enabled:
        return []
    c.check_exposure()
    port = c.port or free_port(c.host if c.host != "0.0.0.0" else "127.0.0.1")
    run.endpoints["console"] = console_url(c.host, port)
    argv = run.module(
        "gateway.console",
        "--config",
        str(run.config_path),
        "--run-dir",
        str(run.run_dir),
        "--port",
        str(port),
    )
    # After the gateway and the workers: it only watches them. Not required: a console
    # that cannot start must not end an experiment.
    return [Service(name="console", argv=argv, order=60, required=False)]
