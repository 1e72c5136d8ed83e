"""Batched simulators at scale: the torch reach stepped in-process against the same envs
through the gateway and an inference server.

For N = 256, 1024 and 4096 envs of the torch reach (:mod:`sim_bridges.torch_reach`, one
tensor per state variable, CPU), two set-ups are built once and measured in turn (the
order rotates from repeat to repeat; the one not measured sits idle):

- **raw**: ``TorchReachEnv.step`` in this process with the policy network run by the
  inference server's own runtime (:mod:`inference.backends`, torch, one thread) in this
  process too: what a researcher playing a policy in Isaac Lab does, nothing recorded;
- **gateway**: the processes ``loopgate up`` starts (:func:`gateway.supervisor.prepare_run`,
  :class:`~gateway.supervisor.Supervisor`): one env worker hosting the ``torch_reach``
  backend (through the Isaac Lab adapter), the gateway recording every step durably
  (spool and local episode store, default ``chunk_steps``), and one inference server
  running the same network on the same runtime. Steps/s is the gateway's count of
  recorded, acknowledged steps over a window after warm-up; between windows the
  gateway is paused.

``batched.steps_per_s.gateway.nN`` has ``batched.steps_per_s.raw.nN`` as its baseline;
the team's goal on CPU is a ratio of at least 0.5 at 4096 envs. Episodes start at random
ages (``random_start``) in both, so resets and chunk cuts are spread over steps as in a
long run. ``batched.bytes_per_step.shm.nN`` and ``batched.bytes_per_step.frames.nN`` are
the observation bytes per batch (per step of the whole worker) that the gateway read in
place from shared memory (copied once, by the worker, into the ring) and that came as
socket frames (copied into the kernel and out again), from the gateway's own counters;
``batched.bytes_per_step.spool.nN`` and ``batched.bytes_per_step.store.nN`` the bytes per
batch the gateway wrote to its spool and its sink to the episode store (each step is
written twice: once before it is acknowledged, once in its chunk)::

    loopgate bench --only batched
"""

from __future__ import annotations

import logging
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from benchmarks.collect import SupervisedRun, interleave
from benchmarks.procs import available_cpus, describe_cpus
from benchmarks.records import Record

log = logging.getLogger(__name__)

NUM_ENVS = (256, 1024, 4096)
TARGET_N = 4096
TARGET = ">= 0.5"
"""The team's goal: through the gateway, at least half the simulator's in-process speed at 4096 envs."""
BYTES_NOTES = {
    "shm": "observation bytes per batch read in place from shared memory (copied once, into the ring)",
    "frames": "observation bytes per batch that came as socket frames (copied into the kernel and out)",
    "spool": "bytes per batch the gateway wrote to its spool (every step, before it is acknowledged)",
    "store": "bytes per batch the gateway's sink wrote to the local episode store (chunk batches)",
}
"""What each ``batched.bytes_per_step.<kind>.nN`` record counts."""
HIDDEN = (64, 64)
EPISODE_LENGTH = 100
START_TIMEOUT_S = 120.0

NAMES: tuple[str, ...] = tuple(
    name
    for n in NUM_ENVS
    for name in (
        f"batched.steps_per_s.raw.n{n}",
        f"batched.steps_per_s.gateway.n{n}",
        f"batched.bytes_per_step.shm.n{n}",
        f"batched.bytes_per_step.frames.n{n}",
        f"batched.bytes_per_step.spool.n{n}",
        f"batched.bytes_per_step.store.n{n}",
    )
)


def _windows(quick: bool) -> tuple[float, float]:
    """(warm-up, measured) seconds of each measurement."""
    return (0.5, 1.0) if quick else (1.0, 3.0)


def _inference_block(num_envs: int) -> dict[str, Any]:
    return {
        "enabled": True,
        "backend": "torch",
        "device": "cpu",
        "threads": 1,
        "deterministic": True,
        "max_batch": num_envs,
        "max_wait_us": 0,
        "network": {"hidden_sizes": list(HIDDEN), "activation": "tanh"},
    }


def _env_options() -> dict[str, Any]:
    return {"device": "cpu", "episode_length": EPISODE_LENGTH, "random_start": True}


def _config(num_envs: int) -> Any:
    """The experiment both set-ups share (the raw one uses its env options and network)."""
    from gateway.config import from_dict

    return from_dict(
        {
            "env": {
                "backend": "torch_reach",
                "workers": 1,
                "num_envs": num_envs,
                "seed": 0,
                "options": _env_options(),
            },
            "policy": {"kind": "inference"},
            "inference": _inference_block(num_envs),
            "gateway": {"host": "127.0.0.1", "transport": "tcp"},
        },
        name=f"bench-batched-n{num_envs}",
    )


