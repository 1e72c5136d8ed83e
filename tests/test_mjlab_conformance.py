"""The ``mjlab`` backend passes the episode-backend conformance suite, with a real mjlab.

mjlab pins MuJoCo 3.11 and lives in its own venv (``.venv-mjlab``, made by ``make
install``). Run from loopgate's venv, this module has one test: it runs this same file
with that venv's pytest and fails with its output when anything there fails. Run in the
mjlab venv, it is the suite itself (real mjlab, real MuJoCo Warp on the CPU).
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conformance.episode_backend import EpisodeBackendConformance

REPO = Path(__file__).resolve().parents[1]
MJLAB_PYTHON = REPO / ".venv-mjlab" / "bin" / "python"
WARP_CACHE = REPO / ".venv-mjlab" / "warp-cache"
SUITE_TIMEOUT_S = 240
"""Budget for the suite in the mjlab venv, including the first Warp kernel compile."""


def mjlab_env() -> dict[str, str]:
    """Environment for processes in the mjlab venv: CPU Warp with kernels cached in the venv."""
    return {**os.environ, "CUDA_VISIBLE_DEVICES": "", "WARP_CACHE_PATH": str(WARP_CACHE)}


try:
    import mjlab  # noqa: F401
except ImportError:
    HAVE_MJLAB = False
else:
    HAVE_MJLAB = True


if not HAVE_MJLAB:

    @pytest.mark.conformance
    @pytest.mark.timeout(SUITE_TIMEOUT_S + 30)
    def test_mjlab_backend_conformance_suite_passes_in_the_mjlab_venv() -> None:
        assert MJLAB_PYTHON.exists(), f"{MJLAB_PYTHON} is missing: `make install` creates the mjlab venv"
        proc = subprocess.run(
            [
                str(MJLAB_PYTHON),
                "-m",
                "pytest",
                str(Path(__file__).relative_to(REPO)),
                "-q",
                "-p",
                "no:cacheprovider",
            ],
            cwd=REPO,
            env=mjlab_env(),
            capture_output=True,
            text=True,
            timeout=SUITE_TIMEOUT_S,
        )
        tail = (proc.stdout + proc.stderr)[-6000:]
        assert proc.returncode == 0, f"the suite failed in the mjlab venv:\n{tail}"
        passed = re.search(r"(\d+) passed", proc.stdout)
        assert passed and int(passed.group(1)) >= 18 and "skipped" not in proc.stdout, tail

else:
    from sim_bridges.mjlab import MjlabBackend, MjlabConfig

    class TestMjlabConformance(EpisodeBackendConformance):
        num_envs = 3
        short_episode_steps = 5

        def make_backend(self, num_envs: int, seed: int, *, max_episode_steps: int | None = None) -> Any:
            config = MjlabConfig(task="Mjlab-Cartpole-Balance", max_episode_steps=max_episode_steps)
            return MjlabBackend(config, num_envs=num_envs, seed=seed)

    @pytest.fixture(scope="module")
    def cartpole() -> Any:
        backend = MjlabBackend(MjlabConfig(max_episode_steps=4), num_envs=3, seed=0)
        yield backend
        backend.close()

    @pytest.mark.conformance
    def test_mjlab_groups_arrive_under_isaac_lab_names(cartpole: Any) -> None:
        assert set(cartpole.spec.observation) == {"policy", "critic"}
        assert cartpole.spec.observation["policy"].shape == (5,)
        assert cartpole.spec.control_hz == pytest.approx(20.0)
        assert cartpole.spec.max_episode_steps == 4
        obs, _ = cartpole.reset(seed=1)
        assert obs["policy"].dtype == np.float32 and obs["policy"].shape == (3, 5)

    @pytest.mark.conformance
    def test_mjlab_time_outs_are_truncations_and_log_comes_only_with_resets(cartpole: Any) -> None:
        cartpole.reset(seed=2)
        zero = np.zeros((3, 1), np.float32)
        for t in range(1, 9):
            _, _, terminated, truncated, info = cartpole.step(zero)
            done = terminated | truncated
            if t % 4 == 0:
                assert truncated.all() and not terminated.any(), f"step {t}: the limit is a time-out"
                assert "log" in info and "Episode_Termination/time_out" in info["log"]
                assert info["log"]["Episode_Termination/time_out"] == pytest.approx(3.0)
            else:
                assert not done.any(), f"step {t}: nothing ends before the limit"
                assert "log" not in info, f"step {t}: extras['log'] forwarded without a reset"
            assert "final_obs" not in info

    @pytest.mark.conformance
    def test_mjlab_flags_handed_out_stay_when_the_env_refills_its_buffers(cartpole: Any) -> None:
        cartpole.reset(seed=3)
        zero = np.zeros((3, 1), np.float32)
        kept = [cartpole.step(zero) for _ in range(4)]
        assert [bool(k[3].all()) for k in kept] == [False, False, False, True]
        assert len({id(k[3]) for k in kept}) == 4

    @pytest.mark.conformance
    def test_mjlab_unknown_task_is_refused_with_the_known_ones() -> None:
        with pytest.raises(ValueError, match=r"unknown mjlab task 'Mjlab-Nope'.*Mjlab-Cartpole-Balance"):
            MjlabBackend(MjlabConfig(task="Mjlab-Nope"), num_envs=1)

    @pytest.mark.conformance
    def test_mjlab_group_missing_from_the_task_is_refused() -> None:
        with pytest.raises(ValueError, match=r"groups \['policy'\] are not in the env.*'actor'"):
            MjlabBackend(MjlabConfig(groups={"policy": "policy"}), num_envs=1)
