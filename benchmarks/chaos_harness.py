"""The chaos harness's moving parts: a run's processes, the experiment, the faults.

:class:`Experiment` drives one run folder through ``loopgate up`` (and starts it again on
the same folder after the supervisor is killed); :func:`run_pids` finds every process
of the run by its command line (each names the run folder) and sorts them by kind;
:class:`Harness` injects one fault at a time and measures the time until the run
collects again with every service back::

    exp = Experiment(config_path, workdir, cfg)
    exp.up()
    harness = Harness(exp, random.Random(seed))
    harness.settle()                         # steps flowing; the baseline of processes
    record = harness.inject("kill.gateway")  # record.recover_s
    exp.stop()                               # Ctrl-C's path: drain, summary.json

Recovery is timed from the end of the fault (the SIGKILL, the SIGCONT, the freed disk,
the healed link, the last fuzzed message) until the gateway acknowledges new steps and
every kind of process is back to its count at the start (the killed one replaced).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import chaos_faults as faults
from benchmarks.chaos_check import shm_in_use
from gateway import lifeline
from gateway.protocol import RemoteError, Timeout
from gateway.services import TORCHRUN_MODULES

log = logging.getLogger("loopgate.chaos")

REPO = Path(__file__).resolve().parents[1]
NEEDS = {
    "inference": "inference",
    "replay": "replay",
    "trainer": "trainer-rank",
    "link": "link-worker",
    "all": "supervisor",
}


def classify(argv: list[str]) -> str:
    """The kind of a run's process, from the module it runs (``python -m MODULE``); by
    the last part of the name, so that a module moving between packages keeps its kind."""
    module = argv[argv.index("-m") + 1] if "-m" in argv[:-1] else ""
    if (module in ("gateway", "gateway.cli") and "up" in argv) or module.endswith("supervisor"):
        return "supervisor"
    if module in TORCHRUN_MODULES:
        return "torchrun"
    if module == "trainer" or module.endswith(".trainer"):
        return "trainer-rank"
    if module.endswith(("worker", ".worker")):
        return "link-worker" if "--connect" in argv else "worker"
    if "replay" in module:
        return "replay"
    if "inference" in module:
        return "inference"
    if "hub" in module:
        return "gateway"
    return "other"


def run_pids(run_dir: Path) -> dict[str, list[int]]:
    """Live processes of a run (their command line names its folder), by kind."""
    found: dict[str, list[int]] = {}
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace").split("\0")
            if str(run_dir) not in " ".join(argv) or "pgrep" in argv[0]:
                continue
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state == "Z":
            continue
        found.setdefault(classify(argv), []).append(int(entry))
    return {k: sorted(v) for k, v in found.items()}


@dataclass
class FaultRecord:
    kind: str
    at_s: float
    target: str = ""
    held_s: float = 0.0
    recover_s: float | None = None
    note: str = ""
    detail: dict[str, Any] = field(default_factory=dict)


class Experiment:
    """One run folder driven through ``loopgate up``, restartable on the same folder."""

    def __init__(self, config: Path, workdir: Path, cfg: dict[str, Any]) -> None:
        self.config, self.workdir, self.cfg = config, workdir, cfg
        self.run_dir = (workdir / "run").resolve()
        self.tmp = workdir / "tmp"
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.sup: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.owned: list[subprocess.Popen[bytes]] = []  # our own link workers
        self._control: Any = None
        self.started = time.monotonic()
        self.shm_used: set[str] = set()
        """Shared memory any process of the run was seen using (checked at the end)."""

    def env(self) -> dict[str, str]:
        return {**os.environ, "TMPDIR": str(self.tmp), "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl")}

    def up(self) -> None:
        self.starts += 1
        out = open(self.workdir / f"up-{self.starts}.log", "wb")  # noqa: SIM115 - owned by the child
        argv = [sys.executable, "-m", "gateway", "up", str(self.config), "--run-dir", str(self.run_dir)]
        # Own session (Ctrl-C at the terminal reaches the harness only); SIGTERM, the
        # graceful stop, if the harness dies first.
        self.sup = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env=self.env(),
            start_new_session=True,
            preexec_fn=lifeline.die_with_parent,
        )
        out.close()

    def link_worker(self, address: str, index: int) -> subprocess.Popen[bytes]:
        out = open(self.workdir / f"link-worker-{index}.log", "ab")  # noqa: SIM115 - owned by the child
        argv = [sys.executable, "-m", "gateway.worker", "--config", str(self.run_dir / "config.yaml")]
        argv += ["--connect", address, "--index", str(index)]
        proc = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env=self.env(),
            preexec_fn=lifeline.die_with_parent,
        )
        out.close()
        self.owned.append(proc)
        return proc

    def control(self) -> Any:
        from gateway.supervisor import ControlClient

        if self._control is None:
            port = self.cfg["gateway"]["control_port"]
            self._control = ControlClient(f"tcp://127.0.0.1:{port}")
        return self._control

    def status(self, timeout_s: float = 1.0) -> dict[str, Any]:
        try:
            return dict(self.control().request("status", timeout_s=timeout_s))
        except (Timeout, RemoteError):
            return {}

    def note_shm(self) -> None:
        self.shm_used |= shm_in_use(p for v in run_pids(self.run_dir).values() for p in v)

    def pids(self) -> dict[str, list[int]]:
        found = run_pids(self.run_dir)
        owned = {p.pid for p in self.owned}
        for kind in list(found):
            found[kind] = [p for p in found[kind] if p not in owned or kind == "link-worker"]
        return {k: v for k, v in found.items() if v}

    def wait(
        self,
        what: str,
        predicate: Callable[[], Any],
        timeout_s: float,
        interval: float = 0.2,
        *,
        sup_may_exit: bool = False,
    ) -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not sup_may_exit and self.sup is not None and self.sup.poll() is not None:
                tail = (self.workdir / f"up-{self.starts}.log").read_text(errors="replace").strip()
                raise TimeoutError(
                    f"loopgate up exited with {self.sup.returncode} while waiting for {what}: "
                    + " | ".join(tail.splitlines()[-3:])
                )
            value = predicate()
            if value:
                return value
            time.sleep(interval)
        raise TimeoutError(f"no {what} within {timeout_s:.0f} s")

    def stop(self, timeout_s: float = 120.0) -> int | None:
        """Ctrl-C's path: drain, stop every service, write summary.json."""
        self.note_shm()
        for proc in self.owned:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.owned:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        code = None
        if self.sup is not None and self.sup.poll() is None:
            self.sup.send_signal(signal.SIGINT)
            try:
                code = self.sup.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                log.error("loopgate up did not stop within %.0f s; killing it", timeout_s)
                self.sup.kill()
                self.sup.wait()
        if self._control is not None:
            self._control.close()
        return code

    def kill_everything(self) -> None:
        """Last resort at teardown: nothing of the run may outlive the harness."""
        for proc in [*self.owned, *([self.sup] if self.sup else [])]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        with contextlib.suppress(TimeoutError):
            self.wait("exit of the run's services", lambda: not run_pids(self.run_dir), 30, sup_may_exit=True)
        for pids in run_pids(self.run_dir).values():
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


