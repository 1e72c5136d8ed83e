"""Engines: who places, starts and watches the services of a run.

``loopgate up`` plans the same services whatever the engine (:data:`gateway.registry.PLANS`);
the engine decides where each one's process runs::

    engine = open_engine(cfg)             # run.engine: local (default) or ray
    launcher = engine.launcher(cfg, run)  # None: the supervisor's own child processes
    ...
    engine.close()

- ``local`` (:mod:`gateway.engines.local`): every service is a child process of ``loopgate
  up`` on this machine, exactly as the supervisor has always started them.
- ``ray`` (:mod:`gateway.engines.ray_engine`): every service is a Ray actor that runs the
  service's command as its own child process on the node Ray placed it on (resources and
  node constraints from ``run.placement``); the trainer's ranks share one placement group.
  Ray is imported only when this engine is selected (``pip install -e '.[ray]'``).

Engines are looked up by name in :data:`ENGINES` and imported on use, like every backend.
"""

from __future__ import annotations

from typing import Any, Protocol

from gateway.config import ConfigError, ExperimentConfig
from gateway.registry import missing_package, resolve

ENGINES: dict[str, str] = {
    "local": "gateway.engines.local:LocalEngine",
    "ray": "gateway.engines.ray_engine:RayEngine",
}
"""Engines by the name ``run.engine`` uses."""


class Engine(Protocol):
    """What ``loopgate up`` needs from an engine."""

    name: str

    def launcher(self, cfg: ExperimentConfig, run: Any) -> Any:
        """What starts each service's process (``start``/``end_session``), or ``None`` for the
        supervisor's own child processes."""

    def close(self) -> None:
        """Release the engine (disconnect from a cluster); services are stopped already."""


def open_engine(cfg: ExperimentConfig) -> Engine:
    """The engine ``run.engine`` names, connected and ready to start services.

    Raises :class:`ConfigError` when it cannot be used (Ray not installed, no cluster at
    ``run.ray_address``, a cluster that does not fit the config)."""
    try:
        cls = resolve(ENGINES, cfg.run.engine, "engine")
    except ImportError as exc:
        raise ConfigError(f"run.engine {cfg.run.engine!r}: {missing_package(exc)}") from exc
    return cls(cfg)  # type: ignore[no-any-return]
