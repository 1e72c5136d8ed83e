"""``loopgate chaos CONFIG``: run a real experiment, inject faults, check that nothing was lost.

    loopgate chaos configs/reach_sim.yaml --seed 7 --duration 600 --json chaos.json
    loopgate chaos configs/collect_pd.yaml --faults kill.worker,kill.gateway,stop.replay
    loopgate chaos configs/reach_sim.yaml --soak --duration 1800     # RSS and fds every minute

The experiment is the config's own, started with ``loopgate up`` on a run folder under
``--workdir``, with four changes the faults need: no step budget (the run lasts
``--duration``), many restarts allowed, fixed ports (so a link proxy and a restarted
``loopgate up`` find the same addresses) and a private ``TMPDIR``. The faults come at
random times from ``--seed`` (the plan is in the JSON): SIGKILL of each process kind,
SIGSTOP/SIGCONT longer than the peers' timeouts, a full disk under the spool or the
replay log (a size-limited tmpfs; root only), a slow, lossy and cut link between an
env worker and the gateway (:class:`~benchmarks.chaos_faults.LinkProxy`), and malformed
traffic on every endpoint. After each fault it measures the time until collection goes
on with every service back; at the end it stops the run with Ctrl-C's path and checks
the run folder (:mod:`benchmarks.chaos_check`). It prints a table and writes the
records ``chaos.faults``, ``chaos.lost_steps``, ``chaos.duplicate_steps``,
``chaos.recover_s.p50|max.<kind>`` (``soak.rss_growth_frac.<service>`` with ``--soak``).
Exit status 0 means every check held, 1 that one did not.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import shutil
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from benchmarks import chaos_faults as faults
from benchmarks.chaos_check import check_run
from benchmarks.chaos_harness import Experiment, Harness
from gateway.services import bindable, free_port, planned

log = logging.getLogger("loopgate.chaos")

KILLS = (
    "kill.worker",
    "kill.gateway",
    "kill.inference",
    "kill.replay",
    "kill.trainer",
    "kill.supervisor",
    "kill.all",
)
STOPS = ("stop.worker", "stop.gateway", "stop.inference", "stop.replay")
OTHERS = ("disk.replay", "disk.spool", "link.worker", "fuzz")
KINDS = KILLS + STOPS + OTHERS


def _free_block(n: int) -> int:
    """The first of ``n`` consecutive ports free now, out of the OS's ephemeral range (the
    inference replicas' ``base_port``): a port from that range can be taken by any
    outgoing connection before the service binds it, a restarted service's included."""
    while True:
        base = free_port()
        rest = range(base + 1, base + n)
        if base + n <= 65535 and all(not planned(p) and bindable("127.0.0.1", p) for p in rest):
            return base


def chaos_config(source: Path, out: Path, overrides: dict[str, Any]) -> dict[str, Any]:
    """The experiment's config with what the faults need (see the module docstring)."""
    cfg = yaml.safe_load(source.read_text()) or {}
    for key, value in overrides.items():
        block, _, name = key.partition(".")
        cfg.setdefault(block, {})[name] = value
    run = cfg.setdefault("run", {})
    run.update({"max_env_steps": None, "max_restarts": 10_000, "status_interval_s": 0.5})
    gw = cfg.setdefault("gateway", {})
    gw["transport"] = "tcp"
    for name in ("worker_port", "client_port", "control_port"):
        gw[name] = gw.get(name) or free_port()
    if cfg.get("replay", {}).get("enabled"):
        for name in ("ingest_port", "sample_port", "control_port"):
            cfg["replay"][name] = cfg["replay"].get(name) or free_port()
    if cfg.get("inference", {}).get("enabled") and not cfg["inference"].get("base_port"):
        # Three ports per replica slot, all free now, for this run.
        icfg = cfg["inference"]
        icfg["base_port"] = _free_block(
            3 * max(int(icfg.get("replicas", 1)), int(icfg.get("max_replicas", 0)))
        )
    out.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return cfg


