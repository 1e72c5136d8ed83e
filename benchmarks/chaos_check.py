"""What the chaos harness checks after a run, by reading the run folder back.

Nothing here trusts a counter that a killed process kept in memory: steps are counted
from the stored chunks themselves (the replay log, or the local episode store), and
compared with what the gateway acknowledged (its spool-backed counter, recovered on
every restart, as ``metrics.jsonl`` and ``summary.json`` report it)::

    report = check_run(run_dir, started_at=t0, tmp_dir=private_tmp)
    report.problems          # [] when every promise held
    report.figures           # acked / stored / lost / duplicate steps, episodes ...

The promises checked:

- every acknowledged step is stored exactly once: ``stored == acked``, no step stored
  twice, ``spooled_steps == 0`` after the final stop, and no gap inside any episode
  (an episode's steps are taken one after the other, each only once the step before
  was acknowledged, so a missing index below a stored one is an acknowledged step lost);
- the gateway's acknowledged counter never goes backwards, across its restarts;
- every episode is closed (its last stored chunk is final, ending ``terminated``,
  ``truncated`` or ``interrupted``), none left open;
- policy versions never go backwards: the trainer's published version, each inference
  server's served version while it lives, and the version stored with each env's steps;
- no process of the run is left, no temporary files and no shared memory.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gateway.metrics import read_metrics
from gateway.protocol import Message
from gateway.store import EpisodeStore

SHM = Path("/dev/shm")
PERSISTENT_CACHES = ("torchinductor_",)
"""Folders in ``TMPDIR`` that libraries keep across processes by design (not leftovers)."""


@dataclass
class CheckReport:
    figures: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def fail(self, text: str) -> None:
        self.problems.append(text)


def stored_chunks(run_dir: Path) -> Iterator[Message]:
    """Every chunk the run stored (replay log first, else the episode store), online only."""
    log_dir = run_dir / "replay" / "log"
    if log_dir.is_dir():
        from trainer.replay.log import read_log

        for msg in read_log(log_dir):
            if msg.meta.get("source", "online") == "online":
                yield msg
    elif (run_dir / "episodes").is_dir():
        yield from EpisodeStore(run_dir / "episodes", readonly=True).chunks()


def audit_chunks(chunks: Iterable[Message], report: CheckReport) -> dict[str, int]:
    """Count unique and duplicate steps, gaps, open episodes and version regressions."""
    steps: dict[str, list[int]] = {}
    ends: dict[str, tuple[int, str | None]] = {}
    versions: dict[tuple[str, int], list[tuple[float, int]]] = {}
    chunks_read = 0
    for msg in chunks:
        chunks_read += 1
        meta = msg.meta
        episode = str(meta["episode_id"])
        idx = [int(s) for s in msg.arrays["step"].tolist()]
        steps.setdefault(episode, []).extend(idx)
        last = max(idx)
        if meta.get("final") and (episode not in ends or last >= ends[episode][0]):
            ends[episode] = (last, meta.get("end"))
        if not meta.get("eval"):
            key = (str(meta.get("worker")), int(meta.get("env", 0)))
            t = np.asarray(msg.arrays["t_action"], dtype=np.float64)
            v = np.asarray(msg.arrays["policy_version"], dtype=np.int64)
            versions.setdefault(key, []).extend(zip(t.tolist(), v.tolist()))
    unique = duplicates = gaps = open_eps = 0
    for episode, idx in steps.items():
        seen = set(idx)
        unique += len(seen)
        duplicates += len(idx) - len(seen)
        missing = (max(seen) + 1) - len(seen) if seen else 0
        if missing:
            gaps += missing
            if gaps == missing:
                report.fail(f"episode {episode}: {missing} step(s) missing below step {max(seen)}")
        end = ends.get(episode)
        if end is None or end[0] != max(seen) or end[1] not in ("terminated", "truncated", "interrupted"):
            open_eps += 1
            if open_eps == 1:
                report.fail(f"episode {episode} is not closed (last step {max(seen)}, final chunk {end})")
    backwards = 0
    for (worker, env), pairs in versions.items():
        pairs.sort()
        v = np.array([p[1] for p in pairs])
        drops = int(np.sum(np.diff(v) < 0)) if len(v) > 1 else 0
        if drops and not backwards:
            report.fail(
                f"worker {worker} env {env}: the acting policy version went backwards {drops} time(s)"
            )
        backwards += drops
    return {
        "chunks": chunks_read,
        "episodes": len(steps),
        "stored_steps": unique,
        "duplicate_steps": duplicates,
        "gap_steps": gaps,
        "open_episodes": open_eps,
        "stored_version_regressions": backwards,
    }


def audit_metrics(run_dir: Path, report: CheckReport) -> dict[str, int]:
    """The gateway's acknowledged counter and every published or served version, in time order."""
    records = sorted(read_metrics(run_dir / "metrics.jsonl"), key=lambda r: r.get("t", 0))
    acked_max = 0
    acked_drops = 0
    trainer_version = 0
    trainer_drops = 0
    served: dict[str, tuple[int, int]] = {}  # service -> (requests so far, version)
    served_drops = 0
    for r in records:
        service = r.get("service")
        if service == "gateway" and "acked_steps" in r:
            acked = int(r["acked_steps"])
            if acked < acked_max:
                acked_drops += 1
                if acked_drops == 1:
                    report.fail(f"the gateway's acknowledged count went back from {acked_max} to {acked}")
            acked_max = max(acked_max, acked)
        elif service == "trainer" and "version" in r:
            if int(r["version"]) < trainer_version:
                trainer_drops += 1
                if trainer_drops == 1:
                    report.fail(f"the trainer's version went back from {trainer_version} to {r['version']}")
            trainer_version = max(trainer_version, int(r["version"]))
        elif str(service).startswith("inference-") and "version" in r:
            # A restarted server starts from its initial weights (its request counter
            # starts again); within one life its version must only grow.
            requests, version = int(r.get("requests", 0)), int(r["version"])
            prev = served.get(str(service))
            if prev is not None and requests >= prev[0] and version < prev[1]:
                served_drops += 1
                report.fail(f"{service} went back from version {prev[1]} to {version} while running")
            served[str(service)] = (requests, version)
    return {
        "acked_max_seen": acked_max,
        "acked_regressions": acked_drops,
        "trainer_version": trainer_version,
        "trainer_version_regressions": trainer_drops,
        "served_version_regressions": served_drops,
    }


