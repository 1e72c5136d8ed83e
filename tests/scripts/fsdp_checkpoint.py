"""Run by tests/test_trainer_fsdp.py under torchrun (or alone): train, checkpoint, reload.

    torchrun --standalone --nproc_per_node=2 tests/scripts/fsdp_checkpoint.py save DIR OUT.json
    python tests/scripts/fsdp_checkpoint.py load DIR OUT.json

Writes the counters and a fingerprint of the full actor state dict to OUT.json (rank 0),
and exits non-zero if the process group's threads outlive ``shutdown()``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from networks.config import NetworkConfig
from sim_bridges.reach import ReachTask
from trainer import checkpoint
from trainer.algos import make_algorithm
from trainer.distributed import World, barrier, group_threads, init_distributed, shutdown
from trainer.publish import full_state_dict


def main() -> None:
    mode, directory, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    torch.set_num_threads(1)
    world = init_distributed(timeout_s=60)
    result = train_or_resume(mode, directory, world)
    if result is not None:
        out.write_text(json.dumps(result))
    # Both ranks tear the group down together, once the sharded networks are gone: a
    # group that outlives the interpreter can abort the process at exit.
    barrier()
    shutdown()
    left = group_threads()
    if left:
        sys.exit(f"the process group outlived shutdown(): threads {left} still run")


def train_or_resume(mode: str, directory: Path, world: World) -> dict[str, Any] | None:
    """Train and save, or resume; rank 0 returns the counters and state fingerprints."""
    spec = ReachTask().spec(max_episode_steps=50)
    torch.manual_seed(0)
    algo = make_algorithm("sac", spec, NetworkConfig(hidden_sizes=(32, 32)), {}, device=world.device)
    algo.shard(world)
    algo.build_optimizers()
    if mode == "save":
        g = torch.Generator().manual_seed(world.rank)
        n = 32
        for _ in range(4):
            b = {f"obs/{k}": torch.randn(n, *a.shape, generator=g) for k, a in spec.observation.items()}
            b.update(
                {f"next_obs/{k}": torch.randn(n, *a.shape, generator=g) for k, a in spec.observation.items()}
            )
            b.update(
                action=torch.rand(n, 3, generator=g) * 2 - 1,
                reward=torch.randn(n, generator=g),
                terminated=torch.zeros(n),
            )
            algo.update(b)
        counters = {"updates": 4, "version": 7, "samples": 4 * n * world.size}
        checkpoint.save(algo, directory, counters, is_main=world.is_main)
    else:
        counters = checkpoint.load(algo, checkpoint.latest(directory))
    actor = full_state_dict(algo.actor)
    everything = full_state_dict(algo.nets)
    if not world.is_main:  # the full state dicts are gathered on rank 0 only
        return None
    critic = {k: v for k, v in everything.items() if k.startswith("critic.")}
    return {
        "world": world.size,
        "sharded": any(hasattr(p, "to_local") for p in algo.actor.parameters()),
        "counters": counters,
        "actor": {k: float(v.astype("float64").sum()) for k, v in actor.items()},
        "critic": float(sum(v.astype("float64").sum() for v in critic.values())),
        "log_alpha": float(everything["log_alpha"][0]),
    }


if __name__ == "__main__":
    main()
