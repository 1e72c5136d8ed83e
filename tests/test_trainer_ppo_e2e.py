"""PPO through the whole loop under ``loopgate up``: sync rounds, the rollout table drained
each round by rank 0 and broadcast to two FSDP ranks (gloo), a version per round."""

from __future__ import annotations

import pytest

from tests.conftest import REPO
from tests.test_trainer_e2e import finish, trainer_records, up

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(300)
def test_ppo_trains_one_version_per_round_on_that_versions_steps(tmp_path):
    run = tmp_path / "run"
    _, summary = finish(
        up(
            REPO / "configs" / "reach_ppo.yaml",
            run,
            "--set",
            "trainer.max_updates=120",
            "--set",
            "trainer.eval_every=0",
            "--set",
            "trainer.final_eval_episodes=0",
        ),
        run,
    )
    assert summary["lost_steps"] == 0 and summary["duplicate_steps"] == 0
    records = [r for r in trainer_records(run, "rollout/kept") if r["updates"] > 0]
    assert records, "no trained round reported"
    last = records[-1]
    # 5 epochs x 4 minibatches a round; every round after the first trains (the first acts
    # with the inference servers' own initial weights, an older version, and is dropped).
    assert last["updates"] >= 120 and last["updates"] % 20 == 0
    assert last["version"] >= last["updates"] // 20 + 1
    collect, envs, chunk_steps = 1024, 32, 8
    later = [r for r in records if r["version"] >= 3]  # the first rounds may mix in version 0
    assert later
    for r in later:
        # The round's steps of the version that trained, but each env's open chunk and the
        # step before it (whose next observation is in that chunk): those come with the
        # next round, a version late, and are dropped.
        assert r["rollout/kept"] >= collect - (chunk_steps + 1) * envs, r
        assert r["rollout/stale"] <= (chunk_steps + 1) * envs, r
        assert r["rollout/kept"] + r["rollout/stale"] == r["rollout/taken"]
        assert r["rollout/steps"] == r["rollout/kept"]
        assert r["rollout/linked_frac"] > 0.8
        assert r["skipped_updates"] == 0
    assert {"loss/policy", "loss/value", "entropy", "kl", "clip_frac"} <= set(last)
