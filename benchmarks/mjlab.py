"""mjlab throughput: the simulator stepped directly against the same envs through the gateway.

mjlab (Isaac Lab's env API on MuJoCo Warp, here on Warp's CPU device) is the simulator
that proves loopgate's Isaac Lab code path on machines without a GPU. For N = 64 and
256 envs of ``Mjlab-Cartpole-Balance``, two set-ups are built once and measured in turn
(the order rotates from repeat to repeat; the one not measured sits idle):

- **raw**: ``ManagerBasedRlEnv.step`` with random torch actions in one process of the
  mjlab venv (:mod:`benchmarks.mjlab_peer`), nothing else;
- **gateway**: the processes ``loopgate up`` starts (:func:`gateway.supervisor.prepare_run`,
  :class:`~gateway.supervisor.Supervisor`): a gateway with a random policy in-process
  recording every step (spool and local episode store), and one env worker hosting the
  ``mjlab`` backend (:mod:`sim_bridges.batched`: tensors to numpy, checks) in the mjlab
  venv (``env.python``). Steps/s is the gateway's count of recorded, acknowledged steps over a
  window after warm-up; between windows the gateway is paused.

``mjlab.steps_per_s.gateway.nN`` has ``mjlab.steps_per_s.raw.nN`` as its baseline, so its
ratio is the share of the simulator's own speed that survives the trip through loopgate.
Warp kernels are cached under ``.venv-mjlab/warp-cache`` (``WARP_CACHE_PATH``)::

    loopgate bench --only mjlab
"""

from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from benchmarks.collect import SupervisedRun, interleave
from benchmarks.procs import available_cpus, describe_cpus, tied
from benchmarks.records import Record

log = logging.getLogger(__name__)

NUM_ENVS = (64, 256)
TASK = "Mjlab-Cartpole-Balance"
REPO = Path(__file__).resolve().parents[1]
MJLAB_PYTHON = REPO / ".venv-mjlab" / "bin" / "python"
START_TIMEOUT_S = 240.0
"""Starting a set-up: importing mjlab, building the env, and on a first run compiling Warp's kernels."""

NAMES: tuple[str, ...] = tuple(
    f"mjlab.steps_per_s.{kind}.n{n}" for n in NUM_ENVS for kind in ("raw", "gateway")
)


def _windows(quick: bool) -> tuple[float, float]:
    """(warm-up, measured) seconds of each measurement (mjlab steps ~20 batches/s on a CPU)."""
    return (0.5, 1.5) if quick else (1.0, 4.0)


def _mjlab_env() -> dict[str, str]:
    return {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "",
        "WARP_CACHE_PATH": os.environ.get("WARP_CACHE_PATH", str(REPO / ".venv-mjlab" / "warp-cache")),
    }


class RawRun:
    """mjlab stepped directly in the mjlab venv (:mod:`benchmarks.mjlab_peer`)."""

    def __init__(self, num_envs: int) -> None:
        if not MJLAB_PYTHON.exists():
            raise RuntimeError(f"{MJLAB_PYTHON} is missing: `make install` creates the mjlab venv")
        self.proc = subprocess.Popen(
            [str(MJLAB_PYTHON), "-m", "benchmarks.mjlab_peer", "--num-envs", str(num_envs), "--task", TASK],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            **tied(_mjlab_env()),
        )
        line = self._line(START_TIMEOUT_S, "the mjlab peer to build its env")
        if line != "ready":
            raise RuntimeError(f"mjlab peer answered {line!r} instead of 'ready'")

    def _line(self, timeout_s: float, what: str) -> str:
        assert self.proc.stdout is not None
        log.info("waiting up to %.0f s for %s", timeout_s, what)
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        if not ready:
            raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"mjlab peer exited with {self.proc.wait(timeout=5)} while waiting for {what}")
        return line.strip()

    def measure(self, warmup_s: float, window_s: float) -> float:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"measure {warmup_s} {window_s}\n")
        self.proc.stdin.flush()
        reply = json.loads(self._line(warmup_s + window_s + 60.0, "a raw mjlab measurement"))
        if "error" in reply:
            raise RuntimeError(f"mjlab peer: {reply['error']}")
        return float(reply["steps_per_s"])

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)


class GatewayRun(SupervisedRun):
    """``loopgate up``'s processes for one mjlab worker of ``num_envs`` envs, paused between windows."""

    def __init__(self, num_envs: int, run_dir: Path) -> None:
        from gateway.config import from_dict

        cfg = from_dict(
            {
                "env": {
                    "backend": "mjlab",
                    "python": str(MJLAB_PYTHON),
                    "workers": 1,
                    "num_envs": num_envs,
                    "seed": 0,
                    "options": {"task": TASK, "device": "cpu", "clip_actions": 1.0},
                },
                "policy": {"kind": "random"},
                "gateway": {"host": "127.0.0.1", "transport": "tcp"},
            },
            name=f"bench-mjlab-n{num_envs}",
        )
        self._saved = {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "WARP_CACHE_PATH")}
        os.environ.update({k: _mjlab_env()[k] for k in self._saved})  # the worker inherits them
        note = f"1 worker x {num_envs} envs in the mjlab venv, random policy in the gateway"
        super().__init__(cfg, run_dir, note=note, start_timeout_s=START_TIMEOUT_S)

    def close(self) -> None:
        try:
            super().close()
        finally:
            for key, value in self._saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def run(quick: bool, repeats: int) -> list[Record]:
    """Measure each N ``repeats`` times, raw and through the gateway interleaved."""
    cpus = available_cpus()
    warmup_s, window_s = _windows(quick)
    placement = f"all on cpus {describe_cpus(set(cpus))}"
    records: list[Record] = []
    for n in NUM_ENVS:
        values: dict[str, list[float]] = {"raw": [], "gateway": []}
        with tempfile.TemporaryDirectory(prefix="loopgate-bench-mjlab-") as tmp, ExitStack() as stack:
            raw = RawRun(n)
            stack.callback(raw.close)
            gateway = GatewayRun(n, Path(tmp) / "run")
            stack.callback(gateway.close)
            gateway.start()
            runners: dict[str, Any] = {"raw": raw, "gateway": gateway}
            interleave(runners, values, repeats, warmup_s, window_s, f"mjlab n{n}")
            note = gateway.note
        timing = f"median of {repeats} x {window_s:g} s after {warmup_s:g} s warm-up, {placement}"
        raw_name = f"mjlab.steps_per_s.raw.n{n}"
        records += [
            Record.median_of(
                raw_name,
                values["raw"],
                "steps/s",
                note=f"{TASK}, {n} envs, ManagerBasedRlEnv.step in one process, Warp on the CPU; {timing}",
            ),
            Record.median_of(
                f"mjlab.steps_per_s.gateway.n{n}",
                values["gateway"],
                "steps/s",
                baseline=raw_name,
                note=f"{note}; {timing}",
            ),
        ]
    return records
