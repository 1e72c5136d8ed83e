"""Run by tests/test_trainer_ppo.py in its own process: PPO trains, checkpoints, and a fresh
PPO resumes with the same actor, adaptive learning rate and round count.

    python tests/scripts/ppo_checkpoint.py DIR OUT.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from networks.config import NetworkConfig
from sim_bridges.reach import ReachTask
from trainer import checkpoint
from trainer.algos import Algorithm, make_algorithm
from trainer.distributed import World, init_distributed, shutdown
from trainer.publish import full_state_dict

SPEC = ReachTask().spec(max_episode_steps=50)


def build(world: World) -> Algorithm:
    torch.manual_seed(0)
    algo = make_algorithm(
        "ppo", SPEC, NetworkConfig(hidden_sizes=(32, 32)), {"lr": 3e-3}, device=world.device
    )
    algo.shard(world)
    algo.build_optimizers()
    return algo


def run(directory: Path, world: World) -> dict[str, object]:
    algo = build(world)
    n = 64
    obs = {f"obs/{k}": torch.randn(n, *a.shape) for k, a in SPEC.observation.items()}
    batch = {**obs, **{"next_" + k: v for k, v in obs.items()}, "action": torch.rand(n, 3) * 2 - 1}
    batch.update(
        reward=torch.randn(n),
        discount=torch.full((n,), 0.9),
        row=torch.arange(n),
        next_row=torch.arange(n) + 1,
    )
    for _ in range(3):
        algo.learn(batch)
    checkpoint.save(algo, directory, {"updates": 60, "version": 3, "samples": 0}, is_main=True)
    before = {"lr": algo.lr, "rounds": algo.rounds}  # type: ignore[attr-defined]
    actor = full_state_dict(algo.actor)
    del algo
    again = build(world)
    counters = checkpoint.load(again, checkpoint.latest(directory))
    after = {"lr": again.lr, "rounds": again.rounds}  # type: ignore[attr-defined]
    same = all(bool((actor[k] == v).all()) for k, v in full_state_dict(again.actor).items())
    return {"counters": counters, "before": before, "after": after, "same_actor": same}


def main() -> None:
    directory, out = Path(sys.argv[1]), Path(sys.argv[2])
    torch.set_num_threads(1)
    world = init_distributed(timeout_s=60)
    out.write_text(json.dumps(run(directory, world)))
    shutdown()


if __name__ == "__main__":
    main()
