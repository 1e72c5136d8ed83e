"""Process groups and FSDP2 sharding, for one process or many (``torchrun``).

    world = init_distributed(timeout_s=60)          # reads torchrun's env, or world of 1
    shard(module, world)                            # fully_shard (bf16 params on CUDA)
    ...
    shutdown()

One code path for every case: a single process without torchrun still gets a (gloo)
process group of size 1, so FSDP2, DCP checkpoints and state-dict gathering behave the
same as with many. Collectives time out after ``timeout_s`` so a lost peer makes the
others fail fast instead of hanging.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

log = logging.getLogger(__name__)

# FSDP2 warns when a sharded module returns a view (the actor reshapes its action);
# loopgate's algorithms never modify a module's output in place, which is the hazard.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")


@dataclass(frozen=True)
class World:
    rank: int
    size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_distributed(*, device: str = "auto", timeout_s: float = 60.0) -> World:
    """Join (or create) the process group: NCCL on CUDA, gloo on CPU."""
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("trainer.device is cuda but no CUDA device is available")
    if "RANK" not in os.environ:  # not under torchrun: a group of one
        os.environ.update(
            {
                "RANK": "0",
                "WORLD_SIZE": "1",
                "LOCAL_RANK": "0",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(_free_port()),
            }
        )
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    backend = "nccl" if use_cuda else "gloo"
    if use_cuda:
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    world = World(rank, size, local_rank, dev, backend)
    log.info("process group: rank %d of %d on %s (%s)", rank, size, dev, backend)
    return world


def shard(module: nn.Module, world: World, methods: tuple[str, ...] = ()) -> nn.Module:
    """Apply FSDP2 ``fully_shard`` to ``module`` (bf16 compute with fp32 reduction on CUDA).

    ``methods`` are entry points besides ``forward`` (e.g. the actor's ``sample``) that
    must gather the parameters before they run.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    kwargs = {}
    if world.device.type == "cuda":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(module, **kwargs)
    for name in methods:
        register_fsdp_forward_method(module, name)
    return module


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
