"""``loopgate up CONFIG``: start, watch and stop every process of an experiment.

    loopgate up configs/reach_sim.yaml --max-env-steps 20000 --set env.workers=2

1. load and validate the config (``--set block.key=value`` overrides), compute the
   env spec and run the preflight checks, so a bad config fails before anything starts;
2. create the run folder (``--run-dir``, default ``runs/<name>-<time>``) with the
   resolved ``config.yaml``, ``spec.json`` and ``endpoints.json``;
3. start the planned services (:mod:`gateway.services`) in order, each logging to
   ``logs/<name>.log``; restart one that crashes (up to ``run.max_restarts`` times, with
   backoff; a process exiting with status 2 has a config problem and is not restarted);
4. show a progress bar and a live status table, and append to ``metrics.jsonl``;
5. stop when the step budget is reached, a finishing service (the trainer) is done, or
   on Ctrl-C: drain the gateway (open episodes are closed as interrupted and flushed),
   stop services in reverse order, then read the store back and write ``summary.json``
   (:mod:`gateway.run_end`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway import lifeline
from gateway.config import ConfigError, ExperimentConfig, load_config
from gateway.control_client import ControlClient
from gateway.endpoints import write as write_endpoints
from gateway.engines import open_engine
from gateway.engines.autoscale import Autoscaler
from gateway.engines.scaling import serve_requests
from gateway.factory import experiment_spec
from gateway.live import LiveView, StartupWatch
from gateway.locks import UP_LOCK, Locked, hold
from gateway.metrics import MetricsWriter
from gateway.priority import may_set_niceness, set_session_niceness
from gateway.protocol import RemoteError, Timeout
from gateway.registry import FINALIZERS, PLANS, PREFLIGHT, resolve
from gateway.run_end import drain, write_summary
from gateway.services import RunContext, Service, free_port, replan_taken
from gateway.transport import CurveKeys, is_loopback
from gateway.venvs import check_interpreter, foreign_spec

log = logging.getLogger("loopgate.up")

EXIT_CONFIG = 2

LATE_GROUP_S = 2.0
"""How long a group of services reached after the stop's deadline gets to end on SIGTERM."""


_EXCEPTION = re.compile(
    r"^[A-Za-z_][\w.]*(Error|Exception|Unavailable|Disconnected|Timeout|Interrupt|Exit)\b.*"
)
"""A Python exception's last traceback line, e.g. ``robots.ros2.RobotUnavailable: no messages ...``."""


