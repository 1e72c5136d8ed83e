"""mjlab workers in mjlab's own venv collect through the gateway (``env.python``).

Real processes throughout: ``loopgate up`` in loopgate's venv (MuJoCo 4) reads the env
spec from, and starts its worker with, ``.venv-mjlab/bin/python`` (mjlab 1.6 on MuJoCo
3.11 and Warp's CPU device), and every step the worker sends reaches the episode store.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.conftest import loopgate, time_left
from tests.test_mjlab_conformance import MJLAB_PYTHON, mjlab_env
from trainer.replay.export import run_episodes

pytestmark = pytest.mark.e2e

LIMIT = 5
"""Episode limit of these runs (steps), so episodes end by time-out within the budget."""


@pytest.mark.timeout(300)
def test_mjlab_worker_in_its_own_venv_collects_through_the_gateway(tmp_path):
    assert MJLAB_PYTHON.exists(), f"{MJLAB_PYTHON} is missing: `make install` creates the mjlab venv"
    run = tmp_path / "run"
    out = loopgate(
        "up",
        "configs/mjlab_cartpole.yaml",
        "--run-dir",
        str(run),
        "--max-env-steps",
        "48",
        "--set",
        "env.num_envs=4",
        "--set",
        f"env.options.max_episode_steps={LIMIT}",
        timeout=time_left(),
        env={k: v for k, v in mjlab_env().items() if k in ("CUDA_VISIBLE_DEVICES", "WARP_CACHE_PATH")},
    )
    assert out.returncode == 0, out.stderr[-4000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["outcome"] == "completed"
    assert summary["env_steps"] >= 48
    assert summary["stored_steps"] == summary["acked_steps"] == summary["env_steps"]
    assert summary["lost_steps"] == 0 and summary["duplicate_steps"] == 0
    spec = json.loads((run / "spec.json").read_text())
    assert spec["name"] == "Mjlab-Cartpole-Balance"
    assert set(spec["observation"]) == {"policy", "critic"}  # mjlab's actor group under Isaac Lab's name
    assert spec["max_episode_steps"] == LIMIT
    worker_log = (run / "logs" / "worker-0.log").read_text()
    assert "Warp" in worker_log and "mujoco_warp" in worker_log, worker_log[-2000:]

    episodes = run_episodes(run)
    ended = [e for e in episodes if e.end is not None and e.end != "interrupted"]
    assert len(ended) >= 4, [(e.episode_id, e.end, e.num_steps) for e in episodes]
    for episode in ended:
        # A time-out is a truncation; no terminal observation exists, so none is stored, and
        # the reset observation the env returned starts the next episode instead.
        assert episode.end == "truncated" and episode.num_steps == LIMIT
        assert not any(k.startswith("final_obs/") for k in episode.arrays)
        assert episode.arrays["obs/policy"].shape == (LIMIT, 5)
        assert episode.arrays["truncated"][-1] and not episode.arrays["truncated"][:-1].any()
        assert not episode.arrays["terminated"].any()
        assert np.all(np.abs(episode.arrays["action"]) <= 1.0)  # clip_actions: 1.0 in the config
