"""``loopgate report RUN``: where a run's time went, which stage limits it, and a model.

Reads the run folder (``metrics.jsonl``, ``config.yaml``, ``trace.jsonl``) and prints,
per stage, its throughput, its service time and how busy it was (busy time over wall
time, from the stage's own counters: the gateway's loop time, the inference servers'
compute time per batch, the env step time the workers report, the trainer's share of
time not waiting for data), names the busiest stage as the bottleneck, and predicts
steps/s from the per-stage costs (see :func:`predict`)::

    loopgate report runs/reach_sim-20261201-101500
    loopgate report RUN --json report.json --png report.png --trace trace.json   # Perfetto

``--trace`` writes the sampled steps of ``trace.jsonl`` as a Chrome/Perfetto trace (one
track per process): open it in ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from gateway.metrics import Histogram, read_metrics

log = logging.getLogger(__name__)


@dataclass
class Stage:
    name: str
    throughput: float
    """Items per second (env steps, inference rows, updates)."""
    unit: str
    service_us: float
    """Median time one item (or one message/batch) takes in this stage."""
    busy: float | None
    """Fraction of wall time the stage was working (None: it keeps no such counter)."""
    note: str = ""


def _by_service(records: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        out.setdefault(str(r.get("service")), []).append(r)
    return out


def _number(r: dict[str, Any], key: str) -> bool:
    return isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)


def _lifetimes(rows: list[dict[str, Any]], counters: tuple[str, ...]) -> list[list[dict[str, Any]]]:
    """A service's records cut where a new process of it began: its ``uptime_s`` or one of
    its ``counters`` went down. A restarted service counts from zero again (the gateway's
    ``busy_s``; its ``env_steps`` go on from the spool), and a run folder continued by a
    second ``loopgate up`` holds both runs' records."""
    out: list[list[dict[str, Any]]] = []
    prev: dict[str, Any] | None = None
    for r in rows:
        if prev is None or any(
            _number(prev, k) and _number(r, k) and r[k] < prev[k] for k in ("uptime_s", *counters)
        ):
            out.append([])
        out[-1].append(r)
        prev = r
    return out


def _span(lifetimes: list[list[dict[str, Any]]], key: str) -> tuple[float, float]:
    """(change of ``key``, seconds) from the first to the last record that has it, summed
    over the service's lifetimes (the time between them, a restart, counts in neither).
    Each lifetime is taken from the last record before ``key`` first moved to the first
    at its last value: the time a service waited for its peers to start, or idled after
    the budget, is not part of its rate."""
    change = seconds = 0.0
    for rows in lifetimes:
        have = [r for r in rows if _number(r, key)]
        while len(have) >= 2 and have[1][key] == have[0][key]:
            have = have[1:]
        while len(have) >= 2 and have[-2][key] == have[-1][key]:
            have = have[:-1]
        if len(have) >= 2:
            change += float(have[-1][key] - have[0][key])
            seconds += float(have[-1]["t"] - have[0]["t"])
    return change, seconds