def describe_exit(code: int) -> str:
    """An exit status in words: ``1``, or ``signal SIGKILL`` for a process killed by one."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-code).name}"
    return str(code)


@dataclass
class Proc:
    service: Service
    popen: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    state: str = "pending"
    next_start: float = 0.0
    last_exit: int | None = None

    def describe(self) -> dict[str, Any]:
        pid = self.popen.pid if self.popen is not None and self.popen.poll() is None else None
        detail = f"exit {self.last_exit}" if self.last_exit is not None else ""
        return {
            "name": self.service.name,
            "state": self.state,
            "pid": pid,
            "restarts": self.restarts,
            "detail": detail,
        }


class Supervisor:
    def __init__(
        self, cfg: ExperimentConfig, run: RunContext, services: list[Service], launcher: Any = None
    ) -> None:
        self.cfg, self.run = cfg, run
        self.launcher = launcher
        """Starts processes elsewhere (``gateway.engines``: a Ray actor per service); ``None``:
        child processes of this one."""
        self.procs = {s.name: Proc(s) for s in sorted(services, key=lambda s: s.order)}
        self.logs = run.run_dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.failed: str | None = None
        self.finished = False

    def start(self, proc: Proc) -> None:
        s = proc.service
        # Another process may have taken a port planned for this one (a busy machine):
        # it binds a new one. Under a launcher, only this machine's addresses are known.
        for move in replan_taken(self.run, s.name, lambda host: self.launcher is None or is_loopback(host)):
            log.warning("%s: its planned port was taken by another process; it binds %s", s.name, move)
        if self.launcher is not None:
            extra = {**s.env, **lifeline.child_env(), "PYTHONUNBUFFERED": "1"}
            proc.popen = self.launcher.start(s, self.logs / f"{s.name}.log", extra, self.niceness(s.name))
            proc.state = "running"
            log.debug("started %s through the %s: %s", s.name, type(self.launcher).__name__, " ".join(s.argv))
            return
        log_file = open(self.logs / f"{s.name}.log", "ab")  # noqa: SIM115 - owned by the child process
        env = {**os.environ, **s.env, **lifeline.child_env(), "PYTHONUNBUFFERED": "1"}
        # Own session: Ctrl-C reaches only the supervisor, which stops children in order.
        # The lifeline ends the child (and its children) if the supervisor dies first.
        niceness = self.niceness(s.name)

        def prepare_child() -> None:  # in the child, before exec
            lifeline.die_with_parent()
            if niceness:  # the process and its session (its own: see gateway.priority)
                set_session_niceness(os.nice(niceness))

        proc.popen = subprocess.Popen(
            s.argv,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            cwd=os.getcwd(),
            preexec_fn=prepare_child,
        )
        log_file.close()
        proc.state = "running"
        log.debug("started %s (pid %d): %s", s.name, proc.popen.pid, " ".join(s.argv))

    def niceness(self, name: str) -> int:
        """``run.nice`` for service ``name``: its own entry, else the longest matching prefix."""
        nice = self.cfg.run.nice
        if name in nice:
            return int(nice[name])
        prefixes = [p for p in nice if name.startswith(p)]
        return int(nice[max(prefixes, key=len)]) if prefixes else 0

    def start_all(self, ready: Any, should_stop: Any = lambda: False) -> None:
        """Start services group by group (same ``order``), waiting for ``ready(group)``
        (up to each group's ``ready_timeout_s``; ``should_stop()`` ends the wait)."""
        groups: dict[int, list[Proc]] = {}
        for proc in self.procs.values():
            groups.setdefault(proc.service.order, []).append(proc)
        for order in sorted(groups):
            for proc in groups[order]:
                self.start(proc)
            timeout = max(p.service.ready_timeout_s for p in groups[order])
            deadline = time.monotonic() + timeout
            log.info(
                "waiting up to %.0f s for %s to be ready",
                timeout,
                ", ".join(p.service.name for p in groups[order]),
            )
            while not (self.placed(groups[order]) and ready(groups[order])):
                self.supervise()
                if self.failed or should_stop():
                    return
                if time.monotonic() > deadline:
                    self.failed = (
                        f"{', '.join(p.service.name for p in groups[order])} not ready within {timeout:.0f} s"
                    )
                    return
                time.sleep(0.1)

    def placed(self, group: list[Proc]) -> bool:
        """Whether a launcher has put every process of ``group`` where its addresses point
        (always, for child processes): services started later read those addresses."""
        return self.launcher is None or all(
            self.launcher.placed(p.popen) for p in group if p.popen is not None and p.state == "running"
        )

    def supervise(self) -> None:
        now = time.monotonic()
        for proc in self.procs.values():
            if proc.state == "backoff" and now >= proc.next_start:
                self.start(proc)
                continue
            if proc.popen is None or proc.state != "running":
                continue
            code = proc.popen.poll()
            if code is None:
                continue
            proc.last_exit = code
            # Take down whatever the process left behind in its session (e.g. the
            # ranks of a torchrun launcher that was killed) before anything restarts.
            self.end_session(proc)
            s = proc.service
            if code == 0 and s.finishes:
                proc.state = "finished"
                self.finished = True
                log.info("%s finished", s.name)
            elif code == EXIT_CONFIG:
                proc.state = "failed"
                if s.required:
                    self.failed = f"{s.name} refused to run (exit 2): {self.reason(s.name)}"
                else:  # e.g. the console: the experiment goes on without it
                    log.error(
                        "%s refused to run; the run goes on without it: %s", s.name, self.reason(s.name)
                    )
                    self.unlist(s.name)
            elif s.restart and proc.restarts < self.cfg.run.max_restarts:
                proc.restarts += 1
                proc.state = "backoff"
                proc.next_start = now + min(0.5 * 2 ** (proc.restarts - 1), 5.0)
                log.warning(
                    "%s exited with %s; restart %d/%d: %s",
                    s.name,
                    describe_exit(code),
                    proc.restarts,
                    self.cfg.run.max_restarts,
                    self.reason(s.name),
                )
            else:
                proc.state = "failed"
                if s.required:
                    self.failed = (
                        f"{s.name} exited with {code} after {proc.restarts} restart(s): {self.tail(s.name)}"
                    )

    def unlist(self, name: str) -> None:
        """Take a service that will not run out of ``endpoints.json``: its planned address
        may be another program's (the console's port in use), which a script reading the
        file would otherwise take for the run's."""
        listed = self.run.endpoints.pop(name, None) is not None
        listed |= self.run.endpoints.get("metrics", {}).pop(name, None) is not None
        if listed:
            write_endpoints(self.run.run_dir / "endpoints.json", self.run.endpoints)

    def given_up(self, name: str) -> bool:
        """Whether service ``name`` failed for good here: it will not be started again."""
        proc = self.procs.get(name)
        return proc is not None and proc.state == "failed"

    def reason(self, name: str) -> str:
        """Why a service ended, from its log: the last exception or error line."""
        path = self.logs / f"{name}.log"
        lines = path.read_text(errors="replace").splitlines()[-200:] if path.exists() else []
        for line in reversed(lines):
            text = line.strip()
            if _EXCEPTION.match(text) or " ERROR " in text or " CRITICAL " in text:
                return text[:400]
        return f"no error in logs/{name}.log" + (f" (last line: {lines[-1].strip()[:200]})" if lines else "")

    def tail(self, name: str, lines: int = 5) -> str:
        path = self.logs / f"{name}.log"
        if not path.exists():
            return ""
        text = path.read_text(errors="replace").strip().splitlines()
        return " | ".join(text[-lines:])

    def stop(self, names: list[str] | None = None, timeout_s: float = 10.0) -> None:
        """SIGTERM in reverse start order, one ``order`` group after the other (the trainer
        ends while the replay service and the inference servers it talks to still run),
        then SIGKILL what is left of a group after ``timeout_s`` in all (a group reached
        after that gets up to :data:`LATE_GROUP_S`)."""
        procs = [p for p in reversed(list(self.procs.values())) if names is None or p.service.name in names]
        deadline = time.monotonic() + timeout_s
        for order in sorted({p.service.order for p in procs}, reverse=True):
            group = [p for p in procs if p.service.order == order]
            for proc in group:
                if proc.popen is not None and proc.popen.poll() is None:
                    proc.popen.send_signal(signal.SIGTERM)
                if proc.state in ("running", "backoff"):
                    proc.state = "stopping"
            group_deadline = max(deadline, time.monotonic() + min(LATE_GROUP_S, timeout_s))
            for proc in group:
                if proc.popen is None:
                    continue
                try:
                    proc.popen.wait(timeout=max(0.1, group_deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("%s did not stop in time; killing it", proc.service.name)
                    proc.popen.kill()
                    proc.popen.wait()
                # Whatever it left in its session (torchrun's ranks) goes with it.
                self.end_session(proc)
                proc.state = "stopped" if proc.state == "stopping" else proc.state

    def end_session(self, proc: Proc) -> None:
        """SIGKILL what is left of a process's session (its actor too, under a launcher)."""
        if proc.popen is None:
            return
        if self.launcher is not None:
            self.launcher.end_session(proc.popen)
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.popen.pid, signal.SIGKILL)

    def add(self, service: Service) -> Proc:
        """Plan one more service into the running set (``loopgate scale``); start it with :meth:`start`."""
        if service.name in self.procs:
            raise ValueError(f"service {service.name!r} is already part of the run")
        proc = self.procs[service.name] = Proc(service)
        return proc

    def remove(self, name: str) -> None:
        """Forget a stopped service (a worker that left)."""
        proc = self.procs.pop(name)
        if proc.popen is not None and proc.popen.poll() is None:
            raise RuntimeError(f"service {name!r} still runs; stop it first")

    def describe(self) -> list[dict[str, Any]]:
        rows = [p.describe() for p in self.procs.values()]
        if self.launcher is not None:
            for row, proc in zip(rows, self.procs.values()):
                if proc.popen is not None and proc.state == "running":
                    state, where = self.launcher.describe(proc.popen)
                    row["state"] = state if state != "exited" else row["state"]
                    row["detail"] = " ".join(x for x in (row["detail"], where) if x)
        return rows


# ---------------------------------------------------------------------- planning


def default_run_dir(cfg: ExperimentConfig) -> Path:
    return Path(cfg.run.run_dir or f"runs/{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}")


def prepare_run(
    cfg: ExperimentConfig, run_dir: Path, log_level: str
) -> tuple[RunContext, list[Service], Any]:
    """Preflight checks, run folder files and the service plan; nothing started yet."""
    if cfg.env.python is None:
        spec = experiment_spec(cfg.env.backend, dict(cfg.env.options))
    else:  # the backend is importable only in the simulator's own venv
        check_interpreter(cfg.env.python)
        spec = foreign_spec(cfg.env.python, cfg.env.backend, dict(cfg.env.options))
    if cfg.run.engine == "local":
        for name, niceness in cfg.run.nice.items():
            if not may_set_niceness(niceness):
                raise ConfigError(
                    f"run.nice.{name}: {niceness} raises the priority, which needs CAP_SYS_NICE "
                    "or a nice limit in /etc/security/limits.conf; use 0 or more, or grant it"
                )
    for block, _ in PREFLIGHT.items():
        if cfg.has(block):
            resolve(PREFLIGHT, block, "preflight check")(cfg, spec)
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "config.yaml"
    cfg.dump(config_path)
    (run_dir / "spec.json").write_text(json.dumps(spec.to_dict(), indent=2))
    run = RunContext(
        run_dir=run_dir.resolve(), config_path=config_path.resolve(), endpoints={}, log_level=log_level
    )
    services: list[Service] = []
    for block in PLANS:
        if block in ("gateway", "env") or cfg.has(block):
            services.extend(resolve(PLANS, block, "service plan")(cfg, run))
    # Every service that writes metrics serves them for Prometheus too; `up` itself also.
    host = "127.0.0.1" if cfg.gateway.host in ("127.0.0.1", "localhost") else cfg.gateway.host
    run.endpoints["metrics"] = {
        name: f"http://{host}:{free_port(host)}/metrics"
        for name in [s.name for s in services if s.metrics] + ["up"]
    }
    write_endpoints(run_dir / "endpoints.json", run.endpoints)
    return run, services, spec


# -------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loopgate up",
        description="Start and supervise every process of an experiment; write a run folder.",
        epilog="example: loopgate up configs/reach_sim.yaml --max-env-steps 5000 --set env.workers=2",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", help="experiment config (YAML)")
    p.add_argument("--run-dir", help="run folder (default: runs/<config name>-<time>)")
    p.add_argument("--max-env-steps", type=int, help="stop after this many recorded env steps")
    p.add_argument(
        "--set", action="append", default=[], metavar="BLOCK.KEY=VALUE", help="override a config key"
    )
    p.add_argument("--log-level", default=None, help="log level of every process (default: run.log_level)")
    p.add_argument(
        "--ray",
        metavar="ADDRESS",
        help="run every service on the Ray cluster at ADDRESS (auto: RAY_ADDRESS); sets run.engine=ray",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    overrides = list(args.set)
    if args.max_env_steps is not None:
        overrides.append(f"run.max_env_steps={args.max_env_steps}")
    if args.ray:
        overrides += ["run.engine=ray", f"run.ray_address={json.dumps(args.ray)}"]
    logging.basicConfig(
        level=(args.log_level or "INFO").upper(), format="%(asctime)s %(levelname)s %(message)s"
    )
    interrupted = {"n": 0}

    def _interrupt_setup(signum: int, frame: Any) -> None:
        # Before any service starts, an interrupt ends the command at once, whatever it
        # waits for (an env spec built in Isaac Sim's interpreter takes minutes).
        interrupted["n"] += 1
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, _interrupt_setup)
    signal.signal(signal.SIGTERM, _interrupt_setup)
    try:
        try:
            cfg = load_config(args.config, overrides)
            run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(cfg)
            # Before anything is written there: a second `loopgate up` on a folder in use
            # would rewrite its endpoints and run a second gateway on its spool.
            try:
                hold(run_dir / UP_LOCK, "loopgate up")
            except OSError as exc:  # the folder cannot be made or written
                log.error("cannot use the run folder %s: %s", run_dir, exc)
                return EXIT_CONFIG
            run, services, _ = prepare_run(cfg, run_dir, (args.log_level or cfg.run.log_level).upper())
            engine = open_engine(cfg)
        except Locked as exc:
            log.error("%s: stop it first, or give this run another --run-dir", exc)
            return EXIT_CONFIG
        except ConfigError as exc:
            if interrupted["n"]:
                # A library interrupted while building the env may report any error
                # ("initialization failed"): the interrupt, not the config, ended it.
                raise KeyboardInterrupt from None
            log.error("invalid config: %s", exc)
            return EXIT_CONFIG
        log.info("run folder: %s (engine: %s)", run.run_dir, engine.name)
        keys = CurveKeys.load(cfg.gateway.curve_keys) if cfg.gateway.curve_keys else None
        control = ControlClient(run.endpoints["gateway"]["control"], keys)
        sup = Supervisor(cfg, run, services, launcher=engine.launcher(cfg, run))
        metrics = MetricsWriter(run.run_dir / "metrics.jsonl", "up")
        autoscaler = Autoscaler(cfg, run)
    except KeyboardInterrupt:
        log.warning("interrupted while preparing the run: no service was started")
        return 130

    def _sigint(signum: int, frame: Any) -> None:
        interrupted["n"] += 1
        if interrupted["n"] == 1:
            log.warning(
                "%s: stopping gracefully (drain, stop services, write summary.json within about %.0f s); "
                "a second one kills everything",
                signal.Signals(signum).name,
                2 * cfg.run.drain_timeout_s + 10,
            )
        if interrupted["n"] > 1:
            log.warning("second interrupt: killing everything")
            sup.stop(timeout_s=0.5)
            os._exit(130)

    signal.signal(signal.SIGINT, _sigint)
    signal.signal(signal.SIGTERM, _sigint)
    status: dict[str, Any] = {}
    started = time.monotonic()

    def ready(group: list[Proc]) -> bool:
        if any(p.service.name == "gateway" for p in group):
            # An engine may have moved the gateway to its node's address; asked after a
            # timeout (a fresh connection), the client uses it.
            control.address = run.endpoints["gateway"]["control"]
            try:
                control.request("status", timeout_s=0.5)
            except (Timeout, RemoteError):
                return False
        return True

    outcome = "completed"
    waits_for_finish = any(s.finishes for s in services)
    final: dict[str, Any] = {}
    try:
        sup.start_all(ready, should_stop=lambda: interrupted["n"] > 0)
        collect_start = time.monotonic()
        watch = StartupWatch(run.run_dir / "logs", cfg.run.start_notice_s)
        with LiveView(cfg.name, cfg.run.max_env_steps) as view:
            while not sup.failed and not interrupted["n"]:
                sup.supervise()
                serve_requests(sup, cfg, run, metrics)
                # A timeout means the gateway is restarting; the supervisor brings it back
                # (under the Ray engine perhaps on another node: its address moves with it).
                control.address = run.endpoints["gateway"]["control"]
                with contextlib.suppress(Timeout):
                    status = control.request("status", timeout_s=2.0)
                autoscaler.tick(sup, status, metrics)
                scaling = autoscaler.describe()
                described = sup.describe()
                watch.check(status, described)
                for row in described:
                    row["detail"] = watch.details.get(row["name"], row["detail"])
                view.update(status, described, scaling)
                record = {k: v for k, v in status.items() if k not in ("spec", "rtt", "workers", "held_why")}
                if scaling:
                    record["autoscaler"] = {**autoscaler.last, "p99_mark_ms": autoscaler.p99_mark_ms}
                metrics.emit({"services": {p["name"]: p["state"] for p in sup.describe()}, **record})
                # A run with a finishing service (the trainer) ends when it finishes; the
                # step budget only stops collection (and the trainer, which then finishes).
                if sup.finished or (status.get("budget_reached") and not waits_for_finish):
                    break
                time.sleep(cfg.run.status_interval_s)
        if sup.failed:
            outcome = "failed"
            log.error("run failed: %s", sup.failed)
        elif interrupted["n"]:
            outcome = "interrupted"
            log.info("interrupted: draining and stopping")
        elapsed = time.monotonic() - collect_start
        if outcome == "completed":
            for block in FINALIZERS:
                if cfg.has(block) and getattr(getattr(cfg, block), "enabled", False):
                    finalizer = resolve(FINALIZERS, block, "finalizer")
                    final.update(
                        finalizer(cfg, control, run.run_dir, should_stop=lambda: interrupted["n"] > 0)
                    )
            if interrupted["n"]:  # Ctrl-C during the final evaluation: it was skipped
                outcome = "interrupted"
        status = drain(control, cfg, status, sup.supervise, lambda: sup.given_up("gateway"))
    finally:
        sup.stop(timeout_s=cfg.run.drain_timeout_s)
        control.close()
        metrics.close()
        engine.close()
    summary = write_summary(cfg, run.run_dir, status, max(elapsed, 1e-9), outcome, final)
    log.info("summary: %s", json.dumps({k: v for k, v in summary.items() if not isinstance(v, dict)}))
    log.info("wrote %s (total %.1f s)", run.run_dir / "summary.json", time.monotonic() - started)
    return 0 if outcome == "completed" else (130 if outcome == "interrupted" else 1)


if __name__ == "__main__":
    sys.exit(main())