# ------------------------------------------------------------------- faults


class Harness:
    """Injects faults into one :class:`Experiment` and measures recovery."""

    def __init__(self, exp: Experiment, rng: random.Random, recover_timeout_s: float = 120.0) -> None:
        self.exp, self.rng = exp, rng
        self.recover_timeout_s = recover_timeout_s
        self.baseline: dict[str, int] = {}
        self.margin = 0
        """Steps past a fault that show collection going on (two per env, set by settle)."""
        self.records: list[FaultRecord] = []
        self.problems: list[str] = []
        self.disks: dict[str, faults.DiskLimit] = {}
        self.proxy: faults.LinkProxy | None = None
        g = exp.cfg.get("gateway", {})
        self.peer_timeout_s = max(float(g.get("worker_timeout_s", 5.0)), 3 * float(g.get("heartbeat_s", 1.0)))

    def acked(self) -> int:
        return int(self.exp.status().get("acked_steps", -1))

    def worker_steps(self, pids: set[int]) -> int:
        """Env steps the gateway counts for the workers with these pids (their uids name the pid)."""
        workers = self.exp.status().get("workers", [])
        return sum(int(w["env_steps"]) for w in workers if any(f"-{pid}-" in w["uid"] for pid in pids))

    def link_steps(self) -> int:
        return self.worker_steps({p.pid for p in self.exp.owned})

    def healthy(self, after: int, killed: int | None = None) -> bool:
        """Every service back (as many of each kind as at the start, the killed one gone)
        and the gateway acknowledging new steps past ``after``."""
        pids = self.exp.pids()
        for kind, n in self.baseline.items():
            if len(pids.get(kind, [])) < n:
                return False
        if killed is not None and any(killed in v for v in pids.values()):
            return False
        # Two steps of every env: a gateway acknowledges the observations already on their
        # way even while no action can be had, so one batch proves nothing.
        return self.acked() > after + self.margin

    def settle(self, timeout_s: float = 180.0) -> None:
        """Wait for the run to collect with every planned service up; note the baseline."""
        self.exp.wait("steps acknowledged", lambda: self.acked() > 0, timeout_s, 0.5)
        if "trainer" in self.exp.cfg and self.exp.cfg["trainer"].get("enabled"):
            nproc = int(self.exp.cfg["trainer"].get("nproc", 1))
            self.exp.wait(
                "trainer ranks", lambda: len(self.exp.pids().get("trainer-rank", [])) >= nproc, timeout_s
            )
            self.exp.wait("a published policy version", lambda: self.trainer_progress()[2] > 0, timeout_s)
        time.sleep(1.0)
        self.margin = 2 * sum(int(w["num_envs"]) for w in self.exp.status().get("workers", []))
        self.baseline = {k: len(v) for k, v in self.exp.pids().items() if k != "other"}
        self.exp.note_shm()

    def available(self, kind: str) -> bool:
        if kind == "fuzz":
            return True
        what = kind.split(".", 1)[1]
        if kind.startswith("disk."):
            return what in self.disks
        if kind == "link.worker":
            return self.proxy is not None
        need = NEEDS.get(what, what)
        return self.baseline.get(need, 0) > 0

    def inject(self, kind: str) -> FaultRecord:
        rec = FaultRecord(kind=kind, at_s=round(time.monotonic() - self.exp.started, 1))
        self.exp.note_shm()
        before = self.exp.pids()
        try:
            getattr(self, "_" + kind.replace(".", "_"))(rec)
        except TimeoutError as exc:
            rec.note = f"did not recover: {exc}"
            self.problems.append(f"{kind} ({rec.target}): {rec.note}")
        except OSError as exc:  # the harness itself could not do it (e.g. a disk full before)
            rec.note = f"not injected: {exc}"
            self.problems.append(f"{kind} ({rec.target}): {rec.note}")
        if not kind.startswith("kill."):
            # A fault that kills nothing must not make anything crash: a restarted
            # service here is one that died of a full disk, a frozen peer or bad input.
            after = self.exp.pids()
            crashed = sorted(k for k, v in before.items() if k != "other" and set(v) - set(after.get(k, [])))
            if crashed:
                rec.detail["restarted"] = crashed
                self.problems.append(f"{kind} ({rec.target}): {', '.join(crashed)} died and was restarted")
        self.records.append(rec)
        log.info("%-16s %-14s recovered in %s s %s", kind, rec.target, rec.recover_s, rec.note)
        return rec

    def _recover(self, rec: FaultRecord, after: int, killed: int | None = None, t0: float = 0.0) -> None:
        t0 = t0 or time.monotonic()
        self.exp.wait("recovery", lambda: self.healthy(after, killed), self.recover_timeout_s)
        rec.recover_s = round(time.monotonic() - t0, 2)

    def _kill(self, rec: FaultRecord, kind: str) -> None:
        pids = self.exp.pids().get(kind, [])
        if not pids:
            raise TimeoutError(f"no {kind} process to kill")
        pid = self.rng.choice(pids)
        rec.target = f"{kind} {pid}"
        before = self.acked()
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        self._recover(rec, before, pid, t0)
        if kind == "worker":  # and its replacement steps
            new = set(self.exp.pids().get("worker", [])) - set(pids)
            self.exp.wait(
                "steps of the new worker", lambda: self.worker_steps(new) > 0, self.recover_timeout_s
            )
            rec.recover_s = round(time.monotonic() - t0, 2)

    def _kill_worker(self, rec: FaultRecord) -> None:
        self._kill(rec, "worker")

    def _kill_gateway(self, rec: FaultRecord) -> None:
        self._kill(rec, "gateway")

    def _kill_inference(self, rec: FaultRecord) -> None:
        self._kill(rec, "inference")

    def _kill_replay(self, rec: FaultRecord) -> None:
        self._kill(rec, "replay")

    def trainer_progress(self) -> tuple[float, int, int]:
        """``(unix time, updates, version)`` of the trainer's newest metrics record."""
        path = self.exp.run_dir / "metrics.jsonl"
        with contextlib.suppress(OSError), open(path, "rb") as f:
            f.seek(max(0, path.stat().st_size - (256 << 10)))
            for line in reversed(f.read().decode(errors="replace").splitlines()):
                if '"service": "trainer"' in line and '"version"' in line:
                    with contextlib.suppress(ValueError):
                        r = json.loads(line)
                        return float(r["t"]), int(r["updates"]), int(r["version"])
        return 0.0, 0, 0

    def _kill_trainer(self, rec: FaultRecord) -> None:
        """A rank dies: torchrun ends, ``loopgate up`` restarts the trainer, which resumes
        from its newest checkpoint; recovered once it reports updates again."""
        t_kill = time.time()
        t0 = time.monotonic()
        self._kill(rec, "trainer-rank")
        self._trainer_back(rec, t_kill, t0)

    def _trainer_back(self, rec: FaultRecord, t_kill: float, t0: float) -> None:
        """With a trainer in the run: wait until it reports updates again after ``t_kill``."""
        if not self.baseline.get("trainer-rank"):
            return
        first: list[int] = []

        def training() -> bool:
            t, updates, _ = self.trainer_progress()
            if t <= t_kill:
                return False
            if not first:
                first.append(updates)
            return updates > first[0]

        self.exp.wait("the restarted trainer's updates", training, self.recover_timeout_s)
        rec.recover_s = round(time.monotonic() - t0, 2)
        rec.detail["resumed_at_updates"] = first[0] if first else None

    def _kill_supervisor(self, rec: FaultRecord) -> None:
        """SIGKILL ``loopgate up``: everything of the run must end by itself; then
        ``loopgate up`` on the same run folder continues it."""
        sup = self.exp.sup
        assert sup is not None
        rec.target = f"supervisor {sup.pid}"
        before = self.acked()
        t_kill, t0 = time.time(), time.monotonic()
        sup.kill()
        sup.wait()
        owned = {p.pid for p in self.exp.owned}
        left = lambda: [p for v in run_pids(self.exp.run_dir).values() for p in v if p not in owned]  # noqa: E731
        try:
            self.exp.wait("end of every service", lambda: not left(), 45, sup_may_exit=True)
        except TimeoutError:
            self.problems.append(f"kill.supervisor: processes left 45 s later: {left()}")
            raise
        rec.detail["orphans_gone_s"] = round(time.monotonic() - t0, 2)
        self.exp.up()
        self._recover(rec, before, sup.pid, t0)
        self._trainer_back(rec, t_kill, t0)

    def _kill_all(self, rec: FaultRecord) -> None:
        """SIGKILL every process of the run at once (a host crash, the OOM killer, a
        ``kill -9`` of the group): no service gets to stop or checkpoint; then
        ``loopgate up`` on the same run folder continues it."""
        owned = {p.pid for p in self.exp.owned}
        pids = [p for v in run_pids(self.exp.run_dir).values() for p in v if p not in owned]
        rec.target = f"{len(pids)} processes"
        before = self.acked()
        t_kill, t0 = time.time(), time.monotonic()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        assert self.exp.sup is not None
        self.exp.sup.wait()

        def gone() -> bool:
            alive = {p for v in run_pids(self.exp.run_dir).values() for p in v}
            return not alive & set(pids)

        self.exp.wait("end of every process", gone, 30, sup_may_exit=True)
        self.exp.up()
        self._recover(rec, before, None, t0)
        self._trainer_back(rec, t_kill, t0)

    def _stop(self, rec: FaultRecord, kind: str) -> None:
        pids = self.exp.pids().get(kind, [])
        if not pids:
            raise TimeoutError(f"no {kind} process to stop")
        pid = self.rng.choice(pids)
        rec.held_s = round(self.peer_timeout_s + self.rng.uniform(1.0, 3.0), 1)
        rec.target = f"{kind} {pid}"
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(rec.held_s)
        finally:
            os.kill(pid, signal.SIGCONT)
        t0 = time.monotonic()
        steps = self.worker_steps({pid})
        self._recover(rec, self.acked(), t0=t0)
        if kind == "worker":  # the thawed worker itself steps again (its count may restart at 0)
            self.exp.wait(
                "steps of the thawed worker", lambda: self.worker_steps({pid}) not in (steps, 0), 60
            )
            rec.recover_s = round(time.monotonic() - t0, 2)

    def _stop_worker(self, rec: FaultRecord) -> None:
        self._stop(rec, "worker")

    def _stop_gateway(self, rec: FaultRecord) -> None:
        self._stop(rec, "gateway")

    def _stop_inference(self, rec: FaultRecord) -> None:
        self._stop(rec, "inference")

    def _stop_replay(self, rec: FaultRecord) -> None:
        self._stop(rec, "replay")

    def _disk(self, rec: FaultRecord, where: str) -> None:
        disk = self.disks[where]
        rec.target = f"{where}/ ({disk.free_bytes() >> 20} MiB free)"
        rec.held_s = round(self.rng.uniform(4.0, 8.0), 1)
        held: float | None = None
        reason = None
        try:
            rec.detail["filled_mib"] = disk.fill() >> 20
            t_full = time.monotonic()
            while time.monotonic() - t_full < rec.held_s:
                status = self.exp.status(timeout_s=0.5)
                if status.get("held") and held is None:
                    held, reason = round(time.monotonic() - t_full, 2), status["held"]
                time.sleep(0.2)
        finally:
            disk.free()  # whatever happened, the disk gets its room back
        rec.detail.update({"held_after_s": held, "held_reason": reason})
        if held is None:
            rec.note = "collection was not held while the disk was full"
            self.problems.append(f"{rec.kind}: {rec.note}")
        self._recover(rec, self.acked())

    def _disk_replay(self, rec: FaultRecord) -> None:
        self._disk(rec, "replay")

    def _disk_spool(self, rec: FaultRecord) -> None:
        self._disk(rec, "spool")

    def _link_worker(self, rec: FaultRecord) -> None:
        """Delay, stall past the peers' timeouts, drop bytes, and cut the worker's link."""
        proxy = self.proxy
        assert proxy is not None
        rng = self.rng
        rec.target = "worker <-> gateway"
        t0 = time.monotonic()
        proxy.set(delay_s=rng.uniform(0.02, 0.2), jitter_s=rng.uniform(0.0, 0.1))
        time.sleep(rng.uniform(2.0, 4.0))
        proxy.set(stall=True)
        time.sleep(self.peer_timeout_s + rng.uniform(1.0, 3.0))
        proxy.set(drop_p=rng.uniform(0.05, 0.3))
        time.sleep(rng.uniform(1.0, 3.0))
        proxy.heal()
        for _ in range(rng.randrange(1, 4)):
            proxy.cut()
            time.sleep(rng.uniform(0.3, 1.0))
        rec.held_s = round(time.monotonic() - t0, 1)
        rec.detail.update(proxy.counters)
        before = self.link_steps()
        t1 = time.monotonic()
        self.exp.wait("link worker steps", lambda: self.link_steps() > before, self.recover_timeout_s)
        self._recover(rec, self.acked(), t0=t1)

    def _fuzz(self, rec: FaultRecord, n: int | None = None) -> None:
        """``n`` malformed messages on every endpoint at once; good peers measured."""
        n = n or self.fuzz_n
        endpoints = json.loads((self.exp.run_dir / "endpoints.json").read_text())
        targets = list(faults.endpoints_to_fuzz(endpoints))
        pids_before = self.exp.pids()
        a0, t0 = self.acked(), time.monotonic()
        time.sleep(3.0)
        rate_before = (self.acked() - a0) / (time.monotonic() - t0)
        results: list[faults.FuzzResult] = []
        threads = [
            threading.Thread(
                target=lambda t=t, a=a, i=i: results.append(
                    faults.fuzz_endpoint(a, n=n, seed=self.rng.randrange(1 << 30) + i, target=t)
                ),
                daemon=True,
            )
            for i, (t, a) in enumerate(targets)
        ]
        a1, t1 = self.acked(), time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        rate_during = (self.acked() - a1) / max(time.monotonic() - t1, 1e-9)
        rec.target = f"{len(targets)} endpoints x {n}"
        rec.held_s = round(time.monotonic() - t1, 1)
        rec.detail = {
            "steps_per_s_before": round(rate_before, 1),
            "steps_per_s_during": round(rate_during, 1),
            "endpoints": [r.to_dict() for r in results],
        }
        restarted = {k: v for k, v in self.exp.pids().items() if v != pids_before.get(k)}
        if restarted:
            self.problems.append(f"fuzz: processes changed under fuzzing: {restarted} (before {pids_before})")
        short = [r.target for r in results if r.sent < n]
        if short:
            self.problems.append(f"fuzz: fewer than {n} messages went to {short}")
        if rate_during <= 0:
            self.problems.append("fuzz: no step was acknowledged while fuzzing")
        unanswered = [name for name, a, m in faults.good_requests(endpoints) if not faults.answers(a, m)]
        rec.detail["good_requests_unanswered"] = unanswered
        if unanswered:
            self.problems.append(f"fuzz: no answer to a well-formed request afterwards from {unanswered}")
        self._recover(rec, self.acked())

    fuzz_n = 10_000
