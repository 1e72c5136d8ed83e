"""How ``loopgate up`` runs inference servers: the plan, the preflight check, the summary.

Registered in :mod:`gateway.registry` under the ``inference`` block:

- ``PLANS["inference"]`` -> :func:`plan`: one ``inference-<i>`` service per replica
  (``python -m inference --index i``), started before the gateway, and the
  addresses in ``endpoints.json``, written before anything starts::

      "inference": [
        {"requests": "tcp://127.0.0.1:41001", "weights": "tcp://127.0.0.1:41002",
         "control": "tcp://127.0.0.1:41003"},
        ...                                   # one entry per replica, index = position
      ]

  ``requests`` is where gateways send observations, ``weights`` where a trainer
  publishes (:class:`~inference.weights.WeightsPublisher`), ``control`` answers
  METADATA and COMMANDs. Nothing is planned while ``inference.enabled`` is false.
- ``PREFLIGHT["inference"]`` -> :func:`preflight`: ``policy.kind: inference`` needs
  ``inference.enabled: true``; the network must fit the env spec; the weights file
  must exist. All before any process starts.
- ``SUMMARY_HOOKS["inference"]`` -> :func:`summary`: the servers' last counters in
  ``summary.json``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gateway.config import ConfigError, ExperimentConfig
from gateway.services import RunContext, Service, address
from gateway.transport import endpoint
from inference.config import InferenceConfig
from networks.config import network_problems

SOCKET_NAMES = ("requests", "weights", "control")


def replica_addresses(
    cfg: ExperimentConfig, run_dir: Path, index: int, *, bind: bool = False
) -> dict[str, str]:
    """Addresses of replica ``index``: ``base_port + 3 * index + k``, or free ports.

    With ``bind`` a port-0 TCP address is left as port 0 for the binding server to
    pick (it writes the real address); otherwise a free port is chosen now.
    """
    icfg: InferenceConfig = cfg.inference
    out: dict[str, str] = {}
    for k, name in enumerate(SOCKET_NAMES):
        port = icfg.base_port + 3 * index + k if icfg.base_port else 0
        label = f"inference-{index}-{name}"
        if bind or cfg.gateway.transport == "ipc":
            g = cfg.gateway
            ipc_dir = run_dir / "ipc"
            if g.transport == "ipc":
                ipc_dir.mkdir(parents=True, exist_ok=True)
            out[name] = endpoint(g.transport, g.host, port, ipc_dir, label)
        else:
            run = RunContext(run_dir=run_dir, config_path=run_dir / "config.yaml", endpoints={})
            out[name] = address(cfg, run, label, port)
    return out


def plan(cfg: ExperimentConfig, run: RunContext) -> list[Service]:
    """One service per replica when ``inference.enabled``; addresses into ``run.endpoints``."""
    icfg: InferenceConfig = cfg.inference
    if not icfg.enabled:
        return []
    entries: list[dict[str, Any]] = [replica_addresses(cfg, run.run_dir, i) for i in range(icfg.slots)]
    for entry in entries[icfg.replicas :]:
        # Slots for autoscaling: addresses fixed now, a server only while load needs it.
        entry["autoscaled"] = True
    run.endpoints["inference"] = entries
    return [replica_service(cfg, run, index) for index in range(icfg.replicas)]


def replica_service(cfg: ExperimentConfig, run: RunContext, index: int) -> Service:
    """The service of replica ``index`` (planned at the start, or started by the autoscaler)."""
    argv = run.module(
        "inference",
        "--config",
        str(run.config_path),
        "--run-dir",
        str(run.run_dir),
        "--spec",
        str(run.run_dir / "spec.json"),
        "--index",
        str(index),
    )
    # Before the gateway (order 20): its action source finds the servers up.
    return Service(name=f"inference-{index}", argv=argv, order=10, ready_timeout_s=60.0, metrics=True)


def preflight(cfg: ExperimentConfig, spec: Any) -> None:
    """Refuse configs that cannot serve, before anything starts (raises :class:`ConfigError`)."""
    icfg: InferenceConfig = cfg.inference
    if cfg.policy.kind == "inference" and not icfg.enabled:
        raise ConfigError(
            "policy.kind is 'inference' but inference.enabled is false: "
            "set inference.enabled=true (or another policy.kind)"
        )
    if not icfg.enabled:
        return
    problems = network_problems(spec, icfg.network)
    if problems:
        raise ConfigError("inference.network does not fit the env spec: " + "; ".join(problems))
    icfg.check_weights_file()


def summary(cfg: ExperimentConfig, run_dir: Path, summary: dict[str, Any]) -> None:
    """Each server's last metrics record, under ``summary["inference"]``."""
    if not cfg.inference.enabled:
        return
    from gateway.metrics import read_metrics

    last: dict[str, dict[str, Any]] = {}
    for record in read_metrics(run_dir / "metrics.jsonl"):
        service = str(record.get("service", ""))
        if service.startswith("inference-"):
            last[service] = record
    counters = ("requests", "device_requests", "rows", "batches", "swaps", "rollbacks", "weights_refused")
    summary["inference"] = {
        name: {
            "version": rec.get("version"),
            **{k: rec.get(k, 0) for k in counters},
            "errors": rec.get("errors", {}),
            "latency_p50_us": rec.get("latency_p50_us"),
            "latency_p99_us": rec.get("latency_p99_us"),
        }
        for name, rec in sorted(last.items())
    }