class RawRun:
    """The torch reach and the policy in this process."""

    def __init__(self, num_envs: int) -> None:
        import numpy as np
        import torch

        from gateway.factory import experiment_spec
        from inference.backends import make_backend
        from sim_bridges.torch_reach import TorchReachConfig, TorchReachEnv

        torch.set_num_threads(1)
        spec = experiment_spec("torch_reach", _env_options())
        self.policy = make_backend(spec, _config(num_envs).inference).initial()
        self.env = TorchReachEnv(TorchReachConfig(**_env_options()), num_envs=num_envs, seed=0)
        self.obs, _ = self.env.reset()
        self.num_envs = num_envs
        self._eps = np.zeros((num_envs, *spec.action.shape), np.float32)
        self._torch = torch

    def _step(self) -> None:
        obs = {"policy": self.obs["policy"].numpy()}
        action = self._torch.from_numpy(self.policy.run(obs, self._eps))
        self.obs, *_ = self.env.step(action)

    def measure(self, warmup_s: float, window_s: float) -> float:
        end = time.perf_counter() + warmup_s
        while time.perf_counter() < end:
            self._step()
        steps, t0 = 0, time.perf_counter()
        while True:
            self._step()
            steps += 1
            now = time.perf_counter()
            if now - t0 >= window_s:
                break
        return steps * self.num_envs / (now - t0)

    def close(self) -> None:
        self.env.close()


class GatewayRun(SupervisedRun):
    """``loopgate up``'s processes for one torch reach worker, paused between windows."""

    def __init__(self, num_envs: int, run_dir: Path) -> None:
        note = (
            f"1 worker x {num_envs} envs (torch_reach), gateway recording every step, "
            f"1 inference server (torch, 1 thread, MLP {list(HIDDEN)})"
        )
        super().__init__(
            _config(num_envs), run_dir, note=note, start_timeout_s=START_TIMEOUT_S, request_timeout_s=10.0
        )
        self.num_envs = num_envs
        self.bytes: dict[str, list[float]] = {kind: [] for kind in BYTES_NOTES}

    def measure(self, warmup_s: float, window_s: float) -> float:
        """Steps/s over the window; the bytes each batch moved through shared memory and frames."""
        s0, s1, seconds = self.window(warmup_s, window_s)
        steps = s1["env_steps"] - s0["env_steps"]
        batches = max(steps / self.num_envs, 1.0)
        (w0,), (w1,) = s0["workers"], s1["workers"]
        self.bytes["shm"].append((w1["shm_bytes"] - w0["shm_bytes"]) / batches)
        self.bytes["frames"].append((w1["frame_bytes"] - w0["frame_bytes"]) / batches)
        self.bytes["spool"].append((s1["spool_bytes"] - s0["spool_bytes"]) / batches)
        self.bytes["store"].append((s1["sink_bytes"] - s0["sink_bytes"]) / batches)
        return float(steps) / seconds


def run(quick: bool, repeats: int) -> list[Record]:
    """Measure every N ``repeats`` times, raw and through the gateway interleaved."""
    cpus = available_cpus()
    warmup_s, window_s = _windows(quick)
    placement = f"all on cpus {describe_cpus(set(cpus))}"
    timing = f"median of {repeats} x {window_s:g} s after {warmup_s:g} s warm-up, {placement}"
    records: list[Record] = []
    for n in NUM_ENVS:
        values: dict[str, list[float]] = {"raw": [], "gateway": []}
        with tempfile.TemporaryDirectory(prefix="loopgate-bench-batched-") as tmp, ExitStack() as stack:
            gateway = GatewayRun(n, Path(tmp) / "run")
            stack.callback(gateway.close)
            gateway.start()
            raw = RawRun(n)
            stack.callback(raw.close)
            runners: dict[str, Any] = {"raw": raw, "gateway": gateway}
            interleave(runners, values, repeats, warmup_s, window_s, f"batched n{n}")
        raw_name = f"batched.steps_per_s.raw.n{n}"
        records += [
            Record.median_of(
                raw_name,
                values["raw"],
                "steps/s",
                note=f"{n} envs, policy MLP {list(HIDDEN)} in-process (torch, 1 thread); {timing}",
            ),
            Record.median_of(
                f"batched.steps_per_s.gateway.n{n}",
                values["gateway"],
                "steps/s",
                baseline=raw_name,
                note=f"{gateway.note}; {timing}",
                target=TARGET if n == TARGET_N else None,
            ),
        ]
        records += [
            Record.median_of(f"batched.bytes_per_step.{kind}.n{n}", gateway.bytes[kind], "B", note=note)
            for kind, note in BYTES_NOTES.items()
        ]
    return records