def run_processes(run_dir: Path) -> list[str]:
    """Command lines of live processes naming ``run_dir`` (every service of a run does)."""
    found = subprocess.run(["pgrep", "-af", str(run_dir)], capture_output=True, text=True)
    return [line for line in found.stdout.splitlines() if "pgrep" not in line]


def shm_in_use(pids: Iterable[int]) -> set[str]:
    """Shared-memory files (``/dev/shm/...``) these processes have open or mapped. Only
    those are the run's: on a shared machine other programs make their own there."""
    found: set[str] = set()
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
                if path.startswith(f"{SHM}/"):
                    found.add(path.removesuffix(" (deleted)"))
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith(f"{SHM}/"):
                        found.add(target.removesuffix(" (deleted)"))
        except OSError:
            continue
    return found


def leftovers(run_dir: Path, tmp_dir: Path | None, shm_used: set[str]) -> list[str]:
    """Temporary files the run's processes left: in their private ``TMPDIR``, shared
    memory they used that still exists, and ``*.tmp`` in the run folder."""
    found: list[str] = []
    if tmp_dir is not None and tmp_dir.is_dir():
        for p in sorted(tmp_dir.rglob("*")):
            rel = p.relative_to(tmp_dir)
            # torch keeps its compile cache there on purpose, for every later process.
            if not rel.parts[0].startswith(PERSISTENT_CACHES):
                found.append(f"TMPDIR/{rel}")
    found += sorted(path for path in shm_used if os.path.exists(path))
    found += [str(p.relative_to(run_dir)) for p in run_dir.rglob("*.tmp")]
    return found


def check_run(
    run_dir: Path,
    *,
    tmp_dir: Path | None = None,
    shm_used: set[str] | None = None,
    require_idle: bool = True,
) -> CheckReport:
    """Every check above on a stopped run; figures and problems in the report."""
    report = CheckReport()
    summary_path = run_dir / "summary.json"
    summary: dict[str, Any] = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    if not summary:
        report.fail("no summary.json: the last `loopgate up` did not end by itself")
    counted = audit_chunks(stored_chunks(run_dir), report)
    seen = audit_metrics(run_dir, report)
    acked = int(summary.get("acked_steps", seen["acked_max_seen"]))
    spooled = int(summary.get("spooled_steps", 0))
    stored = counted["stored_steps"]
    lost = max(0, acked - stored) + counted["gap_steps"]
    report.figures.update(counted)
    report.figures.update(seen)
    report.figures.update(
        {
            "acked_steps": acked,
            "spooled_steps": spooled,
            "lost_steps": lost,
            "summary_lost_steps": summary.get("lost_steps"),
            "summary_duplicate_steps": summary.get("duplicate_steps"),
            "outcome": summary.get("outcome"),
        }
    )
    if spooled:
        report.fail(f"{spooled} acknowledged step(s) still in the spool after the final stop")
    if acked != stored:
        report.fail(f"acknowledged {acked} steps but {stored} are stored")
    if seen["acked_max_seen"] > stored:
        report.fail(f"the gateway once reported {seen['acked_max_seen']} acknowledged, only {stored} stored")
    if counted["duplicate_steps"]:
        report.fail(f"{counted['duplicate_steps']} step(s) stored more than once")
    if require_idle:
        left = run_processes(run_dir)
        report.figures["processes_left"] = len(left)
        if left:
            report.fail(f"{len(left)} process(es) of the run still alive: {left[:3]}")
    files = leftovers(run_dir, tmp_dir, shm_used or set())
    report.figures["files_left"] = len(files)
    if files:
        report.fail(f"{len(files)} temporary file(s) left: {files[:5]}")
    return report


def rss_and_fds(pid: int) -> tuple[int, int] | None:
    """Resident set size (bytes) and open file descriptors of ``pid``, or None if gone."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            rss_pages = int(f.read().split()[1])
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return rss_pages * os.sysconf("SC_PAGE_SIZE"), fds