# ---------------------------------------------------------------------- main


def plan(rng: random.Random, kinds: list[str], count: int) -> list[str]:
    """The order of ``count`` faults: every kind once per round, each round shuffled."""
    out: list[str] = []
    while len(out) < count:
        round_ = list(kinds)
        rng.shuffle(round_)
        out.extend(round_)
    return out[:count]


def records(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The benchmark records of one chaos (or soak) run."""
    out = [
        {"name": "chaos.faults", "value": len(report["faults"]), "unit": "faults"},
        {
            "name": "chaos.lost_steps",
            "value": report["check"]["lost_steps"],
            "unit": "steps",
            "target": "== 0",
        },
        {
            "name": "chaos.duplicate_steps",
            "value": report["check"]["duplicate_steps"],
            "unit": "steps",
            "target": "== 0",
        },
    ]
    by_kind: dict[str, list[float]] = {}
    for f in report["faults"]:
        if f["recover_s"] is not None:
            by_kind.setdefault(f["kind"], []).append(f["recover_s"])
    for kind, values in sorted(by_kind.items()):
        out.append({"name": f"chaos.recover_s.p50.{kind}", "value": statistics.median(values), "unit": "s"})
        out.append({"name": f"chaos.recover_s.max.{kind}", "value": max(values), "unit": "s"})
    for service, growth in sorted(report.get("soak", {}).get("rss_growth_frac", {}).items()):
        out.append({"name": f"soak.rss_growth_frac.{service}", "value": growth, "unit": "fraction"})
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loopgate chaos",
        description="Run an experiment under injected faults; check nothing acknowledged was lost.",
        epilog="example: loopgate chaos configs/collect_pd.yaml --seed 3 --duration 120 --json chaos.json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", help="experiment config (YAML)")
    p.add_argument("--seed", type=int, default=None, help="fault plan seed (default: random, recorded)")
    p.add_argument("--duration", type=float, default=None, help="seconds of faults (default 300; soak 1800)")
    p.add_argument(
        "--faults", help=f"comma-separated kinds (default: every one the run has): {', '.join(KINDS)}"
    )
    p.add_argument("--soak", action="store_true", help="no faults unless --faults; RSS and fds every minute")
    p.add_argument("--sample-s", type=float, default=60.0, help="soak sampling period")
    p.add_argument("--fuzz-messages", type=int, default=10_000, help="malformed messages per endpoint")
    p.add_argument(
        "--set", action="append", default=[], metavar="BLOCK.KEY=VALUE", help="override a config key"
    )
    p.add_argument("--workdir", help="where the run folder goes (default: runs/chaos-<time>)")
    p.add_argument("--json", metavar="FILE", help="write the report and records as JSON")
    p.add_argument("--log-level", default="INFO")
    return p


def run_chaos(
    config: Path,
    workdir: Path,
    *,
    seed: int,
    duration: float,
    kinds: list[str],
    count: int | None = None,
    soak: bool = False,
    sample_s: float = 60.0,
    fuzz_n: int = 10_000,
    overrides: dict[str, Any] | None = None,
    should_stop: Callable[[], bool] = lambda: False,
) -> dict[str, Any]:
    """One chaos run: start, inject ``kinds`` (at most ``count`` faults, within
    ``duration`` s), stop, check. Returns the report (see :func:`records`)."""
    from benchmarks.chaos_report import soak_sampler

    rng = random.Random(seed)
    workdir.mkdir(parents=True, exist_ok=True)
    cfg = chaos_config(config, workdir / "chaos.yaml", overrides or {})
    exp = Experiment(workdir / "chaos.yaml", workdir, cfg)
    harness = Harness(exp, rng)
    harness.fuzz_n = fuzz_n
    skipped: dict[str, str] = {}
    stop_soak = threading.Event()
    soak_data: dict[str, Any] = {}
    log.info("chaos run: seed %d, %.0f s, folder %s", seed, duration, exp.run_dir)
    try:
        disk_kinds = [k for k in kinds if k.startswith("disk.")]
        why = faults.can_mount() if disk_kinds else None
        for kind in disk_kinds:
            where = kind.split(".", 1)[1]
            if why or (where == "replay" and not cfg.get("replay", {}).get("enabled")):
                skipped[kind] = why or "the config has no replay service"
                continue
            harness.disks[where] = faults.DiskLimit(exp.run_dir / where, size_mb=256)
        exp.up()
        harness.settle()
        if "link.worker" in kinds:
            harness.proxy = faults.LinkProxy(f"tcp://127.0.0.1:{cfg['gateway']['worker_port']}", seed=seed)
            exp.link_worker(harness.proxy.address, index=90)
            exp.wait("link worker steps", lambda: harness.link_steps() > 0, 120)
            harness.baseline["link-worker"] = 1
        sampler = None
        if soak:
            sampler = threading.Thread(
                target=soak_sampler, args=(exp, sample_s, stop_soak, soak_data), daemon=True
            )
            sampler.start()
        usable = [k for k in kinds if k not in skipped and harness.available(k)]
        skipped.update(
            {k: "the run has no such process" for k in kinds if k not in usable and k not in skipped}
        )
        order = plan(rng, usable, count=count or 10**5) if usable else []
        deadline = time.monotonic() + duration
        i = 0
        while time.monotonic() < deadline and not should_stop() and (i < len(order) or not usable):
            if not usable:
                time.sleep(1.0)
                continue
            time.sleep(rng.uniform(1.0, 4.0))
            harness.inject(order[i])
            i += 1
        stop_soak.set()
        if sampler is not None:
            sampler.join(timeout=10)
        log.info("stopping the run (drain, summary.json)")
        code = exp.stop()
        if code not in (0, 130):
            harness.problems.append(
                f"loopgate up ended with status {code}; see {workdir}/up-{exp.starts}.log"
            )
    except TimeoutError as exc:  # the run never came up, or went away: reported, not raised
        harness.problems.append(str(exc))
    finally:
        stop_soak.set()
        exp.kill_everything()
        if harness.proxy is not None:
            harness.proxy.close()
        try:
            check = check_run(exp.run_dir, tmp_dir=exp.tmp, shm_used=exp.shm_used)
        finally:
            for disk in harness.disks.values():
                disk.unmount()
    report = {
        "seed": seed,
        "config": str(config),
        "run_dir": str(exp.run_dir),
        "duration_s": duration,
        "faults": [f.__dict__ for f in harness.records],
        "skipped": skipped,
        "check": check.figures,
        "problems": harness.problems + check.problems,
        "soak": soak_data,
    }
    report["records"] = records(report)
    shutil.rmtree(exp.tmp, ignore_errors=True)
    return report


def main(argv: list[str] | None = None) -> int:
    from benchmarks.chaos_report import print_report

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(message)s")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    wanted = args.faults.split(",") if args.faults else ([] if args.soak else list(KINDS))
    unknown = sorted(set(wanted) - set(KINDS))
    if unknown:
        print(f"loopgate chaos: unknown fault kind(s) {unknown}; known: {', '.join(KINDS)}", file=sys.stderr)
        return 2
    interrupted = {"n": 0}
    signal.signal(signal.SIGINT, lambda *_: interrupted.__setitem__("n", interrupted["n"] + 1))
    report = run_chaos(
        Path(args.config),
        Path(args.workdir or f"runs/chaos-{time.strftime('%Y%m%d-%H%M%S')}").resolve(),
        seed=seed,
        duration=args.duration or (1800.0 if args.soak else 300.0),
        kinds=wanted,
        soak=args.soak,
        sample_s=args.sample_s,
        fuzz_n=args.fuzz_messages,
        overrides={k: yaml.safe_load(v) for k, _, v in (s.partition("=") for s in args.set)},
        should_stop=lambda: interrupted["n"] > 0,
    )
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    return 0 if not report["problems"] else 1


if __name__ == "__main__":
    sys.exit(main())
