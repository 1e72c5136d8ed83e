"""What the trainer adds to a run's end: the final evaluation and the learning curve.

``final_evaluation`` (registered in ``gateway.registry.FINALIZERS``) asks the gateway
for ``trainer.final_eval_episodes`` evaluation episodes with the deterministic policy
once training is done and waits for the round; ``summarize`` (a summary hook) names the
trainer's last policy version and plots every evaluation round in ``metrics.jsonl``
against env steps into ``learning_curve.png`` (``learning_curve``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gateway.config import ExperimentConfig
from gateway.metrics import MetricsWriter, read_metrics
from gateway.protocol import RemoteError, Timeout
from trainer.versions import final_version

log = logging.getLogger(__name__)


def final_evaluation(
    cfg: ExperimentConfig,
    control: Any,
    run_dir: Path,
    timeout_s: float = 600.0,
    should_stop: Callable[[], bool] = lambda: False,
) -> dict[str, Any]:
    """The final round, outside the collection budget; every wait has a deadline and
    ends early when ``should_stop()`` (a Ctrl-C at ``loopgate up``)."""
    episodes = cfg.trainer.final_eval_episodes
    if not episodes:
        return {}
    skipped = {"eval_success_rate": None, "eval_return": None}
    deadline = time.monotonic() + timeout_s

    def wait(what: str, done: Callable[[], Any], limit_s: float) -> Any:
        until = min(deadline, time.monotonic() + limit_s)
        log.info("final evaluation: waiting for %s (up to %.0f s)", what, until - time.monotonic())
        while not should_stop() and time.monotonic() < until:
            value = done()
            if value:
                return value
            time.sleep(0.2)
        log.error(
            "final evaluation skipped: %s while waiting for %s",
            "interrupted" if should_stop() else f"no result within {limit_s:.0f} s",
            what,
        )
        return None

    try:
        # The trainer's last publication must be what acts: wait until the servers have it.
        wanted = int(control.request("status", timeout_s=5.0).get("trainer_version", 0))

        def served() -> dict[str, Any] | None:
            status = control.request("status", timeout_s=5.0)
            return status if int(status.get("policy_version", 0)) >= wanted else None

        status = wait(f"the inference servers to serve version {wanted}", served, 60.0)
        if status is None:
            return skipped
        done_before = int((status.get("eval") or {}).get("rounds_done", 0))

        def start() -> dict[str, Any] | None:  # a periodic round still running ends first
            started = control.request("evaluate", timeout_s=5.0, episodes=episodes)
            return started if started.get("started") else None

        started = wait("the running evaluation round to end", start, timeout_s)
        if started is None:
            return skipped
        record_unseen_round(control, run_dir)
        log.info("final evaluation: %d episodes with the deterministic policy", episodes)

        def finished() -> dict[str, Any] | None:
            ev = control.request("status", timeout_s=5.0).get("eval") or {}
            last = ev.get("last") or {}
            return (
                last
                if int(ev.get("rounds_done", 0)) > done_before and last.get("round") == started["round"]
                else None
            )

        last = wait(f"{episodes} evaluation episodes", finished, timeout_s)
        if last is None:
            return skipped
        log.info(
            "final evaluation: success rate %s, return %.2f",
            "n/a (the env reports no success)"
            if last["success_rate"] is None
            else f"{last['success_rate']:.2f}",
            last["return_mean"],
        )
        return {
            "eval_success_rate": last["success_rate"],
            "eval_return": last["return_mean"],
            "eval_episodes": last["episodes"],
            "eval_policy_version": last["policy_version"],
        }
    except (Timeout, RemoteError) as exc:
        log.error("final evaluation failed: %s", exc)
    return skipped


def record_unseen_round(control: Any, run_dir: Path) -> None:
    """The round that ended after the trainer stopped (an untrained policy's round under a
    small update budget, say) goes into ``metrics.jsonl`` as the trainer records rounds,
    with ``updates`` null, so the learning curve and the run's records have it too."""
    status = control.request("status", timeout_s=5.0)
    last = (status.get("eval") or {}).get("last")
    seen = {
        r["eval"]["round"]
        for r in read_metrics(run_dir / "metrics.jsonl")
        if r.get("service") == "trainer" and "eval" in r
    }
    if last is None or last["round"] in seen:
        return
    log.info("evaluation round %d ended after the trainer stopped; recording it", last["round"])
    writer = MetricsWriter(run_dir / "metrics.jsonl", "trainer", serve=False)
    try:
        writer.emit({"eval": last, "updates": None, "env_steps": status.get("env_steps")})
    finally:
        writer.close()


def _rate(value: float | None) -> float:
    """A success rate to plot: NaN (no point) for an env that reports no success."""
    return float("nan") if value is None else float(value)


def summarize(cfg: ExperimentConfig, run_dir: Path, summary: dict[str, Any]) -> None:
    if not cfg.trainer.enabled:
        return
    # A stopped trainer publishes and saves once more after the gateway's last status,
    # which is where the summary's version came from.
    version = max(int(summary.get("policy_version", 0)), final_version(run_dir / "checkpoints"))
    if version:
        summary["policy_version"] = version
    learning_curve(cfg, run_dir, summary)


def learning_curve(cfg: ExperimentConfig, run_dir: Path, summary: dict[str, Any]) -> None:
    points = sorted(
        {
            (r["env_steps"], _rate(r["eval"]["success_rate"]), r["eval"]["return_mean"])
            for r in read_metrics(run_dir / "metrics.jsonl")
            if r.get("service") == "trainer" and "eval" in r and r.get("env_steps") is not None
        }
    )
    if summary.get("eval_return") is not None:
        points.append((summary["env_steps"], _rate(summary["eval_success_rate"]), summary["eval_return"]))
    if not points:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, success, ret = zip(*points)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, success, marker="o", color="tab:blue", label="success rate")
    ax.set_xlabel("env steps")
    ax.set_ylabel("evaluation success rate")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    twin = ax.twinx()
    twin.plot(steps, ret, marker=".", color="tab:orange", alpha=0.7, label="return")
    twin.set_ylabel("evaluation return")
    ax.set_title(f"{cfg.name}: {cfg.trainer.algorithm} learning curve")
    fig.legend(loc="lower right", bbox_to_anchor=(0.88, 0.18))
    fig.tight_layout()
    fig.savefig(run_dir / "learning_curve.png", dpi=100)
    plt.close(fig)
    summary["learning_curve"] = "learning_curve.png"