def stages(run_dir: Path) -> tuple[list[Stage], dict[str, Any]]:
    """Every stage of the run with its throughput, service time and busy fraction."""
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    env = cfg.get("env", {})
    workers, num_envs = int(env.get("workers", 1)), int(env.get("num_envs", 1))
    services = _by_service(read_metrics(run_dir / "metrics.jsonl"))
    gateway = services.get("gateway", [])
    lives = _lifetimes(gateway, ("env_steps", "busy_s"))
    steps, seconds = _span(lives, "env_steps")
    rate = steps / seconds if seconds else 0.0
    busy, _ = _span(lives, "busy_s")
    hops = (gateway[-1].get("hops_us") if gateway else None) or {}

    def p50(hop: str) -> float:
        return float(hops.get(hop, {}).get("p50", 0.0))

    messages = rate / num_envs if num_envs else 0.0  # one observation message per worker step
    out = [
        Stage(
            f"env workers ({workers} x {num_envs} envs)",
            rate,
            "steps/s",
            p50("env_step"),
            min(1.0, p50("env_step") * 1e-6 * messages / workers) if workers else None,
            "env step per message",
        ),
        Stage(
            "gateway",
            rate,
            "steps/s",
            p50("gateway"),
            # At most all of the wall time: the first record's busy_s leaves out the loop
            # turn it was written in, which the span's total counts, so a saturated
            # gateway came out a few tenths of a percent over 1.
            min(1.0, busy / seconds) if seconds else None,
            "observation in to action out",
        ),
    ]
    for name in sorted(s for s in services if s.startswith("inference-")):
        rows = [
            {**r, "compute_us": Histogram.from_dict(r["infer_us"]).total} if "infer_us" in r else r
            for r in services[name]
        ]
        lives = _lifetimes(rows, ("batches", "rows"))
        batches, t = _span(lives, "batches")
        served, _ = _span(lives, "rows")
        compute_us, _ = _span(lives, "compute_us")
        batch = served / batches if batches else 0.0
        out.append(
            Stage(
                name,
                served / t if t else 0.0,
                "rows/s",
                float(rows[-1].get("infer_p50_us", 0.0)),
                min(1.0, compute_us * 1e-6 / t) if t else None,
                f"batch {batch:.1f} rows on average",
            )
        )
    replay = [{**r, "ingest_steps": r.get("ingest", {}).get("steps")} for r in services.get("replay", [])]
    stored, t = _span(_lifetimes(replay, ("ingest_steps",)), "ingest_steps")
    if replay:
        out.append(
            Stage("replay service", stored / t if t else 0.0, "steps/s", p50("sink_ack"), None, "sink ack")
        )
    trainer = [r for r in services.get("trainer", []) if "updates_per_s" in r]
    if trainer:
        last = trainer[-1]
        out.append(
            Stage(
                "trainer",
                float(last["updates_per_s"]),
                "updates/s",
                1e6 / float(last["updates_per_s"]) if last["updates_per_s"] else 0.0,
                1.0 - float(last.get("data_wait_frac", 0.0)),
                f"waits for data {float(last.get('data_wait_frac', 0.0)):.0%} of the time",
            )
        )
    facts = {
        "workers": workers,
        "num_envs": num_envs,
        "steps_per_s": rate,
        "hops_us": hops,
        "seconds": seconds,
    }
    return out, facts


def bottleneck(found: list[Stage]) -> Stage | None:
    measured = [s for s in found if s.busy is not None]
    return max(measured, key=lambda s: s.busy or 0.0) if measured else None


def predict(
    facts: dict[str, Any], found: list[Stage], *, workers: int, num_envs: int, replicas: int = 1
) -> float:
    """Steps/s for ``workers`` x ``num_envs`` envs and ``replicas`` inference servers.

    A worker is a closed loop: one message per step of its ``num_envs`` envs, whose
    cycle is the env step (taken to grow with the env count) plus the gateway's turn and
    the two transits; the gateway (one loop) and the inference servers (their compute
    time per row at the measured batch size) cap the total.
    """
    hops = facts["hops_us"]

    def p50(hop: str) -> float:
        return float(hops.get(hop, {}).get("p50", 0.0))

    per_env_step = p50("env_step") / max(facts["num_envs"], 1)
    cycle_s = (
        per_env_step * num_envs + p50("gateway") + p50("capture_to_gateway") + p50("action_to_worker")
    ) * 1e-6
    limits = [workers * num_envs / cycle_s] if cycle_s > 0 else []
    gw = next((s for s in found if s.name == "gateway"), None)
    if gw is not None and gw.busy and facts["steps_per_s"]:
        busy_per_message = gw.busy / (facts["steps_per_s"] / facts["num_envs"])
        limits.append(num_envs / busy_per_message)
    inference = [s for s in found if s.name.startswith("inference-") and s.busy]
    if inference:
        per_row_s = sum((s.busy or 0.0) / s.throughput for s in inference if s.throughput) / len(inference)
        if per_row_s > 0:
            limits.append(replicas / per_row_s)
    return min(limits) if limits else 0.0


