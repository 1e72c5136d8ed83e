"""Run by tests/test_trainer_fsdp.py: publication snapshots in a group of one.

    python tests/scripts/one_rank_snapshot.py OUT.json

Writes, per module (an FSDP2-sharded actor, as a group of one on a GPU has it; a plain
one, as on the CPU; a compiled one), the snapshot's tensor names and
DCP's, whether the values match DCP's full state dict after a parameter change, whether
the second snapshot reused the first one's arrays without aliasing the parameters, and
which path the snapshot took.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gateway.factory import experiment_spec
from networks.config import NetworkConfig
from networks.modules import make_actor
from trainer import publish
from trainer.distributed import init_distributed, shutdown


def check(module: torch.nn.Module) -> dict[str, Any]:
    first = publish.full_state_dict(module)
    with torch.no_grad():
        for p in module.parameters():
            p.mul_(-2.0)  # what an optimizer step does in place
    second = publish.full_state_dict(module, first)
    reference = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    live = [p.to_local() if hasattr(p, "to_local") else p for p in module.parameters()]
    return {
        "names": sorted(second),
        "dcp_names": sorted(reference),
        "equal": all(np.array_equal(second[k], reference[k].numpy()) for k in reference),
        "reused": all(second[k] is first[k] for k in second),
        "aliased": any(np.shares_memory(v, p.detach().numpy()) for v in second.values() for p in live),
        "local_path": publish._LOCAL_IS_WHOLE.get(module),
    }


def main() -> None:
    world = init_distributed(timeout_s=60)
    spec = experiment_spec("mujoco_reach", {})
    net = NetworkConfig(hidden_sizes=(32, 32))
    sharded = make_actor(spec, net, seed=3)
    fully_shard(sharded)  # what trainer.distributed.shard does on a GPU
    plain = make_actor(spec, net, seed=4)
    compiled = torch.compile(torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh()))
    out = {
        "world": world.size,
        **{k: check(m) for k, m in [("sharded", sharded), ("plain", plain), ("compiled", compiled)]},
    }
    Path(sys.argv[1]).write_text(json.dumps(out))
    del sharded, plain, compiled
    shutdown()


if __name__ == "__main__":
    main()