def chrome_trace(run_dir: Path) -> dict[str, Any]:
    """The sampled steps of ``trace.jsonl`` as Chrome trace events, one track per process."""
    events: list[dict[str, Any]] = []
    tracks = {"env worker": 1, "gateway": 2, "action source": 3, "wire": 4}
    for name, pid in tracks.items():
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}})
    for step in read_metrics(run_dir / "trace.jsonl"):
        us = 1e6
        arrived = step["t_action"] + step.get("action_to_worker_us", 0.0) / us
        spans = [
            ("wire", "observation to gateway", step["t_capture"], step["t_received"]),
            ("gateway", "observation in to action out", step["t_received"], step["t_action"]),
            ("wire", "action to worker", step["t_action"], arrived),
            ("env worker", "env step", arrived, arrived + step.get("env_step_us", 0.0) / us),
        ]
        if "policy_us" in step:
            spans.append(
                ("action source", "policy", step["t_action"] - step["policy_us"] / us, step["t_action"])
            )
        for track, name, start, end in spans:
            events.append(
                {
                    "ph": "X",
                    "name": name,
                    "pid": tracks[track],
                    "tid": 1,
                    "ts": round(start * us, 1),
                    "dur": round(max(end - start, 0.0) * us, 1),
                    "args": {"worker": step["worker"], "seq": step["seq"], "envs": step["envs"]},
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def plot(found: list[Stage], facts: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    measured = [s for s in found if s.busy is not None]
    left.barh([s.name for s in measured], [100 * (s.busy or 0.0) for s in measured], color="tab:blue")
    left.set_xlabel("busy (% of wall time)")
    left.set_xlim(0, 100)
    hops = facts["hops_us"]
    names = list(hops)
    right.barh(names, [hops[n]["p50"] for n in names], color="tab:orange", label="p50")
    right.set_xlabel("hop latency p50 (µs)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


SHORT_S = 3.0
"""Collection spanning fewer seconds of metrics records than this is measured roughly."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loopgate report",
        description="Where a run's time went: stages, the bottleneck, a performance model, a trace.",
        epilog="example: loopgate report runs/reach_sim-20261201-101500 --trace trace.json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run", help="run folder")
    p.add_argument("--json", help="write the report as JSON here")
    p.add_argument("--png", help="write a chart here (default: RUN/report.png)")
    p.add_argument("--trace", help="write a Chrome/Perfetto trace of the sampled steps here")
    p.add_argument("--log-level", default="INFO")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(message)s")
    run = Path(args.run)
    if not (run / "metrics.jsonl").exists() or not (run / "config.yaml").exists():
        log.error("%s is not a run folder (no metrics.jsonl and config.yaml)", run)
        return 2
    found, facts = stages(run)
    collected = facts["steps_per_s"] > 0
    # Without steps there is no time to attribute: no stage limited anything.
    top = bottleneck(found) if collected else None
    model = predict(facts, found, workers=facts["workers"], num_envs=facts["num_envs"]) if collected else 0.0
    if collected and facts["seconds"] < SHORT_S:
        print(
            f"collection spanned {facts['seconds']:.1f} s of metrics records (about one a second): "
            "the rates below are rough, lower bounds"
        )
    print(f"{'stage':32} {'throughput':>16} {'service p50':>12} {'busy':>6}  note")
    for s in found:
        busy = f"{100 * s.busy:5.0f}%" if s.busy is not None else "   n/a"
        print(f"{s.name:32} {s.throughput:10.1f} {s.unit:>5} {s.service_us:10.0f}µs {busy}  {s.note}")
    if not collected:
        print("no env steps were collected while the run wrote its metrics: no bottleneck, no model")
    else:
        if top is not None:
            print(f"bottleneck: {top.name}: {100 * (top.busy or 0):.0f} % busy ({top.note})")
        print(
            f"model: {model:.0f} steps/s predicted for this run's shape, {facts['steps_per_s']:.0f} measured"
        )
    report = {
        "stages": [asdict(s) for s in found],
        "bottleneck": top.name if top else None,
        "predicted_steps_per_s": model,
        **facts,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    plot(found, facts, Path(args.png) if args.png else run / "report.png")
    if args.trace:
        Path(args.trace).write_text(json.dumps(chrome_trace(run)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
